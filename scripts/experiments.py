"""The paper's experiments at toy scale, on top of train.py's pipeline (paper §4.2-4.3, Table 3, Figures 3-4).

    python -m scripts.experiments ablations                   # the ablation table: LOPD variants and controls, 3 seeds
    python -m scripts.experiments figure4                     # reward against generations: LOPD, GRPO, Skill-SD (+3)
    python -m scripts.experiments figure4 --env code --seeds 1 --seed 2 # any train.py flag after the experiment's name
    python -m scripts.experiments figure4 --shops 16 --seeds 5 # the many-shops world (docs/results.md, "Many shops")
    python -m scripts.experiments dial                        # LOPD, GRPO, RFT as hidden conventions grow (K = 1..4)
    python -m scripts.experiments absorb                      # the official code's settings one at a time, 3 seeds
    python -m scripts.experiments course                      # the walk-through's staged path: OPSD -> ... -> LOPD
    python -m scripts.experiments table1                      # Table 1 (tool use), every method: scripts/tables.py
    python -m scripts.experiments table2                      # Table 2 (code), on the toy code world: scripts/tables.py

Each experiment runs train.py's stages 1-4 once per seed (`train.prepare`, cached in OUT/seedI; the dial's in
OUT/kK/seedI), then several joint stages from the same θ̄, bank and φ0 (`train.joint_training`), and writes its
table (and figure) into --out:

  ablations   OUT/ablations.md, ablations.json, ablations.png: vanilla, the world check (base + composer with
              same-shop, other-shop and no references), LOPD at m = 0.05 and m = 0, the frozen composer (Figure 3),
              the retrieval controls and RFT; the student alone and the teacher at the end, mean ± std over seeds.
  figure4     OUT/figure4.csv, figure4.md, figure4.png: the student's held-out reward every 10 steps on one rollout
              budget for the curves Figure 4 draws (LOPD, GRPO, Skill-SD), then OPSD, SDPO and SDFT as further
              rows, and where LOPD reaches GRPO's and Skill-SD's final rewards (the abstract's efficiency claim);
              the 95% intervals at the end and LOPD's paired gaps; the plot on training generations and, beside it,
              with the bank's rollouts. Seed folders are named by seed (OUT/seed3 for --seed 3), so processes
              of `--seed K --seeds 1` fill one OUT and `--seeds N` then reads them all back.
  dial        OUT/dial.csv, dial.md, dial.png: the difficulty dial. For K = 1..4 hidden conventions per shop
              (train.py --conventions, each K with its own shipped backbone): LOPD, GRPO and RFT from one base,
              bank and φ0 per seed, the gaps LOPD − GRPO and LOPD − RFT at the end, how often GRPO's groups held
              equal rewards, the teacher at φ0 and at the end, and LOPD with δ against φ0 (the drift remedy).

  absorb      OUT/absorb.csv, absorb.md, absorb.png: does the student absorb its teacher? From one θ̄ and bank per
              seed, LOPD with the toy's defaults, with each setting of the official code in turn (K = 32,
              self-retrieval, student lr 1e-5, L_distill per trajectory, epoch task order, the cold start's two
              optimizers, a bf16 QFormer), with all of them, with an oracle same-shop retriever, and GRPO and RFT;
              per row the student, its teacher at the end, the distillation efficiency (student − vanilla) /
              (teacher − vanilla) and the gaps to GRPO and RFT; the best row and GRPO then run twice as long. Several
              processes on one --out share the rows (`python -m scripts.experiments absorb --workers 2`).

  course      OUT/course.csv, course.md, course.png, course-curves.png: the walk-through's five stages at the
              exercises' scale (300 training tasks, 100 held out, 20 iterations): OPSD with a text teacher;
              latents instead of the text, the composer frozen; the composer learning without the margin; with
              the margin and β; the full method. Then stages 3-5 again with the composer's lr 1e-4, and the
              exercises' runs that are not a stage (m = 0 with the anchor, other shops' references, M = 1, GRPO,
              RFT). Per row the student, its teacher at the end, the efficiency, Δ and β at the end.
              docs/exercises.md's answers cite it (assets/course.csv).
  table1, 2   OUT/table1.csv, table1.md, table1.png (table2 alike): Vanilla and the six methods on Figure 4's runs,
              scored on each --benchmarks SPEC (scripts/tables.py, which holds the rest).

The first two evaluate every 10 steps on 100 held-out tasks (`CURVE`); the table's LOPD run is Figure 4's LOPD curve, so
the two share it when given the same --out. docs/results.md holds what they measured.

Deviation: the paper runs each row once on Qwen3-4B; here each row is mean ± std over --seeds seeds of a 0.5 M
toy backbone, which share the backbone and vary everything after it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import torch

import eval as ev
import lopd
from runtime import checkpoints, devices, models
import train
from scripts import tables
from worlds import tool_world

# ----------------------------------------------------------------------------------------------------------------
# The paper's ablation table at toy scale (Table 3 rows and Figure 3)
# ----------------------------------------------------------------------------------------------------------------
# Rows trained from the same θ̄ and bank (the retrieval controls beside Figure 3's ablations). A variant with its own
# --retrieval gets its own cold start with that retrieval, so its composer is trained for what it will read.
VARIANTS = {"LOPD (m = 0.05)": {}, "LOPD (m = 0)": {"margin": 0.0}, "frozen composer": {"freeze_composer": True},
            "LOPD, other-variant retrieval": {"retrieval": "other"},
            "LOPD, task-only composer": {"retrieval": "none"}, "RFT": {"method": "rft"}}
# Both commands evaluate the student every 10 steps on 100 held-out tasks: Figure 4's points. The table's LOPD run
# is Figure 4's LOPD curve (`method_dir`), so it is trained once for both.
CURVE = {"eval_every": 10, "eval_tasks": 100}
# Table 3's rows beside ours. The paper's "Base + Composer" (B.4) is the JOINTLY optimised composer (m = 0.05) on the
# unadapted backbone: LOPD's teacher at the end, not the cold-started φ0.
PAPER_ROWS = {"vanilla": "0.486", "LOPD (m = 0.05)": "0.637 (its teacher: 0.631)", "LOPD (m = 0)": "0.551",
              "frozen composer": "0.573"}


def log_of(args) -> "devices.Log":
    """A variant's log: OUT/metrics.jsonl, and with --tensorboard DIR its scalars beside every other run's."""
    return devices.Log(args.out, args.tensorboard)


def ablation_seed(args: train.Args) -> dict:
    """One seed of the table: shared stages 1-4, then each variant's joint stage from the same θ̄ and φ0.
    Returns {row: {"student", "teacher", "generations"}} (the student alone and base + composer at the end)."""
    run = train.prepare(args)
    vanilla = train.evaluate(args, run, None, run.test, which=("vanilla",))["vanilla"]["reward"]
    rows = {"vanilla": {"student": vanilla, "generations": 0}}
    rows.update({k: {"teacher": v["reward"], "generations": len(run.episodes)}
                 for k, v in ev.world_check(args, run, run.test).items()})
    for name, change in VARIANTS.items():
        # only LOPD itself is evaluated along the way (its curve is Figure 4's): the other rows read the end only,
        # and evaluating them too would lengthen the table by much of its training time
        drift = args.eval_every if name == "LOPD (m = 0.05)" else 0
        vargs = dataclasses.replace(args, out=os.path.join(args.out, _slug(name)), resume=True, eval_every=drift,
                                    **change)
        os.makedirs(vargs.out, exist_ok=True)
        checkpoints.reset_composer(run.composer, os.path.join(args.out, "composer0"))
        if vargs.retrieval != "same":            # its own φ0, cold-started on what it will read
            checkpoints.reset_composer(run.composer, os.path.join(args.out, "composer_init"))
            train.cold_start(vargs, None, run.tok, run.retriever, run.episodes, run.train,
                             log_of(vargs), composer=run.composer)
        joint = dataclasses.replace(run, args=vargs, student=fresh_student(run), log=log_of(vargs))
        student = train.joint_training(joint)
        end = train.evaluate(vargs, run, student, run.test, which=("base + composer", "student"))
        gens = _logged(os.path.join(vargs.out, "metrics.jsonl"), vargs.method)   # the bank's, where it reads it
        gens = gens[max(gens)]["generations"]
        rows[name] = {"student": end[train.student_row(vargs)]["reward"], "teacher": end["base + composer"]["reward"],
                      "generations": gens}
    return rows


def fresh_student(run: dict):
    """θ = θ̄ for the next joint stage: the LoRA student reset, or None (train.joint_training builds a full one)."""
    return None if run.student is None else run.student.reset()


def _slug(name: str) -> str:
    return "".join(c for c in name.lower().replace(" ", "-") if c.isalnum() or c == "-").strip("-")


def ablations(args: train.Args, seeds: int = 3):
    """`python -m scripts.experiments ablations`: every row for `seeds` seeds, mean ± std beside the paper's numbers. The
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
# Figure 4 draws LOPD and "the strongest baselines", GRPO and Skill-SD (§4.3: 0.637 by generation 576; they finish at
# 0.611 and 0.588 over 1,600); the other B.1 methods follow as further rows (dashed in the plot).
FIGURE4_METHODS = ("lopd", "grpo", "skillsd", "opsd", "sdpo", "sdft")
FIGURE4_DRAWN = FIGURE4_METHODS[:3]
# Qwen3-4B on EnvScaler (§4.3): LOPD's 0.637 is reached by generation 576 (then 0.63-0.64 to 1,600); GRPO's and
# Skill-SD's are their final rewards at 1,600. Table 1's cells differ (tables.PAPER: GRPO 61.8, Skill-SD 59.1).
PAPER_FIGURE4 = {"lopd": 0.637, "grpo": 0.611, "skillsd": 0.588}


