"""Tests for the baselines in the shared loop (train.py --method grpo|opsd|sdpo|sdft|skillsd; paper B.1).

Run: python -m pytest tests/test_baselines.py -q
Each loss against a float64 brute force written out here (loops over rows and ids, no shared helper), and one
test that every method goes through the same rollout and the same student scoring: the methods differ only in
the teacher's context and the loss. The world fixture (tiny toy backbone, scripted bank) is test_lopd.py's.
"""
import copy
import json
import math
import os
import random
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

# B.1's three context texts, copied from the paper's Appendix B.1 (each "Appended to ..." block; its placeholders
# {gt_text}, {demo_text} and the skill's three fields as the paper names them). The paper prints each block as its own
# paragraphs; what the code puts between the message and the block is its own separator: "\n\n" (OPSD's by
# engine.Chat.context_prompt for the system message, SDFT's and Skill-SD's inside their templates, as baselines.py's
# comment above SDFT_CONTEXT says: "Chat.context_prompt adds no separator there"). Written out here, never read from
# baselines.py, so a change to the code's wording fails these tests.
PAPER_OPSD = (
    "The following is a reference plan for the upcoming task. Use it only as guidance for your own reasoning; you must "
    "still interact with the environment to complete the task.\n\n"
    "{gt_text}\n\n"
    "After reading the reference solution above, make sure you truly understand the reasoning behind each step. Now, "
    "using your own words and independent reasoning, derive the same final answer.")
PAPER_SDFT = (
    "This is an example for a response to the question:\n\n"
    "{demo_text}\n\n"
    "Now answer with a response of your own, including the thinking process.")
PAPER_SKILLSD = (
    "Here is a skill summary from a similar past task that may help guide your approach:\n\n"
    "**What works:** {success_analysis}\n\n"
    "**What to avoid:** {mistake_analysis}\n\n"
    "**Suggested workflow:** {golden_workflow}\n\n"
    "Now solve the current task using your own reasoning.")
SEP = "\n\n"    # the code's separator between the message and the appended block (above)


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
# SDFT: an EMA teacher at 0.01 reads the task's demonstration in the first user message
# ------------------------------------------------------------------------------------------------------------
def _fix_rewards(monkeypatch, rewards):
    """engine.rollout as it is, but its episodes' rewards set to `rewards`, in order (a step's rows are adjacent)."""
    real_rollout = engine.rollout

    def rollout(*a, **kw):
        eps = real_rollout(*a, **kw)
        for e, r in zip(eps, rewards):
            e.reward = r
        return eps
    monkeypatch.setattr(engine, "rollout", rollout)


def _turns(text):
    """The rendered prompt's turns: {role: its content} (the chat template's <|im_start|>role ... <|im_end|>)."""
    return {t.split("\n", 1)[0]: t.split("\n", 1)[1].split("<|im_end|>")[0]
            for t in text.split("<|im_start|>")[1:] if "\n" in t}


def _spy_scoring(monkeypatch):
    """Record each (model, prefix ids) that `engine.continuation_logits` scores."""
    calls, real = [], engine.continuation_logits
    monkeypatch.setattr(engine, "continuation_logits", lambda model, tok, prefixes, eps, device: calls.append(
        (model, [list(p) for p in prefixes])) or real(model, tok, prefixes, eps, device))
    return calls


def test_sdft_teacher_is_an_ema_moved_by_0_01_towards_the_student_after_every_step(world):
    """θ̄_ema ← 0.99·θ̄_ema + 0.01·θ after each step, θ the student after that step's update (by hand, per
    parameter); SDPO's 0.05 would not match, nor would a step that forgot the update."""
    assert baselines.BaselineConfig().sdft_ema_rate == 0.01
    student, _ = make_models(world)
    ema = copy.deepcopy(student).requires_grad_(False)
    tasks = world["train"][8:12]
    pool, _ = baselines.opsd_pool([], tasks, tool_world.ToolWorld)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
    cfg = baselines.BaselineConfig(context="span", micro_batch=8, sample=SAMPLE)
    torch.manual_seed(0)
    for _ in range(2):
        before = {n: p.detach().clone() for n, p in ema.named_parameters()}
        m, _ = baselines.sdft_step(student, ema, world["chat"], tasks, pool=pool, opt=opt, cfg=cfg)
        assert m["skipped"] == 0 and m["context/rows"] == 4 and m["loss/distill"] > 0
        moved = False
        for (n, t), s in zip(ema.named_parameters(), student.parameters()):
            want = 0.99 * before[n].double() + 0.01 * s.detach().double()                   # by hand, in float64
            torch.testing.assert_close(t.double(), want, rtol=1e-6, atol=1e-8, msg=n)         # fp32 rounding only
            sdpo = 0.95 * before[n].double() + 0.05 * s.detach().double()
            moved |= bool((want - sdpo).abs().max() > 1e-5)
        assert moved                                                       # the student moved: the rate matters


