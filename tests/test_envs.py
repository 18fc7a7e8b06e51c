"""The toy world: checklist rewards on hand-worked episodes, a fuzzed step(), task files and traces."""
import copy
import json
import random

import pytest

from worlds import common, tool_world
from worlds.common import DONE_TEXT, format_call
from worlds.tool_world import SHOPS, Task, ToolWorld, load_tasks, oracle_calls


def hand_task(shop="cedar"):
    """A hand-written task: cancel account A10's K2 order (O002) and place it again. Two checklist items."""
    db = {"customers": {"C100": {"account": "A10", "tier": "gold"},
                        "C200": {"account": "A20", "tier": "bronze"}},
          "orders": {"O001": {"customer": "C100", "item": "K1", "qty": 2, "status": "open"},
                     "O002": {"customer": "C100", "item": "K2", "qty": 1, "status": "open"},
                     "O003": {"customer": "C200", "item": "K2", "qty": 5, "status": "held"}}}
    return Task("hand-0", shop, "reorder", f"Cancel an order and place it again: item K2, account A10. Shop: {shop}.",
                db, {"account": "A10", "item": "K2"},
                [["removed", "orders", "O002"], ["added", "orders", "C100", "K2", 1]])


def play(task, calls):
    env = ToolWorld()
    env.reset(task)
    for name, args in calls:
        env.step(format_call(name, args))
    env.step(DONE_TEXT)
    return env


def test_perfect_partial_harmful_rewards():
    t = hand_task("cedar")  # verification, no staging
    perfect = [("find_customer", {"account": "A10"}), ("verify_customer", {"customer_id": "C100"}),
               ("find_order", {"customer_id": "C100", "item": "K2"}), ("cancel_order", {"order_id": "O002"}),
               ("add_order", {"customer_id": "C100", "item": "K2", "qty": 1})]
    assert oracle_calls(t) == perfect
    assert play(t, perfect).reward() == 1.0
    assert play(t, perfect[:4]).reward() == 0.5                     # cancelled, never added: 1 of 2
    assert play(t, perfect[:1]).reward() == 0.0
    other = ("verify_customer", {"customer_id": "C200"})
    assert play(t, perfect + [("cancel_order", {"order_id": "O003"})]).reward() == 1.0   # refused: C200 unverified
    harmful = perfect + [other, ("cancel_order", {"order_id": "O003"})]    # also cancels A20's order
    assert play(t, harmful).reward() == 0.5                         # (2 − 1 collateral) / 2
    wrong_value = perfect[:4] + [("add_order", {"customer_id": "C100", "item": "K2", "qty": 3})]
    assert play(t, wrong_value).reward() == 0.0                     # (1 − 1 unasked order) / 2
    tier_change = perfect + [other, ("update_customer", {"customer_id": "C200", "field": "tier", "value": "gold"})]
    assert play(t, tier_change).reward() == 0.5


def test_commit_shop_stages_until_commit():
    t = hand_task("delta")  # staged, no verification
    calls = oracle_calls(t)
    assert calls[-1] == ("commit", {})
    assert play(t, calls[:-1]).reward() == 0.0                      # staged only
    assert play(t, calls).reward() == 1.0
    direct = play(hand_task("flint"), calls[:-1])                   # neither convention: written at once
    assert direct.reward() == 1.0
    assert [r for _, _, r in direct.trace] == [r for _, _, r in play(t, calls[:-1]).trace]   # staging is unseen


def test_over_applied_convention_aborts_and_rolls_back():
    """A tool the shop lacks (commit where nothing is staged, verify_customer where nobody is verified) ends the
    session and rolls its changes back: no convention is free to apply everywhere."""
    cedar = oracle_calls(hand_task("cedar"))                         # verify, no staging
    env = play(hand_task("cedar"), cedar + [("commit", {})])
    assert env.aborted and env.trace[-1][2] == tool_world.ABORTED.format("commit")
    assert env.reward() == 0.0 and env.db == hand_task("cedar").db  # the applied changes are gone
    res = env.step(format_call("cancel_order", {"order_id": "O002"}))
    assert res.done and env.db == hand_task("cedar").db             # nothing runs after an abort
    flint = ToolWorld()
    flint.reset(hand_task("flint"))                                  # neither convention
    res = flint.step(format_call(*cedar[0]) + format_call(*cedar[1]) + format_call(*cedar[2]))
    assert res.done and len(flint.trace) == 2                       # the call after the abort never ran
    assert play(hand_task("flint"), [c for c in cedar if c[0] != "verify_customer"]).reward() == 1.0


def test_verify_shop_refuses_changes_until_verified():
    t = hand_task("cedar")  # verification, no staging
    calls = oracle_calls(t)
    assert calls[1] == ("verify_customer", {"customer_id": "C100"})
    unverified = play(t, [c for c in calls if c[0] != "verify_customer"])
    assert unverified.reward() == 0.0
    assert [r for _, _, r in unverified.trace][2:] == ["Error: verify the customer first"] * 2
    assert play(t, calls).reward() == 1.0
    late = [calls[0], calls[2], calls[3], calls[1], calls[3], calls[4]]   # refused, verify, retry
    assert play(t, late).reward() == 1.0
    assert play(hand_task("delta"), calls + [("commit", {})]).reward() == 0.0   # verifying where not needed aborts


