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
steps in one turn ends the episode as failed, reward 0 whatever turns passed before it (BFCL's forced quit, which its
multi-turn checker scores as a failed task; BFCL's limit is 20, Table 5 of the paper gives 30 max steps, which a
real model's run takes from --max-env-steps).

Scoring. BFCL's `multi_turn_checker` re-executes each turn's calls from a fresh state, against the ground truth's,
and checks the instances' state and the execution results after every turn; a task is correct only if every turn
passes. `reward()` is the fraction of turns whose prefix passes (the signal training needs; say so in a table);
`passed` is BFCL's accuracy, which eval.py reports. As in BFCL's runner, a task whose question has fewer turns than
its ground truth cannot pass: multi_turn_base_154 (5 user turns, 6 ground-truth turns) fails for every model, so
799/800 is the ceiling, and the ground truth replayed through this environment reaches it (tests/test_bfcl.py). The
verdict is BFCL's checker, in the episode's worker, replaying from fresh instances only the call strings built here
from checked names and values (deviation 1) against the release's ground truth: the reply's text never reaches it, and
the worker's answer counts only as one bool per turn (tests/test_verdicts.py).

Deviations from BFCL's own runner, each for safety or for the learner:
1. Calls are executed from the parsed name and arguments (common.parse_tool_calls), never from a string: a name must
   be one of the task's functions (its API classes' function docs), every argument name one of that function's
   declared parameters, every value a plain JSON value (`literal_problem`); anything else is an error observation
   that is never executed and that the checker never sees. BFCL's executor `eval`s call strings; its checker still
   does, on strings `call_string` builds from those checked names and `repr` of those values, so nothing the model
   wrote reaches `eval` as code. And all of it, the task's API classes called with the model's values and BFCL's
   checker, runs in a confined worker process (`WORKER`, worlds/sandbox.py), never in the trainer: a value that costs
   hours (MathAPI.power(10, 10**12)) costs the episode, at the worker's limits. A held-out function called before
   its turn runs, as it does in BFCL (the ground truth of miss_func_49 calls `tail` two turns before it is listed).
2. A reply whose call does not parse gets an error observation and the turn goes on (the project's rule for a
   malformed call); BFCL ends the turn there.
3. The checker caches instances in its module's globals by (model name, task id, class): each episode has a worker
   of its own and every check in it a name of its own, so episodes never share state. `BFCL_PROJECT_ROOT` points at
   a scratch folder, so importing BFCL writes nothing into site-packages.
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
import json
import os
import random
import tempfile
from dataclasses import dataclass, field

import inject
from runtime.devices import UserError
from worlds.common import MAX_DEPTH, Environment, StepResult, json_problem, parse_tool_calls, utf8_text
from worlds import sandbox

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
# An episode's worker: BFCL's own long-context file systems and its checker's replays fit these with room to spare
LIMITS = sandbox.SandboxLimits(wall_s=30.0, cpu_s=300, memory_mb=2048, output_kb=4096)


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
    """One BFCL-v3 multi-turn task in the project's task fields (common.Environment), with BFCL's entry kept whole."""
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
    """BFCL's verdict on one single-turn reply's parsed calls [(name, arguments)] (`ast_verdict`'s first half)."""
    return ast_verdict(task, calls)[0]