def test_sdft_teacher_reads_the_demonstration_appended_to_the_first_user_message(world, monkeypatch):
    """A real model's placement (--text-context system, its default, or user): B.1's SDFT wording with the task's
    demonstration, at the end of the first user message, behind the task; the EMA teacher scores it, the student's
    prompt has none. On the toy (span) the demonstration fills the latents' span."""
    student, _ = make_models(world)
    ema = copy.deepcopy(student).requires_grad_(False)
    tasks, tok = world["train"][8:10], world["tok"]
    pool, _ = baselines.opsd_pool([], tasks, tool_world.ToolWorld)
    calls = _spy_scoring(monkeypatch)
    for where in ("system", "user"):
        calls.clear()
        cfg = baselines.BaselineConfig(context=where, micro_batch=8, sample=SAMPLE)
        baselines.sdft_step(student, ema, world["chat"], tasks, pool=pool, opt=torch.optim.SGD(student.parameters(),
                                                                                                lr=0.0), cfg=cfg)
        [(_, teacher)] = [c for c in calls if c[0] is ema]
        [(_, own)] = [c for c in calls if c[0] is student]
        for task, ids, sid in zip(tasks, teacher, own):
            turns = _turns(tok.decode(ids))
            demo = SEP + PAPER_SDFT.format(demo_text=pool[task.task_id])          # B.1's words, written out
            assert turns["user"] == task.text + demo, turns["user"]           # appended to the task, nothing else
            assert "This is an example" not in turns["system"] and "This is an example" not in tok.decode(sid)
    calls.clear()
    span = baselines.BaselineConfig(context="span", micro_batch=8, sample=SAMPLE)
    baselines.sdft_step(student, ema, world["chat"], tasks, pool=pool, opt=torch.optim.SGD(student.parameters(), lr=0),
                        cfg=span)
    [(_, teacher)] = [c for c in calls if c[0] is ema]
    ref = tok(pool[tasks[0].task_id], add_special_tokens=False)["input_ids"]
    assert any(teacher[0][i:i + len(ref)] == ref for i in range(len(teacher[0])))   # the toy: the trace in the span


def test_opsd_teacher_reads_b1s_wording_appended_to_the_system_message(world, monkeypatch):
    """OPSD's frozen teacher gets the paper's B.1 text ("Appended to system message", written out above) with the
    task's pool trace, after the student's own system message; the student's prompt has none (paper B.1, OPSD)."""
    student, comp = make_models(world)
    tasks, tok = world["train"][8:10], world["tok"]
    pool, _ = baselines.opsd_pool([], tasks, tool_world.ToolWorld)
    calls = _spy_scoring(monkeypatch)
    cfg = baselines.BaselineConfig(context="system", micro_batch=8, sample=SAMPLE)
    baselines.opsd_step(student, comp.base_forward, world["chat"], tasks, pool=pool,
                        opt=torch.optim.SGD(student.parameters(), lr=0.0), cfg=cfg)
    [(_, own)] = [c for c in calls if c[0] is student]
    [(_, teacher)] = [c for c in calls if c[0] is not student]
    for task, ids, sid in zip(tasks, teacher, own):
        mine, theirs = _turns(tok.decode(sid)), _turns(tok.decode(ids))
        assert theirs["system"] == mine["system"] + SEP + PAPER_OPSD.format(gt_text=pool[task.task_id])
        assert theirs["user"] == mine["user"] == task.text


def test_the_three_b1_texts_render_as_the_paper_writes_them(world):
    """Each text teacher's prompt, as a real model's placement renders it, holds B.1's block word for word (paper
    B.1: OPSD in the system message, SDFT and Skill-SD appended to the first user message)."""
    tok, chat, task = world["tok"], world["chat"], world["train"][0]
    msgs = tool_world.ToolWorld().reset(task)
    base = _turns(tok.decode(chat.prompt(msgs, None)))
    trace = "1. find_customer(account=\"x\") -> c1\n2. cancel_order(order=\"O1\") -> ok"
    got = _turns(tok.decode(chat.context_prompt(msgs, None, trace, baselines.OPSD_CONTEXT, "system")))
    assert got["system"] == base["system"] + SEP + PAPER_OPSD.format(gt_text=trace)
    got = _turns(tok.decode(chat.context_prompt(msgs, None, trace, baselines.SDFT_CONTEXT, "user")))
    assert got["user"] == base["user"] + SEP + PAPER_SDFT.format(demo_text=trace)
    skill = {"family": "f", "success_analysis": "look the customer up first", "mistake_analysis": "guessing ids",
             "golden_workflow": trace}
    text = baselines.skill_text(skill, "user")             # what skillsd_step hands the teacher on a real model
    got = _turns(tok.decode(chat.context_prompt(msgs, None, text, "{text}", "user")))
    assert got["user"] == base["user"] + SEP + PAPER_SKILLSD.format(**skill)
    assert baselines.skill_text(skill, "span") == trace    # deviation 3 (baselines.py): the toy's span, the workflow


# ------------------------------------------------------------------------------------------------------------
# Skill-SD: UCB1 over the family's skills, the skill in the teacher's first user message, PPO-clip + IW reverse KL
# ------------------------------------------------------------------------------------------------------------
def _brute_ucb1(pulls, sums, c):
    """UCB1 written out: the first arm never pulled, else the first arm of highest mean + c·sqrt(ln N / n)."""
    for i, n in enumerate(pulls):
        if n == 0:
            return i, None
    N = sum(pulls)
    scores = [sums[i] / pulls[i] + c * math.sqrt(math.log(N) / pulls[i]) for i in range(len(pulls))]
    best = 0
    for i in range(len(scores)):
        if scores[i] > scores[best]:
            best = i
    return best, scores


