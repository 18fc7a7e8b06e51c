"""Everything that reads untrusted text is total (STYLE.md): the tool-call parsers of worlds/common.py and ACEBench's
call lists, the engine's count of a step's calls, the reads of a worker's answer, and every world's step and
reward return a value, an error observation or a scored failure for whatever a model writes, never an exception.

Two kinds of test. Property-based ones (hypothesis) draw replies from random text and from near-valid calls in each
format (Qwen's <tool_call>{json}</tool_call>, Llama's bare JSON, Olmo's <function_calls>name(args)</function_calls>,
ACEBench's [name(key=value)]) whose values are odd literals: bytes, sets, tuples, complex numbers, dicts with
unhashable or non-string keys, brackets nested 3,000 deep, integers past the digit limit, NaN and Infinity, lone
surrogates, and tags left open. Named regression tests keep each failure found on main.

The rule the parsers are held to: a call's arguments are a JSON object (string keys; values that are strings of
Unicode, finite numbers, booleans, null, lists and objects, nested at most common.MAX_DEPTH deep), or the call is an
error observation. An observation is text that UTF-8 (and so a tokenizer) can carry.

Run: python -m pytest tests/test_total.py -q    (BFCL's worlds skip without bfcl-eval, ACEBench's without a clone)
"""
import glob
import json
import os
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import engine  # noqa: E402
from worlds import acebench, common, sandbox, tool_world  # noqa: E402
from worlds import envscaler as es  # noqa: E402

# Every health check off: the odd literals (3,000-deep brackets, 5,000-digit numbers) are big and slow to draw on
# purpose. No deadline: a world's worker takes its own time to start.
QUIET = dict(deadline=None, suppress_health_check=list(HealthCheck))
FEW = settings(max_examples=25, **QUIET)       # worlds with a worker process per episode
SOME = settings(max_examples=100, **QUIET)     # worlds in this process
MANY = settings(max_examples=300, **QUIET)     # the parsers alone
DEEP = "[" * 3000 + "]" * 3000

# ----------------------------------------------------------------------------------------------------------------
# Replies: random text, and near-valid calls in each format with odd values
# ----------------------------------------------------------------------------------------------------------------
ODD_PYTHON = ["b''", "b'x'", "{1, 2}", "set()", "(1, 2)", "()", "1j", "-2.5j", "{[1]: 2}", "{1: 2}", "{1: 2, 'a': 3}",
              "{(1, 2): 3}", "{None: 1}", "{'k': {1j}}", "[b'', (), {2}]", DEEP, "[" * 40 + "]" * 40, "10**10000",
              "0x" + "f" * 5000, "1" * 5000, "1e999", "-1e999", "float('nan')", "NaN", "'\\ud800'", "'x\\udfff'", "...",
              "__import__('os')", "lambda: 0", "'é中🙂'", "None", "True", "'ok'", "7", "[1, {'a': None}]"]
ODD_JSON = ["NaN", "Infinity", "-Infinity", '"\\ud800"', '"x\\udc00"', "1" * 5000, DEEP, "[" * 40 + "]" * 40, "1e999",
            '"é中🙂"', "null", "{}", '{"a": {"a": []}}', "[", "{", '"unclosed', "[1, 2", "true", "-0", "1e-999"]
FRAGMENTS = ["<tool_call>", "</tool_call>", "<function_calls>", "</function_calls>", common.PYTHON_TAG, "<think>",
             "</think>", "{", "}", "[", "]", "(", ")", '"', "'", ",", ":", "=", ";", "\n", " ", '"name"', '"arguments"',
             '"parameters"', "f", "x", "find_customer", "borrow", "**", "\\", "\ud800", "\x00", "Task Completed"]

_hashable = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4) | st.binary(max_size=3)
             | st.complex_numbers(max_magnitude=1e6))
_python_values = st.recursive(_hashable, lambda inner: (st.lists(inner, max_size=3) | st.tuples(inner, inner)
                                                        | st.dictionaries(_hashable, inner, max_size=3)
                                                        | st.frozensets(_hashable, max_size=3).map(set)),
                              max_leaves=8)
