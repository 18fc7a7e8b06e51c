"""The decode loop (engine.Conversations.decode, sample_next, PreallocatedLayer) against the one it replaced, kept
as scripts/bench.py's ReferenceConversations: the same seed gives the same ids, the same log-probs (to fp32
rounding), the same cache and mask after every turn and the same random stream, on the toy backbone (whole
rollouts) and on SmolLM2 (turns driven by hand: a shared system prompt, observations of different lengths, a row
leaving the batch). Thinking is switched on, though neither chat template here renders it differently (SmolLM2's
has no switch, the toy's neither). Then the decoding copy of a fp32 model under bf16 autocast (runtime/devices.py).

    python -m pytest tests/test_decode.py -q
"""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.cache_utils import DynamicLayer

import engine
from runtime import models
from scripts import bench
from worlds import tool_world
from worlds import toy_backbone as toy

SAMPLINGS = {"B.2": dict(temperature=0.7, top_p=0.95, top_k=20), "no top-k": dict(temperature=1.0, top_k=0, top_p=0.9),
             "no top-p": dict(temperature=1.3, top_p=1.0), "greedy": dict(temperature=0.0)}


# ------------------------------------------------------------------------------------------------------------
# Sampling: the draw is torch.multinomial's; the nucleus among the top-k is the full sort's
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(5))
def test_draw_is_torch_multinomial_with_the_same_random_numbers(seed):
    g = torch.Generator().manual_seed(seed)
    probs = (torch.randn(7, 3001, generator=g) * 4).masked_fill(torch.rand(7, 3001, generator=g) < 0.5,
                                                                float("-inf")).softmax(-1)   # (B, V) zeros too
    torch.manual_seed(seed)
    want, after = torch.multinomial(probs, 1)[:, 0], torch.rand(3)
    torch.manual_seed(seed)
    got = engine.draw(probs)
    assert torch.equal(got, want) and torch.equal(torch.rand(3), after)


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_sample_next_draws_what_the_full_sort_drew(name):
    cfg = engine.SampleConfig(**SAMPLINGS[name])
    scores = torch.randn(8, 5000, generator=torch.Generator().manual_seed(2)) * 3            # (B, V)
    for k in ((cfg.top_k, 400) if cfg.top_k else (0,)):
        cfg.top_k = k
        torch.manual_seed(0)
        got = torch.stack([engine.sample_next(scores, cfg) for _ in range(100)])             # (100, B)
        torch.manual_seed(0)
        want = torch.stack([bench.reference_sample_next(scores, cfg) for _ in range(100)])   # (100, B)
        assert torch.equal(got, want)


# ------------------------------------------------------------------------------------------------------------
# The preallocated layer: in place while there is room, DynamicLayer's values whatever runs between turns
# ------------------------------------------------------------------------------------------------------------
def test_preallocated_layer_writes_in_place_and_holds_dynamic_layers_values():
    g = torch.Generator().manual_seed(0)
    kv = lambda B, n: (torch.randn(B, 2, n, 4, generator=g), torch.randn(B, 2, n, 4, generator=g))  # noqa: E731
    ours, theirs = engine.PreallocatedLayer(), DynamicLayer()
    steps = [("feed", kv(1, 5)), ("repeat", 3), ("feed", kv(3, 2)), ("reserve", 4)] + \
            [("feed", kv(3, 1)) for _ in range(4)] + [("crop", -2), ("select", torch.tensor([2, 0])),
                                                      ("feed", kv(2, 3)), ("reserve", 2), ("feed", kv(2, 1))]
    for op, arg in steps:
        if op == "feed":
            room, at = ours.free(), ours.room[0].data_ptr() if ours.free() else None
            k, v = ours.update(*arg)
            assert torch.equal(k, theirs.update(*arg)[0]) and torch.equal(v, theirs.values)
            if room >= arg[0].shape[-2]:                                 # written into the room, no copy
                assert k.data_ptr() == at and ours.free() == room - arg[0].shape[-2]
        elif op == "reserve":
            ours.reserve(arg)
            assert ours.free() >= arg and torch.equal(ours.keys, theirs.keys)
        else:
            for layer in (ours, theirs):
                ops = dict(repeat=layer.batch_repeat_interleave, crop=layer.crop, select=layer.batch_select_indices)
                ops[op](arg)
            assert torch.equal(ours.keys, theirs.keys) and ours.free() == 0      # the room is gone with the views


# ------------------------------------------------------------------------------------------------------------
# Whole rollouts of the toy backbone, and SmolLM2's turns, against the reference decode
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def backbone(toy_backbone_dir):
    return AutoModelForCausalLM.from_pretrained(toy_backbone_dir), AutoTokenizer.from_pretrained(toy_backbone_dir)


