"""Tables 1 and 2 of the paper: every method on the same loop and budget, each student scored on the benchmarks of
its domain (paper §4.1-4.2, Tables 1-2, B.1, B.3).

    python -m scripts.experiments table1      # tool use at toy scale: the toy tool world's held-out tasks, 3 seeds
    python -m scripts.experiments table2      # code at toy scale: the toy code world (--env code, --out runs/code)
    python -m scripts.experiments table1 --model Qwen/Qwen3-4B --env envscaler --tasks DIR \\
        --benchmarks envscaler=DIR bfcl-v3 acebench=ACEBENCH_CLONE                 # Table 1's three benchmarks
    python -m scripts.experiments table2 --model Qwen/Qwen3-4B --tasks TACO_DIR \\
        --benchmarks lcb_v5.jsonl lcb_v6.jsonl HumanEvalPlus.jsonl MbppPlus.jsonl  # Table 2's, as released

Rows, in the paper's order: Vanilla (the unadapted backbone θ̄), GRPO, SDFT, OPSD, SDPO, Skill-SD, LOPD (train.py
--method grpo | sdft | opsd | sdpo | skillsd | lopd; B.1). Per seed every method trains from the same θ̄, bank and φ0
(`train.prepare`, cached in OUT/seedI) for the same budget, in Figure 4's folders and with Figure 4's settings
(scripts/experiments.py passes its `method_dir` and `CURVE` in `Runs`): figure4 and then table1 on one --out train
nothing twice. Any other flag after the table's name is train.py's.

Columns: each --benchmarks SPEC with its sub-columns, on the paper's 0-100 scale:
  heldout          the trained world's held-out split, scored in this process (`train.evaluate`): reward and full
                   pass, or pass@1 in a single-turn world. The default; under --env envscaler it is EnvScaler's
  envscaler=DIR    EnvScaler's 200 held-out tasks from its released files (worlds/envscaler.py), in this process
  bfcl-v3[:CATS]   BFCL-v3 multi-turn: each category's accuracy and their mean, BFCL's overall (eval.py)
  acebench=PATH    ACEBench's English agent tasks: M-Step, M-Turn and overall end-to-end accuracy (eval.py)
  FILE.jsonl       a code benchmark file (eval.py): pass@1; LiveCodeBench's releases under one heading and HumanEval+
                   and MBPP+ under EvalPlus, each heading with its "overall"
eval.py's benchmarks run in a process of their own on the row's folder (`python eval.py --run ROW --tasks SPEC`,
which scores the row's latest checkpoint, or θ̄ for Vanilla), and the table reads back the JSON file it wrote.

Resuming: each cell (method × seed × benchmark) is written atomically to ROW/cells/KEY_all.json (KEY_firstN.json
with --bench-tasks N) when done, and a rerun reads it back instead of scoring again; the joint stages continue
from their checkpoints (as a rerun of train.py does). A killed table continues from its finished cells; a finished
one is rewritten from them without loading a model; a larger --steps continues each run and scores it again.
Outputs: OUT/tableN.csv (one line per seed, row and column), tableN.md (mean ± std over seeds; per column the best in
bold, the second best in italic), tableN.png (green and light green, as the paper's captions say).

Deviations:
1. Our copy of the paper lacks the tables' cells. `PAPER` holds the values its text quotes, each with its source;
   those not quoted as a cell of the table (from Table 3 or Figures 4-5, derived from a margin the text quotes, or
   whose backbone the sentence leaves to the reader) are marked *. Everything else is "–".
2. The paper runs each row once on each backbone; here each cell is mean ± std over --seeds seeds of one backbone.
3. At toy scale the benchmarks are the toy worlds' held-out splits, on a 0.5 M-parameter backbone: the paper's
   values are shown in a block of their own (another backbone, other benchmarks). They go beside ours, in brackets,
   only for a backbone the paper ran (`paper_backbone`).
4. The training settings are Figure 4's (every 10 steps the student on 100 held-out tasks), so that the runs are
   shared; that evaluation changes no weight.

Choices the paper leaves open:
1. LiveCodeBench's aggregate of v5 and v6 and EvalPlus's of HumanEval+ and MBPP+: "overall" pools their problems
   (pass@1 over all of them), as ACEBench's overall does (worlds/results.py, `acebench_overall`).
2. ACEBench's user is the run's backbone unless --user-model (the paper: deepseek-v4-flash through an API).
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

import eval as ev
from runtime import checkpoints, devices
import train
from runtime.devices import UserError
from worlds import results, sandbox

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The paper's rows, in its order (§4.1 "Baselines"): the unadapted backbone, then train.py's --method of each
ROWS = ("vanilla", "grpo", "sdft", "opsd", "sdpo", "skillsd", "lopd")
LABELS = {"vanilla": "Vanilla", "grpo": "GRPO", "sdft": "SDFT", "opsd": "OPSD", "sdpo": "SDPO", "skillsd": "Skill-SD",
          "lopd": "LOPD"}
IN_PROCESS = ("heldout", "envscaler")          # scored here, with the student in memory; the others by eval.py
POOLED = ("LiveCodeBench", "EvalPlus")         # headings whose "overall" pools their files' problems
EVALPLUS = {"HumanEval+", "MBPP+"}


@dataclass(frozen=True)
class Table:
    """One of the paper's tables: its title, the benchmark kinds it takes, and the paper's backbones for it."""
    title: str
    kinds: tuple
    backbones: tuple


TABLES = {"table1": Table("Table 1, tool use", ("heldout", "envscaler", "bfcl", "acebench"), ("Qwen3-4B", "Qwen3-8B")),
          # §4.2's "ten backbone-benchmark comparisons" are 3 tool benchmarks × 2 backbones + 2 code aggregates × 2,
          # and it names Qwen3-4B and Olmo3-7B for code
          "table2": Table("Table 2, code", ("heldout", "code"), ("Qwen3-4B", "Olmo3-7B"))}

# ----------------------------------------------------------------------------------------------------------------
# The paper's values: what its text quotes (our copy lacks the tables' cells) and the cells the official README's
# results tables publish (bingreeky/LOPD: tool use with Qwen3-4B and Qwen3-8B, code with Qwen3-4B and
# OLMo3-7B-Think), 0-100, with where each comes from.
# {table: {backbone: {row: {(benchmark, column): (value, source)}}}}; a source other than "§4.2" is marked * in the
# tables (not quoted as a cell of this table by the paper's text). worlds/results.py holds some of them
# (tests/test_tables.py checks).
# ----------------------------------------------------------------------------------------------------------------
ENV, BFCL, ACE = ("EnvScaler", "reward"), ("BFCL-v3", "overall"), ("ACEBench", "overall")
LCB, EVP = ("LiveCodeBench", "overall"), ("EvalPlus", "overall")
HE, MBPP = ("EvalPlus", "HumanEval+"), ("EvalPlus", "MBPP+")
INFERRED = "§4.2, backbone inferred: the sentence names the pair, 'with Qwen3-8B' ends it"
README = "official README (bingreeky/LOPD), not in the paper's text"
STRONGEST = "§4.2's strongest baseline, GRPO by the official README (bingreeky/LOPD)"
PAPER = {
    "table1": {
        "Qwen3-4B": {
            "vanilla": {ENV: (48.6, "Table 3: vanilla reward 0.486; official README: 48.6"),
                        BFCL: (22.88, "§4.2"), ACE: (50.6, "§4.2")},   # "SDPO falls from 22.88 ... from 50.6 ..."
            # "it improves over the strongest competing method from 61.8 ... 25.25 ... 56.0" (Skill-SD ties the 56.0)
            "grpo": {ENV: (61.8, STRONGEST), BFCL: (25.25, STRONGEST), ACE: (56.0, STRONGEST)},
            "sdft": {ENV: (50.3, README), BFCL: (21.75, README), ACE: (50.0, README)},
            "opsd": {ENV: (51.2, README), BFCL: (25.13, README), ACE: (48.6, README)},
            "sdpo": {BFCL: (15.75, "§4.2"), ACE: (38.0, "§4.2")},
            "skillsd": {ENV: (59.1, README), BFCL: (24.63, README), ACE: (56.0, README)},
            "lopd": {ENV: (63.7, "§4.2"), BFCL: (27.38, "§4.2"), ACE: (60.6, "§4.2"),
                     ("ACEBench", "M-Step"): (56.6, "Figure 5 at n_ret = 3, which §4.3 says matches Table 1"),
                     ("ACEBench", "M-Turn"): (63.3, "Figure 5 at n_ret = 3, which §4.3 says matches Table 1")}},
        "Qwen3-8B": {
            # "gains ranging from 1.50 points on BFCL-v3 ... to 17.2 points on EnvScaler with the same backbone"
            "vanilla": {ENV: (49.2, "§4.2, derived: LOPD's 66.4 less its 17.2-point gain"), BFCL: (28.38, "§4.2"),
                        ("BFCL-v3", "long_context"): (22.00, INFERRED), ACE: (54.6, README)},
            # "compared with the strongest baseline results of 60.2/29.00/58.0": Skill-SD's 60.2, GRPO's 29.00, 58.0
            "grpo": {ENV: (57.3, README), BFCL: (29.00, STRONGEST), ACE: (58.0, STRONGEST)},
            # "LOPD exceeds OPSD, SDFT, and Skill-SD by 14.4/10.2/6.2 points on EnvScaler and 10.0/8.0/6.7 on ACEBench"
            "opsd": {ENV: (52.0, "§4.2, derived: 66.4 − 14.4"), BFCL: (25.75, "§4.2"),
                     ("BFCL-v3", "long_context"): (29.00, INFERRED), ACE: (52.7, "§4.2, derived: 62.7 − 10.0")},
            "sdft": {ENV: (56.2, "§4.2, derived: 66.4 − 10.2"), BFCL: (26.88, README),
                     ACE: (54.7, "§4.2, derived: 62.7 − 8.0")},
            "skillsd": {ENV: (60.2, "§4.2, derived: 66.4 − 6.2"), BFCL: (27.38, README),
                        ACE: (56.0, "§4.2, derived: 62.7 − 6.7")},
            "lopd": {ENV: (66.4, "§4.2"), BFCL: (29.88, "§4.2"), ACE: (62.7, "§4.2")}}},
    "table2": {
        # The README's code table: "LCB Avg" (our LiveCodeBench overall; every value is k/410, v5's 279 and v6's 131
        # problems pooled), HumanEval+ and MBPP+ (none for OPSD or SDPO), and no EvalPlus aggregate: §4.2's LOPD
        # 81.36 and 78.41 are its HumanEval+ and MBPP+ pooled over 164 + 378 problems
        "Qwen3-4B": {"vanilla": {LCB: (45.61, "§4.2"), HE: (85.37, README), MBPP: (75.93, README)},
                     "grpo": {LCB: (48.29, README), HE: (86.59, README), MBPP: (76.19, README)},
                     "sdft": {LCB: (47.07, README), HE: (87.20, README), MBPP: (76.98, README)},
                     "opsd": {LCB: (40.24, "§4.2")}, "sdpo": {LCB: (38.78, "§4.2")},
                     "lopd": {LCB: (48.78, "§4.2"), EVP: (81.36, "§4.2"), HE: (87.80, README),
                              MBPP: (78.57, README)}},
        "Olmo3-7B": {  # "on LiveCodeBench with both backbones (40.24 vs. 45.61 and 44.39 vs. 46.34)": Table 2's other
            # (the README's OLMo3-7B-Think); §4.2: "outperforming the strongest alternatives by 2.69 and 0.55 points"
            "vanilla": {LCB: (46.34, "§4.2, backbone inferred: Table 2's second backbone; official README: 46.34"),
                        HE: (86.59, README), MBPP: (70.37, README)},
            "grpo": {LCB: (48.29, "§4.2, derived: LOPD's 50.98 less its 2.69-point lead over the strongest "
                                  "alternative, GRPO by the official README (48.29)"),
                     HE: (89.02, README), MBPP: (72.75, README)},
            "sdft": {LCB: (46.58, README), HE: (89.02, README), MBPP: (73.02, README),
                     EVP: (77.86, "§4.2, derived: LOPD's 78.41 less its 0.55-point lead over the strongest "
                                  "alternative, SDFT by the official README (its HumanEval+ and MBPP+ pooled: 77.86)")},
            "opsd": {LCB: (44.39, "§4.2, backbone inferred: Table 2's second backbone")},
            "lopd": {LCB: (50.98, "§4.2"), EVP: (78.41, "§4.2"), HE: (90.24, README), MBPP: (73.28, README)}}},
}


@dataclass(frozen=True)
class Runs:
    """What a table takes from scripts/experiments.py (which imports this file, so this file cannot import it):
    the folder of a method's run inside a seed's folder and the training settings, both Figure 4's, so that the two
    share their runs; and matplotlib's pyplot (a function giving it, or None with a message)."""
    method_dir: Callable[[str, str], str]
    curve: dict
    pyplot: Callable