def test_oracle_solves_every_generated_task():
    train, test = tool_world.make_splits(seed=1, n_train=300, n_test=100)
    for t in train + test:
        assert play(t, oracle_calls(t)).reward() == 1.0, t.text


def test_splits_disjoint_and_seeded():
    a_train, a_test = tool_world.make_splits(seed=3, n_train=200, n_test=50)
    b_train, _ = tool_world.make_splits(seed=3, n_train=200, n_test=50)
    assert [t.text for t in a_train] == [t.text for t in b_train]
    assert not {t.text for t in a_train} & {t.text for t in a_test}
    assert {t.shop for t in a_train} == set(SHOPS) and len({t.schema for t in a_train}) >= 8


def _random_action(rng):
    names = [t["function"]["name"] for t in tool_world.TOOLS] + ["", "drop_table", "find_order "]
    junk = ["", "{", "}", "null", "[1,2]", '{"name": 3}', '{"name": "x", "arguments": []}', "<tool_call>",
            "</tool_call>", "Task Completed", "\x00", "😀", '{"name": "commit", "arguments": {"a": 1}}']
    values = [None, 0, -1, 10**30, 1.5, True, "", "C100", "O002", "O999", "A10", "K2", "gold", "qty", "status",
              "shipped", "9" * 50, [], {}, {"x": 1}, "tier", "held", "K5", "12", 3, 1]
    kind = rng.random()
    if kind < 0.6:
        keys = ["account", "customer_id", "order_id", "field", "value", "item", "qty", "extra"]
        args = {k: rng.choice(values) for k in rng.sample(keys, rng.randint(0, 4))}
        call = format_call(rng.choice(names), args)
        if rng.random() < 0.2:
            call = call[: rng.randint(0, len(call))]               # truncated
        return call * rng.randint(1, 2)
    if kind < 0.9:
        return "".join(rng.choice(junk) for _ in range(rng.randint(1, 4)))
    return "".join(chr(rng.randint(0, 0x2FFF)) for _ in range(rng.randint(0, 40)))


def test_fuzz_step_never_raises_and_state_stays_consistent():
    rng = random.Random(0)
    env, t = ToolWorld(max_steps=10**9), hand_task("alder")
    env.reset(t)
    for i in range(12000):
        if i % 400 == 0:
            env.reset(hand_task(rng.choice(sorted(SHOPS))))
        res = env.step(_random_action(rng))
        assert isinstance(res.observations, list) and all(isinstance(o, str) for o in res.observations)
        r = env.reward()
        assert 0.0 <= r <= 1.0
        for o in env.db["orders"].values():                         # invariants of the database
            assert o["customer"] in env.db["customers"]
            assert isinstance(o["qty"], int) and 1 <= o["qty"] <= 99
            assert o["status"] in tool_world.STATUSES and o["item"] in tool_world.ITEMS
        for c in env.db["customers"].values():
            assert c["tier"] in tool_world.TIERS and c["account"].startswith("A")
    assert env.task.db == hand_task(env.task.shop).db               # the task's initial state is never touched


def test_tasks_jsonl_round_trip_and_errors(tmp_path):
    train, _ = tool_world.make_splits(seed=0, n_train=20, n_test=1)
    path = tmp_path / "tasks.jsonl"
    tool_world.save_tasks(train, str(path))
    assert [t.__dict__ for t in load_tasks(str(path))] == [t.__dict__ for t in train]
    lines = path.read_text().splitlines()
    bad = copy.deepcopy(json.loads(lines[2]))
    del bad["checklist"]
    for n, line in [(2, "{not json"), (3, json.dumps(bad)), (1, json.dumps({**json.loads(lines[0]), "shop": "zzz"}))]:
        broken = list(lines)
        broken[n - 1] = line
        path.write_text("\n".join(broken) + "\n")
        with pytest.raises(ValueError, match=f"tasks.jsonl:{n}:"):
            load_tasks(str(path))


def test_lite_trace_format():
    env = play(hand_task("delta"), [("find_customer", {"account": "A10"}), ("nope", {})])
    assert common.lite_trace(env.trace) == ('1. find_customer(account="A10") -> C100\n'
                                          "2. nope() -> Error: unknown tool 'nope'")


