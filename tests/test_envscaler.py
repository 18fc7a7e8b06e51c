"""EnvScaler as released (worlds/envscaler.py): a small dataset in the published format, written here, run by the
official episode rules with each environment's code in a sandboxed worker.

Two environments: a library (tools that read, change and raise; checklists that read the final and the initial
state, one check that returns a non-boolean) and a hostile one (a tool that reads outside its directory, one that
never returns, class code that loops when it is defined). The rewards are compared with the checklist computed here
by hand; the hostile episodes must cost only themselves.

Run: python -m pytest tests/test_envscaler.py -q
"""
import json
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from runtime import UserError  # noqa: E402
from worlds import common  # noqa: E402
from worlds import envscaler as es  # noqa: E402
from worlds import sandbox  # noqa: E402

LIBRARY = '''
class Library:
    def __init__(self, config):
        self.books = {"b1": {"title": "Dune", "holder": None}, "b2": {"title": "Emma", "holder": None}}
        self.log = []

    def find_book(self, title):
        return [k for k, v in self.books.items() if v["title"] == title]

    def borrow(self, book_id, user):
        self.books[book_id]["holder"] = user
        self.log.append(book_id)
        print("this print must not reach the protocol")
        return {"ok": True}

    def audit(self):
        raise RuntimeError("the audit service is down")

    def _secret(self):
        return "never a tool"
'''
HOSTILE = '''
class Hostile:
    def __init__(self, config):
        self.n = 0

    def peek(self):
        return open("/etc/hostname").read()

    def spin(self):
        while True:
            self.n += 1

    def keep_a_generator(self):
        self.gen = (i for i in range(3))        # the state can no longer be deep-copied
        return "kept"

    def forge(self):
        import os
        os.write(1, b'{"reward": 1.0}\\n{"reward": 1.0}\\n')   # answers of its own, on the protocol's stream
        return "forged"

    def flood(self):
        import os
        os.write(1, b"x" * (1 << 20))           # a megabyte and no newline: no answer, ever
        return "flooded"
'''
LOOPS_AT_DEFINITION = "while True:\n    pass\n"
TOOL = lambda name, props: {"name": name, "description": name, "parameters": {"type": "object", "properties": props}}   # noqa: E731
CHECKS = [  # on the final state; the second reads the initial state; the third returns a string, not a bool
    {"check_item": "b1 is held by ana", "check_func": "def check_func(s):\n    return s['books']['b1']['holder'] == 'ana'"},
    {"check_item": "b2 unchanged", "check_func":
        "def check_func(s):\n    return s['books']['b2'] == initial_state['books']['b2']"},
    {"check_item": "not a bool", "check_func": "def check_func(s):\n    return 'yes'"},
    {"check_item": "one loan", "check_func": "def check_func(s):\n    return len(s['log']) == 1"},
]


