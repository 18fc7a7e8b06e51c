"""Tests for composer.py (§3.2, A.1, A.2; eqs. 4-6, 14): shapes, padding invariance, LoRA isolation, gradients,
the cold-start NLL against a brute-force value, and the save/load round trip.

Run: python -m pytest tests/test_composer.py -q
Offline: a toy byte-level BPE tokenizer and tiny random Qwen3 models (fp32, eval mode).
"""
import copy
import functools
import os
import random
import sys

import pytest
import torch
from transformers import Qwen3ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import composer as C  # noqa: E402
from engine import scripted_episode  # noqa: E402
from worlds.tool_world import ToolWorld, make_task, oracle_replies  # noqa: E402
from worlds import toy_backbone as toy  # noqa: E402

CFG = C.ComposerConfig(n_latents=4, n_layers=3, max_exp_tokens=160)
SHORT = ("Reference:", "End of reference. Your task:")


def base_model(tok, seed=0):
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(toy.toy_config(tok, hidden=64, layers=2)).float().eval()


def build(tok, seed=0, perturb=True):
    """(composer, untouched copy of the base model). perturb: give LoRA B non-zero values (it starts at 0)."""
    model = base_model(tok, seed)
    ref = copy.deepcopy(model)
    torch.manual_seed(seed + 1)
    comp = C.Composer(model, tok, copy.deepcopy(CFG))   # its own config: a test may change it
    if perturb:
        with torch.no_grad():
            for n, p in comp.peft.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.2)
    return comp, ref


@pytest.fixture(scope="module")
def episodes(tok):
    rng = random.Random(0)
    tasks = [make_task(rng, f"t{i}") for i in range(5)]
    eps = [scripted_episode(toy.toy_chat(tok), t, oracle_replies(t)) for t in tasks]
    return tasks, eps


def lora_params(comp, kind):
    return {n: p for n, p in comp.peft.named_parameters() if kind in n}


# ------------------------------------------------------------------------------------------------------------
def test_shapes_and_encoder_text(tok):
    comp, _ = build(tok)
    tasks = ["[cedar] Cancel Ana's pear order.", "[birch] Set Ben's tier to gold."]
    exps = [["1. a -> b", "2. c -> d", "3. e"], ["x", "y", "z -> w"]]
    c = comp(tasks, exps)                                                       # (B, J·K, d)
    assert c.shape == (2, 3 * 4, 64) and c.dtype == torch.float32
    # retrieval order: block j of task b is the compression of experience j alone
    alone = comp.compress([C.ENCODER_TEMPLATE.format(task=tasks[1], experience=exps[1][2])])  # (1, K, d)
    assert torch.allclose(c[1, 8:12], alone[0], atol=1e-5)
    want = "Task to solve: \nX\n\nReference past trajectory: \nM"
    assert C.ENCODER_TEMPLATE.format(task="X", experience="M") == want
    # latents start at the scale of real token embeddings (RMSNorm gain 1 × embedding-table RMS)
    emb_rms = comp.backbone.get_input_embeddings().weight.pow(2).mean().sqrt()
    assert torch.allclose(c.pow(2).mean(-1).sqrt(), emb_rms.expand(2, 12), rtol=1e-3)
    with pytest.raises(ValueError, match="same length J"):
        comp(tasks, [["a", "b"], ["c"]])


def test_reference_only_encoding_ignores_the_task(tok):
    """task_conditional=False (the toy's --composer-input reference): the latents are a function of the
    experience alone; with A.2's task-conditional input the same experience gives other latents per task."""
    comp, _ = build(tok)
    exps = [["1. find_customer -> C1", "2. commit() -> Committed"]]
    with torch.no_grad():
        conditional = [comp([task], exps) for task in ("Cancel order K1. Shop: alder.", "Buy K2. Shop: flint.")]
        comp.cfg.task_conditional = False
        blind = [comp([task], exps) for task in ("Cancel order K1. Shop: alder.", "Buy K2. Shop: flint.")]
        alone = comp.compress([C.REFERENCE_TEMPLATE.format(experience=exps[0][1])])      # (1, K, d)
    assert not torch.allclose(conditional[0], conditional[1], atol=1e-3)
    assert torch.equal(blind[0], blind[1])
    assert torch.allclose(blind[0][0, 4:8], alone[0], atol=1e-5)


