"""LOPD losses: top-M + tail reverse KL, per-token privilege, outcome-weighted margin, dual step, latent anchor.

Implements §3.3 of "Latent On-Policy Self-Distillation" (paper/lopd-paper.md), eqs. (9)-(13):
  (9)  p̃(v): the teacher's top-M ids plus one tail bucket ⊥, built for the student and the teacher
  (10) L_distill = Σ ω·KL(p̃S ‖ p̃T) / Σ ω                                 reverse KL, student first
  (11) δ = log πT(a) − sg[log πS(a)]                                       per-token privilege
  (12) Δ = E_τ[ Σ ω·A(τ)·δ / Σ ω ],  A(τ) = 2r(τ) − 1                      outcome-weighted privilege
  (13) L = L_distill + β(m − Δ) + λ‖c_φ − sg[c_φ0]‖²,   β ← max(0, β + η_β(m − Δ))
and the masked NLL that the cold start (eq. 14), the toy's SFT and the RFT control share (`masked_nll`).
Baselines (B.1), each with its own paper's loss: GRPO's group-normalised advantages and PPO-clip surrogate,
OPSD's full-vocabulary forward KL, SDPO's reverse KL over the student's top-K + tail and its EMA teacher update.
Every loss is a pure function of tensors (no model inside). Math runs in fp32, or float64 when given float64
(so that torch.autograd.gradcheck can run on these functions).

Notation: B batch (trajectories), T tokens, V vocabulary, M top-M, N supervised tokens (Σ ω),
J retrieved experiences, K latents per experience, d hidden size. ω = `mask` (B, T), 1 on supervised action tokens.

Alignment: every function takes logits (B, T, V) and ids / mask (B, T) ALREADY ALIGNED: logits[:, t] is the
distribution that ids[:, t] was sampled from. A causal LM's logits at t predict t+1, so callers shift once
(logits[:, :-1] with ids[:, 1:]) before calling.

Memory: V is ~150k for real models. Full-vocabulary log-softmax is computed only at the N supervised rows, never
at padding, and `lopd_objective` keeps one (N, V) fp32 log-prob tensor per side alive (two in all) and reuses it
for both the KL and δ.

Tests: pytest tests/test_losses.py -q

Deviations from the paper (and choices it leaves open):
  1. Tail clamp. The paper's tail 1 − Σ_topM p is computed as log(−expm1(logsumexp(top-M log p))) with the
     logsumexp clamped to ≤ −1e-7 (as the official code, lopd/loss.py), so the tail log-prob is ≥ log(1e-7) ≈ −16.1
     instead of −inf when the top-M ids hold all the mass (see `topm_tail`).
  2. One KL, two gradients. The official code runs a student phase (teacher top-M values under no_grad) and a
     composer phase (student values detached). Here one KL without detach gives both gradients (see
     `reverse_kl_topm`); the values and gradients are the same.
  3. Normalisation. L_distill divides by the supervised-token count of the WHOLE batch (DESIGN.md §3), for the
     student and the composer alike; the official composer phase divides each trajectory by its own count and
     averages over trajectories. Eq. (10) writes the per-trajectory form for one τ inside E_τ.
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
import torch
import torch.nn.functional as F

# logsumexp of the top-M log-probs is clamped to at most this, so the tail bucket stays finite (see `topm_tail`).
TAIL_LOG_MASS_MAX = -1e-7


def _fp32(x):
    """Upcast to fp32 (bf16/fp16 -> fp32); float64 stays float64 so gradcheck can run in double."""
    return x if x.dtype == torch.float64 else x.float()


def supervised_logprobs(logits, mask):
    """Full-vocabulary log-softmax at the supervised positions only.

    logits (B, T, V), mask ω (B, T) -> (N, V) fp32, rows in row-major order of mask, N = ω.sum().
    Padding rows (which may hold -inf or NaN) are never read: their gradient is exactly zero.
    """
    rows = logits[mask.bool()]                                          # (N, V), input dtype
    return F.log_softmax(_fp32(rows), dim=-1)                           # (N, V) fp32


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


def reverse_kl_topm(student_logits, teacher_logits, mask, top_m=20, n_tokens=None):
    """Eq. (10): Σ_{b,t} ω·KL(p̃S ‖ p̃T) / n_tokens, REVERSE KL (student first): Σ_v p̃S(v) log(p̃S(v)/p̃T(v)).

    student_logits, teacher_logits (B, T, V) aligned with mask ω (B, T); -> scalar fp32.
    n_tokens: divisor, default ω.sum() of this batch. A caller that splits a batch into micro-batches passes the
    whole batch's ω.sum() to every micro-batch, so that the micro-batch values sum to the whole-batch value.
    Logits must be finite at supervised positions; masked positions may hold anything (inf, NaN): they are never
    read and get exactly zero gradient.
    (If you prefer F.kl_div: kl_div(input, target, log_target=True) is KL(target ‖ input), so this is
    kl_div(logq_t, logq_s, log_target=True).)
    """
    logp_s = supervised_logprobs(student_logits, mask)                  # (N, V)
    logp_t = supervised_logprobs(teacher_logits, mask)                  # (N, V)
    logq_s, logq_t = topm_tail(logp_s, logp_t, top_m)                   # (N, M+1) each
    # No detach on either side, on purpose: θ only reaches p̃S and φ only reaches p̃T, so the gradient of this one
    # KL w.r.t. θ is ∇θ KL(S ‖ sg T) and w.r.t. φ is ∇φ KL(sg S ‖ T), exactly as §3.3 prescribes.
    kl = bucket_reverse_kl(logq_s, logq_t)                              # (N,)
    n = mask.sum() if n_tokens is None else n_tokens
    return kl.sum() / n


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
    sq = (_fp32(c) - _fp32(c0).detach()).pow(2)                         # (B, J·K, d)
    per_traj = sq.mean(dim=(1, 2))                                      # (B,)
    n = c.shape[0] if n_traj is None else n_traj
    return weight * per_traj.sum() / n


def lopd_objective(student_logits, teacher_logits, ids, mask, rewards, beta, margin, c, c0, anchor_weight,
                   top_m=20, n_tokens=None, per="trajectory", n_traj=None, ref_logits=None):
    """Eq. (13): L = L_distill + β(m − Δ) + λ‖c_φ − sg[c_φ0]‖², for one batch of student trajectories.

    student_logits, teacher_logits (B, T, V) and ids, mask ω (B, T) ALIGNED (logits[:, t] scores ids[:, t]);
    rewards (B,) in [0, 1]; beta, margin, anchor_weight floats (β is a constant here: no gradient);
    c, c0 (B, J·K, d) latents (c=None drops the anchor, e.g. for a frozen composer).
    n_tokens / n_traj: whole-batch token / trajectory counts when micro-batching (defaults: this batch's).
    ref_logits (B, T, V): what δ measures the teacher against. None is the paper's eq. (11), the student; the
    option `--privilege-against phi0` passes the teacher behind φ0's cached latents, so that Δ is the teacher's
    outcome-weighted gain over its cold start (a remedy for a teacher that drifts towards its student; deviation 6).
    The constant β·m carries no gradient. A caller that splits a batch into micro-batches passes each one its
    share of m (lopd.lopd_step: m·b/B), so that the returned losses sum to the whole batch's eq. (13).
    Returns (loss scalar, metrics: "loss/distill", "privilege/delta" (Δ), "loss/anchor" (λ-weighted), "loss/total").
    """
    sel = mask.bool()                                                   # (B, T)
    logp_s = supervised_logprobs(student_logits, sel)                   # (N, V) fp32, kept for KL and δ
    logp_t = supervised_logprobs(teacher_logits, sel)                   # (N, V) fp32
    # eqs. (9)-(10): reverse KL over the teacher's top-M + tail, normalised by the whole batch's token count
    logq_s, logq_t = topm_tail(logp_s, logp_t, top_m)                   # (N, M+1) each
    n = sel.sum() if n_tokens is None else n_tokens
    distill = bucket_reverse_kl(logq_s, logq_t).sum() / n               # scalar
    # eq. (11): δ at the sampled ids, a gather from the same log-probs (no extra forward)
    a = ids[sel].unsqueeze(-1)                                          # (N, 1)
    logp_ref = logp_s if ref_logits is None else supervised_logprobs(ref_logits, sel)     # (N, V)
    delta = privilege_delta(logp_t.gather(-1, a).squeeze(-1), logp_ref.gather(-1, a).squeeze(-1))  # (N,)
    # eq. (12): outcome-weighted privilege Δ
    norm = n_traj if per == "trajectory" else n_tokens
    Delta = outcome_weighted_privilege(_unflatten(delta, sel), sel, rewards, per, norm)  # scalar
    anchor = distill.new_zeros(()) if c is None else latent_anchor(c, c0, anchor_weight, n_traj)  # scalar
    # eq. (13): the Lagrangian at fixed β
    loss = distill + beta * (margin - Delta) + anchor
    metrics = {"loss/distill": distill.item(), "privilege/delta": Delta.item(),
               "loss/anchor": anchor.item(), "loss/total": loss.item()}
    return loss, metrics


def masked_nll(logits, ids, mask, n_tokens=None):
    """−Σ ω log π(ids) / N: the cold start's eq. (14), the toy backbone's SFT, and the RFT control (train.py
    --method rft: NLL of the bank's successes, no teacher).

    logits (B, T, V) and ids, mask ω (B, T) ALIGNED (callers shift a causal LM's logits once) -> scalar fp32.
    n_tokens: the whole batch's supervised-token count when micro-batching (default: this batch's Σ ω).
    """
    n = mask.sum().clamp(min=1) if n_tokens is None else n_tokens
    return -token_logprobs(logits, ids, mask).sum() / n


# ----------------------------------------------------------------------------------------------------------------
# Baselines (train.py --method grpo|opsd|sdpo, paper B.1). Each keeps its own paper's loss and KL direction.
# ----------------------------------------------------------------------------------------------------------------
def group_advantages(rewards, group: int, eps: float = 1e-4):
    """GRPO's group-normalised advantage: Â_i = (r_i − mean_g r) / (std_g r + eps) within each group of G.

    rewards (B,) with B = n_groups·G, rows of one group adjacent -> (B,) fp32. std is the unbiased sample std
    (as TRL's GRPOTrainer); a group whose rewards are all equal gets Â = 0 (no signal)."""
    r = _fp32(rewards).reshape(-1, group)                               # (n_groups, G)
    mean, std = r.mean(1, keepdim=True), r.std(1, keepdim=True)         # (n_groups, 1) each
    return ((r - mean) / (std + eps)).reshape(-1)                       # (B,)


def ppo_clip_loss(logp, logp_old, advantages, mask, eps_lo=0.2, eps_hi=0.2, n_tokens=None):
    """GRPO's clipped surrogate, token level: −Σ ω·min(ρ Â, clip(ρ, 1−ε_lo, 1+ε_hi) Â) / n_tokens, ρ = π/π_old.

    logp (B, T) log π_θ(a_t) with gradient, logp_old (B, T) the same under the policy that sampled (no gradient),
    advantages Â (B,) one per trajectory, mask ω (B, T) -> (scalar loss, clip fraction over ω tokens).
    n_tokens: the whole batch's Σ ω when micro-batching. With one update per batch ρ = 1 and the clip never
    binds: the gradient is then Σ ω Â ∇log π / n_tokens, plain REINFORCE with a group baseline."""
    ratio = torch.exp(logp - logp_old.detach())                         # (B, T) ρ
    adv = _fp32(advantages).unsqueeze(1)                                # (B, 1)
    # the pessimistic bound: min of the unclipped and the clipped surrogate
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - eps_lo, 1 + eps_hi) * adv)   # (B, T)
    n = mask.sum() if n_tokens is None else n_tokens
    clipped = ((ratio < 1 - eps_lo) | (ratio > 1 + eps_hi)).float()     # (B, T)
    return -(surrogate * mask).sum() / n, ((clipped * mask).sum() / mask.sum().clamp(min=1)).item()


def forward_kl_full(student_logits, teacher_logits, mask, n_tokens=None):
    """OPSD's (and SDFT's) loss: Σ ω·KL(πT ‖ πS) / n_tokens over the FULL vocabulary, FORWARD KL (teacher first):
    Σ_v πT(v) log(πT(v)/πS(v)). The teacher is a target: its side is detached, only θ learns.

    student_logits, teacher_logits (B, T, V) aligned with mask ω (B, T) -> scalar fp32."""
    logp_s = supervised_logprobs(student_logits, mask)                  # (N, V)
    logp_t = supervised_logprobs(teacher_logits, mask).detach()         # (N, V)
    kl = (logp_t.exp() * (logp_t - logp_s)).sum(-1)                     # (N,)
    n = mask.sum() if n_tokens is None else n_tokens
    return kl.sum() / n


def reverse_kl_student_topk(student_logits, teacher_logits, mask, top_k=20, n_tokens=None):
    """SDPO's loss: reverse KL(p̃S ‖ sg p̃T) over the STUDENT's top-K ids plus a tail bucket (SDPO picks the
    support from the student; LOPD's eq. 9 from the teacher). The EMA teacher is a target: detached.

    student_logits, teacher_logits (B, T, V) aligned with mask ω (B, T) -> scalar fp32."""
    logp_s = supervised_logprobs(student_logits, mask)                  # (N, V)
    logp_t = supervised_logprobs(teacher_logits, mask).detach()         # (N, V)
    # topm_tail(a, b) takes b's top ids: passing the student second puts the support on the student
    logq_t, logq_s = topm_tail(logp_t, logp_s, top_k)                   # (N, K+1) each
    n = mask.sum() if n_tokens is None else n_tokens
    return bucket_reverse_kl(logq_s, logq_t).sum() / n


@torch.no_grad()
def ema_update(teacher_params, student_params, rate: float):
    """SDPO's teacher: θ̄ ← (1 − rate)·θ̄ + rate·θ, in place, parameter by parameter (rate 0.05 in B.1)."""
    for t, s in zip(teacher_params, student_params):
        t.mul_(1 - rate).add_(s.detach().to(t.dtype), alpha=rate)
