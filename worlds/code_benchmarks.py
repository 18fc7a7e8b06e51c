"""The code benchmarks as released (paper §4.1 "coding", B.3, Table 2): TACO, DeepCoder's TACO subset,
LiveCodeBench, HumanEval+ and MBPP+ read in their own layouts, and each scored by its own harness's rules.

    python eval.py --run DIR --tasks lcb_v5.jsonl HumanEvalPlus.jsonl MbppPlus.jsonl   # pass@1 per benchmark
    python -m pytest tests/test_benchmarks.py tests/test_code.py -q

What is here, in order:
  CodeProblem and the loaders   problems load from JSONL in our layout or as the releases ship them, each scored by
                                its own harness's rules (the comment block "where each field rule comes from" names
                                the source file of each): TACO (question, input_output, starter_code; call-based with
                                fn_name), LiveCodeBench code_generation_lite (question_content, JSON public tests,
                                base64/zlib/pickle private tests read by an unpickler that refuses every global,
                                functional problems called on Solution()), EvalPlus HumanEval+ / MBPP+ (diff-testing
                                against canonical_solution on base_input + plus_input within atol; the expected
                                outputs are computed once in the sandbox and cached in TASKS.expected.json; base and
                                plus reported apart), and plain HumanEval (prompt, test, entry_point)
  the call-based driver         `run_calls`: call-based tests in one sandboxed process, outputs compared here; every
                                line it reads back is read totally (`_read_results`: forged or malformed -> no result)
  the asserts driver            `ASSERTS_DRIVER`, `instrument_test`: HumanEval's check() and our asserts, run after the
                                program by a driver that reports each assert statement passed and the test's end
  verification                  `verify`, `verify_detail`, `verify_many`: reward 1 iff every test passes, each
                                program run in the sandbox (worlds/sandbox.py: a process the kernel confines); the
                                verdict is the harness's, never the program's exit code or its own __eq__

Deviations: real benchmarks follow their harnesses where those were read (above `_NoGlobals`); the rest are
assumptions listed there: TACO's user message, TACO's lenient stdin comparison (ours is line-wise), MBPP+'s per-task
tuple/set input conversions (inputs are used as stored), and EvalPlus's special oracles that need code of their own
(Mbpp/581, Mbpp/558). Outputs of call-based tests are compared here, outside the sandbox, as plain values. HumanEval's
harness passes a program whose run of prompt + program + test exits 0; ours (`_verify_asserts`) passes it only when
every assert statement of the test passed at least once and the test ran to its end, with every value the program's
functions return to the test rebuilt as a plain value (a numpy array reaches it as a list, an object of the program's
own class not at all) and the test's builtins as they were before the program ran.
"""
from __future__ import annotations

import ast
import base64
import dataclasses
import functools
import inspect
import io
import json
import math
import pickle
import secrets
import zlib
from dataclasses import asdict, dataclass, field
from decimal import Decimal

from runtime import checkpoints
from worlds.common import read_jsonl
from worlds.sandbox import RunResult, SandboxLimits, run_sandboxed


@dataclass
class CodeProblem:
    """One single-turn problem: the statement and its tests, in one of three forms:
    - `tests`: stdin/stdout pairs, and/or `asserts`, code that runs after the program (our layout, TACO stdin,
      LiveCodeBench stdin, HumanEval's check()); the functions the test names return plain values to it, and
      fn_name, where given, is one of them;
    - `calls`: call-based tests, [[args, expected]]: `fn_name` is called (on `Solution()` where the program defines
      that class) with the JSON-parsed args (LiveCodeBench functional, TACO fn_name);
    - `evalplus`: diff-testing against the canonical solution on base and plus inputs (HumanEval+, MBPP+).
    `benchmark` names the release whose comparison rules apply ("" for ours and the toy's); variant / schema name a
    toy family; real benchmarks leave them ""."""
    task_id: str
    text: str
    tests: list = field(default_factory=list)     # [{"input": str, "output": str}]
    asserts: str = ""
    schema: str = ""
    variant: str = ""
    benchmark: str = ""       # "" | TACO | LiveCodeBench | HumanEval | HumanEval+ | MBPP+
    fn_name: str = ""
    calls: list = field(default_factory=list)     # [[args (list), expected]]
    evalplus: dict = field(default_factory=dict)  # entry_point, reference, base_input, plus_input, atol, dataset,
                                                  # expected ({"base", "plus", "base_s", "plus_s"}, filled on load)


EVALPLUS = ("HumanEval+", "MBPP+")      # B.3: no system prompt for these (and plain HumanEval)
NO_SYSTEM_PROMPT = EVALPLUS + ("HumanEval",)

