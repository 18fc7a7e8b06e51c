"""Math checks for losses.py (§3.3, eqs. 9-13) against float64 brute force written out here.

Run: pytest tests/test_losses.py -q
"""
import math
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import losses  # noqa: E402

B, T, V, M = 2, 5, 50, 7

pytestmark = pytest.mark.equality        # every test here holds losses.py against an independent computation


def make_batch(seed=0, b=B, t=T, v=V, scale=2.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    s = (scale * torch.randn(b, t, v, generator=g)).to(dtype)
    te = (scale * torch.randn(b, t, v, generator=g)).to(dtype)
    mask = torch.rand(b, t, generator=g) < 0.7
    mask[:, 0] = True                                                  # every row has a supervised token
    mask[0, -1] = False                                                # and at least one masked position
    ids = torch.randint(0, v, (b, t), generator=g)
    return s, te, ids, mask


# ---------- float64 brute force, independent of losses.py ----------

def bf_log_softmax(row):
    """row: 1-D float64 numpy -> log-softmax, written out."""
    mx = max(row)
    z = sum(math.exp(x - mx) for x in row)
    return np.array([x - mx - math.log(z) for x in row])


def bf_buckets(s_row, t_row, m):
    """Eq. (9) by hand for one position: teacher's top-m ids + tail; returns probabilities (m+1,) per side."""
    ls, lt = bf_log_softmax(s_row), bf_log_softmax(t_row)
    top = sorted(range(len(t_row)), key=lambda v: -lt[v])[:m]
    ps = [math.exp(ls[v]) for v in top]
    pt = [math.exp(lt[v]) for v in top]
    return np.array(ps + [1.0 - sum(ps)]), np.array(pt + [1.0 - sum(pt)])


def bf_kl(p, q):
    """KL(p ‖ q) = Σ p log(p/q), terms with p = 0 contribute 0."""
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q) if pi > 0)


def bf_distill(s, te, mask, m, n_tokens=None):
    s, te, mask = s.detach().double().numpy(), te.detach().double().numpy(), mask.numpy()
    total = 0.0
    for b in range(s.shape[0]):
        for t in range(s.shape[1]):
            if mask[b, t]:
                ps, pt = bf_buckets(s[b, t], te[b, t], m)
                total += bf_kl(ps, pt)                                  # reverse: student first
    return total / (mask.sum() if n_tokens is None else n_tokens)


def bf_token_logp(logits, ids):
    x = logits.detach().double().numpy()
    return np.array([[bf_log_softmax(x[b, t])[ids[b, t]] for t in range(x.shape[1])] for b in range(x.shape[0])])


def bf_Delta(delta, mask, rewards, per):
    delta, mask, r = np.asarray(delta, dtype=np.float64), mask.numpy(), rewards.double().numpy()
    if per == "trajectory":
        vals = []
        for b in range(delta.shape[0]):
            n = mask[b].sum()
            if n > 0:
                vals.append((2 * r[b] - 1) * sum(delta[b, t] for t in range(delta.shape[1]) if mask[b, t]) / n)
        return sum(vals) / len(vals)
    num = sum((2 * r[b] - 1) * delta[b, t] for b in range(delta.shape[0]) for t in range(delta.shape[1]) if mask[b, t])
    return num / mask.sum()


# ---------- eqs. (9)-(10): top-M + tail reverse KL ----------

def mean_kl(s, t, mask, top_m, n_tokens=None):
    """L_distill from logits (B, T, V) and ω (B, T) as training builds it: eq. (10)'s token terms
    (losses.reverse_kl_topm) of the supervised tokens, summed over the whole batch's ω count."""
    sel = mask.bool()
    kl = losses.reverse_kl_topm(losses.supervised_logprobs(s, sel), losses.supervised_logprobs(t, sel), top_m)
    return kl.sum() / (sel.sum() if n_tokens is None else n_tokens)


def test_reverse_kl_matches_brute_force():
    s, te, _, mask = make_batch()
    got = mean_kl(s, te, mask, top_m=M).item()
    want = bf_distill(s, te, mask, M)
    assert want > 0.1                                                   # a non-trivial value
    assert abs(got - want) < 1e-6


