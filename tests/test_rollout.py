"""Toy backbone (tokenizer, chat template, tiny pretraining) and rollout bookkeeping (ω, sampled log-probs)."""
import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import engine
from scripts import bench
from worlds import code_world
from worlds import common, tool_world
from worlds import toy_backbone as toy


@pytest.fixture(scope="module")
def backbone(toy_backbone_dir):
    """A tiny pretraining run (conftest's: the smoke test of base pretraining), saved as an ordinary HF folder."""
    torch.set_num_threads(1)
    out = toy_backbone_dir
    return AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out), out


def test_pretraining_smoke_saves_a_cached_hf_folder(backbone):
    model, tok, out = backbone
    meta = json.load(open(os.path.join(out, "toy_backbone.json")))
    assert meta["steps"] == 60 and model.config.vocab_size == len(tok)
    assert sum(p.numel() for p in model.parameters()) == meta["params"]
    stamp = os.path.getmtime(os.path.join(out, "config.json"))
    toy.build_backbone(out, log=lambda *_: None)                       # second call reuses the folder
    assert os.path.getmtime(os.path.join(out, "config.json")) == stamp


def test_tokenizer_round_trip(backbone):
    _, tok, _ = backbone
    for text in ['<tool_call>\n{"name": "find_customer", "arguments": {"name": "Ana"}}\n</tool_call>',
                 "[cedar shop] Cancel Ana's pear order.", "C417 O082 x9 ünïcødé 😀 \t\n  end"]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids, skip_special_tokens=False) == text
    ids = tok("C417 find_customer", add_special_tokens=False)["input_ids"]
    # digits one by one, as in Qwen3; snake_case names stay whole
    assert [tok.decode([i]) for i in ids][:4] == ["C", "4", "1", "7"] and tok.decode(ids[-1]) == "find_customer"
    for t in ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_response>"]:
        assert len(tok(t, add_special_tokens=False)["input_ids"]) == 1
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"


def test_chat_template_renders_tool_calls_like_qwen3(backbone):
    _, tok, _ = backbone
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "list_orders", "arguments": {"customer_id": "C1"}}}]},
            {"role": "tool", "content": "O1 pear x1 open"}, {"role": "tool", "content": "second"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
                    '<tool_call>\n{"name": "list_orders", "arguments": {"customer_id": "C1"}}\n</tool_call>'
                    "<|im_end|>\n<|im_start|>user\n<tool_response>\nO1 pear x1 open\n</tool_response>\n"
                    "<tool_response>\nsecond\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # the assistant content written by format_call renders identically to a structured tool call
    as_text = msgs[:2] + [{"role": "assistant", "content": common.format_call("list_orders", {"customer_id": "C1"})}]
    assert tok.apply_chat_template(as_text, tokenize=False) == tok.apply_chat_template(msgs[:3], tokenize=False)


def _segments(ep):
    """Split an episode into maximal runs of equal ω: [(ω, ids), ...]."""
    segs = []
    for i, m in zip(ep.ids, ep.mask):
        if segs and segs[-1][0] == m:
            segs[-1][1].append(i)
        else:
            segs.append((m, [i]))
    return segs


def test_rollout_omega_covers_exactly_the_sampled_tokens(backbone):
    model, tok, _ = backbone
    _, test = tool_world.make_splits(seed=0, n_train=10, n_test=12)
    torch.manual_seed(0)
    eps = engine.rollout(model, toy.toy_chat(tok), test,
                         engine.SampleConfig(temperature=1.0, max_new_tokens=48, batch_size=5))
    assert max(e.steps for e in eps) >= 2                               # multi-turn episodes occur
    for ep in eps:
        segs = _segments(ep)
        env = tool_world.ToolWorld()
        assert segs[0] == (0, engine.prompt_ids(tok, env.reset(ep.task)))  # the prompt, unsampled
        assert len(ep.ids) == len(ep.mask) == len(ep.logps) and ep.prompt_len == len(segs[0][1])
        replies = [ids for m, ids in segs if m == 1]
        observations = [ids for m, ids in segs[1:] if m == 0]
        assert len(replies) == ep.steps and len(observations) in (ep.steps - 1, ep.steps - 2)
        for k, reply in enumerate(replies):                            # replay: ω = 0 runs are the observations
            text = tok.decode(reply).replace(tok.eos_token, "")
            result = env.step(text)
            if k < len(observations):
                assert observations[k] == engine.observation_ids(tok, result.observations)
        assert env.reward() == ep.reward and common.lite_trace(env.trace) == ep.trace


@pytest.mark.equality
def test_rescoring_recorded_ids_matches_sampling_logprobs(backbone):
    model, tok, _ = backbone
    _, test = tool_world.make_splits(seed=0, n_train=10, n_test=6)
    torch.manual_seed(1)
    eps = engine.rollout(model, toy.toy_chat(tok), test,
                         engine.SampleConfig(temperature=0.7, max_new_tokens=32, batch_size=6))
    for ep in eps:
        ids = torch.tensor([ep.ids])                                     # (1, T)
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)  # (T-1, V)
        again = logp.gather(-1, ids[0, 1:, None])[:, 0]                  # (T-1,)
        omega = torch.tensor(ep.mask[1:], dtype=torch.bool)
        recorded = torch.tensor(ep.logps[1:])
        assert torch.allclose(again[omega], recorded[omega], atol=2e-4), (again[omega] - recorded[omega]).abs().max()
        assert (recorded[~omega] == 0).all()


