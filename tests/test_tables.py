"""Tables 1 and 2 in one command each (scripts/tables.py, `python -m scripts.experiments table1|table2`).

Run: python -m pytest tests/test_tables.py -q      (2-3 minutes on 2 cores; the SmolLM2 tier's test 4-8 more)

At tiny size on the shipped toy backbone (30 training tasks, 8 held-out, 2 steps a method, 2 seeds) table1 is
stopped after its fifth cell, rerun to the end and rerun again: the rerun scores only the cells not finished, its
joint stages resume from their checkpoints (no step twice), and the third run loads no model. The finished table
has every row and column, and its best and second best per column are those of a brute-force computation on the CSV.
The paper's values agree with the ones worlds/results.py keeps (Table 1's GRPO and Skill-SD cells are §4.2's and
the official README's, not Figure 4's curves); a bad --benchmarks spec is one line
before anything trains; table2 on the toy code world; SmolLM2 (the real-model tier) through the command with
BFCL-v3 where bfcl-eval is installed.
"""
import collections
import importlib.util
import itertools
import json
import os
import shutil
import sys
import types

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from scripts import experiments, tables  # noqa: E402
import train  # noqa: E402
from worlds import results  # noqa: E402

TINY = ["--n-train", "30", "--n-test", "8", "--bank-threshold", "0.0", "--cold-steps", "2", "--steps", "2",
        "--rollouts-per-step", "4", "--micro-batch", "2", "--latents", "2", "--save-every", "1",
        "--max-new-tokens", "32", "--lr", "3e-3"]
LABELS = ["Vanilla", "GRPO", "SDFT", "OPSD", "SDPO", "Skill-SD", "LOPD"]


class Stopped(Exception):
    """Raised in place of the sixth cell's scoring: the table killed partway."""


def counted(real, calls: list, stop_after: int | None = None):
    """`real` (tables.evaluate_cell, train.prepare), recording each call's (row folder, seed, benchmark) in
    `calls`; with stop_after, Stopped once that many calls have run."""
    def wrapper(*a, **kw):
        if stop_after is not None and len(calls) == stop_after:
            raise Stopped
        bench, rargs = (a[0], a[1]) if a and isinstance(a[0], tables.Bench) else (None, a[0])
        calls.append((os.path.basename(rargs.out), rargs.seed, bench.key if bench else None))
        return real(*a, **kw)
    return wrapper


@pytest.fixture(scope="module")
def toy_table(tmp_path_factory):
    """table1 at tiny size: stopped after five cells, rerun (counting the cells it scores and the joint stages it
    steps), then rerun again (counting the stages 1-4 it loads)."""
    out = str(tmp_path_factory.mktemp("table1"))
    argv = ["table1", "--seeds", "2", "--out", out, *TINY]
    calls, cell = collections.defaultdict(list), tables.evaluate_cell
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tables, "evaluate_cell", counted(cell, calls["killed"], stop_after=5))
        with pytest.raises(Stopped):
            experiments.main(argv)
        mp.setattr(tables, "evaluate_cell", counted(cell, calls["rerun"]))
        experiments.main(argv)
        mp.setattr(tables, "evaluate_cell", counted(cell, calls["again"]))
        mp.setattr(train, "prepare", counted(train.prepare, calls["again_prepare"]))
        experiments.main(argv)
    return dict(out=out, calls=calls)


def read_csv(path: str) -> list[dict]:
    """tables.write_csv's lines: row, seed, benchmark, column, value, tasks (the quoted fields unquoted)."""
    lines = open(path).read().splitlines()
    keys = lines[0].split(",")
    return [dict(zip(keys, [f.strip('"') for f in line.split(",")])) for line in lines[1:]]


def markdown_cells(md: str) -> dict:
    """{(row label, column header): cell text} of the first table in a markdown text."""
    text = md.splitlines()
    start = next(i for i, line in enumerate(text) if line.startswith("|"))
    lines = list(itertools.takewhile(lambda line: line.startswith("|"), text[start:]))
    head = [h.strip() for h in lines[0].strip("|").split("|")]
    return {(cells[0], h): c for line in lines[2:] for cells in [[c.strip() for c in line.strip("|").split("|")]]
            for h, c in zip(head[1:], cells[1:])}


