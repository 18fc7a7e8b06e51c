"""The code benchmarks as their releases ship them (worlds/code_world.py; issue 22): LiveCodeBench code_generation_lite
(compressed private tests, functional problems), TACO (input_output, fn_name), EvalPlus HumanEval+ / MBPP+ (diff
testing against the canonical solution on base + plus inputs), and eval.py --tasks.

Run: python -m pytest tests/test_benchmarks.py -q      (a few seconds; every program runs in the sandbox)
The fixtures (tests/fixtures/*.jsonl) are hand-written rows in each release's layout (make_fixtures.py).
"""
import base64
import json
import os
import pickle
import shutil
import sys
import zlib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from worlds import code_benchmarks, code_world, results  # noqa: E402
from worlds import sandbox  # noqa: E402

FIX = os.path.join(ROOT, "tests", "fixtures")
FAST = sandbox.SandboxLimits(wall_s=3.0, cpu_s=2, memory_mb=512, output_kb=64)

# task_id -> (a right program, a wrong program, the reason the wrong one must fail for)
PROGRAMS = {
    # LCB stdin: the mean printed as 2.5 passes "2.50" by the Decimal rule; a program that only knows the public
    # example fails on the first compressed private test
    "abc000_a": ("a, b = map(int, input().split())\nprint((a + b) / 2)\n", "print(2.5)\n", "test 1: wrong output"),
    # LCB functional: Solution().pairWithSum on the JSON arguments; a tuple result counts as a list; List comes from
    # the official prelude
    "9001": ("class Solution:\n    def pairWithSum(self, nums: List[int], target: int) -> List[int]:\n"
             "        seen = {}\n        for j, x in enumerate(nums):\n            if target - x in seen:\n"
             "                return (seen[target - x], j)\n            seen[x] = j\n",
             "class Solution:\n    def pairWithSum(self, nums: List[int], target: int) -> List[int]:\n"
             "        return [0, 1]\n", "test 1: wrong answer"),
    "taco-stdin": ("a, b = map(int, input().split())\nprint(a + b)\n", "print(3)\n", "test 1: wrong output"),
    # TACO call-based: the expected value is wrapped in a list (outputs[i] == [value]); a tuple counts as a list
    "taco-call": ("def sum_sorted(xs):\n    return sorted(xs), sum(xs)\n",
                  "def sum_sorted(xs):\n    return xs, sum(xs)\n", "test 0: wrong answer"),
    # DeepCoder taco subset: TACO's rules on Solution().maxProfit, the value wrapped in a list
    "deepcoder-taco": ("class Solution:\n    def maxProfit(self, prices):\n        best, low = 0, prices[0]\n"
                       "        for p in prices:\n            low = min(low, p)\n"
                       "            best = max(best, p - low)\n        return best\n",
                       "class Solution:\n    def maxProfit(self, prices):\n        return max(prices) - min(prices)\n",
                       "test 0: wrong answer"),
    # DeepCoder lcbv5 subset: LiveCodeBench's stdin rule
    "deepcoder-lcb": ("print(sum(c in 'aeiou' for c in input()))\n", "print(3)\n", "test 1: wrong output"),
    # HumanEval+: floats within atol; rounding fails on the base inputs already
    "HumanEval/2": ("def truncate_number(number):\n    return number - int(number)\n",
                    "def truncate_number(number):\n    return round(number % 1.0, 1)\n", "base input 1: wrong answer"),
    # right on every base input, wrong on the plus input 0: only the "+" catches it
    "HumanEval/31": ("def is_prime(n):\n    return n > 1 and all(n % k for k in range(2, int(n ** 0.5) + 1))\n",
                     "def is_prime(n):\n    if n == 1:\n        return False\n"
                     "    return all(n % k for k in range(2, n))\n", "plus input 0: wrong answer"),
    # MBPP+ set oracle: the order of the shared elements does not matter; the union is wrong
    "Mbpp/2": ("def similar_elements(a, b):\n    return tuple(sorted(set(b) & set(a), reverse=True))\n",
               "def similar_elements(a, b):\n    return tuple(set(a) | set(b))\n", "base input 0: wrong answer"),
    # 4 * a; an int result fails on the plus input 0.3 (expected 1.2)
    "Mbpp/17": ("def square_perimeter(a):\n    return a * 4\n", "def square_perimeter(a):\n    return int(4 * a)\n",
                "plus input 0: wrong answer"),
}


