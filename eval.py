"""Evaluation on held-out tasks: vanilla, base + composer, and the LOPD student alone (paper §4, B.3, B.4, §4.4).

    python eval.py --run runs/toy                    # the three rows, results.md and results.json in the run
    python eval.py --run runs/toy --inspect-latents  # also: the LM-head projection of each latent token (§4.4)
    python eval.py --run runs/toy --world-check      # also: the teacher with other-variant / no references
    python eval.py --run runs/code --conventions     # toy code world: which judges' conventions each row writes

Rows (Table 3):
- vanilla          the base model θ̄, task only;
- base + composer  θ̄ acting behind latents composed from J retrieved training experiences (the teacher);
- LOPD student     the trained student θ alone: no retrieval, no composer, no latent context.
Each row reports mean reward, full-pass rate and the behaviour counts of Table 3 (interaction steps, tool calls per
step, first-step length, repeated tool calls, reward per tool call). A code run (--env code) reports pass@1 and the
reply length instead, beside paper Table 2's Qwen3-4B values (LiveCodeBench / EvalPlus) where the text gives them.

Deviation: the paper evaluates on EnvScaler's 200 held-out tasks, BFCL-v3 and ACEBench; the toy world's held-out
split stands in for the first.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
from tqdm import tqdm

import envs
import lopd

COLUMNS = [("reward", "reward"), ("full_pass", "full pass"), ("steps", "steps"), ("calls_per_step", "calls/step"),
           ("first_len", "1st-step len"), ("repeated_calls", "repeated calls"), ("reward_per_call", "reward/call")]
PAPER_TABLE3 = {  # EnvScaler, Qwen3-4B (Table 3)
    "vanilla": {"reward": 0.486, "steps": 11.12, "calls_per_step": 3.50, "repeated_calls": 8.89,
                "reward_per_call": 0.038},
    "base + composer": {"reward": 0.631, "steps": 16.31, "calls_per_step": 1.21, "repeated_calls": 4.49},
    "LOPD student": {"reward": 0.637, "steps": 17.04, "calls_per_step": 1.11, "repeated_calls": 5.25,
                     "reward_per_call": 0.050},
}


# A code run (--env code) is single-turn: one program per problem, reward 1 if every test passes. Its mean reward is
# pass@1, and the multi-turn columns (steps, calls) say nothing. Paper Table 2 reports pass@1 (%) of Qwen3-4B on
# LiveCodeBench and EvalPlus; these are the values its text quotes (other problems than a toy or --tasks run).
CODE_COLUMNS = [("pass@1", "pass@1"), ("reply_tokens", "reply tokens")]
PAPER_TABLE2 = {"vanilla": "45.61 / –", "OPSD student": "40.24 / –", "SDPO student": "38.78 / –",
                "LOPD student": "48.78 / 81.36"}
PAPER_TABLE2_HEAD = "paper: Qwen3-4B pass@1 %, LiveCodeBench / EvalPlus"


def code_rows(rows: dict) -> dict:
    """A code run's rows: pass@1 (the mean reward of one sample per problem) and the reply length."""
    return {name: {"pass@1": m["reward"], "reply_tokens": m["first_len"]} for name, m in rows.items()}


def _bar(n, desc):
    return tqdm(total=n, desc=desc, leave=False)


def eval_vanilla(composer, tok, tasks, cfg, make_env, tools=envs.TOOLS):
    """θ̄ on the task alone. The composer's LoRA lives in the same backbone, so it is switched off (A.4)."""
    with composer.adapter_disabled(), _bar(len(tasks), "eval vanilla") as bar:
        return lopd.rollout(composer.peft, tok, tasks, cfg, make_env, tools, progress=bar)


def eval_teacher(composer, retriever, tok, tasks, cfg, make_env, n_ret, tools=envs.TOOLS, mode="same"):
    """θ̄ behind c_φ(x, Ret(x)): what the teacher would do on its own. mode: lopd.retrieve's (same | other | none)."""
    with torch.no_grad():
        latents = lopd.compose(composer, tasks, lopd.retrieve(retriever, tasks, n_ret, mode))    # (B, J·K, d)
    with _bar(len(tasks), "eval base + composer") as bar:
        return lopd.teacher_rollout(composer, tok, tasks, latents, cfg, make_env, tools, progress=bar)


def eval_student(student, tok, tasks, cfg, make_env, tools=envs.TOOLS):
    with _bar(len(tasks), "eval student") as bar:
        return lopd.rollout(student, tok, tasks, cfg, make_env, tools, progress=bar)