@pytest.mark.equality
@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_toy_rollouts_are_the_reference_decodes(backbone, monkeypatch, name):
    model, tok = backbone
    tasks = tool_world.make_splits(0, n_train=12, n_test=0)[0]
    chat = engine.Chat(tok, lambda: tool_world.ToolWorld(system_prompt=tool_world.TOY_SYSTEM_PROMPT, max_steps=6,
                                                         tools=None), thinking=True)
    cfg = engine.SampleConfig(max_new_tokens=24, max_len=400, batch_size=6, **SAMPLINGS[name])
    runs = []
    for conversations in (engine.Conversations, bench.ReferenceConversations):
        monkeypatch.setattr(engine, "Conversations", conversations)
        torch.manual_seed(0)
        runs.append((engine.rollout(model, chat, tasks, cfg), torch.rand(3)))
    (got, rng), (want, rng_want) = runs
    assert sum(e.steps for e in got) > 2 * len(tasks) and torch.equal(rng, rng_want)   # several turns; one stream
    for a, b in zip(got, want):
        assert a.ids == b.ids and a.mask == b.mask
        assert max(abs(x - y) for x, y in zip(a.logps, b.logps)) < 1e-6


def turns(conversations, model, tok, cfg, seed: int = 0) -> list:
    """Three turns of three conversations driven by hand through `conversations` (engine.Conversations or the
    reference): one system prompt, thinking switched on; each reply gets an observation of a length of its own, and the
    second row leaves before the last turn. -> per turn (replies, the mask, the cache's length, the generator's
    state after the turn)."""
    system = {"role": "system", "content": "You are a helpful assistant. Answer in one short sentence."}
    users = ["What is the capital of France?", "Name a prime number.", "Say hello in Spanish, please."]
    contexts = [engine.prompt_ids(tok, [system, {"role": "user", "content": u}], enable_thinking=True) for u in users]
    torch.manual_seed(seed)
    conv, keys, out = conversations(model, tok), [0, 1, 2], []
    for turn in range(3):
        rows = engine.generate_replies(model, tok, [contexts[k] for k in keys], cfg, conversations=conv, keys=keys)
        out.append((rows, conv.mask.clone(), conv.cache.get_seq_length(), torch.get_rng_state()))
        for k, (new, _, _) in zip(keys, rows):
            result = f"result {turn}: " + "ok " * (1 + 4 * k + turn)                 # lengths differ by row
            contexts[k] = contexts[k] + new + engine.observation_ids(tok, [result], enable_thinking=True)
        keys = [0, 2] if turn == 1 else keys
    return out


def assert_same_turns(got, want):
    for (rows, mask, length, rng), (rows_w, mask_w, length_w, rng_w) in zip(got, want):
        assert [r[0] for r in rows] == [r[0] for r in rows_w] and [r[2] for r in rows] == [r[2] for r in rows_w]
        assert max(abs(a - b) for r, rw in zip(rows, rows_w) for a, b in zip(r[1], rw[1])) < 1e-5
        assert torch.equal(mask, mask_w) and length == length_w and torch.equal(rng, rng_w)


@pytest.mark.parametrize("name", ["B.2", "no top-k"])
def test_smollm2_turns_are_the_reference_decodes(smollm2, name):
    model, tok = AutoModelForCausalLM.from_pretrained(smollm2).eval(), AutoTokenizer.from_pretrained(smollm2)
    cfg = engine.SampleConfig(max_new_tokens=20, **SAMPLINGS[name])
    got = turns(engine.Conversations, model, tok, cfg)
    assert_same_turns(got, turns(bench.ReferenceConversations, model, tok, cfg))
    assert any(r[2] for rows, *_ in got for r in rows) and not all(r[2] for rows, *_ in got for r in rows)


@pytest.mark.equality
def test_steps_past_the_last_end_are_undone(backbone):
    """Every row ends within END_CHECK tokens, before the host looks: the extra steps' columns and draws are
    taken back (the same mask, cache length and random stream as the reference, which stops at once)."""
    model, tok = backbone
    cfg = engine.SampleConfig(max_new_tokens=2 * engine.END_CHECK + 3, temperature=1.0)
    seen = [[] for _ in range(2)]
    for i, conversations in enumerate((engine.Conversations, bench.ReferenceConversations)):
        for seed in range(6):
            seen[i].append(turns(conversations, model, tok, cfg, seed))
    longest = [max(len(r[0]) for r in rows) for runs in seen[0] for rows, *_ in runs]    # per turn
    T, C = cfg.max_new_tokens, engine.END_CHECK
    assert sum(n < T and n % C != 0 for n in longest) >= 2               # turns whose last end was not looked at
    for got, want in zip(*seen):
        assert_same_turns(got, want)


