"""Engineering, not the paper: errors a user can fix, the device and precision, one seed, the log, the time left.

`UserError` is bad input a user can fix: `one_line_errors` prints it as one line and exits with status 2 (train.py,
eval.py). `pick_device` chooses cuda -> mps -> cpu and bf16 on CUDA (fp32 elsewhere); `precision` is the bf16
autocast around the fp32 student beside the bf16 backbone, and the student's bf16 copy that generates under it is
`models.decoding_copy`. `Log` writes metrics.jsonl (and TensorBoard), rank 0 speaking (`say`); `size_line` says what
a run holds before its first stage, and `Clock` turns each stage's first batch into the time the run has left.

    python train.py --quick          # prints its size, the device, then each stage's time left
    python -m pytest tests/test_time_left.py tests/test_decode.py -q

No deviation from the paper lives here.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from runtime import parallel


# ----------------------------------------------------------------------------------------------------------------
# User errors: one line, exit status 2
# ----------------------------------------------------------------------------------------------------------------
class UserError(Exception):
    """Bad input that the user can fix (a model, a folder, a bank the base cannot fill): `main` prints it as one line
    and exits with status 2. Anything else is a bug and raises with its traceback."""


@contextlib.contextmanager
def one_line_errors():
    """Turn a UserError into one line on stderr and exit status 2 (train.py and eval.py)."""
    try:
        yield
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


# The settings made flags (`arg`, `parser_of`, `check_values`, ...) are in runtime/preflight.py, which imports no
# torch: a command line of train.py or eval.py is checked there before torch loads.


# ----------------------------------------------------------------------------------------------------------------
# Device, seed, precision, the log (rank 0 speaks)
# ----------------------------------------------------------------------------------------------------------------
def device_type(device: str) -> str:
    """--device's value -> the device a run uses: auto is the first of cuda, mps, cpu that is available."""
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"


def pick_device(device: str, dtype: str):
    """Device cuda -> mps -> cpu, dtype bf16 on CUDA else fp32, chosen here only; printed with the reason."""
    if device == "auto":
        device = device_type(device)
        why = "auto: first of cuda, mps, cpu that is available"
    else:
        why = "--device"
    if dtype == "auto":
        dtype, dwhy = ("bfloat16", "auto: bf16 on CUDA") if device == "cuda" else ("float32", "auto: fp32 off CUDA")
    else:
        dwhy = "--dtype"
    say(f"device {device} ({why}); dtype {dtype} ({dwhy})")
    return torch.device(device), getattr(torch, dtype)


def seed_everything(seed: int):
    """Seed random, numpy and torch; under torchrun rank r draws its own stream (seed + 10007 r): its rollouts are
    not a copy of rank 0's noise. Weights that must agree across ranks are broadcast (`broadcast_params`)."""
    seed += 10007 * parallel.rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def precision(model):
    """bf16 autocast around everything that runs the fp32 student next to the bf16 backbone (CUDA); a no-op in
    fp32. Losses upcast to fp32 themselves (losses.py); the composer switches autocast off for itself (composer.py,
    deviation 4)."""
    p = next(model.parameters())
    # cache_enabled=False: autocast would otherwise keep a bf16 copy of every fp32 weight it cast (the whole student,
    # ~8 GB for 4B parameters) until the region ends; each forward casts its weights again instead
    return torch.autocast(p.device.type, dtype=p.dtype, enabled=p.dtype != torch.float32, cache_enabled=False)


def say(*a):
    """print on rank 0 only."""
    if parallel.rank() == 0:
        print(*a)