@dataclass(frozen=True)
class Bench:
    """One --benchmarks SPEC: its kind, its heading (code files: "", the heading comes from the file's rows), the
    name of its cells' file, and for eval.py the spec with absolute paths (it runs from the repository's root)."""
    spec: str
    kind: str               # heldout | envscaler | bfcl | acebench | code
    heading: str
    key: str
    target: str = ""        # envscaler: the release's folder (or hf); the others: eval.py's --tasks value


@dataclass(frozen=True)
class Options:
    """How the students are scored: the first n_tasks tasks of each benchmark (0 = all), ACEBench's user model."""
    n_tasks: int = 0
    user_model: str = ""


# ----------------------------------------------------------------------------------------------------------------
# The command: benchmarks, then per seed per row its cells, then the table
# ----------------------------------------------------------------------------------------------------------------
def train_argv(name: str, argv: list) -> list:
    """train.py's flags for a table: Table 2 trains on the code world (--env code) in runs/code unless told."""
    given = {a.split("=")[0] for a in argv}
    defaults = {"--env": "code", "--out": "runs/code"} if name == "table2" else {}
    return [x for flag, value in defaults.items() if flag not in given for x in (flag, value)] + argv


def table(name: str, args: train.Args, runs: Runs, seeds: int = 3, *, specs=None, opts: Options = Options()):
    """`python -m scripts.experiments table1|table2`: every row × seed × benchmark, then OUT/NAME.csv, .md, .png.
    -> the CSV's lines as dicts (row, seed, heading, column, value 0-100, tasks)."""
    args = dataclasses.replace(args, model=args.model or train.toy_backbone(args), **runs.curve)
    benches = [parse_bench(s, name, args) for w in (specs or ["heldout"]) for s in w.split()]
    headings = [b.heading for b in benches if b.kind != "code"]          # code files share theirs on purpose
    if len({b.key for b in benches}) < len(benches) or len(set(headings)) < len(headings):
        raise UserError(f"--benchmarks {' '.join(b.spec for b in benches)}: a benchmark is named twice (under "
                        "--env envscaler, heldout is EnvScaler's held-out split)")
    check_methods(args)
    rows = []                                        # one dict per seed, row, column
    for i in range(seeds):
        seeded = dataclasses.replace(args, seed=args.seed + i, out=os.path.join(args.out, f"seed{args.seed + i}"))
        for row, cols in table_seed(seeded, benches, runs, opts).items():
            rows += [dict(row=row, seed=seeded.seed, heading=h, column=c, value=v, tasks=n) for h, c, v, n in cols]
    backbone = paper_backbone(name, args.model)
    write_csv(os.path.join(args.out, f"{name}.csv"), rows)
    md = markdown(name, rows, args, backbone)
    with checkpoints.atomic_open(os.path.join(args.out, f"{name}.md")) as f:
        f.write(md)
    print("\n" + md)
    plot_table(name, rows, backbone, os.path.join(args.out, f"{name}.png"), runs.pyplot)
    return rows