@pytest.fixture(scope="module")
def problems(tmp_path_factory):
    """Every fixture, loaded from a copy (EvalPlus writes its expected-output cache next to the file)."""
    tmp = tmp_path_factory.mktemp("fixtures")
    out = {}
    names = {"taco": ("taco-stdin", "taco-call"), "deepcoder": ("deepcoder-taco", "deepcoder-lcb")}
    for name in ("lcb", "taco", "deepcoder", "humanevalplus", "mbppplus"):
        shutil.copy(os.path.join(FIX, name + ".jsonl"), tmp)
        for i, p in enumerate(code_benchmarks.load_problems(str(tmp / (name + ".jsonl")), FAST)):
            out[names[name][i] if name in names else p.task_id] = p
    return out


def test_each_layout_loads_with_the_release_fields(problems):
    lcb, fn = problems["abc000_a"], problems["9001"]
    assert lcb.benchmark == "LiveCodeBench" and len(lcb.tests) == 3          # 1 public + 2 compressed private
    assert lcb.tests[1] == {"input": "-3 -4\n", "output": "-3.5\n"}
    assert fn.fn_name == "pairWithSum" and fn.calls[1] == [[[3, 2, 4], 6], [1, 2]] and not fn.tests
    assert "class Solution" in fn.text and fn.text.startswith("### Question:")   # starter code shown
    taco = problems["taco-call"]
    assert taco.benchmark == "TACO" and taco.fn_name == "sum_sorted"
    assert taco.calls[0] == [[[3, 1, 2]], [[[1, 2, 3], 6]]]
    assert problems["taco-stdin"].tests == [{"input": "1 2\n", "output": "3\n"}, {"input": "10 -4\n", "output": "6\n"}]
    dc, dl = problems["deepcoder-taco"], problems["deepcoder-lcb"]
    assert (dc.benchmark, dc.fn_name, dc.calls[0]) == ("TACO", "maxProfit", [[[7, 1, 5, 3, 6, 4]], [5]])
    assert dl.benchmark == "LiveCodeBench" and dl.tests[1] == {"input": "sky\n", "output": "0\n"}
    he, mb = problems["HumanEval/31"], problems["Mbpp/2"]
    assert he.benchmark == "HumanEval+" and mb.benchmark == "MBPP+"
    assert he.evalplus["expected"]["plus"] == [False, False, True, True]      # canonical solution, run once
    assert mb.evalplus["expected"]["base"] == [(4, 5), (3, 4)]                  # tuples survive the cache
    assert problems["HumanEval/2"].evalplus["atol"] == 1e-6


def test_right_programs_pass_and_wrong_ones_fail_for_the_right_reason(problems):
    pairs = [(problems[k], code) for k, (right, wrong, _) in PROGRAMS.items() for code in (right, wrong)]
    got = code_benchmarks.verify_many(pairs, FAST)
    for i, (k, (_, _, reason)) in enumerate(PROGRAMS.items()):
        assert got[2 * i][0], (k, got[2 * i])
        assert not got[2 * i + 1][0] and got[2 * i + 1][1] == reason, (k, got[2 * i + 1])


def test_evalplus_reports_base_and_plus_separately(problems):
    right, wrong, _ = PROGRAMS["HumanEval/31"]
    assert code_benchmarks.verify_detail(problems["HumanEval/31"], right, FAST)[2] == {"base": True, "plus": True}
    assert code_benchmarks.verify_detail(problems["HumanEval/31"], wrong, FAST)[2] == {"base": True, "plus": False}
    # the original HumanEval test (check()) alone would have passed the wrong program
    plain = code_benchmarks.CodeProblem("he", "x", asserts="def check(candidate):\n    assert candidate(6) == False\n"
                             "    assert candidate(1) == False\n\ncheck(is_prime)\n")
    assert code_benchmarks.verify(plain, wrong, FAST)[0]


def test_lcb_stdin_rule_is_decimal_and_line_count():
    assert code_benchmarks._lcb_same_output("2.5\n", "2.50") and code_benchmarks._lcb_same_output("  1 2 \n3\n\n", "1 2\n3")
    assert not code_benchmarks._lcb_same_output("2.5000001", "2.5") and not code_benchmarks._lcb_same_output("1\n2", "1 2")
    assert not code_benchmarks._lcb_same_output("abc", "abd") and not code_benchmarks._lcb_same_output("", "0")


def test_a_program_without_the_function_fails_as_not_loaded(problems):
    for key, code in (("9001", "class Solution:\n    pass\n"), ("Mbpp/17", "def perimeter(a):\n    return 4 * a\n"),
                      ("taco-call", "def sum_sorted(xs:\n")):
        ok, why = code_benchmarks.verify(problems[key], code, FAST)
        assert not ok and why.startswith("cannot load"), (key, why)


