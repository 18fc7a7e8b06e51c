"""The LOPD pipeline, from a backbone to a trained student, top to bottom (paper §4.1, A.2, B.2, Algorithm 1).

    python train.py                              # toy world, toy backbone, CPU: minutes on a laptop
    python train.py --model Qwen/Qwen3-4B        # the paper's experiment: EnvScaler (B.2-B.3), on CUDA
    python train.py --method grpo                # a baseline on the same loop (rft | grpo | opsd | sdpo)
    python train.py --env code                   # the toy code world; --env FILE.py:CLASS for a world of yours
    torchrun --nproc-per-node 8 train.py --model Qwen/Qwen3-8B   # data parallel on 8 GPUs, one node

The file reads in the order a run does: `Args` (every setting, grouped), `main`, then the stages, each cached in
--out so that a rerun continues where a kill stopped it (each reuse said in a line; --no-resume: stages 4-5 anew):
  1. backbone      the toy backbone (worlds/toy_backbone.py) or --model; what depends on it (`fit_to_model`)
  2. base rollouts the base model on the world's training tasks (worlds/)
  3. bank          successful rollouts -> experience bank + FAISS index + cached query embeddings (retrieval.py)
  4. cold start    composer φ0 by eq. (14) on the bank's own trajectories (composer.py)
  5. joint         --steps iterations of --method: Algorithm 1 (lopd.py) or a baseline (baselines.py)
  6. evaluation    vanilla / base + composer / student on held-out tasks (`evaluate`, Table 3; worlds/results.py)
and last the command line (`parse_args`, `resolve_defaults`); stages 2, 4-6 say the time left (devices.Clock).
Engineering (devices, seeds, torchrun, checkpoints, memory plan, the student): runtime/. Others load runs: `load_run`.

Defaults follow B.2 and the official code except where the toy needs its own (`TOY_DEFAULTS`, each with its
reason; a world may add its own). The one that changes the method: on the toy world the composer encodes the
reference without the task (`--composer-input reference`; composer.py, deviation 5). Where the official code
(bingreeky/LOPD) differs and the paper is silent, the default is ours and a flag gives the official setting
(scripts/experiments.py absorb runs each): --cold-optim split, --task-order epoch, --retrieval self,
--qformer-dtype bfloat16; L_distill over the whole batch's tokens is the official code's (--kl-per trajectory: eq.
10 as written). Controls: --method rft, --retrieval other | none | shop; worlds: --conventions K, --shops N.

Real backbones: bf16 weights with the trained ones in fp32 under autocast (`devices.precision`), a memory plan made
before any weight is read (`plan_before_loading`), --student-lora for θ as a second adapter. User errors end the
run with one line and exit status 2. Under torchrun each rank rolls out a slice of each batch, normalisers and Δ are
summed over ranks, the full student is sharded with FSDP2, rank 0 alone logs and writes (runtime/parallel.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import random
import time
from dataclasses import dataclass

from runtime import preflight    # first: as the script being run, it checks the command line before torch loads
import torch
import torch.distributed as dist
from tqdm import tqdm

import baselines
import engine
import lopd
import retrieval
from runtime import checkpoints, devices, memory, models, parallel, serving
from worlds import common, results, sandbox, tool_world
from worlds import toy_backbone as toy
from composer import Composer, ComposerConfig, QFormer, cold_start_batch, cold_start_loss, schema_balanced_sampler
from runtime.devices import UserError, say
from torch.distributed.elastic.multiprocessing.errors import record


arg = preflight.arg       # an `Args` field: its default and its --help text (preflight.parser_of makes the flags)


@dataclass
class Args:
    """Every setting of a run. Fields left at None take the paper default, or the toy default for the toy model
    (`resolve_defaults`); a default written as a config's field (lopd.LOPDConfig.margin) is that config's."""
    # -- the run: which backbone, world, method and folder
    model: str = arg("", "HF causal-LM id or local folder; empty = the offline toy backbone (worlds/toy_backbone.py)")
    env: str = arg("", "the world (worlds/): tools (toy) | code (toy, or --tasks TACO/LiveCodeBench/EvalPlus) | bfcl "
                       "| envscaler (--tasks DIR or hf) | FILE.py:CLASS (docs/adding-an-environment.md). Empty: tools "
                       "for the toy backbone, envscaler for any other --model (B.2-B.3; preflight.default_world)")
    tasks: str = arg("", "folder with train.jsonl and test.jsonl in the world's format; empty = its generated splits "
                         "(envscaler: its release's folder, or hf, the default: the Hugging Face Hub)")
    out: str = arg("runs/toy", "run folder: every stage's output, checkpoints, metrics.jsonl")
    quick: bool = arg(False, "a first look in about a minute: every stage on fewer tasks and steps (QUICK), not a result")
    seed: int = arg(0, "seeds random, numpy and torch (and the toy world's tasks)")
    method: str = arg("lopd", "lopd (Algorithm 1) | rft (control, no rollouts) | grpo | opsd | sdpo | sdft | skillsd")
    conventions: int = arg(2, "hidden conventions per shop of the generated tool world, 1-4 (the dial; 2 elsewhere)")
    shops: int = arg(0, "shops of the generated tool world: 0 = 2^K; 5-64 = the many-shops world (docs/toy-world.md)")
    n_train: int = arg(1000, "generated training tasks (toy world)")
    n_test: int = arg(200, "generated held-out tasks (toy world; the paper's EnvScaler test split has 200)")
    # -- the paper's hyperparameters (B.1, B.2; the toy's own values are in TOY_DEFAULTS)
    n_ret: int = arg(lopd.LOPDConfig.n_ret, "J, experiences retrieved per task (§4.1: 3)")
    latents: int = arg(None, "K, latent tokens per experience (paper 32)")
    composer_input: str = arg(None, "what the composer's encoder reads: task+reference (A.2) | reference (alone)")
    top_m: int = arg(lopd.LOPDConfig.top_m, "M, teacher top-M support of the distillation KL (eq. 9; §4.1: 20)")
    margin: float = arg(lopd.LOPDConfig.margin, "m, the privileged margin (eq. 13; §4.1: 0.05)")
    anchor: float = arg(lopd.LOPDConfig.anchor, "λ, weight of the latent anchor ||c_φ − sg c_φ0||² (B.2: 0.2)")
    dual_lr: float = arg(lopd.LOPDConfig.dual_lr, "η_β, step size of the dual variable β (B.2: 0.5)")
    delta_per: str = arg(lopd.LOPDConfig.delta_per, "Δ normalisation: trajectory (eq. 12) | token")
    kl_per: str = arg(lopd.LOPDConfig.kl_per, "L_distill's normalisation: token (over the whole batch's ω tokens: the official "
                                  "code) | trajectory (eq. 10 as written: the mean of each trajectory's mean)")
    steps: int = arg(None, "joint iterations")
    rollouts_per_step: int = arg(32, "student rollouts per iteration (B.1: 32)")
    lr: float = arg(None, "student learning rate (paper 1e-5)")
    composer_lr: float = arg(None, "composer learning rate during joint training (paper 1e-5)")
    clip: float = arg(lopd.LOPDConfig.clip, "gradient clipping during joint training (B.1: 1.0)")
    temperature: float = arg(engine.SampleConfig.temperature, "sampling temperature for rollouts (B.2: 0.7)")
    top_p: float = arg(engine.SampleConfig.top_p, "nucleus sampling (B.2: 0.95)")
    top_k: int = arg(engine.SampleConfig.top_k, "top-k sampling (B.2: 20)")
    max_new_tokens: int = arg(None, "token budget of one reply")
    max_env_steps: int = arg(None, "environment steps per episode (paper 30)")
    max_len: int = arg(None, "a conversation's token budget (B.2: 40,960; at most the model's context)")
    # -- the pipeline's stages: bank, retrieval, cold start, evaluation, controls
    bank_rollouts: int = arg(2, "base-model rollouts per training task when building the experience bank")
    bank_threshold: float = arg(1.0, "reward a rollout needs to enter the bank (A.3: successful rollouts only)")
    embedder: str = arg("minilm", "f_ret: minilm (offline, PyPI) | backbone | an HF encoder (paper: Qwen3-Embedding-8B)")
    retrieval: str = arg(lopd.LOPDConfig.retrieval, "what the composer reads: same (Ret(x), never the task's own) | self (its own "
                                        "allowed: the official code) | controls: other (other variants only), shop "
                                        "(its own variant only: an oracle), none (no reference)")
    cold_steps: int = arg(None, "cold-start steps of the composer (eq. 14)")
    cold_lr: float = arg(None, "cold-start learning rate (paper 1e-5)")
    cold_batch: int = arg(8, "cold-start batch size (A.2: 8)")
    cold_clip: float = arg(3.0, "cold-start gradient clipping (A.2: 3.0): of ψ and χ, or of ψ with --cold-optim split")
    freeze_composer: bool = arg(lopd.LOPDConfig.freeze_composer, "keep the composer at φ0 in joint training (Figure 3)")
    eval_every: int = arg(None, "every N steps, student and teacher on --eval-tasks held-out tasks (0: at the end)")
    eval_tasks: int = arg(50, "held-out tasks of each --eval-every evaluation (the final one uses all)")
    thinking: bool | None = arg(None, "Qwen3's thinking mode (default: on where the template has the switch, B.3)")
    chat_template: str = arg("", "a Jinja chat-template file for a tokenizer that has none (a base checkpoint)")
    # -- baselines (baselines.py)
    group: int = arg(baselines.BaselineConfig.group, "G, rollouts per task for grpo, sdpo and skillsd (B.1: 4)")
    clip_eps: float = arg(baselines.BaselineConfig.clip_eps, "GRPO's PPO clip ε (B.1: 0.2)")
    ema_rate: float = arg(baselines.BaselineConfig.ema_rate, "SDPO's EMA teacher update rate (B.1: 0.05)")
    sdft_ema_rate: float = arg(baselines.BaselineConfig.sdft_ema_rate, "SDFT's EMA teacher rate α_EMA (B.1: 0.01)")
    sdl_weight: float = arg(baselines.BaselineConfig.sdl_weight, "λ_sdl, Skill-SD's reverse-KL weight (B.1: 0.001)")
    text_context: str = arg(None, "where text teachers read: system | user | span (toy); SDFT, Skill-SD: user unless span")
    # -- settings that exist for one experiment each (experiments.py dial: privilege_against; experiments.py absorb,
    #    the official code's choices one at a time: the other four)
    privilege_against: str = arg(lopd.LOPDConfig.privilege_against, "what δ (eq. 11) measures the teacher against: student (the "
                                                        "paper) | phi0 (the teacher behind c_φ0; losses.py, dev. 6)")
    task_order: str = arg("fresh", "a step's tasks: fresh (drawn anew) | epoch (the official code: shuffled epochs)")
    qformer_dtype: str = arg("float32", "the QFormer's weights in the joint stage: float32 | bfloat16 (official)")
    cold_optim: str = arg("joint", "joint (one AdamW for ψ and χ, one clip) | split (the official code: an AdamW each, "
                                   "ψ clipped at --cold-clip, χ at --cold-qformer-clip)")
    cold_qformer_clip: float = arg(30.0, "the QFormer's cold-start clip with --cold-optim split (official: 30)")
    # -- engineering (runtime/): device, precision, memory, checkpoints
    engine: str = arg("hf", "what generates rollouts: hf (engine.Conversations) | vllm (own virtualenv: real-models.md)")
    compile_decode: bool = arg(False, "--engine hf: decode steps through torch.compile (a GPU option; off: readable)")
    device: str = arg("auto", "auto | cpu | cuda | mps")
    dtype: str = arg("auto", "auto (bf16 on CUDA, else fp32) | float32 | bfloat16 | float16")
    memory: float = arg(0, "GB the run may fill on its device in total, the backbone included (0 = what is free "
                           "before it loads): the memory plan fits --token-budget, --gen-batch, --grad-ckpt within it")
    micro_batch: int = arg(lopd.LOPDConfig.micro_batch, "at most this many rollouts per forward/backward")
    token_budget: int = arg(None, "at most this many padded tokens per forward/backward (engine.micro_batches). "
                                  "Default: what the memory plan fits; 0 = no limit but --micro-batch (the toy's)")
    kv_budget: float = arg(None, "GB of KV cache generation may fill (default: the memory plan's --gen-batch; "
                                 "--engine vllm: the engine's cache, default a quarter of the free memory)")
    gen_batch: int = arg(None, "episodes generated together. Default: as many as the memory plan fits (the toy: 64)")
    loss_chunk: int = arg(None, "supervised rows per LM-head application of the loss, recomputed in the backward "
                                "(losses.lopd_objective_from_hidden); 0 = full logits, the readable path (the toy's)")
    grad_ckpt: bool | None = arg(None, "gradient checkpointing in the backbones. Default: where the memory plan needs it")
    student_lora: bool = arg(False, "the student as a second LoRA adapter on the frozen backbone, not a full copy")
    student_lora_r: int = arg(64, "rank of the LoRA student (--student-lora)")
    dist_timeout: float = arg(360, "minutes a collective waits for the slowest rank under torchrun")
    save_every: int = arg(10, "write a checkpoint every N iterations")
    cold_save_every: int = arg(50, "write a cold-start checkpoint every N steps (OUT/cold_ckpt, until φ0 is written)")
    resume: bool = arg(True, "continue the cold start and joint stage from OUT's checkpoints (--no-resume: anew)")
    unsafe_no_sandbox: bool = arg(False, "run the world's untrusted code (programs, environments, checkers) WITHOUT "
                                         "the kernel's confinement (worlds/sandbox.py), limits only: it may wreck it")
    tensorboard: str = arg("", "also write every metric as TensorBoard scalars here (pip install tensorboard)")


# Where the toy needs its own value, and why (docs/toy-world.md, "The toy defaults"). Real models take PAPER_DEFAULTS:
# the paper's values, else the official configs' (step counts, 10,000 tokens a reply); other defaults are both's.
TOY_DEFAULTS = {
    "latents": 8,          # fewer latent positions keep the teacher's CPU forward cheap
    "composer_input": "reference",   # the task names its shop: a task-conditional composer learns the shops'
                                     # conventions from the name and ignores the reference (composer.py, dev. 5)
    "cold_steps": 500,     # ours (A.2 gives no count): shorter cold starts collapsed the latents to one prompt
    "cold_lr": 1e-3,       # a 0.5 M-parameter model trained from scratch needs a far larger step than 1e-5
    "steps": 60, "lr": 1e-4,   # lr: ditto for the student
    "composer_lr": 1e-5,   # the paper's: a larger rate first lowered the teacher's own reward
    "max_new_tokens": 64,
    "max_env_steps": 10,   # toy procedures take 2-6 calls (+ commit + "Task Completed")
    "max_len": 768,        # a toy episode's conversation: 10 replies of 64 tokens and their observations fit
    "eval_every": 20,      # teacher drift: base + composer and the student on --eval-tasks held-out tasks
    "text_context": "span",   # OPSD/SDPO's text where the toy backbone reads a reference (toy_backbone.py)
    "loss_chunk": 0,       # full logits: the readable loss (a toy vocabulary needs no chunks)
    "gen_batch": 64, "token_budget": 0, "kv_budget": 0, "grad_ckpt": False,   # budgets a toy run needs no plan for
}
PAPER_DEFAULTS = {"latents": ComposerConfig.n_latents, "composer_input": "task+reference", "cold_steps": 1000,
                  "cold_lr": 1e-5, "steps": 100, "lr": 1e-5, "composer_lr": 1e-5, "max_new_tokens": 10000,
                  "max_env_steps": 30, "max_len": 40960, "eval_every": 0, "text_context": "system",
                  "loss_chunk": 1024}   # the budgets: the memory plan (`fit_to_model`)
METHODS = {"lopd": lopd.METHOD, **baselines.METHODS}     # what --method runs: lopd, rft, grpo, opsd, sdpo, sdft, skillsd
# --quick: the same pipeline, small (flags given beside it win); its own folder, so it never mixes with runs/toy
QUICK = {"n_train": 200, "n_test": 50, "cold_steps": 100, "steps": 10, "rollouts_per_step": 16, "out": "runs/quick"}


def main(argv=None):
    """Under torchrun, torch's @record makes a rank's exception the job's reported root cause. A UserError is one
    line and exit status 2 (`devices.one_line_errors`)."""
    with devices.one_line_errors():
        return (record(_main) if "RANK" in os.environ else _main)(argv)


def _main(argv=None):
    t0 = time.time()
    args = parse_args(argv)
    _, world, backend = parallel.dist_setup(args.device, args.dist_timeout)
    parallel.check_world(args, world, rollouts_per_task(args))
    run = prepare(args)
    student = joint_training(run) if args.steps > 0 else None
    run.log.clock.enter("evaluation")
    rows = evaluate(args, run, student, run.test, cache=True)    # rows a killed evaluation finished: read back
    if parallel.rank() == 0:
        table = environment(args).results
        results.write_results(args.out, rows, {"seconds": round(time.time() - t0, 1)}, table=table, n=len(run.test))
        print(f"\n{results.caption(table, len(run.test))}\n\n{results.markdown_table(rows, table=table)}")
        results.plot_curves(args.out)              # OUT/curves.png, from OUT/metrics.jsonl
        print(f"total {time.time() - t0:.0f}s; results in {args.out}/results.md")
    serving.close_engine()                  # --engine vllm: ends the process group too (torchrun's, under torchrun)
    if backend != "none" and dist.is_initialized():
        dist.destroy_process_group()


def prepare(args: Args, record: bool = True) -> engine.Run:
    """Stages 1-4 (each cached in OUT) -> the run the joint stage and evaluation read. `record`: write args.json once
    every setting is resolved; a finished run read back (`load_run`) writes nothing and plans memory anew."""
    os.makedirs(args.out, exist_ok=True)
    checkpoints.check_same_world(args.out, env=args.env, conventions=args.conventions, shops=args.shops)
    if not record:
        memory.replan(args)
    devices.seed_everything(args.seed)
    train_tasks, test_tasks = load_splits(args, record)  # a missing release costs no load; the plan reads prompts
    if record:
        say(devices.size_line(args, len(train_tasks), len(test_tasks)))     # first: what the run holds
    device, dtype = devices.pick_device(args.device, args.dtype)
    log = devices.Log(args.out, args.tensorboard, functools.partial(devices.stages_left, args, len(train_tasks),
                      len(test_tasks), drift_rows=2 if METHODS[args.method].trains_composer else 1))   # as drift_eval
    planned = plan_before_loading(args, device, dtype, train_tasks)    # a run that cannot fit stops here
    model, tok = load_backbone(args, device, dtype)
    plan = fit_to_model(args, model, tok, device, planned)
    if record:     # every setting resolved: one that would join two runs stops here, before args.json is replaced
        checkpoints.check_same_run(args)
    serving.start_engine(args, model, args.model or toy_backbone(args), plan)
    if record and parallel.rank() == 0:   # atomically: another rank may be reading it in check_same_world
        checkpoints.write_json(os.path.join(args.out, "args.json"), dataclasses.asdict(args))
        checkpoints.write_json(os.path.join(args.out, "memory_plan.json"), dataclasses.asdict(plan))
    source = None if args.student_lora else models.student_source(model)   # θ̄'s weights, before the composer's LoRA
    episodes = base_rollouts(args, model, tok, train_tasks, log)
    retriever = build_retriever(args, model, tok, episodes, train_tasks, test_tasks, log)
    composer = cold_start(args, model, tok, retriever, episodes, train_tasks, log)
    # a full student is made when the joint stage needs it (models.full_student); a LoRA one now, in the backbone
    student = models.lora_student(composer.peft, args.student_lora_r) if args.student_lora else None
    return engine.Run(args=args, tok=tok, chat=chat_of(args, tok), sample=sample_config(args), composer=composer,
                      retriever=retriever, train=train_tasks, test=test_tasks, episodes=episodes, log=log,
                      student=student, source=source)


# ----------------------------------------------------------------------------------------------------------------
# Stage 1: the backbone θ̄ (and its tokenizer)
# ----------------------------------------------------------------------------------------------------------------
def plan_before_loading(args: Args, device, dtype, tasks) -> memory.Planning:
    """memory.memory_plan on θ̄ built on the meta device from --model's config, before any weight is read: a run
    that cannot fit stops here, in one line naming what fits. -> its inputs, which `fit_to_model` plans again."""
    path = args.model or toy_backbone(args)
    model = models.meta_backbone(models.check_causal_lm(path), dtype)
    n_ctx = getattr(model.config, "max_position_embeddings", None)
    args.max_len, args.max_new_tokens = memory.fit_context(args.max_len, args.max_new_tokens, n_ctx)
    try:
        chat = chat_of(args, models.load_tokenizer(path, args.chat_template))   # thinking off: the longer prompt
    except (OSError, ValueError, TypeError):                # a folder with only config.json, a hub id not cached
        chat = None
    prompt = memory.prompt_tokens(chat, tasks, args.n_ret * args.latents)
    planning = memory.Planning(args, model, memory.machine(args, device), trains(args, model.config), prompt)
    memory.memory_plan(planning)
    return planning


def trains(args: Args, config) -> memory.Trains:
    """What the joint stage trains beside θ (memory.footprint): the composer's LoRA and QFormer, an EMA teacher."""
    cc, d, heads = ComposerConfig(n_latents=args.latents), config.hidden_size, config.num_attention_heads
    with torch.device("meta"):
        qformer = QFormer(d, heads, cc.n_latents, cc.n_layers, cc.ffn_mult, 1.0)
    return memory.Trains(tuple(cc.lora_targets), cc.lora_r, sum(p.numel() for p in qformer.parameters()),
                          METHODS[args.method].keeps_ema, rollouts_per_task(args))