def parse_bench(spec: str, name: str, args: train.Args) -> Bench:
    """One --benchmarks SPEC -> its Bench, checked before any training (a bad one is one line now, not hours later)."""
    if spec == "heldout":
        heading = "EnvScaler" if args.env == "envscaler" else f"held-out ({args.env})"
        bench = Bench(spec, "heldout", heading, "heldout")
    elif spec.startswith("envscaler="):
        folder = spec.removeprefix("envscaler=")
        folder = folder if folder == "hf" else os.path.abspath(folder)
        bench = Bench(spec, "envscaler", "EnvScaler", "envscaler", folder)
    elif ev.bfcl_categories(spec) is not None:      # bfcl-v3, bfcl-v3:single, bfcl-v3:CAT[,CAT] (unknown: one line)
        bench = Bench(spec, "bfcl", "BFCL-v3", spec.replace(":", "_").replace(",", "-"), spec)
    elif spec.startswith("acebench="):
        from worlds import acebench
        path, regimes = acebench.parse_spec(spec)
        tail = "" if list(regimes) == list(acebench.REGIMES) else ":" + ",".join(regimes)
        bench = Bench(spec, "acebench", "ACEBench", "acebench" + tail.replace(":", "_").replace(",", "-"),
                      f"acebench={os.path.abspath(path)}{tail}")
    elif os.path.isfile(spec):
        bench = Bench(spec, "code", "", os.path.splitext(os.path.basename(spec))[0], os.path.abspath(spec))
    else:
        raise UserError(f"--benchmarks {spec!r}: expected heldout, envscaler=DIR, bfcl-v3[:CATS], acebench=PATH or a "
                        "benchmark file (JSONL)")
    if bench.kind not in TABLES[name].kinds:
        raise UserError(f"--benchmarks {spec!r}: {name} takes {', '.join(TABLES[name].kinds)} benchmarks")
    check_bench(bench, args)
    return bench