def test_ucb1_takes_a_never_pulled_arm_first_then_the_mean_plus_a_bonus_shrinking_as_sqrt_log_n_over_n():
    c = math.sqrt(2)
    assert baselines.BaselineConfig().ucb_c == c
    assert baselines.ucb1_choice([3, 0, 2, 0], [3.0, 0.0, 0.0, 0.0], c) == 1       # never pulled first, the lowest
    assert baselines.ucb1_choice([1, 1], [1.0, 0.0], c) == 0
    # the bonus c·sqrt(ln N / n): four times the pulls, half the bonus; it lets a worse arm pulled once win, then
    # no longer once it is pulled as often
    scores = baselines.ucb1_scores([4, 16], [2.0, 8.0], c)
    bonus = [s - m for s, m in zip(scores, [0.5, 0.5])]
    assert bonus[0] == pytest.approx(c * math.sqrt(math.log(20) / 4)) and bonus[1] == pytest.approx(bonus[0] / 2)
    assert baselines.ucb1_choice([10, 1], [6.0, 0.5], c) == 1 and baselines.ucb1_choice([10, 100], [6.0, 50.0], c) == 0
    # a bandit run: every choice is the brute force's, on the same history
    rng = random.Random(0)
    means, pulls, sums = [0.2, 0.5, 0.8, 0.4], [0] * 4, [0.0] * 4
    for _ in range(60):
        k = baselines.ucb1_choice(pulls, sums, c)
        want, brute = _brute_ucb1(pulls, sums, c)
        assert k == want
        if brute is not None:
            assert baselines.ucb1_scores(pulls, sums, c) == pytest.approx(brute, rel=1e-12)
        pulls[k] += 1
        sums[k] += float(rng.random() < means[k])
    assert pulls.index(max(pulls)) == 2 and min(pulls) >= 2                     # it finds the best, explores all


def test_ucb1_arm_value_is_the_mean_reward_plus_the_bonus_by_hand():
    """An arm pulled three times for rewards 1, 0, 1 is worth its mean 2/3 (not the sum 2) plus c·√(ln N / n), c = √2
    (UCB1, Auer et al. 2002; paper B.1: UCB1 with c = √2): here that mean makes the other arm win."""
    bank = baselines.SkillBank()
    for fam, tag in (("s1/cancel", "a"), ("s1/cancel", "b")):
        bank.add({"step": -1, "event": "skill", "source": "test", **_skill(fam, tag)})
    bank.add({"step": 0, "event": "pulls", "pulls": [[0, 1.0], [1, 0.5]]})
    bank.add({"step": 1, "event": "pulls", "pulls": [[0, 0.0], [1, 0.5]]})
    bank.add({"step": 2, "event": "pulls", "pulls": [[0, 1.0]]})
    # arm 0: n = 3, rewards 1, 0, 1: mean 0.666667; arm 1: n = 2, rewards 0.5, 0.5: mean 0.5; N = 5, ln 5 = 1.609438
    # bonus 0: √2·√(1.609438 / 3) = 1.414214 × 0.732447 = 1.035837 -> score 1.702504
    # bonus 1: √2·√(1.609438 / 2) = 1.414214 × 0.897061 = 1.268636 -> score 1.768636
    scores = baselines.ucb1_scores(bank.pulls, bank.reward, math.sqrt(2))
    assert scores == pytest.approx([1.702504, 1.768636], abs=1e-6)
    assert bank.select(type("T", (), {"variant": "s1", "schema": "cancel"})(), math.sqrt(2)) == 1   # a sum: arm 0