class Log:
    """One line per event on stdout (behaviour counts left out), the full record appended to OUT/metrics.jsonl, the
    source of truth. With `tensorboard` (a folder; train.py --tensorboard) every number of a record is also a scalar
    `stage/name` at the record's step, in a sub-folder named after OUT, so that the runs of scripts/experiments.py sit
    in one TensorBoard. Under torchrun only rank 0 logs (the metrics it gets are already summed or gathered).
    `plan` (`stages_left`) lets its `clock` say how long the run has left; progress bars come from `bar`."""

    def __init__(self, out: str, tensorboard: str = "", plan=None):
        self.path, self.writer, self.events = os.path.join(out, "metrics.jsonl"), None, {}
        self.clock = Clock(plan)
        if tensorboard and parallel.rank() == 0:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise UserError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
            name = os.path.normpath(os.path.abspath(out)).strip(os.sep)
            self.writer = SummaryWriter(os.path.join(tensorboard, name))

    def __call__(self, stage: str, **metrics):
        if parallel.rank() != 0:
            return
        rec = {"stage": stage, **{k: (round(v, 5) if isinstance(v, float) else v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        shown = {k: v for k, v in rec.items() if k != "stage" and not k.startswith("behaviour/")}
        tqdm.write(stage + "  " + "  ".join(f"{k} {v}" for k, v in shown.items()))
        if self.writer is not None:
            self._scalars(stage, rec)

    def _scalars(self, stage: str, rec: dict):
        """The record's numbers as TensorBoard scalars at its step (records without one count per stage)."""
        step = rec.get("step", self.events.get(stage, 0))
        self.events[stage] = self.events.get(stage, 0) + 1
        for k, v in rec.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                self.writer.add_scalar(f"{stage}/{k}", v, step)
        self.writer.flush()

    def bar(self, total: int, desc: str) -> tqdm:
        """A progress bar of rollouts (rank 0's shown) whose first update, a first batch, the clock times."""
        return TimedBar(total=total, desc=desc, leave=False, disable=parallel.rank() != 0,
                        first=lambda seconds, n: self.clock.first("rollout", seconds, n))


class TimedBar(tqdm):
    """A tqdm bar that tells `first(seconds, n)` how long its first update (n items) took from its start, once."""

    def __init__(self, *args, first=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.first, self.started = first, time.time()

    def update(self, n=1):
        shown = super().update(n)
        if self.first is not None:
            first, self.first = self.first, None
            first(time.time() - self.started, n)
        return shown


# ----------------------------------------------------------------------------------------------------------------
# How long the run has left: each stage's first batch gives a rate, one line adds up what is left
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Stage:
    """What a stage has left, in the units the clock times ("rollout", "cold step", "step"); `floor`: what the
    work holds at least in timed units while one of its own is not timed yet (a joint step: its rollouts)."""
    name: str
    work: dict
    floor: dict | None = None


def time_left(stages: list, rates: dict) -> list[tuple]:
    """Each stage's seconds left from measured `rates` (unit -> seconds each) -> [(name, seconds, lower)]: its work
    at those rates; else its floor's, a lower bound (lower True); else None (not timed yet)."""
    out = []
    for stage in stages:
        work = {unit: n for unit, n in stage.work.items() if n}
        if all(unit in rates for unit in work):
            out.append((stage.name, sum(n * rates[unit] for unit, n in work.items()), False))
        elif stage.floor and all(unit in rates for unit in stage.floor):
            out.append((stage.name, sum(n * rates[unit] for unit, n in stage.floor.items()), True))
        else:
            out.append((stage.name, None, False))
    return out


def duration(seconds: float) -> str:
    """'40 s', '12 min', '3 h 10 min'."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60} min"


def time_line(estimates: list) -> str:
    """`time_left`'s estimates as one line: the stage under way first ("left"), then the rest and their sum."""
    parts = [f"{name} not timed yet" if s is None else f"{name} {'≥' if low else '~'}{duration(s)}" +
             (" left" if i == 0 else "") for i, (name, s, low) in enumerate(estimates)]
    bound = "≥" if any(s is None or low for _, s, low in estimates) else "~"
    total = sum(s for _, s, _ in estimates if s is not None)
    return f"time: {', '.join(parts)}; in all {bound}{duration(total)} (estimates from the first batch)"


class Clock:
    """How long the run has left, said once a stage (rank 0): the stage under way (`enter`) times its first batch
    (`first`: seconds per rollout, per cold-start step, per joint step), and one line adds up what every stage from
    it on has left at the rates measured so far. `plan(stage, done)` lists those stages (`stages_left`)."""

    def __init__(self, plan=None):
        self.plan, self.rates, self.said, self.stage, self.done = plan, {}, set(), None, 0

    def enter(self, stage: str, done: int = 0):
        """`stage` is under way, `done` of its units finished before (a resumed one's)."""
        self.stage, self.done = stage, done

    def first(self, unit: str, seconds: float, n: int):
        """n units took `seconds`: the unit's rate (the latest measured), and the line if the stage under way has not
        said it."""
        self.rates[unit] = seconds / max(1, n)
        if self.plan is None or self.stage is None or self.stage in self.said:
            return
        self.said.add(self.stage)
        if parallel.rank() == 0:
            tqdm.write(time_line(time_left(self.plan(self.stage, self.done + n), self.rates)))


STAGES = ("bank", "cold start", "joint", "evaluation")     # the stages of train.py whose time the clock adds up


def size_line(args, n_train: int, n_test: int) -> str:
    """What a run of `args` (train.Args, resolved) holds, in the stages' own units, said before its first stage:
    the base rollouts, the cold-start steps, the joint iterations and their rollouts, the --eval-every checks and
    the final evaluation's rows of held-out tasks (vanilla, base + composer, and the student where there are
    steps). Every rank's work together; how long it takes is said once each stage's first batch is timed (`Clock`)."""
    def count(n, unit):                                       # 1 cold-start step, 60 iterations
        return f"{n:,} {unit}{'s' * (n != 1)}"
    checks = args.steps // args.eval_every if args.eval_every else 0
    rollouts = "on the bank (no rollouts)" if args.method == "rft" else f"of {count(args.rollouts_per_step, 'rollout')}"
    parts = [f"{count(n_train * args.bank_rollouts, 'base rollout')} ({n_train:,} tasks × {args.bank_rollouts})",
             count(args.cold_steps, "cold-start step")]
    parts += [f"{count(args.steps, args.method + ' iteration')} {rollouts}"] if args.steps else []
    parts += [f"{count(checks, 'check')} on {min(args.eval_tasks, n_test):,} held-out tasks"] if checks else []
    parts += [f"{3 if args.steps else 2} rows × {n_test:,} held-out tasks at the end"]
    name = "quick run" if args.quick else "this run"
    return f"{name}: {', '.join(parts)}; the time left is said after each stage's first batch"


def stages_left(args, n_train: int, n_test: int, stage: str, done: int, *, drift_rows: int = 1) -> list[Stage]:
    """What a run of `args` (train.Args) has left from `stage` on (`done` of that stage's units finished), this rank's
    share, in the units the clock times: the bank's base rollouts, the cold start's steps, the joint steps with
    the rollouts of their --eval-every evaluations (`drift_rows` rows each), at least each step's own rollouts until a
    step is timed, and the final evaluation's rows (no student row without steps)."""
    w, at = parallel.world(), lambda name, n: max(0, n - done) if name == stage else n      # noqa: E731
    steps = at("joint", args.steps)
    evals = (args.steps // args.eval_every - (args.steps - steps) // args.eval_every) if args.eval_every else 0
    drift = evals * min(args.eval_tasks, n_test) * drift_rows / w
    per_step = 0 if args.method == "rft" else args.rollouts_per_step / w      # RFT trains on the bank: no rollouts
    rows = 3 if args.steps else 2                                             # vanilla, base + composer, student
    plan = {"bank": Stage("bank", {"rollout": at("bank", n_train * args.bank_rollouts / w)}),
            "cold start": Stage("cold start", {"cold step": at("cold start", args.cold_steps)}),
            "joint": Stage(f"{steps} step{'s' * (steps != 1)}", {"step": steps, "rollout": drift},
                           {"rollout": steps * per_step + drift} if per_step else None),
            "evaluation": Stage("evaluation", {"rollout": at("evaluation", rows * n_test / w)})}
    return [plan[name] for name in STAGES[STAGES.index(stage):] if any(plan[name].work.values())]