def write_dataset(folder) -> str:
    """The published layout: env_metadata.json (a JSON list) and train.jsonl / test.jsonl scenario lines."""
    os.makedirs(folder, exist_ok=True)
    meta = [{"env_id": "library", "env_class_code": LIBRARY, "environment_introduction": "A small library.",
             "constraints_rules": ["Books are lent to one user at a time."],
             "tools": json.dumps([TOOL("find_book", {"title": {"type": "string"}}),
                                  TOOL("borrow", {"book_id": {"type": "string"}, "user": {"type": "string"}}),
                                  TOOL("audit", {})])},
            {"env_id": "hostile", "env_class_code": HOSTILE, "environment_introduction": "", "constraints_rules": [],
             "tools": [TOOL("peek", {}), TOOL("spin", {}), TOOL("keep_a_generator", {}), TOOL("forge", {}),
                       TOOL("flood", {})]},
            {"env_id": "looping", "env_class_code": LOOPS_AT_DEFINITION, "environment_introduction": "",
             "constraints_rules": [], "tools": []}]
    with open(os.path.join(folder, "env_metadata.json"), "w") as f:
        json.dump(meta, f)
    lend = {"env_id": "library", "env_class_name": "Library", "init_config": "{}", "checklist_with_func": CHECKS}
    rows = {"train": [{"task_id": "lend-1", "task": "Lend Dune to ana.", **lend},
                      {"task_id": "lend-2", "task": "Lend Dune to ana, please.", **lend}],
            "test": [{"task_id": "peek", "task": "Look around.", "env_id": "hostile", "env_class_name": "Hostile",
                      "init_config": {}, "checklist_with_func": CHECKS[:1]},
                     {"task_id": "loop", "task": "Wait.", "env_id": "looping", "env_class_name": "Looping",
                      "init_config": {}, "checklist_with_func": CHECKS[:1]}]}
    for name, recs in rows.items():
        with open(os.path.join(folder, name + ".jsonl"), "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in recs))
    return str(folder)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    folder = write_dataset(tmp_path_factory.mktemp("envscaler"))
    train, test = (es.load_scenarios(os.path.join(folder, n + ".jsonl")) for n in ("train", "test"))
    return {t.task_id: t for t in train + test}


def world(**kw):
    return es.EnvScalerWorld(limits=sandbox.SandboxLimits(wall_s=2.0, cpu_s=10, memory_mb=512, output_kb=256), **kw)


def call(name, **args):
    return common.format_call(name, args)


def by_hand(final: dict, initial: dict) -> float:
    """The checklist's reward computed here: each check_func run on the state, True counts, rounded to 4 places."""
    passed = 0
    for c in CHECKS:
        scope = {"initial_state": initial}
        exec(c["check_func"], scope)
        passed += scope["check_func"](final) is True
    return round(passed / len(CHECKS), 4)


def test_the_official_prompt_and_the_checklist_reward(tasks):
    env = world()
    messages = env.reset(tasks["lend-1"])
    assert messages[0]["content"].startswith(es.SYSTEM_PROMPT) and "Books are lent to one user" in messages[0]["content"]
    assert messages[1] == {"role": "user", "content": "Lend Dune to ana."}
    assert [t["function"]["name"] for t in env.tools] == ["find_book", "borrow", "audit"]
    assert env.step(call("find_book", title="Dune")).observations == ["['b1']"]
    r = env.step(call("borrow", book_id="b1", user="ana") + call("borrow", book_id="b2", user="bo"))
    assert r.observations == ["{'ok': True}"] and r.n_calls == 2          # the first call only (deviation 2)
    r = env.step(call("_secret"))
    assert r.observations == ["Error: '_secret' is not a valid tool of this environment."] and not r.done
    assert env.step("<tool_call>\n{oops}\n</tool_call>").errors == 1      # malformed: an observation
    assert env.step("Task Completed").done
    initial = {"books": {"b1": {"title": "Dune", "holder": None}, "b2": {"title": "Emma", "holder": None}}, "log": []}
    final = {"books": {"b1": {"title": "Dune", "holder": "ana"}, "b2": {"title": "Emma", "holder": None}}, "log": ["b1"]}
    assert env.reward() == by_hand(final, initial) == 0.75
    # the same task again from a fresh instance: nothing carries over
    env.reset(tasks["lend-1"])
    assert env.step("Task Completed").done and env.reward() == by_hand(initial, initial) == 0.25


def test_a_raising_tool_ends_the_episode_with_reward_0(tasks):
    env = world()
    env.reset(tasks["lend-2"])
    env.step(call("borrow", book_id="b1", user="ana"))
    r = env.step(call("audit"))
    assert r.done and r.observations[0].startswith("Error: <Exception>") and "audit service is down" in r.observations[0]
    assert env.reward() == 0.0


def test_the_step_cap_ends_the_episode_unscored(tasks):
    env = world(max_steps=2)
    env.reset(tasks["lend-1"])
    assert not env.step(call("borrow", book_id="b1", user="ana")).done
    assert env.step(call("find_book", title="Dune")).done and env.reward() == 0.0


def test_hostile_code_costs_its_episode_not_the_run(tasks):
    env = world()
    env.reset(tasks["peek"])
    r = env.step(call("peek"))                                   # reading outside its directory is refused
    assert r.done and "PermissionError" in r.observations[0] and "/etc/hostname" in r.observations[0]
    assert env.reward() == 0.0
    env.reset(tasks["peek"])
    t0 = time.time()
    r = env.step(call("spin"))                                   # never returns: killed at the wall-clock limit
    assert r.done and r.observations == [es.GONE] and time.time() - t0 < 10
    pid = env.worker.proc and env.worker.proc.pid
    assert env.reward() == 0.0 and pid is None                   # the worker is gone
    env.reset(tasks["loop"])                                     # class code that loops at its definition
    r = env.step(call("anything"))
    assert r.done and r.observations == [es.GONE] and env.reward() == 0.0
    env.reset(tasks["lend-1"])                                   # and the next episode runs normally
    env.step(call("borrow", book_id="b1", user="ana"))
    assert env.step("Task Completed").done and env.reward() == 0.75


def test_a_prompt_needs_no_worker(tasks, monkeypatch):
    monkeypatch.setattr(sandbox, "Worker", lambda *a: pytest.fail("a worker was started to render a prompt"))
    env = world()
    env.reset(tasks["lend-1"])
    assert env.tools and env.reward() == 0.0


def test_bad_files_are_one_line_errors(tmp_path):
    folder = write_dataset(tmp_path / "data")
    with open(os.path.join(folder, "test.jsonl"), "a") as f:
        f.write(json.dumps({"task_id": "x", "task": "t", "env_id": "nowhere", "env_class_name": "X"}) + "\n")
    with pytest.raises(UserError, match="names env_id 'nowhere', which env_metadata.json lacks"):
        es.load_scenarios(os.path.join(folder, "test.jsonl"))
    os.remove(os.path.join(folder, "env_metadata.json"))
    with pytest.raises(UserError, match="needs env_metadata.json, train.jsonl and test.jsonl"):
        es.load_scenarios(os.path.join(folder, "train.jsonl"))
    assert "give --tasks DIR" in es.EnvScalerWorld.check_args(type("A", (), {"tasks": "", "conventions": 2})())


def test_every_answer_a_worker_can_give_costs_the_episode_not_the_run(tasks):
    """A state that cannot be copied (the checklist's worker raises), an answer of the wrong kind written on the
    protocol's own stream, a flood without a newline, a worker killed under the trainer: each ends its episode with
    an error observation, `step` and `reward` never raise, and the next episode scores as before. (Environment code
    that forges well-formed answers in the right order can still fool its own checklist: worlds/sandbox.py, "the verdict".)"""
    env = world()
    env.reset(tasks["peek"])
    assert env.step(call("keep_a_generator")).observations == ["kept"]
    r = env.step("Task Completed")                               # the worker answers {"ok": False, "status": "raised"}
    assert r.done and r.observations == [es.GONE] and env.reward() == 0.0
    env.reset(tasks["peek"])
    r = env.step(call("forge"))                                  # a reward line where a call's answer belongs
    assert r.done and r.observations == [es.GONE] and env.reward() == 0.0
    env.reset(tasks["peek"])
    t0 = time.time()
    r = env.step(call("flood"))
    assert r.done and r.observations == [es.GONE] and env.reward() == 0.0 and time.time() - t0 < 10
    env.reset(tasks["lend-1"])
    env.step(call("find_book", title="Dune"))
    os.kill(env.worker.proc.pid, 9)                              # the worker dies between two requests
    r = env.step(call("borrow", book_id="b1", user="ana"))
    assert r.done and r.observations == [es.GONE] and env.reward() == 0.0
    env.reset(tasks["lend-1"])
    env.step(call("borrow", book_id="b1", user="ana"))
    assert env.step("Task Completed").done and env.reward() == 0.75


@pytest.mark.parametrize("answer, ok", [({"status": "ok", "text": "x"}, True), ({"status": "raised", "text": "t"}, True),
                                        ({"ok": False, "status": "raised"}, True), ({"status": "weird"}, False),
                                        ({"status": "ok", "text": 3}, False), (None, False), ([1], False)])
def test_call_answers_are_checked(answer, ok):
    assert (es.call_answer(answer) is not None) == ok


@pytest.mark.parametrize("answer, value", [({"reward": 0.5}, 0.5), ({"reward": 1}, 1.0), ({"reward": 1.5}, None),
                                          ({"reward": float("nan")}, None), ({"reward": True}, None),
                                          ({"ok": False, "status": "raised"}, None), (None, None)])
def test_reward_answers_are_checked(answer, value):
    assert es.reward_answer(answer) == value