def test_direction_is_reverse():
    s, te, _, mask = make_batch(seed=3)
    got = mean_kl(s, te, mask, top_m=M).item()
    # the forward direction KL(p̃T ‖ p̃S) on the same buckets gives a different number
    sn, tn, mn = s.double().numpy(), te.double().numpy(), mask.numpy()
    fwd = [bf_kl(*reversed(bf_buckets(sn[b, t], tn[b, t], M))) for b in range(B) for t in range(T) if mn[b, t]]
    assert abs(got - sum(fwd) / mn.sum()) > 1e-3


def test_zero_for_identical_logits():
    s, _, _, mask = make_batch()
    assert abs(mean_kl(s, s.clone(), mask, top_m=M).item()) < 1e-6


def test_m_equals_v_is_full_vocabulary_kl():
    s, te, _, mask = make_batch(seed=1)
    got = mean_kl(s, te, mask, top_m=V).item()
    sn, tn, mn = s.double().numpy(), te.double().numpy(), mask.numpy()
    full = [bf_kl(np.exp(bf_log_softmax(sn[b, t])), np.exp(bf_log_softmax(tn[b, t])))
            for b in range(B) for t in range(T) if mn[b, t]]
    assert abs(got - sum(full) / mn.sum()) < 1e-6
    assert torch.isfinite(torch.tensor(got))


def test_buckets_sum_to_one_and_match_brute_force():
    s, te, _, _ = make_batch(seed=2)
    logq_s, logq_t = losses.topm_tail(torch.log_softmax(s, -1), torch.log_softmax(te, -1), M)
    assert logq_s.shape == (B, T, M + 1) and logq_t.shape == (B, T, M + 1)
    assert torch.allclose(logq_s.exp().sum(-1), torch.ones(B, T), atol=1e-6)
    assert torch.allclose(logq_t.exp().sum(-1), torch.ones(B, T), atol=1e-6)
    ps, pt = bf_buckets(s[1, 3].double().numpy(), te[1, 3].double().numpy(), M)
    assert np.allclose(logq_s[1, 3].exp().double().numpy(), ps, atol=1e-6)
    assert np.allclose(logq_t[1, 3].exp().double().numpy(), pt, atol=1e-6)


def test_tail_is_finite_when_top_m_holds_all_mass():
    # a teacher so peaked that Σ top-M p rounds to 1 in fp32: the tail must stay finite (the clamp)
    te = torch.full((1, 1, V), -1e4)
    te[0, 0, :M] = torch.arange(M, dtype=torch.float32)
    s = torch.randn(1, 1, V, requires_grad=True)
    t_req = te.clone().requires_grad_(True)
    loss = mean_kl(s, t_req, torch.ones(1, 1, dtype=torch.bool), top_m=M)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(s.grad).all() and torch.isfinite(t_req.grad).all()


def test_masked_tokens_contribute_nothing():
    s, te, _, mask = make_batch(seed=4)
    s1, t1 = s.clone().requires_grad_(True), te.clone().requires_grad_(True)
    loss1 = mean_kl(s1, t1, mask, top_m=M)
    loss1.backward()
    for junk in (float("nan"), float("inf"), -float("inf"), 1e30):
        s2, t2 = s.clone(), te.clone()
        s2[~mask], t2[~mask] = junk, junk
        s2.requires_grad_(True)
        t2.requires_grad_(True)
        loss2 = mean_kl(s2, t2, mask, top_m=M)
        loss2.backward()
        assert loss2.item() == loss1.item()
        assert torch.equal(s2.grad, s1.grad) and torch.equal(t2.grad, t1.grad)
        assert (s2.grad[~mask] == 0).all() and (t2.grad[~mask] == 0).all()


def test_global_normalisation_over_micro_batches():
    s, te, ids, mask = make_batch(seed=5, b=4)
    whole = mean_kl(s, te, mask, top_m=M).item()
    n = mask.sum()
    parts = sum(mean_kl(s[i:i + 2], te[i:i + 2], mask[i:i + 2], top_m=M, n_tokens=n).item()
                for i in (0, 2))
    assert abs(parts - whole) < 1e-6
    assert abs(whole - bf_distill(s, te, mask, M)) < 1e-6
    # the same for Δ, in both modes
    delta = torch.randn(4, T, dtype=torch.float64)
    r = torch.tensor([1.0, 0.0, 0.5, 1.0], dtype=torch.float64)
    n_traj = int((mask.sum(1) > 0).sum())
    for per, norm in (("trajectory", n_traj), ("token", n)):
        whole = losses.outcome_weighted_privilege(delta, mask, r, per).item()
        parts = sum(losses.outcome_weighted_privilege(delta[i:i + 2], mask[i:i + 2], r[i:i + 2], per, norm).item()
                    for i in (0, 2))
        assert abs(parts - whole) < 1e-12