def ast_verdict(task: BFCLTask, calls: list) -> tuple[bool, str]:
    """BFCL's verdict on one single-turn reply's parsed calls and its reason ("" when it passes): irrelevance is
    right when the reply makes no call, live_relevance when it makes one; every other category goes to BFCL's
    `ast_checker`, whose message is the reason. Its module imports every vendor SDK through `constants.model_config`
    for one flag (whether a model's function names had "." turned into "_"); a stub module with that flag off for
    our name stands in, so nothing else is imported."""
    if "irrelevance" in task.variant:
        return not calls, "" if not calls else "a call where none should be made"
    if task.variant == "live_relevance":
        return bool(calls), "" if calls else "no call where one should be made"
    package_dir()
    import sys
    import types
    if "bfcl_eval.constants.model_config" not in sys.modules:
        stub = types.ModuleType("bfcl_eval.constants.model_config")
        stub.MODEL_CONFIG_MAPPING = {"lopd": types.SimpleNamespace(underscore_to_dot=False)}
        sys.modules[stub.__name__] = stub
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker
    output = [{name: args} for name, args in calls]
    try:     # the checker compares the parsed values with the possible answers (no eval); a value it cannot
        #      compare (a type it did not expect) is a wrong answer, not the run's end
        verdict = ast_checker(task.entry["function"], output, task.ground_truth, "Python", task.variant, "lopd")
    except Exception as err:
        return False, f"BFCL's checker could not compare the values ({type(err).__name__})"
    if verdict["valid"]:
        return True, ""
    return False, f"{'; '.join(map(str, verdict.get('error', [])))} ({verdict.get('error_type')})"[:300]


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


def literal_problem(name: str, args: dict, doc: dict) -> str | None:
    """Why a parsed call cannot become a literal call string, or None: its name must be the doc's, each argument
    name an identifier among the doc's declared parameters, each value a plain JSON value (common.json_problem:
    str, a finite number, bool, None, lists, objects with string keys) nested at most common.MAX_DEPTH deep."""
    declared = doc["parameters"].get("properties", {})
    if name != doc["name"] or not name.isidentifier():
        return f"the function is {doc['name']!r}, not {name!r}"
    for key, value in args.items():
        if not (isinstance(key, str) and key.isidentifier() and key in declared):
            return f"{name} has no parameter {key!r}; its parameters are {', '.join(declared) or 'none'}"
        if problem := json_problem(value, MAX_DEPTH):
            return f"the value of {key!r} is not a plain JSON value ({problem})"
    return None


def call_string(name: str, args: dict, doc: dict) -> str:
    """A parsed call as the string BFCL's checker evaluates: `literal_problem` must find nothing (else ValueError),
    so the string is name(key=repr(value), ...) of declared names and plain values: a literal call, nothing else."""
    problem = literal_problem(name, args, doc)
    if problem:
        raise ValueError(problem)
    return f"{name}(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")"


def call_text(name: str, args: dict) -> str:
    """A call as text for a trace or the bank (read, never evaluated)."""
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


# The worker: the task's API instances, the model's calls on them and BFCL's checker, in a confined process; one JSON
# request a line, one JSON answer. What BFCL's code prints is swallowed.
WORKER = r'''
import copy, importlib, inspect, io, json, os, sys, traceback
os.environ["BFCL_PROJECT_ROOT"] = os.getcwd()
answer, sys.stdout = sys.stdout, io.StringIO()
SOURCE = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code."
methods = {}

def start(entry, modules, stateless):
    long = "long_context" in entry["id"]
    for name in entry["involved_classes"]:
        obj = getattr(importlib.import_module(SOURCE + modules[name]), name)()
        if name not in stateless:
            obj._load_scenario(copy.deepcopy(entry["initial_config"].get(name, {})), long_context=long)
        methods.update({n: m for n, m in inspect.getmembers(obj, inspect.ismethod) if not n.startswith("_")})
    return {"ok": True}

def dumps(result):
    if isinstance(result, dict):
        try:
            return json.dumps(result)
        except (TypeError, ValueError):
            pass
    return str(result)

def call(name, args):
    try:
        result = methods[name](**args)
        return {"text": result if isinstance(result, str) else dumps(result), "ok": True}
    except Exception as err:
        return {"text": "Error during execution: %s" % err, "ok": False}

def check(prefixes, variant):
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker
    verdicts = [multi_turn_checker(decoded, truth, entry, variant, "lopd_%d" % i)
                for i, (entry, truth, decoded) in enumerate(prefixes)]
    return {"valid": [bool(v["valid"]) for v in verdicts],
            "reasons": ["%s (%s)" % (v.get("error_message", ""), v.get("error_type", "")) if not v["valid"] else ""
                        for v in verdicts]}

for line in sys.stdin:
    req = json.loads(line)
    try:
        out = {"start": lambda: start(req["entry"], req["modules"], req["stateless"]),
               "call": lambda: call(req["name"], req["args"]),
               "check": lambda: check(req["prefixes"], req["variant"])}[req["op"]]()
    except BaseException:
        out = {"ok": False, "error": traceback.format_exc()[-2000:]}
    sys.stdout.seek(0), sys.stdout.truncate()
    answer.write(json.dumps(out) + "\n")
    answer.flush()
'''


