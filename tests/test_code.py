"""Tests for the code domain (worlds/code_world.py): the verifier's limits, problem loading, CodeWorld.

Run: python -m pytest tests/test_code.py -q      (about 20 s; each case runs real programs in the sandbox)
The ways out of the sandbox are tried in tests/test_escape.py; what it does not cover is in worlds/sandbox.py's
docstring.
"""
import json
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import engine  # noqa: E402
from worlds import code_benchmarks, code_world  # noqa: E402
from worlds import sandbox  # noqa: E402

FAST = sandbox.SandboxLimits(wall_s=3.0, cpu_s=1, memory_mb=256, output_kb=64)


def run(code, stdin="", limits=FAST, **kw):
    return sandbox.run_sandboxed(code, stdin, limits, **kw)


# ------------------------------------------------------------------------------------------------------------
# The verifier's limits
# ------------------------------------------------------------------------------------------------------------
def test_busy_infinite_loop_dies_of_its_cpu_limit():
    r = run("while True:\n    pass\n")
    assert r.status == "cpu limit" and r.seconds < FAST.wall_s + 0.5


def test_sleeping_program_dies_at_the_wall_limit():
    t0 = time.time()
    r = run("import time\ntime.sleep(60)\n", limits=sandbox.SandboxLimits(wall_s=1.0))
    assert r.status == "timeout" and time.time() - t0 < 2.5


def test_memory_bomb_is_stopped():
    for bomb in ("x = bytearray(4 * 1024 ** 3)\n", "x = []\nwhile True:\n    x.append(' ' * 10 ** 6)\n"):
        r = run(bomb)
        assert r.status in ("error", "killed", "cpu limit") and r.status != "ok", r
        assert "MemoryError" in r.stderr or r.status != "error"


def test_endless_output_is_capped():
    r = run("while True:\n    print('x' * 1000)\n")
    assert r.status == "output limit"
    assert len(r.stdout) <= FAST.output_kb * 1024 and r.seconds < FAST.wall_s


def test_the_programs_own_directory_is_writable_and_numpy_imports():
    """Its scratch directory is its own (what it may not do anywhere else: tests/test_escape.py), and the site-packages
    it may read hold numpy, which TACO's prelude imports."""
    inside = run("open('scratch.txt', 'w').write('ok')\nprint(open('scratch.txt').read())\n")
    assert inside.status == "ok" and inside.stdout.strip() == "ok"
    assert run("import numpy\nprint(numpy.arange(4).sum())\n", limits=sandbox.SandboxLimits()).stdout == "6\n"


# ------------------------------------------------------------------------------------------------------------
# Verification: pass/fail against the tests
# ------------------------------------------------------------------------------------------------------------
SUM = code_benchmarks.CodeProblem("p-sum", "Read two integers, print their sum.",
                       tests=[{"input": "1 2\n", "output": "3\n"}, {"input": "-5 5", "output": "0"}])
REV = code_benchmarks.CodeProblem("p-rev", "Write rev(s) returning s reversed.",
                       asserts="assert rev('abc') == 'cba'\nassert rev('') == ''")


def test_correct_program_passes_and_wrong_ones_fail():
    assert code_benchmarks.verify(SUM, "a, b = map(int, input().split())\nprint(a + b)\n", FAST) == (True, "all tests passed")
    ok, why = code_benchmarks.verify(SUM, "a, b = map(int, input().split())\nprint(a * b)\n", FAST)
    assert not ok and why == "test 0: wrong output"
    ok, why = code_benchmarks.verify(SUM, "print(3)\n", FAST)            # right on the first test only
    assert not ok and why == "test 1: wrong output"
    assert code_benchmarks.verify(REV, "def rev(s):\n    return s[::-1]\n", FAST)[0]
    ok, why = code_benchmarks.verify(REV, "def rev(s):\n    return s\n", FAST)
    assert not ok and "AssertionError" in why
    ok, why = code_benchmarks.verify(SUM, "def (:\n", FAST)
    assert not ok and "SyntaxError" in why


def test_outputs_match_up_to_trailing_whitespace_only():
    assert code_benchmarks._same_output("3  \n\n", "3") and code_benchmarks._same_output("a\nb\n", "a \nb")
    assert not code_benchmarks._same_output("3 0", "30") and not code_benchmarks._same_output("a\n\nb", "a\nb")