_json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
                            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                        max_size=3), max_leaves=8)
python_literal = _python_values.map(repr) | st.sampled_from(ODD_PYTHON)
json_literal = _json_values.map(json.dumps) | st.sampled_from(ODD_JSON)
names = st.sampled_from(["find_customer", "borrow", "echo", "noop", "send_message", "ls", "turn_on_wifi"])
keys = (st.sampled_from(["account", "x", "book_id", "user", "a"])
        | st.from_regex(r"[a-z_][a-z0-9_]{0,5}", fullmatch=True))
ending = st.sampled_from(["close", "close", "open"])    # a tagged call left unclosed a third of the time


@st.composite
def qwen_reply(draw):
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call>, the arguments an object or a JSON string of one."""
    pairs = draw(st.lists(st.tuples(keys, json_literal), max_size=3))
    body = "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in pairs) + "}"
    body = json.dumps(body) if draw(st.booleans()) else body
    call = f'{{"name": {json.dumps(draw(names))}, "arguments": {body}}}'
    return "<tool_call>\n" + call + ("\n</tool_call>" if draw(ending) == "close" else "")


@st.composite
def llama_reply(draw):
    """Llama's bare JSON call(s), joined by ';', optionally after <|python_tag|>."""
    calls = []
    for _ in range(draw(st.integers(1, 2))):
        pairs = draw(st.lists(st.tuples(keys, json_literal), max_size=3))
        args = "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in pairs) + "}"
        calls.append(f'{{"name": {json.dumps(draw(names))}, "parameters": {args}}}')
    return draw(st.sampled_from(["", common.PYTHON_TAG])) + "; ".join(calls)


def _python_call(draw) -> str:
    pairs = draw(st.lists(st.tuples(keys, python_literal), max_size=3))
    return f"{draw(names)}(" + ", ".join(f"{k}={v}" for k, v in pairs) + ")"


@st.composite
def olmo_reply(draw):
    """<function_calls>name(key=literal, ...)</function_calls>, one call a line."""
    lines = "\n".join(_python_call(draw) for _ in range(draw(st.integers(1, 2))))
    return "<function_calls>\n" + lines + ("\n</function_calls>" if draw(ending) == "close" else "")


@st.composite
def call_list_reply(draw):
    """ACEBench's [name(key=literal), ...], or one bare call."""
    calls = [_python_call(draw) for _ in range(draw(st.integers(1, 2)))]
    return "[" + ", ".join(calls) + "]" if draw(st.booleans()) else calls[0]


fragments = st.lists(st.sampled_from(FRAGMENTS) | python_literal | json_literal, max_size=12).map("".join)
structured = qwen_reply() | llama_reply() | olmo_reply() | call_list_reply()
replies = st.text(max_size=200) | structured | fragments | st.tuples(st.text(max_size=20), structured).map("".join)


# ----------------------------------------------------------------------------------------------------------------
# What every answer must be
# ----------------------------------------------------------------------------------------------------------------
def assert_json_object(args):
    """args is a JSON object exactly: JSON writes it (strict: no NaN, no Infinity) in UTF-8 and reads it back equal
    (a tuple, or a key that is no string, would come back changed)."""
    assert isinstance(args, dict)
    text = json.dumps(args, allow_nan=False, ensure_ascii=False)
    text.encode("utf-8")
    assert json.loads(text) == args


def assert_calls(calls):
    """A parser's answer: a list of (name, JSON arguments) or (None, an error message)."""
    assert isinstance(calls, list)
    for name, args in calls:
        if name is None:
            assert isinstance(args, str) and args.startswith("Error")
            args.encode("utf-8")
        else:
            assert isinstance(name, str)
            name.encode("utf-8")
            assert_json_object(args)


