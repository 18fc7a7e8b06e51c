"""Engineering, not the paper: data parallel under torchrun, and FSDP2 for the student.

`dist_setup` joins the process group (gloo on CPU, nccl on CUDA). Every other helper is the identity with one
process and no process group, so the single-process path is exactly the readable code: lopd.py, baselines.py and
train.py call `parallel.all_sum`, `parallel.gathered`, ... by name. `shard_student` shards the full student with
FSDP2 (each decoder layer, then the root); `full_state` and `full_optimizer_state` gather what a checkpoint writes.

    torchrun --nproc-per-node 2 train.py --steps 2       # two processes (gloo on CPU, nccl on CUDA)
    python -m pytest tests/test_distributed.py -q

No deviation from the paper: N ranks compute the gradient and β of one process (the rule is below).
"""
from __future__ import annotations

import datetime
import os
from contextlib import contextmanager

import numpy as np
import torch
import torch.distributed as dist

from runtime import devices


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
    devices.say(f"world size {world()}, backend {backend}")
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