def test_compiled_decode_steps_give_the_eager_replies(backbone):
    model, tok = backbone
    cfg = engine.SampleConfig(max_new_tokens=12, temperature=0.0)
    eager = turns(engine.Conversations, model, tok, cfg)
    cfg.compile_decode = True
    assert_same_turns(turns(engine.Conversations, model, tok, cfg), eager)


@pytest.mark.equality
def test_a_sliding_window_model_is_looked_at_every_token(backbone):
    """A random Qwen3 whose first layer attends through a sliding window shorter than a turn: its cache cannot be
    cropped or compacted, so decode looks at the rows each token; the replies are still the reference's."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    _, tok = backbone
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         head_dim=16, sliding_window=12, use_sliding_window=True,
                                         layer_types=["sliding_attention", "full_attention"])).eval()
    model.generation_config.eos_token_id = list(range(0, len(tok), 5))     # a fifth of the ids end a reply
    cfg = engine.SampleConfig(max_new_tokens=2 * engine.END_CHECK + 3, temperature=1.0)
    got = turns(engine.Conversations, model, tok, cfg)
    longest = [max(len(r[0]) for r in rows) for rows, *_ in got]
    assert any(n % engine.END_CHECK for n in longest)                 # a last end between two looks
    assert_same_turns(got, turns(bench.ReferenceConversations, model, tok, cfg))


# ------------------------------------------------------------------------------------------------------------
# The decoding copy: a fp32 model under bf16 autocast generates from its Linear weights cast once (runtime/devices.py)
# ------------------------------------------------------------------------------------------------------------
def test_the_decoding_copy_is_made_only_under_autocast_and_shares_what_autocast_leaves(backbone):
    model, _ = backbone
    assert models.decoding_copy(model) is model                              # fp32 without autocast: the CPU
    with torch.autocast("cpu", dtype=torch.bfloat16):
        copy = models.decoding_copy(model)
        bf16 = AutoModelForCausalLM.from_pretrained(model.name_or_path, dtype=torch.bfloat16)
        assert models.decoding_copy(bf16) is bf16                            # a bf16 backbone: as it is
    assert copy is not model and copy.lm_head.weight.dtype == torch.bfloat16
    assert copy.model.embed_tokens.weight is model.model.embed_tokens.weight  # not cast by autocast: shared
    assert copy.model.norm.weight is model.model.norm.weight
    assert model.lm_head.weight.dtype == torch.float32 and all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.equality
def test_rollouts_from_the_decoding_copy_are_autocasts(backbone, monkeypatch):
    """The toy backbone under CPU's bf16 autocast (train.py's `precision` on CUDA): whole rollouts from the copy
    and from the fp32 model, each weight cast at every forward, give the same ids and log-probs, exactly."""
    model, tok = backbone
    tasks = tool_world.make_splits(0, n_train=8, n_test=0)[0]
    cfg = engine.SampleConfig(max_new_tokens=24, max_len=400, batch_size=8)
    runs, made = [], []
    real = models.decoding_copy
    for copying in (True, False):
        monkeypatch.setattr(models, "decoding_copy", lambda m: made.append(real(m)) or made[-1] if copying else m)
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            runs.append(engine.rollout(model, toy.toy_chat(tok), tasks, cfg))
    assert len(made) == 1 and made[0] is not model                            # one copy a rollout
    assert sum(e.steps for e in runs[0]) > len(tasks)
    for a, b in zip(*runs):
        assert a.ids == b.ids and a.logps == b.logps


def test_smollm2_turns_from_the_decoding_copy_are_autocasts(smollm2):
    model, tok = AutoModelForCausalLM.from_pretrained(smollm2).eval(), AutoTokenizer.from_pretrained(smollm2)
    cfg = engine.SampleConfig(max_new_tokens=12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        copy = models.decoding_copy(model)
        got = turns(lambda m, t: engine.Conversations(copy, t), model, tok, cfg)
        want = turns(engine.Conversations, model, tok, cfg)
    for (rows, *_), (rows_w, *_) in zip(got, want):
        assert rows == rows_w


def test_the_decode_benchmark_runs_at_a_tiny_size(capsys):
    """scripts/bench.py --decode's table (SmolLM2 where installed, else a random Qwen3), at two tiny contexts."""
    bench.bench_decode(2, 4, 1, contexts=(24, 40))
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 24 ") or
            line.startswith("| 40 ")]
    assert len(rows) == 2 and all(row.endswith("| True |") for row in rows)