def test_gradcheck_both_sides():
    s, te, _, mask = make_batch(seed=6, b=1, t=3, v=7, dtype=torch.float64)
    s.requires_grad_(True)
    te.requires_grad_(True)
    f = lambda a, b: mean_kl(a, b, mask, top_m=3)   # noqa: E731
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                                            # tiny tensors: a thread pool only adds overhead
    try:
        assert torch.autograd.gradcheck(f, (s, te), eps=1e-6, atol=1e-6)
    finally:
        torch.set_num_threads(threads)


def test_gradients_go_to_student_and_teacher():
    s, te, _, mask = make_batch(seed=7)
    s.requires_grad_(True)
    te.requires_grad_(True)
    mean_kl(s, te, mask, top_m=M).backward()
    assert s.grad.abs().sum() > 0 and te.grad.abs().sum() > 0


# ---------- eqs. (11)-(12): δ and Δ ----------

def test_token_logprobs_brute_force():
    s, _, ids, mask = make_batch(seed=8)
    got = losses.token_logprobs(s, ids).double().numpy()
    assert np.allclose(got, bf_token_logp(s, ids), atol=1e-5)
    got_m = losses.token_logprobs(s, ids, mask).double().numpy()
    assert np.allclose(got_m, bf_token_logp(s, ids) * mask.numpy(), atol=1e-5)


def test_masked_nll_brute_force_and_global_normaliser():
    s, _, ids, mask = make_batch(seed=12)
    want = -(bf_token_logp(s, ids) * mask.numpy()).sum() / mask.numpy().sum()
    assert abs(losses.masked_nll(s, ids, mask).item() - want) < 1e-5
    # micro-batches with the whole batch's token count add up to the whole-batch value (the RFT control's steps)
    n = mask.sum()
    parts = sum(losses.masked_nll(s[i:i + 1], ids[i:i + 1], mask[i:i + 1], n).item() for i in range(len(s)))
    assert abs(parts - want) < 1e-5


def test_delta_gives_no_gradient_to_student():
    s, te, ids, mask = make_batch(seed=9)
    s.requires_grad_(True)
    te.requires_grad_(True)
    delta = losses.privilege_delta(losses.token_logprobs(te, ids, mask), losses.token_logprobs(s, ids, mask))
    want = bf_token_logp(te, ids) - bf_token_logp(s, ids)
    assert np.allclose(delta.detach().double().numpy()[mask.numpy()], want[mask.numpy()], atol=1e-5)
    Delta = losses.outcome_weighted_privilege(delta, mask, torch.tensor([1.0, 0.0]))
    Delta.backward()
    assert s.grad is None or (s.grad == 0).all()
    assert te.grad is not None and te.grad.abs().sum() > 0


@pytest.mark.parametrize("per", ["trajectory", "token"])
def test_Delta_brute_force(per):
    g = torch.Generator().manual_seed(10)
    delta = torch.randn(4, 6, generator=g, dtype=torch.float64)
    mask = torch.rand(4, 6, generator=g) < 0.6
    mask[2] = False                                                    # a trajectory with no ω tokens (skipped)
    mask[0, :3] = True
    delta[~mask] = float("nan")                                        # δ at masked positions must be ignored
    r = torch.tensor([1.0, 0.0, 1.0, 0.3], dtype=torch.float64)
    got = losses.outcome_weighted_privilege(delta, mask, r, per).item()
    assert abs(got - bf_Delta(delta.numpy(), mask, r, per)) < 1e-12


