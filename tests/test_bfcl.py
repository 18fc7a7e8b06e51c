"""BFCL-v3 multi-turn through the project's own rendering, parsing and execution, scored by BFCL's checker
(bfcl.py). The optional tier: skipped without `pip install --no-deps bfcl-eval==2025.7.17`.

The replies are scripted, not sampled: each turn's ground-truth calls in the Qwen3 call format (common.format_call),
then a reply without a call to end the turn. They go through engine.rollout as a model's replies would (the chat
template renders prompts, tool results and user turns; replies are decoded and parsed; calls run on the task's
instances), with the toy tokenizer's template. BFCL's checker is the judge, so the replay can fail: the empty and
the truncated replays must score 0.

Run: python -m pytest tests/test_bfcl.py -q
"""
import functools
import json
import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytest.importorskip("bfcl_eval")
import engine  # noqa: E402
from worlds import bfcl  # noqa: E402
from worlds import common  # noqa: E402
from worlds import toy_backbone as toy  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(toy.SHIPPED)


@pytest.fixture(scope="module")
def tasks():
    return bfcl.load_tasks()


def replies_of(task, how: str) -> list[str]:
    """The scripted replies of one task: per turn its ground-truth calls (none: "empty"; the episode's last call left
    out: "truncated") in one reply, then a reply without a call, which ends the turn."""
    turns = bfcl.ground_truth_calls(task)
    last = max(i for i, turn in enumerate(turns) if turn)
    out = []
    for i, turn in enumerate(turns):
        calls = [] if how == "empty" else turn[:-1] if how == "truncated" and i == last else turn
        out += ["\n".join(common.format_call(n, a) for n, a in calls)] if calls else []
        out.append("Done.")
    return out


def replay(tok, tasks, how: str, monkeypatch):
    """engine.rollout of `tasks` with generate_replies replaced by the scripted replies. -> (BFCL's verdicts by task
    id, the episodes)."""
    script = {t.task_id: replies_of(t, how) for t in tasks}
    live = []                                                   # the batch's episodes, in the order rollout made them

    def scripted(model, tokenizer, contexts, cfg, conversations=None, keys=None, **_):
        out = []
        for k in keys:
            queue = script[live[k].task.task_id]
            ids = engine.reply_ids(tokenizer, queue.pop(0) if queue else "Done.")
            out.append((ids, [0.0] * len(ids), True))
        return out
    episode = engine.Episode
    monkeypatch.setattr(engine, "generate_replies", scripted)
    monkeypatch.setattr(engine, "Episode", lambda task: live.append(episode(task)) or live[-1])
    log = {}
    chat = engine.Chat(tok, functools.partial(bfcl.BFCLWorld, log=log))
    cfg = engine.SampleConfig(max_new_tokens=4096, max_len=10 ** 7, batch_size=len(tasks))
    eps = engine.rollout(torch.nn.Linear(1, 1), chat, tasks, cfg)
    return log, eps


def test_the_ground_truth_replayed_passes_every_task_that_can_pass(tok, tasks, monkeypatch):
    log, eps = replay(tok, tasks, "truth", monkeypatch)
    assert len(tasks) == 800 and {t.variant for t in tasks} == set(bfcl.CATEGORIES)
    failed = [k for k, v in log.items() if not v["passed"]]
    # the one task no model passes in BFCL's own runner: its question has one turn fewer than its ground truth
    assert failed == ["multi_turn_base_154"]
    bad = next(t for t in tasks if t.task_id == failed[0])
    assert len(bad.entry["question"]) == len(bad.ground_truth) - 1
    assert sum(v["passed"] for v in log.values()) == 799
    assert all(e.reward == 1.0 for e in eps if e.task.task_id != failed[0])
    assert all(e.ids[e.prompt_len:].count(tok.eos_token_id) >= len(e.task.ground_truth) for e in eps)


@pytest.mark.parametrize("how", ["empty", "truncated"])
def test_empty_and_truncated_replies_fail_every_task(tok, tasks, how, monkeypatch):
    some = [t for c in bfcl.CATEGORIES for t in [t for t in tasks if t.variant == c][:50]]   # 200 tasks
    log, eps = replay(tok, some, how, monkeypatch)
    assert len(log) == 200 and not any(v["passed"] for v in log.values())
    if how == "empty":
        assert all(e.tool_calls == 0 for e in eps)