def load_backbone(args: Args, device, dtype):
    """The base model θ̄ and its tokenizer: --model, or the toy backbone built (once) into OUT/backbone."""
    from transformers import AutoModelForCausalLM
    path = args.model or toy_backbone(args)
    models.check_causal_lm(path)
    if environment(args).toy_world == "tools" and not args.tasks:      # a toy backbone knows its world's tools
        toy.check_conventions(path, args.conventions, args.shops)
    tok = models.load_tokenizer(path, args.chat_template)
    if not tok.chat_template:
        raise UserError(f"--model {path!r}: its tokenizer has no chat template (a base checkpoint?); give one with "
                        "--chat-template FILE (a Jinja file), or use an instruct model")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
        say(f"tokenizer has no pad token: using eos {tok.eos_token!r} as pad (and as the latent placeholder)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device)
    model.requires_grad_(False).eval()
    return model, tok


def fit_to_model(args: Args, model, tok, device, planned: memory.Planning) -> memory.MemoryPlan:
    """What depends on the backbone (and `plan_before_loading`'s --max-len), said in one line each, in args.json:
    the plan's budgets where the command line gave none (`memory.fit_memory`: `planned` again, beside θ̄)."""
    if args.thinking is None:
        args.thinking = thinks_by_default(args, tok)
        if args.thinking:
            say("thinking mode on (B.2; the template has enable_thinking): --no-thinking turns it off")
    machine = memory.machine(args, device, loaded=memory.backbone_bytes(model))
    return memory.fit_memory(dataclasses.replace(planned, args=args, model=model, machine=machine))


def thinks_by_default(args: Args, tok) -> bool:
    """B.2 runs Qwen3 with thinking on: a real model whose chat template reads `enable_thinking` thinks unless
    --no-thinking. The toy backbone never does (its budgets are sized for short replies)."""
    return not is_toy(args) and "enable_thinking" in (tok.chat_template or "")


def toy_backbone(args: Args) -> str:
    """The toy backbone of the world (and --conventions, --shops): shipped, or built once into OUT (worlds/toy_backbone.py)."""
    world = environment(args).toy_world
    if world is None:
        raise UserError(f"--env {args.env!r} has no toy backbone (its toy_world is None): give --model")
    return toy.backbone_for(args.out, world, args.conventions, args.shops)


# ----------------------------------------------------------------------------------------------------------------
# Stage 2: the environment's tasks, and the base model's rollouts on them
# ----------------------------------------------------------------------------------------------------------------
def environment(args: Args) -> type:
    return common.environment_class(args.env)        # a name in common.ENVS, or the user's FILE.py:CLASS


def env_factory(args: Args):
    """A fresh environment of the run per call: the toy backbone reads the short prompts it was trained on, a real
    model A.5's (`Environment.for_run`). Its `tools` (JSON schemas, or None) go to the chat template."""
    cls, toy_model = environment(args), is_toy(args)
    return lambda: cls.for_run(args, toy_model)


def chat_of(args: Args, tok) -> engine.Chat:
    """The run's chat (engine.Chat): the tokenizer, the environment factory and the thinking mode that every
    prompt, observation and latent prompt of the run is rendered with."""
    return engine.Chat(tok, env_factory(args), bool(args.thinking))


def sample_config(args: Args, temperature=None) -> engine.SampleConfig:
    """The rollouts' sampling (B.2) and budgets; `temperature` overrides the run's (an evaluation's)."""
    return engine.SampleConfig(temperature=args.temperature if temperature is None else temperature,
                               top_p=args.top_p, top_k=args.top_k, max_new_tokens=args.max_new_tokens,
                               max_len=args.max_len, batch_size=args.gen_batch or engine.SampleConfig.batch_size,
                               sort_by_length=not is_toy(args), generator=serving.GENERATOR,
                               compile_decode=args.compile_decode)


def load_splits(args: Args, record: bool = True):
    """Training and held-out tasks: --tasks's folder, or the world's seeded splits (saved to OUT/tasks if `record`)."""
    cls = environment(args)
    try:       # DIR/train.jsonl and test.jsonl (or the world's layout), or the seeded splits, the same on every rank
        train, test = cls.read_splits(args, record) if args.tasks else cls.make_splits(args)
    except NotImplementedError as err:                     # a world without a task source of that kind
        raise UserError(f"--env {args.env!r}: {err}") from None
    if problem := common.missing_task_field(args.env, train, test):     # one line now, not a stage's traceback
        raise UserError(problem)
    if record and not args.tasks and parallel.rank() == 0:
        os.makedirs(os.path.join(args.out, "tasks"), exist_ok=True)
        for name, tasks in (("train", train), ("test", test)):
            cls.save_tasks(tasks, os.path.join(args.out, "tasks", name + ".jsonl"))
    return train, test


def base_rollouts(args, model, tok, train, log):
    """Stage 2: args.bank_rollouts rollouts of the base model per training task (checkpoints.cached)."""
    path = os.path.join(args.out, "base_rollouts.jsonl")
    by_id = {t.task_id: t for t in train}
    if checkpoints.reuse("base rollouts", path):
        return [engine.Episode.from_record(r, by_id[r["task_id"]]) for r in map(json.loads, open(path))]
    t0 = time.time()
    tasks = parallel.shard([t for t in train for _ in range(args.bank_rollouts)])   # this rank's slice (1 process: all)
    log.clock.enter("bank")                        # its first batch says how long the run has left
    with log.bar(len(tasks), "base rollouts") as bar:
        eps = engine.rollout(model, chat_of(args, tok), tasks, sample_config(args), progress=bar)
    if parallel.world() > 1:                                      # every rank's slice, in order, on every rank
        eps = [engine.Episode.from_record(r, by_id[r["task_id"]]) for r in parallel.gather([e.record() for e in eps])]
    if parallel.rank() == 0:
        checkpoints.write_jsonl(path, [e.record() for e in eps])
    log("base_rollouts", n=len(eps), seconds=round(time.time() - t0, 1), **engine.summarize(eps))
    return eps


# ----------------------------------------------------------------------------------------------------------------
# Stage 3: the experience bank and the retriever (A.3, eqs. 15-16)
# ----------------------------------------------------------------------------------------------------------------
def build_retriever(args, model, tok, episodes, train, test, log):
    """Stage 3: the experience bank of successful training rollouts, indexed; queries cached for all tasks."""
    path = os.path.join(args.out, "bank")
    if checkpoints.reuse("bank and retriever", path, "meta.json"):
        return retrieval.Retriever.load(path)
    cands = [retrieval.make_entry(e.task.task_id, e.task.text, e.trace, e.reward,
                                  {"variant": e.task.variant, "schema": e.task.schema, "episode": i})
             for i, e in enumerate(episodes)]
    bank = retrieval.build_bank(cands, args.bank_threshold)
    retrieval.check_bank(bank, episodes, args.n_ret, args.bank_threshold)   # a UserError: too few to retrieve
    embedder = retrieval.make_embedder(args.embedder, model, tok, env_factory(args)().retrieval_instruction)
    if parallel.world() == 1:
        ret = retrieval.Retriever(bank, embedder)
        ret.cache_queries([t.task_id for t in train + test], [t.text for t in train + test])
    else:   # each rank embeds a slice of the documents and of the queries; all ranks build the same index
        ret = retrieval.Retriever(bank, embedder, doc_vectors=parallel.split_over_ranks(embedder.embed_docs, bank))
        ret.query_cache.update(zip([t.task_id for t in train + test],
                                   parallel.split_over_ranks(embedder.embed_queries, [t.text for t in train + test])))
    if parallel.rank() == 0:
        ret.save(path)
    log("bank", entries=len(bank), tasks_covered=len({e["task_id"] for e in bank}), **retrieval.bank_recall(ret, test))
    return ret


# ----------------------------------------------------------------------------------------------------------------
# Stage 4: cold start of the composer (A.2, eq. 14)
# ----------------------------------------------------------------------------------------------------------------
def cold_start_step(args, composer, chat, retriever, episodes, tasks_by_id, entries) -> float:
    """One eq. (14) loss, back-propagated: each entry's own successful episode, behind latents composed from J OTHER
    entries (B, J·K, d). --token-budget splits the batch into forward/backward passes (`engine.accumulate`), each
    normalised by the whole batch's ω count (summed over ranks under torchrun). -> the loss, summed over ranks."""
    eps = [episodes[e["meta"]["episode"]] for e in entries]
    n_tokens = engine.supervised_tokens(eps)
    head = (models.lm_head(composer.peft), args.loss_chunk) if args.loss_chunk else ()   # the NLL applies the head

    def part_loss(idx):
        tasks = [tasks_by_id[e["task_id"]] for e in engine.pick(entries, idx)]
        latents = lopd.compose(composer, tasks, lopd.retrieve(retriever, tasks, args.n_ret, args.retrieval))
        batch = cold_start_batch(chat, engine.pick(eps, idx), latents.shape[1])   # ids, mask, ω (b, T), starts (b,)
        with models.lm_head_bypassed(composer.peft) if head else contextlib.nullcontext():
            loss = cold_start_loss(composer, batch, latents, n_tokens, *head)
        return loss, {"loss/init": loss.item()}
    m, _ = engine.accumulate(eps, part_loss, max(1, len(eps)), args.token_budget or 0)   # one part, or the budget's
    return m["loss/init"]


def cold_start(args, model, tok, retriever, episodes, train, log, composer=None) -> Composer:
    """Stage 4: φ0. The backbone stays frozen; only the LoRA ψ and the QFormer χ learn (cached in OUT/composer0; a
    checkpoint every --cold-save-every steps, which a rerun goes on from). A given `composer` (an ablation variant
    with its own --retrieval; the caller resets it to composer_init first) is trained in place, or set to φ0."""
    path = os.path.join(args.out, "composer0")
    if checkpoints.reuse("cold start (φ0)", path, "composer.json"):
        if composer is None:
            return Composer.load(path, model, tok)
        checkpoints.reset_composer(composer, path)
        return composer
    resumed = checkpoints.continue_from(args, checkpoints.COLD_CKPT)    # a killed run's checkpoint, said in a line
    if composer is None:
        composer = Composer(model, tok, ComposerConfig(n_latents=args.latents,
                                                       task_conditional=args.composer_input == "task+reference"))
        parallel.broadcast_params(composer.trainable_parameters())  # torchrun: every rank starts from rank 0's φ
        if parallel.rank() == 0 and resumed is None:       # φ before training, for the ablations' variants
            composer.save(os.path.join(args.out, "composer_init"))
    groups = cold_start_groups(args, composer)              # [(parameters, clip)]: one group, or ψ and χ
    opts = [torch.optim.AdamW(params, lr=args.cold_lr) for params, _ in groups]
    tasks_by_id, chat, task_rng = {t.task_id: t for t in train}, chat_of(args, tok), random.Random(args.seed)
    draw = schema_balanced_sampler(retriever.bank, task_rng)
    t0, start = time.time(), checkpoints.resume_cold_start(resumed, composer, opts, task_rng) if resumed else 0
    log.clock.enter("cold start", start)
    for step in tqdm(range(start, args.cold_steps), desc="cold start", initial=start, total=args.cold_steps,
                     leave=False, disable=parallel.rank() != 0):
        # every rank draws the same batch (the sampler is seeded alike) and computes its slice's share of the loss
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        loss = cold_start_step(args, composer, chat, retriever, episodes, tasks_by_id,
                               parallel.shard(draw(args.cold_batch)))                 # back-propagated
        parallel.sync_grads(composer.trainable_parameters())     # summed over ranks (no-op in one process)
        for (params, clip), opt in zip(groups, opts):
            torch.nn.utils.clip_grad_norm_(params, clip)
            opt.step()
        if step == start:
            log.clock.first("cold step", time.time() - t0, 1)      # the time left, from this first step
        if step % 50 == 0 or step == args.cold_steps - 1:
            log("cold_start", step=step, **{"loss/init": loss})
        checkpoints.cold_checkpoint(args, composer, opts, step + 1, task_rng)     # every --cold-save-every steps
    for opt in opts:
        opt.zero_grad(set_to_none=True)   # the last step's gradients must not leak into the joint stage's first one
    if parallel.rank() == 0:
        composer.save(path)
        checkpoints.drop_cold_checkpoints(args.out)
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


def joint_training(run: engine.Run):
    """Stage 5: args.steps iterations of args.method (Algorithm 1 for lopd; METHODS has each method's step), a
    checkpoint every --save-every and at the end. Returns the trained student θ."""
    args, composer, method = run.args, run.composer, METHODS[run.args.method]
    run.chat, run.sample = chat_of(args, run.tok), sample_config(args)    # this stage's settings (an experiment's)
    state = method.setup(run)
    student = run.student
    if student is None:         # θ = θ̄ in fp32, made now (under torchrun, sharded before it is materialised)
        student = models.full_student(args, run.source)
    elif parallel.world() > 1 and not isinstance(student, models.LoraStudent):   # a caller's own full student
        student = parallel.shard_student(student)
    composer.qformer.to(getattr(torch, args.qformer_dtype))     # --qformer-dtype (float32 unless asked)
    opts = make_optimizers(args, student, composer)
    run.task_rng, start = random.Random(args.seed + 2), 0
    gens = len(run.episodes) if method.uses_bank else 0     # honest budgets: the bank's rollouts count
    devices.seed_everything(args.seed + 3)   # the joint stage's randomness does not depend on which stages were cached
    if ckpt := checkpoints.continue_from(args):       # a killed or finished run's checkpoint, said in a line
        start, gens = checkpoints.load_checkpoint(ckpt, student, composer, opts, state, run.task_rng)
    serving.serve(student)                   # --engine vllm: the student's weights, on every rank at once
    run.log.clock.enter("joint", start)
    for step in tqdm(range(start, args.steps), desc=args.method.upper(), initial=start, total=args.steps,
                     leave=False, disable=parallel.rank() != 0):
        t0 = time.time()
        with devices.precision(composer.peft):
            m, spent = method.step(run, state, student, opts, step)
        run.log.clock.first("step", time.time() - t0, 1)      # the first step's says how long the run has left
        gens += spent
        m.update(serving.follow(student))      # --engine vllm: the engine takes the student's weights, checked
        if args.eval_every and (step + 1) % args.eval_every == 0:
            m.update(drift_eval(args, student, run))
        run.log(args.method, step=step, generations=gens, seconds=round(time.time() - t0, 2), **m)
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            checkpoints.save_checkpoint(args.out, student, composer, opts, state, step=step + 1, generations=gens,
                                    task_rng=run.task_rng)
    return student


def drift_eval(args, student, run) -> dict:
    """reward/eval (the student alone) and, for a method that trains the composer (LOPD), reward/teacher (base +
    composer) on the first --eval-tasks held-out tasks. The others never change it: their teacher cannot drift."""
    which = ("base + composer", "student") if METHODS[args.method].trains_composer else ("student",)
    rows = evaluate(args, run, student, run.test[:args.eval_tasks], which=which)
    return {"reward/eval": rows[student_row(args)]["reward"],
            **({"reward/teacher": rows["base + composer"]["reward"]} if "base + composer" in rows else {})}


# ----------------------------------------------------------------------------------------------------------------
# Stage 6: evaluation (paper §4, Table 3, B.3, B.4)
# ----------------------------------------------------------------------------------------------------------------
# The three rows of Table 3, each a rollout of the same held-out tasks from the same sampling seed:
#   vanilla          θ̄ on the task alone (the composer's LoRA off, A.4)
#   base + composer  θ̄ behind c_φ(x, Ret(x)): what the teacher would do on its own
#   LOPD student     θ alone: no retrieval, no composer, no latent context
def eval_vanilla(composer, chat, tasks, cfg, progress=None):
    """θ̄ on the task alone: the composer's LoRA, in the same backbone, switched off (A.4). `progress`: a bar."""
    with composer.adapter_disabled():
        return engine.rollout(composer.peft, chat, tasks, cfg, progress=progress)


def eval_teacher(composer, retriever, chat, tasks, cfg, n_ret, mode="same", *, progress=None):
    """θ̄ behind c_φ(x, Ret(x)): what the teacher would do on its own. mode: lopd.retrieve's (same | other | none)."""
    with torch.no_grad():
        latents = lopd.compose(composer, tasks, lopd.retrieve(retriever, tasks, n_ret, mode))    # (B, J·K, d)
    return lopd.teacher_rollout(composer, chat, tasks, latents, cfg, progress=progress)


def eval_student(student, chat, tasks, cfg, progress=None):
    """θ alone, from the task (the deployed policy)."""
    return engine.rollout(student, chat, tasks, cfg, progress=progress)


ROWS = ("vanilla", "base + composer", "student")     # `evaluate`'s rows; the student's is named by its method


def student_row(args) -> str:
    return METHODS[args.method].label           # the trained student's row: "LOPD student", "GRPO student", ...


def evaluate(args, run, student, tasks, temperature=None, which=ROWS, keep: dict | None = None, cache=False) -> dict:
    """The rows of Table 3 (`which`: some of ROWS) on held-out tasks, each from the same seed; the training RNG
    streams are restored. `keep`, if given, receives each row's episodes (this rank's under torchrun). `cache`: the
    student is OUT's latest checkpoint; each row is written once finished, and read back by a rerun after a kill."""
    composer, cfg, chat, rows = run.composer, sample_config(args, temperature), chat_of(args, run.tok), {}
    keys = checkpoints.row_keys(args, run, cfg, tasks, student) if cache and keep is None and parallel.world() == 1 else {}
    tasks = parallel.shard(tasks)
    saved = checkpoints.rng_state(random.Random())
    for name, go in (("vanilla", lambda bar: eval_vanilla(composer, chat, tasks, cfg, bar)),
                     ("base + composer", lambda bar: eval_teacher(composer, run.retriever, chat, tasks, cfg,
                                                                  args.n_ret, mode=args.retrieval, progress=bar)),
                     ("student", lambda bar: eval_student(student, chat, tasks, cfg, bar))):
        if name not in which or (name == "student" and student is None):
            continue
        label = student_row(args) if name == "student" else name
        if (row := checkpoints.read_row(args.out, keys.get(name))) is not None:    # finished before a kill
            rows[label] = row
            continue
        devices.seed_everything(args.seed + 1)
        if name == "student":
            serving.serve(student)                   # --engine vllm: every rank, even one with no task here
        whole = parallel.gathered(student) if name == "student" else contextlib.nullcontext()   # FSDP2: weights
        with devices.precision(composer.peft), whole, run.log.bar(len(tasks), f"eval {name}") as bar:
            eps = go(bar) if tasks else []       # torchrun: a rank may get no held-out task
        rows[label] = engine.summarize_all(eps)
        checkpoints.write_row(args.out, keys.get(name), rows[label])
        if keep is not None:
            keep[label] = eps
    checkpoints.set_rng_state(saved, random.Random())
    return rows


# ----------------------------------------------------------------------------------------------------------------
# The command line, and a finished run read back (eval.py, scripts/experiments.py)
# ----------------------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> Args:
    """The command line as `Args`: a flag per field (its metadata's help), every default resolved (TOY_DEFAULTS or
    PAPER_DEFAULTS, and the world's own) before anything reads them."""
    registered = {"method": f"registered: {', '.join(METHODS)}", "env": f"registered: {', '.join(common.ENVS)}"}
    p = preflight.parser_of(Args, __doc__.split("\n")[0], registered)
    args = resolve_defaults(Args(**preflight.parse_with_preset(p, argv, QUICK, "quick")))
    _check(p, args)
    return checkpoints.absolute_paths(args)


def resolve_defaults(args: Args) -> Args:
    """Every field left at None, from the flags alone: --env and --tasks (`preflight.default_world`), TOY_DEFAULTS for
    the toy backbone, PAPER_DEFAULTS for a real model, the world's own over them (`Environment.toy_defaults`,
    `paper_defaults`); what depends on the backbone once it is loaded, in `fit_to_model`, and nowhere else."""
    env, tasks = preflight.default_world(args.model, args.env, args.tasks)    # the paper's world for a real model
    args = dataclasses.replace(args, env=env, tasks=tasks)
    try:
        cls = environment(args)
    except ValueError as err:                              # one line, without argparse's usage (devices.UserError)
        raise UserError(str(err)) from None
    defaults = {**TOY_DEFAULTS, **cls.toy_defaults} if is_toy(args) else {**PAPER_DEFAULTS, **cls.paper_defaults}
    return dataclasses.replace(args, **{k: v for k, v in defaults.items() if getattr(args, k) is None})


def is_toy(args: Args) -> bool:
    """The toy backbone: no --model, or a folder that worlds/toy_backbone.py wrote (`preflight.is_toy_model`)."""
    return preflight.is_toy_model(args.model)


# The flags that take one of a few values, and those that must be positive (the others at least 0)
CHOICES = {"device": ("auto", "cpu", "cuda", "mps"), "dtype": ("auto", "float32", "bfloat16", "float16"),
           "engine": ("hf", "vllm"), "method": tuple(METHODS), "text_context": ("system", "user", "span"),
           "composer_input": ("task+reference", "reference"), "retrieval": lopd.RETRIEVAL_MODES,
           "delta_per": ("trajectory", "token"), "kl_per": ("token", "trajectory"), "task_order": ("fresh", "epoch"),
           "cold_optim": ("joint", "split"), "qformer_dtype": ("float32", "bfloat16"),
           "privilege_against": ("student", "phi0"), "conventions": tuple(tool_world.WORLD_CONVENTIONS)}
POSITIVE, NON_NEGATIVE = ("n_ret", "latents", "rollouts_per_step", "micro_batch", "gen_batch", "top_m",
                          "cold_save_every"), ("steps", "loss_chunk", "token_budget", "memory")


def _check(p, a: Args):
    """Settings that cannot run together or at all: argparse's one-line error (exit 2), or a world's UserError."""
    preflight.check_values(p, a, CHOICES, POSITIVE, NON_NEGATIVE)
    preflight.check_paths(p, a, environment(a).task_files)    # --model, --chat-template, --tasks: there
    if rollouts_per_task(a) > 1 and a.rollouts_per_step % a.group:
        p.error(f"--rollouts-per-step {a.rollouts_per_step} must be a multiple of --group {a.group}")
    if METHODS[a.method].keeps_ema and a.student_lora:
        p.error(f"--method {a.method} keeps an EMA copy of a full student; it does not support --student-lora")
    if (a.conventions != 2 or a.shops) and not issubclass(environment(a), tool_world.ToolWorld):
        raise UserError("--conventions and --shops set the generated tool world: each takes --env tools and no --tasks")
    if environment(a).check_args(a):
        raise UserError(environment(a).check_args(a))
    sandbox.require_for(environment(a), a.unsafe_no_sandbox, f"--env {a.env}")


def rollouts_per_task(args: Args) -> int:
    field_name = METHODS[args.method].per_task          # "group" for a method that rolls out groups (GRPO, SDPO)
    return getattr(args, field_name) if field_name else 1


def load_args(out: str) -> Args:
    """The settings a run was started with (OUT/args.json; checkpoints.read_settings)."""
    return checkpoints.read_settings(out, Args)


def load_run(args: Args) -> engine.Run:
    """A run rebuilt from OUT (eval.py, scripts/experiments.py): stages 1-4 from their caches (`prepare`), then the
    latest checkpoint's student and composer. run.student is None when the run has no checkpoint."""
    run = prepare(args, record=False)
    ckpt = checkpoints.latest_checkpoint(args.out)
    if ckpt is None:
        return dataclasses.replace(run, student=None)
    if run.student is None:
        run.student = models.full_student(args, run.source)
    models.load_student_weights(run.student, os.path.join(ckpt, "student"))
    checkpoints.reset_composer(run.composer, os.path.join(ckpt, "composer"))
    return run


if __name__ == "__main__":
    main()