def test_a_skills_edge_is_the_teachers_mean_log_prob_gain_over_the_rollouts_own_tokens_by_hand():
    """skill_edges: per rollout, the mean over its ω tokens of log πT(a) − log πθ(a) (baselines.py, choice c); rows of
    3 and 1 tokens, so a sum would not pass as the mean, and a token off ω counts nothing."""
    logp = torch.tensor([[-1.0, -2.0, -0.5, -9.0], [-0.2, -3.0, -3.0, -3.0]])
    logp_t = torch.tensor([[-0.4, -2.5, 0.0, 5.0], [-1.2, 7.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    # row 0: gains 0.6, −0.5, 0.5 on ω (the 4th, +14, is off ω): mean 0.6 / 3 = 0.2; row 1: −1.0 on its one token
    assert baselines.skill_edges(logp, logp_t, mask).tolist() == pytest.approx([0.2, -1.0], abs=1e-6)


def test_a_skills_value_is_how_its_teacher_orders_the_groups_rollouts_not_how_hard_the_task_was():
    """skill_value (choice c): over a group's pairs with different rewards, the fraction the skill's edges order as the
    rewards do, ½ for a tie. By hand, with graded rewards; then the two things a reward mean would get wrong: an easy
    task and a hard one value the same skill alike, and a skill whose teacher favours the failures loses."""
    rewards = [1.0, 0.25, 0.5, 0.0]
    # better-worse pairs (6): (0,1) (0,2) (0,3) (2,1) (2,3) (1,3)
    # edges [0.3, −0.1, 0.3, −0.2]: agree, tie ½, agree, agree, agree, agree -> 5.5 / 6
    assert baselines.skill_value(rewards, [0.3, -0.1, 0.3, -0.2]) == pytest.approx(5.5 / 6)
    # edges [0.3, 0.4, 0.3, −0.2]: (0,1) 0.3 < 0.4 no, tie ½, agree, (2,1) no, agree, agree -> 3.5 / 6
    assert baselines.skill_value(rewards, [0.3, 0.4, 0.3, -0.2]) == pytest.approx(3.5 / 6)
    # the same teacher edges on an easy task (3 of 4 succeed) and a hard one (1 of 4): the same value, 1, although
    # the rollouts' mean rewards (0.75 and 0.25, what the bandit used to average) differ
    edges = [0.5, 0.4, 0.1, -0.3]
    assert baselines.skill_value([1.0, 1.0, 1.0, 0.0], edges) == baselines.skill_value([1.0, 0.0, 0.0, 0.0], edges) == 1
    # the same rollouts, a skill whose teacher favours the failures: 0, though the rewards (and their mean) are equal
    assert baselines.skill_value([1.0, 1.0, 1.0, 0.0], [-x for x in edges]) == 0
    assert baselines.skill_value([0.5, 0.5, 0.5, 0.5], edges) is None            # equal rewards: nothing to order


def test_grow_skill_bank_pulls_for_each_tasks_value_and_writes_a_skill_from_a_failed_group_too():
    """grow_skill_bank pulls each task's skill for its value, skips a group that ordered nothing (still logging the
    step's pulls event), and writes one skill per task from its group whether or not the group succeeded (the paper:
    every completed trajectory is summarised; baselines.py, choice b): a failed group's toy skill shows its best
    attempt. UCB1's arm value is then the mean of the values, not their sum."""
    from types import SimpleNamespace
    bank = baselines.SkillBank()
    bank.add({"step": -1, "event": "skill", "source": "test", **_skill("s1/cancel", "a")})
    task = SimpleNamespace(variant="s1", schema="cancel", text="t")
    near = "1. find_customer(account=\"A1\") -> c1\n2. delete_order(order=\"O1\") -> error"
    traces, rewards = ["1. x() -> y", near, "1. x() -> y\n2. z() -> w", "1. x() -> y"], [0.0, 0.5, 0.25, 0.0]
    eps = [SimpleNamespace(task=task, trace=t, reward=r) for t, r in zip(traces, rewards)]
    seen = []

    def writer(groups):
        seen.extend(groups)
        return [baselines.toy_skill(a) for _, a in groups]
    cfg = baselines.BaselineConfig(group=4, success=1.0)                  # no rollout succeeds
    grown = baselines.grow_skill_bank(bank, writer, [task, task, task], eps * 3, [[0, 0.75], [0, None], [0, 0.25]],
                                      step=0, cfg=cfg)
    assert (bank.pulls, bank.reward) == ([2, 0, 0, 0], [1.0, 0.0, 0.0, 0.0])     # None counts no pull
    assert grown == {"skillsd/new_skills": 3, "skillsd/skills": 4, "skillsd/valued_pulls": 2}
    assert [f for f, _ in seen] == ["s1/cancel"] * 3 and not any(ok for _, a in seen for *_, ok in a)
    assert bank.skills[1]["golden_workflow"] == near                               # the nearest miss, reward 0.5
    assert bank.skills[1]["success_analysis"].startswith("0 of 4 attempts succeeded; the best (reward 0.50)")
    assert "find_customer, delete_order" in bank.skills[1]["success_analysis"]
    # the arm's value: mean 1.0 / 2 = 0.5 (a sum would be 1.0) + √2·√(ln 2 / 2) = 0.832555; the new skills first
    assert baselines.ucb1_scores(bank.pulls[:1], bank.reward[:1], math.sqrt(2)) == pytest.approx([0.5 + 0.832555],
                                                                                               abs=1e-6)


def test_the_skill_writer_shows_a_failed_group_its_best_attempts_and_worst_failures():
    attempts = [("t1", "1. a() -> x", 0.0, False), ("t2", "1. b() -> x", 0.75, False),
                ("t3", "1. c() -> x\n2. d() -> y", 0.5, False), ("t4", "1. e() -> x", 0.25, False),
                ("t5", "1. f() -> x", 0.1, False)]
    prompt = baselines.skill_prompt(attempts)
    # the best two (0.75, 0.5), then the worst two failures not shown yet (0.0, 0.1); 0.25 is left out
    order = [prompt.index(f"Task: t{i}") for i in (2, 3, 1, 5)]
    assert order == sorted(order) and "Task: t4" not in prompt and "success (" not in prompt
    assert baselines.toy_skill(attempts)["golden_workflow"] == "1. b() -> x"


@pytest.mark.parametrize("method", ["grpo", "skillsd"])
def test_ppo_clip_gets_group_normalised_advantages_by_hand(world, monkeypatch, method):
    """What PPO-clip receives: per group of G = 4, Â = (r − mean) / (std + 1e-4) with the unbiased sample std
    (group_advantages' docstring, as TRL; paper B.1: GRPO's and Skill-SD's group-normalised advantages)."""
    tasks = world["train"][8:11]
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.25, 1.0, 0.0, 0.75]   # three groups of 4, rows adjacent
    seen = []
    _fix_rewards(monkeypatch, rewards)
    real_ppo = baselines.ppo_clip_loss
    monkeypatch.setattr(baselines, "ppo_clip_loss",
                        lambda *a, **k: seen.append(a[2].detach().double().tolist()) or real_ppo(*a, **k))
    student, _ = make_models(world)
    cfg = baselines.BaselineConfig(group=4, context="span", micro_batch=12, sample=SAMPLE)
    opt = torch.optim.SGD(student.parameters(), lr=0.0)
    if method == "grpo":
        baselines.grpo_step(student, world["chat"], tasks, opt, cfg)
    else:
        baselines.skillsd_step(student, world["chat"], tasks, _skill_bank(world), opt=opt, cfg=cfg)
    # group [1, 0, 0, 1]: mean 0.5; unbiased variance (4 × 0.25) / 3 = 1/3, std 0.5773503; Â = ±0.5 / 0.5774503
    a = 0.5 / (0.5773503 + 1e-4)                                         # 0.8658754 (the population std: 1.0)
    # group [1, 1, 1, 1]: every reward the mean, Â = 0 (no signal)
    # group [0.25, 1, 0, 0.75]: mean 0.5, deviations −0.25, 0.5, −0.5, 0.25; unbiased variance 0.625 / 3, std
    # 0.4564355 (the population std: 0.3952847); Â = deviation / 0.4565355 = ∓0.5476026, ±1.0952052
    b, c = 0.25 / (0.4564355 + 1e-4), 0.5 / (0.4564355 + 1e-4)
    assert seen == [pytest.approx([a, -a, -a, a, 0.0, 0.0, 0.0, 0.0, -b, c, -c, b], abs=1e-5)]
    assert (a, b, c) == pytest.approx((0.8658754, 0.5476026, 1.0952052), abs=1e-6)


def _skill(family, tag):
    return {"family": family, "success_analysis": f"works-{tag}", "mistake_analysis": f"avoid-{tag}",
            "golden_workflow": f"1. find_customer(account=\"{tag}\") -> c1"}


def test_skill_bank_chooses_within_the_family_logs_every_event_and_replays_them(tmp_path):
    class T:
        variant, schema = "s1", "cancel"
    path = str(tmp_path / "skill_bank.jsonl")
    bank = baselines.SkillBank(path)
    for fam, tag in (("s1/cancel", "a"), ("s2/update", "b"), ("s1/cancel", "c")):
        bank.add({"step": -1, "event": "skill", "source": "base rollouts", **_skill(fam, tag)})
    assert baselines.task_family(T()) == "s1/cancel" and baselines.task_family(object()) == "/"
    assert bank.select(T(), math.sqrt(2)) == 0                                 # its family's first, never pulled
    bank.add({"step": 0, "event": "pulls", "pulls": [[0, 1.0], [2, 0.0]]})
    assert (bank.pulls, bank.reward) == ([1, 0, 1], [1.0, 0.0, 0.0]) and bank.select(T(), math.sqrt(2)) == 0
    bank.add({"step": 1, "event": "pulls", "pulls": [[0, 0.0], [0, 0.0]]})
    assert bank.select(T(), math.sqrt(2)) == 2                                 # the bonus: 1 pull against 3
    assert bank.select(type("U", (), {"variant": "s9", "schema": ""})(), math.sqrt(2)) == 1   # no family: every skill
    events = [json.loads(line) for line in open(path)]
    assert [e["event"] for e in events] == ["skill"] * 3 + ["pulls"] * 2 and events[1]["id"] == 1
    assert all(events[i][k] == v for i, (f, t) in enumerate((("s1/cancel", "a"), ("s2/update", "b")))
               for k, v in _skill(f, t).items())                               # a reader sees each skill whole
    again = baselines.SkillBank.replay(path, events, before=1)                  # --resume at step 1
    assert (again.pulls, again.next_step, len(open(path).readlines())) == ([1, 0, 1], 1, 4)
    with pytest.raises(ValueError):
        baselines.SkillBank().select(T(), 1.0)


def test_toy_skill_reads_the_traces_and_the_writers_reply_parses_into_the_three_fields():
    ok1 = ("t1", "1. find_customer(account=\"A1\") -> c1\n2. cancel_order(order=\"O1\") -> ok", 1.0, True)
    ok2 = ("t2", "1. find_customer(account=\"A2\") -> c2\n2. get_order(order=\"O2\") -> o\n"
                 "3. cancel_order(order=\"O2\") -> ok", 1.0, True)
    bad = ("t3", "1. delete_customer(account=\"A3\") -> error", 0.0, False)
    skill = baselines.toy_skill([bad, ok2, ok1])
    assert skill["golden_workflow"] == ok1[1]                                   # the shortest of the best successes
    assert "2 of 3" in skill["success_analysis"] and "find_customer, cancel_order" in skill["success_analysis"]
    assert "delete_customer" in skill["mistake_analysis"]
    prompt = baselines.skill_prompt([bad, ok2, ok1])
    assert prompt.index("success (reward 1.00)\nTask: t1") < prompt.index("failure (reward 0.00)\nTask: t3")
    reply = ("<think>hm</think>**What works:** look it up first\n**What to avoid:** deleting\n"
             "Suggested workflow: 1. a\n2. b")
    assert baselines.parse_skill(reply) == {"success_analysis": "look it up first", "mistake_analysis": "deleting",
                                            "golden_workflow": "1. a\n2. b"}
    assert baselines.parse_skill("What works: x")["golden_workflow"] == "(none)"


def test_a_real_models_skills_are_written_by_its_frozen_base_through_the_engine(smollm2, monkeypatch, world):
    """On a real model (SmolLM2-135M here) the frozen base answers SKILL_WRITER_PROMPT, generated by
    engine.generate_replies, with the composer's LoRA off, and its reply becomes the three fields; the toy backbone's
    run takes `toy_skill` instead."""
    import contextlib
    import types
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model, tok = AutoModelForCausalLM.from_pretrained(smollm2).eval(), AutoTokenizer.from_pretrained(smollm2)
    off = []
    base = types.SimpleNamespace(peft=model, adapter_disabled=lambda: off.append(1) or contextlib.nullcontext())
    seen, real = [], engine.generate_replies
    monkeypatch.setattr(engine, "generate_replies", lambda m, t, contexts, cfg, **k: seen.append(
        (m, [t.decode(c) for c in contexts], cfg)) or real(m, t, contexts, cfg, **k))
    monkeypatch.setattr(baselines, "SKILL_WRITER_TOKENS", 24)
    attempts = [("Cancel order O1.", "1. cancel_order(order=\"O1\") -> ok", 1.0, True),
                ("Cancel order O2.", "1. delete_order(order=\"O2\") -> error", 0.0, False)]
    run = types.SimpleNamespace(args=types.SimpleNamespace(model=smollm2), composer=base, tok=tok)
    [skill] = baselines.skill_writer(run)([("s1/cancel", attempts)])
    [(m, [prompt], cfg)] = seen
    assert m is model and off == [1] and cfg.temperature == 0 and cfg.max_new_tokens == 24
    assert baselines.skill_prompt(attempts) in prompt and "What to avoid:" in prompt
    assert set(skill) == set(baselines.SKILL_FIELDS) and all(isinstance(v, str) and v for v in skill.values())
    toy_run = types.SimpleNamespace(args=types.SimpleNamespace(model=world["path"]))       # a toy backbone folder
    assert baselines.skill_writer(toy_run)([("s1/cancel", attempts)]) == [baselines.toy_skill(attempts)]


def test_skillsd_loss_is_ppo_clip_0_2_0_28_plus_lambda_sdl_times_the_importance_weighted_reverse_kl():
    """Against a loop over tokens: −Σ ω·min(ρÂ, clip(ρ, 0.8, 1.28)Â)/N + 0.001·Σ ω·ρ·(log πθ − log πT)/N, and its
    gradient: the PPO part where unclipped, plus 0.001·ρ·(log πθ − log πT)/N at every ω token (through ρ)."""
    assert baselines.BaselineConfig().skill_clip == (0.2, 0.28) and baselines.BaselineConfig().sdl_weight == 0.001
    logp_old = torch.log(torch.tensor([[0.5, 0.4, 0.3, 0.2], [0.6, 0.5, 0.4, 0.3]], dtype=torch.float64))
    rho = torch.tensor([[1.25, 1.3, 0.75, 1.0], [0.85, 1.1, 1.27, 0.7]], dtype=torch.float64)
    logp = (logp_old + rho.log()).requires_grad_(True)                         # ρ = πθ / π_old, as set
    logp_t = logp_old.detach() - 0.3 * torch.arange(8, dtype=torch.float64).reshape(2, 4)
    adv, mask = torch.tensor([1.5, -0.5], dtype=torch.float64), torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0.]])
    lam, N = 0.001, 7.0
    loss, terms, frac = baselines.skillsd_loss(logp, logp_old, logp_t, adv, mask.double(), clip=(0.2, 0.28),
                                               sdl_weight=lam, n_tokens=N)
    ppo, sdl, grad, clipped = 0.0, 0.0, torch.zeros(2, 4, dtype=torch.float64), 0
    for b in range(2):
        for t in range(4):
            if not mask[b, t]:
                continue
            r, a, gap = float(rho[b, t]), float(adv[b]), float(logp[b, t].detach() - logp_t[b, t])
            cut = min(max(r, 0.8), 1.28)
            ppo -= min(r * a, cut * a) / N
            sdl += r * gap / N
            clipped += not (0.8 <= r <= 1.28)
            live = r * a <= cut * a                                            # the unclipped branch is the min
            grad[b, t] = (-a * r / N if live else 0.0) + lam * r * gap / N
    assert terms["loss/ppo"] == pytest.approx(ppo, abs=1e-12) and terms["loss/sdl"] == pytest.approx(sdl, abs=1e-12)
    assert loss.item() == pytest.approx(ppo + lam * sdl, abs=1e-12) and frac == pytest.approx(clipped / 7)
    assert clipped == 2           # 1.3 > 1.28 and 0.75 < 0.8; 1.25 and 1.27 are inside (ε_hi = 0.2 would clip them)
    loss.backward()
    torch.testing.assert_close(logp.grad, grad, rtol=1e-10, atol=1e-12)