def test_a_result_object_with_its_own_eq_does_not_pass():
    cheat = ("class Any:\n    def __eq__(self, other):\n        return True\n"
             "class Solution:\n    def pairWithSum(self, nums, target):\n        return Any()\n")
    fn = code_benchmarks.CodeProblem("f", "x", fn_name="pairWithSum", calls=[[[[2, 7], 9], [0, 1]]], benchmark="LiveCodeBench")
    ok, why = code_benchmarks.verify(fn, cheat, FAST)
    assert not ok and "cannot be compared" in why


def _evil_pickles(marker):
    """Pickles that would run `touch marker` if unpickled: by __reduce__ (os.system, protocol 4 STACK_GLOBAL),
    through eval, and a hand-written protocol-0 GLOBAL + REDUCE."""
    class System:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    class Eval:
        def __reduce__(self):
            return eval, (f"__import__('os').system('touch {marker}')",)
    handmade = b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR."
    return [pickle.dumps(System()), pickle.dumps(Eval(), protocol=2), handmade]


def test_a_crafted_pickle_with_a_global_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "pwned"
    for blob in _evil_pickles(marker):
        field = base64.b64encode(zlib.compress(blob)).decode()
        row = {"question_id": "evil", "question_content": "q", "public_test_cases": "[]", "metadata": "{}",
               "private_test_cases": field}
        path = tmp_path / "evil.jsonl"
        path.write_text(json.dumps(row) + "\n")
        with pytest.raises(ValueError, match=r"evil\.jsonl:1: private_test_cases: the pickle layer was refused"):
            code_benchmarks.load_problems(str(path))
    assert not marker.exists()
    # the release's own chain round-trips
    cases = [{"input": "1\n", "output": "1\n", "testtype": "stdin"}]
    assert code_benchmarks.decode_lcb_private(code_benchmarks.encode_lcb_private(cases), "x") == cases


@pytest.mark.parametrize("row, reason", [
    ({"question_content": "q", "public_test_cases": "[]", "private_test_cases": "not base64 !"}, "neither JSON nor"),
    ({"question_content": "q", "private_test_cases": code_benchmarks.encode_lcb_private([])[:-8]}, "neither JSON nor"),
    ({"question_content": "q", "public_test_cases": json.dumps([{"input": "1", "output": "1",
                                                                  "testtype": "functional"}])}, "func_name"),
    ({"task_id": "Mbpp/9", "prompt": "p", "entry_point": "f", "canonical_solution": "def f(x): return x",
      "base_input": "[[1]]", "plus_input": []}, "'base_input' must be a list"),
])
def test_bad_benchmark_rows_name_file_line_and_reason(tmp_path, row, reason):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=rf"bad\.jsonl:1: .*{reason}"):
        code_benchmarks.load_problems(str(path))


def test_evalplus_expected_outputs_are_cached_next_to_the_file(tmp_path, monkeypatch):
    shutil.copy(os.path.join(FIX, "mbppplus.jsonl"), tmp_path)
    path = str(tmp_path / "mbppplus.jsonl")
    first = code_benchmarks.load_problems(path, FAST)
    assert os.path.isfile(path + ".expected.json")
    monkeypatch.setattr(code_benchmarks, "run_calls", lambda *a, **k: pytest.fail("the cache was not used"))
    again = code_benchmarks.load_problems(path, FAST)
    assert [p.evalplus["expected"] for p in again] == [p.evalplus["expected"] for p in first]
    monkeypatch.undo()
    code_benchmarks.save_problems(first, str(tmp_path / "ours.jsonl"))       # our layout round-trips, tuples and all
    ours = code_benchmarks.load_problems(str(tmp_path / "ours.jsonl"), FAST)
    outputs = lambda ps: [(p.evalplus["expected"]["base"], p.evalplus["expected"]["plus"]) for p in ps]   # noqa: E731
    assert outputs(ours) == outputs(first)
    assert ours[0].benchmark == "MBPP+" and code_benchmarks.verify(ours[0], PROGRAMS["Mbpp/2"][0], FAST)[0]


def test_code_world_uses_no_system_prompt_for_evalplus_and_a5_for_lcb(problems):
    log = {}
    env = code_world.CodeWorld(limits=FAST, log=log)
    assert [m["role"] for m in env.reset(problems["HumanEval/31"])] == ["user"]
    env.step("```python\n" + PROGRAMS["HumanEval/31"][1] + "```")
    assert env.reward() == 0.0 and log["HumanEval/31"]["base"] and not log["HumanEval/31"]["plus"]
    msgs = env.reset(problems["9001"])
    assert msgs[0] == {"role": "system", "content": code_world.CODING_SYSTEM_PROMPT}