def check_bench(bench: Bench, args: train.Args):
    """What each kind needs, now: EnvScaler's files and the sandbox, bfcl-eval, ACEBench's clone, the confinement
    every eval.py benchmark asks for (worlds/sandbox.py)."""
    if bench.kind == "envscaler":
        eargs = dataclasses.replace(args, env="envscaler", tasks=bench.target)
        if train.environment(eargs).check_args(eargs):
            raise UserError(f"--benchmarks {bench.spec}: {train.environment(eargs).check_args(eargs)}")
        sandbox.require_for(train.environment(eargs), args.unsafe_no_sandbox, f"--benchmarks {bench.spec}")
    if bench.kind == "bfcl":
        from worlds import bfcl
        bfcl.package_dir()
    if bench.kind == "acebench":
        from worlds import acebench
        acebench.load_tasks(*acebench.parse_spec(bench.target))
    if bench.kind not in IN_PROCESS:
        sandbox.check_confinement(f"--benchmarks {bench.spec}")


def check_methods(args: train.Args):
    """Each row's settings must run: a method that rolls out groups needs --rollouts-per-step a multiple of G."""
    for method in ROWS[1:]:
        margs = dataclasses.replace(args, method=method)
        if train.rollouts_per_task(margs) > 1 and args.rollouts_per_step % margs.group:
            raise UserError(f"--rollouts-per-step {args.rollouts_per_step} must be a multiple of --group "
                            f"{margs.group} for {LABELS[method]}")
        if train.METHODS[method].keeps_ema and args.student_lora:
            raise UserError(f"{LABELS[method]} keeps an EMA copy of a full student: the tables do not take "
                            "--student-lora")


