"""Tests for the baselines in the shared loop (train.py --method grpo|opsd|sdpo; paper B.1).

Run: python -m pytest tests/test_baselines.py -q
Each loss against a float64 brute force written out here (loops over rows and ids, no shared helper), and one
test that every method goes through the same rollout and the same student scoring: the methods differ only in
the teacher's context and the loss. The world fixture (tiny toy backbone, scripted bank) is test_lopd.py's.
"""
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import baselines  # noqa: E402
import engine  # noqa: E402
import lopd  # noqa: E402
import losses  # noqa: E402
from worlds import common, tool_world  # noqa: E402
from test_lopd import SAMPLE, make_models, world  # noqa: E402,F401  (world is a fixture)


# ------------------------------------------------------------------------------------------------------------
# GRPO
# ------------------------------------------------------------------------------------------------------------
def test_group_advantages_match_a_per_group_loop():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2, 0.2, 0.2, 0.2, 0.0, 1.0, 1.0, 0.25])
    got = baselines.group_advantages(rewards, 4)
    want = []
    for g in range(3):
        r = [float(x) for x in rewards[4 * g:4 * g + 4]]
        mean = sum(r) / 4
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / 3)          # unbiased, as TRL
        want += [(x - mean) / (std + 1e-4) for x in r]
    assert torch.allclose(got.double(), torch.tensor(want, dtype=torch.float64), atol=1e-5)
    assert torch.equal(got[4:8], torch.zeros(4))                       # equal rewards: no signal


def test_ppo_clip_loss_matches_a_token_loop_and_clips_both_ways():
    g = torch.Generator().manual_seed(0)
    B, T = 3, 5
    logp_old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = logp_old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4      # ρ spread around 1
    logp.requires_grad_(True)
    adv = torch.tensor([1.3, -0.7, 0.4], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0]], dtype=torch.float64)
    loss, frac = baselines.ppo_clip_loss(logp, logp_old, adv, mask, eps_lo=0.2, eps_hi=0.2, n_tokens=20.0)
    total, clipped = 0.0, 0
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                rho = math.exp(float(logp[b, t].detach() - logp_old[b, t]))
                a = float(adv[b])
                total += min(rho * a, min(max(rho, 0.8), 1.2) * a)
                clipped += not (0.8 <= rho <= 1.2)
    assert loss.item() == pytest.approx(-total / 20.0, abs=1e-12)
    assert frac == pytest.approx(clipped / mask.sum().item())
    assert 0 < clipped < mask.sum().item()          # the test reaches both branches
    # gradient: zero where the clipped branch is the minimum (ρ outside the band in the advantage's direction)
    loss.backward()
    rho = (logp - logp_old).exp().detach()
    dead = ((adv[:, None] > 0) & (rho > 1.2)) | ((adv[:, None] < 0) & (rho < 0.8))
    assert (logp.grad[dead.bool() & mask.bool()] == 0).all()
    live = ~dead & mask.bool()
    assert torch.allclose(logp.grad[live], (-adv[:, None] * rho / 20.0).expand(B, T)[live])


def test_one_update_ppo_clip_is_reinforce_with_a_group_baseline():
    """With π_old = the sampling policy (ρ = 1) the clip never binds: ∇ = −Σ ω Â ∇log π / N."""
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    adv, mask = torch.tensor([0.5, -1.0]), torch.ones(2, 2)
    loss, frac = baselines.ppo_clip_loss(logp, logp.detach(), adv, mask, n_tokens=4)
    loss.backward()
    assert frac == 0.0
    assert torch.allclose(logp.grad, torch.tensor([[-0.125, -0.125], [0.25, 0.25]]))


# ------------------------------------------------------------------------------------------------------------
# OPSD and SDPO
# ------------------------------------------------------------------------------------------------------------
def _rand_logits(B=2, T=4, V=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2,
            torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2)


def _softmax(row):
    m = max(row)
    e = [math.exp(x - m) for x in row]
    return [x / sum(e) for x in e]