# -- where each field rule comes from, read from the releases' own loaders and harnesses (at LiveCodeBench 28fef95ea8c9,
# evalplus 26d6d00bb1fd, FlagOpen/TACO 245eba3beb2d, rllm 1a95050504a9) ------------------------------------------
# LiveCodeBench code_generation_lite, LiveCodeBench/LiveCodeBench:
#   lcb_runner/benchmarks/code_generation.py: public_test_cases and metadata are JSON strings; private_test_cases is
#     JSON or else base64 -> zlib -> pickle -> a JSON string (the decode below, minus the pickle's power to run code);
#     each test is {input, output, testtype: stdin | functional}; metadata["func_name"] names the functional method.
#   lcb_runner/evaluation/testing_util.py: an import prelude goes before every program (`_lcb_prelude`); functional:
#     each line of a test's input is one JSON argument, its output one JSON value; the method is taken from
#     Solution() when the program contains "class Solution"; a tuple result counts as a list; then result == expected,
#     exactly (no float tolerance). stdin: both outputs stripped and split into lines, each line stripped; the line
#     counts must agree and each line must be equal as text or as a list of Decimals.
#   lcb_runner/prompts/code_generation.py: the A.5 system prompt is its SYSTEM_MESSAGE_GENERIC; the user message is
#     "### Question:" + statement + "### Format:" (starter code, or the stdin instruction) + "### Answer:"
#     (`_lcb_text`).
# EvalPlus, evalplus/evalplus:
#   evalplus/data/humaneval.py, data/utils.py (completeness_check): a record has task_id, prompt, entry_point,
#     canonical_solution, contract, base_input, plus_input, atol (HumanEval+ keeps HumanEval's `test` too).
#   evalplus/evaluate.py (get_groundtruth, check_correctness): the expected outputs are the outputs of
#     prompt + canonical_solution on each input (computed once, cached); a program scores "base" on base_input and
#     "plus" on plus_input; plus pass@1 counts base AND plus.
#   evalplus/eval/__init__.py (unsafe_execute): out == expected, else, where atol != 0 (atol = 1e-6 where it is 0 and
#     the expected value is a float or a list of floats), same type, same length and |out - exp| <= atol + 1e-7 |exp|;
#     special oracles by entry point (evalplus/eval/_special_oracle.py; those kept here: `_evalplus_ok`).
#   evalplus/codegen.py, provider/utility.py: the user message is the instruction prefix and the prompt in a fence.
# TACO, FlagOpen/TACO (the HF dataset BAAI/TACO):
#   README.md: fields question, solutions, starter_code, input_output (a JSON string), difficulty, ...
#   metrics/testing_util.py: input_output {inputs, outputs, fn_name?}; with fn_name the test is call-based: each input
#     is the argument list, Solution() is used when the program has "class Solution", a tuple result counts as a list,
#     and result == output or result == output[0]; dicts whose keys are digit strings get int keys; an import
#     prelude goes before the program. stdin inputs/outputs are strings or lists of lines (joined by "\n").
# DeepCoder-Preview-Dataset (the paper's training set): rllm-org/rllm rllm/rewards/code_reward.py scores the taco
#   subset's `tests` (a dict of lists, TACO's input_output) with TACO's harness and lcbv5's (a list of cases, func_name
#   in their metadata) with LiveCodeBench's; the statement is `problem` (also in NVIDIA NeMo-RL's deepcoder loader).
# Assumptions and departures (not in those sources): TACO's user message uses LiveCodeBench's template; TACO stdin
# outputs keep our line comparison (TACO's own harness is more lenient: token sets, float closeness); MBPP+ inputs are
# used as stored (EvalPlus turns some lists back into tuples/sets per task: evalplus/data/mbpp.py
# mbpp_deserialize_inputs); EvalPlus's oracles for Mbpp/581 and Mbpp/558 (code of their own) are not reproduced;
# a blank last line of a functional input is not an argument; TACO's int-key rule keeps the arguments after the
# first; time limits are the sandbox's (per call: SandboxLimits.wall_s; EvalPlus: max(wall_s, 4 x the reference)).


class _NoGlobals(pickle.Unpickler):
    """An unpickler that refuses every global: no class, function or module can be named, so nothing can be called
    or built but the plain values pickle encodes by itself (str, bytes, numbers, lists, tuples, dicts, sets)."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"global {module}.{name} refused: only plain values may be unpickled")


def decode_lcb_private(value, where: str):
    """LiveCodeBench's private_test_cases: JSON, or base64 -> zlib -> pickle -> a JSON string (code_generation.py).
    The pickle layer is read by `_NoGlobals`, so a crafted pickle that names os.system is refused, not run."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        pass
    try:
        raw = zlib.decompress(base64.b64decode(value.encode("ascii"), validate=True))
    except (ValueError, zlib.error) as e:
        raise ValueError(f"{where}: private_test_cases is neither JSON nor base64/zlib data ({e})") from None
    try:
        text = _NoGlobals(io.BytesIO(raw)).load()
    except Exception as e:          # a malformed pickle raises anything from EOFError to KeyError
        raise ValueError(f"{where}: private_test_cases: the pickle layer was refused ({e})") from None
    if not isinstance(text, str):
        raise ValueError(f"{where}: private_test_cases must unpickle to a JSON string, not {type(text).__name__}")
    return json.loads(text)


def encode_lcb_private(cases: list) -> str:
    """The inverse chain, as the release stores private tests (fixtures and tests write rows with it)."""
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(cases)))).decode("ascii")


def _lcb_prelude() -> str:
    """The imports LiveCodeBench's harness puts before every program (testing_util.py: import_string)."""
    mods = ("string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random", "statistics",
            "itertools", "functools", "operator", "io", "sys", "json")
    return "".join([f"from {m} import *\n" for m in mods + ("builtins", "typing")] + [f"import {m}\n" for m in mods]
                   + ["sys.setrecursionlimit(50000)\n"])


def _taco_prelude() -> str:
    """The imports TACO's harness puts before every program (metrics/testing_util.py: synthesize_cb_code). Its numpy
    import is tried only, as numpy may not be installed."""
    return "\n".join([
        "import sys", "import time", "import itertools",
        "from itertools import accumulate, product, permutations, combinations", "import collections",
        "from collections import Counter, OrderedDict, deque, defaultdict, ChainMap", "from functools import lru_cache",
        "import math", "from math import sqrt, sin, cos, tan, ceil, fabs, floor, gcd, exp, log, log2",
        "import fractions", "from typing import List, Tuple", "try:", "    import numpy as np", "except Exception:",
        "    pass", "import random", "import heapq", "from heapq import *", ""])


PRELUDES = {"LiveCodeBench": _lcb_prelude(), "TACO": _taco_prelude()}


def _lcb_text(statement: str, starter_code: str) -> str:
    """LiveCodeBench's user message (prompts/code_generation.py, the generic template); TACO's too (an assumption)."""
    if starter_code:
        fmt = ("You will use the following starter code to write the solution to the problem and enclose your code "
               f"within delimiters.\n```python\n{starter_code}\n```\n\n")
    else:
        fmt = ("Read the inputs from stdin solve the problem and write the answer to stdout (do not directly test on "
               "the sample inputs). Enclose your code within delimiters as follows. Ensure that when the python "
               "program runs, it reads the inputs, runs the algorithm and writes output to STDOUT.\n"
               "```python\n# YOUR CODE HERE\n```\n\n")
    return f"### Question:\n{statement}\n\n### Format: {fmt}### Answer: (use the provided format with backticks)\n\n"