def _skill_bank(world):
    """A skill bank from scripted (oracle) episodes of the first eight training tasks, written by the toy's writer."""
    eps = [engine.scripted_episode(world["chat"], t, tool_world.oracle_replies(t)) for t in world["train"][:8]]
    bank = baselines.SkillBank()
    for fam, attempts in baselines.family_attempts(eps):
        bank.add({"step": -1, "event": "skill", "source": "test", "family": fam, **baselines.toy_skill(attempts)})
    return bank


def test_skillsd_step_teacher_reads_its_ucb1_skill_its_three_fields_and_its_sdl_term_is_live(world, monkeypatch):
    """One step, a real model's placement: each task's teacher (the student itself, detached) reads B.1's wording
    with the three fields of the skill UCB1 chose, appended to its first user message; PPO-clip gets (0.2, 0.28);
    the reverse-KL term changes the gradient in proportion to λ_sdl (so a step without it, or without the skill in
    the teacher's prompt, where πT = πθ, would not); then the bank counts the pulls and writes the groups' skills."""
    tasks, tok = world["train"][8:10], world["tok"]
    clips, grads = [], []
    real_ppo = baselines.ppo_clip_loss
    monkeypatch.setattr(baselines, "ppo_clip_loss", lambda *a, **k: clips.append((k["eps_lo"], k["eps_hi"])) or
                        real_ppo(*a, **k))
    calls = _spy_scoring(monkeypatch)
    for lam in (0.0, 1.0, 2.0):
        student, _ = make_models(world)
        bank, store = _skill_bank(world), {}
        opt = torch.optim.SGD(student.parameters(), lr=0.0)
        step = opt.step
        opt.step = lambda: (store.update({n: p.grad.clone() for n, p in student.named_parameters()}), step())
        cfg = baselines.BaselineConfig(group=2, context="system", micro_batch=8, success=0.0, sdl_weight=lam,
                                       clip=1e9, sample=SAMPLE)
        calls.clear()
        torch.manual_seed(0)
        m, eps, pulls = baselines.skillsd_step(student, world["chat"], tasks, bank, opt=opt, cfg=cfg)
        chosen = [k for k, _ in pulls]
        grads.append(store)
        own, teacher = [c for c in calls if c[0] is student]                  # the student, then its own teacher
        for i, (ids, sid) in enumerate(zip(teacher[1], own[1])):
            skill, turns = bank.skills[chosen[i // 2]], _turns(tok.decode(ids))
            assert turns["user"] == tasks[i // 2].text + SEP + PAPER_SKILLSD.format(**skill)   # B.1's words
            assert all(f"**{label}:** {skill[k]}" in turns["user"] for label, k in zip(
                baselines.SKILL_LABELS, baselines.SKILL_FIELDS)) and "skill summary" not in tok.decode(sid)
    assert set(clips) == {(0.2, 0.28)} and m["loss/sdl"] != 0 and m["skipped"] == 0
    g0, g1, g2 = grads
    assert any(not torch.allclose(g1[k], g0[k]) for k in g0)                   # the term is live
    for k in g0:
        torch.testing.assert_close(g2[k] - g0[k], 2 * (g1[k] - g0[k]), rtol=1e-3, atol=1e-7, msg=k)
    n = len(bank.skills)

    def toy_writer(groups):
        return [baselines.toy_skill(a) for _, a in groups]
    grown = baselines.grow_skill_bank(bank, toy_writer, tasks, eps, pulls, step=0, cfg=cfg)
    assert grown["skillsd/new_skills"] == 2 and grown["skillsd/skills"] == n + 2       # each group writes one
    for k in set(chosen):
        values = [v for c, v in pulls if c == k and v is not None]
        assert bank.pulls[k] == len(values) and bank.reward[k] == pytest.approx(sum(values))
    assert [s["family"] for s in bank.skills[n:]] == [baselines.task_family(t) for t in tasks]


def test_skillsd_step_values_each_tasks_skill_by_its_teachers_edges_on_the_groups_rollouts_by_hand(world,
                                                                                                   monkeypatch):
    """The pull skillsd_step hands the bank for each task: skill_value of the group's rewards and of the edges
    log πT − log πθ the loss itself saw, both written out here (loops over tokens and pairs); graded rewards, so
    neither a mean reward nor a sum passes. The teacher reads the skill: its edges are not zero."""
    tasks = world["train"][8:10]
    rewards = [1.0, 0.0, 0.5, 0.0, 0.25, 0.25, 0.25, 0.25]             # two groups of 4; the second orders nothing
    seen = []
    _fix_rewards(monkeypatch, rewards)
    real_loss = baselines.skillsd_loss
    monkeypatch.setattr(baselines, "skillsd_loss", lambda logp, old, logp_t, adv, mask, **k: seen.append(
        (logp.detach().double(), logp_t.double(), mask.double())) or real_loss(logp, old, logp_t, adv, mask, **k))
    student, _ = make_models(world)
    cfg = baselines.BaselineConfig(group=4, context="span", micro_batch=3, sample=SAMPLE)    # parts split groups
    torch.manual_seed(0)
    _, _, pulls = baselines.skillsd_step(student, world["chat"], tasks, _skill_bank(world),
                                         opt=torch.optim.SGD(student.parameters(), lr=0.0), cfg=cfg)
    edges = []
    for logp, logp_t, mask in seen:
        for b in range(logp.shape[0]):
            gain = [float(logp_t[b, t] - logp[b, t]) for t in range(logp.shape[1]) if mask[b, t]]
            edges.append(sum(gain) / len(gain))
    assert len(edges) == 8 and any(abs(e) > 1e-4 for e in edges)
    right = pairs = 0.0
    for i in range(4):
        for j in range(4):
            if rewards[i] > rewards[j]:
                pairs += 1
                right += 1.0 if edges[i] > edges[j] else (0.5 if edges[i] == edges[j] else 0.0)
    assert pairs == 5 and pulls[0][1] == pytest.approx(right / pairs, abs=1e-9) and pulls[1][1] is None


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
                         (baselines, "reverse_kl_student_topk"), (baselines, "skillsd_loss")):
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
    elif method in ("opsd", "sdft"):
        pool, _ = baselines.opsd_pool([], tasks * 2, tool_world.ToolWorld)
        if method == "opsd":
            baselines.opsd_step(student, comp.base_forward, chat, tasks * 2, pool=pool, opt=opt, cfg=bcfg)
        else:
            baselines.sdft_step(student, copy.deepcopy(student).requires_grad_(False), chat, tasks * 2, pool=pool,
                                opt=opt, cfg=bcfg)
    elif method == "skillsd":
        baselines.skillsd_step(student, chat, tasks, _skill_bank(world), opt=opt, cfg=bcfg)
    else:
        ema = copy.deepcopy(student).requires_grad_(False)
        baselines.sdpo_step(student, ema, chat, tasks, opt, bcfg)
    return student, calls


@pytest.mark.parametrize("method, loss", [("lopd", "lopd_objective"), ("grpo", "ppo_clip_loss"),
                                          ("opsd", "forward_kl_full"), ("sdpo", "reverse_kl_student_topk"),
                                          ("sdft", "forward_kl_full"), ("skillsd", "skillsd_loss")])
def test_every_method_shares_rollout_and_student_scoring(world, monkeypatch, method, loss):
    student, calls = _run_method(world, method, monkeypatch)
    # one on-policy rollout of the student, 4 episodes, the same sampling config
    [(model, ids, cfg)] = calls["rollout"]
    assert model is student and len(ids) == 4 and cfg is SAMPLE
    # the student is scored behind its own prompt on its own sampled ids
    student_calls = [c for c in calls["scored"] if c[0] is student]
    teacher_calls = [c for c in calls["scored"] if c[0] is not student]
    if method == "skillsd":                         # its teacher is the student itself, scored after it
        student_calls, teacher_calls = student_calls[:1], student_calls[1:]
    assert len(student_calls) == 1
    _, prefixes, conts = student_calls[0]
    assert all(p[-3:] == prefixes[0][-3:] for p in prefixes)              # the prompt ends with the assistant header
    # the teacher: its context is what differs
    if method == "grpo":
        assert teacher_calls == []                                          # no teacher
    elif method == "lopd":
        assert teacher_calls == []                                          # latents: lopd.teacher_logits, not text
    else:
        [(_, t_prefixes, t_conts)] = teacher_calls
        assert t_conts == conts                                             # the SAME sampled ids, never re-tokenized
        assert all(len(tp) > len(sp) for tp, sp in zip(t_prefixes, prefixes))   # plus a trajectory as text
    assert calls["loss"] and set(calls["loss"]) == {loss} | ({"ppo_clip_loss"} if method == "skillsd" else set())


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


@pytest.mark.parametrize("method", ["rft", "grpo", "opsd", "sdpo", "sdft", "skillsd"])
@pytest.mark.equality
def test_every_baseline_gives_the_same_step_with_the_chunked_loss(world, method):
    """--loss-chunk on the baselines: hidden states out, the heads applied 3 rows at a time by the loss. From the
    same seed, the same metrics and the same student gradients as from full logits."""
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
        elif method in ("opsd", "sdft"):
            pool, _ = baselines.opsd_pool([], tasks * 2, tool_world.ToolWorld)
            if method == "opsd":
                m, _ = baselines.opsd_step(student, comp.base_forward, chat, tasks * 2, pool=pool, opt=opt, cfg=bcfg)
            else:
                m, _ = baselines.sdft_step(student, copy.deepcopy(student).requires_grad_(False), chat, tasks * 2,
                                           pool=pool, opt=opt, cfg=bcfg)
        elif method == "skillsd":
            m, _, _ = baselines.skillsd_step(student, chat, tasks, _skill_bank(world), opt=opt, cfg=bcfg)
        else:
            ema = copy.deepcopy(student).requires_grad_(False)
            m, _ = baselines.sdpo_step(student, ema, chat, tasks, opt, bcfg)
        results.append((m, grads))
    (m0, g0), (m3, g3) = results
    loss_key = {"rft": "loss/rft", "grpo": "loss/grpo", "skillsd": "loss/sdl"}.get(method, "loss/distill")
    assert m3[loss_key] == pytest.approx(m0[loss_key], rel=1e-5, abs=1e-7) and m3["tokens"] == m0["tokens"]
    assert g0 and g0.keys() == g3.keys()
    assert method == "grpo" or any(g.abs().max() > 0 for g in g0.values())   # GRPO's groups may all tie
    for k in g0:
        torch.testing.assert_close(g3[k], g0[k], rtol=1e-4, atol=1e-6, msg=k)
