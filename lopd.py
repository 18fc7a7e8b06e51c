"""LOPD, Algorithm 1 top to bottom (paper §3.1, §3.3, Alg. 1): what the method adds to the shared engine.

    retrieve / compose         Ret(x) (eq. 16) and c_φ = Φ_φ(x, E) (eqs. 4-7)
    teacher_rollout            "base + composer": the frozen base acting behind latents (evaluation)
    teacher_logits /           p_T on the student's SAME sampled ids, behind the latent prompt with the composer's
      student_teacher_logits   LoRA off, beside p_S (eq. 8, A.4)
    anchor_cache               Algorithm 1's "cache c_φ0 per task"
    lopd_step                  one iteration: rollouts -> retrieve -> compose -> re-score -> eq. 13 -> AdamW -> β
    micro_batch_objective      one pass: both models' scores and eq. 13 (`losses.Eq13` holds its constants), from
                               full logits or (--loss-chunk) from hidden states; `engine.accumulate` runs it on
                               every micro-batch
    lopd_setup, METHOD         LOPD as train.py runs it (--method lopd): the c_φ0 cache, then lopd_step each step

The machinery every method shares (the run's `engine.Chat`, which renders every prompt; episodes, generation and
rollouts, scoring, the micro-batch loop, the optimizer step) is engine.py; the baselines (RFT, GRPO, OPSD, SDPO,
SDFT, Skill-SD) are baselines.py. The calls `parallel.all_sum`, `parallel.gathered` and their kind are data parallel
under torchrun and the identity in one process: a first read can skip them (runtime/parallel.py).

    python train.py --steps 5                   # runs lopd_step in the full pipeline
    python -m pytest tests/test_lopd.py -q

Notation: B episodes in a batch, T tokens, V vocabulary, J experiences, K latents each, d hidden.

No deviation from the paper lives here; the engine's (generation, budgets) are engine.py's.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, fields, replace

import torch

import engine
import inject
import losses
import retrieval
from runtime import models, parallel


# ----------------------------------------------------------------------------------------------------------------
# Algorithm 1, step 3: retrieve J experiences and compose c_φ; the teacher acting behind its latent prompt
# ----------------------------------------------------------------------------------------------------------------
# What the composer reads in the "task only" control (train.py --retrieval none): no reference, and the task where
# the encoder is task-conditional (composer.py; the toy's encoder reads the reference alone, so then nothing).
NO_REFERENCE = {"task_id": "", "task": "", "trace": "(no reference)", "reward": 0.0, "meta": {}}


RETRIEVAL_MODES = ("same", "other", "none", "self", "shop")


def retrieve(retriever, tasks, n_ret: int, mode: str = "same"):
    """Ret(x) for each task (eq. 16): B lists of J bank entries.

    "same" is the method, never the task's own entries (retrieval.py, deviation 1); "self" is the same search with
    the task's own successes allowed (the official configs' allow_self_retrieval: true). Controls (does the teacher
    use the experience?): "other" never returns an entry of the task's own variant (shop), "none" gives the
    composer no reference, "shop" returns only entries of the task's own shop (an oracle retriever: it separates
    what retrieval finds from what the composer makes of it)."""
    if mode == "none":
        return [[NO_REFERENCE] * n_ret for _ in tasks]
    if mode not in RETRIEVAL_MODES:
        raise ValueError(f"retrieval mode {mode!r}: expected one of {RETRIEVAL_MODES}")
    variants = [t.variant for t in tasks] if mode in ("other", "shop") else None
    return retriever.retrieve([t.task_id for t in tasks], [t.text for t in tasks], n_ret=n_ret,
                              exclude_self=mode != "self", exclude_variants=variants if mode == "other" else None,
                              only_variants=variants if mode == "shop" else None)


def compose(composer, tasks, experiences, chunk: int = 32):
    """c_φ for each task (eqs. 4-7): experiences B lists of J entries -> latents (B, J·K, d)."""
    out = []
    for i in range(0, len(tasks), chunk):
        out.append(composer([t.text for t in tasks[i:i + chunk]],
                            [[retrieval.experience_text(e) for e in es] for es in experiences[i:i + chunk]]))
    return torch.cat(out, 0)                                                  # (B, J·K, d)


@torch.no_grad()
def teacher_rollout(composer, chat: engine.Chat, tasks, latents, cfg: engine.SampleConfig, progress=None):
    """The frozen base θ̄ acting behind its latent prompt ("base + composer"): LoRA off (A.4), latents injected."""
    n = latents.shape[1]
    starts = [chat.latent_prompt(*chat.begin(t), n)[1] for t in tasks]
    embed_fn = inject.make_embed_fn(composer.peft, latents, starts)

    def latent_prompt(messages, tools):              # n placeholder ids where c_φ goes (eq. 17)
        return chat.latent_prompt(messages, tools, n)[0]
    with composer.adapter_disabled():
        return engine.rollout(composer.peft, chat, tasks, cfg, prompt_fn=latent_prompt, embed_fn=embed_fn,
                              progress=progress)


def teacher_logits(composer, chat: engine.Chat, eps, latents):
    """π_θ̄,φ^T on the SAME continuation ids behind the latent prompt with c_φ injected, LoRA off (eqs. 7-8, A.4).
    Nothing is re-tokenized: the prompt changes, the continuation ids are the sampled ones. -> (B, Tc, V)."""
    device = latents.device
    conts, omega = engine.continuation(eps, device)
    prompts = [chat.latent_prompt(*chat.begin(e.task), latents.shape[1]) for e in eps]
    ids, att, pos, P, pad = engine.pack([p for p, _ in prompts], conts, chat.tokenizer.pad_token_id, device)
    starts = torch.tensor([s for _, s in prompts], device=device) + pad                  # (B,) after left padding
    Tc = omega.shape[1]
    # only the last Tc+1 columns: column P-1+t (here t) predicts continuation token t
    logits = composer.teacher_logits(ids, att, latents, starts, keep=Tc + 1, position_ids=pos)   # (B, Tc+1, V)
    return logits[:, :Tc]                                                                  # (B, Tc, V)


def student_teacher_logits(student, composer, chat: engine.Chat, eps, latents):
    """Algorithm 1, step 4: both models score the SAME sampled continuation (never re-tokenized, eq. 8).
    Returns aligned student and teacher logits (B, Tc, V), continuation ids and ω (B, Tc)."""
    ls, ids, omega = engine.student_logits(student, chat.tokenizer, eps, latents.device)
    return ls, teacher_logits(composer, chat, eps, latents), ids, omega


# ----------------------------------------------------------------------------------------------------------------
# Algorithm 1: one LOPD iteration
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class LOPDConfig:
    n_ret: int = 3             # J
    top_m: int = losses.TOP_M  # M (eq. 9)
    margin: float = 0.05       # m (eq. 13)
    anchor: float = 0.2        # λ (eq. 13)
    dual_lr: float = 0.5       # η_β (eq. 13)
    delta_per: str = "trajectory"   # Δ normalisation (eq. 12)
    kl_per: str = "token"      # L_distill normalisation: the whole batch's ω tokens | per trajectory (eq. 10)
    micro_batch: int = 8       # rollouts per forward/backward
    clip: float = 1.0          # gradient clipping, student and composer each
    freeze_composer: bool = False
    retrieval: str = "same"    # what the composer reads: same (the method) | other | none (controls, `retrieve`)
    privilege_against: str = "student"   # δ's baseline: the student (eq. 11) | phi0, the teacher behind c_φ0
    loss_chunk: int = 0        # supervised rows per LM-head application of the loss; 0: full logits (the reference)
    token_budget: int = 0      # padded tokens per forward/backward (0: micro_batch rollouts each; `micro_batches`)
    sample: engine.SampleConfig = field(default_factory=engine.SampleConfig)   # the student's rollouts (B.2)

    def eq13(self, beta: float, n_tokens=None, n_traj=None) -> losses.Eq13:
        """Eq. (13)'s constants at this step, normalised by the whole batch's counts (None: each part's own): every
        field of losses.Eq13 that this config has, by name (a setting added to both reaches the loss)."""
        constants = {f.name: getattr(self, f.name) for f in fields(losses.Eq13) if hasattr(self, f.name)}
        return losses.Eq13(beta=beta, n_tokens=n_tokens, n_traj=n_traj, **constants)


@torch.no_grad()
def anchor_cache(composer, retriever, tasks, n_ret: int, mode: str = "same", chunk: int = 32) -> dict:
    """c_φ0 per task from the cold-started composer, computed once (Algorithm 1: "cache c_φ0 per task")."""
    cache = {}
    for i in range(0, len(tasks), chunk):
        part = tasks[i:i + chunk]
        c0 = compose(composer, part, retrieve(retriever, part, n_ret, mode))    # (b, J·K, d)
        cache.update({t.task_id: c for t, c in zip(part, c0.cpu())})
    return cache


def lopd_step(student, composer, chat: engine.Chat, tasks, retriever, *, c0_cache, beta: float, opts,
              cfg: LOPDConfig):
    """One iteration of Algorithm 1 on `tasks`. opts = (student optimizer, composer optimizer or None).
    Returns (β, metrics, episodes); a non-finite loss skips the update and β, and says so in the metrics."""
    # 1-2. on-policy student rollouts from the task alone (eq. 1); r_i from the verifier, A_i = 2 r_i − 1 later
    with parallel.gathered(student):
        eps = engine.rollout(student, chat, tasks, cfg.sample)
    rewards = torch.tensor([e.reward for e in eps])                                       # (B,)
    # 3. retrieve J experiences per task (eq. 16)
    exps = retrieve(retriever, tasks, cfg.n_ret, cfg.retrieval)
    # whole-batch normalisers (summed over ranks under torchrun: the loss is then this rank's share of the total)
    n_tokens, n_traj = engine.supervised_tokens(eps), parallel.all_sum(len(eps))
    eq = cfg.eq13(beta, n_tokens, n_traj)

    def part_loss(idx):
        """4-5. Both models score the same ids; eq. (13) at fixed β on the episodes `idx`. Each micro-batch carries
        its share b / B of the constant β·m, so that the parts (and their logged values) sum to eq. (13)."""
        with torch.set_grad_enabled(not cfg.freeze_composer):
            latents = compose(composer, engine.pick(tasks, idx), engine.pick(exps, idx))     # (b, J·K, d) c_φ
        c0 = torch.stack([c0_cache[tasks[i].task_id] for i in idx]).to(latents)          # (b, J·K, d) sg[c_φ0]
        share = replace(eq, margin=cfg.margin * len(idx) / n_traj)
        return micro_batch_objective(student, composer, chat, engine.pick(eps, idx), (latents, c0), rewards[idx],
                                     eq=share, cfg=cfg)
    # 5-6. every part adds up over micro-batches and ranks, "loss/total" included (the sum of the losses
    # backpropagated: eq. 13 of the whole batch); AdamW steps, gradients clipped per model
    totals, finite = engine.update(student, opts, eps, part_loss, cfg, composer=composer)
    # 7. the dual step β ← [β + η_β (m − Δ)]₊
    if finite:
        beta = losses.dual_step(beta, totals["privilege/delta"], cfg.margin, cfg.dual_lr)
    behaviour = engine.summarize_all(eps)
    metrics = {"reward/student": behaviour["reward"], **totals, "dual/beta": beta, "skipped": int(not finite),
               "tokens": n_tokens, **{"behaviour/" + k: v for k, v in behaviour.items() if k != "reward"}}
    return beta, metrics, eps


def micro_batch_objective(student, composer, chat: engine.Chat, eps, latents, rewards, *, eq: losses.Eq13,
                          cfg: LOPDConfig):
    """Algorithm 1, steps 4-5 for one micro-batch: both models score the SAME sampled ids (eq. 8), then eq. (13)
    at fixed β, whose one backward gives ∇θ (through p_S) and ∇φ (through p_T and the anchor). latents = (c_φ, c_φ0),
    (b, J·K, d) each; eq: β, this micro-batch's share of m, λ, M and the whole batch's counts. -> (loss, metrics).
    cfg.loss_chunk > 0: the forwards return hidden states and the loss applies the LM heads a chunk of rows at a
    time (memory bounded by the chunk, not by the conversation; `models.lm_head_bypassed`). 0: full logits and
    the readable `losses.lopd_objective`; the two agree in value and gradient (tests/test_losses.py)."""
    c, c0 = latents
    chunked = models.lm_head_bypassed(student, composer.peft) if cfg.loss_chunk else contextlib.nullcontext()
    with chunked:
        # 4. the teacher re-scores exactly the student's ids behind c_φ; the student behind its own prompt
        ls, lt, ids, omega = student_teacher_logits(student, composer, chat, eps, c)   # (b, Tc, V), or (b, Tc, d)
        ref = None                                                             # eq. (11): δ against the student
        if cfg.privilege_against == "phi0":       # option: the teacher behind φ0's latents (losses.py, deviation 6)
            with torch.no_grad():
                ref = teacher_logits(composer, chat, eps, c0)
    # 5. eq. (13); a frozen composer has no anchor term
    anchor = None if cfg.freeze_composer else (c, c0)
    rewards = rewards.to(ls.device)
    if not cfg.loss_chunk:
        return losses.lopd_objective(ls, lt, ids, omega, rewards, eq=eq, latents=anchor, ref_logits=ref)
    heads = (models.lm_head(student), models.lm_head(composer.peft), models.lm_head(composer.peft))
    return losses.lopd_objective_from_hidden(ls, lt, heads, ids, omega, rewards, eq=eq, latents=anchor, h_ref=ref,
                                             chunk=cfg.loss_chunk)


# ----------------------------------------------------------------------------------------------------------------
# LOPD as train.py runs it (--method lopd): its setup, "cache c_φ0 per task", and one step
# ----------------------------------------------------------------------------------------------------------------
def lopd_config(args, sample: engine.SampleConfig) -> LOPDConfig:
    """Algorithm 1's settings from train.py's Args (each field of LOPDConfig has its flag of the same name), with
    the rollouts' sampling (train.sample_config)."""
    names = [f.name for f in fields(LOPDConfig) if f.name != "sample"]
    return LOPDConfig(**{k: getattr(args, k) for k in names}, sample=sample)


def lopd_setup(run: engine.Run) -> dict:
    """Algorithm 1: "cache c_φ0 per task" (each rank a slice of the tasks, gathered), and β₀ = 0."""
    part = anchor_cache(run.composer, run.retriever, parallel.shard(run.train), run.args.n_ret, run.args.retrieval)
    c0 = part if parallel.world() == 1 else {k: v for d in parallel.gather([part]) for k, v in d.items()}
    return {"c0": c0, "beta": 0.0}


def lopd_train_step(run: engine.Run, state: dict, student, opts, step: int):
    """One iteration of Algorithm 1 on this step's tasks (`lopd_step`); β lives in `state`."""
    cfg = lopd_config(run.args, run.sample)
    state["beta"], m, _ = lopd_step(student, run.composer, run.chat, run.tasks(step), run.retriever,
                                    c0_cache=state["c0"], beta=state["beta"], opts=opts, cfg=cfg)
    parallel.assert_same(state["beta"], "β")      # Δ was summed over ranks, so the dual step agrees everywhere
    return m, run.args.rollouts_per_step


METHOD = engine.Method(lopd_setup, lopd_train_step, "LOPD student", uses_bank=True, trains_composer=True)
