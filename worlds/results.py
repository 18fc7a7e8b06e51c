"""How each world's results read: the tables a run and an evaluation write, with the paper's values beside them
(paper Table 3 for the tool worlds, Table 2 for code, BFCL-v3's categories).

    python train.py        # ends with Table 3's rows (`markdown_table`), written to OUT/results.md and .json

A world names its table (`Environment.results`): "table3" (Table 3's behaviour columns with the paper's EnvScaler
values in brackets: the toy tool world, which stands in for EnvScaler), "behaviour" (the same columns alone: any other
multi-turn world), "pass@1" (one program a problem: pass@1 and the reply length, Table 2's quoted values beside).
"""
from __future__ import annotations

import os

import runtime
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


def write_results(out: str, rows: dict, extra: dict | None = None, table: str = "table3", name: str = "results"):
    """OUT/NAME.json (every row's summary) and OUT/NAME.md (the table), each written atomically; a pass@1 run's rows
    hold pass@1 and reply length only. The training run's are results.*; eval.py names its own."""
    if table == "pass@1":
        rows = code_rows(rows)
    runtime.write_json(os.path.join(out, name + ".json"), {"rows": rows, **(extra or {})})
    with runtime.atomic_open(os.path.join(out, name + ".md")) as f:
        f.write("Held-out problems, pass@1 (one program each, every test must pass)\n\n" if table == "pass@1" else
                "Held-out toy tasks (paper Table 3 values, EnvScaler / Qwen3-4B, in brackets)\n\n" if table == "table3"
                else "Held-out tasks\n\n")
        f.write(markdown_table(rows, table=table))


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