def table_seed(args: train.Args, benches: list, runs: Runs, opts: Options) -> dict:
    """One seed: per row its finished cells read back, the others scored (the seed's stages 1-4 loaded only then).
    -> {row: [(heading, column, value 0-100, tasks)]}, with the pooled "overall" of POOLED headings."""
    out, run = {}, None
    for row in ROWS:
        folder, steps = runs.method_dir(args.out, row), 0 if row == "vanilla" else args.steps
        cells = {b.key: read_cell(folder, b, opts, steps) for b in benches}
        todo = [b for b in benches if cells[b.key] is None]
        if todo:
            run = run or train.prepare(args)
            cells.update(row_cells(args, run, row, todo, runs, opts))
        out[row] = pooled([c for b in benches for c in cells[b.key]])
    return out


def row_cells(args: train.Args, run, row: str, todo: list, runs: Runs, opts: Options) -> dict:
    """A row's missing cells: its student trained (or resumed: a finished run trains no step) from the seed's θ̄,
    bank and φ0, Vanilla's none; the in-process benchmarks while the student is in memory, then eval.py's on its
    checkpoint. Each cell is written as soon as it is scored. -> {key: columns}."""
    student, rargs = train_row(args, run, row, runs) if row != "vanilla" else (
        None, dataclasses.replace(args, out=runs.method_dir(args.out, row)))
    os.makedirs(rargs.out, exist_ok=True)
    checkpoints.write_json(os.path.join(rargs.out, "args.json"), dataclasses.asdict(rargs))   # what eval.py --run reads
    done = {}
    for bench in sorted(todo, key=lambda b: b.kind not in IN_PROCESS):
        if bench.kind not in IN_PROCESS and student is not None:       # eval.py loads its own copy of the student
            student = None
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        done[bench.key] = evaluate_cell(bench, rargs, run, student, opts)
        write_cell(rargs.out, bench, opts, 0 if row == "vanilla" else rargs.steps, done[bench.key])
    return done


def train_row(args: train.Args, run, method: str, runs: Runs):
    """The method's joint stage from the seed's θ̄, bank and φ0, in Figure 4's folder, resumed from its checkpoint
    (as `figure4_seed` runs it). -> (the student θ, the row's settings)."""
    margs = dataclasses.replace(args, method=method, out=runs.method_dir(args.out, method), resume=True)
    os.makedirs(margs.out, exist_ok=True)
    checkpoints.reset_composer(run.composer, os.path.join(args.out, "composer0"))     # φ0 for every method
    student = None if run.student is None else run.student.reset()                 # θ = θ̄ (a LoRA student)
    joint = dataclasses.replace(run, args=margs, student=student, log=devices.Log(margs.out, margs.tensorboard))
    return train.joint_training(joint), margs


# ----------------------------------------------------------------------------------------------------------------
# A cell: one row's student on one benchmark, written atomically and read back
# ----------------------------------------------------------------------------------------------------------------
def cell_path(folder: str, bench: Bench, opts: Options) -> str:
    """ROW/cells/KEY_<all|firstN>.json, as eval.py names a split."""
    return os.path.join(folder, "cells", f"{bench.key}_{f'first{opts.n_tasks}' if opts.n_tasks else 'all'}.json")


def read_cell(folder: str, bench: Bench, opts: Options, steps: int):
    """A finished cell's columns, or None: none yet, or one of another benchmark under the same name, or of a
    student after another number of steps (a larger --steps continues the run from its checkpoint, then scores)."""
    path = cell_path(folder, bench, opts)
    if not os.path.isfile(path):
        return None
    cell = json.load(open(path))
    same = cell["spec"] == (bench.target or bench.spec) and cell["steps"] == steps
    return [tuple(c) for c in cell["columns"]] if same else None


def write_cell(folder: str, bench: Bench, opts: Options, steps: int, columns: list):
    """ROW/cells/KEY_<split>.json, atomically: the spec, the student's steps (Vanilla: 0) and the columns."""
    os.makedirs(os.path.join(folder, "cells"), exist_ok=True)
    checkpoints.write_json(cell_path(folder, bench, opts), {"spec": bench.target or bench.spec, "steps": steps,
                                                        "columns": columns})


def evaluate_cell(bench: Bench, rargs: train.Args, run, student, opts: Options) -> list:
    """One row (the student, or θ̄ when `student` is None and the row is Vanilla) on one benchmark.
    -> [(heading, column, value 0-100, tasks)]."""
    if bench.kind in IN_PROCESS:
        return heldout_columns(bench, rargs, run, student, opts)
    return eval_py_columns(bench, run_eval_py(bench, rargs, opts))