def method_dir(seed_out: str, method: str) -> str:
    """A method's run inside a seed folder; LOPD's is the ablation table's "LOPD (m = 0.05)" run (one run, both)."""
    return os.path.join(seed_out, _slug("LOPD (m = 0.05)") if method == "lopd" else method)


def figure4_seed(args: train.Args) -> list[dict]:
    """One seed: every method from the same θ̄ (LOPD and OPSD also from the same bank, LOPD from the same φ0).
    Returns CSV rows: method, seed, step, generations (with the bank where the method uses it), training
    generations (without), reward of the student alone on the first --eval-tasks held-out tasks."""
    run = train.prepare(args)
    vanilla = train.evaluate(args, run, None, run.test[:args.eval_tasks], which=("vanilla",))["vanilla"]["reward"]
    rows = []
    for method in FIGURE4_METHODS:
        margs = dataclasses.replace(args, method=method, out=method_dir(args.out, method), resume=True)
        os.makedirs(margs.out, exist_ok=True)
        checkpoints.reset_composer(run.composer, os.path.join(args.out, "composer0"))
        train.joint_training(dataclasses.replace(run, args=margs, student=fresh_student(run), log=log_of(margs)))
        bank = len(run.episodes) if train.METHODS[method].uses_bank else 0
        rows.append(dict(method=method, seed=args.seed, step=0, generations=bank, training_generations=0,
                         reward=vanilla))
        last = {k: r for k, r in _logged(os.path.join(margs.out, "metrics.jsonl"), method).items()
                if "reward/eval" in r}
        rows += [dict(method=method, seed=args.seed, step=k + 1, generations=r["generations"],
                      training_generations=r["generations"] - bank, reward=r["reward/eval"])
                 for k, r in sorted(last.items())]
    return rows


def figure4(args: train.Args, seeds: int = 3):
    """`python -m scripts.experiments figure4`: FIGURE4_METHODS × `seeds` seeds; OUT/figure4.csv, figure4.md, figure4.png."""
    if not args.model:
        args = dataclasses.replace(args, model=train.toy_backbone(args))
    args = dataclasses.replace(args, **CURVE)
    seeded = [dataclasses.replace(args, seed=args.seed + i, out=os.path.join(args.out, f"seed{args.seed + i}"))
              for i in range(seeds)]      # seed folders by seed: `--seed 3 --seeds 1` adds seed3 beside seed0-2
    rows = [r for a in seeded for r in figure4_seed(a)]
    with open(os.path.join(args.out, "figure4.csv"), "w") as f:
        f.write("method,seed,step,generations,training_generations,reward\n")
        f.writelines(f"{r['method']},{r['seed']},{r['step']},{r['generations']},{r['training_generations']},"
                     f"{r['reward']}\n" for r in rows)
    table = figure4_table(rows)
    with open(os.path.join(args.out, "figure4.md"), "w") as f:
        f.write(table)
    print("\n" + table)
    shops = f", --shops {args.shops}" if args.shops else ""
    plot_figure4(rows, os.path.join(args.out, "figure4.png"), f"Figure 4 at toy scale (--env {args.env}{shops})")


def _curves(rows) -> dict:
    """{method: [(training generations, mean reward over seeds, sample std)]} at each evaluated step."""
    out = {}
    for m in dict.fromkeys(r["method"] for r in rows):
        steps = sorted({r["step"] for r in rows if r["method"] == m})
        pts = []
        for s in steps:
            vals = [r["reward"] for r in rows if r["method"] == m and r["step"] == s]
            gen = next(r["training_generations"] for r in rows if r["method"] == m and r["step"] == s)
            pts.append((gen, float(np.mean(vals)), tables.sample_std(vals)))
        out[m] = pts
    return out


def final_rewards(rows, method: str) -> dict:
    """{seed: the method's reward at its last evaluated step}."""
    mine = [r for r in rows if r["method"] == method]
    last = max(r["step"] for r in mine)
    return {r["seed"]: r["reward"] for r in mine if r["step"] == last}


def paired_line(rows, other: str) -> str:
    """LOPD − `other` at the end, per seed paired, as mean and 95% interval, and which side of 0 the interval is."""
    a, b = final_rewards(rows, "lopd"), final_rewards(rows, other)
    seeds = sorted(set(a) & set(b))
    mean, s, half = tables.interval([a[k] - b[k] for k in seeds])
    side = ("above 0: LOPD ahead" if mean - half > 0 else "below 0: LOPD behind" if mean + half < 0
            else "contains 0: not separated")
    return (f"LOPD − {method_name(other)} at the end, paired over {len(seeds)} seeds: {mean:+.3f} ± {s:.3f}, 95% "
            f"interval [{mean - half:+.3f}, {mean + half:+.3f}] ({side}).")


def method_name(method: str) -> str:
    """A --method's name as the tables print it: its student row without " student" (Skill-SD, LOPD, ...)."""
    return train.METHODS[method].label.removesuffix(" student")


def figure4_table(rows) -> str:
    """Reward (mean ± std over seeds) at each evaluated generation count, Figure 4's curves first, and the paper's
    efficiency question: how many generations LOPD needs to reach GRPO's and Skill-SD's final rewards, as a share
    of theirs (the abstract: "surpassing GRPO and Skill-SD with less than 30% of their rollout budget")."""
    curves = _curves(rows)
    gens = [g for g, _, _ in curves[next(iter(curves))]]
    lines = ["| training generations | " + " | ".join(method_name(m) for m in curves) + " |",
             "|---|" + "---|" * len(curves)]
    for i, g in enumerate(gens):
        lines.append(f"| {g} | " + " | ".join(f"{c[i][1]:.3f} ± {c[i][2]:.3f}" if i < len(c) else ""
                                                for c in curves.values()) + " |")
    paper = [f"{method_name(m)} {v}" for m, v in PAPER_FIGURE4.items() if m in curves]
    lines += ["", "Paper (Qwen3-4B, EnvScaler, §4.3: LOPD's by generation 576, the others' at 1,600): " +
              ", ".join(paper) + "."] if paper else []
    bank = next((r["generations"] for r in rows if r["method"] == "lopd" and r["step"] == 0), 0)
    lines += ["", "At the end, mean ± sample std [95% interval]: " + "; ".join(
        "{} {:.3f} ± {:.3f} [{:.3f}, {:.3f}]".format(method_name(m), *end_interval(rows, m)) for m in curves) + "."]
    for other in ("grpo", "skillsd"):
        if "lopd" in curves and other in curves:
            lines += ["", reach_line(curves, other, bank), "", paired_line(rows, other)]
    lines += ["", pool_line(rows)]
    seeds = len({r["seed"] for r in rows})
    return "\n".join(lines) + (f"\n\n{seeds} seeds; mean ± sample std (ddof = 1) over seeds; the student alone on "
                               "held-out tasks.\n")


