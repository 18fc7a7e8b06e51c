"""The official code's settings as flags (scripts/experiments.py absorb), each against an independent computation:
--kl-per trajectory (eq. 10 as written), --task-order epoch, --cold-optim split and --qformer-dtype bfloat16.
--retrieval self and shop are tested in test_lopd.py (the modes) and test_retrieval.py (the oracle)."""
import argparse
import random

import pytest
import torch

import engine
import losses
import train
from test_losses import M, bf_buckets, bf_kl, hidden_case, make_batch
from test_composer import build


# ---------- L_distill per trajectory (eq. 10 as written) ----------------------------------------------------------
def bf_distill_per_trajectory(s, te, mask, m):
    """Each trajectory's mean KL over its ω tokens, then the mean over trajectories that have any (float64)."""
    s, te, mask = s.detach().double().numpy(), te.detach().double().numpy(), mask.numpy()
    means = []
    for b in range(s.shape[0]):
        kls = [bf_kl(*bf_buckets(s[b, t], te[b, t], m)) for t in range(s.shape[1]) if mask[b, t]]
        if kls:
            means.append(sum(kls) / len(kls))
    return sum(means) / len(means)


def distill(kl_per, s, te, ids, mask, **kw):
    rewards = torch.ones(s.shape[0])
    eq = losses.Eq13(beta=0.0, margin=0.0, anchor=0.0, top_m=M, delta_per="trajectory", kl_per=kl_per, **kw)
    return losses.lopd_objective(s, te, ids, mask, rewards, eq=eq)[1]["loss/distill"]   # β = m = λ = 0, no latents


def test_kl_per_trajectory_is_the_mean_of_each_trajectorys_mean():
    s, te, ids, mask = make_batch(seed=3, b=4, t=6)
    mask[1, 2:] = False                                     # lengths differ, so the two normalisations differ
    want = bf_distill_per_trajectory(s, te, mask, M)
    assert distill("trajectory", s, te, ids, mask) == pytest.approx(want, rel=1e-6)
    assert abs(distill("token", s, te, ids, mask) - want) > 1e-3
    # micro-batches given the whole batch's trajectory count add up to the whole batch's value
    parts = sum(distill("trajectory", s[i:i + 2], te[i:i + 2], ids[i:i + 2], mask[i:i + 2], n_traj=4)
                for i in (0, 2))
    assert parts == pytest.approx(want, rel=1e-6)


@pytest.mark.equality
def test_kl_per_trajectory_chunked_equals_the_reference_in_value_and_gradient():
    """In float64: the two paths are equal in exact arithmetic, and in fp32 their sums run in another order by a
    kernel the CPU chooses (on an AVX-512 machine a gradient entry differed by 2e-6, relative 5e-4)."""
    x = hidden_case(1, tied=False, dtype=torch.float64)
    out = []
    for fused in (False, True):
        leaves = [x[k] for k in ("h_s", "h_t", "w_s", "w_t")]
        for p in leaves:
            p.grad = None
        eq = losses.Eq13(beta=0.7, margin=0.05, anchor=0.2, top_m=5, delta_per="trajectory", kl_per="trajectory")
        rest, kw = (x["ids"], x["mask"], x["rewards"]), {"latents": (x["c"], x["c0"]), "eq": eq}
        if fused:
            heads = ((x["w_s"], x["b_s"]), (x["w_t"], None), (x["w_t"], None))
            loss, _ = losses.lopd_objective_from_hidden(x["h_s"], x["h_t"], heads, *rest, **kw, chunk=2)
        else:
            f = torch.nn.functional.linear
            loss, _ = losses.lopd_objective(f(x["h_s"], x["w_s"], x["b_s"]), f(x["h_t"], x["w_t"]), *rest, **kw)
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in leaves]))
    (l0, g0), (l1, g1) = out
    torch.testing.assert_close(l1, l0, rtol=1e-12, atol=1e-14)                 # float64: rounding ~1e-16
    for a, b in zip(g0, g1):
        assert a.abs().max() > 0
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


