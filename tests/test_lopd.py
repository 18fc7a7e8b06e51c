"""Tests for lopd.py's training step (Algorithm 1): `pack` alignment, where gradients go, micro-batching, the dual
variable β, and the non-finite skip.

Run: python -m pytest tests/test_lopd.py -q
Offline: a tiny toy backbone (toy.build_backbone, hidden 32, 2 layers), a composer with K = 2 latents and one
QFormer layer, and a bank of eight scripted (oracle) episodes; fp32 on CPU, one thread.
"""
import copy
import os
import random
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from composer import Composer, ComposerConfig  # noqa: E402
import engine  # noqa: E402
import inject  # noqa: E402
import lopd  # noqa: E402
import losses  # noqa: E402
import retrieval  # noqa: E402
from runtime import devices, memory  # noqa: E402
from worlds import tool_world  # noqa: E402
from worlds import toy_backbone as toy  # noqa: E402

J = 2                                           # experiences per task; K = 2 latents each -> 4 latent positions
CFG = ComposerConfig(n_latents=2, n_layers=1)
SAMPLE = engine.SampleConfig(temperature=1.0, max_new_tokens=16, batch_size=8)


@pytest.fixture(scope="module")
def world(toy_backbone_dir):
    """The backbone folder (conftest's), its tokenizer and chat (the tool world, no tool schemas listed: the toy's),
    train tasks, and a retriever over eight scripted episodes.

    Query vectors of every task are cached before any composer exists (as train.py does), so later retrieval never
    embeds through a backbone that carries the composer's LoRA."""
    out = toy_backbone_dir
    tok = AutoTokenizer.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(out).eval()
    train, _ = tool_world.make_splits(seed=0, n_train=14, n_test=1)
    chat, entries = toy.toy_chat(tok), []
    for i, task in enumerate(train[:8]):
        ep = engine.scripted_episode(chat, task, tool_world.oracle_replies(task))
        entries.append(retrieval.make_entry(task.task_id, task.text, ep.trace, ep.reward,
                                            {"schema": task.schema, "shop": task.shop, "episode": i}))
    ret = retrieval.Retriever(entries, retrieval.Embedder.from_model(base, tok, pooling="mean"))
    ret.cache_queries([t.task_id for t in train], [t.text for t in train])
    return dict(path=out, tok=tok, chat=chat, train=train, retriever=ret)


def make_models(world, seed=0):
    """(student, composer): the student is a copy of θ̄ taken BEFORE the composer's LoRA goes into θ̄ (train.py).

    LoRA B starts at zero, which would make "LoRA on" and "LoRA off" indistinguishable; it gets small values."""
    base = AutoModelForCausalLM.from_pretrained(world["path"]).eval()
    student = copy.deepcopy(base)                # trainable; Composer freezes θ̄'s own weights below
    torch.manual_seed(seed)
    comp = Composer(base, world["tok"], CFG)
    with torch.no_grad():
        for n, p in comp.peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return student, comp


def backbone_params(comp):
    return {n: p for n, p in comp.peft.named_parameters() if "lora_" not in n}


def snapshot(named):
    return {n: p.detach().clone() for n, p in named}


def record_grads(opt, store):
    """Wrap opt.step so that each parameter's gradient (after clipping) is copied into store[id(p)] first."""
    step = opt.step

    def wrapped(*args, **kwargs):
        for group in opt.param_groups:
            for p in group["params"]:
                store[id(p)] = None if p.grad is None else p.grad.detach().clone()
        return step(*args, **kwargs)

    opt.step = wrapped
    return opt


def setup_step(world, seed=0, tasks=None, lr=1e-3, freeze=False, perturb_c0=0.0):
    """Models, optimizers (grad-recording), and the c_φ0 cache for one lopd_step on `tasks`."""
    student, comp = make_models(world, seed)
    tasks = tasks or world["train"][6:10]        # two bank tasks (self-excluded) and two tasks outside the bank
    c0 = lopd.anchor_cache(comp, world["retriever"], tasks, J)
    if perturb_c0:                               # c_φ ≠ c_φ0 so that the anchor term is not zero
        g = torch.Generator().manual_seed(seed)
        c0 = {k: v + perturb_c0 * torch.randn(v.shape, generator=g) for k, v in c0.items()}
    grads = {}
    opt_s = record_grads(torch.optim.AdamW(student.parameters(), lr=lr), grads)
    opt_c = None if freeze else record_grads(torch.optim.AdamW(comp.trainable_parameters(), lr=lr), grads)
    return student, comp, tasks, c0, (opt_s, opt_c), grads