def assert_step(result):
    """A step's answer: observations (and the next user message) a tokenizer can read."""
    assert isinstance(result, common.StepResult) and isinstance(result.done, bool)
    assert isinstance(result.observations, list) and all(isinstance(o, str) for o in result.observations)
    for text in result.observations + ([] if result.user is None else [result.user]):
        text.encode("utf-8")                              # a lone surrogate here: the tokenizer raises TypeError


def play(env, task, texts) -> float:
    """reset, then step each reply until the episode ends (counted as engine.rollout counts them), then reward."""
    env.reset(task)
    ep = engine.Episode(task)
    for reply in texts:
        n_before = len(env.trace)
        result = engine._count_step(ep, env, env.step(reply), n_before, 1)
        assert_step(result)
        if result.done:
            break
    reward = env.reward()
    assert isinstance(reward, float) and 0.0 <= reward <= 1.0
    return reward


# ----------------------------------------------------------------------------------------------------------------
# The parsers
# ----------------------------------------------------------------------------------------------------------------
JSON_SPEC = {"start_anchor": "<|im_start|>assistant\n",
             "fields": {"content": {}, "tool_calls": {"open": "<tool_call>", "close": "</tool_call>", "content": "json",
                                                      "repeats": True}}}
CALL_LIST_SPEC = {"start_anchor": "<|im_start|>assistant\n",
                  "fields": {"content": {}, "tool_calls": {"open": "<function_calls>", "close": "</function_calls>",
                                                           "content": "python-call-list"}}}


@MANY
@given(replies)
def test_every_parser_answers_calls_or_errors_for_any_reply(reply):
    for parse in (common.parse_qwen_calls, common.parse_llama_calls, common.parse_olmo_calls, common.parse_tool_calls):
        assert_calls(parse(reply))
    for spec in (JSON_SPEC, CALL_LIST_SPEC):              # the tokenizer's own parser, then the formats
        assert_calls(common.parse_tool_calls(reply, spec))
    for calls in (common.parse_call_list(reply), acebench.decode(reply)):
        assert calls is None or assert_calls(calls) is None


@MANY
@given(st.lists(olmo_reply() | qwen_reply() | st.text(max_size=30), min_size=1, max_size=3).map("\n".join))
def test_replies_of_several_calls_answer_calls_or_errors(reply):
    assert_calls(common.parse_tool_calls(reply))


# ----------------------------------------------------------------------------------------------------------------
# Regressions found on main
# ----------------------------------------------------------------------------------------------------------------
def hand_task():
    return tool_world.make_splits(0, n_train=1, n_test=0)[0][0]


def test_an_olmo_dict_with_a_list_key_is_an_error_observation():
    """ast.literal_eval raised TypeError (unhashable list) out of parse_olmo_calls, which every family's replies
    reach when they hold no <tool_call>."""
    reply = "<function_calls>noop(x={[1]: 2})</function_calls>"
    (name, error), = common.parse_tool_calls(reply)
    assert name is None and error.startswith("Error")
    env = tool_world.ToolWorld()
    env.reset(hand_task())
    assert env.step(reply).errors == 1


NOT_JSON = {"bytes": "[b'']", "tuple": "[(1, 2)]", "set": "{'k': {1}}", "complex": "[1j]",
            "mixed keys": "{1: 2, 'a': 3}", "an int key": "{1: 2}", "infinity": "[1e999]",
            "an int past the digit limit": "[0x" + "f" * 5000 + "]", "a lone surrogate": "'\\ud800'",
            "nesting past MAX_DEPTH": "[" * 40 + "]" * 40}


@pytest.mark.parametrize("value", NOT_JSON.values(), ids=NOT_JSON.keys())
@pytest.mark.parametrize("form", ["<function_calls>find_customer(account={})</function_calls>",
                                  "[find_customer(account={})]"])