def heldout_columns(bench: Bench, rargs: train.Args, run, student, opts: Options) -> list:
    """The trained world's held-out split (run.test), or EnvScaler's from --benchmarks envscaler=DIR, rolled out
    here by `train.evaluate`: reward and full pass ×100, or pass@1 for a single-turn world."""
    eargs = rargs
    if bench.kind == "envscaler":                   # its split is recorded beside the row, never in the seed's folder
        eargs = dataclasses.replace(rargs, env="envscaler", tasks=bench.target,
                                    out=os.path.join(rargs.out, "envscaler"))
    tasks = run.test if bench.kind == "heldout" else train.load_splits(eargs, record=True)[1]
    tasks = tasks[:opts.n_tasks] if opts.n_tasks else tasks
    which = ("vanilla",) if student is None else ("student",)
    m = next(iter(train.evaluate(eargs, run, student, tasks, which=which).values()))
    if train.environment(eargs).results == "pass@1":
        return [(bench.heading, "pass@1", 100 * m["reward"], len(tasks))]
    return [(bench.heading, "reward", 100 * m["reward"], len(tasks)),
            (bench.heading, "full pass", 100 * m["full_pass"], len(tasks))]


def run_eval_py(bench: Bench, rargs: train.Args, opts: Options) -> dict:
    """`python eval.py --run ROW --tasks SPEC` in a process of its own (its copy of the model goes with it) -> the
    JSON file it wrote into ROW (the one new one: eval.py never writes over an earlier result)."""
    before = set(glob.glob(os.path.join(rargs.out, "*.json")))
    cmd = [sys.executable, "eval.py", "--run", rargs.out, "--tasks", bench.target, "--engine", rargs.engine,
           *(["--n-test", str(opts.n_tasks)] if opts.n_tasks else []),
           *(["--user-model", opts.user_model] if opts.user_model and bench.kind == "acebench" else []),
           *(["--unsafe-no-sandbox"] if rargs.unsafe_no_sandbox else [])]
    rc = subprocess.run(cmd, cwd=ROOT).returncode
    new = sorted(set(glob.glob(os.path.join(rargs.out, "*.json"))) - before)
    if rc or len(new) != 1:
        raise UserError(f"{' '.join(cmd)}: exit status {rc}, wrote {', '.join(new) or 'no result'}")
    return json.load(open(new[0]))


def eval_py_columns(bench: Bench, result: dict) -> list:
    """eval.py's rows as columns ×100: BFCL-v3's categories and their mean (BFCL's overall), ACEBench's regimes and
    overall (end-to-end), a code file's pass@1 (`code_column`)."""
    rows = result["rows"]
    if bench.kind == "bfcl":
        cols = [(bench.heading, r["category"], 100 * r["accuracy"], r["tasks"]) for r in rows]
        return cols + [(bench.heading, "overall", float(np.mean([c[2] for c in cols])), sum(c[3] for c in cols))]
    if bench.kind == "acebench":
        return [(bench.heading, results.ACEBENCH_LABELS[r["regime"]], 100 * r["end_to_end"], r["tasks"])
                for r in rows]
    return [(*code_column(r["benchmark"], bench.key), 100 * r["pass@1"], r["problems"]) for r in rows]


def code_column(benchmark: str, stem: str) -> tuple:
    """A code benchmark's (heading, column): HumanEval+ and MBPP+ under EvalPlus, LiveCodeBench's releases named by
    their files (lcb_v5), any other (TACO; ours: named by its file) its pass@1."""
    if benchmark in EVALPLUS:
        return "EvalPlus", benchmark
    if benchmark == "LiveCodeBench":
        return benchmark, stem
    return (stem if benchmark == "ours" else benchmark), "pass@1"


def pooled(columns: list) -> list:
    """The columns with, after each POOLED heading's, its "overall": pass@1 over all its problems."""
    out = []
    for heading in dict.fromkeys(c[0] for c in columns):
        part = [c for c in columns if c[0] == heading]
        out += part
        if heading in POOLED:
            n = sum(c[3] for c in part)
            out.append((heading, "overall", sum(c[2] * c[3] for c in part) / max(1, n), n))
    return out


# ----------------------------------------------------------------------------------------------------------------
# The table: mean ± sample std over seeds, the best and second best per column, the paired gaps, the paper's values
# ----------------------------------------------------------------------------------------------------------------
# Statistics over seeds. A cell is the mean and the SAMPLE standard deviation s (ddof = 1: with 3 seeds the
# population std understates the spread by a factor √(2/3)). At the end of the curves, the 95% interval of a mean,
#     mean ± t(0.975, n − 1) · s / √n,
# and, for two methods run on the same seeds (the same θ̄, tasks and bank), of their paired per-seed difference.
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def sample_std(vals) -> float:
    """s with ddof = 1 (0 for one value)."""
    return float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0