def brute_force_marks(lines: list[dict]) -> dict:
    """{(row label, column header): "best" | "second"} computed here from the CSV's per-seed values: the mean over
    seeds of each row and column, every row at the highest mean best, every row at the next highest second."""
    means = collections.defaultdict(list)
    for r in lines:
        means[(tables.LABELS[r["row"]], f"{r['benchmark']}: {r['column']}")].append(float(r["value"]))
    marks = {}
    for col in {c for _, c in means}:
        ranked = sorted({round(float(np.mean(v)), 3) for (_, c), v in means.items() if c == col}, reverse=True)
        for (row, c), v in means.items():
            m = round(float(np.mean(v)), 3)
            if c == col and m in ranked[:2]:
                marks[(row, c)] = "best" if m == ranked[0] else "second"
    return marks


def mark_of(cell: str) -> str | None:
    return "best" if cell.startswith("**") else "second" if cell.startswith("*") else None


# ------------------------------------------------------------------------------------------------------------
def test_the_toy_table_has_every_row_and_column_and_marks_the_best_two(toy_table):
    out = toy_table["out"]
    lines = read_csv(os.path.join(out, "table1.csv"))
    cols = ["held-out (tools): reward", "held-out (tools): full pass"]
    assert {(r["row"], r["seed"]) for r in lines} == {(row, s) for row in tables.ROWS for s in ("0", "1")}
    assert all(0.0 <= float(r["value"]) <= 100.0 and r["tasks"] == "8" for r in lines)
    md = open(os.path.join(out, "table1.md")).read()
    assert "| method | " + " | ".join(cols) + " |" in md
    cells = markdown_cells(md)
    assert sorted({row for row, _ in cells}, key=LABELS.index) == LABELS and {c for _, c in cells} == set(cols)
    marks = brute_force_marks(lines)
    assert {k: mark_of(v) for k, v in cells.items() if mark_of(v)} == marks
    assert any(m == "best" for m in marks.values())
    # mean ± sample std over the two seeds, as the CSV gives them (two values: |a − b| / √2)
    vals = [float(r["value"]) for r in lines if r["row"] == "lopd" and r["column"] == "reward"]
    assert cells[("LOPD", cols[0])].strip("*") == f"{np.mean(vals):.1f} ± {abs(vals[0] - vals[1]) / 2 ** 0.5:.1f}"
    # the paper's values, in a block of their own at toy scale (another backbone)
    assert "The paper's values (another backbone" in md
    assert "| Qwen3-4B BFCL-v3: overall | 22.88 | 25.25* | 21.75* | 25.13* | 15.75 | 24.63* | 27.38 |" in md
    assert "| Qwen3-4B EnvScaler: reward | 48.6* | 61.8* | 50.3* | 51.2* | – | 59.1* | 63.7 |" in md
    assert os.path.isfile(os.path.join(out, "table1.png")) == bool(importlib.util.find_spec("matplotlib"))


def test_a_killed_table_continues_from_its_finished_cells(toy_table):
    """The rerun scores the cells the stopped run had not finished, each once; its joint stages resume (every
    method's metrics hold each of its 2 steps once); the third run scores nothing and loads no model."""
    calls = toy_table["calls"]
    every = [(os.path.basename(experiments.method_dir("", m)), s, "heldout") for s in (0, 1) for m in tables.ROWS]
    assert calls["killed"] == every[:5]
    assert calls["rerun"] == every[5:]
    assert calls["again"] == [] and calls["again_prepare"] == []
    for seed in ("seed0", "seed1"):
        for method in tables.ROWS[1:]:
            folder = experiments.method_dir(os.path.join(toy_table["out"], seed), method)
            steps = [json.loads(line)["step"] for line in open(os.path.join(folder, "metrics.jsonl"))
                     if json.loads(line)["stage"] == method]
            assert steps == [0, 1], (seed, method, steps)
            cell = json.load(open(os.path.join(folder, "cells", "heldout_all.json")))
            assert cell["spec"] == "heldout" and [c[:2] for c in cell["columns"]] == [
                ["held-out (tools)", "reward"], ["held-out (tools)", "full pass"]]


