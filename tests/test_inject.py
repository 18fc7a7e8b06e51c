"""Tests for inject.py (A.4, A.5, eqs. 17-18): placeholder prompts, embedding replacement, the A.4 equivalence check.

Run: python -m pytest tests/test_inject.py -q
Offline: a toy byte-level BPE tokenizer and a tiny random Qwen3 (fp32, eval mode), built in a module fixture.
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
import engine  # noqa: E402
import inject  # noqa: E402
from worlds.tool_world import ToolWorld, make_task  # noqa: E402
from worlds import toy_backbone as toy  # noqa: E402

SHORT = ("Reference:", "End of reference. Your task:")   # short framing: fewer tokens for the model tests


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    m = Qwen3ForCausalLM(toy.toy_config(tok, hidden=64, layers=2)).float().eval()
    m.generation_config.pad_token_id = tok.pad_token_id
    m.generation_config.eos_token_id = tok.eos_token_id
    return m


def msgs(text):
    return [{"role": "system", "content": "Use the shop tools."}, {"role": "user", "content": text}]


def known_ids(tok, n, seed):
    """n real (non-special) token ids to stand in for latents."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, len(tok) - 10, (n,), generator=g)                  # (n,)


def both_paths(tok, model, texts, n):
    """Left-padded batch two ways: token ids in the span, and placeholders + their embeddings injected."""
    rows, tok_rows, starts, lat = [], [], [], []
    for i, t in enumerate(texts):
        ids, s = engine.latent_prompt_ids(tok, msgs(t), n, framing=SHORT)
        chosen = known_ids(tok, n, seed=i)                                      # (n,)
        rows.append(ids)
        tok_rows.append(ids[:s] + chosen.tolist() + ids[s + n:])
        starts.append(s)
        lat.append(model.get_input_embeddings().weight[chosen].detach())        # (n, d)
    ph, att = engine.left_pad(rows, tok.pad_token_id, "cpu")                      # (B, L)
    ids_tok, att_tok = engine.left_pad(tok_rows, tok.pad_token_id, "cpu")         # (B, L)
    assert torch.equal(att, att_tok)
    return ph, ids_tok, att, inject.span_starts(att, starts), torch.stack(lat)  # starts (B,), lat (B, n, d)


# ------------------------------------------------------------------------------------------------------------
# Prompt side (eq. 17, A.5)
# ------------------------------------------------------------------------------------------------------------
# Appendix A.5, "Latent-context framing text", quoted from the paper as it prints it, paragraph by paragraph (its
# en dash in "SEPARATE session – in", its em dashes around "end of reference"): the agentic framing, then the
# coding framing. Typed apart from inject.py, so that a change of one character there shows here.
PAPER_A5 = "\n\n".join((
    "**Before latent context:**",
    "The following is a REFERENCE EXAMPLE of how a DIFFERENT, already-solved task was handled, shown only to "
    "illustrate the general approach. It was performed in a SEPARATE session – in YOUR task below, NOTHING "
    "has been done yet and the environment is in its initial state. You must perform every step yourself by "
    "calling the tools and reading their actual results; do NOT assume any step is already complete.",
    "**After latent context:**",
    "— end of reference example —",
    "Now complete YOUR task below, starting from scratch (the environment is untouched):",
    "**Before:**",
    "The following is a reference from a similar programming problem. Study the approach and algorithm, then "
    "solve YOUR problem below.",
    "**After:**",
    "— end of reference —",
))


def test_framing_is_word_for_word():
    before, after = inject.AGENTIC_FRAMING
    assert "SEPARATE session \u2013 in YOUR task" in before and before.endswith("already complete.")
    assert after.startswith("\u2014 end of reference example \u2014\n\n")
    assert inject.CODING_FRAMING[1] == "\u2014 end of reference \u2014"
    paragraphs = PAPER_A5.split("\n\n")
    for part in (before, *after.split("\n\n"), *inject.CODING_FRAMING):    # each a whole paragraph of A.5
        assert part in paragraphs, part
    # in the paper's order: before the latents, then after, for each domain
    assert paragraphs.index(before) < paragraphs.index(after.split("\n\n")[0])
    assert paragraphs.index(inject.CODING_FRAMING[0]) < paragraphs.index(inject.CODING_FRAMING[1])


def test_latent_prompt_ids_span(tok):
    ids, start = engine.latent_prompt_ids(tok, msgs("[cedar] Cancel Ana's pear order."), 6)
    assert ids[start:start + 6] == [tok.pad_token_id] * 6
    assert tok.pad_token_id not in ids[:start] + ids[start + 6:]
    text = tok.decode(ids[start + 6:])
    assert text.startswith("\n\n\u2014 end of reference example") and "[cedar] Cancel Ana's pear order." in text
    assert tok.decode(ids[:start]).endswith("do NOT assume any step is already complete.\n\n")
    assert ids[-3:] == tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    # the run's Chat renders the same latent prompt (A.5's framing, no tools listed, thinking off)
    chat = engine.Chat(tok, functools.partial(ToolWorld, framing=inject.AGENTIC_FRAMING, tools=None))
    assert chat.latent_prompt(msgs("[cedar] Cancel Ana's pear order."), None, 6) == (ids, start)


