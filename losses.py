"""LOPD losses: top-M + tail reverse KL, per-token privilege, outcome-weighted margin, dual step, latent anchor.

Implements §3.3 of "Latent On-Policy Self-Distillation" (arXiv 2608.13040), eqs. (9)-(13):
  (9)  p̃(v): the teacher's top-M ids plus one tail bucket ⊥, built for the student and the teacher
  (10) L_distill = Σ ω·KL(p̃S ‖ p̃T) / Σ ω                                 reverse KL, student first
  (11) δ = log πT(a) − sg[log πS(a)]                                       per-token privilege
  (12) Δ = E_τ[ Σ ω·A(τ)·δ / Σ ω ],  A(τ) = 2r(τ) − 1                      outcome-weighted privilege
  (13) L = L_distill + β(m − Δ) + λ‖c_φ − sg[c_φ0]‖²,   β ← max(0, β + η_β(m − Δ))
and the masked NLL that the cold start (eq. 14), the toy's SFT and the RFT control share (`masked_nll`).
The baselines' losses (GRPO, OPSD, SDPO, SDFT, Skill-SD; B.1) sit beside their steps in baselines.py.
Every loss is a pure function of tensors (no model inside). Math runs in fp32, or float64 when given float64
(so that torch.autograd.gradcheck can run on these functions).

Notation: B batch (trajectories), T tokens, V vocabulary, M top-M, N supervised tokens (Σ ω),
J retrieved experiences, K latents per experience, d hidden size. ω = `mask` (B, T), 1 on supervised action tokens.

Alignment: every function takes logits (B, T, V) and ids / mask (B, T) ALREADY ALIGNED: logits[:, t] is the
distribution that ids[:, t] was sampled from. A causal LM's logits at t predict t+1, so callers shift once
(logits[:, :-1] with ids[:, 1:]) before calling.

Memory: V is ~150k for real models. Full-vocabulary log-softmax is computed only at the N supervised rows, never
at padding, and `lopd_objective` keeps one (N, V) fp32 log-prob tensor per side alive (two in all) and reuses it
for both the KL and δ. That is the readable reference, and the toy's path. At the paper's budgets N is thousands
of tokens a micro-batch, so real models take `lopd_objective_from_hidden` (train.py --loss-chunk, default 1024 for
them): the same values and gradients from the final hidden states, the LM heads applied C rows at a time and
recomputed in the backward, so the peak holds a few (C, V) tensors whatever N is.

Tests: pytest tests/test_losses.py -q

Deviations from the paper (and choices it leaves open):
  1. Tail clamp. The paper's tail 1 − Σ_topM p is computed as log(−expm1(logsumexp(top-M log p))) with the
     logsumexp clamped to ≤ −1e-7 (as the official code, lopd/loss.py), so the tail log-prob is ≥ log(1e-7) ≈ −16.1
     instead of −inf when the top-M ids hold all the mass (see `topm_tail`).
  2. One KL, two gradients. The official code runs a student phase (teacher top-M values under no_grad) and a
     composer phase (student values detached). Here one KL without detach gives both gradients (see
     `reverse_kl_topm`); the values and gradients are the same.
  3. Normalisation. L_distill divides by the supervised-token count of the WHOLE batch (a choice, not a trap:
     docs/design.md, "Correctness traps", after the list), for the student and the composer alike; the official
     composer phase divides each trajectory by its own count and averages over trajectories. Eq. (10) writes the
     per-trajectory form for one τ inside E_τ (kl_per="trajectory", `--kl-per trajectory`).
  4. Δ. Default per="trajectory" (eq. 12, which the official code also uses for the composer's loss).
     per="token" is Σ ω A δ / Σ ω over the batch: the value the official code feeds the dual step. Here the same Δ
     goes into the loss and into `dual_step`.
  5. Anchor reduction. The paper writes ‖c_φ − sg[c_φ0]‖²₂ (a sum). The official code (lopd/worker.py,
     `composer_loss`) takes the MEAN of the squared entries over (J·K, d) per trajectory, then averages over
     trajectories; λ = 0.2 was tuned for that scale, so we follow the code (see `latent_anchor`).
  6. An option, not the default: `ref_logits` measures δ against the teacher behind φ0's latents instead of the
     student (train.py --privilege-against phi0). On the toy code world the joint teacher drifted towards its
     student while Δ (against the student) stayed above m, so β stayed 0; against φ0, a teacher that loses what
     its cold start knew has Δ < 0 and β pushes back. docs/results.md reports what it did.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# logsumexp of the top-M log-probs is clamped to at most this, so the tail bucket stays finite (see `topm_tail`).
TAIL_LOG_MASS_MAX = -1e-7


TOP_M = 20   # M, the teacher's top-M support of eq. (9) (§4.1: 20); every default of M in the code is this one


def fp32(x):
    """Upcast to fp32 (bf16/fp16 -> fp32); float64 stays float64 so gradcheck can run in double."""
    return x if x.dtype == torch.float64 else x.float()


def supervised_logprobs(logits, mask):
    """Full-vocabulary log-softmax at the supervised positions only.

    logits (B, T, V), mask ω (B, T) -> (N, V) fp32, rows in row-major order of mask, N = ω.sum().
    Padding rows (which may hold -inf or NaN) are never read: their gradient is exactly zero.
    """
    rows = logits[mask.bool()]                                          # (N, V), input dtype
    return F.log_softmax(fp32(rows), dim=-1)                           # (N, V) fp32


def _unflatten(values, mask):
    """Scatter per-supervised-token values (N,) back to (B, T), zeros elsewhere (differentiable)."""
    out = values.new_zeros(mask.shape)                                  # (B, T)
    return out.masked_scatter(mask.bool(), values)                      # (B, T)


def token_logprobs(logits, ids, mask=None):
    """log π(ids[b, t]) under the full-vocabulary softmax of logits[b, t].

    logits (B, T, V), ids (B, T) long, mask (B, T) optional -> (B, T) fp32; zeros where mask is 0.
    """
    mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()  # (B, T)
    logp = supervised_logprobs(logits, mask)                            # (N, V)
    logp_tok = logp.gather(-1, ids[mask].unsqueeze(-1)).squeeze(-1)     # (N,)
    return _unflatten(logp_tok, mask)                                   # (B, T)


def _with_tail(top_logp):
    """Append the tail bucket ⊥ in log space: (..., M) top-M log-probs -> (..., M+1)."""
    # Σ_{u∈V^M} p(u) in log space, kept strictly below 0 so that the tail below is > 0
    log_mass = torch.logsumexp(top_logp, dim=-1, keepdim=True).clamp(max=TAIL_LOG_MASS_MAX)  # (..., 1)
    # eq. (9), tail: log(1 − Σ_{u∈V^M} p(u)) = log(−expm1(log Σ p))
    log_tail = torch.log(-torch.expm1(log_mass))                        # (..., 1)
    return torch.cat([top_logp, log_tail], dim=-1)                      # (..., M+1)


def topm_tail(logp_student, logp_teacher, top_m):
    """Eq. (9): the teacher's top-M ids plus a tail bucket ⊥, for both distributions.

    logp_student, logp_teacher (..., V) full-vocabulary log-probs -> (logq_s, logq_t), each (..., M+1),
    bucket M is ⊥. Each bucket set sums to 1 (up to the clamp, ≤ 1e-7).

    Traps:
    - The support V^M is the TEACHER's top-M at each position, for both sides; each side gathers its OWN TRUE
      full-vocabulary log-probs there (no renormalisation over the M ids: that would drop the tail).
    - The tail is computed in log space. 1 − Σ p in linear fp32 cancels catastrophically when Σ p ≈ 1 and can
      round to 0 or below (log -> -inf or NaN, and 0·(-inf) = NaN in the KL and its gradient).
      log(−expm1(logsumexp(...))) keeps the digits, and the logsumexp is clamped to ≤ −1e-7: fp32 resolves a sum
      of probabilities only to about 1e-7 (machine epsilon 1.2e-7), so a smaller tail is rounding noise, and the
      clamp caps log p(⊥) at log(1e-7) ≈ −16.1 (its gradient is zero while clamped). Same value as the official code.
    """
    # V^M: the teacher's top-M ids (the selection itself is piecewise constant: no gradient through it)
    top_t, ids_m = logp_teacher.topk(top_m, dim=-1)                     # (..., M), (..., M)
    top_s = logp_student.gather(-1, ids_m)                              # (..., M)
    return _with_tail(top_s), _with_tail(top_t)                         # (..., M+1) each


def bucket_reverse_kl(logq_s, logq_t):
    """Reverse KL(q_s ‖ q_t) = Σ_v q_s(v)(log q_s(v) − log q_t(v)) over the last dim: (..., M+1) -> (...)."""
    return (logq_s.exp() * (logq_s - logq_t)).sum(-1)                   # (...)


def reverse_kl_topm(logp_s, logp_t, top_m=TOP_M):
    """Eq. (10)'s term of each supervised token: KL(p̃S ‖ p̃T), REVERSE KL (student first), Σ_v p̃S(v) log(p̃S(v) /
    p̃T(v)) over the teacher's top-M ids and one tail bucket (eq. 9). The one eq. 10 of the code: training averages
    these terms (`token_terms`, then `lopd_objective` or its chunked form: over the batch's ω tokens, or per
    trajectory), eval.py draws them.

    logp_s, logp_t (N, V) full-vocabulary log-probs of the N supervised tokens (`supervised_logprobs`: masked
    positions never reach them) -> (N,) fp32.
    (If you prefer F.kl_div: kl_div(input, target, log_target=True) is KL(target ‖ input), so this is
    kl_div(logq_t, logq_s, log_target=True).)
    """
    logq_s, logq_t = topm_tail(logp_s, logp_t, top_m)                   # (N, M+1) each, eq. (9)
    # No detach on either side, on purpose: θ only reaches p̃S and φ only reaches p̃T, so the gradient of this one
    # KL w.r.t. θ is ∇θ KL(S ‖ sg T) and w.r.t. φ is ∇φ KL(sg S ‖ T), exactly as §3.3 prescribes.
    return bucket_reverse_kl(logq_s, logq_t)                            # (N,)


def privilege_delta(logp_t_tok, logp_s_tok):
    """Eq. (11): δ = log πT(a) − sg[log πS(a)], from per-token log-probs already computed (any shape, e.g. (B, T))."""
    # eq. (11): the student side is detached, so Δ never moves θ
    return logp_t_tok - logp_s_tok.detach()                             # same shape as inputs


def outcome_weighted_privilege(delta, mask, rewards, per="trajectory", normaliser=None):
    """Eq. (12): outcome-weighted privilege Δ, with A(τ) = 2r(τ) − 1 ∈ [−1, 1].

    delta δ (B, T), mask ω (B, T), rewards r (B,) in [0, 1] -> scalar.
    per="trajectory" (eq. 12): mean of A·δ over each trajectory's ω tokens, then the mean over trajectories;
        trajectories without ω tokens are skipped. normaliser default: the number of trajectories in this batch
        with ≥ 1 ω token.
    per="token": Σ ω·A·δ / Σ ω over the whole batch (long trajectories weigh more). normaliser default: ω.sum().
    Micro-batching: pass the whole batch's count (trajectories or tokens) as normaliser; the values then sum to
    the whole-batch value. δ at masked positions is ignored (even if NaN).
    """
    w = mask.to(delta.dtype)                                            # (B, T) ω
    A = 2.0 * rewards.to(delta.dtype) - 1.0                             # (B,)
    w_delta = torch.where(mask.bool(), delta, torch.zeros_like(delta))  # (B, T) ω·δ, NaN-safe
    if per == "trajectory":
        n_tok = w.sum(-1)                                               # (B,) ω tokens per trajectory
        mean_delta = w_delta.sum(-1) / n_tok.clamp(min=1)               # (B,) zero where no tokens
        n = (n_tok > 0).sum().clamp(min=1) if normaliser is None else normaliser
        return (A * mean_delta).sum() / n
    if per == "token":
        n = w.sum().clamp(min=1) if normaliser is None else normaliser
        return (A[:, None] * w_delta).sum() / n
    raise ValueError(f"per must be 'trajectory' or 'token', got {per!r}")


def dual_step(beta, delta_value, margin, lr):
    """Eq. (13) dual ascent on β: β ← max(0, β + η_β (m − Δ)). Plain floats in, float out."""
    return max(0.0, float(beta) + float(lr) * (float(margin) - float(delta_value)))


def latent_anchor(c, c0, weight, n_traj=None):
    """Eq. (13) anchor: λ‖c_φ − sg[c_φ0]‖², reduced as the official code does.

    c (B, J·K, d) latents of the current composer φ; c0 (B, J·K, d) cached cold-start latents of φ0 -> scalar.
    Reduction: the mean of the squared entries over (J·K, d) per trajectory, summed over trajectories and
    divided by n_traj (default B; the whole batch's count when micro-batching). The official code
    (bingreeky/LOPD, lopd/worker.py, composer_loss) computes `(c_phi - c_phi0).pow(2).mean()` per rollout, with
    c_phi of shape (J·K, d), and averages over rollouts; its λ = 0.2 is tuned for that scale. This is
    ‖·‖²₂ / (J·K·d) per trajectory: the paper's ‖·‖²₂ as a sum would be J·K·d (≈ 2.5e5 for Qwen3-4B) times larger.
    """
    # eq. (13): c_φ − sg[c_φ0]; c0 is a cached constant, detached so no gradient reaches it
    sq = (fp32(c) - fp32(c0).detach()).pow(2)                         # (B, J·K, d)
    per_traj = sq.mean(dim=(1, 2))                                      # (B,)
    n = c.shape[0] if n_traj is None else n_traj
    return weight * per_traj.sum() / n


@dataclass(frozen=True)
class Eq13:
    """The constants of eq. (13) at one step and how its terms are normalised (β carries no gradient). Built by
    keyword from the method's settings (lopd.LOPDConfig holds every default). n_tokens / n_traj: the whole batch's
    ω tokens / trajectories when it is split into micro-batches (None: this batch's). A caller that splits a batch
    gives each micro-batch its share of m (lopd.lopd_step: m·b/B), so that the parts' losses sum to the whole
    batch's eq. (13)."""
    beta: float                    # β, the dual variable
    margin: float                  # m, the privileged margin
    anchor: float                  # λ, the latent anchor's weight
    top_m: int                     # M, the teacher's top-M support (eq. 9)
    delta_per: str                 # Δ (eq. 12): "trajectory", each trajectory's mean, then the mean | "token"
    kl_per: str                    # L_distill: "token", over the whole batch's ω tokens (deviation 3) | "trajectory"
    n_tokens: object = None        # the whole batch's Σ ω (int or scalar tensor)
    n_traj: object = None          # the whole batch's trajectories


def lopd_objective(student_logits, teacher_logits, ids, mask, rewards, *, eq: Eq13, latents=None, ref_logits=None):
    """Eq. (13): L = L_distill + β(m − Δ) + λ‖c_φ − sg[c_φ0]‖², for one batch of student trajectories.

    student_logits, teacher_logits (B, T, V) and ids, mask ω (B, T) ALIGNED (logits[:, t] scores ids[:, t]);
    rewards (B,) in [0, 1]; latents (c, c0): the composer's c_φ and the cached c_φ0, (B, J·K, d) each (None drops
    the anchor, e.g. for a frozen composer); eq: β, m, λ, M and the normalisers (`Eq13`).
    ref_logits (B, T, V): what δ measures the teacher against. None is the paper's eq. (11), the student; the
    option `--privilege-against phi0` passes the teacher behind φ0's cached latents, so that Δ is the teacher's
    outcome-weighted gain over its cold start (a remedy for a teacher that drifts towards its student; deviation 6).
    Returns (loss scalar, metrics: "loss/distill", "privilege/delta" (Δ), "loss/anchor" (λ-weighted), "loss/total").
    """
    sel = mask.bool()                                                   # (B, T)
    logp_s = supervised_logprobs(student_logits, sel)                   # (N, V) fp32, kept for KL and δ
    logp_t = supervised_logprobs(teacher_logits, sel)                   # (N, V) fp32
    a = ids[sel].unsqueeze(-1)                                          # (N, 1)
    # eqs. (9)-(10): reverse KL over the teacher's top-M + tail, normalised by the whole batch's token count;
    # eq. (11)'s log-probs at the sampled ids, gathered from the same log-probs (no extra forward)
    kl, logp_t_a, logp_s_a = token_terms(logp_s, logp_t, a, eq.top_m)  # (N,) each
    n = sel.sum() if eq.n_tokens is None else eq.n_tokens
    distill = kl.sum() / n if eq.kl_per == "token" else (kl * trajectory_weights(sel, eq.n_traj)).sum()   # scalar
    logp_ref_a = logp_s_a if ref_logits is None else supervised_logprobs(ref_logits, sel).gather(-1, a).squeeze(-1)
    delta = privilege_delta(logp_t_a, logp_ref_a)                       # (N,) eq. (11)
    return _lagrangian(distill, delta, sel, rewards, latents, eq)


def token_terms(logp_s, logp_t, a, top_m=TOP_M):
    """Eqs. (9)-(11) per supervised token, from full-vocabulary log-probs (N, V) of each side and the sampled ids a
    (N, 1): -> (each token's reverse KL(p̃S ‖ p̃T) over the teacher's top-M + tail, log πT(a), log πS(a)), (N,)
    each. `lopd_objective` and its chunked form average the first and take δ from the others; eval.py draws them."""
    kl = reverse_kl_topm(logp_s, logp_t, top_m)                         # (N,) eq. (10)'s terms
    return kl, logp_t.gather(-1, a).squeeze(-1), logp_s.gather(-1, a).squeeze(-1)


def trajectory_weights(sel, n_traj=None):
    """Eq. (10) as written, per trajectory: each of the N supervised tokens weighs 1 / (its trajectory's ω count ·
    the number of trajectories), so Σ weights · KL is the mean over trajectories of each one's mean KL.
    sel ω (B, T) bool -> (N,) fp32. n_traj: the whole batch's trajectories when micro-batching (default: the rows
    of this batch with ≥ 1 ω token)."""
    count = sel.sum(-1, keepdim=True).expand_as(sel)[sel].float()       # (N,) ω tokens of each token's trajectory
    n = (sel.sum(-1) > 0).sum() if n_traj is None else n_traj
    return 1.0 / (count * n)                                            # (N,)


def _lagrangian(distill, delta, sel, rewards, latents, eq: Eq13):
    """Eqs. (12)-(13) from L_distill (scalar) and δ at the N supervised tokens (N,): -> (loss, metrics)."""
    # eq. (12): outcome-weighted privilege Δ
    norm = eq.n_traj if eq.delta_per == "trajectory" else eq.n_tokens
    Delta = outcome_weighted_privilege(_unflatten(delta, sel), sel, rewards, eq.delta_per, norm)   # scalar
    anchor = distill.new_zeros(()) if latents is None else latent_anchor(*latents, eq.anchor, eq.n_traj)  # scalar
    # eq. (13): the Lagrangian at fixed β
    loss = distill + eq.beta * (eq.margin - Delta) + anchor
    metrics = {"loss/distill": distill.item(), "privilege/delta": Delta.item(),
               "loss/anchor": anchor.item(), "loss/total": loss.item()}
    return loss, metrics


# ----------------------------------------------------------------------------------------------------------------
# The same objective from hidden states, chunk by chunk: memory bounded by a chunk of rows, not by the conversation
# ----------------------------------------------------------------------------------------------------------------
# `lopd_objective` above is the readable reference. At the paper's sizes (V = 151,936, thousands of supervised
# tokens a micro-batch) its (N, V) fp32 log-probs, two per side and their gradients, are tens of GB. Here the LM
# heads are applied to C supervised rows at a time, the chunk's KL and sampled-token log-probs are taken, and the
# chunk is recomputed in the backward (torch.utils.checkpoint): the peak holds a few (C, V) tensors whatever N is.
# Same values and gradients for θ, φ and the heads (tests/test_losses.py checks them against `lopd_objective`).
def chunked(fn, rows, consts=(), chunk=1024) -> list:
    """fn(row_chunks, *consts) on each chunk of C rows of `rows` (a tuple of tensors with the same first dimension,
    or None), recomputed in the backward (torch.utils.checkpoint): the peak holds one chunk's (C, V) tensors,
    whatever the number of rows. -> fn's results, a chunk each. The one loop of every hidden-state loss below."""
    from torch.utils.checkpoint import checkpoint
    cut = lambda r, i: None if r is None else r[i:i + chunk]            # noqa: E731
    return [checkpoint(fn, tuple(cut(r, i) for r in rows), *consts, use_reentrant=False)
            for i in range(0, rows[0].shape[0], chunk)]


def _chunk_terms(rows, heads, eq: Eq13):
    """One chunk of C supervised rows (h_s, h_t, a, h_ref, weight): h_* (C, d) hidden states, a (C, 1) sampled ids,
    `weight` (C,) or None; heads as in `lopd_objective_from_hidden` -> (Σ over the chunk of KL(p̃S ‖ p̃T), each
    times its weight if given, log πT(a) (C,), log π_ref(a) (C,): the student's unless h_ref is given)."""
    h_s, h_t, a, h_ref, weight = rows
    (w_s, b_s), (w_t, b_t), (w_ref, b_ref) = heads
    logp_s = F.log_softmax(fp32(F.linear(h_s, w_s, b_s)), dim=-1)       # (C, V) fp32
    logp_t = F.log_softmax(fp32(F.linear(h_t, w_t, b_t)), dim=-1)       # (C, V) fp32
    kl, logp_t_a, logp_s_a = token_terms(logp_s, logp_t, a, eq.top_m)  # (C,) each, eqs. (9)-(11)
    if h_ref is not None:                                               # --privilege-against phi0
        logp_s_a = F.log_softmax(fp32(F.linear(h_ref, w_ref, b_ref)), dim=-1).gather(-1, a).squeeze(-1)   # (C,)
    kl = kl if weight is None else kl * weight                          # (C,)
    return kl.sum(), logp_t_a, logp_s_a                                 # scalar, (C,), (C,)


def lopd_objective_from_hidden(h_s, h_t, heads, ids, mask, rewards, *, eq: Eq13, latents=None, h_ref=None,
                               chunk=1024):
    """Eq. (13) exactly as `lopd_objective`, from the final hidden states instead of logits.

    h_s, h_t (B, T, d) ALIGNED with ids and mask ω (B, T) (h[:, t] is what the LM head turns into the distribution
    ids[:, t] was drawn from); heads = ((w_s, b_s), (w_t, b_t), (w_ref, b_ref)): each side's LM head weight (V, d)
    and bias (or None); a tied head is the embedding matrix itself, and its gradient reaches it. h_ref (B, T, d):
    the reference side of δ (None: the student, eq. 11). chunk: supervised rows per LM-head application.
    Returns (loss, metrics) as `lopd_objective`."""
    sel = mask.bool()                                                   # (B, T)
    hs, ht = h_s[sel], h_t[sel]                                         # (N, d) each
    hr = None if h_ref is None else h_ref[sel]                          # (N, d)
    a = ids[sel].unsqueeze(-1)                                          # (N, 1)
    wk = None if eq.kl_per == "token" else trajectory_weights(sel, eq.n_traj)   # (N,) eq. (10) per trajectory
    kl, lt, lr = fp32(hs.new_zeros(())), [], []
    for k, t, r in chunked(_chunk_terms, (hs, ht, a, hr, wk), (heads, eq), chunk):
        kl, lt, lr = kl + k, lt + [t], lr + [r]
    n = sel.sum() if eq.n_tokens is None else eq.n_tokens
    distill = kl / n if wk is None else kl                              # eq. (10), scalar
    logp_t_a = torch.cat(lt) if lt else kl.new_zeros(0)                 # (N,)
    logp_r_a = torch.cat(lr) if lr else kl.new_zeros(0)                 # (N,)
    delta = privilege_delta(logp_t_a, logp_r_a)                         # (N,) eq. (11)
    return _lagrangian(distill, delta, sel, rewards, latents, eq)


def masked_nll(logits, ids, mask, n_tokens=None):
    """−Σ ω log π(ids) / N: the cold start's eq. (14), the toy backbone's SFT, and the RFT control (train.py
    --method rft: NLL of the bank's successes, no teacher).

    logits (B, T, V) and ids, mask ω (B, T) ALIGNED (callers shift a causal LM's logits once) -> scalar fp32.
    n_tokens: the whole batch's supervised-token count when micro-batching (default: this batch's Σ ω).
    """
    return nll(token_logprobs(logits, ids, mask), mask, n_tokens)


def nll(logp, mask, n_tokens=None):
    """The masked NLL from the ids' log-probs logp (B, T) (zeros off ω: `token_logprobs` or its hidden-state form
    `token_logprobs_from_hidden`), mask ω (B, T) -> −Σ logp / N, N = n_tokens or this batch's Σ ω."""
    n = mask.sum().clamp(min=1) if n_tokens is None else n_tokens
    return -logp.sum() / n


def token_logprobs_from_hidden(h, head, ids, mask, chunk=1024):
    """`token_logprobs` from hidden states: log π(ids[b, t]) under the softmax of head(h[b, t]), C rows at a time,
    recomputed in the backward. h (B, T, d), head (weight (V, d), bias or None), ids, mask (B, T) -> (B, T) fp32,
    zeros where mask is 0. The NLL of the cold start (eq. 14) and of RFT, and GRPO's log π, at any length."""
    sel = mask.bool()                                                   # (B, T)
    rows, a = h[sel], ids[sel].unsqueeze(-1)                            # (N, d), (N, 1)
    parts = chunked(_logp_rows, (rows, a), head, chunk)                 # (C,) each
    flat = torch.cat(parts) if parts else fp32(h.new_zeros(0))         # (N,)
    return _unflatten(flat, sel)                                        # (B, T)


def _logp_rows(rows, w, b):
    """(C, d) hidden rows and (C, 1) ids -> (C,) the ids' log-probs under the head (w, b)."""
    h, a = rows
    return F.log_softmax(fp32(F.linear(h, w, b)), dim=-1).gather(-1, a).squeeze(-1)   # (C,)


def rowwise_from_hidden(loss_fn, h_s, h_t, head_s, head_t, mask, *, n_tokens=None, chunk=1024):
    """A loss of the form Σ_ω f(p_S, p_T) / n_tokens over (B, T, V) logits (the baselines' forward KL, SDPO's
    reverse KL) computed from hidden states C rows at a time, recomputed in the backward: loss_fn(logits_s, logits_t,
    mask, n_tokens) is called on each chunk's (1, C, V) logits with n_tokens = 1, so it returns the chunk's sum.
    h_s, h_t (B, T, d), heads (weight, bias), mask ω (B, T) -> scalar fp32."""
    sel = mask.bool()
    hs, ht = h_s[sel], h_t[sel]                                         # (N, d) each

    def part(rows, ws, bs, wt, bt):
        hs, ht = rows
        ls, lt = F.linear(hs, ws, bs)[None], F.linear(ht, wt, bt)[None]  # (1, C, V) each
        return loss_fn(ls, lt, torch.ones(ls.shape[:2], device=ls.device), 1)   # Σ over the chunk's rows
    total = fp32(hs.new_zeros(()))
    for s in chunked(part, (hs, ht), (*head_s, *head_t), chunk):
        total = total + s
    n = sel.sum() if n_tokens is None else n_tokens
    return total / n