def test_a_name_the_task_lacks_is_an_error_observation_and_never_runs(tasks):
    env = bfcl.BFCLWorld()
    env.reset(next(t for t in tasks if t.task_id == "multi_turn_base_0"))
    r = env.step(common.format_call("__import__", {"name": "os"}) + common.format_call("eval", {"source": "1"}))
    assert r.errors == 2 and all(o.startswith("Error: no function") for o in r.observations)
    assert env.decoded[0] == [[]] and env.trace == []                 # nothing ran, nothing goes to the checker
    r = env.step(common.format_call("cd", {"folder": "__import__('os').system('true')"}))
    assert env.decoded[0][-1] == ["cd(folder=\"__import__('os').system('true')\")"]   # a string stays a string
    r = env.step("<tool_call>\n{not json}\n</tool_call>")             # malformed: an observation, the turn goes on
    assert r.errors == 1 and not r.done and r.user is None
    env.close()


def injections(path: str) -> list[str]:
    """The argument-name injection of issue 46 (a key that is code, for BFCL's checker to eval), written in every
    call format the parsers read: Qwen3's tag, an OpenAI-style object, arguments as a JSON string, Llama 3's bare
    JSON (and after <|python_tag|>), Olmo 3's call (whose parser only yields identifier keys)."""
    key = f"folder=__import__('os').system('touch {path}'),x"
    args = {key: "a"}
    return [f"<tool_call>{json.dumps({'name': 'cd', 'arguments': args})}</tool_call>",
            f"<tool_call>{json.dumps({'function': {'name': 'cd', 'arguments': args}})}</tool_call>",
            f"<tool_call>{json.dumps({'name': 'cd', 'arguments': json.dumps(args)})}</tool_call>",
            json.dumps({"name": "cd", "parameters": args}),
            "<|python_tag|>" + json.dumps({"name": "cd", "parameters": args}),
            f"<function_calls>cd(**{{{key!r}: 'a'}})</function_calls>"]


def test_code_in_an_argument_name_never_runs_in_any_call_format(tasks, tmp_path):
    """Each injection is an error observation: never executed, never handed to the checker, and the scoring of the
    episode (BFCL's checker, which evals call strings) creates no file. The same key through `call_string` is a
    ValueError: no string of it can be built."""
    task = next(t for t in tasks if t.task_id == "multi_turn_base_0")
    target = tmp_path / "X"
    for reply in injections(str(target)):
        env = bfcl.BFCLWorld()
        env.reset(task)
        r = env.step(reply)
        assert r.errors == 1 and r.observations[0].startswith("Error:") and not r.done, (reply, r)
        assert env.decoded[0] in ([[]], []) and env.trace == [], reply
        env.step("Done.")
        env.reward()
        assert not target.exists(), reply
    doc = {d["name"]: d for d in bfcl.function_docs("GorillaFileSystem")}["cd"]
    with pytest.raises(ValueError, match="has no parameter"):
        bfcl.call_string("cd", {f"folder=__import__('os').system('touch {target}'),x": "a"}, doc)
    assert bfcl.call_string("cd", {"folder": "a'); b('"}, doc) == "cd(folder=\"a'); b('\")"


@pytest.mark.parametrize("args, problem", [
    ({"folder": "x"}, None), ({}, None), ({"folder": [1, 2.5, None, True, {"k": "v"}]}, None),
    ({"folder=1,x": "a"}, "has no parameter"), ({"fold": "a"}, "has no parameter"), ({"__class__": "a"}, "no parameter"),
    ({"folder": float("nan")}, "not a plain JSON value"), ({"folder": float("inf")}, "not a plain JSON value"),
    ({"folder": ("tu", "ple")}, "not a plain JSON value"), ({"folder": {1: "a"}}, "not a plain JSON value"),
    ({"folder": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["x"]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}, "nests deeper"),
])
def test_only_declared_names_and_plain_values_make_a_call_string(args, problem):
    doc = {d["name"]: d for d in bfcl.function_docs("GorillaFileSystem")}["cd"]
    got = bfcl.literal_problem("cd", args, doc)
    assert (got is None) if problem is None else (problem in got), got
    if problem is None:            # the string evaluates to the same call: a literal, nothing else
        import ast
        node = ast.parse(bfcl.call_string("cd", args, doc), mode="eval").body
        assert {k.arg: ast.literal_eval(k.value) for k in node.keywords} == args


def test_a_value_that_costs_hours_costs_the_episode_not_the_run(tasks):
    """MathAPI.power(10, 10**12) would compute for hours in the trainer; in the episode's worker it is cut at the
    worker's wall-clock limit, the episode ends failed, and the next one runs as usual."""
    task = next(t for t in tasks if "MathAPI" in t.entry["involved_classes"])
    env = bfcl.BFCLWorld(limits=bfcl.sandbox.SandboxLimits(wall_s=2.0, cpu_s=10, memory_mb=1024,
                                                                   output_kb=4096))
    env.reset(task)
    t0 = time.time()
    r = env.step(common.format_call("power", {"base": 10, "exponent": 10 ** 12}))
    assert r.done and r.observations[-1] == bfcl.GONE and time.time() - t0 < 10
    assert env.reward() == 0.0
    env.reset(task)
    assert json.loads(env.step(common.format_call("power", {"base": 2, "exponent": 10})).observations[0]) == \
        {"result": 1024}
    env.close()