def test_best_and_second_best_against_brute_force_on_made_up_numbers():
    """tables.ranks and the markdown on rows made up here, ties included; a paper backbone's values beside ours."""
    rng = np.random.default_rng(0)
    cols = [("BFCL-v3", "base"), ("BFCL-v3", "overall"), ("ACEBench", "overall")]
    rows = [dict(row=row, seed=s, heading=h, column=c, value=float(rng.integers(0, 4)) * 10, tasks=1)
            for row in tables.ROWS for s in (0, 1, 2) for h, c in cols]
    args = types.SimpleNamespace(model="Qwen/Qwen3-4B", env="envscaler")
    md = tables.markdown("table1", rows, args, tables.paper_backbone("table1", args.model))
    lines = [dict(row=r["row"], seed=r["seed"], benchmark=r["heading"], column=r["column"], value=r["value"])
             for r in rows]
    cells = markdown_cells(md)
    assert {k: mark_of(v) for k, v in cells.items() if mark_of(v)} == brute_force_marks(lines)
    assert cells[("SDPO", "BFCL-v3: overall")].endswith("(15.75)") and cells[("GRPO", "BFCL-v3: overall")].endswith(
        "(25.25*)")
    assert tables.paper_cell("table1", "Qwen3-8B", "sdpo", tables.BFCL) == "–"     # a row the paper has no value of
    assert not cells[("SDPO", "BFCL-v3: base")].endswith(")")             # the text quotes no category of 4B
    assert "The paper's values (another backbone" not in md
    assert tables.ranks({"a": {0: (1.0, 0)}, "b": {0: (1.0, 0)}, "c": {0: (0.5, 0)}, "d": {0: (0.1, 0)}}, 0) == {
        "a": "best", "b": "best", "c": "second"}


def test_code_columns_and_their_pooled_overall():
    """eval.py's code rows as Table 2's columns: LiveCodeBench's releases and EvalPlus's two under one heading
    each, with "overall" pooling their problems; another benchmark alone."""
    files = {"lcb_v5": [("LiveCodeBench", 4, 0.5)], "lcb_v6": [("LiveCodeBench", 2, 1.0)],
             "EvalPlus": [("HumanEval+", 3, 1 / 3), ("MBPP+", 1, 0.0)], "taco": [("TACO", 5, 0.4)]}
    made = {stem: {"rows": [{"benchmark": b, "problems": n, "pass@1": p} for b, n, p in rs]}
            for stem, rs in files.items()}
    cols = [c for stem, result in made.items() for c in tables.eval_py_columns(tables.Bench(stem, "code", "", stem),
                                                                               result)]
    got = {(h, c): (round(v, 4), n) for h, c, v, n in tables.pooled(cols)}
    assert got == {("LiveCodeBench", "lcb_v5"): (50.0, 4), ("LiveCodeBench", "lcb_v6"): (100.0, 2),
                   ("LiveCodeBench", "overall"): (round(100 * 4 / 6, 4), 6), ("EvalPlus", "HumanEval+"): (33.3333, 3),
                   ("EvalPlus", "MBPP+"): (0.0, 1), ("EvalPlus", "overall"): (25.0, 4), ("TACO", "pass@1"): (40.0, 5)}


def test_the_paper_backbones_and_their_values():
    assert tables.paper_backbone("table1", "Qwen/Qwen3-4B") == "Qwen3-4B"
    assert tables.paper_backbone("table1", "/models/qwen3-8b/") == "Qwen3-8B"
    assert tables.paper_backbone("table2", "allenai/Olmo-3-7B-Instruct") == "Olmo3-7B"
    assert tables.paper_backbone("table2", "Qwen/Qwen3-8B") is None           # Table 2 has no Qwen3-8B group
    assert tables.paper_backbone("table1", "HuggingFaceTB/SmolLM2-135M-Instruct") is None
    q4 = tables.PAPER["table1"]["Qwen3-4B"]
    assert q4["vanilla"][tables.ENV][0] == pytest.approx(100 * results.PAPER_TABLE3["vanilla"]["reward"])
    assert q4["lopd"][tables.ENV][0] == pytest.approx(100 * results.PAPER_TABLE3["LOPD student"]["reward"])
    for regime, label in results.ACEBENCH_LABELS.items():
        assert q4["lopd"][("ACEBench", label)][0] == results.ACEBENCH_PAPER[regime]
    # Table 1's cells, not Figure 4's curves (0.611, 0.588): §4.2's strongest baseline 61.8, the official README's 59.1
    assert q4["grpo"][tables.ENV][0] == 61.8 and q4["skillsd"][tables.ENV][0] == 59.1
    assert [q4["grpo"][c][0] for c in (tables.BFCL, tables.ACE)] == [25.25, 56.0]
    code = tables.PAPER["table2"]["Qwen3-4B"]
    for row, quoted in results.PAPER_TABLE2.items():
        method = row.replace(" student", "").lower()
        assert code[method][tables.LCB][0] == quoted["LiveCodeBench"]
        assert code[method].get(tables.EVP, (quoted.get("EvalPlus"),))[0] == quoted.get("EvalPlus")
    q8 = tables.PAPER["table1"]["Qwen3-8B"]          # the derived ones: LOPD's value less the margins §4.2 quotes
    for m, env, ace in (("opsd", 14.4, 10.0), ("sdft", 10.2, 8.0), ("skillsd", 6.2, 6.7)):
        assert q8[m][tables.ENV][0] == pytest.approx(66.4 - env) and q8[m][tables.ACE][0] == pytest.approx(62.7 - ace)
    every = [v for t in tables.PAPER.values() for b in t.values() for r in b.values() for v in r.values()]
    assert all(0 < v < 100 and src for v, src in every)


