"""Engineering, not the paper: files written atomically, a run's folder, checkpoints and resume.

Every file is written into a temp file and renamed over its path (`atomic_open`): a kill leaves the old file or the
new one. The joint stage saves a checkpoint every --save-every steps (`save_checkpoint`: the student, the composer,
AdamW's states, β and the random streams), published whole by a rename and then named in LATEST, the older one
deleted last (`publish`); the cold start saves its own; the evaluation's rows are written one by one and read
back after a kill (`read_row`). A rerun of the same command continues: each cached stage it reuses is one line
(`reuse`), an unfinished cold start or joint stage goes on from its checkpoint on any number of ranks
(`continue_from`), and a rerun whose settings would join two runs into one stops in one line (`check_same_run`);
--no-resume starts the two stages over.

    python train.py --steps 4 --save-every 2 --out runs/a     # killed, then the same command again: it continues
    python -m pytest tests/test_train.py -q

No deviation from the paper lives here.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
import dataclasses
from contextlib import contextmanager

import numpy as np
import torch

from runtime import models, parallel
from runtime.devices import UserError, say


# ----------------------------------------------------------------------------------------------------------------
# Files written atomically, and a run's folder (its settings read back, made absolute, of one world)
# ----------------------------------------------------------------------------------------------------------------
def cached(path: str) -> bool:
    """Is this stage's output in OUT? Under torchrun only if every rank sees it (nodes without a shared --out
    then all redo the stage together instead of parting ways)."""
    return parallel.all_true(os.path.exists(path))


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


def append_jsonl(path: str, row):
    """Append one JSON line in a single write to a file opened for appending, then flush it to disk: a kill leaves
    every earlier line whole (values JSON cannot write are written as text)."""
    line = (json.dumps(row, default=str) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


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


def reuse(what: str, folder: str, marker: str = "") -> bool:
    """Is this stage's output in OUT (`cached`: folder/marker, the file written last)? If so, one line says it is
    reused and from where."""
    found = cached(os.path.join(folder, marker) if marker else folder)
    if found:
        say(f"{what}: reusing {folder}")
    return found


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
    sharded = {"student": parallel.full_state(student), "ema": parallel.full_state(ema) if ema is not None else None}
    opt_s, rngs = parallel.full_optimizer_state(opts[0]), parallel.gather([rng_state(task_rng)])
    if parallel.rank() != 0:
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
    EMA teacher; `continue_from` has said where from); returns (step, generations)."""
    models.load_student_weights(student, os.path.join(path, "student"))
    if state.get("ema") is not None:
        models.load_student_weights(state["ema"], os.path.join(path, "ema_teacher"))
    reset_composer(composer, os.path.join(path, "composer"))
    # mmap: the optimizer state is read from the page cache as each rank loads its shard, not copied whole per rank
    saved = torch.load(os.path.join(path, "state.pt"), weights_only=False, mmap=True)
    parallel.load_optimizer_state(opts[0], saved["opt_s"])
    if opts[1] is not None:
        opts[1].load_state_dict(saved["opt_c"])
    state.update(saved["state"])
    rngs = saved.get("rng_ranks") or []       # the same number of ranks resumes each rank's own streams
    set_rng_state(rngs[parallel.rank()] if len(rngs) == parallel.world() else saved["rng"], task_rng)
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
    rngs = parallel.gather([rng_state(task_rng)])
    if parallel.rank() != 0:
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
    set_rng_state(rngs[parallel.rank()] if len(rngs) == parallel.world() else saved["rng"], task_rng)
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
    common = {"settings": settings, "sampling": sampling, "world": parallel.world(),
              "device": f"{p.device.type} {p.dtype}", "tasks": [len(tasks), _sha1(ids)]}
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
    """The row written under `key` (on every rank), said in one line, or None: no key, or not finished yet."""
    if key is None or not cached(_row_path(out, key)):
        return None
    saved = json.load(open(_row_path(out, key)))
    if saved["key"] != key:
        return None
    say(f"evaluation, {key['row']}: reusing {_row_path(out, key)}")
    return saved["row"]


def write_row(out: str, key: dict | None, row: dict):
    """A finished row under `key` (rank 0, atomically); no key: nothing."""
    if key is not None and parallel.rank() == 0:
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
# A rerun of the same command: where an unfinished stage goes on, and which changed settings stop it
# ----------------------------------------------------------------------------------------------------------------
def continue_from(args, folder: str = "ckpt"):
    """The checkpoint the joint stage (`folder` ckpt) or the cold start (COLD_CKPT) goes on from: OUT/<folder>'s
    latest, said in one line with its step; None where there is none. --no-resume (args.resume False) removes it
    instead, so that a kill of the run that starts over cannot be continued from the run it replaces. Every rank
    gets the same answer (nodes without a shared --out all start over)."""
    path = latest_checkpoint(args.out, folder)
    if not parallel.all_true(path is not None):
        return None
    stage, flag = ("cold start", "cold_steps") if folder == COLD_CKPT else ("joint stage", "steps")
    if not args.resume:
        say(f"{stage}: starting over at step 0 (--no-resume); removing {path}")
        if parallel.rank() == 0:
            shutil.rmtree(os.path.join(args.out, folder), ignore_errors=True)
        return None
    step = int(os.path.basename(path).removeprefix("step-"))
    total = getattr(args, flag)
    say(f"{stage}: finished ({step} steps, --{flag.replace('_', '-')} {total}): reusing {path} (--no-resume trains "
        "it again)" if step >= total else f"{stage}: continuing from {path} at step {step} of {total} (--no-resume "
        "starts over)")
    return path


# What a rerun may change and still continue OUT's checkpoints: where and how often it writes and evaluates, how far
# it goes, and how this machine runs it (device, precision, engine, the memory plan's budgets). Any other setting
# changes what is trained, and continuing under it would join two runs into one.
RERUN_MAY_CHANGE = UNKEYED + ("quick", "steps", "cold_steps", "engine", "compile_decode", "device", "dtype", "memory",
                              "micro_batch", "token_budget", "kv_budget", "gen_batch", "loss_chunk", "grad_ckpt",
                              "unsafe_no_sandbox")


def check_same_run(args):
    """A rerun that would continue a checkpoint in OUT (the cold start's or the joint stage's) with settings other
    than OUT/args.json's, RERUN_MAY_CHANGE aside: a UserError naming each difference and the two ways on. Called with
    every setting resolved, before args.json is replaced; the same on every rank."""
    pointers = [cached(os.path.join(args.out, folder, "LATEST")) for folder in ("ckpt", COLD_CKPT)]  # each rank: both
    saved = os.path.join(args.out, "args.json")
    if not args.resume or not any(pointers) or not os.path.isfile(saved):
        return
    old, now = json.load(open(saved)), dataclasses.asdict(args)
    changed = [k for k, v in now.items() if k in old and k not in RERUN_MAY_CHANGE and old[k] != v]
    if changed:
        what = ", ".join(f"--{k.replace('_', '-')} {old[k]!r} (now {now[k]!r})" for k in changed)
        raise UserError(f"--out {args.out!r} holds a checkpoint of a run with {what}: continuing it would join two "
                        "runs; --no-resume starts its checkpointed stages over there, or give another --out")