def test_held_out_functions_arrive_at_their_turn_in_a_user_message(tok, tasks):
    task = next(t for t in tasks if t.variant == "miss_func")
    (turn, names), = task.entry["missed_function"].items()
    env, chat = bfcl.BFCLWorld(), engine.Chat(tok, bfcl.BFCLWorld)
    messages, tools = chat.begin(task)
    listed = {t["function"]["name"] for t in tools}
    assert not listed & set(names) and messages[-1]["content"] == task.text
    env.reset(task)
    for _ in range(int(turn) - 1):
        assert env.step("Done.").user is not None
    r = env.step("Done.")                                             # the end of the turn before the held-out one
    assert r.user.endswith(bfcl.MORE_FUNCTIONS) and not r.done
    arrived = json.loads(r.user[:-len(bfcl.MORE_FUNCTIONS) - 1])
    assert [f["function"]["name"] for f in arrived] == names
    text = tok.decode(chat.observation(r.observations, r.user))
    assert text.lstrip("\n").startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    assert set(names) <= set(env.listed)


def test_episodes_share_no_state_and_reset_starts_fresh(tasks):
    """Each episode's instances live in a worker of its own: the same mkdir twice succeeds in two episodes and fails
    the second time within one; no BFCL instance is ever cached in the trainer's process."""
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
    task = next(t for t in tasks if "GorillaFileSystem" in t.entry["involved_classes"])
    env, seen = bfcl.BFCLWorld(), []
    for _ in range(2):
        env.reset(task)
        seen.append(env.step(common.format_call("mkdir", {"dir_name": "lopd_probe"})).observations)
        env.reward()
    assert seen[0] == seen[1] and "rror" not in seen[0][0]
    env.reset(task)
    env.step(common.format_call("mkdir", {"dir_name": "lopd_probe"}))
    assert env.step(common.format_call("mkdir", {"dir_name": "lopd_probe"})).observations != seen[0]   # it can fail
    env.close()
    assert not [k for k in vars(multi_turn_utils) if k.endswith("_instance")]


def test_every_tool_schema_is_json_schema():
    allowed = {"object", "number", "integer", "string", "boolean", "array"}

    def types(p):
        yield p.get("type")
        for v in p.get("properties", {}).values():
            yield from types(v)
        if "items" in p:
            yield from types(p["items"])
    for cls in bfcl.CLASSES:
        for doc in bfcl.function_docs(cls):
            tool = bfcl.schema(doc)
            assert tool["function"]["name"] == doc["name"]
            assert set(types(tool["function"]["parameters"])) - {None} <= allowed, doc["name"]