def test_scripted_episode_uses_the_same_bookkeeping(backbone):
    _, tok, _ = backbone
    task = tool_world.make_splits(seed=2, n_train=1, n_test=1)[0][0]
    ep = engine.scripted_episode(toy.toy_chat(tok), task, tool_world.oracle_replies(task))
    assert ep.reward == 1.0 and ep.steps == len(tool_world.oracle_calls(task)) + 1
    rendered = tok.decode(ep.ids)
    assert rendered.endswith("Task Completed<|im_end|>") and rendered.count("<tool_call>") == ep.tool_calls
    sampled = tok.decode([i for i, m in zip(ep.ids, ep.mask) if m])
    assert sampled.count("<|im_end|>") == ep.steps and "<tool_response>" not in sampled


def _conventions_shown(text: str, code: bool) -> tuple:
    """Which conventions a reference's text shows: (verify, commit) in a tool trace, (prefix, END) in a program."""
    if code:
        return "Answer:" in text, "'END'" in text
    return "verify_customer(" in text, "commit(" in text


@pytest.mark.parametrize("code", [False, True])
def test_reading_references_show_the_tasks_own_conventions_or_another_variants(backbone, code):
    _, tok, _ = backbone
    tasks = (code_world.make_code_splits(3, n_train=0, n_test=40)[1] if code else
             tool_world.make_splits(3, n_train=0, n_test=40)[1])
    table = code_world.JUDGES if code else tool_world.SHOPS                   # variant -> its pair of conventions
    same, other = toy.reading_references(tok, tasks, True, 0), toy.reading_references(tok, tasks, False, 0)
    assert set(same) == set(other) == {t.text for t in tasks}
    for t in tasks:
        assert _conventions_shown(tok.decode(same[t.text]), code) == tuple(table[t.variant])
        assert _conventions_shown(tok.decode(other[t.text]), code) != tuple(table[t.variant])


def test_reading_check_puts_each_tasks_reference_in_the_span(backbone, monkeypatch):
    model, tok, _ = backbone
    tasks = tool_world.make_splits(4, n_train=0, n_test=6)[1]
    seen = []
    real = toy.rollout

    def spy(*a, **kw):
        eps = real(*a, **kw)
        seen.append(eps)
        return eps
    monkeypatch.setattr(toy, "rollout", spy)
    rewards = toy.reading_check(model, tok, tasks, tool_world.ToolWorld, seed=0)
    assert set(rewards) == {"same variant", "other variant"} and len(seen) == 2
    for eps, same in zip(seen, (True, False)):
        refs = toy.reading_references(tok, tasks, same, 0)
        for ep in eps:
            ref, prompt = refs[ep.task.text], ep.ids[:ep.prompt_len]
            assert any(prompt[i:i + len(ref)] == ref for i in range(len(prompt) - len(ref) + 1))
        assert abs(rewards["same variant" if same else "other variant"] -
                   sum(e.reward for e in eps) / len(eps)) < 1e-9


def test_build_backbone_never_replaces_a_folder_that_is_not_a_backbone(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="mine"):
        toy.build_backbone(str(out), n_demos=20, steps=1, batch=4, hidden=32, log=lambda *_: None)
    assert (out / "notes.txt").read_text() == "keep me" and sorted(os.listdir(out)) == ["notes.txt"]
    with pytest.raises(ValueError, match="steps"):
        toy.build_backbone(str(tmp_path / "new"), steps=0, log=lambda *_: None)


@pytest.mark.parametrize("flag", ["--steps", "--n-eval"])
def test_toy_command_line_names_a_bad_flag(tmp_path, capsys, flag):
    with pytest.raises(SystemExit) as err:
        toy.main(["--out", str(tmp_path / "bb"), flag, "0"])
    assert err.value.code == 2 and f"{flag} must be at least 1, not 0" in capsys.readouterr().err
    assert not (tmp_path / "bb").exists()