def run_step(world, student, comp, tasks, c0, opts, beta=0.3, rng_seed=0, **cfg):
    cfg = lopd.LOPDConfig(**{"n_ret": J, "top_m": 5, "micro_batch": 3, "sample": SAMPLE, **cfg})
    torch.manual_seed(rng_seed)
    return lopd.lopd_step(student, comp, world["chat"], tasks, world["retriever"], c0_cache=c0, beta=beta, opts=opts,
                          cfg=cfg)


# ------------------------------------------------------------------------------------------------------------
# 1. pack and the aligned logits of student and teacher
# ------------------------------------------------------------------------------------------------------------
def test_pack_puts_continuation_token_t_in_column_P_plus_t():
    prefixes, conts = [[1, 2, 3], [4], [5, 6]], [[7], [8, 9, 10], [11, 12]]
    ids, att, pos, P, pad = engine.pack(prefixes, conts, 0, "cpu")
    assert P == 3 and ids.shape == (3, 6) and pad.tolist() == [0, 2, 1]
    assert ids.tolist() == [[1, 2, 3, 7, 0, 0], [0, 0, 4, 8, 9, 10], [0, 5, 6, 11, 12, 0]]
    assert att.tolist() == [[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0]]
    for i in range(3):                                   # real tokens keep their unpadded positions 0, 1, ...
        assert pos[i][att[i].bool()].tolist() == list(range(len(prefixes[i]) + len(conts[i])))


@pytest.mark.equality
def test_student_and_teacher_logits_equal_unpadded_single_forwards(world):
    """Batched, padded scoring = each episode scored alone, at every continuation position, for both models."""
    tok, student, comp = world["tok"], *make_models(world)
    all_eps = [engine.scripted_episode(world["chat"], t, tool_world.oracle_replies(t)) for t in world["train"]]
    eps, lengths = [], {7}                      # four different continuation lengths, one of them cut short
    for e in all_eps:
        if len(e.ids) - e.prompt_len not in lengths and len(eps) < 4:
            eps.append(e)
            lengths.add(len(e.ids) - e.prompt_len)
    tasks = [e.task for e in eps]
    eps[1].ids, eps[1].mask = eps[1].ids[:eps[1].prompt_len + 7], eps[1].mask[:eps[1].prompt_len + 7]  # short
    assert len({e.prompt_len for e in eps}) > 1 and len({len(e.ids) - e.prompt_len for e in eps}) == 4
    with torch.no_grad():
        latents = lopd.compose(comp, tasks, lopd.retrieve(world["retriever"], tasks, J))    # (B, J·K, d)
        ls, lt, ids, omega = lopd.student_teacher_logits(student, comp, world["chat"], eps, latents)
        for i, e in enumerate(eps):
            cont = e.ids[e.prompt_len:]
            n = len(cont)
            assert ids[i, :n].tolist() == cont and omega[i, :n].tolist() == e.mask[e.prompt_len:]
            assert omega[i, n:].sum() == 0                                              # padding is never supervised
            # student: ep.ids alone; logits at t predict t+1
            alone_s = student(input_ids=torch.tensor([e.ids])).logits[0]                # (T, V)
            torch.testing.assert_close(ls[i, :n], alone_s[e.prompt_len - 1:-1], atol=1e-5, rtol=0)
            # teacher: latent prompt + the same continuation, latents injected, LoRA off
            prompt, start = engine.latent_prompt_ids(tok, tool_world.ToolWorld().reset(e.task), latents.shape[1],
                                                     tool_world.ToolWorld().framing)
            row = torch.tensor([prompt + cont])                                         # (1, T')
            embeds = inject.embed_with_latents(comp.peft, row, latents[i:i + 1], [start])  # (1, T', d)
            with comp.adapter_disabled():
                alone_t = comp.peft(inputs_embeds=embeds, attention_mask=torch.ones_like(row)).logits[0]
            torch.testing.assert_close(lt[i, :n], alone_t[len(prompt) - 1:-1], atol=1e-5, rtol=0)
            # the check can tell LoRA on from LoRA off (the adapter is not a no-op here)
            with_lora = comp.peft(inputs_embeds=embeds, attention_mask=torch.ones_like(row)).logits[0]
            assert (with_lora[len(prompt) - 1:-1] - alone_t[len(prompt) - 1:-1]).abs().max() > 1e-3