def test_hidden_states_are_final_normed_layer(tok):
    comp, _ = build(tok)
    hidden, att = comp.encode(["Task to solve: \nabc\n\nReference past trajectory: \ndef"])
    full = comp.peft(input_ids=comp.tokenizer(["Task to solve: \nabc\n\nReference past trajectory: \ndef"],
                                              return_tensors="pt")["input_ids"], output_hidden_states=True)
    assert torch.allclose(hidden, full.hidden_states[-1], atol=1e-6)


@pytest.mark.equality
def test_padding_invariance(tok):
    comp, _ = build(tok)
    short = C.ENCODER_TEMPLATE.format(task="[cedar] Cancel Ana's pear order.", experience="1. find -> C1")
    long = C.ENCODER_TEMPLATE.format(task="[birch] Set Ben's tier to gold.",
                                     experience="\n".join(f"{i}. lookup_customer(name=\"Ben\") -> C{i}"
                                                          for i in range(12)))
    with torch.no_grad():
        a = comp.compress([short])                                              # (1, K, d)
        b = comp.compress([long, short, long])                                  # (3, K, d), short padded
        _, att = comp.encode([long, short])
    assert att[1].sum() < att.shape[1] // 2                                     # much padding in the batch
    assert torch.allclose(a[0], b[1], atol=1e-5)


@pytest.mark.equality
def test_repeated_experiences_are_encoded_once_with_the_same_values_and_gradients(tok):
    """forward() encodes each distinct text once; the latents and the gradients equal encoding every row alone."""
    cfg = C.ComposerConfig(n_latents=4, n_layers=3, max_exp_tokens=160, task_conditional=True)
    comp = C.Composer(base_model(tok), tok, cfg)
    tasks = ["[alder] a", "[cedar] b", "[alder] c"]
    exps = [["m1", "m2"], ["m2", "m3"], ["m1", "m1"]]   # 6 rows; task-conditional: 5 distinct texts
    calls = []
    real = comp.compress
    comp.compress = lambda texts: calls.append(len(texts)) or real(texts)
    c = comp(tasks, exps)                                                       # (3, 2·K, d)
    assert calls == [5]
    q = comp.qformer.queries
    (g_dedup,) = torch.autograd.grad((c ** 2).sum(), q)
    rows = [real([C.ENCODER_TEMPLATE.format(task=x, experience=m)]) for x, ms in zip(tasks, exps) for m in ms]
    brute = torch.cat(rows, 0).reshape(3, 2 * cfg.n_latents, -1)                # every row encoded alone
    (g_brute,) = torch.autograd.grad((brute ** 2).sum(), q)
    assert torch.allclose(c.float(), brute, atol=1e-5)
    assert torch.allclose(g_dedup, g_brute, atol=1e-4)


@pytest.mark.equality
def test_chunked_encoding_in_length_order_returns_the_input_order(tok):
    """encode_batch_size chunks the texts by length; the latents come back in the order of the texts."""
    comp, _ = build(tok)
    texts = [C.REFERENCE_TEMPLATE.format(experience="x" * n) for n in (40, 3, 25, 9, 60)]
    with torch.no_grad():
        whole = comp.compress(texts)                                            # (5, K, d), one forward
        comp.cfg.encode_batch_size = 2
        chunked = comp.compress(texts)                                          # 3 forwards by length
        alone = torch.cat([comp.compress([t]) for t in texts])                  # each text alone
    assert torch.allclose(whole, chunked, atol=1e-5) and torch.allclose(alone, chunked, atol=1e-5)


@pytest.mark.equality
def test_qformer_matches_multihead_attention_applied_per_layer():
    """The QFormer projects keys and values once; nn.MultiheadAttention called in every layer (the textbook
    block, with the same weights) gives the same latents and the same gradients, padding included."""
    torch.manual_seed(0)
    qf = C.QFormer(d=32, n_heads=4, n_latents=5, n_layers=3, ffn_mult=4, emb_rms=0.7)
    hidden = torch.randn(3, 11, 32, requires_grad=True)                        # (N, T, d)
    pad = torch.zeros(3, 11, dtype=torch.bool)
    pad[1, 6:], pad[2, 9:] = True, True                                         # right padding
    out = qf(hidden, pad)                                                       # (N, K, d)

    blk = qf.block                                                              # the textbook block, by hand
    kv = qf.norm_kv(hidden)
    q = qf.queries.expand(3, -1, -1)
    for _ in range(qf.n_layers):
        a, _ = blk.attn(blk.norm_q(q), kv, kv, key_padding_mask=pad, need_weights=False)
        q = q + a
        q = q + blk.ffn(blk.norm_ff(q))
    ref = qf.norm_out(q) * qf.emb_rms
    assert torch.allclose(out, ref, atol=1e-5)
    w = torch.randn_like(out)
    params = [hidden, qf.queries, blk.attn.in_proj_weight, blk.attn.out_proj.weight]
    g_out = torch.autograd.grad((out * w).sum(), params)
    g_ref = torch.autograd.grad((ref * w).sum(), params)
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(g_out, g_ref))
    assert hidden.grad is None and g_out[0][1, 6:].abs().max() == 0            # pads get no gradient