def test_forward_kl_full_matches_a_vocabulary_loop_and_trains_only_the_student():
    ls, lt = _rand_logits()
    ls.requires_grad_(True)
    lt.requires_grad_(True)
    mask = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1]], dtype=torch.float64)
    got = baselines.forward_kl_full(ls, lt, mask, n_tokens=10.0)
    want = 0.0
    for b in range(2):
        for t in range(4):
            if mask[b, t]:
                p, q = _softmax(lt[b, t].tolist()), _softmax(ls[b, t].tolist())
                want += sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))   # KL(teacher ‖ student)
    assert got.item() == pytest.approx(want / 10.0, abs=1e-10)
    got.backward()
    assert lt.grad is None or torch.all(lt.grad == 0)                      # the teacher is a target
    assert ls.grad.abs().sum() > 0
    assert baselines.forward_kl_full(lt, lt, mask).item() == pytest.approx(0.0, abs=1e-12)


def test_sdpo_reverse_kl_uses_the_students_top_k_plus_tail():
    ls, lt = _rand_logits(seed=1)
    mask = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 0]], dtype=torch.float64)
    K = 3
    got = baselines.reverse_kl_student_topk(ls, lt, mask, top_k=K)
    want, n = 0.0, 0
    for b in range(2):
        for t in range(4):
            if not mask[b, t]:
                continue
            n += 1
            ps, pt = _softmax(ls[b, t].tolist()), _softmax(lt[b, t].tolist())
            top = sorted(range(7), key=lambda v: -ps[v])[:K]                 # the STUDENT's top-K ids
            qs = [ps[v] for v in top] + [1 - sum(ps[v] for v in top)]
            qt = [pt[v] for v in top] + [1 - sum(pt[v] for v in top)]
            want += sum(a * math.log(a / c) for a, c in zip(qs, qt))          # KL(student ‖ teacher)
    assert got.item() == pytest.approx(want / n, abs=1e-10)
    # K = V: the full-vocabulary reverse KL
    full = baselines.reverse_kl_student_topk(ls, lt, mask, top_k=7)
    ref = sum(sum(p * math.log(p / q) for p, q in zip(_softmax(ls[b, t].tolist()), _softmax(lt[b, t].tolist())))
              for b in range(2) for t in range(4) if mask[b, t]) / n
    assert full.item() == pytest.approx(ref, abs=1e-6)


def test_ema_update_matches_the_closed_form():
    """k updates towards a fixed θ: θ̄_k = (1 − r)^k θ̄_0 + (1 − (1 − r)^k) θ."""
    teacher = [torch.tensor([1.0, -2.0], dtype=torch.float64), torch.tensor([[0.5]], dtype=torch.float64)]
    student = [torch.tensor([3.0, 0.0], dtype=torch.float64), torch.tensor([[-1.5]], dtype=torch.float64)]
    t0 = [t.clone() for t in teacher]
    r, k = 0.05, 7
    for _ in range(k):
        baselines.ema_update(teacher, student, r)
    for t, a, s in zip(teacher, t0, student):
        assert torch.allclose(t, (1 - r) ** k * a + (1 - (1 - r) ** k) * s, atol=1e-12)
    assert torch.equal(student[0], torch.tensor([3.0, 0.0], dtype=torch.float64))   # the student is untouched


def test_sibling_contexts_never_use_the_rollouts_own_trace():
    eps = [engine.Episode(task=None, reward=r, trace=f"t{i}") for i, r in enumerate([1.0, 0.0, 1.0, 0.0, 0, 0, 0, 1])]
    assert baselines.sibling_contexts(eps, 4) == ["t2", "t0", "t0", "t0", "t7", "t7", "t7", None]