# The official README's code table (bingreeky/LOPD, commit 00332bc), copied by hand: LCB Avg, HumanEval+, MBPP+
README_TABLE2 = {"Qwen3-4B": {"vanilla": (45.61, 85.37, 75.93), "grpo": (48.29, 86.59, 76.19),
                              "sdft": (47.07, 87.20, 76.98), "lopd": (48.78, 87.80, 78.57)},
                 "Olmo3-7B": {"vanilla": (46.34, 86.59, 70.37), "grpo": (48.29, 89.02, 72.75),
                              "sdft": (46.58, 89.02, 73.02), "lopd": (50.98, 90.24, 73.28)}}


def test_table2s_paper_values_hold_every_cell_of_the_official_readme():
    for backbone, by_row in README_TABLE2.items():
        for row, values in by_row.items():
            cells = tables.PAPER["table2"][backbone][row]
            assert tuple(cells[c][0] for c in (tables.LCB, tables.HE, tables.MBPP)) == values, (backbone, row)
            # a cell the paper's text quotes keeps §4.2 as its source; the others name the README
            assert all("§4.2" in cells[c][1] or "official README" in cells[c][1] for c in cells), (backbone, row)
    # §4.2's EvalPlus aggregates are the README's HumanEval+ and MBPP+ pooled over their 164 + 378 problems
    q4, olmo = tables.PAPER["table2"]["Qwen3-4B"], tables.PAPER["table2"]["Olmo3-7B"]
    assert (87.80 * 164 + 78.57 * 378) / 542 == pytest.approx(q4["lopd"][tables.EVP][0], abs=0.005)
    assert (90.24 * 164 + 73.28 * 378) / 542 == pytest.approx(olmo["lopd"][tables.EVP][0], abs=0.005)
    # "outperforming the strongest alternatives by 2.69 and 0.55 points" (Olmo3-7B): GRPO's LCB, SDFT's EvalPlus
    assert olmo["grpo"][tables.LCB][0] == pytest.approx(50.98 - 2.69)
    assert olmo["sdft"][tables.EVP][0] == pytest.approx(78.41 - 0.55)
    assert (89.02 * 164 + 73.02 * 378) / 542 == pytest.approx(olmo["sdft"][tables.EVP][0], abs=0.005)


@pytest.mark.parametrize("spec, said", [("nonsense", "expected heldout, envscaler=DIR"),
                                        ("bfcl-v3:nope", "no BFCL-v3 category 'nope'"),
                                        ("heldout heldout", "a benchmark is named twice"),
                                        ("README.md", "table1 takes heldout, envscaler, bfcl, acebench")])
def test_a_bad_benchmark_is_one_line_before_anything_trains(tmp_path, capsys, spec, said):
    out = tmp_path / "t"
    with pytest.raises(SystemExit) as err:
        experiments.main(["table1", "--seeds", "1", "--out", str(out), "--benchmarks",
                          os.path.join(ROOT, spec) if spec.endswith(".md") else spec, *TINY])
    assert err.value.code == 2 and said in capsys.readouterr().err
    assert not os.path.exists(out / "seed0")