# ------------------------------------------------------------------------------------------------------------
# 2. where the gradients of one lopd_step go
# ------------------------------------------------------------------------------------------------------------
def test_lopd_step_updates_student_and_composer_never_the_backbone(world):
    student, comp, tasks, c0, opts, grads = setup_step(world, perturb_c0=0.05)
    frozen = snapshot(backbone_params(comp).items())
    s_before = snapshot(student.named_parameters())
    c_before = [p.detach().clone() for p in comp.trainable_parameters()]
    assert all(s.data_ptr() != b.data_ptr() for s, b in zip(student.parameters(), backbone_params(comp).values()))
    beta, m, eps = run_step(world, student, comp, tasks, c0, opts)    # 4 rollouts, micro-batches of 3 and 1
    assert m["skipped"] == 0 and len(eps) == 4 and all(sum(e.mask) > 0 for e in eps)
    # θ: every student tensor got a finite gradient, the whole gradient is non-zero, and the weights moved
    g_s = [grads[id(p)] for p in student.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in g_s)
    assert sum(g.abs().sum() for g in g_s) > 0
    moved = [not torch.equal(p, s_before[n]) for n, p in student.named_parameters()]
    assert all(moved)
    # φ: the QFormer and the encoder LoRA both got gradient (through the teacher's p_T and the anchor), and moved
    named_c = [(n, p) for n, p in comp.named_parameters() if p.requires_grad]
    assert all(grads[id(p)] is not None and torch.isfinite(grads[id(p)]).all() for _, p in named_c)
    assert grads[id(comp.qformer.queries)].abs().sum() > 0
    assert sum(grads[id(p)].abs().sum() for n, p in named_c if "lora_A" in n) > 0
    assert sum(grads[id(p)].abs().sum() for n, p in named_c if "lora_B" in n) > 0
    assert all(not torch.equal(p, b) for p, b in zip(comp.trainable_parameters(), c_before))
    # θ̄: bit-identical, no gradient, not trainable
    for n, p in backbone_params(comp).items():
        assert torch.equal(p, frozen[n]), n
        assert not p.requires_grad and p.grad is None, n


def test_frozen_composer_stays_bit_identical(world):
    student, comp, tasks, c0, opts, grads = setup_step(world, freeze=True, perturb_c0=0.05)
    c_before = snapshot(comp.named_parameters())
    s_before = snapshot(student.named_parameters())
    _, m, _ = run_step(world, student, comp, tasks, c0, opts, freeze_composer=True)
    assert m["skipped"] == 0 and m["loss/anchor"] == 0.0
    for n, p in comp.named_parameters():
        assert torch.equal(p, c_before[n]) and p.grad is None, n
    assert any(not torch.equal(p, s_before[n]) for n, p in student.named_parameters())


# ------------------------------------------------------------------------------------------------------------
# 3. micro-batching: micro_batch=2 sums to the same metrics and gradients as one batch of 4
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("against", ["student", "phi0"])
@pytest.mark.equality
def test_the_chunked_loss_gives_the_full_logits_step(world, against):
    """--loss-chunk: the forwards return hidden states, the loss applies the LM heads 3 rows at a time. The same
    rollouts give the same metrics, β and clipped gradients (student, its tied head included, and composer)."""
    results = []
    for chunk in (0, 3):
        student, comp, tasks, c0, opts, grads = setup_step(world, seed=1, perturb_c0=0.05)
        beta, m, eps = run_step(world, student, comp, tasks, c0, opts, beta=0.3, rng_seed=7, loss_chunk=chunk,
                                privilege_against=against)
        g = [grads[id(p)] for p in list(student.parameters()) + comp.trainable_parameters()]
        results.append((beta, m, [e.ids for e in eps], g, student))
    (b0, m0, ids0, g0, s0), (b3, m3, ids3, g3, s3) = results
    assert ids0 == ids3 and m3["skipped"] == 0
    for k in ("loss/distill", "privilege/delta", "loss/anchor", "loss/total"):
        assert m3[k] == pytest.approx(m0[k], rel=1e-5, abs=1e-7), k
    assert b3 == pytest.approx(b0, rel=1e-6)
    assert s3.get_output_embeddings().forward.__func__ is type(s3.get_output_embeddings()).forward   # restored
    for a, b in zip(g0, g3):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