def markdown_table(rows: dict, paper=PAPER_TABLE3, env: str = "tools") -> str:
    """rows: name -> summary dict. Paper values (Table 3) in brackets where the paper has them. A code run
    (env="code") shows pass@1 and Table 2's values in their own, labelled column."""
    if env == "code":
        rows = code_rows(rows) if rows and "reward" in next(iter(rows.values())) else rows
        head = ("| row | " + " | ".join(c for _, c in CODE_COLUMNS) + f" | {PAPER_TABLE2_HEAD} |\n|---|" +
                "---|" * (len(CODE_COLUMNS) + 1) + "\n")
        return head + "\n".join(f"| {name} | " + " | ".join(f"{m[k]:.3f}" for k, _ in CODE_COLUMNS) +
                                 f" | {PAPER_TABLE2.get(name, '')} |" for name, m in rows.items()) + "\n"
    head = "| row | " + " | ".join(c for _, c in COLUMNS) + " |\n|---|" + "---|" * len(COLUMNS) + "\n"
    lines = []
    for name, m in rows.items():
        cells = []
        for key, _ in COLUMNS:
            ref = paper.get(name, {}).get(key)
            cells.append(f"{m[key]:.3f}" + (f" ({ref})" if ref is not None else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"


def write_results(out: str, rows: dict, extra: dict | None = None, env: str = "tools"):
    """OUT/results.json and results.md; a code run's rows hold pass@1 and reply length only."""
    if env == "code":
        rows = code_rows(rows)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"rows": rows, **(extra or {})}, f, indent=1)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("Held-out problems, pass@1 (one program each, every test must pass)\n\n" if env == "code" else
                "Held-out toy tasks (paper Table 3 values, EnvScaler / Qwen3-4B, in brackets)\n\n")
        f.write(markdown_table(rows, env=env))


def conventions_table(tok, episodes: dict) -> str:
    """Toy code world: per row, how often replies write the `Answer` prefix and the `END` line, and how often each
    is right for the problem's judge. A student that learned WHEN (per judge) is right well above 0.5; one that
    only changed HOW OFTEN it writes a convention stays near 0.5 (README, Figure 4 on the toy code world)."""
    keys = ("prefix", "prefix_right", "end", "end_right")
    lines = ["| row | pass | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    for name, eps in episodes.items():
        marks = [envs.code_conventions(e.task, tok.decode(e.ids[e.prompt_len:], skip_special_tokens=True))
                 for e in eps]
        rates = [sum(m[k] for m in marks) / len(marks) for k in keys]
        passed = sum(e.reward for e in eps) / len(eps)
        lines.append(f"| {name} | {passed:.3f} | " + " | ".join(f"{r:.3f}" for r in rates) + " |")
    return "\n".join(lines) + "\n"


def inspect_latents(composer, tok, latents, top: int = 5):
    """§4.4: project each latent token through the LM head and print its nearest vocabulary tokens."""
    head = composer.backbone.get_output_embeddings()
    with torch.no_grad():
        logits = head(latents.to(head.weight.dtype))                               # (n, V)
    for k, row in enumerate(logits):
        ids = row.topk(top).indices.tolist()
        print(f"latent {k:3d}: " + "  ".join(repr(tok.decode([i])) for i in ids))


def main(argv=None):
    import train  # the run's settings and loaders live in the entry script
    p = argparse.ArgumentParser(description="Evaluate a run on held-out tasks.")
    p.add_argument("--run", required=True, help="run folder written by train.py (holds args.json)")
    p.add_argument("--n-test", type=int, default=0, help="evaluate only the first N held-out tasks (0 = all)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the run's)")
    p.add_argument("--inspect-latents", action="store_true", help="print the LM-head projection of latents (§4.4)")
    p.add_argument("--world-check", action="store_true",
                   help="also base + composer with other-variant references and with no reference (does the teacher "
                        "use the experience?)")
    p.add_argument("--conventions", action="store_true",
                   help="toy code world: per row, which output conventions replies write and whether each is right "
                        "for the problem's judge")
    a = p.parse_args(argv)
    if a.n_test < 0 or (a.temperature is not None and a.temperature < 0):
        p.error(f"--n-test and --temperature must be at least 0, not {a.n_test} and {a.temperature}")
    if not os.path.isfile(os.path.join(a.run, "args.json")):
        p.error(f"--run {a.run!r}: no args.json there; is it a folder written by train.py?")
    args = train.Args(**json.load(open(os.path.join(a.run, "args.json"))))
    if a.conventions and (args.env != "code" or args.tasks):
        p.error(f"--conventions: the run {a.run!r} is not on the toy code world, the only one with judges' conventions")
    keep = {} if a.conventions else None
    with train.one_line_errors():
        rows, (composer, tok, first_latents) = train.final_eval(args, a.n_test, a.temperature, a.world_check, keep)
    print(markdown_table(rows, env=args.env))
    if a.conventions:
        print(conventions_table(tok, train.name_student_row(args, keep)))
    if a.inspect_latents:
        inspect_latents(composer, tok, first_latents)


if __name__ == "__main__":
    main()