# ---------- --task-order epoch ------------------------------------------------------------------------------------
def draw(order, step, n_train=100, per_step=32, per_task=1, seed=0):
    return engine.draw_tasks(list(range(n_train)), per_step // per_task, random.Random(7), order=order, seed=seed,
                             step=step)


def test_epoch_order_shows_every_task_once_before_any_twice_and_resumes_by_step():
    seq = [t for step in range(25) for t in draw("epoch", step)]                  # 800 draws: 8 epochs of 100
    for e in range(8):
        assert sorted(seq[100 * e:100 * (e + 1)]) == list(range(100))             # each epoch a permutation
    assert seq[:100] != seq[100:200]                                              # and a new one each epoch
    assert draw("epoch", 13) == seq[13 * 32:14 * 32]                              # a resumed step: the same tasks
    assert draw("epoch", 3, per_task=4) == seq[24:32]                             # GRPO's groups: 8 tasks a step
    # the default draws afresh each step: after 25 steps some tasks were never seen (and the draw is task_rng's)
    fresh = [t for step in range(3) for t in draw("fresh", step)]
    assert draw("fresh", 0) == random.Random(7).sample(list(range(100)), 32)
    assert len(set(fresh)) < len(fresh)


# ---------- --retrieval self / shop: tests/test_lopd.py (the modes) and tests/test_retrieval.py (the oracle) --------


# ---------- --cold-optim split -------------------------------------------------------------------------------------
def test_split_cold_start_groups_partition_the_composer_with_the_official_clips(tok):
    comp, _ = build(tok)
    args = argparse.Namespace(cold_optim="joint", cold_clip=3.0, cold_qformer_clip=30.0)
    (joint, clip), = train.cold_start_groups(args, comp)
    assert clip == 3.0 and [id(p) for p in joint] == [id(p) for p in comp.trainable_parameters()]
    (psi, c_psi), (chi, c_chi) = train.cold_start_groups(argparse.Namespace(**{**vars(args), "cold_optim": "split"}),
                                                         comp)
    assert (c_psi, c_chi) == (3.0, 30.0)
    assert {id(p) for p in chi} == {id(p) for p in comp.qformer.parameters()}
    assert {id(p) for p in psi} | {id(p) for p in chi} == {id(p) for p in joint}
    assert not {id(p) for p in psi} & {id(p) for p in chi}
    assert all("lora" in n for n, p in comp.peft.named_parameters() if any(p is q for q in psi))


# ---------- --qformer-dtype bfloat16 ------------------------------------------------------------------------------
def test_a_bf16_qformer_composes_close_to_fp32_and_a_1e5_step_leaves_most_entries_unchanged(tok):
    comp, _ = build(tok)
    tasks, exps = ["find order 12"], [["list_orders -> ok", "get_order -> ok"]]
    with torch.no_grad():
        c32 = comp(tasks, exps)                                                      # (1, J·K, d)
    comp.qformer.to(torch.bfloat16)
    c16 = comp(tasks, exps)
    assert c16.dtype == c32.dtype and torch.isfinite(c16).all()
    assert (c16 - c32).norm() / c32.norm() < 0.05                                    # bf16 rounding, not a bug
    # the official code's QFormer in bf16: an AdamW step of lr 1e-5 moves each entry by ~1e-5, below half a bf16
    # ulp of most of them, so most entries stay exactly where they were
    before = [p.detach().clone() for p in comp.qformer.parameters()]
    opt = torch.optim.AdamW(comp.qformer.parameters(), lr=1e-5)
    c16.float().pow(2).sum().backward()
    opt.step()
    moved = sum((p.detach() != b).sum().item() for p, b in zip(comp.qformer.parameters(), before))
    total = sum(b.numel() for b in before)
    assert moved / total < 0.5, moved / total