# ------------------------------------------------------------------------------------------------------------
# The KV cache kept across turns (engine.Conversations) against generate on every whole conversation
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_cached_turns_give_the_ids_of_generating_each_whole_conversation(backbone, monkeypatch, temperature):
    """Multi-turn toy episodes (shared system prompt computed once, caches kept, padding squeezed out between turns):
    greedy ids equal the reference's; sampled ones too, from the same seed (the same warpers and draws); the
    recorded log-probs agree."""
    model, tok, _ = backbone
    tasks = tool_world.make_splits(0, n_train=24, n_test=0)[0]
    cfg = engine.SampleConfig(temperature=temperature, max_new_tokens=24, max_len=400, batch_size=10)
    chat = toy.toy_chat(tok, lambda: tool_world.ToolWorld(system_prompt=tool_world.TOY_SYSTEM_PROMPT, max_steps=6, tools=None))
    torch.manual_seed(0)
    got = engine.rollout(model, chat, tasks, cfg)
    torch.manual_seed(0)
    with monkeypatch.context() as m:
        m.setattr(engine, "generate_replies", lambda mdl, t, ctx, c, **_: bench.generate_whole(mdl, t, ctx, c))
        want = engine.rollout(model, chat, tasks, cfg)
    assert sum(e.steps for e in got) > 2 * len(tasks)                  # several turns: the caches were reused
    for a, b in zip(got, want):
        assert a.ids == b.ids and a.mask == b.mask
        assert max(abs(x - y) for x, y in zip(a.logps, b.logps)) < 1e-4


def test_the_shared_prefix_is_computed_once_and_turns_feed_only_new_tokens(backbone, monkeypatch):
    """Count the tokens the model is fed: the system prompt once per batch, then per turn what the turn added."""
    model, tok, _ = backbone
    tasks = tool_world.make_splits(0, n_train=8, n_test=0)[0]
    cfg = engine.SampleConfig(temperature=0.0, max_new_tokens=24, max_len=400, batch_size=8)
    chat = toy.toy_chat(tok, lambda: tool_world.ToolWorld(system_prompt=tool_world.TOY_SYSTEM_PROMPT, max_steps=6, tools=None))
    fed = []
    real = engine.Conversations.forward
    monkeypatch.setattr(engine.Conversations, "forward",
                        lambda self, ids=None, embeds=None: fed.append(int(self.mask[:, -ids.shape[1]:].sum()))
                        or real(self, ids, embeds))
    eps = engine.rollout(model, chat, tasks, cfg)
    prompts = [e.ids[:e.prompt_len] for e in eps]
    shared = next(i for i in range(min(map(len, prompts))) if len({p[i] for p in prompts}) > 1)
    assert shared > 10                                                  # the toy's system prompt
    # every real token fed once: the shared prefix once, each episode's other tokens once (its last not at all)
    assert sum(fed) == shared + sum(len(e.ids) - shared - 1 for e in eps)


def scripted_rollout(monkeypatch, replies, cfg, world):
    """engine.rollout on one toy task with `replies` in place of the model: (text, finished) in turn, the last one
    repeated. The shipped toy backbone's tokenizer renders it (its model is never called)."""
    tok = AutoTokenizer.from_pretrained(toy.SHIPPED)
    queue = list(replies)

    def scripted(model, tokenizer, contexts, cfg, conversations=None, keys=None, **_):
        text, finished = queue.pop(0) if len(queue) > 1 else queue[0]
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] * finished
        return [(ids, [0.0] * len(ids), finished) for _ in contexts]
    monkeypatch.setattr(engine, "generate_replies", scripted)
    monkeypatch.setattr(engine.models, "decoding_copy", lambda model: model)
    task = tool_world.make_splits(seed=0, n_train=1, n_test=1)[1][0]
    return engine.rollout(torch.nn.Linear(1, 1), toy.toy_chat(tok, world), [task], cfg)[0]


CALL = common.format_call("find_customer", {"name": "Ana"})


@pytest.mark.parametrize("replies, max_steps, max_len, end, steps", [
    ([(CALL, True)], 3, 4096, "step cap", 3),                          # a call every reply: the world's cap
    ([(CALL, True), (CALL, False)], 10, 4096, "token budget", 2),     # cut at --max-new-tokens, whatever it held
    ([(CALL, True)], 10, 400, "context full", None),                  # the next reply might not fit --max-len
    ([(CALL, True), (common.DONE_TEXT, True)], 10, 4096, "done", 2),
    ([("I cannot help.", True)], 10, 4096, "no call", 1)])
def test_each_episode_says_why_it_ended(monkeypatch, replies, max_steps, max_len, end, steps):
    world = lambda: tool_world.ToolWorld(system_prompt=tool_world.TOY_SYSTEM_PROMPT, tools=None,   # noqa: E731
                                         max_steps=max_steps)
    cfg = engine.SampleConfig(max_new_tokens=64, max_len=max_len, batch_size=1)
    ep = scripted_rollout(monkeypatch, replies, cfg, world)
    assert ep.end == end and end in common.ENDS
    assert ep.steps == steps if steps else ep.steps < max_steps and len(ep.ids) + 64 > max_len
    assert engine.Episode.from_record(ep.record(), ep.task).end == end          # kept with the base rollouts