def _int_keys(x):
    """TACO's process_input_output: a dict whose keys are all digit strings gets int keys (JSON has only strings)."""
    try:
        return {int(k): v for k, v in x.items()} if isinstance(x, dict) else x
    except ValueError:
        return x


def _tests_from_io(io_, where: str) -> dict:
    """TACO's `input_output` (a JSON string or object: inputs, outputs, optional fn_name) -> CodeProblem fields."""
    io_ = json.loads(io_) if isinstance(io_, str) else io_
    if not isinstance(io_, dict) or not isinstance(io_.get("inputs"), list) or not isinstance(io_.get("outputs"), list):
        raise ValueError(f"{where}: field 'input_output' must hold lists 'inputs' and 'outputs'")
    if len(io_["inputs"]) != len(io_["outputs"]):
        raise ValueError(f"{where}: 'input_output' has {len(io_['inputs'])} inputs but {len(io_['outputs'])} outputs")
    if io_.get("fn_name"):   # call-based: each input is the argument list, each output the return value
        calls = []
        for a, o in zip(io_["inputs"], io_["outputs"]):
            if not isinstance(a, list):
                raise ValueError(f"{where}: call-based input {a!r} is not an argument list")
            calls.append([a, o])
        return {"fn_name": io_["fn_name"], "calls": calls}
    return {"tests": [{"input": _text(a), "output": _text(o)} for a, o in zip(io_["inputs"], io_["outputs"])]}


def _text(x) -> str:
    return "\n".join(map(str, x)) if isinstance(x, list) else str(x)


def _tests_from_lcb(cases, fn_name: str, where: str) -> dict:
    """LiveCodeBench's test cases (a list of {input, output, testtype}) -> CodeProblem fields: stdin tests, or, for
    functional ones, calls whose args are the input's JSON lines and whose expected value is the JSON output."""
    if not isinstance(cases, list) or any(not isinstance(c, dict) or not {"input", "output"} <= set(c) for c in cases):
        raise ValueError(f"{where}: test cases must be a list of {{input, output, testtype}} objects")
    kinds = {c.get("testtype", "stdin") for c in cases}
    if kinds - {"stdin", "functional"}:
        raise ValueError(f"{where}: unknown LiveCodeBench testtype {sorted(kinds - {'stdin', 'functional'})}")
    if "functional" not in kinds:
        return {"tests": [{"input": c["input"], "output": c["output"]} for c in cases]}
    if kinds != {"functional"} or not fn_name:
        raise ValueError(f"{where}: functional tests need metadata.func_name and no stdin tests beside them")
    try:   # one JSON value per line (testing_util.py); a blank last line is not an argument
        calls = [[[json.loads(line) for line in c["input"].rstrip("\n").split("\n")], json.loads(c["output"])]
                 for c in cases]
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: a functional test is not one JSON value per line ({e.msg})") from None
    return {"fn_name": fn_name, "calls": calls}


def _lcb_row(row: dict, where: str) -> dict:
    meta = row.get("metadata") or {}
    meta = json.loads(meta) if isinstance(meta, str) else meta
    public = row.get("public_test_cases", [])
    public = json.loads(public) if isinstance(public, str) else public
    cases = public + decode_lcb_private(row.get("private_test_cases", []), where)
    fields = _tests_from_lcb(cases, meta.get("func_name") or "", where)
    return {**fields, "text": _lcb_text(row["question_content"], row.get("starter_code") or ""),
            "benchmark": "LiveCodeBench"}


def _deepcoder_row(row: dict, where: str) -> dict:
    """DeepCoder-Preview-Dataset (the paper's "TACO subset of DeepCoder"): problem + tests, a JSON string holding
    TACO's input_output dict (taco subset) or LiveCodeBench's list of cases (lcbv5 subset, func_name in each case's
    metadata); scored by TACO's or LiveCodeBench's rules accordingly."""
    tests = json.loads(row["tests"]) if isinstance(row["tests"], str) else row["tests"]
    if isinstance(tests, dict):
        return {**_tests_from_io(tests, where), "benchmark": "TACO",
                "text": _lcb_text(row["problem"], row.get("starter_code") or "")}
    meta = (tests[0].get("metadata") or {}) if tests and isinstance(tests[0], dict) else {}
    meta = json.loads(meta) if isinstance(meta, str) else meta
    return {**_tests_from_lcb(tests, meta.get("func_name") or "", where), "benchmark": "LiveCodeBench",
            "text": _lcb_text(row["problem"], row.get("starter_code") or "")}


def _evalplus_row(row: dict, where: str) -> dict:
    """An EvalPlus record (HumanEval+ "HumanEval/N", MBPP+ "Mbpp/N"): the reference is prompt + canonical_solution."""
    for key, typ in (("base_input", list), ("plus_input", list), ("canonical_solution", str), ("entry_point", str)):
        if not isinstance(row.get(key), typ):
            raise ValueError(f"{where}: EvalPlus field '{key}' must be a {typ.__name__}")
    mbpp = str(row.get("task_id", "")).startswith("Mbpp/")
    text = ("Please provide a self-contained Python script that solves the following problem in a markdown code "
            f"block:\n```\n{row['prompt'].strip()}\n```\n")
    spec = {"entry_point": row["entry_point"], "reference": row["prompt"] + row["canonical_solution"],
            "base_input": row["base_input"], "plus_input": row["plus_input"], "atol": float(row.get("atol") or 0),
            "dataset": "mbpp" if mbpp else "humaneval", "expected": None}
    return {"text": text, "evalplus": spec, "benchmark": "MBPP+" if mbpp else "HumanEval+"}