def test_adapter_disabled_is_bit_exact_base(tok):
    comp, ref = build(tok)                                                       # LoRA B perturbed: LoRA is live
    ids = torch.tensor([tok("<|im_start|>user\nCancel Ana's pear order.<|im_end|>\n")["input_ids"]])
    att = torch.ones_like(ids)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=att).logits                   # (1, T, V)
        assert torch.equal(comp.base_forward(input_ids=ids, attention_mask=att).logits, want)
        with comp.adapter_disabled():                                           # the caller's model object too
            assert torch.equal(comp.backbone(input_ids=ids, attention_mask=att).logits, want)
        assert not torch.allclose(comp.peft(input_ids=ids, attention_mask=att).logits, want, atol=1e-4)
        # teacher path: latents injected, LoRA off == the untouched model fed the same embeddings
        lat = torch.randn(1, 3, 64)
        emb = ref.get_input_embeddings()(ids).clone()
        emb[0, 2:5] = lat[0]
        want = ref(inputs_embeds=emb, attention_mask=att).logits
        assert torch.equal(comp.teacher_logits(ids, att, lat, torch.tensor([2])), want)
    with comp.adapter_disabled(), pytest.raises(RuntimeError, match="adapter_disabled"):
        comp.encode(["x"])


def cold_batch(tok, comp, episodes, J=2):
    tasks, eps = episodes
    chat = toy.toy_chat(tok, functools.partial(ToolWorld, framing=SHORT, tools=None))   # the SHORT framing
    exps = [[eps[(i + j + 1) % len(eps)].trace for j in range(J)] for i in range(len(tasks))]
    batch = C.cold_start_batch(chat, eps, J * CFG.n_latents)                  # ids, att, omega, starts
    return [t.text for t in tasks], exps, batch


def test_cold_start_batch_layout(tok, episodes):
    comp, _ = build(tok)
    _, _, (ids, att, omega, starts) = cold_batch(tok, comp, episodes)
    _, eps = episodes
    for b, ep in enumerate(eps):
        n = int(att[b].sum())
        assert att[b, :n].all() and not att[b, n:].any()                      # right-padded, from lengths
        assert (ids[b, starts[b]:starts[b] + 8] == tok.pad_token_id).all()    # the span
        assert ids[b, n - len(ep.ids) + ep.prompt_len:n].tolist() == ep.ids[ep.prompt_len:]
        assert omega[b].sum() == sum(ep.mask)


def test_gradients_reach_only_lora_and_qformer(tok, episodes):
    comp, _ = build(tok, perturb=False)                                          # LoRA B = 0 as at init
    texts, exps, batch = cold_batch(tok, comp, episodes)
    opt = torch.optim.AdamW(comp.trainable_parameters(), lr=1e-2)
    for step in range(2):
        opt.zero_grad(set_to_none=True)
        C.cold_start_loss(comp, batch, comp(texts, exps)).backward()
        frozen = [(n, p) for n, p in comp.peft.named_parameters() if "lora_" not in n]
        assert frozen and all(not p.requires_grad and p.grad is None for _, p in frozen)
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in comp.qformer.parameters())
        assert all(p.grad.abs().sum() > 0 for p in lora_params(comp, "lora_B").values())
        lora_a = lora_params(comp, "lora_A").values()
        if step == 0:   # B = 0 at init, so ∂L/∂A = Bᵀ(...) = 0: A only moves once B has moved
            assert all(p.grad is None or p.grad.abs().sum() == 0 for p in lora_a)
        else:
            assert all(p.grad.abs().sum() > 0 for p in lora_a)
        opt.step()
    assert len(lora_params(comp, "lora_A")) == 2 * 7                           # 7 projections × 2 layers