def test_a_value_that_is_no_json_is_an_error_observation(form, value):
    """Literal values that JSON cannot carry, or would carry changed (a tuple as a list, the key 1 as "1"), nested
    inside a list or an object where the top-level check did not look: the call is an error, not a call."""
    reply = form.format(value)
    parse = common.parse_call_list if reply.startswith("[") else common.parse_tool_calls
    (name, error), = parse(reply)
    assert name is None and error.startswith("Error"), (name, error)


JSON_NOT_JSON = {"NaN": "NaN", "infinity": "-Infinity", "a lone surrogate": '"\\ud800"',
                 "nesting past MAX_DEPTH": "[" * 40 + "]" * 40}


@pytest.mark.parametrize("value", JSON_NOT_JSON.values(), ids=JSON_NOT_JSON.keys())
def test_json_that_python_reads_but_json_forbids_is_an_error_observation(value):
    """Python's json reads NaN, Infinity and lone surrogate escapes; none is a JSON value a tool schema allows, and a
    lone surrogate echoed into an observation makes the tokenizer raise."""
    for reply in (f'<tool_call>{{"name": "find_customer", "arguments": {{"account": {value}}}}}</tool_call>',
                  f'{{"name": "find_customer", "parameters": {{"account": {value}}}}}'):
        (name, error), = common.parse_tool_calls(reply)
        assert name is None and error.startswith("Error"), (reply, name, error)


ONE_CALL_SPEC = {"start_anchor": "<|im_start|>assistant\n",
                 "fields": {"content": {}, "tool_calls": {"open": "<tool_call>", "close": "</tool_call>",
                                                          "content": "json"}}}


def test_a_tokenizers_parser_that_finds_one_unlisted_value_answers_one_call():
    """A response_template without "repeats" gives the region's JSON as it is, not in a list: a number raised
    TypeError (iterated), and a call object was read key by key as two malformed calls."""
    assert common.parse_tool_calls("<tool_call>5</tool_call>", ONE_CALL_SPEC)[0][0] is None
    assert common.parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}</tool_call>', ONE_CALL_SPEC) == \
        [("f", {})]


class TraceOnly:
    """An environment whose trace holds what a world of the user's own might put there."""
    def __init__(self, trace):
        self.trace = trace


ODD_ARGS = {"bytes": ({"a": b"x"}, 1), "tuple": ({"a": (1, 2)}, 1), "set": ({"a": {1, 2}}, 1),
            "complex": ({"a": 1j}, 1), "mixed keys": ({"a": {1: 2, "b": 3}}, 1),
            "an int past the digit limit": ({"a": 1 << 20000}, 0),
            "nested 900 deep": ({"a": json.loads("[" * 900 + "]" * 900)}, 1)}


@pytest.mark.parametrize("args, repeats", ODD_ARGS.values(), ids=ODD_ARGS.keys())
def test_the_engines_count_of_repeated_calls_takes_any_arguments(args, repeats):
    """engine._count_step keyed each call by json.dumps(args, sort_keys=True), which raised TypeError on bytes, sets,
    complex numbers and mixed-type keys, and ValueError on an int past the digit limit. A world's trace is the
    world's to fill, so the key must take anything; the same call twice still counts as a repeat where it can be
    written at all."""
    ep = engine.Episode(hand_task())
    env = TraceOnly([("f", args, "r"), ("f", args, "r")])
    result = engine._count_step(ep, env, common.StepResult(["r", "r"], False, 2, 0), 0, 1)
    assert result.n_calls == 2 and ep.repeated_calls == repeats


@pytest.mark.parametrize("depth", [3000, common.MAX_DEPTH + 1])
def test_a_deep_list_literal_is_an_error_observation_in_every_format(depth):
    """3,000 deep, each format's parser stops at its own limit (ast's parenthesis limit, json's recursion); one past
    MAX_DEPTH, each parses, and the rule refuses it. Either way the call is an error, the world's step goes on, and
    the engine's count takes it."""
    deep = "[" * depth + "]" * depth
    forms = [f"<function_calls>find_customer(account={deep})</function_calls>",
             f'<tool_call>{{"name": "find_customer", "arguments": {{"account": {deep}}}}}</tool_call>',
             f'{{"name": "find_customer", "parameters": {{"account": {deep}}}}}']
    for reply in forms:
        assert [n for n, _ in common.parse_tool_calls(reply)] == [None], reply[:60]
        play(tool_world.ToolWorld(), hand_task(), [reply, common.DONE_TEXT])
    calls = common.parse_call_list(f"[find_customer(account={deep})]")
    assert calls is None or [n for n, _ in calls] == [None]            # no call list (prose), or an error