def problem_from_row(row: dict, where: str) -> CodeProblem:
    """One JSONL row in any of six layouts, told apart by their field names:
    ours (task_id, text, tests / asserts / calls), TACO (question, input_output, starter_code), LiveCodeBench
    (question_content, public/private_test_cases, metadata, starter_code), DeepCoder (problem, tests), EvalPlus
    HumanEval+ / MBPP+ (prompt, canonical_solution, base_input, plus_input, atol, entry_point), HumanEval (prompt,
    test, entry_point)."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if "text" in row:
        tests = row.get("tests", [])
        if not isinstance(tests, list) or any(not isinstance(t, dict) or set(t) != {"input", "output"} for t in tests):
            raise ValueError(f"{where}: field 'tests' must be a list of {{\"input\", \"output\"}} objects")
        fields = {k: row[k] for k in ("text", "tests", "asserts", "benchmark", "fn_name", "calls", "evalplus")
                  if k in row}
    elif "question" in row and "input_output" in row:
        fields = {**_tests_from_io(row["input_output"], where), "benchmark": "TACO",
                  "text": _lcb_text(row["question"], row.get("starter_code") or "")}
    elif "question_content" in row:
        fields = _lcb_row(row, where)
    elif "problem" in row and "tests" in row:
        fields = _deepcoder_row(row, where)
    elif {"prompt", "entry_point", "canonical_solution", "base_input", "plus_input"} <= set(row):
        fields = _evalplus_row(row, where)
    elif {"prompt", "test", "entry_point"} <= set(row):
        fields = {"asserts": row["test"] + f"\n\ncheck({row['entry_point']})\n", "text": row["prompt"],
                  "benchmark": "HumanEval"}
    else:
        raise ValueError(f"{where}: no known problem layout (need 'text', or TACO's 'question' + 'input_output', "
                         f"LiveCodeBench's 'question_content', DeepCoder's 'problem' + 'tests', EvalPlus's "
                         f"'prompt' + 'canonical_solution' + "
                         f"'base_input' + 'plus_input' + 'entry_point', or HumanEval's 'prompt' + 'test' + "
                         f"'entry_point')")
    if not isinstance(fields.get("text"), str) or not fields["text"].strip():
        raise ValueError(f"{where}: the problem statement is empty")
    if not (fields.get("tests") or fields.get("asserts") or fields.get("calls") or fields.get("evalplus")):
        raise ValueError(f"{where}: the problem has no tests")
    if fields.get("asserts"):       # counted and instrumented by our own parse (`instrument_test`): it must parse
        if not isinstance(fields["asserts"], str):
            raise ValueError(f"{where}: the test code must be a string")
        try:
            instrument_test(fields["asserts"])
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    task_id = str(row.get("task_id", row.get("question_id", row.get("id", where))))
    return CodeProblem(task_id, schema=str(row.get("schema", "")), variant=str(row.get("variant", "")), **fields)


def save_problems(problems, path: str) -> None:
    """Write problems as JSONL in our layout (what `load_problems` reads back). EvalPlus expected outputs are left
    out (JSON would turn their tuples into lists): load_problems recomputes or reads them from its cache."""
    rows = [asdict(p) for p in problems]
    for row in rows:
        if row["evalplus"]:
            row["evalplus"]["expected"] = None
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def load_problems(path: str, limits: SandboxLimits | None = None) -> list[CodeProblem]:
    """Read code problems from JSONL; a bad line raises ValueError naming `path:line` and the reason.
    EvalPlus problems get their expected outputs here: from the cache PATH.expected.json next to the file, else run
    once in the sandbox (the canonical solution on every input) and cached there (`evalplus_expected`)."""
    problems = read_jsonl(path, problem_from_row)
    if any(p.evalplus for p in problems):
        evalplus_expected(problems, path + ".expected.json", limits or SandboxLimits())
    return problems


def _same_output(got: str, want: str) -> bool:
    """Outputs match up to trailing whitespace on each line and trailing blank lines (ours and TACO's stdin tests)."""
    norm = lambda s: "\n".join(line.rstrip() for line in s.strip("\n").splitlines()).strip()   # noqa: E731
    return norm(got) == norm(want)


def _lcb_same_output(got: str, want: str) -> bool:
    """LiveCodeBench's stdin rule (testing_util.py, grade_stdio): stripped lines, as many as expected, each equal as
    text or as a list of Decimals ("2.50" == "2.5", but "2.5000001" != "2.5")."""
    lines = lambda s: [x.strip() for x in s.strip().split("\n")]   # noqa: E731
    got_lines, want_lines = lines(got), lines(want)
    if len(got_lines) != len(want_lines):
        return False
    for a, b in zip(got_lines, want_lines):
        if a == b:
            continue
        try:
            if [Decimal(x) for x in a.split()] != [Decimal(x) for x in b.split()]:
                return False
        except ArithmeticError:     # decimal.InvalidOperation: not numbers
            return False
    return True


# -- the verdict's wire: what the harness reads back from a sandboxed run --------------------------------------------
# A program never decides its own verdict: its exit code counts for nothing, and values are compared by the harness.
# Call-based results travel back as JSON with tags for what JSON lacks (`_encode`); only plain values pass, rebuilt
# from their base types, so a result object with its own __eq__ (or an int subclass) cannot pass for the expected
# value, and the comparison is done here, outside the sandbox. The asserts path rebuilds every value the program's
# functions return the same way, inside the sandbox, before the test sees it (`ASSERTS_DRIVER`).
# A report line starts with a fresh random nonce: the program never sees it through its stdin (the driver reads all of
# it, then puts /dev/null in its place) or its stdout (it writes into a buffer). A program could still dig the nonce
# out of the driver's frames: the sandbox bounds what a program can do to the machine, not how hard it tries to cheat
# the verdict from inside (as for the official harnesses). So whatever line comes back, well-formed or forged, is read
# totally: a malformed answer is a failed test with a reason, never an exception in the trainer.
def _encode(x):
    """A plain value -> JSON with tags (tuple, set, frozenset, dict, complex, bytes); TypeError for anything else."""
    if x is None or type(x) is bool:
        return x
    for base, plain in ((int, int.__int__), (float, float.__float__), (str, str.__str__)):
        if isinstance(x, base):
            return plain(x)     # the base type's own copy: a subclass's __eq__, __int__ or __str__ stays behind
    if isinstance(x, list):
        return [_encode(v) for v in x]
    for base, tag in ((tuple, "tuple"), (frozenset, "frozenset"), (set, "set")):
        if isinstance(x, base):
            return {tag: [_encode(v) for v in x]}
    if isinstance(x, dict):
        return {"dict": [[_encode(k), _encode(v)] for k, v in x.items()]}
    if isinstance(x, complex):
        return {"complex": [x.real, x.imag]}
    if isinstance(x, bytes):
        return {"bytes": bytes(x).decode("latin-1")}
    if hasattr(x, "tolist") and type(x).__module__.startswith("numpy"):     # numpy arrays and scalars
        return _encode(x.tolist())
    raise TypeError(f"a {type(x).__name__} result cannot be compared")


def _decode(x):
    """The inverse of _encode."""
    if isinstance(x, list):
        return [_decode(v) for v in x]
    if not isinstance(x, dict):
        return x
    (tag, v), = x.items()
    if tag == "dict":
        return {_decode(k): _decode(val) for k, val in v}
    return {"tuple": lambda: tuple(map(_decode, v)), "set": lambda: set(map(_decode, v)),
            "frozenset": lambda: frozenset(map(_decode, v)), "complex": lambda: complex(*v),
            "bytes": lambda: v.encode("latin-1")}[tag]()


CALL_DRIVER = r'''
import io, json, os, signal, sys, time
spec = json.loads(sys.stdin.read())
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)   # stdin is a file: the spec (and its nonce) cannot be read again
sys.stdin = io.StringIO("")
real_stdout = sys.stdout
{codec}
def _time_up(signum, frame):
    raise TimeoutError("time limit")
def _report(results):
    real_stdout.write(spec["nonce"] + json.dumps(results) + "\n")
    real_stdout.flush()
signal.signal(signal.SIGALRM, _time_up)
sys.stdout = io.StringIO()                    # what the program prints is not its answer
module = {"__name__": "solution"}
try:
    signal.setitimer(signal.ITIMER_REAL, spec["load_s"])
    exec(compile(spec["prelude"] + spec["code"], "solution.py", "exec"), module)
    signal.setitimer(signal.ITIMER_REAL, 0)
    if spec["method"] and "class Solution" in spec["code"]:
        fn = getattr(module["Solution"](), spec["fn_name"])
    else:
        fn = module[spec["fn_name"]]
except BaseException as e:
    signal.setitimer(signal.ITIMER_REAL, 0)
    _report([{"error": "cannot load %s: %s: %s" % (spec["fn_name"], type(e).__name__, str(e)[:200]), "load": 1}])
    raise SystemExit(0)
results = []
for args, limit in zip(spec["inputs"], spec["limits"]):
    try:
        args = _decode(args)
        signal.setitimer(signal.ITIMER_REAL, limit)
        t0 = time.perf_counter()
        out = fn(*args)
        took = time.perf_counter() - t0
        signal.setitimer(signal.ITIMER_REAL, 0)
        if spec["not_none"] == "all" or (spec["not_none"] == "non-bool" and type(out) is not bool):
            out = out is not None
        results.append({"out": _encode(out), "s": took})
    except BaseException as e:
        signal.setitimer(signal.ITIMER_REAL, 0)
        results.append({"error": "%s: %s" % (type(e).__name__, str(e)[:200])})
        break
_report(results)
'''


@functools.lru_cache(maxsize=None)
def _with_codec(driver: str) -> str:
    """A driver with the codec's source in place of {codec}: the child encodes and decodes as the harness does."""
    return driver.replace("{codec}", inspect.getsource(_encode) + "\n" + inspect.getsource(_decode))


def _nonce_line(stdout: str, nonce: str) -> str | None:
    """What follows the nonce on the last line of a run's stdout that starts with it, or None."""
    line = next((x for x in reversed(stdout.splitlines()) if x.startswith(nonce)), None)
    return None if line is None else line[len(nonce):]


def run_calls(code: str, fn_name: str, inputs: list, limits: SandboxLimits = SandboxLimits(), per_call=None,
              prelude: str = "", method: bool = True, not_none: str = "") -> tuple[list | None, str]:
    """Load `code` (after `prelude`) in the sandbox and call fn_name(*args) for each args in `inputs` (plain values),
    on Solution() if `method` and the code has that class; stops at the first error.
    -> ([{"out": value, "s": seconds} | {"error": str}], "") or (None, why no result came back); a program that
    does not load (or lacks fn_name) gives [{"error": "cannot load ...", "load": 1}]. A result line that is not the
    driver's (forged, cut, nested past the stack) is (None, why): never an exception.
    per_call: seconds allowed per call (default limits.wall_s each); the run's own limits grow with their sum.
    not_none: "all" reports `out is not None`, "non-bool" does so unless out is a bool (EvalPlus's MBPP oracles)."""
    per_call = list(per_call) if per_call is not None else [limits.wall_s] * len(inputs)
    nonce = secrets.token_hex(16)
    spec = {"nonce": nonce, "code": code, "prelude": prelude, "fn_name": fn_name, "method": method,
            "inputs": [_encode(a) for a in inputs], "limits": per_call, "load_s": limits.wall_s, "not_none": not_none}
    total = limits.wall_s + sum(per_call)
    run_limits = dataclasses.replace(limits, wall_s=total, cpu_s=int(math.ceil(total)) + 1,
                                     output_kb=max(limits.output_kb, 64 << 10))
    r = run_sandboxed(_with_codec(CALL_DRIVER), json.dumps(spec), run_limits)
    line = _nonce_line(r.stdout, nonce)
    if line is None:
        return None, r.status + (f" ({_last_line(r.stderr)})" if r.stderr else "")
    return _read_results(line)


def _read_results(line: str) -> tuple[list | None, str]:
    """The driver's JSON list of results, each checked and decoded -> (results, "") or (None, why it is malformed)."""
    try:
        raw = json.loads(line)
    except (ValueError, RecursionError) as e:       # not JSON, or nested past the parser's stack
        return None, f"malformed result line ({type(e).__name__})"
    if not isinstance(raw, list):
        return None, f"malformed result line (a {type(raw).__name__}, not a list)"
    results = [_read_result(x) for x in raw]
    if any(r is None for r in results):
        return None, "malformed result line (a result that is neither a value nor an error)"
    return results, ""


def _read_result(x) -> dict | None:
    """{"out": decoded value, "s": seconds} or {"error": str[, "load": 1]}, as the driver writes them; else None."""
    if isinstance(x, dict) and set(x) <= {"error", "load"} and isinstance(x.get("error"), str):
        return {"error": x["error"], **({"load": 1} if x.get("load") == 1 else {})}
    if not (isinstance(x, dict) and set(x) == {"out", "s"} and type(x["s"]) in (int, float)
            and math.isfinite(x["s"]) and x["s"] >= 0):
        return None
    try:
        return {"out": _decode(x["out"]), "s": float(x["s"])}
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError):   # tags or shapes _encode never writes
        return None