def end_interval(rows, method: str) -> tuple:
    """(mean, s, low, high) of the method's final rewards over seeds."""
    mean, s, half = tables.interval(list(final_rewards(rows, method).values()))
    return mean, s, mean - half, mean + half


def pool_line(rows) -> str:
    """Which methods' generations also count rollouts made before their first step (the bank, or the pool it
    seeds), and how many: the curves' axis leaves them out, the CSV's `generations` column and the plot's right
    panel count them."""
    pools = {r["method"]: r["generations"] for r in rows if r["step"] == 0 and r["generations"]}
    if not pools:
        return "No method read rollouts made before its first step."
    return ("Rollouts made before the first step, left out of the axis above and counted in the plot's right panel: "
            + ", ".join(f"{method_name(m)} {n}" for m, n in pools.items()) + " (the base's rollouts that built the "
            "bank; the other methods read none).")


def reach_line(curves: dict, other: str, bank: int) -> str:
    """Where LOPD's mean curve first reaches `other`'s final mean reward, as a share of `other`'s generations."""
    name, (total, target, _) = method_name(other), curves[other][-1]
    hit = next((g for g, mean, _ in curves["lopd"] if mean >= target), None)
    flat = (f"{name} did not improve on the base ({curves[other][0][1]:.3f} -> {target:.3f}). "
            if target <= curves[other][0][1] else "")  # then "LOPD reaches it" holds at 0 generations, saying nothing
    return flat + f"{name}'s final reward {target:.3f} after {total} generations. " + (
        f"LOPD first reaches it after {hit} training generations ({hit / total:.0%} of {name}'s; "
        f"{(hit + bank) / total:.0%} counting the {bank} rollouts that built its bank)." if hit is not None
        else "LOPD does not reach it within the budget.")