def test_table2_on_the_toy_code_world(tmp_path):
    """table2 without --env trains on the toy code world: pass@1 on its held-out problems (in this process) and on a
    benchmark file (two problems of that world in our layout: eval.py --run ROW --tasks FILE), every row."""
    out, bench = str(tmp_path / "code"), str(tmp_path / "mine.jsonl")
    code = train.parse_args(["--env", "code", "--n-train", "30", "--n-test", "4", "--out", str(tmp_path / "x")])
    train.environment(code).save_tasks(train.load_splits(code, record=False)[1][:2], bench)
    experiments.main(["table2", "--seeds", "1", "--out", out, "--benchmarks", "heldout", bench, *TINY,
                      "--n-test", "4"])
    assert json.load(open(os.path.join(out, "seed0", "args.json")))["env"] == "code"
    cells = markdown_cells(open(os.path.join(out, "table2.md")).read())
    assert set(cells) == {(label, c) for label in LABELS for c in ("held-out (code): pass@1", "mine: pass@1")}
    lines = read_csv(os.path.join(out, "table2.csv"))
    assert {r["tasks"] for r in lines if r["benchmark"] == "mine"} == {"2"}
    assert os.path.isfile(os.path.join(experiments.method_dir(os.path.join(out, "seed0"), "lopd"), "mine_all.json"))
    assert "| Qwen3-4B LiveCodeBench: overall | 45.61 | 48.29* | 47.07* | 40.24 | 38.78 | – | 48.78 |" in open(
        os.path.join(out, "table2.md")).read()


def test_table1_on_smollm2_through_the_command(smollm2, tmp_path, monkeypatch):
    """The real-model tier: `python -m scripts.experiments table1 --model SMOLLM2` at the smallest size (one step a
    method, one task a benchmark; Skill-SD's skills of 8 tokens): the held-out split, and BFCL-v3's base category
    where bfcl-eval is installed (scored by eval.py on each row's checkpoint); every row and column, the paper's
    values apart (not a backbone of the paper). Each row's checkpoint is removed once its cells are written."""
    import baselines
    from runtime import parallel
    monkeypatch.setattr(baselines, "SKILL_WRITER_TOKENS", 8)
    # disk: a row's checkpoint (1.6-2.2 GB with AdamW's moments and an EMA teacher) goes once its cells are written,
    # and holds no optimizer state (nothing resumes here), so the test never keeps more than one student on disk
    monkeypatch.setattr(parallel, "full_optimizer_state", lambda opt: {})
    row_cells = tables.row_cells

    def row_cells_then_drop(args, run, row, *rest):
        done = row_cells(args, run, row, *rest)
        shutil.rmtree(os.path.join(experiments.method_dir(args.out, row), "ckpt"), ignore_errors=True)
        return done
    monkeypatch.setattr(tables, "row_cells", row_cells_then_drop)
    bfcl = importlib.util.find_spec("bfcl_eval") is not None
    out = str(tmp_path / "t1")
    argv = ["table1", "--seeds", "1", "--model", smollm2, "--env", "tools", "--out", out, "--benchmarks", "heldout",
            *(["bfcl-v3:base"] if bfcl else []), "--bench-tasks", "1", "--n-train", "2", "--n-test", "1",
            "--bank-rollouts", "1", "--bank-threshold", "0", "--max-new-tokens", "8", "--max-env-steps", "1",
            "--latents", "2", "--n-ret", "1", "--cold-steps", "1", "--cold-batch", "1", "--steps", "1",
            "--rollouts-per-step", "2", "--group", "2", "--micro-batch", "1", "--device", "cpu"]
    try:
        experiments.main(argv)
        md = open(os.path.join(out, "table1.md")).read()
    finally:
        for row in tables.ROWS:
            shutil.rmtree(os.path.join(experiments.method_dir(os.path.join(out, "seed0"), row), "ckpt"),
                          ignore_errors=True)
    cols = {"held-out (tools): reward", "held-out (tools): full pass"} | (
        {"BFCL-v3: base", "BFCL-v3: overall"} if bfcl else set())
    assert set(markdown_cells(md)) == {(label, c) for label in LABELS for c in cols}
    assert md.startswith("Table 1, tool use: smollm2-135m-instruct, --env tools, 1 seed;")
    assert "in brackets" not in md and "The paper's values (another backbone" in md