def test_cold_start_loss_matches_brute_force(tok, episodes):
    comp, ref = build(tok)
    texts, exps, batch = cold_batch(tok, comp, episodes)
    ids, att, omega, starts = batch
    with torch.no_grad():
        lat = comp(texts, exps)                                                 # (B, J·K, d)
        got = C.cold_start_loss(comp, batch, lat)
        emb = ref.get_input_embeddings()(ids).clone()                           # (B, T, d)
        for b, s in enumerate(starts.tolist()):
            emb[b, s:s + lat.shape[1]] = lat[b]
        logits = ref(inputs_embeds=emb, attention_mask=att).logits.double()   # (B, T, V)
    total, count = 0.0, 0
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1] - 1):
            if omega[b, t + 1] > 0:
                total -= torch.log_softmax(logits[b, t], -1)[ids[b, t + 1]].item()
                count += 1
    assert count == int(omega[:, 1:].sum())
    assert abs(got.item() - total / count) < 1e-5


def test_save_load_round_trip(tok, tmp_path):
    comp, _ = build(tok)
    with torch.no_grad():
        for p in comp.qformer.parameters():
            p.add_(0.01 * torch.randn_like(p))
    tasks, exps = ["[cedar] Cancel Ana's pear order."], [["1. find -> C1", "2. cancel -> ok"]]
    with torch.no_grad():
        want = comp(tasks, exps)
    path = str(tmp_path / "composer")
    comp.save(path)
    comp.save(path)                                                             # overwrite in place
    assert {"composer", "composer.json", "qformer.safetensors"} <= set(os.listdir(path))
    assert os.path.exists(os.path.join(path, "composer", "adapter_model.safetensors"))
    assert sorted(os.listdir(tmp_path)) == ["composer"]                        # no temp folders left
    loaded = C.Composer.load(path, base_model(tok, seed=0), tok)
    assert loaded.cfg == CFG
    with torch.no_grad():
        assert torch.equal(loaded(tasks, exps), want)
    assert all(p.requires_grad for n, p in loaded.peft.named_parameters() if "lora_" in n)


@pytest.mark.filterwarnings("ignore::FutureWarning")   # peft reads a property transformers 5 deprecates
def test_existing_peft_model_with_another_adapter(tok):
    """Injected into a PeftModel that already has a (student) adapter: encoding activates the composer's own LoRA,
    leaves the student's trainable, and gives the same latents whichever adapter was active before."""
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(base_model(tok), LoraConfig(r=2, target_modules=["q_proj"]), adapter_name="student")
    comp = C.Composer(model, tok, CFG)
    assert comp.peft is model and set(model.peft_config) == {"student", "composer"}
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)   # both adapters train
    assert not any(".student." in n for n, p in comp.peft.named_parameters()
                   if any(p is q for q in comp.trainable_parameters()))               # φ holds no student LoRA
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".student." in n and "lora_B" in n:
                p.fill_(0.5)                    # a student LoRA that changes the backbone's output
    model.set_adapter("student")                # peft's own call: freezes the composer's LoRA
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    with torch.no_grad():
        a = comp.compress(["x y"])
    assert model.active_adapter == "student"                                        # restored afterwards
    assert flags == {n: p.requires_grad for n, p in model.named_parameters()}       # and no flag changed
    model.set_adapter("composer")
    with torch.no_grad():
        b = comp.compress(["x y"])
    assert a.shape == (1, CFG.n_latents, 64) and torch.equal(a, b)


@pytest.mark.equality
def test_the_chunked_cold_start_loss_equals_the_full_logits_one(tok, episodes):
    """--loss-chunk on the cold start (eq. 14): hidden states out, the NLL applies the head 3 rows at a time; the
    same value and the same gradients for ψ and χ."""
    from runtime import models
    comp, _ = build(tok)
    texts, exps, batch = cold_batch(tok, comp, episodes)
    got = []
    for chunk in (0, 3):
        for p in comp.trainable_parameters():
            p.grad = None
        if chunk:
            with models.lm_head_bypassed(comp.peft):
                loss = C.cold_start_loss(comp, batch, comp(texts, exps), None, models.lm_head(comp.peft), chunk)
        else:
            loss = C.cold_start_loss(comp, batch, comp(texts, exps))
        loss.backward()
        got.append((loss.item(), [p.grad.clone() for p in comp.trainable_parameters() if p.grad is not None]))
    (l0, g0), (l3, g3) = got
    assert l3 == pytest.approx(l0, rel=1e-5) and len(g0) == len(g3) > 0
    for a, b in zip(g0, g3):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)