SURROGATES = {"in an argument": ("find_customer", '{"account": "A\\ud800"}'), "in a name": ("find\\udfff", "{}")}


@pytest.mark.parametrize("name, args", SURROGATES.values(), ids=SURROGATES.keys())
def test_a_lone_surrogate_never_reaches_the_tokenizer(name, args):
    """A JSON escape of half a surrogate pair in an argument or a name came back in the tool world's observation
    ("Error: no account A\\ud800", "Error: unknown tool ..."), and the tokenizer raised TypeError on it: the whole
    rollout stopped."""
    from transformers import AutoTokenizer

    from worlds import toy_backbone as toy
    chat = engine.Chat(AutoTokenizer.from_pretrained(toy.SHIPPED), tool_world.ToolWorld)
    reply = f'<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'
    ep = engine.scripted_episode(chat, hand_task(), [reply, common.DONE_TEXT])
    assert ep.errors == 1 and ep.done


# ----------------------------------------------------------------------------------------------------------------
# The worlds: any reply, a few steps, a reward in [0, 1]
# ----------------------------------------------------------------------------------------------------------------
episodes = st.lists(replies, min_size=1, max_size=4)


@SOME
@given(episodes)
def test_the_tool_world_answers_any_reply(texts):
    play(tool_world.ToolWorld(), hand_task(), texts)


def decodable(text: str) -> str:
    """What a tokenizer's decode can give: valid Unicode (a byte sequence it cannot decode comes back as U+FFFD)."""
    return text.encode("utf-8", "replace").decode("utf-8")


@FEW
@given(st.lists(st.sampled_from(["```python\n", "```\n", "```", "\n"]) | replies, max_size=4).map("".join))
def test_the_code_world_answers_any_reply(text):
    """One program per reply, run in the sandbox; the reply as decoded text (sandbox.run_sandboxed writes the program
    to a file as UTF-8, so a lone surrogate, which no decoded reply holds, is outside what it takes)."""
    from worlds import code_world
    task = code_world.make_code_splits(0, n_train=1, n_test=0)[0][0]
    play(code_world.CodeWorld(), task, [decodable(text)])


ECHO = '''
class Echo:
    def __init__(self, config):
        self.seen = []

    def echo(self, **kw):
        self.seen.append(kw)
        return repr(kw)

    def ghost(self):
        return "half a pair: " + chr(0xD800)
'''


@pytest.fixture(scope="module")
def echo_task():
    """An EnvScaler scenario whose tools echo their arguments (echo) and answer half a surrogate pair (ghost)."""
    tool = lambda name, props: {"type": "function", "function": {"name": name, "description": name,   # noqa: E731
                                                                 "parameters": {"type": "object", "properties": props}}}
    env = {"env_id": "echo", "env_class_code": ECHO, "environment_introduction": "", "constraints_rules": [],
           "tools": [tool("echo", {"x": {}}), tool("ghost", {})]}
    check = {"check_item": "one echo", "check_func": "def check_func(s):\n    return len(s['seen']) == 1"}
    scenario = {"task_id": "echo", "env_id": "echo", "env_class_name": "Echo", "task": "Echo something.",
                "init_config": {}, "checklist_with_func": [check]}
    return es.EnvScalerTask("echo", "Echo something.", "echo", "echo", scenario, env)


@pytest.fixture(scope="module")
def scaler():
    """One EnvScaler world for the module's episodes (each reset starts a fresh worker)."""
    env = es.EnvScalerWorld(limits=sandbox.SandboxLimits(wall_s=5.0, cpu_s=10, memory_mb=512, output_kb=256))
    yield env
    env.close()