def test_the_learner_reads_only_what_the_environment_interface_declares():
    """engine.py (Chat, rollout), lopd.py, baselines.py and train.py read an environment only through
    common.Environment's names: every `env.X` they use is declared there (so a new world knows what to provide), and
    none is probed with getattr (lopd.py reaches an environment only through engine.Chat)."""
    import os
    import re

    from worlds import common
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    reads = r"(?:\benv|\bprobe|make_env\(\)|envs_\[0\]|env_factory\(args\)\(\))\.(\w+)"   # probe: Chat's
    declared = set(dir(common.Environment)) | {"trace"}                     # trace: set by __init__
    seen = set()
    for name in ("engine.py", "lopd.py", "baselines.py", "train.py"):
        text = open(os.path.join(root, name), encoding="utf-8").read()
        used = set(re.findall(reads, text))
        assert not used - declared, (name, used - declared)
        assert not re.search(r"(?:getattr|hasattr)\((?:env|probe|make_env\(\))\b", text), name
        seen |= used
    assert {"reset", "step", "reward", "tools", "framing"} <= seen          # the pattern finds the reads
    assert set(re.findall(reads, "env.reset(t); make_env().no_such_hook")) - declared == {"no_such_hook"}


def test_env_values_name_a_shipped_world_or_a_users_class(tmp_path):
    from worlds import common, tool_world
    assert common.environment_class("tools") is tool_world.ToolWorld
    assert common.environment_class("code").__name__ == "CodeWorld"
    mine = tmp_path / "mine.py"
    mine.write_text("from worlds import common\n\nclass Mine(common.Environment):\n    def reset(self, task):\n        return []\n\n"
                    "    def step(self, reply):\n        return common.StepResult([], True)\n\n"
                    "    def reward(self):\n        return 0.0\n\nclass Empty(common.Environment):\n    pass\n\n"
                    "class NotOne:\n    pass\n")
    assert common.environment_class(f"{mine}:Mine").__name__ == "Mine"
    for bad, said in (("bogus", "expected tools or code"), (f"{mine}:NotOne", "no class 'NotOne'"),
                      (f"{mine}:Empty", "does not implement reset, step, reward"),
                      ("nofile.py:X", "no such file"), ("no_such_module:X", "cannot import")):
        with pytest.raises(ValueError, match=said):
            common.environment_class(bad)


# ------------------------------------------------------------------------------------------------------------
# The call parsers: what the regexes found, in one pass
# ------------------------------------------------------------------------------------------------------------
def test_tagged_blocks_and_extract_code_find_what_the_regexes_found():
    """Brute force against the regexes the parsers used before (quadratic on unclosed tags), on random replies of
    tags, fences and text."""
    import re

    from worlds import code_world
    tool_re = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
    fence_re = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)

    def old_extract(reply):
        reply = re.sub(r"<think>.*?</think>", "", reply, flags=re.S)
        blocks = fence_re.findall(reply)
        return blocks[-1] if blocks else reply
    rng = random.Random(0)
    tags = ["<tool_call>", "</tool_call>", "x", "{}", "\n"]
    fences = ["```", "```python\n", "```py\n", "```py \n  \n", "```js\n", "````\n", "<think>", "</think>", "x = 1\n",
              "\n", " ", "`", "python", "\t\n"]
    for _ in range(5000):
        text = "".join(rng.choice(tags) for _ in range(rng.randrange(12)))
        assert common.tagged_blocks(text, "<tool_call>", "</tool_call>") == tool_re.findall(text), text
        reply = "".join(rng.choice(fences) for _ in range(rng.randrange(12)))
        assert code_world.extract_code(reply) == old_extract(reply), reply


@pytest.mark.parametrize("tag", ["<tool_call>", "<function_calls>", "```python\n", "<think>", "{"])
def test_a_reply_of_100k_unclosed_tags_parses_in_well_under_a_second(tag):
    """A degenerate sample at a long budget: 100k unclosed tags (a megabyte or more). The regexes took over 600 s."""
    import time

    from worlds import code_world
    reply = tag * 100_000
    t0 = time.perf_counter()
    calls = common.parse_tool_calls(reply)
    code_world.extract_code(reply)
    assert time.perf_counter() - t0 < 1.0
    assert all(name is None for name, _ in calls)                   # unterminated or malformed: error observations


@pytest.mark.parametrize("reply", [
    '<tool_call>{"name": "x", "arguments": ' + "[" * 100_000 + "}</tool_call>",          # nested past the recursion
    '<tool_call>{"name": "x", "arguments": {"a": ' + "1" * 5000 + "}}</tool_call>",    # past int's digit limit
    '<tool_call>{"name": "x", "arguments": "' + "[" * 100_000 + '"}</tool_call>',       # the same, as a JSON string
    '{"name": "x", "parameters": {"a": ' + "[" * 100_000 + "}}",
    "<function_calls>f(a=" + "[" * 1000 + ")</function_calls>",
    "<function_calls>f(a=" + "1" * 5000 + ")</function_calls>",
])
def test_a_call_the_parsers_cannot_read_is_an_error_observation(reply):
    (name, why), = common.parse_tool_calls(reply)
    assert name is None and why.startswith("Error")
    env = ToolWorld()
    env.reset(hand_task())
    assert env.step(reply).errors == 1                              # and the world's step says so, no exception