def test_eval_py_reports_each_category_and_their_mean(tmp_path, capsys):
    """eval.py --tasks bfcl-v3 on a run folder (the toy backbone saved as its checkpoint's student): one task of each
    category, BFCL's accuracy per category and the mean, written to files of its own with a record per task (a
    second evaluation beside the first); a bad category is one line."""
    import eval as ev
    import train
    from transformers import AutoModelForCausalLM
    run = tmp_path / "run"
    args = train.parse_args(["--out", str(run), "--device", "cpu", "--max-new-tokens", "8", "--max-len", "20000"])
    run.mkdir()
    (run / "args.json").write_text(json.dumps(train.dataclasses.asdict(args)))
    os.makedirs(run / "ckpt" / "step-1")
    AutoModelForCausalLM.from_pretrained(train.toy_backbone(args)).save_pretrained(run / "ckpt" / "step-1" / "student")
    (run / "ckpt" / "LATEST").write_text("step-1")
    rows = ev.main(["--run", str(run), "--tasks", "bfcl-v3", "--n-test", "1"])
    out = capsys.readouterr().out
    assert [r["category"] for r in rows] == list(bfcl.CATEGORIES) and all(r["tasks"] == 1 for r in rows)
    assert "| mean | 4 |" in out and "LOPD student (step-1)" in out
    assert json.load(open(run / "bfcl-v3_first1.json"))["rows"] == rows
    records = [json.loads(x) for x in open(run / "bfcl-v3_first1.records.jsonl")]     # a line per task
    assert [r["benchmark"] for r in records] == [f"bfcl-v3:{c}" for c in bfcl.CATEGORIES]
    assert all(r["verdict"]["passed"] in (True, False) and r["conversation"] for r in records)
    assert ev.main(["--run", str(run), "--tasks", "bfcl-v3:base", "--n-test", "1"])[0]["category"] == "base"
    again = ev.main(["--run", str(run), "--tasks", "bfcl-v3", "--n-test", "1"])     # the same evaluation again
    assert json.load(open(run / "bfcl-v3_first1-2.json"))["rows"] == again          # beside the first, not over it
    assert json.load(open(run / "bfcl-v3_first1.json"))["rows"] == rows
    assert os.path.isfile(run / "bfcl-v3_base_first1.json")
    plain = ev.main(["--model", train.toy_backbone(args), "--tasks", "bfcl-v3", "--n-test", "1",
                     "--out", str(tmp_path / "plain")])                    # the model as released, no run folder
    assert [r["category"] for r in plain] == list(bfcl.CATEGORIES) and "(as released)" in capsys.readouterr().out
    assert json.load(open(tmp_path / "plain" / "bfcl-v3_first1.json"))["rows"] == plain
    assert not os.path.exists(tmp_path / "plain" / "args.json")             # not a run: nothing mistakes it for one
    with pytest.raises(SystemExit) as stop:
        ev.main(["--run", str(run), "--tasks", "bfcl-v3:simplest"])
    assert stop.value.code == 2 and "no BFCL-v3 category 'simplest'" in capsys.readouterr().err
    single = ev.main(["--run", str(run), "--tasks", "bfcl-v3:simple,irrelevance", "--n-test", "2"])
    assert [(r["category"], r["tasks"]) for r in single] == [("simple", 2), ("irrelevance", 2)]


def answer_calls(task) -> list:
    """A single-turn task's possible answer as calls: per parameter the first allowed value, left out where BFCL
    allows leaving it out ("") and the function does not require it."""
    def value(v):
        if isinstance(v, dict):
            return {k: value([x for x in a if x != ""][0] if isinstance(a, list) else a)
                    for k, a in v.items() if not (isinstance(a, list) and (not a or a[0] == ""))}
        return [value(e) for e in v] if isinstance(v, list) else v
    docs, out = {d["name"]: d for d in task.entry["function"]}, []
    for call in task.ground_truth:
        for name, params in call.items():
            required = docs.get(name, {}).get("parameters", {}).get("required", [])
            given = {k: [v for v in allowed if v != ""] for k, allowed in params.items()}
            kept = [k for k, g in given.items() if g and (k in required or "" not in params[k])]
            out.append((name, {k: value(given[k][0]) for k in kept}))
    return out


def test_single_turn_answers_pass_bfcls_ast_checker_and_wrong_ones_fail():
    """BFCL-v3's single-turn Python categories through BFCLSingleWorld: each possible answer as a reply passes the AST
    checker (a handful of tasks' answers omit a parameter the function requires: at most 1% a category), no call is
    right exactly on irrelevance; a changed value, or a dropped call, fails."""
    tasks = bfcl.load_single_turn()
    assert {t.variant for t in tasks} == set(bfcl.SINGLE_TURN) and len(tasks) == 3491
    by_cat = {}
    for t in tasks:
        env = bfcl.BFCLSingleWorld()
        env.reset(t)
        calls = [] if "irrelevance" in t.variant else answer_calls(t) if t.ground_truth else \
            [(t.entry["function"][0]["name"], {})]                # live_relevance: any call is right
        env.step("\n".join(common.format_call(n, a) for n, a in calls) or "No call is needed.")
        by_cat.setdefault(t.variant, []).append(env.reward())
    for cat, rewards in by_cat.items():
        assert sum(rewards) >= 0.99 * len(rewards), (cat, len(rewards) - sum(rewards))
    assert min(by_cat["irrelevance"]) == min(by_cat["live_irrelevance"]) == 1.0
    simple = next(t for t in tasks if t.task_id == "simple_0")
    (name, args), = answer_calls(simple)
    wrong = {k: (v + 1 if isinstance(v, int) else v + "x") for k, v in args.items()}
    assert not bfcl.ast_check(simple, [(name, wrong)]) and bfcl.ast_check(simple, [(name, args)])
    para = next(t for t in tasks if t.variant == "parallel")
    assert bfcl.ast_check(para, answer_calls(para)) and not bfcl.ast_check(para, answer_calls(para)[:-1])
    irrelevant = next(t for t in tasks if t.variant == "irrelevance")
    assert not bfcl.ast_check(irrelevant, [(irrelevant.entry["function"][0]["name"], {})])