NOT_SENT = {"bytes": "[b'']", "set": "{'k': {1}}", "complex": "[1j]", "mixed keys": "{1: 2, 'a': 3}",
            "tuple": "[(1, 2)]"}


@pytest.mark.parametrize("value", NOT_SENT.values(), ids=NOT_SENT.keys())
def test_envscaler_is_never_sent_arguments_json_cannot_carry(scaler, echo_task, value):
    """The worker's request is json.dumps'd: bytes, sets and complex numbers raised TypeError out of step, and mixed
    keys and tuples reached the environment changed. Each is an error observation; the episode goes on and is
    scored."""
    env = scaler
    env.reset(echo_task)
    result = env.step(f"<function_calls>echo(x={value})</function_calls>")
    assert result.errors == 1 and not result.done and env.trace == []
    assert env.step('<tool_call>{"name": "echo", "arguments": {"x": 1}}</tool_call>').observations == ["{'x': 1}"]
    assert env.step(common.DONE_TEXT).done and env.reward() == 1.0


def test_a_workers_answer_with_a_lone_surrogate_is_read_as_text(scaler, echo_task):
    """The environment's code answers half a surrogate pair; JSON carries it escaped, and read back it would reach the
    tokenizer. The observation keeps the text, with the half pair replaced."""
    scaler.reset(echo_task)
    result = scaler.step('<tool_call>{"name": "ghost", "arguments": {}}</tool_call>')
    assert_step(result)
    assert result.observations[0].startswith("half a pair: ") and scaler.reward() == 0.0


@FEW
@given(episodes)
def test_envscaler_answers_any_reply(scaler, echo_task, texts):
    play(scaler, echo_task, texts)


# -- BFCL (the optional tier: pip install --no-deps bfcl-eval) ---------------------------------------------------
@pytest.fixture(scope="module")
def bfcl():
    """worlds.bfcl and a task of each kind: (module, a multi-turn task, a single-turn task)."""
    pytest.importorskip("bfcl_eval")
    from worlds import bfcl
    return bfcl, bfcl.load_tasks(("base",))[0], bfcl.load_single_turn(("simple",))[0]


@FEW
@given(episodes)
def test_bfcl_multi_turn_answers_any_reply(bfcl, texts):
    module, task, _ = bfcl
    play(module.BFCLWorld(), task, texts)


@SOME
@given(replies)
def test_bfcl_single_turn_answers_any_reply(bfcl, reply):
    module, _, task = bfcl
    play(module.BFCLSingleWorld(), task, [reply])


# -- ACEBench (a clone beside the repository, as tests/test_acebench.py finds it) ----------------------------------
@pytest.fixture(scope="module")
def ace_tasks():
    candidates = [os.environ.get("ACEBENCH", ""), os.path.join(ROOT, "..", "ACEBench"),
                  *sorted(glob.glob(os.path.join(ROOT, "..", "*", "acebench")))]
    root = next((os.path.abspath(p) for p in candidates
                 if os.path.isfile(os.path.join(p, "data_all", "data_en", "data_agent_multi_step.json"))), None)
    if root is None:
        pytest.skip("ACEBench tier: no clone of ACEBench ($ACEBENCH, or beside the repository)")
    tasks = acebench.load_tasks(root)
    return [next(t for t in tasks if t.variant == regime) for regime in ("multi_step", "multi_turn")]


@pytest.fixture(scope="module")
def ace():
    """One ACEBench world for the module's episodes, its user simulator one that never ends the dialogue."""
    env = acebench.AceBenchWorld(user=lambda messages: "Please go on.", max_messages=8)
    yield env
    env.close()


@FEW
@given(episodes, st.booleans())
def test_acebench_answers_any_reply(ace, ace_tasks, texts, multi_turn):
    play(ace, ace_tasks[int(multi_turn)], texts)