@pytest.mark.equality
def test_a_token_budget_splits_the_step_without_changing_it(world):
    """--token-budget: micro-batches of as many episodes as fit in 300 padded tokens give the step of one batch."""
    results = []
    for kw in ({"micro_batch": 4}, {"token_budget": 300}):
        student, comp, tasks, c0, opts, grads = setup_step(world, seed=1, perturb_c0=0.05)
        beta, m, eps = run_step(world, student, comp, tasks, c0, opts, beta=0.3, rng_seed=7, **kw)
        parts = engine.micro_batches(eps, 4, kw.get("token_budget", 0))
        g = [grads[id(p)] for p in list(student.parameters()) + comp.trainable_parameters()]
        results.append((beta, m, [e.ids for e in eps], g, len(parts)))
    (b1, m1, ids1, g1, n1), (b2, m2, ids2, g2, n2) = results
    assert ids1 == ids2 and n1 == 1 and n2 > 1                            # the budget did split the batch
    for k in ("loss/distill", "privilege/delta", "loss/anchor", "loss/total"):
        assert m2[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-7), k
    assert b2 == pytest.approx(b1, rel=1e-6)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


@pytest.mark.equality
def test_a_budget_planned_from_a_small_free_memory_splits_the_step_without_changing_it(world):
    """memory.plan_memory on a faked free memory that leaves room for about 300 tokens beside the resident terms:
    the planned budget splits the step into micro-batches, each within the plan, with the gradient of one batch."""
    config = AutoModelForCausalLM.from_pretrained(world["path"]).config
    costs = memory.step_costs(config, 4, trained=400_000, n_ret=J, loss_chunk=0, max_len=120)
    fixed = costs.resident + costs.fixed + costs.per_row[False]
    free = int((fixed + 300 * costs.per_token[False]) / memory.HEADROOM) + 1                 # bytes
    given = dict(grad_ckpt=None, token_budget=None, gen_batch=None)
    plan = memory.plan_memory(costs, free, max_len=120, given=given)
    assert not plan.grad_ckpt and 290 <= plan.token_budget <= 300          # 120 tokens fit without checkpointing
    assert fixed + plan.token_budget * costs.per_token[False] <= memory.HEADROOM * free
    results = []
    for kw in ({"micro_batch": 4}, {"micro_batch": 4, "token_budget": plan.token_budget}):
        student, comp, tasks, c0, opts, grads = setup_step(world, seed=1, perturb_c0=0.05)
        beta, m, eps = run_step(world, student, comp, tasks, c0, opts, beta=0.3, rng_seed=7, **kw)
        parts = engine.micro_batches(eps, 4, kw.get("token_budget", 0))
        assert all(len(eps[p]) * max(len(e.ids) for e in eps[p]) <= plan.token_budget for p in parts) or \
            "token_budget" not in kw
        g = [grads[id(p)] for p in list(student.parameters()) + comp.trainable_parameters()]
        results.append((beta, m, g, len(parts)))
    (b1, m1, g1, n1), (b2, m2, g2, n2) = results
    assert n1 == 1 and n2 > 1
    assert b2 == pytest.approx(b1, rel=1e-6) and m2["loss/total"] == pytest.approx(m1["loss/total"], rel=1e-5)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


@pytest.mark.equality
def test_the_cold_start_split_by_a_planned_budget_has_the_gradient_of_one_pass(world):
    """Eq. (14)'s step (train.cold_start_step) on four bank entries, whole and split by a budget that a faked
    free memory leaves (about two entries' tokens): the same loss and the same gradient of ψ and χ."""
    import argparse
    import train
    chat, ret = world["chat"], world["retriever"]
    tasks = {t.task_id: t for t in world["train"]}
    episodes = [engine.scripted_episode(chat, t, tool_world.oracle_replies(t)) for t in world["train"][:8]]
    entries = ret.bank[:4]
    longest = max(len(episodes[e["meta"]["episode"]].ids) for e in entries)
    config = AutoModelForCausalLM.from_pretrained(world["path"]).config
    costs = memory.step_costs(config, 4, trained=10_000, n_ret=J, loss_chunk=0, max_len=longest)
    fixed = costs.resident + costs.fixed + costs.per_row[False]
    free = int((fixed + 2 * longest * costs.per_token[False]) / memory.HEADROOM) + 1
    budget = memory.plan_memory(costs, free, longest, dict(grad_ckpt=None, token_budget=None,
                                                            gen_batch=None)).token_budget
    assert longest <= budget < 4 * longest
    out = []
    for token_budget in (0, budget):
        _, comp = make_models(world, seed=2)
        args = argparse.Namespace(n_ret=J, retrieval="same", token_budget=token_budget, loss_chunk=0)
        loss = train.cold_start_step(args, comp, chat, ret, episodes, tasks, entries)
        out.append((loss, [p.grad.clone() for p in comp.trainable_parameters()]))
    (l0, g0), (l1, g1) = out
    assert len(engine.micro_batches([episodes[e["meta"]["episode"]] for e in entries], 4, budget)) > 1
    assert l1 == pytest.approx(l0, rel=1e-5)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)