def test_Delta_modes_differ_with_unequal_lengths():
    delta = torch.ones(2, 4, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    r = torch.tensor([1.0, 0.0], dtype=torch.float64)                 # A = +1, −1
    assert losses.outcome_weighted_privilege(delta, mask, r, "trajectory").item() == pytest.approx(0.0)
    assert losses.outcome_weighted_privilege(delta, mask, r, "token").item() == pytest.approx(3 / 5)


# ---------- eq. (13): dual step, anchor, objective ----------

def test_dual_step():
    assert losses.dual_step(0.2, delta_value=0.0, margin=0.05, lr=0.5) == pytest.approx(0.225)   # Δ < m: rises
    assert losses.dual_step(0.2, delta_value=0.15, margin=0.05, lr=0.5) == pytest.approx(0.15)   # Δ > m: falls
    assert losses.dual_step(0.01, delta_value=1.0, margin=0.05, lr=0.5) == 0.0                   # clamped at 0
    assert isinstance(losses.dual_step(0.0, 0.0, 0.05, 0.5), float)


def test_latent_anchor_brute_force_and_no_grad_to_c0():
    g = torch.Generator().manual_seed(11)
    c = torch.randn(3, 6, 4, generator=g, requires_grad=True)
    c0 = torch.randn(3, 6, 4, generator=g, requires_grad=True)
    got = losses.latent_anchor(c, c0, weight=0.2)
    cn, c0n = c.detach().double().numpy(), c0.detach().double().numpy()
    per_traj = [sum((cn[b, i, j] - c0n[b, i, j]) ** 2 for i in range(6) for j in range(4)) / 24 for b in range(3)]
    assert abs(got.item() - 0.2 * sum(per_traj) / 3) < 1e-6
    got.backward()
    assert c0.grad is None
    assert torch.allclose(c.grad, 0.2 * 2 * (c - c0).detach() / (3 * 24))


def test_lopd_objective_parts_and_gradients():
    s, te, ids, mask = make_batch(seed=12)
    s.requires_grad_(True)
    te.requires_grad_(True)
    c = torch.randn(B, 6, 4, requires_grad=True)
    c0 = torch.randn(B, 6, 4)
    r = torch.tensor([1.0, 0.0])
    beta, m, lam = 0.7, 0.05, 0.2
    loss, met = losses.lopd_objective(s, te, ids, mask, r, latents=(c, c0), eq=losses.Eq13(beta=beta, margin=m, anchor=lam, top_m=M, delta_per="trajectory", kl_per="token"))
    # parts against brute force
    distill = bf_distill(s.detach(), te.detach(), mask, M)
    delta = bf_token_logp(te.detach(), ids) - bf_token_logp(s.detach(), ids)
    Delta = bf_Delta(delta, mask, r, "trajectory")
    anchor = lam * ((c.detach().double() - c0.double()) ** 2).mean(dim=(1, 2)).sum().item() / B
    assert abs(met["loss/distill"] - distill) < 1e-6
    assert abs(met["privilege/delta"] - Delta) < 1e-5
    assert abs(met["loss/anchor"] - anchor) < 1e-6
    # total = sum of parts
    assert met["loss/total"] == pytest.approx(met["loss/distill"] + beta * (m - met["privilege/delta"])
                                              + met["loss/anchor"], abs=1e-6)
    assert abs(met["loss/total"] - (distill + beta * (m - Delta) + anchor)) < 1e-5
    loss.backward()
    assert s.grad.abs().sum() > 0 and te.grad.abs().sum() > 0 and c.grad.abs().sum() > 0
    # the student's gradient is the distillation gradient alone (δ is detached on the student side)
    s2 = s.detach().clone().requires_grad_(True)
    mean_kl(s2, te.detach(), mask, top_m=M).backward()
    assert torch.allclose(s.grad, s2.grad, atol=1e-7)


def test_privilege_against_a_reference_policy():
    """ref_logits (the teacher behind φ0's latents, --privilege-against phi0): δ = log πT(a) − log πref(a). With the
    student as the reference it is eq. (11) exactly; with the teacher itself Δ is 0; otherwise Δ matches the float64
    brute force, and the student's gradient is still the distillation gradient alone."""
    s, te, ids, mask = make_batch(seed=13)
    ref = make_batch(seed=14)[1]
    r = torch.tensor([1.0, 0.0])
    args, kw = (ids, mask, r), {"eq": losses.Eq13(beta=0.7, margin=0.05, anchor=0.2, top_m=M, delta_per="trajectory", kl_per="token")}   # no latents: no anchor
    plain = losses.lopd_objective(s, te, *args, **kw)[1]
    assert losses.lopd_objective(s, te, *args, **kw, ref_logits=s)[1] == plain
    assert losses.lopd_objective(s, te, *args, **kw, ref_logits=te)[1]["privilege/delta"] == 0.0
    s.requires_grad_(True)
    loss, met = losses.lopd_objective(s, te, *args, **kw, ref_logits=ref)
    want = bf_Delta(bf_token_logp(te, ids) - bf_token_logp(ref, ids), mask, r, "trajectory")
    assert abs(met["privilege/delta"] - want) < 1e-5 and abs(met["privilege/delta"] - plain["privilege/delta"]) > 1e-3
    loss.backward()
    s2 = s.detach().clone().requires_grad_(True)
    mean_kl(s2, te, mask, top_m=M).backward()
    assert torch.allclose(s.grad, s2.grad, atol=1e-7)


# ----------------------------------------------------------------------------------------------------------------
# The chunked objective from hidden states equals the full-logits reference, in value and in every gradient
# ----------------------------------------------------------------------------------------------------------------
def hidden_case(seed, tied, dtype=torch.float32, b=3, t=7, d=6, v=40):
    """Hidden states, heads and the rest of eq. (13)'s inputs; the ω mask has an empty row and ragged rows."""
    g = torch.Generator().manual_seed(seed)
    leaf = lambda *shape: (torch.randn(*shape, generator=g) * 1.5).to(dtype).requires_grad_(True)   # noqa: E731
    h_s, h_t, h_r = leaf(b, t, d), leaf(b, t, d), leaf(b, t, d)
    w_s, b_s = leaf(v, d), leaf(v)
    w_t = w_s if tied else leaf(v, d)       # tied: one matrix on both sides (a LoRA student shares θ̄'s head)
    mask = torch.rand(b, t, generator=g) > 0.35                                       # (B, T) ω
    mask[1] = False                                                                   # a row without ω tokens
    ids = torch.randint(0, v, (b, t), generator=g)                                    # (B, T)
    rewards = torch.tensor([1.0, 0.0, 0.25])
    c, c0 = leaf(b, 4, d), torch.randn(b, 4, d, generator=g).to(dtype)              # (B, J·K, d)
    return dict(h_s=h_s, h_t=h_t, h_r=h_r, w_s=w_s, b_s=b_s, w_t=w_t, mask=mask, ids=ids, rewards=rewards, c=c, c0=c0)


def run_both(x, chunk, ref, top_m=5, per="trajectory"):
    """(loss, grads) of the reference on full logits and of the chunked objective on the same leaves."""
    out = []
    for fused in (False, True):
        leaves = [x[k] for k in ("h_s", "h_t", "h_r", "w_s", "b_s", "w_t", "c")]
        for p in leaves:
            p.grad = None
        rest = (x["ids"], x["mask"], x["rewards"])
        kw = {"latents": (x["c"], x["c0"]), "eq": losses.Eq13(beta=0.7, margin=0.05, anchor=0.2, top_m=top_m, delta_per=per, kl_per="token")}
        if fused:
            heads = ((x["w_s"], x["b_s"]), (x["w_t"], None), (x["w_t"], None))
            loss, m = losses.lopd_objective_from_hidden(x["h_s"], x["h_t"], heads, *rest, **kw,
                                                        h_ref=x["h_r"] if ref else None, chunk=chunk)
        else:
            logits = lambda h, w, b=None: torch.nn.functional.linear(h, w, b)    # noqa: E731
            loss, m = losses.lopd_objective(logits(x["h_s"], x["w_s"], x["b_s"]), logits(x["h_t"], x["w_t"]), *rest,
                                            **kw, ref_logits=logits(x["h_r"], x["w_t"]) if ref else None)
        loss.backward()
        out.append((loss.detach().double(), m, [None if p.grad is None else p.grad.double() for p in leaves]))
    return out


# In float64. The two are equal in exact arithmetic; in fp32 the head is applied to a chunk of rows by a kernel the
# CPU chooses (a matrix-vector product for one row; another blocking under AVX-512 than AVX2), whose rounding differs
# by ~1e-6 in a logit, and one row of this case turns that into ~1e-5 of its KL: an fp32 tolerance would pass on one
# machine and fail on the next. In float64 the two agree to ~1e-15 whatever the kernel. (bf16 below: closeness.)
@pytest.mark.parametrize("chunk", [1, 2, 4, 1000])   # one row, chunks that split rows, one chunk
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("ref", [False, True])
def test_chunked_objective_equals_the_full_logits_reference(chunk, tied, ref):
    (l0, m0, g0), (l1, m1, g1) = run_both(hidden_case(0, tied, torch.float64), chunk, ref)
    assert torch.allclose(l1, l0, rtol=1e-12, atol=1e-14), (l1, l0)
    for k in m0:
        assert m1[k] == pytest.approx(m0[k], rel=1e-10, abs=1e-12), k
    names = ("h_s", "h_t", "h_r", "w_s", "b_s", "w_t", "c")
    for name, a, b in zip(names, g0, g1):
        if a is None:
            assert b is None or b.abs().max() == 0, name
            continue
        assert a.abs().max() > 0 or name == "h_r", name          # every trained side receives a gradient
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12, msg=name)