# ----------------------------------------------------------------------------------------------------------------
# The environment
# ----------------------------------------------------------------------------------------------------------------
GONE = "Error: the functions did not answer (a call hung, crashed or broke a sandbox limit); the episode ends"


@dataclass
class BFCLWorld(Environment):
    """A BFCL-v3 multi-turn task as an episode (the module docstring says how it runs and how it is scored). The
    task's API instances live in the episode's worker (`WORKER`), started at its first call; a worker that hangs,
    dies or answers nonsense ends the episode, failed."""
    system_prompt: str = ""
    framing: tuple = inject.AGENTIC_FRAMING
    results: str = "behaviour"
    log: dict | None = None        # task_id -> {"passed", "turns_passed", "turns"} once an episode is scored (eval.py)
    task: BFCLTask | None = None
    max_steps: int = MAX_STEPS_PER_TURN     # steps a turn may take before BFCL's forced quit
    limits: sandbox.SandboxLimits = field(default_factory=lambda: LIMITS)
    untrusted_code = True                   # the model's values reach BFCL's code: in a confined worker

    def reset(self, task: BFCLTask) -> list[dict]:
        self.close()
        self.task, self.trace, self.turn, self.steps_in_turn, self.quit = task, [], 0, 0, ""
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
            self.quit = f"BFCL's forced quit: more than {self.max_steps} steps in turn {self.turn + 1}"
            return StepResult([f"Model has been forced to quit after {self.max_steps} steps."], True, 0, 1,
                              end="step cap")
        observations, errors, executed = [], 0, []
        for name, args in calls:
            problem = self._problem(name, args)
            if problem:                                           # deviation 1: never executed, never checked
                observations, errors = observations + [f"Error: {problem}"], errors + 1
                continue
            answer = self._execute(name, args)
            if answer is None:                                    # the worker is gone: the episode ends, failed
                self.quit = GONE.removeprefix("Error: ")
                return StepResult(observations + [GONE], True, len(calls), errors + 1, end="error")
            observations, errors = observations + [answer["text"]], errors + (not answer["ok"])
            executed.append(call_string(name, args, self.docs[name]))   # BFCL's checker runs it again
        self.decoded[self.turn].append(executed)
        return StepResult(observations, False, len(calls), errors)

    def _problem(self, name, args) -> str | None:
        """Why a parsed call is not executed: it did not parse, names no function of the task, or is no literal call
        of it (`literal_problem`); None for a call that runs."""
        if name is None:                                          # a call that did not parse: args is the error
            return str(args).removeprefix("Error: ")
        if name not in self.docs:
            return f"no function {name!r} is available; the functions are {', '.join(self.listed)}"
        return literal_problem(name, args, self.docs[name])

    def _execute(self, name: str, args: dict) -> dict | None:
        """One of the task's functions called on its instances, in the worker -> {"text": its result as text, "ok":
        ran without error}, or None once the worker is gone."""
        if getattr(self, "worker", None) is None:
            self.worker = sandbox.Worker(WORKER, self.limits)
            started = self.worker.request(op="start", entry=self.task.entry, stateless=list(STATELESS),
                                          modules={k: v[0] for k, v in CLASSES.items()})
            if not (started and started.get("ok") is True):
                return None
        answer = self.worker.request(op="call", name=name, args=args)
        if not (answer and isinstance(answer.get("text"), str) and isinstance(answer.get("ok"), bool)):
            return None
        answer = {"text": utf8_text(answer["text"]), "ok": answer["ok"]}
        self.trace.append((name, args, answer["text"]))
        return answer

    def _next_turn(self) -> StepResult:
        self.turn, self.steps_in_turn = self.turn + 1, 0
        if self.turn >= len(self.task.entry["question"]):
            return StepResult([], True, end="done")
        arriving = self.task.entry.get("missed_function", {}).get(str(self.turn), [])
        if arriving:                                              # held-out functions arrive in a user message
            self.listed += arriving
            user = json.dumps([schema(self.docs[n]) for n in arriving]) + "\n" + MORE_FUNCTIONS
        else:
            user = "\n".join(m["content"] for m in self.task.entry["question"][self.turn])
        return StepResult([], False, user=user)

    def reward(self) -> float:
        """The fraction of turns whose prefix BFCL's checker passes (0 after a forced quit or a worker gone); BFCL's
        verdict on the whole task goes to `log`, with the reason of its first failed turn (the checker's message)."""
        turns = len(self.task.ground_truth)
        passed, reason = ([False] * turns, self.quit) if self.quit else self._checked(turns)
        if self.log is not None:
            self.log[self.task.task_id] = {"passed": bool(passed[-1]), "turns_passed": sum(passed), "turns": turns,
                                           "reason": reason}
        self.close()
        return sum(passed) / turns

    def _checked(self, turns: int) -> tuple[list[bool], str]:
        """BFCL's multi_turn_checker on each prefix of k turns (the task and the decoded calls cut to k turns), in the
        episode's worker; all False when the worker gives no verdict. -> (the verdicts, the first failed turn's
        message: "turn k: the checker's message (its error type)"; "" when every turn passes)."""
        prefixes = [({**self.task.entry, "question": self.task.entry["question"][:k]}, self.task.ground_truth[:k],
                     self.decoded[:k]) for k in range(1, turns + 1)]
        if getattr(self, "worker", None) is None:
            self.worker = sandbox.Worker(WORKER, self.limits)
        answer = self.worker.request(op="check", prefixes=prefixes, variant=self.task.variant)
        valid = answer.get("valid") if answer else None
        if not (isinstance(valid, list) and len(valid) == turns and all(isinstance(v, bool) for v in valid)):
            return [False] * turns, "BFCL's checker gave no verdict"
        reasons = answer.get("reasons")
        reasons = reasons if isinstance(reasons, list) and len(reasons) == turns else [""] * turns
        first = next((k for k, v in enumerate(valid) if not v), None)
        return valid, "" if first is None else f"turn {first + 1}: {utf8_text(str(reasons[first]))[:300]}"

    def close(self):
        """Stop the episode's worker, if it runs."""
        if getattr(self, "worker", None) is not None:
            self.worker = self.worker.close()

    def trace_text(self) -> str:
        return "\n".join(f"{i + 1}. {call_text(n, a)} -> {str(r)[:200]}" for i, (n, a, r) in enumerate(self.trace))

    def oracle_trace(self, task) -> str:
        return "\n".join(call_text(n, a) for turn in ground_truth_calls(task) for n, a in turn)

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
        self.task, self.trace, self.passed, self.reason = task, [], False, "no reply"
        self.tools = [schema(d) for d in task.entry["function"]]
        return list(task.entry["question"][0])

    def step(self, reply: str) -> StepResult:
        calls = [(n, a) for n, a in parse_tool_calls(reply, self.response_template) if n is not None]
        self.trace = [(n, a, "") for n, a in calls]
        self.passed, self.reason = ast_verdict(self.task, calls)
        return StepResult([], True, len(calls), 0, end="done")        # one reply: the task's end

    def reward(self) -> float:
        if self.log is not None:
            self.log[self.task.task_id] = {"passed": self.passed, "turns_passed": int(self.passed), "turns": 1,
                                           "reason": self.reason}
        return float(self.passed)