def test_the_plan_checkpoints_only_when_needed_and_refuses_what_cannot_train():
    """Checkpointing is chosen when one conversation does not train without it; a given value is kept and named;
    below one conversation even with checkpointing the plan is a one-line UserError before any work, naming the
    longest conversation that fits (memory.advice turns it into a --max-len)."""
    config = type("C", (), dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=1000))()
    costs = memory.step_costs(config, 4, trained=10_000, n_ret=3, loss_chunk=0, max_len=1000)
    none = dict(grad_ckpt=None, token_budget=None, gen_batch=None)
    need = {ck: costs.resident + costs.fixed + costs.per_row[ck] + 1000 * costs.per_token[ck] for ck in (0, 1)}
    assert need[1] < need[0]
    roomy = memory.plan_memory(costs, int(need[0] / memory.HEADROOM) + 1, 1000, none)
    tight = memory.plan_memory(costs, int(need[1] / memory.HEADROOM) + 1, 1000, none)
    assert (roomy.grad_ckpt, tight.grad_ckpt) == (False, True) and tight.token_budget >= 1000
    assert tight.chosen == ("grad_ckpt", "token_budget", "gen_batch") and "(given)" not in tight.line()
    capped = memory.plan_memory(costs, 10 * need[0], 1000, none, cap=1000)
    assert capped.token_budget == 1000 and capped.gen_batch > 1
    kept = memory.plan_memory(costs, 10 * need[0], 1000, dict(none, grad_ckpt=True, token_budget=0, gen_batch=3))
    assert (kept.grad_ckpt, kept.token_budget, kept.gen_batch, kept.chosen) == (True, 0, 3, ())
    with pytest.raises(devices.UserError, match=r"one 1000-token conversation needs .* to train; at most 999 "):
        memory.plan_memory(costs, int(need[1] / memory.HEADROOM) - 1, 1000, none)
    with pytest.raises(memory.NoFit) as err:                  # checkpointing given off: the longest without it
        memory.plan_memory(costs, int(need[1] / memory.HEADROOM) + 1, 1000, dict(none, grad_ckpt=False))
    assert 0 < err.value.largest < 1000 and costs.per_row[0] + err.value.largest * costs.per_token[0] <= \
        memory.HEADROOM * (need[1] / memory.HEADROOM + 1) - costs.resident - costs.fixed


@pytest.mark.equality
def test_micro_batches_sum_to_the_whole_batch(world):
    """Same seed -> the same rollouts (checked); the metrics add up and the clipped gradients agree."""
    results = []
    for mb in (2, 4):
        student, comp, tasks, c0, opts, grads = setup_step(world, seed=1, perturb_c0=0.05)
        beta, m, eps = run_step(world, student, comp, tasks, c0, opts, beta=0.3, rng_seed=7, micro_batch=mb)
        g = [grads[id(p)] for p in list(student.parameters()) + comp.trainable_parameters()]
        results.append((beta, m, [e.ids for e in eps], g))
    (b2, m2, ids2, g2), (b4, m4, ids4, g4) = results
    assert ids2 == ids4                                   # identical rollouts: the comparison is fair
    assert m2["loss/anchor"] > 0                          # the anchor term is exercised
    for k in ("loss/distill", "privilege/delta", "loss/anchor", "loss/total"):
        assert m2[k] == pytest.approx(m4[k], rel=1e-5, abs=1e-7), k
    assert b2 == pytest.approx(b4, rel=1e-6, abs=1e-9)
    for a, b in zip(g2, g4):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------------------------------------