def test_verify_many_runs_in_parallel_and_keeps_order():
    codes = ["a, b = map(int, input().split())\nprint(a + b)\n", "print(0)\n", "import time\ntime.sleep(0.5)\n"
             "a, b = map(int, input().split())\nprint(a + b)\n"] * 2
    t0 = time.time()
    got = code_benchmarks.verify_many([(SUM, c) for c in codes], FAST, workers=2)
    assert [g[0] for g in got] == [True, False, True] * 2
    assert time.time() - t0 < 2 * 0.5 * 2 + 3            # the two sleepers overlap with other runs


# ------------------------------------------------------------------------------------------------------------
# Problem files and CodeWorld
# ------------------------------------------------------------------------------------------------------------
def test_problem_layouts_of_taco_livecodebench_and_evalplus(tmp_path):
    rows = [
        {"task_id": "ours", "text": "Print 1.", "tests": [{"input": "", "output": "1"}]},
        {"question": "Sum.", "input_output": json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]})},
        {"question": "Call.", "input_output": {"inputs": [[2, 3]], "outputs": [5], "fn_name": "add"}},
        {"question_id": "lcb1", "question_content": "Echo.",
         "public_test_cases": json.dumps([{"input": "x\n", "output": "x\n", "testtype": "stdin"}]),
         "private_test_cases": [{"input": "y\n", "output": "y\n", "testtype": "stdin"}]},
        {"task_id": "HumanEval/0", "prompt": "def inc(x):\n", "entry_point": "inc",
         "test": "def check(candidate):\n    assert candidate(1) == 2\n"},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ours, taco, call, lcb, plus = code_benchmarks.load_problems(str(path))
    assert ours.task_id == "ours" and ours.tests == [{"input": "", "output": "1"}]
    assert taco.tests == [{"input": "1 2\n", "output": "3\n"}] and taco.task_id == f"{path}:2"
    assert code_benchmarks.verify(call, "def add(a, b):\n    return a + b\n", FAST)[0]
    assert not code_benchmarks.verify(call, "def add(a, b):\n    return a - b\n", FAST)[0]
    assert lcb.task_id == "lcb1" and [t["input"] for t in lcb.tests] == ["x\n", "y\n"]
    assert code_benchmarks.verify(lcb, "print(input())\n", FAST)[0]
    assert code_benchmarks.verify(plus, "def inc(x):\n    return x + 1\n", FAST)[0]
    assert not code_benchmarks.verify(plus, "def inc(x):\n    return x\n", FAST)[0]


@pytest.mark.parametrize("line, reason", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"text": "x"}', "no tests"),
    ('{"text": "x", "tests": [{"input": "1"}]}', "field 'tests'"),
    ('{"question": "q", "input_output": {"inputs": [1], "outputs": []}}', "1 inputs but 0 outputs"),
    ('{"statement": "x"}', "no known problem layout"),
])
def test_bad_problem_line_names_file_and_line(tmp_path, line, reason):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok", "tests": [{"input": "", "output": ""}]}\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"bad\.jsonl:2: .*{reason}"):
        code_benchmarks.load_problems(str(path))


def test_code_world_interface():
    env = code_world.CodeWorld(limits=FAST)
    msgs = env.reset(SUM)
    assert msgs[0] == {"role": "system", "content": code_world.CODING_SYSTEM_PROMPT} and msgs[1]["content"] == SUM.text
    program = "a, b = map(int, input().split())\nprint(a + b)\n"
    result = env.step(f"<think>\nadd them\n</think>\nHere:\n```python\n{program}```")
    assert result.done and result.observations == [] and env.reward() == 1.0
    assert env.trace_text() == program
    env.reset(SUM)
    result = env.step("I cannot solve this.")           # no program at all: reward 0, no exception
    assert result.done and env.reward() == 0.0 and result.errors == 1


