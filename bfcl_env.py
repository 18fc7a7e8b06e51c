"""BFCL-v3 multi-turn as an environment: the paper's tool-use benchmark (Table 1: base, missing-function,
missing-parameter, long-context; 4 × 200 tasks), run as Berkeley's Function-Calling Leaderboard runs a local model
and scored by BFCL's own checker.

    pip install --no-deps bfcl-eval==2025.7.17            # the optional tier: BFCL's data, API classes and checker
    python eval.py --run DIR --tasks bfcl-v3               # a run's student: each category's accuracy, their mean
    python eval.py --run DIR --tasks bfcl-v3:miss_func     # one category
    python eval.py --run DIR --tasks bfcl-v3:single        # the single-turn Python categories, BFCL's AST checker
    python train.py --model Qwen/Qwen3-4B --env bfcl       # train on BFCL's own tasks (a split of the 800)
    python -m pytest tests/test_bfcl.py -q

Why that release: bfcl-eval 2025.7.17 ships BFCL-v3's last multi-turn files byte for byte; newer releases (named v4)
changed about half of the tasks. Its declared dependencies conflict with ours (numpy, faiss-cpu, vendor SDKs), and
the multi-turn path needs none of them, hence `--no-deps`.

An episode is BFCL's prompting loop for a local model. The task's first user message opens it, with the tools of the
task's API classes listed by the chat template. Each reply's calls run against the task's own instances of those
classes and come back as tool messages; a reply without a call ends the turn, and the next turn's user message
arrives as the observation (`StepResult.user`). In the missing-function category the held-out functions arrive at
their turn in a user message ("I have updated some more functions you can choose from. What about now?", after
their schemas), as BFCL's prompting path sends them; the conversation is never re-rendered. More than `max_steps`
steps in one turn ends the episode as failed (BFCL's forced quit; BFCL's limit is 20, Table 5 of the paper gives 30
max steps, which a real model's run takes from --max-env-steps).

Scoring. BFCL's `multi_turn_checker` re-executes each turn's calls from a fresh state, against the ground truth's,
and checks the instances' state and the execution results after every turn; a task is correct only if every turn
passes. `reward()` is the fraction of turns whose prefix passes (the signal training needs; say so in a table);
`passed` is BFCL's accuracy, which eval.py reports. As in BFCL's runner, a task whose question has fewer turns than
its ground truth cannot pass: multi_turn_base_154 (5 user turns, 6 ground-truth turns) fails for every model, so
799/800 is the ceiling, and the ground truth replayed through this environment reaches it (tests/test_bfcl.py).

Deviations from BFCL's own runner, each for safety or for the learner:
1. Calls are executed from the parsed name and arguments (envs.parse_tool_calls), never from a string: a name must
   be one of the task's functions (its API classes' function docs), and a call of anything else, `__import__`
   included, is an error observation that the checker never sees. BFCL's executor `eval`s call strings; its checker
   still does, on strings this file builds with `repr` of the parsed JSON values (`call_string`), so nothing the
   model wrote reaches `eval` as code. A held-out function called before its turn runs, as it does in BFCL (the
   ground truth of miss_func_49 calls `tail` two turns before it is listed).
2. A reply whose call does not parse gets an error observation and the turn goes on (the project's rule for a
   malformed call); BFCL ends the turn there.
3. The checker caches instances in its module's globals by (model name, task id, class): every check uses a name of
   its own and removes its instances afterwards, so episodes never share state. `BFCL_PROJECT_ROOT` points at a
   scratch folder, so importing BFCL writes nothing into site-packages.
4. The paper serves models in BFCL's function-calling mode, where held-out functions are added to the tool list and
   the prompt is rendered again; here they arrive in a user message (BFCL's prompting path), since a conversation
   whose ids were sampled is never re-rendered. The tools of the first turn are the template's, as in FC mode.
"""
from __future__ import annotations

import ast
import copy
import importlib
import importlib.util
import inspect
import itertools
import json
import os
import random
import tempfile
from dataclasses import dataclass, field

import inject
from envs import Environment, StepResult, parse_tool_calls
from runtime import UserError