def interval(vals) -> tuple:
    """(mean, s, half-width of the 95% t interval) over seeds; the half-width is nan for one seed. Beyond 11 seeds
    t is taken as 2.228 (df = 10), a slight overstatement."""
    n = len(vals)
    half = T975[min(n - 1, 10)] * sample_std(vals) / np.sqrt(n) if n > 1 else float("nan")
    return float(np.mean(vals)), sample_std(vals), float(half)


def summarize(rows: list) -> tuple:
    """-> ([(heading, column)] in order, {row: {(heading, column): (mean, sample std) over the seeds}})."""
    columns = list(dict.fromkeys((r["heading"], r["column"]) for r in rows))
    summary = {}
    for row in dict.fromkeys(r["row"] for r in rows):
        vals = {c: [r["value"] for r in rows if r["row"] == row and (r["heading"], r["column"]) == c] for c in columns}
        summary[row] = {c: (float(np.mean(v)), sample_std(v)) for c, v in vals.items() if v}
    return columns, summary


def paired_gaps(rows: list, against=("grpo", "skillsd")) -> list:
    """Lines "LOPD − GRPO, heading: column: mean ± s, 95% interval [lo, hi] (side)" per column, each over the seeds
    both rows scored (paired: same θ̄, tasks and bank per seed); none with fewer than 2 seeds."""
    out = []
    for other in [o for o in against if any(r["row"] == o for r in rows) and any(r["row"] == "lopd" for r in rows)]:
        for h, c in dict.fromkeys((r["heading"], r["column"]) for r in rows):
            cell = {(r["row"], r["seed"]): r["value"] for r in rows if (r["heading"], r["column"]) == (h, c)}
            seeds = sorted({s for (row, s) in cell if row == "lopd"} & {s for (row, s) in cell if row == other})
            if len(seeds) < 2:
                continue
            mean, s, half = interval([cell["lopd", k] - cell[other, k] for k in seeds])
            side = ("above 0: LOPD ahead" if mean - half > 0 else "below 0: LOPD behind" if mean + half < 0
                    else "contains 0: not separated")
            out.append(f"LOPD − {LABELS[other]}, {h}: {c}: {mean:+.1f} ± {s:.1f} over {len(seeds)} seeds, 95% "
                       f"interval [{mean - half:+.1f}, {mean + half:+.1f}] ({side}).")
    return out


def ranks(summary: dict, column) -> dict:
    """{row: "best" | "second"} for one column: the rows at its highest mean (ties share it), then those at the
    next highest; higher is better in every column of both tables."""
    means = {row: round(s[column][0], 9) for row, s in summary.items() if column in s}
    levels = sorted(set(means.values()), reverse=True)[:2]
    return {row: ("best", "second")[levels.index(m)] for row, m in means.items() if m in levels}


def paper_backbone(name: str, model: str) -> str | None:
    """The paper's backbone that --model is (Qwen/Qwen3-4B, a folder named Qwen3-8B...), or None."""
    norm = lambda s: "".join(ch for ch in s.lower() if ch.isalnum())                 # noqa: E731
    return next((b for b in TABLES[name].backbones if norm(b) in norm(os.path.basename(model.rstrip("/")))), None)


def quoted_columns(name: str, backbone) -> set:
    """The (benchmark, column)s for which the paper quotes a value of `backbone` (none for None)."""
    return {c for by_row in PAPER[name].get(backbone, {}).values() for c in by_row}


def paper_cell(name: str, backbone: str, row: str, column) -> str:
    """A paper value as the paper writes it (two decimals for BFCL-v3 and the code benchmarks, one elsewhere):
    "22.88", "48.6*" (not quoted as this table's cell), or "–"."""
    value, source = PAPER[name].get(backbone, {}).get(row, {}).get(column, (None, ""))
    decimals = 2 if column[0] in ("BFCL-v3", *POOLED) else 1
    return "–" if value is None else f"{value:.{decimals}f}" + ("" if source == "§4.2" else "*")