def _lcb_call_ok(out, want) -> bool:
    """LiveCodeBench (testing_util.py, grade_call_based): a tuple counts as a list; then exact equality."""
    return (list(out) if isinstance(out, tuple) else out) == want


def _taco_call_ok(out, want) -> bool:
    """TACO (metrics/testing_util.py, execute_cb_code): a tuple counts as a list; out == output, or out == output[0]
    (TACO often wraps a return value in a list), or a list of tuples as lists == output[0]."""
    out = list(out) if isinstance(out, tuple) else out
    want = _int_keys(want)
    if out == want or (isinstance(want, list) and want and out == _int_keys(want[0])):
        return True
    try:        # TACO's own try: a list whose later items are not sequences is simply not equal
        if isinstance(out, list) and out and isinstance(out[0], tuple) and isinstance(want, list) and want:
            return [list(x) for x in out] == want[0]
    except TypeError:
        pass
    return False


def _judged(rule, *args) -> bool:
    """rule(*args) on values the program chose: one nested past the stack, an int too large for a float, or a shape
    the rule did not expect is a wrong answer, not an exception in the trainer."""
    try:
        return bool(rule(*args))
    except (RecursionError, OverflowError, TypeError, ValueError):
        return False


def _verify_calls(problem: CodeProblem, code: str, limits: SandboxLimits) -> tuple[bool, str]:
    taco = problem.benchmark == "TACO"
    args = [[_int_keys(a[0])] + a[1:] if taco and a else a for a, _ in problem.calls]
    results, why = run_calls(code, problem.fn_name, args, limits, prelude=PRELUDES.get(problem.benchmark, ""))
    if results is None:
        return False, f"no result: {why}"
    if results and results[0].get("load"):
        return False, results[0]["error"]
    same = _taco_call_ok if taco else _lcb_call_ok
    for i, (res, (_, want)) in enumerate(zip(results, problem.calls)):
        if "error" in res:
            return False, f"test {i}: {res['error']}"
        if not _judged(same, res["out"], want):
            return False, f"test {i}: wrong answer"
    return (True, "all tests passed") if len(results) == len(problem.calls) else (False, "missing results")