def test_chunked_objective_in_bf16_matches_the_reference_and_the_tail_bucket_matters():
    (l0, _, g0), (l1, _, g1) = run_both(hidden_case(1, False, torch.bfloat16), chunk=3, ref=False)
    assert torch.allclose(l1, l0, rtol=2e-2, atol=1e-3)
    for a, b in zip(g0, g1):
        if a is not None:
            torch.testing.assert_close(b, a, rtol=5e-2, atol=5e-3)
    # the tail bucket is not optional: with M = V − 1 the top-M support and its tail give another KL than M = 2
    x = hidden_case(2, False)
    (small, _, _), _ = run_both(x, 2, False, top_m=2)
    (wide, _, _), _ = run_both(x, 2, False, top_m=39)
    assert abs(small - wide) > 1e-3


def test_chunked_objective_reads_only_the_omega_rows():
    """Rows with ω = 0 may hold anything (padding: NaN): the loss and its gradients stay finite and unchanged."""
    x = hidden_case(3, False)
    (l0, _, _), (l1, _, g1) = run_both(x, 2, True)
    with torch.no_grad():
        for k in ("h_s", "h_t", "h_r"):
            x[k][~x["mask"]] = float("nan")
    (_, _, _), (l2, _, g2) = run_both(x, 2, True)
    assert torch.allclose(l2, l1) and all(g is None or torch.isfinite(g).all() for g in g2)