def test_latent_user_content_joining():
    c = inject.latent_user_content("do X", ("B", "A"))
    assert c == "B\n\n" + inject.LATENT_PH + "\n\nA\ndo X"


def test_sentinel_missing_or_repeated(tok):
    with pytest.raises(ValueError, match="2 times, expected exactly once"):
        engine.latent_prompt_ids(tok, msgs("quote " + inject.LATENT_PH), 4)
    t2 = copy.deepcopy(tok)
    t2.chat_template = "{% for m in messages %}{{ m.role }}{% endfor %}"      # drops the message contents
    with pytest.raises(ValueError, match="0 times, expected exactly once"):
        engine.latent_prompt_ids(t2, msgs("x"), 4)
    with pytest.raises(ValueError, match="no user message"):
        engine.latent_prompt_ids(tok, [{"role": "system", "content": "s"}], 4)


# ------------------------------------------------------------------------------------------------------------
# Embedding side (eq. 18) and the A.4 equivalence check
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("texts", [["[cedar] Cancel Ana's pear order."],
                                   ["[birch] Set Ben's tier to gold.", "[alder] Move Cleo to Rome, then ship it."]])
def test_equivalence_logits_and_greedy(tok, model, texts):
    n = 5
    ph, ids_tok, att, starts, lat = both_paths(tok, model, texts, n)
    with torch.no_grad():
        emb = inject.embed_with_latents(model, ph, lat, starts, span_len=n)     # (B, L, d)
        a = model(inputs_embeds=emb, attention_mask=att).logits                 # (B, L, V)
        b = model(input_ids=ids_tok, attention_mask=att).logits                 # (B, L, V)
        real = att.bool()
        assert (a - b)[real].abs().max() < 1e-5
        kw = dict(attention_mask=att, max_new_tokens=8, do_sample=False, temperature=None, top_p=None, top_k=None,
                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        ga = model.generate(inputs_embeds=emb, **kw)                             # (B, N) new tokens only
        gb = model.generate(input_ids=ids_tok, **kw)[:, ids_tok.shape[1]:]      # (B, N)
    assert torch.equal(ga, gb)


def test_generate_replies_with_embed_fn(tok, model):
    """make_embed_fn + span_starts inside engine.generate_replies: same greedy replies as the token-id path."""
    texts = ["[birch] Set Ben's tier to gold.", "[alder] Move Cleo to Rome, then ship it now please."]
    n = 4
    rows, tok_rows, starts, lat = [], [], [], []
    for i, t in enumerate(texts):
        ids, s = engine.latent_prompt_ids(tok, msgs(t), n, framing=SHORT)
        chosen = known_ids(tok, n, seed=10 + i)
        rows.append(ids)
        tok_rows.append(ids[:s] + chosen.tolist() + ids[s + n:])
        starts.append(s)
        lat.append(model.get_input_embeddings().weight[chosen].detach())
    cfg = engine.SampleConfig(temperature=0.0, max_new_tokens=6)
    fn = inject.make_embed_fn(model, torch.stack(lat), starts)
    a = engine.generate_replies(model, tok, rows, cfg, embed_fn=lambda ids, att: fn(ids, att, [0, 1]))
    b = engine.generate_replies(model, tok, tok_rows, cfg)
    assert [r[0] for r in a] == [r[0] for r in b]
    assert all(abs(x - y) < 1e-4 for ra, rb in zip(a, b) for x, y in zip(ra[1], rb[1]))


def test_rollout_with_latent_prompt(tok, model):
    """engine.rollout with prompt_fn + embed_fn (rows index tasks) samples what the token-id prompt samples."""
    rng = random.Random(0)
    tasks = [make_task(rng, f"t{i}") for i in range(3)]
    n = 4
    chosen = [known_ids(tok, n, seed=20 + i) for i in range(3)]
    spans = [engine.latent_prompt_ids(tok, ToolWorld().reset(t), n, framing=SHORT) for t in tasks]
    lat = torch.stack([model.get_input_embeddings().weight[c].detach() for c in chosen])  # (N, n, d)
    by_text = {t.text: i for i, t in enumerate(tasks)}

    def token_prompt(messages, tools):
        i = by_text[messages[1]["content"]]
        ids, s = spans[i]
        return ids[:s] + chosen[i].tolist() + ids[s + n:]

    cfg = engine.SampleConfig(temperature=0.0, max_new_tokens=6, batch_size=2)   # two chunks: rows are global
    chat = toy.toy_chat(tok, functools.partial(ToolWorld, framing=SHORT, tools=None))
    a = engine.rollout(model, chat, tasks, cfg, prompt_fn=lambda m, tools: chat.latent_prompt(m, tools, n)[0],
                       embed_fn=inject.make_embed_fn(model, lat, [s for _, s in spans]))
    b = engine.rollout(model, chat, tasks, cfg, prompt_fn=token_prompt)
    for ea, eb, (ids, _) in zip(a, b, spans):
        assert ea.ids[:ea.prompt_len] == ids
        assert ea.ids[ea.prompt_len:] == eb.ids[eb.prompt_len:] and ea.mask == eb.mask


def test_gradients_reach_latents(tok, model):
    ph, _, att, starts, lat = both_paths(tok, model, ["[cedar] Cancel Ana's pear order.", "[birch] Hi."], 3)
    lat = lat.clone().requires_grad_(True)                                      # (B, n, d)
    emb = inject.embed_with_latents(model, ph, lat, starts)                    # (B, L, d)
    logits = model(inputs_embeds=emb, attention_mask=att).logits               # (B, L, V)
    logits[:, -1].logsumexp(-1).sum().backward()
    assert lat.grad is not None and (lat.grad.abs().sum(-1) > 0).all()     # every latent gets a gradient
    model.zero_grad(set_to_none=True)


def test_inject_is_out_of_place():
    emb = torch.randn(2, 7, 3)
    lat = torch.randn(2, 2, 3)
    before = emb.clone()
    out = inject.inject(emb, lat, torch.tensor([1, 4]))
    assert torch.equal(emb, before)
    assert torch.equal(out[0, 1:3], lat[0]) and torch.equal(out[1, 4:6], lat[1])
    assert torch.equal(out[0, [0, 3, 4, 5, 6]], emb[0, [0, 3, 4, 5, 6]])
    assert torch.equal(out[1, :4], emb[1, :4]) and torch.equal(out[1, 6:], emb[1, 6:])


# ------------------------------------------------------------------------------------------------------------
# The pad-id trap: masks come from lengths
# ------------------------------------------------------------------------------------------------------------
def test_mask_from_lengths_keeps_placeholders_visible(tok, model):
    ph, _, att, starts, lat = both_paths(tok, model, ["[birch] Set Ben's tier to gold.",
                                                      "[alder] Move Cleo to Rome, then ship it."], 4)
    lengths = att.sum(1)
    assert torch.equal(inject.length_mask(lengths, ph.shape[1], left=True), att)
    spans = span_mask(starts, 4, ph.shape[1])                                   # (B, L)
    assert (att[spans] == 1).all() and (ph[spans] == tok.pad_token_id).all()
    naive = (ph != tok.pad_token_id).long()                                     # (B, L): the trap
    assert (naive[spans] == 0).all()
    with torch.no_grad():
        emb = inject.embed_with_latents(model, ph, lat, starts)
        good = model(inputs_embeds=emb, attention_mask=att).logits[:, -1]      # (B, V)
        bad = model(inputs_embeds=emb, attention_mask=naive).logits[:, -1]     # (B, V)
    assert (good - bad).abs().max() > 1e-3


def test_length_mask_and_span_starts():
    assert inject.length_mask([2, 4], 4, left=True).tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    assert inject.length_mask([2, 4], 4, left=False).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    att = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    assert inject.span_starts(att, [1, 2]).tolist() == [4, 2]
    assert span_mask(torch.tensor([1, 3]), 2, 5).tolist() == [
        [False, True, True, False, False], [False, False, False, True, True]]


def span_mask(starts, n: int, total: int) -> torch.Tensor:
    """The placeholder span as a mask: starts (B,) -> (B, total) bool, True at starts[b] ... starts[b] + n − 1."""
    pos = torch.arange(total)[None, :]                                          # (1, total)
    starts = torch.as_tensor(starts, dtype=torch.long)[:, None]                 # (B, 1)
    return (pos >= starts) & (pos < starts + n)                                 # (B, total)


# ------------------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------------------
def test_errors_count_and_span_past_end():
    emb = torch.randn(2, 6, 3)
    with pytest.raises(ValueError, match="span holds 3 positions but 2 latents"):
        inject.inject(emb, torch.randn(2, 2, 3), [0, 0], span_len=3)
    with pytest.raises(ValueError, match="runs outside"):
        inject.inject(emb, torch.randn(2, 2, 3), [0, 5])
    with pytest.raises(ValueError, match="runs outside"):
        inject.inject(emb, torch.randn(2, 2, 3), [-1, 0])
    with pytest.raises(ValueError, match="latents must be"):
        inject.inject(emb, torch.randn(2, 2, 4), [0, 0])
    with pytest.raises(ValueError, match="one entry per row"):
        inject.inject(emb, torch.randn(2, 2, 3), [0])
