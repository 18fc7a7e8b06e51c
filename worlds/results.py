"""How each world's results read: the tables a run and an evaluation write, with the paper's values beside them
(paper Table 3 for the tool worlds, Table 2 for code, BFCL-v3's categories, ACEBench's regimes), and Table 1's row
across EnvScaler, BFCL-v3 and ACEBench (`table1_cells`).

    python train.py        # ends with Table 3's rows (`markdown_table`), written to OUT/results.md and .json,
                           # and the run's curves beside them, OUT/curves.png (`plot_curves`; needs matplotlib)

A world names its table (`Environment.results`): "table3" (Table 3's behaviour columns with the paper's EnvScaler
values in brackets: the toy tool world, which stands in for EnvScaler), "behaviour" (the same columns alone: any other
multi-turn world), "pass@1" (one program a problem: pass@1 and the reply length, Table 2's quoted values beside).
"""
from __future__ import annotations

import json
import os

from runtime import checkpoints
from worlds.code_benchmarks import EVALPLUS

# Table 3's columns: the mean of each behaviour metric over a row's episodes (engine.Episode.metrics)
COLUMNS = [("reward", "reward"), ("full_pass", "full pass"), ("steps", "steps"), ("calls_per_step", "calls/step"),
           ("first_len", "1st-step len"), ("repeated_calls", "repeated calls"), ("reward_per_call", "reward/call")]


PAPER_TABLE3 = {  # EnvScaler, Qwen3-4B (Table 3)
    "vanilla": {"reward": 0.486, "steps": 11.12, "calls_per_step": 3.50, "repeated_calls": 8.89,
                "reward_per_call": 0.038},
    "base + composer": {"reward": 0.631, "steps": 16.31, "calls_per_step": 1.21, "repeated_calls": 4.49,
                        "reward_per_call": 0.053},
    "LOPD student": {"reward": 0.637, "steps": 17.04, "calls_per_step": 1.11, "repeated_calls": 5.25,
                     "reward_per_call": 0.050},
}


# A code run (--env code) is single-turn: one program per problem, reward 1 if every test passes. Its mean reward is
# pass@1, and the multi-turn columns (steps, calls) say nothing. Paper Table 2 reports pass@1 (%) of Qwen3-4B on
# LiveCodeBench and EvalPlus; these are the values its text quotes (other problems than a toy or --tasks run).
# Our copy of the paper lacks Table 2's cells: these are the aggregates its text quotes (LiveCodeBench v5/v6,
# EvalPlus = HumanEval+ and MBPP+). eval.py --tasks shows the same values per benchmark.
CODE_COLUMNS = [("pass@1", "pass@1"), ("reply_tokens", "reply tokens")]


PAPER_TABLE2 = {"vanilla": {"LiveCodeBench": 45.61}, "OPSD student": {"LiveCodeBench": 40.24},
                "SDPO student": {"LiveCodeBench": 38.78}, "LOPD student": {"LiveCodeBench": 48.78, "EvalPlus": 81.36}}


PAPER_TABLE2_HEAD = "paper: Qwen3-4B pass@1 %, LiveCodeBench / EvalPlus"


def paper_table2_cell(row: str) -> str:
    """A row's quoted Table 2 values as "LiveCodeBench / EvalPlus" ("–" where the text gives none)."""
    v = PAPER_TABLE2.get(row)
    return "" if v is None else f"{v.get('LiveCodeBench', '–')} / {v.get('EvalPlus', '–')}"


def code_rows(rows: dict) -> dict:
    """A code run's rows: pass@1 (the mean reward of one sample per problem) and the reply length."""
    return {name: {"pass@1": m["reward"], "reply_tokens": m["first_len"]} for name, m in rows.items()}