def test_benchmark_rows_count_pass_at_1_and_base_apart(problems):
    he = [problems["HumanEval/2"], problems["HumanEval/31"]]
    log = {"HumanEval/2": {"passed": True, "base": True, "plus": True},
           "HumanEval/31": {"passed": False, "base": True, "plus": False}}
    rows = results.benchmark_rows(he, log, "he.jsonl")
    assert rows == [{"benchmark": "HumanEval+", "file": "he.jsonl", "problems": 2, "pass@1": 0.5, "base pass@1": 1.0}]
    table = results.benchmark_table(rows, "LOPD student")
    assert "| HumanEval+ | he.jsonl | 2 | 50.00 | 100.00 | LOPD 81.36" in table and "Qwen3-4B, paper Table 2" in table


def test_eval_tasks_prints_pass_at_1_per_benchmark(tmp_path, capsys):
    """eval.py --run DIR --tasks FILE...: a run folder (the shipped toy code backbone; a checkpoint whose student is
    a saved copy of it) evaluated on the fixtures of all four layouts."""
    import eval as ev
    import train
    from transformers import AutoModelForCausalLM
    run = tmp_path / "run"
    args = train.parse_args(["--env", "code", "--out", str(run), "--device", "cpu", "--max-new-tokens", "8"])
    run.mkdir()
    (run / "args.json").write_text(json.dumps(train.dataclasses.asdict(args)))
    os.makedirs(run / "ckpt" / "step-1")
    AutoModelForCausalLM.from_pretrained(train.toy_backbone(args)).save_pretrained(run / "ckpt" / "step-1" / "student")
    (run / "ckpt" / "LATEST").write_text("step-1")
    files = []
    for name in ("lcb", "taco", "humanevalplus", "mbppplus"):
        shutil.copy(os.path.join(FIX, name + ".jsonl"), tmp_path)
        files.append(str(tmp_path / (name + ".jsonl")))
    rows = ev.main(["--run", str(run), "--tasks", *files, "--n-test", "1"])
    out = capsys.readouterr().out
    assert [r["benchmark"] for r in rows] == ["LiveCodeBench", "TACO", "HumanEval+", "MBPP+"]
    assert "LOPD student (step-1)" in out and "| LiveCodeBench | lcb.jsonl | 1 |" in out
    assert all(0 <= r["pass@1"] <= r.get("base pass@1", 1) for r in rows)
    assert json.load(open(run / "lcb-taco-humanevalplus-mbppplus_first1.json"))["rows"] == rows
    records = [json.loads(x) for x in open(run / "lcb-taco-humanevalplus-mbppplus_first1.records.jsonl")]
    assert [r["benchmark"] for r in records] == [f"{n}.jsonl" for n in ("lcb", "taco", "humanevalplus", "mbppplus")]
    with pytest.raises(SystemExit):
        ev.main(["--run", str(run), "--tasks", str(tmp_path / "missing.jsonl")])


def test_eval_loads_a_lora_student_and_uses_b3_sampling_for_real_models(tmp_path):
    """--student-lora: the checkpoint's student is a LoRA adapter saved as LoraStudent saves it (a subfolder named
    after the adapter); the loaded model equals backbone + that adapter. Real models sample with B.3's settings."""
    import eval as ev
    import torch
    import train
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    args = train.parse_args(["--env", "code", "--out", str(tmp_path), "--device", "cpu", "--student-lora"])
    base = AutoModelForCausalLM.from_pretrained(train.toy_backbone(args))
    peft = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
                          adapter_name="student")
    path = tmp_path / "ckpt" / "step-3" / "student"
    peft.save_pretrained(str(path), selected_adapters=["student"])
    (tmp_path / "ckpt" / "LATEST").write_text("step-3")
    model, _, name = ev.load_eval_student(args)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, peft(ids).logits, atol=1e-5)
    assert name == "LOPD student (step-3)"
    real = train.dataclasses.replace(args, model=str(tmp_path / "not-a-toy"))
    cfg = ev.benchmark_sample_config(real)
    assert (cfg.max_new_tokens, cfg.temperature, cfg.top_k) == (16384, 0.7, 20) and ev.B3_THINKING is True
    assert ev.benchmark_sample_config(real, temperature=0.0).temperature == 0.0
    assert ev.benchmark_sample_config(args).max_new_tokens == args.max_new_tokens     # the toy keeps its own