# -- asserts: HumanEval's check() and our `asserts`, with the verdict taken by the harness ---------------------------
# The test code runs after the program, as the releases run it, but inside a driver that decides the verdict itself:
# every assert statement (counted here, by our own parse of the test) must report that it passed, and the test must
# run to its end. Exiting early with code 0 (sys.exit, os._exit, an atexit hook), or an exit code forced after a failed
# assert, leaves reports missing; every value the functions the test names hand it is rebuilt as a plain value first.
ASSERT_HOOK = "__lopd_assert__"     # the name the instrumented test calls; the driver binds it after the program ran

ASSERTS_DRIVER = r"""
import builtins, io, json, os, sys
spec = json.loads(sys.stdin.read())
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)   # stdin is a file: the spec (and its nonce) cannot be read again
nonce, write, settrace, setprofile = spec.pop("nonce"), os.write, sys.settrace, sys.setprofile
harness_builtins = dict(vars(builtins))
__builtins__ = harness_builtins   # the functions below keep these, whatever the program does to the builtins module
{codec}
def say(text):
    write(1, (nonce + text.replace("\n", " ") + "\n").encode("utf-8", "replace"))
def why(e):
    try:
        text = str(e)[:200]
    except BaseException:
        text = ""
    return type(e).__name__ + (": " + text if text else "")
def plain(fn):
    def candidate(*args, **kwargs):
        return _decode(_encode(fn(*args, **kwargs)))
    return candidate
def test_namespace(module, seen):
    ns = {k: v for k, v in module.items() if k not in harness_builtins or k == spec["fn_name"]}
    for name in spec["wrap"]:
        if name in ns and callable(ns[name]):
            ns[name] = plain(ns[name])
    def passed(i, condition):
        if condition:
            seen.add(i)
            return True
        return False
    ns.update(__name__="__main__", __builtins__=dict(harness_builtins), **{spec["hook"]: passed})
    return ns
def main():
    sys.stdin, sys.stdout = io.StringIO(""), io.StringIO()
    module = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(spec["code"], "solution.py", "exec"), module)
    except BaseException as e:
        return say("error the program does not load: " + why(e))
    seen = set()
    ns = test_namespace(module, seen)
    settrace(None)
    setprofile(None)
    try:
        exec(compile(spec["test"], "test.py", "exec"), ns)
    except BaseException as e:
        return say("error " + why(e))
    line = "done"
    for i in sorted(seen):
        line += " %d" % i
    say(line)
main()
"""