def markdown_table(rows: dict, paper=PAPER_TABLE3, table: str = "table3") -> str:
    """rows: name -> summary dict. Paper values (Table 3) in brackets where the paper has them. A single-turn code
    run (table="pass@1", `Environment.results`) shows pass@1 and Table 2's values in their own, labelled column."""
    if table == "pass@1":
        rows = code_rows(rows) if rows and "reward" in next(iter(rows.values())) else rows
        head = ("| row | " + " | ".join(c for _, c in CODE_COLUMNS) + f" | {PAPER_TABLE2_HEAD} |\n|---|" +
                "---|" * (len(CODE_COLUMNS) + 1) + "\n")
        return head + "\n".join(f"| {name} | " + " | ".join(f"{m[k]:.3f}" for k, _ in CODE_COLUMNS) +
                                 f" | {paper_table2_cell(name)} |" for name, m in rows.items()) + "\n"
    paper = paper if table == "table3" else {}              # another world's rows are not EnvScaler's
    head = "| row | " + " | ".join(c for _, c in COLUMNS) + " |\n|---|" + "---|" * len(COLUMNS) + "\n"
    lines = []
    for name, m in rows.items():
        cells = []
        for key, _ in COLUMNS:
            ref = paper.get(name, {}).get(key)
            cells.append(f"{m[key]:.3f}" + (f" ({ref})" if ref is not None else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"


def caption(table: str = "table3", n: int | None = None) -> str:
    """The line above a results table: what its rows were scored on (`n` held-out tasks each, where given) and
    where the paper's values are. The columns are defined in docs/glossary.md, "The results table"."""
    each = "" if n is None else f", {n:,} a row"
    return (f"Held-out problems{each}, pass@1 (one program each, every test must pass)" if table == "pass@1" else
            f"Held-out toy tasks{each} (paper Table 3 values, EnvScaler / Qwen3-4B, in brackets)" if table == "table3"
            else f"Held-out tasks{each}")


def write_results(out: str, rows: dict, extra: dict | None = None, table: str = "table3", name: str = "results",
                  n: int | None = None):
    """OUT/NAME.json (every row's summary) and OUT/NAME.md (the table under its `caption`, `n` tasks a row), each
    written atomically; a pass@1 run's rows hold pass@1 and reply length only. The training run's are results.*;
    eval.py names its own."""
    if table == "pass@1":
        rows = code_rows(rows)
    checkpoints.write_json(os.path.join(out, name + ".json"), {"rows": rows, **(extra or {})})
    with checkpoints.atomic_open(os.path.join(out, name + ".md")) as f:
        f.write(caption(table, n) + "\n\n" + markdown_table(rows, table=table))


# ----------------------------------------------------------------------------------------------------------------
# A run's curves: OUT/curves.png beside its results, drawn from OUT/metrics.jsonl (train.py calls `plot_curves`)
# ----------------------------------------------------------------------------------------------------------------
SMOOTH = 5        # iterations in the running mean drawn over the student's reward (one iteration is one batch)


def logged(out: str) -> dict:
    """OUT/metrics.jsonl by stage: {stage: [records in step order]}. A step logged twice (a resumed run logs the
    steps after its checkpoint again) keeps its last record; records without a step keep their order."""
    stages = {}
    for line in open(os.path.join(out, "metrics.jsonl")):
        rec = json.loads(line)
        stages.setdefault(rec["stage"], {})[rec.get("step", len(stages.get(rec["stage"], {})))] = rec
    return {stage: [by_step[s] for s in sorted(by_step)] for stage, by_step in stages.items()}


def curve_panels(stages: dict, rows: dict, margin: float | None = None) -> dict:
    """{panel: [(label, steps, values, style)]} from `logged` records and the final rows (results.json): the
    student's reward per iteration (and its running mean), the joint stage's losses, Δ and β (LOPD: m dotted), the
    cold start's loss (eq. 14), and the evaluations along the way with the final rows across the iterations. A
    panel whose numbers the run did not log is left out."""
    joint = next((r for recs in stages.values() for r in recs[:1] if "generations" in r), None)
    recs = stages[joint["stage"]] if joint else []
    steps = lambda key: [r["step"] for r in recs if key in r]                                   # noqa: E731
    line = lambda key, label, **style: (label, steps(key), [r[key] for r in recs if key in r], style)   # noqa: E731
    panels = {"student reward": [line("reward/student", "the student's rollouts", alpha=0.35)],
              "losses": [line(k, k) for k in dict.fromkeys(k for r in recs for k in r if k.startswith("loss/"))],
              "Δ, the teacher's privilege (eq. 12)": [line("privilege/delta", "Δ")],
              "β, the dual variable (eq. 13)": [line("dual/beta", "β")],
              "cold start": [("loss/init (eq. 14)", [r["step"] for r in stages.get("cold_start", [])],
                              [r["loss/init"] for r in stages.get("cold_start", [])], {})],
              "evaluation": [line("reward/eval", "the student on --eval-tasks", c="C0"),
                             line("reward/teacher", "base + composer on --eval-tasks", c="C1")]}
    reward = panels["student reward"][0]
    if len(reward[1]) >= SMOOTH:
        window = lambda i: reward[2][max(0, i - SMOOTH + 1):i + 1]                           # noqa: E731
        mean = [sum(window(i)) / len(window(i)) for i in range(len(reward[2]))]
        panels["student reward"].append((f"running mean of {SMOOTH}", reward[1], mean, {}))
    delta = panels["Δ, the teacher's privilege (eq. 12)"]
    if delta[0][1] and margin is not None:
        delta.append((f"the margin m = {margin:g}", delta[0][1], [margin] * len(delta[0][1]),
                      {"ls": ":", "c": "k", "marker": ""}))
    span = [min(reward[1], default=0), max(reward[1], default=0)]       # the final rows, across the iterations
    final = {name: row.get("reward", row.get("pass@1")) for name, row in rows.items()}   # a code run's: pass@1
    colour = {"vanilla": "C7", "base + composer": "C1"}                          # the student's row: C0, as above
    panels["evaluation"] += [(f"{name}, final", span, [v] * 2, {"ls": "--", "marker": "", "c": colour.get(name, "C0")})
                             for name, v in final.items() if v is not None]
    return {name: [c for c in curves if c[1]] for name, curves in panels.items() if any(c[1] for c in curves)}


def plot_curves(out: str) -> list[str]:
    """OUT/curves.png: `curve_panels` of OUT/metrics.jsonl and OUT/results.json, one panel each. -> the panels drawn
    (none, with one line said, where matplotlib is not installed)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: OUT/curves.png is skipped (pip install matplotlib draws it)")
        return []
    done = os.path.join(out, "results.json")
    settings = os.path.join(out, "args.json")
    rows = json.load(open(done))["rows"] if os.path.isfile(done) else {}
    margin = json.load(open(settings)).get("margin") if os.path.isfile(settings) else None
    panels = curve_panels(logged(out), rows, margin)
    if not panels:
        return []
    cols = min(3, len(panels))
    lines = -(-len(panels) // cols)
    fig, axes = plt.subplots(lines, cols, figsize=(5 * cols, 3.4 * lines), squeeze=False)
    for ax, (name, curves) in zip(axes.flat, panels.items()):
        for label, xs, ys, style in curves:
            ax.plot(xs, ys, label=label, **{"marker": "." if len(xs) < 30 else None, **style})
        ax.set_title(name)
        ax.set_xlabel("cold-start step" if name == "cold start" else "iteration")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(os.path.basename(os.path.normpath(out)))
    fig.tight_layout()
    with checkpoints.atomic_open(os.path.join(out, "curves.png"), "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)
    return list(panels)


def paper_value(benchmark: str) -> str:
    """The Qwen3-4B values the paper's text quotes for a benchmark's aggregate (PAPER_TABLE2), e.g.
    "vanilla 45.61, LOPD 48.78 (LiveCodeBench aggregate)"; "" for TACO (the training set) and our own layout."""
    agg = "EvalPlus" if benchmark in EVALPLUS else benchmark
    vals = [f"{row.replace(' student', '')} {v[agg]}" for row, v in PAPER_TABLE2.items() if agg in v]
    return f"{', '.join(vals)} ({agg} aggregate)" if vals else ""


def benchmark_rows(problems, log: dict, source: str) -> list[dict]:
    """pass@1 per benchmark of one file (one sample per problem), and base pass@1 for EvalPlus, from CodeWorld's
    log (task_id -> {passed, base, plus}); plus pass@1 is EvalPlus's "base and plus"."""
    rows = []
    for bench in dict.fromkeys(p.benchmark or "ours" for p in problems):
        ids = [p.task_id for p in problems if (p.benchmark or "ours") == bench]
        row = {"benchmark": bench, "file": source, "problems": len(ids),
               "pass@1": sum(log[i]["passed"] for i in ids) / len(ids)}
        if bench in EVALPLUS:
            row["base pass@1"] = sum(log[i].get("base", False) for i in ids) / len(ids)
        rows.append(row)
    return rows


def benchmark_table(rows: list[dict], student: str) -> str:
    """Markdown: pass@1 (%) per benchmark (EvalPlus: plus, and base beside it) and the paper's value."""
    lines = [f"Code benchmarks, {student}: pass@1 (%), one sample per problem", "",
             "| benchmark | file | problems | pass@1 (EvalPlus: plus) | base pass@1 | Qwen3-4B, paper Table 2 |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        base = f"{100 * r['base pass@1']:.2f}" if "base pass@1" in r else ""
        lines.append(f"| {r['benchmark']} | {r['file']} | {r['problems']} | {100 * r['pass@1']:.2f} | {base} | "
                     f"{paper_value(r['benchmark'])} |")
    return "\n".join(lines) + "\n"


def bfcl_table(rows, name: str, single=()) -> str:
    """Markdown: BFCL-v3 accuracy per category and their mean (BFCL's overall). Multi-turn categories also show the
    fraction of turns passed (the training reward); `single` names the single-turn ones (one reply, BFCL's AST
    checker), which have no turns: their column says so, and a table of them alone has none."""
    multi = [r for r in rows if r["category"] not in single]
    kind = ("multi-turn, " if len(multi) == len(rows) else "single-turn (AST checker), " if not multi
            else "")                                                         # a mixed table: both kinds
    turns = (lambda r: "–" if r["category"] in single else f"{r['turns']:.3f}") if multi else None   # noqa: E731
    cols = "| category | tasks | accuracy |" + (" turns passed |" if turns else "")
    lines = [f"BFCL-v3 {kind}{name}", "", cols, "|---|---|---|" + ("---|" if turns else "")]
    lines += [f"| {r['category']} | {r['tasks']} | {r['accuracy']:.3f} |" + (f" {turns(r)} |" if turns else "")
              for r in rows]
    mean = lambda k, rs: sum(r[k] for r in rs) / len(rs)          # noqa: E731
    tail = f" {mean('turns', multi):.3f} |" if turns else ""
    lines.append(f"| mean | {sum(r['tasks'] for r in rows)} | {mean('accuracy', rows):.3f} |" + tail)
    return "\n".join(lines)


# ACEBench (worlds/acebench.py): Figure 5 at n_ret = 3, the LOPD student of Qwen3-4B, end-to-end accuracy (%)
ACEBENCH_PAPER = {"multi_step": 56.6, "multi_turn": 63.3, "overall": 60.6}
ACEBENCH_LABELS = {"multi_step": "M-Step", "multi_turn": "M-Turn", "overall": "overall"}


def acebench_overall(rows) -> dict:
    """The regimes' rows taken together, as the paper's overall (Figure 5's 60.6 = (20 × 56.6 + 30 × 63.3) / 50):
    the tasks passed over all tasks, and the process score weighted by tasks alike. (ACEBench's own summary is the
    unweighted mean of the two regimes.)"""
    n = max(1, sum(r["tasks"] for r in rows))
    correct = sum(r["correct"] for r in rows)
    return {"regime": "overall", "tasks": sum(r["tasks"] for r in rows), "correct": correct,
            "end_to_end": correct / n, "process": sum(r["process"] * r["tasks"] for r in rows) / n}


def acebench_table(rows, name: str) -> str:
    """Markdown: ACEBench's end-to-end and process accuracy (%) per regime and overall, Figure 5's beside."""
    lines = [f"ACEBench, English agent tasks, {name}: ACEBench's checker, accuracy %", "",
             "| regime | tasks | end-to-end | process | paper: LOPD Qwen3-4B end-to-end (Fig. 5) |",
             "|---|---|---|---|---|"]
    lines += [f"| {ACEBENCH_LABELS[r['regime']]} | {r['tasks']} | {100 * r['end_to_end']:.1f} | "
              f"{100 * r['process']:.1f} | {ACEBENCH_PAPER[r['regime']]} |" for r in rows]
    return "\n".join(lines)


# Table 1 (§4.1): the tool-use benchmarks side by side on the paper's 0-100 scale. EnvScaler: the mean reward on its
# held-out tasks (Table 3's reward × 100); BFCL-v3: each category's accuracy and their mean (BFCL's overall);
# ACEBench: the end-to-end accuracy per regime and over all its tasks (Figure 5's overall)
BFCL_LABELS = {"base": "base", "miss_func": "missing-function", "miss_param": "missing-parameter",
               "long_context": "long-context"}        # §4.1's names of BFCL-v3's multi-turn categories


def _envscaler_cells(rows) -> dict:
    return {"reward": rows[0]["reward"]}


def _bfcl_cells(rows) -> dict:
    overall = sum(r["accuracy"] for r in rows) / len(rows)
    return {**{BFCL_LABELS.get(r["category"], r["category"]): r["accuracy"] for r in rows}, "overall": overall}


def _acebench_cells(rows) -> dict:
    return {ACEBENCH_LABELS[r["regime"]]: r["end_to_end"] for r in rows}


TABLE1 = {"envscaler": ("EnvScaler", _envscaler_cells), "bfcl-v3": ("BFCL-v3", _bfcl_cells),
          "acebench": ("ACEBench", _acebench_cells)}         # in Table 1's order


def table1_cells(evaluated: dict) -> dict:
    """The benchmarks' results (each one's STEM.json, by envscaler, bfcl-v3, acebench; any of them) -> Table 1's
    cells, {"EnvScaler": {"reward": 61.5}, "BFCL-v3": {"base": ..., "overall": ...}, ...}, 0-100, Table 1's order."""
    return {name: {col: 100 * v for col, v in cells(evaluated[kind]["rows"]).items()}
            for kind, (name, cells) in TABLE1.items() if kind in evaluated}


def table1_markdown(student: str, cells: dict) -> str:
    """Markdown: one row of Table 1's columns (`table1_cells`), a column per benchmark and sub-column."""
    cols = [(b, c) for b, sub in cells.items() for c in sub]
    return "\n".join([
        "Table 1's columns (§4.1), 0-100: EnvScaler mean reward, BFCL-v3 accuracy, ACEBench end-to-end accuracy", "",
        "| row | " + " | ".join(f"{b} {c}" for b, c in cols) + " |", "|---|" + "---|" * len(cols),
        f"| {student} | " + " | ".join(f"{cells[b][c]:.2f}" for b, c in cols) + " |"])