def test_opsd_pool_prefers_the_bank_then_the_oracle():
    train, _ = tool_world.make_splits(seed=0, n_train=4, n_test=1)
    bank = [{"task_id": train[0].task_id, "trace": "from the bank", "reward": 1.0},
            {"task_id": train[1].task_id, "trace": "a failure", "reward": 0.5}]
    pool, n_oracle = baselines.opsd_pool(bank, train, tool_world.ToolWorld)
    assert pool[train[0].task_id] == "from the bank" and n_oracle == 3
    env = tool_world.ToolWorld()
    env.reset(train[1])
    for name, a in tool_world.oracle_calls(train[1]):
        env.step(common.format_call(name, a))
    assert pool[train[1].task_id] == common.lite_trace(env.trace) and env.reward() == 1.0


# ------------------------------------------------------------------------------------------------------------
# The shared loop: the only differences are the teacher's context and the loss
# ------------------------------------------------------------------------------------------------------------
def _run_method(world, method, monkeypatch):
    """One step of `method` with spies on the shared functions. -> (rollout calls, scoring calls, loss names)."""
    student, comp = make_models(world)
    tasks = world["train"][8:10]
    calls = {"rollout": [], "scored": [], "loss": []}
    real_rollout, real_scoring = engine.rollout, engine.continuation_logits

    def rollout(model, chat, tasks_, cfg, *a, **kw):
        calls["rollout"].append((model, [t.task_id for t in tasks_], cfg))
        return real_rollout(model, chat, tasks_, cfg, *a, **kw)

    def scoring(model, tok, prefixes, eps, device):
        calls["scored"].append((model, [list(p) for p in prefixes], [list(e.ids[e.prompt_len:]) for e in eps]))
        return real_scoring(model, tok, prefixes, eps, device)

    monkeypatch.setattr(engine, "rollout", rollout)
    monkeypatch.setattr(engine, "continuation_logits", scoring)
    for module, name in ((losses, "lopd_objective"), (baselines, "ppo_clip_loss"), (baselines, "forward_kl_full"),
                         (baselines, "reverse_kl_student_topk")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _n=name, _r=real, **kw: calls["loss"].append(_n) or _r(*a, **kw))
    opt = torch.optim.AdamW(student.parameters(), lr=1e-4)
    bcfg = baselines.BaselineConfig(group=2, context="span", micro_batch=8, success=0.0,   # every sibling counts
                                    sample=SAMPLE)
    chat = world["chat"]
    torch.manual_seed(0)
    if method == "lopd":
        c0 = lopd.anchor_cache(comp, world["retriever"], tasks, 2)
        lopd.lopd_step(student, comp, chat, tasks * 2, world["retriever"], c0_cache={**c0}, beta=0.0, opts=(opt, None),
                       cfg=lopd.LOPDConfig(n_ret=2, freeze_composer=True, sample=SAMPLE))
    elif method == "grpo":
        baselines.grpo_step(student, chat, tasks, opt, bcfg)
    elif method == "opsd":
        pool, _ = baselines.opsd_pool([], tasks * 2, tool_world.ToolWorld)
        baselines.opsd_step(student, comp.base_forward, chat, tasks * 2, pool=pool, opt=opt, cfg=bcfg)
    else:
        import copy
        ema = copy.deepcopy(student).requires_grad_(False)
        baselines.sdpo_step(student, ema, chat, tasks, opt, bcfg)
    return student, calls


@pytest.mark.parametrize("method, loss", [("lopd", "lopd_objective"), ("grpo", "ppo_clip_loss"),
                                          ("opsd", "forward_kl_full"), ("sdpo", "reverse_kl_student_topk")])
def test_every_method_shares_rollout_and_student_scoring(world, monkeypatch, method, loss):
    student, calls = _run_method(world, method, monkeypatch)
    # one on-policy rollout of the student, 4 episodes, the same sampling config
    [(model, ids, cfg)] = calls["rollout"]
    assert model is student and len(ids) == 4 and cfg is SAMPLE
    # the student is scored behind its own prompt on its own sampled ids
    student_calls = [c for c in calls["scored"] if c[0] is student]
    assert len(student_calls) == 1
    _, prefixes, conts = student_calls[0]
    assert all(p[-3:] == prefixes[0][-3:] for p in prefixes)              # the prompt ends with the assistant header
    # the teacher: its context is what differs
    teacher_calls = [c for c in calls["scored"] if c[0] is not student]
    if method == "grpo":
        assert teacher_calls == []                                          # no teacher
    elif method == "lopd":
        assert teacher_calls == []                                          # latents: lopd.teacher_logits, not text
    else:
        [(_, t_prefixes, t_conts)] = teacher_calls
        assert t_conts == conts                                             # the SAME sampled ids, never re-tokenized
        assert all(len(tp) > len(sp) for tp, sp in zip(t_prefixes, prefixes))   # plus a trajectory as text
    assert calls["loss"] and set(calls["loss"]) == {loss}