def plot_figure4(rows, path: str, title: str = "Figure 4 at toy scale"):
    """Reward against generations, one line per method: Figure 4's three solid, the further rows dashed; on the
    left the training generations, on the right every generation, the bank's rollouts included for the methods
    that read it (skipped with a message without matplotlib)."""
    plt = _pyplot()
    if plt is None:
        return
    pools = {r["method"]: r["generations"] for r in rows if r["step"] == 0}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for m, pts in _curves(rows).items():
        g, mean, std = (np.array(x) for x in zip(*pts))
        drawn = m in FIGURE4_DRAWN
        for ax, x in zip(axes, (g, g + pools.get(m, 0))):
            ax.plot(x, mean, marker="o" if drawn else ".", linestyle="-" if drawn else "--", label=method_name(m),
                    alpha=1.0 if drawn else 0.6)
            if drawn:
                ax.fill_between(x, mean - std, mean + std, alpha=0.15)
    axes[0].set_xlabel("training generations (rollouts)")
    axes[1].set_xlabel("generations, the bank's rollouts included")
    axes[0].set_ylabel("held-out reward, student alone (± sample std)")
    fig.suptitle(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


# ----------------------------------------------------------------------------------------------------------------
# The difficulty dial: when does LOPD beat outcome RL? (the paper's efficiency claim, Figure 4)
# ----------------------------------------------------------------------------------------------------------------
# K hidden conventions per shop (train.py --conventions K; tool_world.WORLD_CONVENTIONS), each with its own shipped toy
# backbone. Per K and seed: one base, bank and φ0 (train.prepare), then each method's joint stage from them. LOPD
# runs twice: with the paper's margin (δ against the student) and with δ against φ0's teacher (the teacher-drift
# remedy, --privilege-against phi0). RFT spends no rollouts of its own (it re-reads the bank's successes).
DIAL_METHODS = {"lopd": {}, "lopd-phi0": {"privilege_against": "phi0"}, "grpo": {"method": "grpo"},
                "rft": {"method": "rft"}}
# 40 iterations of 32 rollouts (1,280 generations; the other tables run 60), the student on 100 held-out tasks at
# 0, 640 and 1,280 generations, the endpoint on all 200 (docs/results.md, "The difficulty dial: when does LOPD beat
# outcome RL?" gives its cost and its results).
DIAL = {"steps": 40, "eval_every": 20, "eval_tasks": 100}
DIAL_KS = (1, 2, 3, 4)


def dial_seed(args: train.Args) -> list[dict]:
    """One K and seed of the dial. Returns long rows {k, seed, method, measure, step, generations, value}:
    measure is "student" (the student alone on the first --eval-tasks held-out tasks, at `step`), "student_end"
    and "teacher" (base + composer, at step 0 with φ0 and at the end with the method's composer) on every held-out
    task, "flat_groups" (GRPO: the share of its groups whose rewards were all equal, so no signal), or the base's
    "vanilla", "bank" (entries) and "recall3_shop" (same-shop recall@3 of held-out queries). Cached in
    OUT/dial.json."""
    done = os.path.join(args.out, "dial.json")
    if os.path.isfile(done):
        return json.load(open(done))
    run = train.prepare(args)
    start = train.evaluate(args, run, None, run.test, which=("vanilla", "base + composer"))
    curve0 = train.evaluate(args, run, None, run.test[:args.eval_tasks], which=("vanilla",))["vanilla"]["reward"]
    rows = [_row(args, "base", "vanilla", 0, 0, start["vanilla"]["reward"]),
            _row(args, "base", "teacher", 0, 0, start["base + composer"]["reward"])]
    bank = _logged(os.path.join(args.out, "metrics.jsonl"), "bank")
    if bank:           # the bank's size and how often retrieval finds the same shop (2^K shops)
        rows += [_row(args, "base", "bank", 0, 0, bank[max(bank)]["entries"]),
                 _row(args, "base", "recall3_shop", 0, 0, bank[max(bank)]["recall3_variant"])]
    for method, change in DIAL_METHODS.items():
        rows += dial_method(dataclasses.replace(args, out=os.path.join(args.out, method), resume=True, **change),
                            run, method, curve0)
    checkpoints.write_json(done, rows)
    return rows


def dial_method(margs: train.Args, run: dict, method: str, curve0: float) -> list[dict]:
    """One method's joint stage from the seed's θ̄ and φ0, and its rows (dial_seed's docstring)."""
    os.makedirs(margs.out, exist_ok=True)
    checkpoints.reset_composer(run.composer, os.path.join(os.path.dirname(margs.out), "composer0"))
    student = train.joint_training(dataclasses.replace(run, args=margs, student=fresh_student(run), log=log_of(margs)))
    last = _logged(os.path.join(margs.out, "metrics.jsonl"), margs.method)
    rows = [_row(margs, method, "student", 0, 0, curve0)]
    rows += [_row(margs, method, "student", k + 1, r["generations"], r["reward/eval"])
             for k, r in sorted(last.items()) if "reward/eval" in r]
    which = ("student", "base + composer") if train.METHODS[margs.method].trains_composer else ("student",)
    end = train.evaluate(margs, run, student, run.test, which=which)
    gens = last[max(last)]["generations"]
    rows.append(_row(margs, method, "student_end", margs.steps, gens, end[train.student_row(margs)]["reward"]))
    if "base + composer" in end:
        rows.append(_row(margs, method, "teacher", margs.steps, gens, end["base + composer"]["reward"]))
    if margs.method == "grpo":
        groups = len(last) * margs.rollouts_per_step // margs.group
        flat = sum(r["grpo/zero_adv_groups"] for r in last.values())
        rows.append(_row(margs, method, "flat_groups", margs.steps, gens, flat / groups))
    return rows


def _row(args, method, measure, step, generations, value) -> dict:
    return dict(k=args.conventions, seed=args.seed, method=method, measure=measure, step=step,
                generations=generations, value=value)


def _logged(path: str, stage: str) -> dict:
    """{step: the last record of `stage` at that step} from a metrics.jsonl ({} when there is none): a resumed run
    may have logged a step twice, and the last one counts."""
    last = {}
    if os.path.isfile(path):
        for rec in map(json.loads, open(path)):
            if rec.get("stage") == stage:
                last[rec.get("step", 0)] = rec
    return last


def retrieval_split(args: train.Args) -> list[dict]:
    """How much of the teacher's reward at φ0 rests on retrieval finding the task's own shop: base + composer on
    every held-out task (the dial's "teacher" at step 0, from the same seed), split by how many of the task's J
    references come from its shop: all, some, none. Rows as dial_seed's, method "base", measure
    "teacher_refs_{all|some|none}" (mean reward of that group) and "share_refs_{...}" (its share of the tasks).
    Cached in OUT/retrieval.json."""
    done = os.path.join(args.out, "retrieval.json")
    if os.path.isfile(done):
        return json.load(open(done))
    run, keep = train.prepare(args), {}
    checkpoints.reset_composer(run.composer, os.path.join(args.out, "composer0"))
    train.evaluate(args, run, None, run.test, which=("base + composer",), keep=keep)
    refs = lopd.retrieve(run.retriever, run.test, args.n_ret, args.retrieval)      # what that teacher read
    own = [sum(e.get("meta", {}).get("variant") == t.variant for e in es) for t, es in zip(run.test, refs)]
    group = ["all" if n == args.n_ret else "none" if n == 0 else "some" for n in own]
    rows = []
    for g in ("all", "some", "none"):
        rewards = [ep.reward for ep, gi in zip(keep["base + composer"], group) if gi == g]
        rows.append(_row(args, "base", f"share_refs_{g}", 0, 0, len(rewards) / len(group)))
        if rewards:
            rows.append(_row(args, "base", f"teacher_refs_{g}", 0, 0, float(np.mean(rewards))))
    checkpoints.write_json(done, rows)
    return rows


def convention_split(args: train.Args) -> list[dict]:
    """Which conventions each student learned: vanilla and each method's final student on every held-out task,
    the share of episodes that took each convention's step exactly when the shop requires it
    (tool_world.conventions_kept). Rows as dial_seed's, measure "kept_{convention}". Cached in OUT/conventions.json."""
    done = os.path.join(args.out, "conventions.json")
    if os.path.isfile(done):
        return json.load(open(done))
    run, rows = train.prepare(args), []
    student = run.student or models.full_student(args, run.source)
    for method in ("base", *DIAL_METHODS):
        keep, which = {}, ("vanilla",) if method == "base" else ("student",)
        if method != "base":
            models.load_student_weights(student, os.path.join(
                checkpoints.latest_checkpoint(os.path.join(args.out, method)), "student"))
        train.evaluate(args, run, student, run.test, which=which, keep=keep)
        kept = [tool_world.conventions_kept(ep.task, ep.trace) for ep in next(iter(keep.values()))]
        rows += [_row(args, method, f"kept_{c}", 0, 0, float(np.mean([k[c] for k in kept]))) for c in kept[0]]
    checkpoints.write_json(done, rows)
    return rows


def dial(args: train.Args, seeds: int = 3, ks=DIAL_KS, given=()):
    """`python -m scripts.experiments dial [--ks 1,2,3,4] [--seeds 3]`: every K × seed (OUT/kK/seedI), then OUT/dial.csv,
    dial.md and dial.png. Runs for several --ks into the same --out add up: each K and seed is cached. DIAL's
    sizes apply unless their flag is among `given` (the command line)."""
    flags = {g.split("=")[0] for g in given}
    args = dataclasses.replace(args, **{k: v for k, v in DIAL.items() if "--" + k.replace("_", "-") not in flags})
    rows = []
    for k in ks:
        kargs = dataclasses.replace(args, conventions=k)
        if not args.model:
            kargs = dataclasses.replace(kargs, model=train.toy_backbone(kargs))
        for i in range(seeds):
            sargs = dataclasses.replace(kargs, seed=args.seed + i, out=os.path.join(args.out, f"k{k}", f"seed{i}"))
            rows += dial_seed(sargs) + retrieval_split(sargs) + convention_split(sargs)
    keys = ("k", "seed", "method", "measure", "step", "generations", "value")
    with open(os.path.join(args.out, "dial.csv"), "w") as f:
        f.write(",".join(keys) + "\n")
        f.writelines(",".join(str(r[key]) for key in keys) + "\n" for r in rows)
    table = dial_table(rows)
    with open(os.path.join(args.out, "dial.md"), "w") as f:
        f.write(table)
    print("\n" + table)
    plot_dial(rows, os.path.join(args.out, "dial.png"))


def _values(rows, k, method, measure, step=None) -> dict:
    """{seed: value} of one K, method and measure (at `step`, if given)."""
    return {r["seed"]: r["value"] for r in rows if r["k"] == k and r["method"] == method and r["measure"] == measure
            and (step is None or r["step"] == step)}


def _mean(vals, fmt: str) -> str:
    return format(float(np.mean(vals)), fmt) if len(vals) else ""


def _ms(vals) -> str:
    return f"{np.mean(vals):.3f} ± {np.std(vals):.3f}" if len(vals) else ""


def dial_gaps(rows) -> dict:
    """{(k, "LOPD − GRPO" | "LOPD − RFT"): per-seed differences of the students' endpoint rewards}: paired, as
    both students of a seed start from the same base, bank and φ0."""
    out = {}
    for k in sorted({r["k"] for r in rows}):
        lopd_end = _values(rows, k, "lopd", "student_end")
        for other in ("grpo", "rft"):
            o = _values(rows, k, other, "student_end")
            out[(k, f"LOPD − {other.upper()}")] = [lopd_end[s] - o[s] for s in sorted(lopd_end) if s in o]
    return out


def dial_table(rows) -> str:
    """Two markdown tables: per K the endpoints (mean ± std over seeds) and the gaps; per K and method the
    student on the first --eval-tasks held-out tasks at each evaluated budget."""
    ks, gaps = sorted({r["k"] for r in rows}), dial_gaps(rows)
    lines = ["| K | vanilla | teacher φ0 | LOPD | GRPO | RFT | LOPD − GRPO | LOPD − RFT | GRPO flat groups | "
             "teacher end, LOPD | LOPD (δ vs φ0) | teacher end, δ vs φ0 | bank | same-shop recall@3 |",
             "|---|" + "---|" * 13]
    for k in ks:
        v = lambda method, measure: list(_values(rows, k, method, measure).values())     # noqa: E731
        teacher = lambda method: [r["value"] for r in rows if r["k"] == k and r["method"] == method   # noqa: E731
                                  and r["measure"] == "teacher"]
        lines.append(f"| {k} | {_ms(v('base', 'vanilla'))} | {_ms(teacher('base'))} | "
                     f"{_ms(v('lopd', 'student_end'))} | {_ms(v('grpo', 'student_end'))} | "
                     f"{_ms(v('rft', 'student_end'))} | {_ms(gaps[(k, 'LOPD − GRPO')])} | "
                     f"{_ms(gaps[(k, 'LOPD − RFT')])} | {_ms(v('grpo', 'flat_groups'))} | {_ms(teacher('lopd'))} | "
                     f"{_ms(v('lopd-phi0', 'student_end'))} | {_ms(teacher('lopd-phi0'))} | "
                     f"{_mean(v('base', 'bank'), '.0f')} | {_mean(v('base', 'recall3_shop'), '.2f')} |")
    seeds = len({r["seed"] for r in rows})
    lines += ["", f"Held-out reward of the student alone at the end (all held-out tasks); {seeds} seed"
              f"{'s' if seeds > 1 else ''}, mean ± std "
              "(gaps: of the per-seed differences). Teacher: base + composer.", "",
              "| K | method | " + " | ".join(f"{g} generations" for g in _budgets(rows)) + " |",
              "|---|---|" + "---|" * len(_budgets(rows))]
    for k in ks:
        for method in DIAL_METHODS:
            cells = [_ms(list(_values(rows, k, method, "student", step).values())) for step in _steps(rows)]
            lines.append(f"| {k} | {method} | " + " | ".join(cells) + " |")
    lines += ["", "The student alone on the first --eval-tasks held-out tasks at each budget (training generations; "
              "LOPD also spent its bank's base rollouts, RFT only those)."]
    if any(r["measure"].startswith("share_refs_") for r in rows):
        lines += ["", "| K | teacher φ0 | tasks whose J references all come from its shop | teacher on them | "
                  "tasks with none from its shop | teacher on them |", "|---|---|---|---|---|---|"]
        for k in ks:
            v = lambda measure: list(_values(rows, k, "base", measure, 0).values())     # noqa: E731
            lines.append(f"| {k} | {_ms(v('teacher'))} | {_ms(v('share_refs_all'))} | {_ms(v('teacher_refs_all'))} | "
                         f"{_ms(v('share_refs_none'))} | {_ms(v('teacher_refs_none'))} |")
        lines += ["", "The teacher at φ0 split by what retrieval gave it (`retrieval_split`); a mean over the seeds "
                  "where the group is not empty."]
    kept = sorted({r["measure"][5:] for r in rows if r["measure"].startswith("kept_")},
                  key=lambda c: list(tool_world.CONVENTION_TOOLS).index(c))
    if kept:
        lines += ["", "| K | student | " + " | ".join(kept) + " |", "|---|---|" + "---|" * len(kept)]
        for k in ks:
            for method in ("base", *DIAL_METHODS):
                cells = [_ms(list(_values(rows, k, method, f"kept_{c}").values())) for c in kept]
                lines.append(f"| {k} | {'vanilla' if method == 'base' else method} | " + " | ".join(cells) + " |")
        lines += ["", "Share of held-out episodes that took each convention's step exactly when the shop requires it "
                  "(`convention_split`; verification counts only when taken before the first change)."]
    return "\n".join(lines) + "\n"


def _steps(rows) -> list:
    return sorted({r["step"] for r in rows if r["measure"] == "student"})


def _budgets(rows) -> list:
    """Training generations at each evaluated step (GRPO's count: 32 a step; LOPD's is the same past its bank)."""
    per = {r["step"]: r["generations"] for r in rows if r["measure"] == "student" and r["method"] == "grpo"}
    return [per.get(s, s) for s in _steps(rows)]


def plot_dial(rows, path: str):
    """Left: the endpoint gaps LOPD − GRPO and LOPD − RFT against K (mean ± std over seeds). Right: each
    student's endpoint, the teacher at φ0 and vanilla against K."""
    plt = _pyplot()
    if plt is None:
        return
    ks, gaps = sorted({r["k"] for r in rows}), dial_gaps(rows)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for i, name in enumerate(("LOPD − GRPO", "LOPD − RFT")):
        vals = [gaps[(k, name)] for k in ks]
        a.errorbar(np.array(ks) + 0.05 * (2 * i - 1), [np.mean(v) for v in vals], yerr=[np.std(v) for v in vals],
                   marker="o", capsize=4, label=name)
    a.axhline(0, color="k", lw=0.8)
    a.set_xticks(ks)
    a.set_xlabel("hidden conventions per shop (K)")
    a.set_ylabel("gap in held-out reward (student alone)")
    a.set_title("LOPD against outcome RL")
    a.legend()
    series = [("lopd", "student_end", "LOPD"), ("grpo", "student_end", "GRPO"), ("rft", "student_end", "RFT"),
              ("lopd-phi0", "student_end", "LOPD, δ vs φ0"), ("base", "teacher", "teacher (φ0)"),
              ("base", "vanilla", "vanilla")]
    for method, measure, label in series:
        vals = [list(_values(rows, k, method, measure, 0 if method == "base" else None).values()) for k in ks]
        b.errorbar(ks, [np.mean(v) for v in vals], yerr=[np.std(v) for v in vals], marker="o", capsize=3,
                   label=label, ls="--" if method == "base" else "-")
    b.set_xticks(ks)
    b.set_xlabel("hidden conventions per shop (K)")
    b.set_ylabel("held-out reward")
    b.set_title("Endpoints (1,280 training generations)")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


# ----------------------------------------------------------------------------------------------------------------
# Does the student absorb its teacher? The official code's settings at toy scale, one at a time
# ----------------------------------------------------------------------------------------------------------------
# Every row starts from the same θ̄ and bank per seed. A row whose change reaches the cold start (K, what retrieval
# returns, the cold start's optimizers) trains its own φ0 in its folder from the seed's cached stages 1-3; the
# others start from the seed's φ0. Every row runs ABSORB_STEPS iterations of 32 rollouts (the generations GRPO and
# RFT get); the best LOPD row and GRPO then continue to twice as many from their checkpoints. Each row is one job,
# cached in OUT/seedI/ROW/absorb.json, so two processes started on the same --out share the work (a job is claimed
# by an O_EXCL file holding the worker's pid; a dead worker's claim is taken over).
OFFICIAL = {"latents": 32, "retrieval": "self", "lr": 1e-5, "task_order": "epoch", "cold_optim": "split",
            "qformer_dtype": "bfloat16"}
VANILLA = "vanilla and φ0's teacher"
ABSORB_ROWS = {          # row: train.py's changes; the rows are run in this order, every seed before the next row
    VANILLA: None,
    "LOPD, toy defaults": {},
    "GRPO": {"method": "grpo"},
    "RFT": {"method": "rft"},
    "official at toy scale (all six)": OFFICIAL,
    "K = 32 latents": {"latents": 32},
    "self-retrieval allowed": {"retrieval": "self"},
    "oracle same-shop retrieval": {"retrieval": "shop"},
    "student lr 1e-5": {"lr": 1e-5},
    "KL per trajectory (eq. 10)": {"kl_per": "trajectory"},
    "epoch task order": {"task_order": "epoch"},
    "cold start: two AdamW, clips 30/3": {"cold_optim": "split"},
    "bf16 QFormer": {"qformer_dtype": "bfloat16"},
}
OWN_COLD_START = ("latents", "retrieval", "cold_optim")     # changes that need the row's own φ0
ABSORB_STEPS = 60
LONG = ", twice the iterations"
# A course's staged path at the exercises' scale (docs/exercises.md's sizes): each stage adds one piece of LOPD to
# the one before, from one θ̄, bank and φ0 per seed, so each is motivated by what the one before leaves undone; then
# the exercises' runs that are not a stage, so that every answer cites a figure of OUT/course.csv.
COURSE_ROWS = {
    VANILLA: None,
    "1. OPSD: the teacher reads a success as text": {"method": "opsd"},
    "2. latents instead of text, the composer frozen": {"freeze_composer": True},
    "3. the composer learns, no margin (m = 0)": {"margin": 0.0, "anchor": 0.0},
    "4. the margin and β (m = 0.05), no anchor": {"anchor": 0.0},
    "5. the full method (+ the anchor λ = 0.2)": {},
    # at the paper's composer lr 1e-5, 20 iterations barely move φ: stages 3-5 again with a 10× larger step
    "3'. stage 3, the composer's lr 1e-4": {"margin": 0.0, "anchor": 0.0, "composer_lr": 1e-4},
    "4'. stage 4, the composer's lr 1e-4": {"anchor": 0.0, "composer_lr": 1e-4},
    "5'. stage 5, the composer's lr 1e-4": {"composer_lr": 1e-4},
    # the exercises' other runs (docs/exercises.md): stage 5 is exercise 1's run, stage 1 exercise 4's, stage 2 6's
    "exercise 2: m = 0, the anchor kept": {"margin": 0.0},
    "exercise 3: other shops' references": {"retrieval": "other"},
    "exercise 5: M = 1": {"top_m": 1},
    "exercise 7: GRPO": {"method": "grpo"},
    "exercise 8: RFT": {"method": "rft"},
}
COURSE = {"n_train": 300, "n_test": 100, "steps": 20, "eval_every": 10, "eval_tasks": 50}
ROWS = {"absorb": ABSORB_ROWS, "course": COURSE_ROWS}


def absorb(args: train.Args, seeds: int = 3, given=(), report: bool = False):
    """`python -m scripts.experiments absorb [--seeds 3]`: every row × seed, then the long runs, then OUT/absorb.csv,
    absorb.md and absorb.png. --workers 2 (or two processes on the same --out, OMP_NUM_THREADS=1 each) uses two
    cores. A
    --steps on the command line replaces ABSORB_STEPS (the long runs: twice as many). `report`: run nothing, write
    the table from the rows finished so far."""
    given_steps = any(g.split("=")[0] == "--steps" for g in given)
    args = dataclasses.replace(args, steps=args.steps if given_steps else ABSORB_STEPS, eval_every=0)
    _run_rows("absorb", args, seeds, report)


def course(args: train.Args, seeds: int = 3, given=(), report: bool = False, stages: bool = False):
    """`python -m scripts.experiments course [--seeds 3] [--stages]`: the staged path of the walk-through, each row × seed
    at the exercises' scale (COURSE, unless its flag is given), then OUT/course.csv, course.md, course.png and the Δ
    and β curves of the stages trained by eq. 13, course-curves.png. `stages`: vanilla and stages 1-5 only."""
    flags = {g.split("=")[0] for g in given}
    args = dataclasses.replace(args, **{k: v for k, v in COURSE.items() if "--" + k.replace("_", "-") not in flags})
    rows = [r for r, c in ROWS["course"].items() if c is None or _stage(r) in {(n, False) for n in range(1, 6)}]
    _run_rows("course", args, seeds, report, rows if stages else None)
    plot_course_curves(args.out, seeds)


def plot_course_curves(out: str, seeds: int):
    """OUT/course-curves.png: Δ and β per iteration (mean over seeds) for the stages trained by LOPD's loss (the
    frozen composer's too: its Δ and β are logged), read back from each row's metrics.jsonl; the margin m dotted."""
    plt = _pyplot()
    if plt is None:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for row, change in ROWS["course"].items():
        if _stage(row) is None or change.get("method", "lopd") != "lopd":
            continue                                        # the stages trained by eq. 13 (φ frozen or not)
        runs = [_logged(os.path.join(_seed_row_dir(os.path.join(out, f"seed{i}"), row), "metrics.jsonl"), "lopd")
                for i in range(seeds)]
        runs = [r for r in runs if r]
        if not runs:
            continue
        steps = sorted(set.intersection(*(set(r) for r in runs)))
        number, primed = _stage(row)
        style = dict(color=f"C{number}", ls="--" if primed else "-", marker=".", label=row)
        for ax, key in ((a, "privilege/delta"), (b, "dual/beta")):   # one colour a stage; dashed: lr 1e-4
            ax.plot(steps, [np.mean([r[t][key] for r in runs]) for t in steps], **style)
    a.axhline(0.05, ls=":", color="k", lw=0.8)
    a.text(0, 0.048, "the margin m = 0.05", fontsize=7, va="top")
    a.set_title("Δ, the teacher's outcome-weighted privilege (eq. 12)")
    b.set_title("β, the dual variable (eq. 13)")
    for ax in (a, b):
        ax.set_xlabel("iteration")
    b.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "course-curves.png"), dpi=120)
    print(f"plot: {os.path.join(out, 'course-curves.png')}")