RELEASE = "2025.7.17"
CATEGORIES = ("base", "miss_func", "miss_param", "long_context")   # BFCL-v3 multi-turn, the paper's four
# BFCL-v3's single-turn Python categories, scored by its AST checker (an evaluation only: `BFCLSingleWorld`)
SINGLE_TURN = ("simple", "multiple", "parallel", "parallel_multiple", "irrelevance", "live_simple", "live_multiple",
               "live_parallel", "live_parallel_multiple", "live_irrelevance", "live_relevance")
INSTALL = f"pip install --no-deps bfcl-eval=={RELEASE}"
MAX_STEPS_PER_TURN = 20                     # BFCL's MAXIMUM_STEP_LIMIT
MORE_FUNCTIONS = "I have updated some more functions you can choose from. What about now?"   # BFCL's wording
# BFCL's type names -> JSON schema's, for the chat template's `tools=` (BFCL writes "dict", "float", "tuple", ...)
JSON_TYPES = {"dict": "object", "float": "number", "tuple": "array", "list": "array", "bool": "boolean",
              "any": "string", "integer": "integer", "number": "number", "string": "string", "boolean": "boolean",
              "array": "array", "object": "object"}
# The class behind each API name, and the file of its function docs (BFCL's own mapping)
CLASSES = {"GorillaFileSystem": ("gorilla_file_system", "gorilla_file_system.json"),
           "MathAPI": ("math_api", "math_api.json"), "MessageAPI": ("message_api", "message_api.json"),
           "TwitterAPI": ("posting_api", "posting_api.json"), "TicketAPI": ("ticket_api", "ticket_api.json"),
           "TradingBot": ("trading_bot", "trading_bot.json"), "TravelAPI": ("travel_booking", "travel_booking.json"),
           "VehicleControlAPI": ("vehicle_control", "vehicle_control.json")}
STATELESS = ("MathAPI",)                    # BFCL builds these without a scenario
_checks = itertools.count()


# ----------------------------------------------------------------------------------------------------------------
# The release's files
# ----------------------------------------------------------------------------------------------------------------
def package_dir() -> str:
    """bfcl_eval's folder, found without importing it; a one-line error naming the install otherwise."""
    os.environ.setdefault("BFCL_PROJECT_ROOT", os.path.join(tempfile.gettempdir(), "lopd-bfcl"))   # deviation 3
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None:
        raise UserError(f"BFCL-v3 needs its data and checker: {INSTALL}")
    return spec.submodule_search_locations[0]


def _jsonl(path: str) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]


@dataclass
class BFCLTask:
    """One BFCL-v3 multi-turn task in the project's task fields (envs.Environment), with BFCL's entry kept whole."""
    task_id: str
    text: str                      # the first user message
    variant: str                   # the category: base | miss_func | miss_param | long_context
    schema: str                    # the API classes it involves, joined (the cold start balances over them)
    entry: dict = field(repr=False)          # question, initial_config, involved_classes, missed_function (names)
    ground_truth: list = field(repr=False)   # per turn, BFCL's call strings


def load_tasks(categories=CATEGORIES) -> list[BFCLTask]:
    """The multi-turn tasks of the given categories, in BFCL's order, with their ground truth."""
    data = os.path.join(package_dir(), "data")
    tasks = []
    for cat in categories:
        if cat not in CATEGORIES:
            raise UserError(f"BFCL-v3 category {cat!r}: expected one of {', '.join(CATEGORIES)} (--tasks bfcl-v3:base)")
        answers = {a["id"]: a["ground_truth"] for a in _jsonl(os.path.join(data, "possible_answer",
                                                                            f"BFCL_v3_multi_turn_{cat}.json"))}
        for e in _jsonl(os.path.join(data, f"BFCL_v3_multi_turn_{cat}.json")):
            first, classes = e["question"][0][-1]["content"], "+".join(sorted(e["involved_classes"]))
            tasks.append(BFCLTask(e["id"], first, cat, classes, e, answers[e["id"]]))
    return tasks


