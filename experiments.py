"""The paper's experiments at toy scale, on top of train.py's pipeline (paper §4.2-4.3, Table 3, Figures 3-4).

    python experiments.py ablations                    # the ablation table: LOPD variants and controls, 3 seeds
    python experiments.py figure4                      # reward against generations: LOPD, GRPO, OPSD, SDPO, 3 seeds
    python experiments.py figure4 --env code --seeds 1 --seed 2    # any train.py flag after the experiment's name

Each experiment runs train.py's stages 1-4 once per seed (`train.prepare`, cached in OUT/seedI), then several joint
stages from the same θ̄, bank and φ0 (`train.joint_training`), and writes its table (and figure) into --out:

  ablations   OUT/ablations.md, ablations.json, ablations.png: vanilla, the world check (base + composer with same-shop, other-shop
              and no references), LOPD at m = 0.05 and m = 0, the frozen composer (Figure 3), the retrieval
              controls and RFT; the student alone and the teacher at the end, mean ± std over seeds.
  figure4     OUT/figure4.csv, figure4.md, figure4.png: the student's held-out reward every 10 steps for LOPD,
              GRPO, OPSD and SDPO on one rollout budget, and where LOPD reaches GRPO's final reward (Figure 4).

Both evaluate every 10 steps on 100 held-out tasks (`CURVE`); the table's LOPD run is Figure 4's LOPD curve, so
the two share it when given the same --out. docs/results.md holds what they measured.

Deviation: the paper runs each row once on Qwen3-4B; here each row is mean ± std over --seeds seeds of a 0.5 M
toy backbone, which share the backbone and vary everything after it.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os

import numpy as np

import train

# ----------------------------------------------------------------------------------------------------------------
# The paper's ablation table at toy scale (Table 3 rows and Figure 3)
# ----------------------------------------------------------------------------------------------------------------
# Rows trained from the same θ̄ and bank (issue 8's controls beside Figure 3's ablations). A variant with its own
# --retrieval gets its own cold start with that retrieval, so its composer is trained for what it will read.
VARIANTS = {"LOPD (m = 0.05)": {}, "LOPD (m = 0)": {"margin": 0.0}, "frozen composer": {"freeze_composer": True},
            "LOPD, other-variant retrieval": {"retrieval": "other"},
            "LOPD, task-only composer": {"retrieval": "none"}, "RFT": {"method": "rft"}}
# Both commands evaluate the student every 10 steps on 100 held-out tasks: Figure 4's points. The table's LOPD run
# is Figure 4's LOPD curve (`method_dir`), so it is trained once for both.
CURVE = {"eval_every": 10, "eval_tasks": 100}
PAPER_ROWS = {"vanilla": 0.486, "base + composer": 0.631, "LOPD (m = 0.05)": 0.637, "LOPD (m = 0)": 0.551,
              "frozen composer": 0.573}


def ablation_seed(args: train.Args) -> dict:
    """One seed of the table: shared stages 1-4, then each variant's joint stage from the same θ̄ and φ0.
    Returns {row: {"student", "teacher", "generations"}} (the student alone and base + composer at the end)."""
    run = train.prepare(args)
    rows = {"vanilla": {"student": train.evaluate(args, run["composer"], None, run["retriever"], run["tok"], run["test"],
                                            which=("vanilla",))["vanilla"]["reward"], "generations": 0}}
    rows.update({k: {"teacher": v["reward"], "generations": len(run["episodes"])}
                 for k, v in train.world_check(args, run, run["test"]).items()})
    base_student = run["student"] if isinstance(run["student"], train.LoraStudent) else copy.deepcopy(run["student"])
    for name, change in VARIANTS.items():
        # only LOPD itself is evaluated along the way (its curve is Figure 4's): the others' evaluations would add
        # ~40% to the table's time, and its rows read the end only
        drift = args.eval_every if name == "LOPD (m = 0.05)" else 0
        vargs = dataclasses.replace(args, out=os.path.join(args.out, _slug(name)), resume=True, eval_every=drift,
                                    **change)
        os.makedirs(vargs.out, exist_ok=True)
        train.reset_composer(run["composer"], os.path.join(args.out, "composer0"))
        if vargs.retrieval != "same":            # its own φ0, cold-started on what it will read
            train.reset_composer(run["composer"], os.path.join(args.out, "composer_init"))
            train.cold_start(vargs, None, run["tok"], run["retriever"], run["episodes"], run["train"], train.Log(vargs.out),
                       composer=run["composer"])
        fresh = base_student.reset() if isinstance(base_student, train.LoraStudent) else copy.deepcopy(base_student)
        student = train.joint_training({**run, "args": vargs, "student": fresh, "log": train.Log(vargs.out)})
        end = train.evaluate(vargs, run["composer"], student, run["retriever"], run["tok"], run["test"],
                             which=("base + composer", "LOPD student"))
        gens = len(run["episodes"]) + (0 if vargs.method == "rft" else vargs.steps * vargs.rollouts_per_step)
        rows[name] = {"student": end["LOPD student"]["reward"], "teacher": end["base + composer"]["reward"],
                      "generations": gens}
    return rows


def _slug(name: str) -> str:
    return "".join(c for c in name.lower().replace(" ", "-") if c.isalnum() or c == "-").strip("-")


def ablations(args: train.Args, seeds: int = 3):
    """`python experiments.py ablations`: every row for `seeds` seeds, mean ± std beside the paper's numbers. The
    seeds share the backbone (as the paper's runs share Qwen3-4B) and vary everything after it."""
    if not args.model:
        args = dataclasses.replace(args, model=train.toy_backbone(args))
    args = dataclasses.replace(args, **CURVE)
    per_seed = [ablation_seed(dataclasses.replace(args, seed=args.seed + i, out=os.path.join(args.out, f"seed{i}")))
                for i in range(seeds)]
    table = ablation_table(per_seed)
    with open(os.path.join(args.out, "ablations.md"), "w") as f:
        f.write(table)
    json.dump(per_seed, open(os.path.join(args.out, "ablations.json"), "w"), indent=1)
    print("\n" + table)
    plot_ablations(ablation_summary(per_seed), os.path.join(args.out, "ablations.png"),
                   f"Ablations at toy scale (--env {args.env}, {seeds} seeds)")


def ablation_summary(per_seed) -> dict:
    """{row: {"student"/"teacher": (mean, std) over the seeds that measured it, "generations": n}}."""
    out = {}
    for name in per_seed[0]:
        out[name] = {"generations": per_seed[0][name]["generations"]}
        for key in ("student", "teacher"):
            vals = [r[name][key] for r in per_seed if key in r[name]]
            if vals:
                out[name][key] = (float(np.mean(vals)), float(np.std(vals)))
    return out


def ablation_table(per_seed) -> str:
    """Markdown: per row the student alone and the teacher (base + composer) as mean ± std, generations spent."""
    def cell(row, key):
        return f"{row[key][0]:.3f} ± {row[key][1]:.3f}" if key in row else ""
    lines = ["| row | student alone | teacher (base + composer) | generations | paper (EnvScaler, Qwen3-4B) |",
             "|---|---|---|---|---|"]
    for name, row in ablation_summary(per_seed).items():
        lines.append(f"| {name} | {cell(row, 'student')} | {cell(row, 'teacher')} | "
                     f"{row['generations']} | {PAPER_ROWS.get(name, '')} |")
    return "\n".join(lines) + f"\n\n{len(per_seed)} seeds; mean ± std over seeds.\n"


def plot_ablations(summary: dict, path: str, title: str = "Ablations at toy scale"):
    """Horizontal bars: each row's held-out reward (the student alone, or the teacher for the world-check rows),
    mean ± std over seeds, with vanilla as a dashed line. Skipped with a message without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return
    names = [n for n in summary if "student" in summary[n] or "teacher" in summary[n]]
    vals = [summary[n].get("student", summary[n].get("teacher")) for n in names]
    who = ["student" if "student" in summary[n] else "teacher" for n in names]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(names) + 1.2))
    ax.barh(range(len(names)), [v[0] for v in vals], xerr=[v[1] for v in vals], capsize=3,
            color=["tab:blue" if w == "student" else "tab:gray" for w in who])
    ax.set_yticks(range(len(names)), [f"{n} ({w})" for n, w in zip(names, who)], fontsize=8)
    ax.invert_yaxis()
    if "vanilla" in summary:
        ax.axvline(summary["vanilla"]["student"][0], color="k", ls="--", lw=1, label="vanilla")
        ax.legend(loc="lower right")
    ax.set_xlabel("held-out reward (mean ± std over seeds)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def _pyplot():
    """matplotlib.pyplot on the Agg backend, or None (printed) when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: the plot is skipped (the CSV and the markdown table are written)")
        return None
    return plt


# ----------------------------------------------------------------------------------------------------------------
# Figure 4 at toy scale: reward against generations, every method on the same loop and budget
# ----------------------------------------------------------------------------------------------------------------
FIGURE4_METHODS = ("lopd", "grpo", "opsd", "sdpo")


def method_dir(seed_out: str, method: str) -> str:
    """A method's run inside a seed folder; LOPD's is the ablation table's "LOPD (m = 0.05)" run (one run, both)."""
    return os.path.join(seed_out, _slug("LOPD (m = 0.05)") if method == "lopd" else method)


def figure4_seed(args: train.Args) -> list[dict]:
    """One seed: every method from the same θ̄ (LOPD and OPSD also from the same bank, LOPD from the same φ0).
    Returns CSV rows: method, seed, step, generations (with the bank where the method uses it), training
    generations (without), reward of the student alone on the first --eval-tasks held-out tasks."""
    run = train.prepare(args)
    base_student = run["student"] if isinstance(run["student"], train.LoraStudent) else copy.deepcopy(run["student"])
    vanilla = train.evaluate(args, run["composer"], None, run["retriever"], run["tok"], run["test"][:args.eval_tasks],
                       which=("vanilla",))["vanilla"]["reward"]
    rows = []
    for method in FIGURE4_METHODS:
        margs = dataclasses.replace(args, method=method, out=method_dir(args.out, method), resume=True)
        os.makedirs(margs.out, exist_ok=True)
        train.reset_composer(run["composer"], os.path.join(args.out, "composer0"))
        fresh = base_student.reset() if isinstance(base_student, train.LoraStudent) else copy.deepcopy(base_student)
        train.joint_training({**run, "args": margs, "student": fresh, "log": train.Log(margs.out)})
        bank = len(run["episodes"]) if method in train.USES_BANK else 0
        rows.append(dict(method=method, seed=args.seed, step=0, generations=bank, training_generations=0,
                         reward=vanilla))
        last = {}
        for rec in map(json.loads, open(os.path.join(margs.out, "metrics.jsonl"))):
            if rec.get("stage") == method and "reward/eval" in rec:
                last[rec["step"]] = rec          # a resumed run may have logged a step twice: the last one counts
        rows += [dict(method=method, seed=args.seed, step=k + 1, generations=r["generations"],
                      training_generations=r["generations"] - bank, reward=r["reward/eval"])
                 for k, r in sorted(last.items())]
    return rows


def figure4(args: train.Args, seeds: int = 3):
    """`python experiments.py figure4`: FIGURE4_METHODS × `seeds` seeds; OUT/figure4.csv, figure4.md, figure4.png."""
    if not args.model:
        args = dataclasses.replace(args, model=train.toy_backbone(args))
    args = dataclasses.replace(args, **CURVE)
    rows = [r for i in range(seeds)
            for r in figure4_seed(dataclasses.replace(args, seed=args.seed + i, out=os.path.join(args.out, f"seed{i}")))]
    with open(os.path.join(args.out, "figure4.csv"), "w") as f:
        f.write("method,seed,step,generations,training_generations,reward\n")
        f.writelines(f"{r['method']},{r['seed']},{r['step']},{r['generations']},{r['training_generations']},"
                     f"{r['reward']}\n" for r in rows)
    table = figure4_table(rows)
    with open(os.path.join(args.out, "figure4.md"), "w") as f:
        f.write(table)
    print("\n" + table)
    plot_figure4(rows, os.path.join(args.out, "figure4.png"), f"Figure 4 at toy scale (--env {args.env})")


def _curves(rows) -> dict:
    """{method: [(training generations, mean reward over seeds, std)]} at each evaluated step."""
    out = {}
    for m in dict.fromkeys(r["method"] for r in rows):
        steps = sorted({r["step"] for r in rows if r["method"] == m})
        pts = []
        for s in steps:
            vals = [r["reward"] for r in rows if r["method"] == m and r["step"] == s]
            gen = next(r["training_generations"] for r in rows if r["method"] == m and r["step"] == s)
            pts.append((gen, float(np.mean(vals)), float(np.std(vals))))
        out[m] = pts
    return out


def figure4_table(rows) -> str:
    """Reward (mean ± std over seeds) at each evaluated generation count, and the paper's efficiency question:
    how many generations LOPD needs to reach GRPO's final reward, as a share of GRPO's."""
    curves = _curves(rows)
    gens = [g for g, _, _ in curves[next(iter(curves))]]
    lines = ["| training generations | " + " | ".join(m.upper() for m in curves) + " |",
             "|---|" + "---|" * len(curves)]
    for i, g in enumerate(gens):
        lines.append(f"| {g} | " + " | ".join(f"{c[i][1]:.3f} ± {c[i][2]:.3f}" if i < len(c) else ""
                                                for c in curves.values()) + " |")
    bank = next((r["generations"] for r in rows if r["method"] == "lopd" and r["step"] == 0), 0)
    if "lopd" in curves and "grpo" in curves:
        target, total = curves["grpo"][-1][1], curves["grpo"][-1][0]
        hit = next((g for g, mean, _ in curves["lopd"] if mean >= target), None)
        lines.append("")
        if target <= curves["grpo"][0][1]:     # then "LOPD reaches it" holds at 0 generations and says nothing
            lines.append(f"GRPO did not improve on the base ({curves['grpo'][0][1]:.3f} -> {target:.3f}).")
        lines.append(f"GRPO's final reward {target:.3f} after {total} generations. " + (
            f"LOPD first reaches it after {hit} training generations ({hit / total:.0%} of GRPO's; "
            f"{(hit + bank) / total:.0%} counting the {bank} rollouts that built its bank)." if hit is not None
            else "LOPD does not reach it within the budget."))
    seeds = len({r["seed"] for r in rows})
    return "\n".join(lines) + f"\n\n{seeds} seeds; mean ± std over seeds; the student alone on held-out tasks.\n"


def plot_figure4(rows, path: str, title: str = "Figure 4 at toy scale"):
    """Reward against training generations, one line per method (skipped with a message without matplotlib)."""
    plt = _pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for m, pts in _curves(rows).items():
        g, mean, std = (np.array(x) for x in zip(*pts))
        ax.plot(g, mean, marker="o", label=m.upper())
        ax.fill_between(g, mean - std, mean + std, alpha=0.15)
    ax.set_xlabel("training generations (rollouts)")
    ax.set_ylabel("held-out reward, student alone")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


EXPERIMENTS = {"ablations": ablations, "figure4": figure4}


def main(argv=None):
    """`python experiments.py NAME [--seeds N] [train.py flags]`."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                epilog="Every other flag is train.py's (python train.py --help).")
    p.add_argument("experiment", choices=sorted(EXPERIMENTS), help="which experiment to run")
    p.add_argument("--seeds", type=int, default=3, help="seeds seed, seed+1, ...; rows are mean ± std (default: 3)")
    mine, rest = p.parse_known_args(argv)
    if mine.seeds < 1:
        p.error(f"--seeds must be at least 1, not {mine.seeds}")
    return EXPERIMENTS[mine.experiment](train.parse_args(rest), mine.seeds)


if __name__ == "__main__":
    main()