def test_text_context_span_puts_the_text_where_the_latents_go(world):
    tok, chat, task = world["tok"], world["chat"], world["train"][0]     # chat: the tool world's TOY framing
    msgs = tool_world.ToolWorld().reset(task)
    text = "1. find_customer(account=\"x\") -> c1"
    ids = chat.context_prompt(msgs, None, text, baselines.OPSD_CONTEXT, "span")
    ref = tok(text, add_special_tokens=False)["input_ids"]
    lat, s = engine.latent_prompt_ids(tok, msgs, len(ref), tool_world.ToolWorld().framing)
    assert ids[:s] == lat[:s] and ids[s:s + len(ref)] == ref and ids[s + len(ref):] == lat[s + len(ref):]
    sys_ids = chat.context_prompt(msgs, None, text, baselines.OPSD_CONTEXT, "system")
    rendered = tok.decode(sys_ids)
    assert "reference plan for the upcoming task" in rendered and text in rendered
    assert rendered.index(text) < rendered.index(task.text)                 # in the system turn, before the task


@pytest.mark.parametrize("method", ["rft", "grpo", "opsd", "sdpo"])
@pytest.mark.equality
def test_every_baseline_gives_the_same_step_with_the_chunked_loss(world, method):
    """--loss-chunk on the baselines: hidden states out, the heads applied 3 rows at a time by the loss. From the
    same seed, the same metrics and the same student gradients as from full logits."""
    import copy
    tasks = world["train"][8:10]
    results = []
    for chunk in (0, 3):
        student, comp = make_models(world)
        grads = {}
        opt = torch.optim.SGD(student.parameters(), lr=0.0)
        step = opt.step
        opt.step = lambda: (grads.update({n: p.grad.clone() for n, p in student.named_parameters()
                                          if p.grad is not None}), step())
        bcfg = baselines.BaselineConfig(group=2, context="span", micro_batch=8, success=0.0, loss_chunk=chunk,
                                        sample=SAMPLE)                  # RFT: micro-batch 8, clip 1.0
        chat = world["chat"]
        torch.manual_seed(0)
        if method == "rft":
            eps = engine.rollout(student, chat, tasks, SAMPLE)
            m = baselines.rft_step(student, world["tok"], eps, opt, bcfg)
        elif method == "grpo":
            m, _ = baselines.grpo_step(student, chat, tasks, opt, bcfg)
        elif method == "opsd":
            pool, _ = baselines.opsd_pool([], tasks * 2, tool_world.ToolWorld)
            m, _ = baselines.opsd_step(student, comp.base_forward, chat, tasks * 2, pool=pool, opt=opt, cfg=bcfg)
        else:
            ema = copy.deepcopy(student).requires_grad_(False)
            m, _ = baselines.sdpo_step(student, ema, chat, tasks, opt, bcfg)
        results.append((m, grads))
    (m0, g0), (m3, g3) = results
    loss_key = {"rft": "loss/rft", "grpo": "loss/grpo"}.get(method, "loss/distill")
    assert m3[loss_key] == pytest.approx(m0[loss_key], rel=1e-5, abs=1e-7) and m3["tokens"] == m0["tokens"]
    assert g0 and g0.keys() == g3.keys()
    assert method == "grpo" or any(g.abs().max() > 0 for g in g0.values())   # GRPO's groups may all tie
    for k in g0:
        torch.testing.assert_close(g3[k], g0[k], rtol=1e-4, atol=1e-6, msg=k)