def load_single_turn(categories=SINGLE_TURN) -> list[BFCLTask]:
    """The single-turn tasks of the given categories, with their possible answers ([] for the irrelevance and
    relevance categories, which have none)."""
    data = os.path.join(package_dir(), "data")
    tasks = []
    for cat in categories:
        if cat not in SINGLE_TURN:
            raise UserError(f"BFCL-v3 single-turn category {cat!r}: expected one of {', '.join(SINGLE_TURN)}")
        path = os.path.join(data, "possible_answer", f"BFCL_v3_{cat}.json")
        answers = {a["id"]: a["ground_truth"] for a in _jsonl(path)} if os.path.isfile(path) else {}
        for e in _jsonl(os.path.join(data, f"BFCL_v3_{cat}.json")):
            tasks.append(BFCLTask(e["id"], e["question"][0][-1]["content"], cat, cat, e, answers.get(e["id"], [])))
    return tasks


def ast_check(task: BFCLTask, calls: list) -> bool:
    """BFCL's verdict on one single-turn reply's parsed calls [(name, arguments)]: irrelevance is right when the
    reply makes no call, live_relevance when it makes one; every other category goes to BFCL's `ast_checker`. Its
    module imports every vendor SDK through `constants.model_config` for one flag (whether a model's function names
    had "." turned into "_"); a stub module with that flag off for our name stands in, so nothing else is imported."""
    if "irrelevance" in task.variant:
        return not calls
    if task.variant == "live_relevance":
        return bool(calls)
    package_dir()
    import sys
    import types
    if "bfcl_eval.constants.model_config" not in sys.modules:
        stub = types.ModuleType("bfcl_eval.constants.model_config")
        stub.MODEL_CONFIG_MAPPING = {"lopd": types.SimpleNamespace(underscore_to_dot=False)}
        sys.modules[stub.__name__] = stub
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker
    output = [{name: args} for name, args in calls]
    return bool(ast_checker(task.entry["function"], output, task.ground_truth, "Python", task.variant, "lopd")["valid"])


def function_docs(class_name: str) -> list[dict]:
    """BFCL's function docs of one API class (name, description, parameters in BFCL's types)."""
    return _jsonl(os.path.join(package_dir(), "data", "multi_turn_func_doc", CLASSES[class_name][1]))


def schema(doc: dict) -> dict:
    """One BFCL function doc as the JSON-schema tool a chat template takes (`tools=`)."""
    def convert(p):
        out = {k: v for k, v in p.items() if k not in ("type", "properties", "items")}
        if "type" in p:
            out["type"] = JSON_TYPES.get(p["type"], "string")
        if "properties" in p:
            out["properties"] = {k: convert(v) for k, v in p["properties"].items()}
        if "items" in p:
            out["items"] = convert(p["items"])
        return out
    return {"type": "function", "function": {"name": doc["name"], "description": doc["description"],
                                             "parameters": convert(doc["parameters"])}}


def instances(entry: dict) -> dict:
    """Fresh instances of the task's API classes, loaded with its initial configuration: {class name: instance}."""
    module = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code."
    out, long = {}, "long_context" in entry["id"]
    for name in entry["involved_classes"]:
        obj = getattr(importlib.import_module(module + CLASSES[name][0]), name)()
        if name not in STATELESS:
            obj._load_scenario(copy.deepcopy(entry["initial_config"].get(name, {})), long_context=long)
        out[name] = obj
    return out


def public_methods(objects: dict) -> dict:
    """{method name: bound method} of the instances' public methods (BFCL's function names)."""
    return {n: m for obj in objects.values() for n, m in inspect.getmembers(obj, inspect.ismethod)
            if not n.startswith("_")}


def call_string(name: str, args: dict) -> str:
    """A parsed call as the string BFCL's checker reads: the name checked by the caller, values by `repr` of JSON
    values (str, numbers, booleans, None, lists, dicts), so the string is a literal call and nothing else."""
    return f"{name}(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")"