@functools.lru_cache(maxsize=1024)
def instrument_test(test: str) -> tuple[str, int, tuple]:
    """The test code with each assert's condition passed through the driver's recorder (`assert c, m` becomes
    `assert __lopd_assert__(i, c), m`: the record is made inside the assert, so no jump between lines can keep the
    record and skip the check) -> (that source, the number of assert statements, the names the test reads: the
    program's functions among them return plain values). ValueError if the test is not Python."""
    try:
        tree = ast.parse(test)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ValueError(f"the test code cannot be parsed ({type(e).__name__}: {e})") from None
    names = sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)})
    asserts = [node for node in ast.walk(tree) if isinstance(node, ast.Assert)]
    for i, node in enumerate(asserts):
        node.test = ast.Call(ast.Name(ASSERT_HOOK, ast.Load()), [ast.Constant(i), node.test], [])
    return ast.unparse(ast.fix_missing_locations(tree)), len(asserts), tuple(names)


def _verify_asserts(problem: CodeProblem, code: str, limits: SandboxLimits) -> tuple[bool, str]:
    """The program, then its test, in ASSERTS_DRIVER: passed only if the driver reports the test's end and every
    assert statement passed at least once, and the run ended cleanly. The test names the functions it calls (the
    entry point, through check(entry_point)); fn_name, where given, is one of them."""
    try:
        test, n_asserts, names = instrument_test(problem.asserts)
    except ValueError as e:
        raise ValueError(f"{problem.task_id}: {e}") from None       # the release's test, not the program: ours to fix
    nonce = secrets.token_hex(16)
    spec = {"nonce": nonce, "code": code, "test": test, "hook": ASSERT_HOOK, "fn_name": problem.fn_name,
            "wrap": sorted(set(names) | {problem.fn_name} - {""})}
    r = run_sandboxed(_with_codec(ASSERTS_DRIVER), json.dumps(spec), limits)
    return _asserts_verdict(_nonce_line(r.stdout, nonce), n_asserts, r)


def _asserts_verdict(report: str | None, n_asserts: int, r: RunResult) -> tuple[bool, str]:
    """The driver's report (what followed the nonce; None if no line had it) and the run `r` -> (passed, reason)."""
    if report is None:
        return False, f"asserts: no report from the harness (the run: {r.status}" + (
            f", {_last_line(r.stderr)})" if r.stderr.strip() else ")")
    kind, _, rest = report.partition(" ")
    if kind == "error":
        return False, f"asserts: {rest}"
    seen = _indices(rest) if kind == "done" else None
    if seen is None:
        return False, "asserts: a malformed report"
    missing = n_asserts - len(seen & set(range(n_asserts)))
    if missing:
        return False, f"asserts: {missing} of {n_asserts} assert statements never passed"
    if r.status != "ok":
        return False, f"asserts: the run ended {r.status} after the test"
    return True, "all tests passed"


def _indices(text: str) -> set | None:
    """The assert numbers of a "done" report, or None where it holds anything but numbers."""
    try:
        return {int(x) for x in text.split()}
    except ValueError:
        return None


# -- EvalPlus: diff-testing against the canonical solution (evalplus/evaluate.py, eval/__init__.py) ----------------
MBPP_SET_EQ = ("similar_elements", "find_char_long", "common_in_nested_lists", "extract_singly", "larg_nnum",
               "intersection_array", "find_dissimilar", "Diff")     # eval/_special_oracle.py: compared as sets
MBPP_NOT_NONE = ("check_str", "text_match_three", "text_starta_endb")  # only "is the result not None" is compared


def _is_floats(x) -> bool:
    return isinstance(x, float) or (isinstance(x, (list, tuple)) and bool(x) and all(isinstance(v, float) for v in x))


def _close(out, exp, atol: float) -> bool:
    """np.allclose(out, exp, rtol=1e-7, atol) for numbers and (nested) lists of numbers of equal shape."""
    if isinstance(exp, (list, tuple)):
        return isinstance(out, (list, tuple)) and len(out) == len(exp) and all(
            _close(o, e, atol) for o, e in zip(out, exp))
    try:
        return abs(out - exp) <= atol + 1e-7 * abs(exp)
    except (TypeError, OverflowError):      # not a number, or an int no float can hold
        return False


def _evalplus_ok(out, exp, args, atol: float, spec: dict) -> bool:
    """One input, EvalPlus's rule (eval/__init__.py, unsafe_execute) with the special oracles that need no code of
    their own: MBPP set comparisons, HumanEval find_zero (|poly(xs, out)| <= atol), MBPP are_equivalent / sum_div."""
    entry, mbpp = spec["entry_point"], spec["dataset"] == "mbpp"
    exact = out == exp
    if mbpp and entry == "are_equivalent":
        return True
    if mbpp and entry == "sum_div":
        exact = exact or out == 0
    if mbpp and entry in MBPP_SET_EQ:
        try:
            exact = set(out) == set(exp)
        except TypeError:
            return False
    if not mbpp and entry == "find_zero":
        try:
            return abs(sum(c * math.pow(out, i) for i, c in enumerate(args[0]))) <= atol
        except (TypeError, ValueError, OverflowError):
            return False
    if atol == 0 and _is_floats(exp):
        atol = 1e-6
    if exact or atol == 0:
        return bool(exact)
    same_shape = type(out) is type(exp) and (not isinstance(exp, (list, tuple)) or len(out) == len(exp))
    return same_shape and _close(out, exp, atol)


def _evalplus_key(spec: dict) -> str:
    import hashlib
    blob = json.dumps([spec["reference"], spec["entry_point"], spec["base_input"], spec["plus_input"]])
    return hashlib.sha256(blob.encode()).hexdigest()