# 4. β dynamics (eq. 13): β ← max(0, β + η_β (m − Δ)) with the Δ lopd_step measures
# ------------------------------------------------------------------------------------------------------------
def test_dual_step_rises_below_margin_and_stays_zero_above():
    """Repeated dual_step calls, the loop's semantics: Δ < m raises β by η(m − Δ) each step; Δ ≫ m holds β at 0."""
    beta, seq = 0.0, []
    for _ in range(4):
        beta = losses.dual_step(beta, 0.01, 0.05, 0.5)
        seq.append(beta)
    assert seq == pytest.approx([0.02, 0.04, 0.06, 0.08])
    beta, seq = 0.05, []
    for _ in range(4):
        beta = losses.dual_step(beta, 2.0, 0.05, 0.5)
        seq.append(beta)
    assert seq == [0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("margin", [100.0, -100.0])
def test_lopd_step_feeds_its_delta_to_the_dual_step(world, margin):
    """Real Δ from real rollouts; the margin is put far above (β must rise every step) or far below (β -> 0) any Δ
    the tiny model can reach. Checks the exact update from the Δ that lopd_step reports."""
    student, comp, tasks, c0, opts, _ = setup_step(world, seed=2, tasks=world["train"][6:9])
    beta, betas = (0.0 if margin > 0 else 0.4), []
    for k in range(2):
        new, m, _ = run_step(world, student, comp, tasks, c0, opts, beta=beta, rng_seed=k, margin=margin,
                             dual_lr=0.01, micro_batch=2)
        assert m["skipped"] == 0 and abs(m["privilege/delta"]) < abs(margin) / 2
        assert new == losses.dual_step(beta, m["privilege/delta"], margin, 0.01) == m["dual/beta"]
        beta = new
        betas.append(beta)
    if margin > 0:
        assert 0 < betas[0] < betas[1]
    else:
        assert betas == [0.0, 0.0]


def test_privilege_against_phi0_is_zero_while_the_composer_is_at_phi0(world):
    """--privilege-against phi0: δ measures the teacher behind c_φ against the teacher behind the cached c_φ0. On
    the first step φ = φ0, so Δ is 0 (up to float rounding) and β rises by η_β·m; the paper's Δ (against the
    student) on the same rollouts is not 0."""
    runs = {}
    for against in ("student", "phi0"):
        student, comp, tasks, c0, opts, _ = setup_step(world, seed=2, tasks=world["train"][6:9])
        runs[against] = run_step(world, student, comp, tasks, c0, opts, beta=0.0, privilege_against=against,
                                 dual_lr=0.5, micro_batch=2)[1]
    assert abs(runs["phi0"]["privilege/delta"]) < 1e-6 < abs(runs["student"]["privilege/delta"])
    assert runs["phi0"]["dual/beta"] == pytest.approx(0.5 * 0.05, abs=1e-6)
    assert runs["phi0"]["loss/distill"] == runs["student"]["loss/distill"]     # the same rollouts and KL


# ------------------------------------------------------------------------------------------------------------
# 5. a non-finite loss or gradient skips the update
# ------------------------------------------------------------------------------------------------------------
def _params(student, comp):
    return [p.detach().clone() for p in list(student.parameters()) + comp.trainable_parameters()]


def test_nan_loss_skips_the_update(world, monkeypatch):
    real = losses.lopd_objective

    def nan_objective(*args, **kwargs):
        loss, m = real(*args, **kwargs)
        return loss * float("nan"), m                     # NaN, still attached to the graph

    monkeypatch.setattr(losses, "lopd_objective", nan_objective)
    student, comp, tasks, c0, opts, grads = setup_step(world)
    before = _params(student, comp)
    beta, m, _ = run_step(world, student, comp, tasks, c0, opts, beta=0.3)
    assert m["skipped"] == 1 and beta == 0.3 and m["dual/beta"] == 0.3
    assert not grads and all(not o.state for o in opts)   # no optimizer step happened
    for a, p in zip(before, list(student.parameters()) + comp.trainable_parameters()):
        assert torch.equal(a, p) and p.grad is None


def test_nan_gradient_with_finite_loss_skips_and_drops_gradients(world, monkeypatch):
    """A finite loss whose gradient is NaN: `_step` sees the non-finite norm, steps nothing, drops all gradients."""
    real = losses.lopd_objective

    def nan_grad_objective(student_logits, *args, **kwargs):
        loss, m = real(student_logits, *args, **kwargs)
        return loss + (student_logits * 0).abs().pow(0.5).sum(), m   # value + 0, d/dx √|0·x| = NaN

    monkeypatch.setattr(losses, "lopd_objective", nan_grad_objective)
    student, comp, tasks, c0, opts, grads = setup_step(world)
    before = _params(student, comp)
    beta, m, _ = run_step(world, student, comp, tasks, c0, opts, beta=0.3)
    assert m["skipped"] == 1 and beta == 0.3 and torch.isfinite(torch.tensor(m["loss/total"]))
    for a, p in zip(before, list(student.parameters()) + comp.trainable_parameters()):
        assert torch.equal(a, p) and p.grad is None


def test_skipped_step_leaves_no_stale_gradients(world, monkeypatch):
    real, calls = losses.lopd_objective, []

    def second_is_nan(*args, **kwargs):
        loss, m = real(*args, **kwargs)
        calls.append(1)
        return (loss * float("nan") if len(calls) == 2 else loss), m

    monkeypatch.setattr(losses, "lopd_objective", second_is_nan)
    student, comp, tasks, c0, opts, _ = setup_step(world)
    beta, m, _ = run_step(world, student, comp, tasks, c0, opts, beta=0.3, micro_batch=2)
    assert len(calls) == 2 and m["skipped"] == 1 and beta == 0.3
    stale = [p for p in list(student.parameters()) + comp.trainable_parameters()
             if p.grad is not None and p.grad.abs().sum() > 0]
    assert not stale, f"{len(stale)} parameters keep gradients from the skipped iteration"


def test_retrieve_modes_pass_the_controls_to_the_retriever():
    """same: Ret(x) without the task's own entries; self: with them (the official allow_self_retrieval); other: the
    task's variant excluded; shop: only the task's variant (the oracle); none: no reference at all."""
    class Recorder:
        def retrieve(self, task_ids, texts, n_ret, exclude_self, exclude_variants=None, only_variants=None):
            self.call = (task_ids, exclude_self, exclude_variants, only_variants)
            return [[{"task": "t", "trace": "x"}] * n_ret for _ in task_ids]
    tasks = [tool_world.make_task(random.Random(i), f"t{i}") for i in range(3)]
    ids, shops = [t.task_id for t in tasks], [t.shop for t in tasks]
    rec = Recorder()
    assert lopd.retrieve(rec, tasks, 2, "none") == [[lopd.NO_REFERENCE] * 2] * 3 and not hasattr(rec, "call")
    for mode, call in (("other", (ids, True, shops, None)), ("same", (ids, True, None, None)),
                       ("self", (ids, False, None, None)), ("shop", (ids, True, None, shops))):
        lopd.retrieve(rec, tasks, 2, mode)
        assert rec.call == call, mode
    with pytest.raises(ValueError, match="retrieval mode 'bogus'"):
        lopd.retrieve(rec, tasks, 2, "bogus")


def test_scoring_forwards_keep_no_kv_cache(world):
    """Every re-scoring forward (student, teacher behind latents, the φ0 reference) and the composer's encoder pass
    use_cache=False: nothing reads their KV cache, and at the paper's 40k tokens it is gigabytes. Generation
    (logits_to_keep 1) keeps its cache."""
    student, comp, tasks, c0, opts, _ = setup_step(world, seed=1)
    seen = []

    def spy(module, args, kwargs):
        keep = kwargs.get("logits_to_keep", 0)
        if not isinstance(keep, int) or keep != 1:           # a scoring forward (generation keeps 1 column)
            seen.append((type(module).__name__, kwargs.get("use_cache")))
    hooks = [m.register_forward_pre_hook(spy, with_kwargs=True)
             for m in (student, comp.peft.get_base_model(), comp.peft.get_base_model().model)]
    try:
        run_step(world, student, comp, tasks, c0, opts, privilege_against="phi0")
    finally:
        for h in hooks:
            h.remove()
    names = {n for n, _ in seen}
    assert {"Qwen3ForCausalLM", "Qwen3Model"} <= names, names
    assert seen and all(use_cache is False for name, use_cache in seen if name == "Qwen3ForCausalLM"), seen
    encoder_calls = [u for n, u in seen if n == "Qwen3Model"]
    assert encoder_calls and False in encoder_calls