def ground_truth_calls(task: BFCLTask) -> list[list[tuple[str, dict]]]:
    """The ground truth as (name, keyword arguments) per turn: BFCL's strings read with `ast` (literals only), their
    positional arguments named from the method's signature. What a reply carrying the ground truth calls."""
    methods, turns = public_methods(instances(task.entry)), []
    for calls in task.ground_truth:
        turn = []
        for text in calls:
            node = ast.parse(text, mode="eval").body
            args = [ast.literal_eval(a) for a in node.args]
            kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            bound = inspect.signature(methods[node.func.id]).bind(*args, **kwargs)
            turn.append((node.func.id, dict(bound.arguments)))
        turns.append(turn)
    return turns


def check(task: BFCLTask, decoded: list) -> dict:
    """BFCL's multi_turn_checker on decoded calls (per turn, per step, a list of call strings) -> its verdict
    {"valid": bool, ...}. Each check runs under a model name of its own and drops its cached instances afterwards."""
    package_dir()
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker
    name = f"lopd_{os.getpid()}_{next(_checks)}"
    try:
        return multi_turn_checker(decoded, task.ground_truth, task.entry, task.variant, name)
    finally:
        cache = vars(multi_turn_utils)
        for key in [k for k in cache if k.startswith(name)]:
            del cache[key]


# ----------------------------------------------------------------------------------------------------------------
# The environment
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class BFCLWorld(Environment):
    """A BFCL-v3 multi-turn task as an episode (the module docstring says how it runs and how it is scored)."""
    system_prompt: str = ""
    framing: tuple = inject.AGENTIC_FRAMING
    results: str = "behaviour"
    log: dict | None = None        # task_id -> {"passed", "turns_passed", "turns"} once an episode is scored (eval.py)
    task: BFCLTask | None = None
    max_steps: int = MAX_STEPS_PER_TURN     # steps a turn may take before BFCL's forced quit

    def reset(self, task: BFCLTask) -> list[dict]:
        self.task, self.trace, self.turn, self.steps_in_turn, self.quit = task, [], 0, 0, False
        self.methods = public_methods(instances(task.entry))
        held = {n for names in task.entry.get("missed_function", {}).values() for n in names}
        self.docs = {d["name"]: d for c in task.entry["involved_classes"] for d in function_docs(c)}
        self.listed = [n for n in self.docs if n not in held]     # what the prompt lists so far
        self.tools = [schema(self.docs[n]) for n in self.listed]
        self.decoded = [[] for _ in task.ground_truth]           # per turn, per step: the call strings executed
        return [m for m in task.entry["question"][0]]

    def step(self, reply: str) -> StepResult:
        calls = parse_tool_calls(reply, self.response_template)
        if not calls:                                             # the turn is over: the next user message, if any
            return self._next_turn()
        self.steps_in_turn += 1
        if self.steps_in_turn > self.max_steps:                   # BFCL's forced quit fails the task
            self.quit = True
            return StepResult([f"Model has been forced to quit after {self.max_steps} steps."], True, 0, 1)
        observations, errors, executed = [], 0, []
        for name, args in calls:
            if name is None:                                      # a call that did not parse: args is the error
                observations, errors = observations + [f"Error: {args}"], errors + 1
            elif name not in self.docs:                           # deviation 1: never executed, never checked
                observations.append(f"Error: no function {name!r} is available; the functions are "
                                    f"{', '.join(self.listed)}")
                errors += 1
            else:
                text, ok = self._execute(name, args)
                observations, errors = observations + [text], errors + (not ok)
                executed.append(call_string(name, args))          # BFCL's checker runs it again, from the string
        self.decoded[self.turn].append(executed)
        return StepResult(observations, False, len(calls), errors)

    def _execute(self, name: str, args: dict) -> tuple[str, bool]:
        """One of the task's functions called on its instances -> (its result as text, ran without error?)."""
        try:
            result = self.methods[name](**args)
            text, ok = (result if isinstance(result, str) else _dumps(result)), True
        except Exception as err:                                  # a wrong argument is the model's mistake
            text, ok = f"Error during execution: {err}", False
        self.trace.append((name, args, text))
        return text, ok

    def _next_turn(self) -> StepResult:
        self.turn, self.steps_in_turn = self.turn + 1, 0
        if self.turn >= len(self.task.entry["question"]):
            return StepResult([], True)
        arriving = self.task.entry.get("missed_function", {}).get(str(self.turn), [])
        if arriving:                                              # held-out functions arrive in a user message
            self.listed += arriving
            user = json.dumps([schema(self.docs[n]) for n in arriving]) + "\n" + MORE_FUNCTIONS
        else:
            user = "\n".join(m["content"] for m in self.task.entry["question"][self.turn])
        return StepResult([], False, user=user)

    def reward(self) -> float:
        """The fraction of turns whose prefix BFCL's checker passes (0 after a forced quit); BFCL's verdict on the
        whole task goes to `log`."""
        turns = len(self.task.ground_truth)
        passed = [not self.quit and check(self._prefix(k + 1), self.decoded[:k + 1])["valid"] for k in range(turns)]
        if self.log is not None:
            self.log[self.task.task_id] = {"passed": bool(passed[-1]), "turns_passed": sum(passed), "turns": turns}
        return sum(passed) / turns

    def _prefix(self, k: int) -> BFCLTask:
        """The task cut to its first k turns, for the checker."""
        entry = {**self.task.entry, "question": self.task.entry["question"][:k]}
        return BFCLTask(self.task.task_id, self.task.text, self.task.variant, self.task.schema, entry,
                        self.task.ground_truth[:k])

    def trace_text(self) -> str:
        return "\n".join(f"{i + 1}. {call_string(n, a)} -> {str(r)[:200]}" for i, (n, a, r) in enumerate(self.trace))

    def oracle_trace(self, task) -> str:
        return "\n".join(call_string(n, a) for turn in ground_truth_calls(task) for n, a in turn)

    # -- the run --------------------------------------------------------------------------------------------------
    @classmethod
    def for_run(cls, args, toy: bool) -> "BFCLWorld":
        return cls(max_steps=args.max_env_steps or MAX_STEPS_PER_TURN)    # a real model: B.3's 30

    @classmethod
    def make_splits(cls, args) -> tuple[list, list]:
        """All 800 multi-turn tasks, shuffled by the seed: the first --n-test held out, up to --n-train of the rest."""
        tasks = load_tasks()
        random.Random(args.seed).shuffle(tasks)
        return tasks[args.n_test:args.n_test + args.n_train], tasks[:args.n_test]

    @classmethod
    def check_args(cls, args) -> str | None:
        if args.tasks:
            return "--env bfcl reads BFCL's own files; leave --tasks out (eval.py --tasks bfcl-v3 evaluates a run)"
        try:
            package_dir()
        except UserError as err:
            return f"--env bfcl: {err}"
        return super().check_args(args)