def evalplus_expected(problems, cache_path: str | None, limits: SandboxLimits = SandboxLimits()) -> None:
    """Fill each EvalPlus problem's expected outputs ({"base", "plus", "base_s", "plus_s"}): from the cache file if
    it holds them for the same reference and inputs (a sha256 key), else by running the canonical solution once in
    the sandbox on every input (evaluate.py, get_groundtruth), in parallel; new ones are written back atomically.
    A reference that fails is a bad release file: ValueError naming the task."""
    import os
    from concurrent.futures import ThreadPoolExecutor
    cache = json.load(open(cache_path)) if cache_path and os.path.isfile(cache_path) else {}
    todo = []
    for p in problems:
        if not p.evalplus or p.evalplus.get("expected"):
            continue
        hit = cache.get(p.task_id)
        if hit and hit.get("key") == _evalplus_key(p.evalplus):
            p.evalplus["expected"] = {k: _decode(v) if k in ("base", "plus") else v for k, v in hit.items()
                                      if k != "key"}
        else:
            todo.append(p)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        done = list(pool.map(lambda p: _reference_outputs(p, limits), todo))
    for p, expected in zip(todo, done):
        p.evalplus["expected"] = expected
        cache[p.task_id] = {"key": _evalplus_key(p.evalplus), **{k: _encode(v) if k in ("base", "plus") else v
                                                                 for k, v in expected.items()}}
    if todo and cache_path:
        with checkpoints.atomic_open(cache_path) as f:
            json.dump(cache, f)


def _reference_outputs(p: CodeProblem, limits: SandboxLimits) -> dict:
    """The canonical solution's outputs and seconds on base and plus inputs, from one sandboxed run."""
    spec = p.evalplus
    not_none = "all" if spec["dataset"] == "mbpp" and spec["entry_point"] in MBPP_NOT_NONE else ""
    inputs, n_base = spec["base_input"] + spec["plus_input"], len(spec["base_input"])
    results, why = run_calls(spec["reference"], spec["entry_point"], inputs, limits, method=False, not_none=not_none)
    bad = why or next((r["error"] for r in results if "error" in r), "")
    if bad or len(results) != len(inputs):
        raise ValueError(f"{p.task_id}: the canonical solution fails on its own inputs ({bad or 'missing results'})")
    outs, secs = [r["out"] for r in results], [r["s"] for r in results]
    return {"base": outs[:n_base], "plus": outs[n_base:], "base_s": secs[:n_base], "plus_s": secs[n_base:]}


def _verify_evalplus(problem: CodeProblem, code: str, limits: SandboxLimits) -> tuple[bool, str, dict]:
    """Base inputs, then plus inputs, in one sandboxed run that stops at the first error; plus counts only with
    base (EvalPlus's plus pass@1). Per-input time limit: max(limits.wall_s, 4 x the reference's time) (EvalPlus:
    max(4 s, 4 x)). -> (passed, reason, {"base": bool, "plus": bool})."""
    spec = problem.evalplus
    if not spec.get("expected"):
        spec["expected"] = _reference_outputs(problem, limits)
    exp = spec["expected"]
    not_none = "non-bool" if spec["dataset"] == "mbpp" and spec["entry_point"] in MBPP_NOT_NONE else ""
    inputs, want = spec["base_input"] + spec["plus_input"], exp["base"] + exp["plus"]
    per_call = [max(limits.wall_s, 4 * s) for s in exp["base_s"] + exp["plus_s"]]
    results, why = run_calls(code, spec["entry_point"], inputs, limits, per_call, method=False, not_none=not_none)
    n_base = len(spec["base_input"])
    parts = {"base": n_base == 0, "plus": False}
    if results is None or (results and results[0].get("load")):
        return False, results[0]["error"] if results else f"no result: {why}", parts
    for i, res in enumerate(results):
        part, k = ("base", i) if i < n_base else ("plus", i - n_base)
        if "error" in res:
            return False, f"{part} input {k}: {res['error']}", parts
        if not _judged(_evalplus_ok, res["out"], want[i], inputs[i], spec["atol"], spec):
            return False, f"{part} input {k}: wrong answer", parts
        parts["base"] = i + 1 >= n_base
    if len(results) != len(inputs):
        return False, "missing results", parts
    parts["plus"] = True
    return True, "all tests passed", parts


def verify(problem: CodeProblem, code: str, limits: SandboxLimits = SandboxLimits()) -> tuple[bool, str]:
    """Reward 1 iff every test passes. -> (passed, a one-line reason); stops at the first failure."""
    return verify_detail(problem, code, limits)[:2]


def verify_detail(problem: CodeProblem, code: str, limits: SandboxLimits = SandboxLimits()) -> tuple[bool, str, dict]:
    """verify(), plus the parts EvalPlus reports: {"base": bool, "plus": bool} for HumanEval+ / MBPP+, else {}.
    stdin tests run one per process (LiveCodeBench's rule and prelude for its rows), then asserts after the program;
    call-based tests run in one process (`run_calls`); EvalPlus diff-tests (`_verify_evalplus`). Never raises on
    anything the program does; a release file the harness cannot use (a test that is not Python, a canonical solution
    that fails) is ValueError."""
    try:
        return _verdict(problem, code, limits)
    except RecursionError:      # the readers and comparisons are total; this holds for any path added later
        return False, "the program's values nest too deeply to be judged", {}


def _verdict(problem: CodeProblem, code: str, limits: SandboxLimits) -> tuple[bool, str, dict]:
    if problem.evalplus:
        return _verify_evalplus(problem, code, limits)
    if problem.calls:
        return (*_verify_calls(problem, code, limits), {})
    program = PRELUDES.get(problem.benchmark, "") + code
    same = _lcb_same_output if problem.benchmark == "LiveCodeBench" else _same_output
    for i, t in enumerate(problem.tests):
        r = run_sandboxed(program, t["input"], limits)
        if r.status != "ok":
            return False, f"test {i}: {r.status}" + (f" ({_last_line(r.stderr)})" if r.stderr else ""), {}
        if not same(r.stdout, t["output"]):
            return False, f"test {i}: wrong output", {}
    if problem.asserts:
        return (*_verify_asserts(problem, code, limits), {})
    return True, "all tests passed", {}


def _last_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return lines[-1][:200] if lines else ""


def verify_many(pairs, limits: SandboxLimits = SandboxLimits(), workers: int | None = None) -> list:
    """verify() over [(problem, code)] in parallel, up to the core count (each run is its own process)."""
    import os
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        return list(pool.map(lambda pc: verify(pc[0], pc[1], limits), pairs))