def test_token_logprobs_and_rowwise_losses_from_hidden_states_equal_their_full_logits_forms():
    """The bounded path of the cold start, RFT, GRPO (token log-probs) and OPSD, SDPO (row-wise divergences)."""
    import baselines
    x = hidden_case(4, False, torch.float64)
    h_s, h_t, w_s, b_s, w_t, ids, mask = (x[k] for k in ("h_s", "h_t", "w_s", "b_s", "w_t", "ids", "mask"))
    logits = torch.nn.functional.linear
    leaves = (h_s, h_t, w_s, b_s, w_t)
    for full, chunked in (
            (lambda: losses.masked_nll(logits(h_s, w_s, b_s), ids, mask),
             lambda: -losses.token_logprobs_from_hidden(h_s, (w_s, b_s), ids, mask, chunk=2).sum() / mask.sum()),
            (lambda: baselines.forward_kl_full(logits(h_s, w_s, b_s), logits(h_t, w_t), mask),
             lambda: losses.rowwise_from_hidden(baselines.forward_kl_full, h_s, h_t, (w_s, b_s), (w_t, None), mask,
                                                chunk=3)),
            (lambda: baselines.reverse_kl_student_topk(logits(h_s, w_s, b_s), logits(h_t, w_t), mask, 4),
             lambda: losses.rowwise_from_hidden(lambda a, b, m, n: baselines.reverse_kl_student_topk(a, b, m, 4, n),
                                                h_s, h_t, (w_s, b_s), (w_t, None), mask, chunk=4))):
        got = []
        for fn in (full, chunked):
            for p in leaves:
                p.grad = None
            loss = fn()
            loss.backward()
            got.append((loss.detach(), [None if p.grad is None else p.grad.clone() for p in leaves]))
        (l0, g0), (l1, g1) = got
        assert torch.allclose(l0, l1, rtol=1e-10) and l0.abs() > 0
        for a, b in zip(g0, g1):
            assert (a is None) == (b is None) or (b is not None and b.abs().max() == 0)
            if a is not None:
                torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-12)