def markdown(name: str, rows: list, args: train.Args, backbone) -> str:
    """The table: a line per row, a column per (benchmark, column), mean ± std; the best bold, the second italic.
    The paper's values beside ours in brackets for one of its backbones, else in a block below (`paper_block`)."""
    columns, summary = summarize(rows)
    marks, quoted = {c: ranks(summary, c) for c in columns}, quoted_columns(name, backbone)
    who = "the toy backbone" if train.is_toy(args) else os.path.basename(args.model.rstrip("/"))
    seeds = len({r["seed"] for r in rows})
    world = f"--env {args.env}" + (f" --shops {args.shops}" if getattr(args, "shops", 0) else "")
    lines = [f"{TABLES[name].title}: {who}, {world}, {seeds} seed{'s' * (seeds > 1)}; 0-100, mean ± sample std "
             "over seeds; per column **best**, *second best*" +
             (f"; the paper's {backbone} values in brackets" if backbone else ""), "",
             "| method | " + " | ".join(f"{h}: {c}" for h, c in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for row, s in summary.items():
        cells = []
        for c in columns:
            text = f"{s[c][0]:.1f} ± {s[c][1]:.1f}" if c in s else "–"
            text = {"best": f"**{text}**", "second": f"*{text}*"}.get(marks[c].get(row), text)
            cells.append(text + (f" ({paper_cell(name, backbone, row, c)})" if c in quoted else ""))
        lines.append(f"| {LABELS[row]} | " + " | ".join(cells) + " |")
    gaps = paired_gaps(rows)
    return "\n".join(lines) + "\n\n" + ("\n".join(gaps) + "\n\n" if gaps else "") + paper_block(name, backbone) + "\n"


def paper_block(name: str, backbone) -> str:
    """The paper's values, one line per (backbone, benchmark, column) it quotes and a column per row, for a
    backbone other than the paper's (marked *: its source); only the sources of the starred ones for the paper's."""
    shown = [backbone] if backbone else list(TABLES[name].backbones)
    keys = [(b, c) for b in shown for c in dict.fromkeys(c for by_row in PAPER[name][b].values() for c in by_row)]
    starred = [f"{b} {LABELS[row]} {h}: {c}: {src}" for b in shown for row, by in PAPER[name][b].items()
               for (h, c), (_, src) in by.items() if src != "§4.2"]
    notes = "* not quoted as a cell of the table: " + "; ".join(starred) + "." if starred else ""
    if backbone:
        return notes + "\n"
    lines = ["The paper's values (another backbone and the paper's benchmarks: not comparable with the rows above; "
             "our copy of the paper lacks the table's cells, these are what its text quotes or the official README "
             "publishes, each source below; – where neither gives one):",
             "", "| paper | " + " | ".join(LABELS[r] for r in ROWS) + " |", "|---" * (len(ROWS) + 1) + "|"]
    lines += [f"| {b} {h}: {c} | " + " | ".join(paper_cell(name, b, r, (h, c)) for r in ROWS) + " |"
              for b, (h, c) in keys]
    return "\n".join(lines) + "\n\n" + notes + "\n"


def write_csv(path: str, rows: list):
    """One line per seed, row and column: row,seed,benchmark,column,value (0-100),tasks."""
    with checkpoints.atomic_open(path) as f:
        f.write("row,seed,benchmark,column,value,tasks\n")
        f.writelines(f'{r["row"]},{r["seed"]},"{r["heading"]}","{r["column"]}",{r["value"]:.4f},{r["tasks"]}\n'
                     for r in rows)


def plot_table(name: str, rows: list, backbone, path: str, pyplot: Callable):
    """The table as a picture: the best cell of each column green, the second light green (the paper's captions);
    for a backbone the paper did not run, its values in a second table below. Skipped with a message without
    matplotlib."""
    plt = pyplot()
    if plt is None:
        return
    columns, summary = summarize(rows)
    marks, quoted = {c: ranks(summary, c) for c in columns}, quoted_columns(name, backbone)
    colour = {"best": "#63be7b", "second": "#c6efce"}
    text = [[f"{s[c][0]:.1f} ± {s[c][1]:.1f}" + (f" ({paper_cell(name, backbone, row, c)})" if c in quoted else "")
             if c in s else "–" for c in columns] for row, s in summary.items()]
    fills = [[colour.get(marks[c].get(row), "white") for c in columns] for row in summary]
    keys = [] if backbone else [(b, c) for b in TABLES[name].backbones
                                for c in dict.fromkeys(c for by in PAPER[name][b].values() for c in by)]
    fig, axes = plt.subplots(2 if keys else 1, 1, squeeze=False, figsize=(2.5 + 1.5 * max(len(columns), 5),
                             0.3 * (len(summary) + len(keys)) + 1.2 + 0.6 * bool(keys)),
                             height_ratios=[len(summary) + 1] + ([len(keys) + 1] if keys else []))
    draw = lambda ax, cells, rows_, cols, fill=None: ax.table(   # noqa: E731
        cellText=cells, cellColours=fill, rowLabels=rows_, colLabels=cols, loc="center", cellLoc="center")
    grids = [draw(axes[0][0], text, [LABELS[r] for r in summary], [f"{h}\n{c}" for h, c in columns], fills)]
    axes[0][0].set_title(f"{TABLES[name].title} (mean ± sample std over seeds; green: best, light green: second)",
                        fontsize=9)
    if keys:
        grids.append(draw(axes[1][0], [[paper_cell(name, b, r, c) for r in ROWS] for b, c in keys],
                          [f"{b} {h}: {c}" for b, (h, c) in keys], [LABELS[r] for r in ROWS]))
        axes[1][0].set_title("the paper's values (another backbone, its benchmarks; * not quoted as a cell)",
                             fontsize=9)
    for ax, grid in zip((a[0] for a in axes), grids):
        ax.axis("off")
        grid.auto_set_font_size(False)
        grid.set_fontsize(7)
        grid.scale(1, 1.4)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    print(f"plot: {path}")