@dataclass
class BFCLSingleWorld(Environment):
    """A BFCL-v3 single-turn task: the question with its functions listed, one reply, BFCL's AST verdict as reward
    (`ast_check`). A reply whose call does not parse counts as no call, as BFCL's decoding failure does."""
    framing: tuple = inject.AGENTIC_FRAMING
    log: dict | None = None        # task_id -> {"passed", "turns_passed", "turns"}, as BFCLWorld's (eval.py)
    task: BFCLTask | None = None

    def reset(self, task: BFCLTask) -> list[dict]:
        self.task, self.trace, self.passed = task, [], False
        self.tools = [schema(d) for d in task.entry["function"]]
        return list(task.entry["question"][0])

    def step(self, reply: str) -> StepResult:
        calls = [(n, a) for n, a in parse_tool_calls(reply, self.response_template) if n is not None]
        self.trace = [(n, a, "") for n, a in calls]
        self.passed = ast_check(self.task, calls)
        return StepResult([], True, len(calls), 0)

    def reward(self) -> float:
        if self.log is not None:
            self.log[self.task.task_id] = {"passed": self.passed, "turns_passed": int(self.passed), "turns": 1}
        return float(self.passed)


def _dumps(result) -> str:
    """A tool's result as BFCL passes it on: a dict as JSON where it can be, anything else as str()."""
    if isinstance(result, dict):
        try:
            return json.dumps(result)
        except (TypeError, ValueError):
            return str(result)
    return str(result)