def test_rollout_steps_a_batch_of_code_worlds_in_parallel():
    """engine._step_all: CodeWorld's programs run in threads, one sandboxed process each (1.5 s of sleep each here:
    sequential takes 6 s, two workers 3 s; the bound sits halfway, so a busy host's startup costs do not fail it)."""
    slow = "import time\ntime.sleep(1.5)\na, b = map(int, input().split())\nprint(a + b)\n"
    worlds = [code_world.CodeWorld(limits=FAST) for _ in range(4)]
    for w in worlds:
        w.reset(code_benchmarks.CodeProblem("p", "sum", tests=[{"input": "1 2", "output": "3"}]))
    t0 = time.time()
    results = engine._step_all(worlds, [f"```python\n{slow}```"] * 4)
    took = time.time() - t0
    assert [w.reward() for w in worlds] == [1.0] * 4 and all(r.done for r in results)
    workers = min(4, os.cpu_count() or 1)
    assert took < 4 * 1.5 / workers + 1.5 if workers > 1 else took >= 6.0   # sequential would take 6 s


# ------------------------------------------------------------------------------------------------------------
# The toy code world's generator (its toy backbone is not built yet)
# ------------------------------------------------------------------------------------------------------------
def test_toy_code_problems_need_their_judges_conventions():
    """The oracle passes; the same program with any other judge's conventions fails; the statement never says."""
    train, test = code_world.make_code_splits(seed=3, n_train=24, n_test=8)
    assert {p.schema for p in train + test} <= set(code_world.CODE_FAMILIES) and len({p.variant for p in train}) == 4
    pairs = []
    for p in train[:12]:
        pairs.append((p, code_world.code_oracle(p)))
        for judge in code_world.JUDGES:
            if judge != p.variant:
                other = code_benchmarks.CodeProblem(p.task_id, p.text, p.tests, schema=p.schema, variant=judge)
                pairs.append((p, code_world.code_oracle(other)))
    results = code_benchmarks.verify_many(pairs, FAST)
    for k, (ok, why) in enumerate(results):
        assert ok == (k % 4 == 0), (pairs[k][0].text, pairs[k][1], why)
    for p in train + test:
        assert "Answer" not in p.text and "END" not in p.text and p.text.endswith(f"Judge: {p.variant}.")


def test_toy_code_splits_are_seeded_and_disjoint():
    a_train, a_test = code_world.make_code_splits(seed=1, n_train=30, n_test=10)
    b_train, b_test = code_world.make_code_splits(seed=1, n_train=30, n_test=10)
    assert [(p.text, p.tests) for p in a_train + a_test] == [(p.text, p.tests) for p in b_train + b_test]
    key = lambda p: p.text + json.dumps(p.tests)                          # noqa: E731
    assert not {key(p) for p in a_train} & {key(p) for p in a_test}


def test_code_conventions_agree_with_the_sandbox_and_the_table_counts_them(tok):
    """eval.py --conventions: a program written with judge J's conventions passes problem p exactly when both
    conventions are right for p's judge (the sandbox decides, independently of the string checks); the table's
    rates are those counts."""
    import eval as ev
    from engine import Episode
    problems = code_world.make_code_splits(seed=5, n_train=0, n_test=8)[1]
    pairs, marks = [], []
    for p in problems:
        for judge in code_world.JUDGES:
            program = code_world.code_oracle(code_benchmarks.CodeProblem(p.task_id, p.text, p.tests, schema=p.schema,
                                                                variant=judge))
            pairs.append((p, program))
            marks.append(code_world.code_conventions(p, f"```python\n{program}```"))
    results = code_benchmarks.verify_many(pairs, FAST)
    for (ok, why), m in zip(results, marks):
        assert ok == (m["prefix_right"] and m["end_right"]), why
    # the table over one row of those replies, against counts taken here
    eps = []
    for (p, program), (ok, _) in zip(pairs, results):
        reply = f"```python\n{program}```"
        prompt = tok("Judge: " + p.variant, add_special_tokens=False)["input_ids"]
        eps.append(Episode(p, ids=prompt + tok(reply, add_special_tokens=False)["input_ids"], prompt_len=len(prompt),
                           reward=float(ok)))
    row = ev.conventions_table(tok, {"row": eps}).splitlines()[2]
    n = len(pairs)
    expect = [sum(e.reward for e in eps) / n] + [sum(m[k] for m in marks) / n
                                                 for k in ("prefix", "prefix_right", "end", "end_right")]
    assert row == "| row | " + " | ".join(f"{x:.3f}" for x in expect) + " |"
    assert expect[0] == 0.25 and expect[2] == expect[4] == 0.5      # 1 judge in 4 right; each convention 2 in 4