def _run_rows(kind: str, args: train.Args, seeds: int, report: bool, only=None):
    """Every job (row, seed) of ROWS[kind] (or of the rows `only` lists) not yet done, claimed one at a time
    (several workers share them), the seed's VANILLA row first; then the table from every finished row."""
    if not args.model:
        args = dataclasses.replace(args, model=train.toy_backbone(args))
    seed_args = [dataclasses.replace(args, seed=args.seed + i, out=os.path.join(args.out, f"seed{i}"))
                 for i in range(seeds)]
    while not report:
        jobs = [(row, a) for row in (only or ROWS[kind]) for a in seed_args]
        if kind == "absorb" and all(_absorbed(a, row, kind) for row, a in jobs):   # the long runs wait for the rest
            jobs += [(row + LONG, a) for row in (_best_lopd_row(seed_args), "GRPO") for a in seed_args]
        todo = [(row, a) for row, a in jobs if not _absorbed(a, row, kind)]
        ready = [(row, a) for row, a in todo if row == VANILLA or _absorbed(a, VANILLA, kind)]   # the seed's stages
        if not todo:
            break
        job = next(((row, a) for row, a in ready if _claim(a, row)), None)
        if job is None:                                     # everything left is another worker's: wait for it
            time.sleep(15)
            continue
        absorb_row(*job, kind=kind)
    rows = [r for a in seed_args if os.path.isfile(os.path.join(a.out, f"{kind}.json"))
            for r in json.load(open(os.path.join(a.out, f"{kind}.json")))]
    _write_absorb(args.out, rows, kind)