def test_a_turn_past_its_step_limit_fails_the_task(tasks):
    task = next(t for t in tasks if t.task_id == "multi_turn_base_0")
    env = bfcl.BFCLWorld(max_steps=2)
    env.reset(task)
    name, args = bfcl.ground_truth_calls(task)[0][0]
    assert not env.step(common.format_call(name, args)).done and not env.step(common.format_call(name, args)).done
    r = env.step(common.format_call(name, args))                       # the third step of the turn: forced quit
    assert r.done and r.observations == ["Model has been forced to quit after 2 steps."] and env.reward() == 0.0


def test_bfcl_table_is_headed_by_what_it_holds():
    """A single-turn table is not called multi-turn and has no turns column; a mixed one marks single-turn turns."""
    from worlds import results
    multi = {"category": "base", "tasks": 2, "accuracy": 0.5, "turns": 0.75}
    single = {"category": "simple", "tasks": 2, "accuracy": 1.0, "turns": 1.0}
    only_single = results.bfcl_table([single], "m", single=bfcl.SINGLE_TURN)
    assert only_single.startswith("BFCL-v3 single-turn") and "turns" not in only_single
    assert results.bfcl_table([multi], "m", single=bfcl.SINGLE_TURN).startswith("BFCL-v3 multi-turn")
    mixed = results.bfcl_table([multi, single], "m", single=bfcl.SINGLE_TURN)
    assert "multi-turn" not in mixed and "| simple | 2 | 1.000 | – |" in mixed
    assert "| mean | 4 | 0.750 | 0.750 |" in mixed          # accuracy over both; turns over the multi-turn row only


def _steps(env, calls):
    """Each call as a reply of its own (one step each) -> the StepResults."""
    return [env.step(common.format_call(n, a)) for n, a in calls]


def test_the_reward_is_the_fraction_of_turns_whose_prefix_passes(tasks):
    """multi_turn_base_0 (4 turns) with its first two turns' ground truth and nothing after: turns 1 and 2 pass, 3 and
    4 do not, so the reward is 2/4 = 0.5 and BFCL's task verdict is a fail (bfcl.py's module docstring, Scoring)."""
    task = next(t for t in tasks if t.task_id == "multi_turn_base_0")
    truth, log = bfcl.ground_truth_calls(task), {}
    env = bfcl.BFCLWorld(log=log)
    env.reset(task)
    for turn in truth[:2]:
        assert not any(r.done for r in _steps(env, turn))
        assert env.step("Done.").user is not None
    assert env.step("Done.").user is not None and env.step("Done.").done          # turns 3 and 4: no call
    assert env.reward() == 2 / 4
    verdict = log["multi_turn_base_0"]
    assert verdict == {"passed": False, "turns_passed": 2, "turns": 4, "reason": verdict["reason"]}
    assert verdict["reason"].startswith("turn 3: ") and "(multi_turn:" in verdict["reason"]   # BFCL's message


def test_a_forced_quit_scores_0_for_the_task_even_after_turns_that_passed(tasks):
    """BFCL's forced quit (more than max_steps steps in one turn) fails the whole task, as BFCL's multi-turn checker
    scores it: turns 1 and 2 pass (2/4 with the quit switched off), then turn 2's third step at max_steps = 2 quits,
    and the reward is 0 (bfcl.py's module docstring; the step count starts again at each turn)."""
    task = next(t for t in tasks if t.task_id == "multi_turn_base_0")
    truth, log = bfcl.ground_truth_calls(task), {}
    env = bfcl.BFCLWorld(max_steps=2, log=log)
    env.reset(task)
    first = [r.done for r in _steps(env, truth[0][:2])] + [env.step(common.format_call(*truth[0][2])).done]
    assert first == [False, False, True]                              # 3 steps in one turn: the limit is 2 a turn
    env.reset(task)
    both = [truth[0][:2], truth[0][2:]]                                # turn 1's three calls in two replies
    env.step("\n".join(common.format_call(n, a) for n, a in both[0]))
    env.step(common.format_call(*both[1][0]))
    assert env.step("Done.").user is not None                          # turn 1 done, in 2 steps: no quit
    assert [r.done for r in _steps(env, truth[1])] == [False, False]    # turn 2: 2 steps, the count started again
    r = env.step(common.format_call(*truth[2][0]))                     # a third step in turn 2: forced quit
    assert r.done and r.observations == ["Model has been forced to quit after 2 steps."]
    assert env.reward() == 0.0
    assert log["multi_turn_base_0"] == {"passed": False, "turns_passed": 0, "turns": 4,
                                        "reason": "BFCL's forced quit: more than 2 steps in turn 2"}