def _row_dir(a: train.Args, row: str) -> str:
    return _seed_row_dir(a.out, row)


def _seed_row_dir(seed_out: str, row: str) -> str:
    return os.path.join(seed_out, _slug(row.replace("φ0", "phi0")))


def _stage(row: str):
    """A course row's stage: (its number, whether it is a primed lr-1e-4 repeat), or None for other rows."""
    m = re.match(r"(\d)('?)\. ", row)
    return (int(m.group(1)), bool(m.group(2))) if m else None


def _absorbed(a: train.Args, row: str, kind: str = "absorb") -> bool:
    return os.path.isfile(os.path.join(_row_dir(a, row), f"{kind}.json"))


def _claim(a: train.Args, row: str) -> bool:
    """Take the job (row, seed) for this process: an O_EXCL claim file, or a dead process's claim taken over."""
    path = _row_dir(a, row) + ".claim"
    os.makedirs(a.out, exist_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        try:
            os.kill(int(open(path).read() or 0), 0)        # its worker is alive: not ours
            return False
        except (OSError, ValueError):
            os.remove(path)
            return _claim(a, row)
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    return True


def _best_lopd_row(seed_args) -> str:
    """The LOPD row whose student ends highest (mean over seeds)."""
    def mean_student(row):
        return np.mean([json.load(open(os.path.join(_row_dir(a, row), "absorb.json")))["student"] for a in seed_args])
    return max((r for r, c in ROWS["absorb"].items() if c is not None and c.get("method", "lopd") == "lopd"),
               key=mean_student)


def absorb_row(row: str, a: train.Args, kind: str = "absorb"):
    """One job: the row's joint stage (or the seed's vanilla and φ0 rows) and its end evaluation on every held-out
    task, written to ROW/KIND.json and appended to the seed's KIND.json."""
    long = row.endswith(LONG)
    change = ROWS[kind][row[:-len(LONG)] if long else row]
    out = _row_dir(a, row)
    if change is None:
        run = train.prepare(a)
        end = train.evaluate(a, run, None, run.test, which=("vanilla", "base + composer"))
        result = {"vanilla": end["vanilla"]["reward"], "teacher": end["base + composer"]["reward"]}
        return _absorb_result(a, row, out, result, kind)
    rargs = dataclasses.replace(a, out=out, resume=True, steps=2 * a.steps if long else a.steps, **change)
    if long and not os.path.isdir(out):                     # continue the 60-iteration run in a copy of its folder
        shutil.copytree(_row_dir(a, row[:-len(LONG)]), out, ignore=shutil.ignore_patterns("absorb.json"))
    os.makedirs(out, exist_ok=True)
    run = _row_run(a, rargs, change)
    t0 = time.time()
    student = train.joint_training(dataclasses.replace(run, args=rargs, log=log_of(rargs)))
    steps = _logged(os.path.join(out, "metrics.jsonl"), rargs.method)
    lopd_like = rargs.method == "lopd"                         # its teacher moved, and it logged Δ and β
    end = train.evaluate(rargs, run, student, run.test, which=("student", "base + composer") if lopd_like else
                         ("student",))
    result = {"student": end[train.student_row(rargs)]["reward"], "generations": steps[max(steps)]["generations"],
              "seconds_per_step": float(np.mean([r["seconds"] for r in steps.values()])),
              "minutes": round((time.time() - t0) / 60, 1)}
    if lopd_like:                                           # its teacher at the end, Δ and β of the last step
        last = steps[max(steps)]
        result.update(teacher=end["base + composer"]["reward"], delta=last["privilege/delta"], beta=last["dual/beta"])
        result["teacher_curve"] = [r["reward/teacher"] for _, r in sorted(steps.items()) if "reward/teacher" in r]
    _absorb_result(a, row, out, result, kind)


def _row_run(a: train.Args, rargs: train.Args, change: dict) -> dict:
    """Stages 1-4 for a row: the seed's, or with its own φ0 (cold-started in the row's folder from hard links to
    the seed's cached tasks, base rollouts and bank) when the change reaches the cold start."""
    seed_run = train.prepare(a)                             # the seed's stages 1-4, cached after the first row
    if not any(k in change for k in OWN_COLD_START):
        return seed_run
    for name in ("tasks", "bank", "base_rollouts.jsonl"):
        src, dst = os.path.join(a.out, name), os.path.join(rargs.out, name)
        if os.path.exists(src) and not os.path.exists(dst):
            (shutil.copytree if os.path.isdir(src) else shutil.copy2)(src, dst, **(
                {"copy_function": os.link} if os.path.isdir(src) else {}))
    return train.prepare(dataclasses.replace(rargs, steps=a.steps))


def _absorb_result(a: train.Args, row: str, out: str, result: dict, kind: str = "absorb"):
    os.makedirs(out, exist_ok=True)
    result = {"row": row, "seed": a.seed, **result}
    checkpoints.write_json(os.path.join(out, f"{kind}.json"), result)
    whole = os.path.join(a.out, f"{kind}.json")             # the seed's rows, rebuilt from every row's own file
    rows = [json.load(open(os.path.join(_row_dir(a, r), f"{kind}.json")))
            for r in [*ROWS[kind], *(k + LONG for k in ROWS[kind])] if _absorbed(a, r, kind)]
    checkpoints.write_json(whole, rows)
    if os.path.exists(out + ".claim"):
        os.remove(out + ".claim")


def absorb_kept(args: train.Args, seeds: int = 3, row: str = "LOPD, toy defaults") -> list[dict]:
    """Where the student falls short of its teacher: for `row`'s run of each seed, the share of held-out episodes
    that took each convention's step exactly when the shop requires it (tool_world.conventions_kept), for vanilla, the
    teacher at the end (base + the row's final composer) and the student. Rows {seed, who, convention, kept};
    OUT/absorb_kept.json."""
    out = []
    for i in range(seeds):
        a = dataclasses.replace(args, seed=args.seed + i, out=os.path.join(args.out, f"seed{i}"), steps=ABSORB_STEPS)
        run, ckpt = train.prepare(a), checkpoints.latest_checkpoint(_row_dir(a, row))
        student = models.full_student(a, run.source)
        models.load_student_weights(student, os.path.join(ckpt, "student"))
        checkpoints.reset_composer(run.composer, os.path.join(ckpt, "composer"))
        keep = {}
        train.evaluate(a, run, student, run.test, keep=keep)
        for who, eps in keep.items():
            kept = [tool_world.conventions_kept(ep.task, ep.trace) for ep in eps]
            out += [dict(seed=a.seed, who=who, convention=c, kept=float(np.mean([k[c] for k in kept])))
                    for c in kept[0]]
            out.append(dict(seed=a.seed, who=who, convention="reward", kept=float(np.mean([ep.reward for ep in eps]))))
    checkpoints.write_json(os.path.join(args.out, "absorb_kept.json"), out)
    for who in dict.fromkeys(r["who"] for r in out):
        print(who, {c: _ms([r["kept"] for r in out if r["who"] == who and r["convention"] == c])
                    for c in dict.fromkeys(r["convention"] for r in out)})
    return out


def absorb_summary(rows) -> dict:
    """{row: {measure: [one value per seed]}}: student, teacher, efficiency (student − vanilla) / (teacher −
    vanilla), LOPD − GRPO and LOPD − RFT (at the same iterations), generations, seconds per step."""
    by = {(r["row"], r["seed"]): r for r in rows}
    seeds = sorted({r["seed"] for r in rows})
    base = {s: by[(VANILLA, s)] for s in seeds if (VANILLA, s) in by}
    out = {}
    for name in dict.fromkeys(r["row"] for r in rows):
        long = name.endswith(LONG)
        m = {}
        for s in seeds:
            r = by.get((name, s))
            if r is None:
                continue
            if name == VANILLA:
                m.setdefault("vanilla", []).append(r["vanilla"])
                m.setdefault("teacher", []).append(r["teacher"])
                continue
            for k in ("student", "teacher", "generations", "seconds_per_step", "delta", "beta"):
                if k in r:
                    m.setdefault(k, []).append(r[k])
            if "teacher" in r and s in base and r["teacher"] != base[s]["vanilla"]:
                m.setdefault("efficiency", []).append((r["student"] - base[s]["vanilla"]) /
                                                      (r["teacher"] - base[s]["vanilla"]))
            for other in ("GRPO", "RFT"):
                ref = by.get((other + (LONG if long and other == "GRPO" else ""), s))
                if ref is not None and name not in ("GRPO", "RFT", "GRPO" + LONG):
                    m.setdefault(f"LOPD − {other}", []).append(r["student"] - ref["student"])
        out[name] = m
    return out


TABLE_COLUMNS = {"absorb": ("student", "teacher", "efficiency", "LOPD − GRPO", "LOPD − RFT", "generations",
                            "seconds_per_step"),
                 "course": ("student", "teacher", "efficiency", "delta", "beta", "seconds_per_step")}


def absorb_table(rows, kind: str = "absorb") -> str:
    """Markdown: one line per row, mean ± std over seeds of each measure (delta, beta: Δ and β at the last step)."""
    cols = TABLE_COLUMNS[kind]
    lines = ["| row | " + " | ".join(c.replace("_", " ") for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, m in absorb_summary(rows).items():
        if "vanilla" in m:
            name, m = "vanilla (student) / φ0's teacher", {"student": m["vanilla"], "teacher": m["teacher"]}
        cells = [(f"{np.mean(m[c]):.0f}" if c == "generations" else f"{np.mean(m[c]):.2f}" if c == "seconds_per_step"
                  else _ms(m[c])) if c in m else "" for c in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    n = len({r["seed"] for r in rows})
    gaps = (" LOPD − GRPO: the same seed's GRPO student after as many iterations; LOPD − RFT: its RFT student (the "
            "short run's).") if kind == "absorb" else " delta, beta: Δ and β at the last step."
    return "\n".join(lines) + (f"\n\n{n} seeds; mean ± std over seeds. Efficiency: (student − vanilla) / "
                               f"(teacher at the end − vanilla), per seed.{gaps}\n")


def _write_absorb(out: str, rows, kind: str = "absorb"):
    keys = ("row", "seed", "vanilla", "student", "teacher", "delta", "beta", "generations", "seconds_per_step",
            "minutes")
    with open(os.path.join(out, f"{kind}.csv"), "w") as f:
        f.write(",".join(keys) + "\n")
        f.writelines(",".join(f'"{r[k]}"' if k == "row" else str(r.get(k, "")) for k in keys) + "\n" for r in rows)
    table = absorb_table(rows, kind)
    with open(os.path.join(out, f"{kind}.md"), "w") as f:
        f.write(table)
    print("\n" + table)
    title = ("Does the student absorb its teacher? (tool world, toy scale)" if kind == "absorb" else
             "LOPD in five stages (tool world, the exercises' scale)")
    plot_absorb(absorb_summary(rows), os.path.join(out, f"{kind}.png"), title)


def plot_absorb(summary: dict, path: str, title: str):
    """Per row: the student (bar) and its teacher at the end (marker), mean ± std; vanilla and φ0's teacher as
    dashed lines. Skipped with a message without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return
    base = summary.get(VANILLA, {})
    names = [n for n in summary if "student" in summary[n]]
    fig, ax = plt.subplots(figsize=(8, 0.42 * len(names) + 1.8))
    y = range(len(names))
    ax.barh(y, [np.mean(summary[n]["student"]) for n in names], xerr=[np.std(summary[n]["student"]) for n in names],
            capsize=3, color=["tab:gray" if re.search(r"\b(GRPO|RFT)\b", n) else "tab:blue" for n in names],
            label="student alone (grey: GRPO, RFT)")
    ty = [i for i, n in enumerate(names) if "teacher" in summary[n]]
    ax.errorbar([np.mean(summary[names[i]]["teacher"]) for i in ty], ty, fmt="D", color="tab:orange",
                xerr=[np.std(summary[names[i]]["teacher"]) for i in ty], capsize=3, label="its teacher at the end")
    for key in ("vanilla", "teacher"):
        if key in base:
            ax.axvline(np.mean(base[key]), ls="--", lw=1, color="k" if key == "vanilla" else "tab:orange",
                       label="vanilla" if key == "vanilla" else "φ0's teacher")
    ax.set_yticks(list(y), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("held-out reward (mean ± std over seeds)")
    ax.set_title(title)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3 / len(names) - 0.08), ncol=2, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


# Tables 1-2 (scripts/tables.py) train Figure 4's runs: its folders and settings, so that neither trains them twice
TABLE_RUNS = tables.Runs(method_dir=method_dir, curve=CURVE, pyplot=_pyplot)


def table1(args: train.Args, seeds: int = 3, **how):
    """`python -m scripts.experiments table1`: Table 1, tool use (scripts/tables.py)."""
    return tables.table("table1", args, TABLE_RUNS, seeds, **how)


def table2(args: train.Args, seeds: int = 3, **how):
    """`python -m scripts.experiments table2`: Table 2, code (scripts/tables.py)."""
    return tables.table("table2", args, TABLE_RUNS, seeds, **how)


EXPERIMENTS = {"ablations": ablations, "figure4": figure4, "dial": dial, "absorb": absorb, "course": course,
               "table1": table1, "table2": table2}


def main(argv=None):
    """`python -m scripts.experiments NAME [--seeds N] [train.py flags]`."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                epilog="Every other flag is train.py's (python train.py --help).")
    p.add_argument("experiment", choices=sorted(EXPERIMENTS), help="which experiment to run")
    p.add_argument("--seeds", type=int, default=3, help="seeds seed, seed+1, ...; rows are mean ± std (default: 3)")
    p.add_argument("--report", action="store_true", help="absorb and course: run nothing, write the table, CSV and "
                   "plot from the rows finished so far")
    p.add_argument("--kept", action="store_true", help="absorb only: run nothing but absorb_kept, which conventions "
                   "vanilla, the default row's teacher and its student keep (after the rows)")
    p.add_argument("--stages", action="store_true", help="course only: run vanilla and the five stages, not stages "
                   "3'-5' or the exercises' rows (the table shows every row finished so far)")
    p.add_argument("--ks", default="1,2,3,4", help="dial only: the K (hidden conventions per shop) to run, "
                   "comma-separated (default: 1,2,3,4)")
    p.add_argument("--workers", type=int, default=1, help="absorb and course: this many processes share the rows "
                   "of one --out, the cores split between them (default: 1)")
    p.add_argument("--benchmarks", nargs="+", metavar="SPEC", help="table1 and table2 only: the columns, heldout "
                   "(the default) | envscaler=DIR | bfcl-v3[:CATS] | acebench=PATH | benchmark files "
                   "(scripts/tables.py)")
    p.add_argument("--bench-tasks", type=int, default=0, help="table1 and table2 only: the first N tasks of each "
                   "benchmark (0 = all)")
    p.add_argument("--user-model", default="", help="table1 only: ACEBench's user (eval.py --user-model)")
    mine, rest = p.parse_known_args(argv)
    if mine.seeds < 1 or mine.workers < 1 or mine.bench_tasks < 0:
        p.error(f"--seeds and --workers must be at least 1, not {mine.seeds} and {mine.workers}; --bench-tasks at "
                f"least 0, not {mine.bench_tasks}")
    if mine.workers > 1 and mine.experiment not in ("absorb", "course"):
        p.error(f"--workers: only absorb and course share their rows between processes, not {mine.experiment}")
    helpers = start_workers(mine.workers, argv if argv is not None else sys.argv[1:])
    try:
        ks = tuple(int(k) for k in mine.ks.split(","))
    except ValueError:
        ks = ()
    if not ks or any(k not in DIAL_KS for k in ks):
        p.error(f"--ks must list K from 1, 2, 3, 4 separated by commas, not {mine.ks!r}")
    with devices.one_line_errors():
        if mine.experiment in tables.TABLES:
            return EXPERIMENTS[mine.experiment](train.parse_args(tables.train_argv(mine.experiment, rest)), mine.seeds,
                                                specs=mine.benchmarks, opts=tables.Options(mine.bench_tasks,
                                                                                           mine.user_model))
        if mine.experiment == "dial":
            return dial(train.parse_args(rest), mine.seeds, ks, given=rest)
        if mine.experiment == "absorb" and mine.kept:
            args = train.parse_args(rest)
            return absorb_kept(dataclasses.replace(args, model=args.model or train.toy_backbone(args)), mine.seeds)
        if mine.experiment == "course":
            course(train.parse_args(rest), mine.seeds, given=rest, report=mine.report, stages=mine.stages)
            return [h.wait() for h in helpers]
        if mine.experiment == "absorb":
            absorb(train.parse_args(rest), mine.seeds, given=rest, report=mine.report)
            return [h.wait() for h in helpers]
        return EXPERIMENTS[mine.experiment](train.parse_args(rest), mine.seeds)


def start_workers(n: int, argv: list) -> list:
    """--workers N: N − 1 more processes of the same command (the rows are shared through claim files), and every
    process, this one too, on cores / N threads: two processes on both cores' threads each ran several times slower
    than on one each (torch's threads spin against each other)."""
    threads = max(1, (os.cpu_count() or 1) // n)
    if n > 1:
        torch.set_num_threads(threads)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    argv = [a for i, a in enumerate(argv) if not a.startswith("--workers") and
            not (i > 0 and argv[i - 1] == "--workers")]
    return [subprocess.Popen([sys.executable, "-m", "scripts.experiments", *argv], env=env,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) for _ in range(n - 1)]


if __name__ == "__main__":
    main()
