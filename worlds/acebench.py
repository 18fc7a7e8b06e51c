"""ACEBench's English agent tasks as an evaluation world: the paper's third tool-use benchmark (Table 1; B.3: 20
multi-step and 30 multi-turn tasks, scored per regime and overall; Figure 5: M-Step 56.6, M-Turn 63.3, overall 60.6
for the LOPD student of Qwen3-4B), run as ACEBench runs a model and scored by ACEBench's own code.

    git clone https://github.com/chenchen0103/ACEBench                 # the benchmark: data, APIs, prompts, checker
    python eval.py --run DIR --tasks acebench=ACEBench                 # a run's student: M-Step, M-Turn, overall
    python eval.py --run DIR --tasks acebench=ACEBench:multi_turn      # one regime
    python eval.py --run DIR --tasks acebench=ACEBench --user-model Qwen/Qwen3-8B   # another user simulator
    python -m pytest tests/test_acebench.py -q

ACEBench is a repository, not a package: its clone is read from the folder given at run time (`read_clone`), and
nothing of it is copied here. What is read, by ACEBench's own paths: the tasks and their answers (data_all/data_en/
data_agent_{multi_step,multi_turn}.json and possible_answer/, JSON Lines); the prompts, as the string constants of
its Python files, read with `ast` and never imported (model_inference/multi_step/common_agent_step.py,
multi_turn/common_agent.py, prompt_en.py, multi_turn/APIModel_user.py; the multi-step execution's answer to a
message it cannot parse, from multi_step/execution_role_step.py); the class -> module maps (multi_*_utils.py) and
the state it saves (common_inference.py, SAVED_CLASS); the simulated APIs (model_inference/*/scenariosen/) and the
scoring code (eval_main.py, model_eval/), which run only in a confined worker (below).

An episode, as ACEBench's `multi_step_inference` / `multi_turn_inference` run it (common_inference.py):
- The agent's system prompt is ACEBench's (multi-turn: with the phone or airline rules of prompt_en.py), and its
  first user message is ACEBench's template filled with the task's functions and the history's first line
  ("user:" and the task, or, in multi-turn, the user simulator's opening). No tools go to the chat template: the
  agent answers in ACEBench's call format, `[ApiName(key='value', ...), ...]`, or in prose.
- Multi-step: every agent message goes to execution; one that is no call list gets ACEBench's "Please do not ask me
  any questions, ..." back. Multi-turn: a message with `[...]` that reads as a call list goes to execution, any
  other to the user simulator (ACEBench's APIUSER prompt and opening "Is there anything you need help with
  today?"), whose line comes back; the simulator never sees execution results.
- Each later line of ACEBench's history arrives as a user message after the agent's reply, with ACEBench's own
  prefix ("execution result:" in multi-step, "execution:" in multi-turn, "user:"): `StepResult.user`.
- It ends when a message contains "finish conversation" (from the third message on, as ACEBench checks), or at 40
  messages (ACEBench's max_dialog_turns): 20 agent replies, B.3's max steps.
- Calls run on the task's own fresh instances of ACEBench's API classes, each loaded with its initial config and
  then BaseApi's; a name runs on every instance that has it (an inherited turn_on_wifi() on each), as ACEBench
  dispatches it, and each result comes back as ACEBench renders it (dicts as JSON, read back).

Scoring is ACEBench's `eval_main.agent_eval`, run as is on the episode's record: the final state (the SAVED_CLASS
attributes of the instances, through JSON as ACEBench writes them, so integer keys become strings; empty if no
message was executed, as ACEBench's result is) against the ground truth by model_eval/checker.py's
`agent_checker`, and `agent_eval_process`'s milestone score on the agent's messages that went to execution (exact
text, in order). A task passes end to end when every ground-truth class matches; its process score is 1.0 if it
passed, else the share of milestones found in order (the best of the alternatives where a task lists several).
`reward()` is that process score; eval.py reports both accuracies per regime and their mean over the tasks (the
paper's overall: Figure 5's 60.6 is (20 × 56.6 + 30 × 63.3) / 50). The verdict is agent_eval's, in the episode's
worker, on the final state the executed calls produced and the agent's messages that went to execution (the milestone
score reads their text, by ACEBench's definition: exact equality with a milestone); the reply reaches the state only
as literal calls of the task's functions, and a worker's score that is not a number in [0, 1] is no verdict
(tests/test_verdicts.py). Its dependencies that agent_eval never calls (pandas and openpyxl, for Excel sheets; the
Chinese prompts where the clone lacks them) are empty stand-ins.

What the clone's data does, scored as its checker scores it:
- Four ground-truth class names are misspelt (ReminderAPI in multi_step 0 and 1, Reminderpi in multi_turn 7,
  BaseAPI in multi_turn 9): agent_eval finds no instance of that name and skips the class (the previous class's
  verdict stands), so those classes are never checked.
- ACEBench's commit 941444d (2025-09-21) added a trailing period to the expected message of multi_step 14-17
  ("... 198.0 yuan."), as the task's reminder asks; a clone older than that expects it without.
- The milestones are ACEBench's text, not all of them Python (apostrophes inside single quotes: 'Domino's').
  `milestone_replies` re-quotes those for a replay; the process score compares text, and a task that passes end to
  end scores 1.0 whatever its text.
- The milestones are not all a path to the ground truth, so replayed as calls they pass 12 of 20 multi-step tasks
  and 29 of 30 multi-turn ones, with every milestone found: multi_step 0 and 1 order 'Super Supreme' (Domino's
  sells 'Super Supreme Pizza', the ground truth's order); 12 and 13 never log Helen into the food platform, which the
  order needs and the ground truth shows; 14-17 delete the earliest message where the task says the most recent,
  as the ground truth does (and 16, logged out, never calls login_device()); multi_turn 6 never calls
  login_device(). With those mended the replays pass 20 of 20 and 30 of 30 (tests/test_acebench.py).

Safety. The clone's Python is dataset code and the model's text is hostile: neither runs in the trainer. ACEBench's
harness `eval`s call strings built from the model's text (and arithmetic or lambdas in its arguments), caches
instances in module globals across runs, and writes logs and scores into the working directory. Here each episode
has a worker process the kernel confines (`WORKER`, worlds/sandbox.py) that holds the API instances and runs the
checker; the parent sends it the clone's source texts (the worker reads no file outside its scratch folder, where
agent_eval's score files go) and each call as a parsed name and literal values.

Deviations from ACEBench's own runner:
1. Calls are executed from parsed names and literal values (common.parse_call_list), never from a string: a name
   must be one of the task's functions (ACEBench also runs public helpers that no schema lists, such as
   update_balance), every argument a declared parameter passed by keyword (ACEBench drops positional ones), every
   value a plain JSON value (bfcl.literal_problem). Anything else is an error observation that nothing executes.
   A function the schema lists but no class has (search_reminders) answers "Error during execution: ..." (ACEBench
   reuses an earlier call's result or fails on its own variable).
2. The history is a chat transcript: each later history line a user message after the agent's reply, where
   ACEBench re-sends the whole history as one user message every step, since a conversation whose ids were sampled
   is never re-rendered here (engine.py).
3. The user simulator is a local model (--user-model; default the run's backbone), greedy (ACEBench's is gpt-4o at
   temperature 0.001; the paper's deepseek-v4-flash through an API), at most 1,000 tokens a line (APIUSER's), or the
   run's reply budget where that is smaller, with thinking off. Its own lines are its assistant turns and the
   agent's messages its user turns (ACEBench sends them to the API as "system" and "user"). It generates with the
   project's Hugging Face sampler (engine.generate_replies) under --engine vllm too, so the agent's served weights
   never swap.
4. A multi-turn call that fails stops the reply's later calls, as in ACEBench, and its error comes back with the
   results before it (ACEBench sends the unformatted "Error during execution: {str(e)}", split into characters).
5. Reasoning (`<think>...</think>`) and surrounding whitespace are cut from a reply before it is parsed, routed or
   recorded for the milestone score.
6. The agent samples with the run's settings (a real model: B.3's temperature 0.7, top-p 0.95, top-k 20, thinking
   on), not ACEBench's local 0.0 / 0.9; and its prompts are ACEBench's, not A.5's agentic system prompt, which the
   paper names for tool-use tasks: ACEBench's call format and its "finish conversation" come with its own.
"""
from __future__ import annotations

import ast
import functools
import os
from dataclasses import dataclass, field

from runtime.devices import UserError
from worlds import sandbox
from worlds.bfcl import literal_problem
from worlds.common import Environment, StepResult, parse_call_list, read_jsonl, utf8_text

REGIMES = ("multi_step", "multi_turn")
FINISH = "finish conversation"            # ACEBench's stop phrase, from the agent or the user
MAX_MESSAGES = 40                         # generate.py's --max-dialog-turns: 20 agent replies (B.3's max steps)
USER_MAX_TOKENS = 1000                    # APIUSER's max_tokens
DATA = "data_all/data_en"
WANT = "give the folder of a clone of ACEBench (git clone https://github.com/chenchen0103/ACEBench)"
# What ACEBench's history calls the execution's lines (multi_step_scene.py, multi_turn_scene.py)
EXECUTION = {"multi_step": "execution result:", "multi_turn": "execution:"}
# The prompts: (file, string constant) in the clone
PROMPTS = {"step_system": ("model_inference/multi_step/common_agent_step.py", "MULTI_TURN_AGENT_PROMPT_SYSTEM_EN"),
           "step_user": ("model_inference/multi_step/common_agent_step.py", "MULTI_TURN_AGENT_PROMPT_USER_EN"),
           "turn_system": ("model_inference/multi_turn/common_agent.py", "MULTI_TURN_AGENT_PROMPT_SYSTEM_EN"),
           "turn_user": ("model_inference/multi_turn/common_agent.py", "MULTI_TURN_AGENT_PROMPT_USER_EN"),
           "phone_rules": ("model_inference/prompt_en.py", "BASE_PROMPT_EN"),
           "travel_rules": ("model_inference/prompt_en.py", "TRAVEL_PROMPT_EN"),
           "user_phone": ("model_inference/multi_turn/APIModel_user.py", "SYSTEM_PROMPT_BASE_EN"),
           "user_travel": ("model_inference/multi_turn/APIModel_user.py", "SYSTEM_PROMPT_TRAVEL_EN")}
API_FOLDERS = ("model_inference/multi_step/scenariosen", "model_inference/multi_turn/scenariosen")
SCORING = ("eval_main.py", "category.py", "model_eval/checker.py", "model_eval/utils.py",
           "model_eval/evaluation_helper.py", "model_inference/utils.py", "model_inference/prompt_en.py",
           "model_inference/prompt_zh.py")
# agent_eval's module imports these for Excel sheets it never writes; empty stand-ins where the clone lacks them
STUBS = {"pandas": [], "openpyxl": ["Workbook"], "openpyxl.styles": ["Alignment"], "model_inference.prompt_zh": []}
LIMITS = sandbox.SandboxLimits(wall_s=10.0, cpu_s=60, memory_mb=1024, output_kb=1024)   # per episode; per request
GONE = "Error: the functions did not answer (a call hung, crashed or broke a sandbox limit); the episode ends"


# ----------------------------------------------------------------------------------------------------------------
# The clone's files, read (never imported here)
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Clone:
    """What an episode needs of an ACEBench clone: its prompts, the classes' modules per regime, the state it
    saves, and the source texts the worker runs (module name -> source)."""
    root: str
    prompts: dict
    modules: dict                  # regime -> {class name: module name}
    saved: dict                    # class name -> the attributes of its final state (SAVED_CLASS)
    sources: dict = field(repr=False)


def _read(root: str, rel: str) -> str:
    try:
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"ACEBench clone {root!r}: cannot read {rel} ({getattr(err, 'strerror', None) or err}); "
                        f"{WANT}") from None


@functools.lru_cache(maxsize=None)
def _tree(root: str, rel: str) -> ast.Module:
    try:
        return ast.parse(_read(root, rel))
    except (SyntaxError, ValueError, RecursionError) as err:
        raise UserError(f"ACEBench clone {root!r}: {rel} is not Python ({err}); {WANT}") from None


def _constant(root: str, rel: str, name: str):
    """The literal value of a top-level `name = ...` in a file of the clone, read with ast (the file never runs)."""
    for node in _tree(root, rel).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [name]:
            try:
                return ast.literal_eval(node.value)
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                break
    raise UserError(f"ACEBench clone {root!r}: {rel} has no literal {name}; {WANT}")


def _method(root: str, rel: str, cls: str, name: str) -> ast.FunctionDef:
    for node in _tree(root, rel).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and f.name == name:
                    return f
    raise UserError(f"ACEBench clone {root!r}: {rel} has no {cls}.{name}; {WANT}")


def _unparsed_answer(root: str) -> str:
    """The multi-step execution's answer to a message it cannot parse: the string EXECUTION_STEP.respond sets as
    current_message["message"]."""
    rel = "model_inference/multi_step/execution_role_step.py"
    for node in ast.walk(_method(root, rel, "EXECUTION_STEP", "respond")):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                and any(isinstance(t, ast.Subscript) and getattr(t.slice, "value", None) == "message"
                        for t in node.targets)):
            return node.value.value
    raise UserError(f"ACEBench clone {root!r}: {rel} sets no constant message in EXECUTION_STEP.respond; {WANT}")


def _user_opening(root: str) -> str:
    """The user turn APIUSER.get_init_prompt seeds the simulator with, in its English branch."""
    rel = "model_inference/multi_turn/APIModel_user.py"
    for branch in ast.walk(_method(root, rel, "APIUSER", "get_init_prompt")):
        english = isinstance(branch, ast.If) and isinstance(branch.test, ast.Compare) and any(
            getattr(c, "value", None) == "en" for c in branch.test.comparators)
        for node in (n for stmt in branch.body for n in ast.walk(stmt)) if english else ():
            if isinstance(node, ast.Dict):
                fields = {getattr(k, "value", None): getattr(v, "value", None) for k, v in zip(node.keys, node.values)}
                if fields.get("role") == "user" and isinstance(fields.get("content"), str):
                    return fields["content"]
    raise UserError(f"ACEBench clone {root!r}: {rel} has no English opening in APIUSER.get_init_prompt; {WANT}")


def _sources(root: str) -> dict:
    """module name -> source text of the simulated APIs and the scoring code (the package __init__ files too)."""
    files = [f for f in SCORING if os.path.isfile(os.path.join(root, f))]
    for folder in API_FOLDERS:
        for where, _, names in sorted(os.walk(os.path.join(root, folder))):
            files += [os.path.relpath(os.path.join(where, n), root) for n in sorted(names) if n.endswith(".py")]
    inits = {os.path.join(*parts[:k], "__init__.py") for parts in (rel.split(os.sep)[:-1] for rel in files)
             for k in range(1, len(parts) + 1)}            # the __init__.py of every package above a file
    files += sorted(p for p in inits if p not in files and os.path.isfile(os.path.join(root, p)))
    module = lambda rel: rel[:-3].replace(os.sep, ".").removesuffix(".__init__")   # noqa: E731
    return {module(rel): _read(root, rel) for rel in files}


@functools.lru_cache(maxsize=None)
def read_clone(root: str) -> Clone:
    """The clone at `root`, read once: a one-line UserError naming what is missing where it is not one."""
    if not os.path.isfile(os.path.join(root, DATA, "data_agent_multi_step.json")):
        raise UserError(f"--tasks acebench={root}: no ACEBench clone there (no {DATA}/data_agent_multi_step.json); "
                        f"{WANT}")
    prompts = {k: _constant(root, rel, name) for k, (rel, name) in PROMPTS.items()}
    prompts.update(unparsed=_unparsed_answer(root), user_opening=_user_opening(root))
    modules = {r: _constant(root, f"model_inference/{r}/{r}_utils.py", "CLASS_FILE_PATH_MAPPING_EN") for r in REGIMES}
    saved = _constant(root, "model_inference/common_inference.py", "SAVED_CLASS")
    return Clone(root, prompts, modules, saved, _sources(root))


# ----------------------------------------------------------------------------------------------------------------
# The tasks
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class AceTask:
    """One ACEBench agent task in the project's task fields (common.Environment), with ACEBench's records whole."""
    task_id: str
    text: str                      # multi-step: the user's task; multi-turn: the user simulator's instruction
    variant: str                   # the regime: multi_step | multi_turn
    schema: str                    # the API classes it involves, joined
    root: str                      # the clone it comes from
    entry: dict = field(repr=False)     # id, question, initial_config, function, involved_classes
    answer: dict = field(repr=False)    # ground_truth (the final state), mile_stone (the expected calls)


def _jsonl(root: str, rel: str, fields: tuple) -> list[dict]:
    """The records of the clone's JSON Lines file `rel` (common.read_jsonl), each holding `fields`; a file that
    cannot be read, a line that is not JSON or lacks a field is one line naming the file and what to change."""
    def parse(row, where):
        missing = [f for f in fields if not isinstance(row, dict) or f not in row]
        if missing:
            raise ValueError(f"{where}: lacks {', '.join(missing)}; ACEBench's records carry {', '.join(fields)}")
        return row
    try:
        return read_jsonl(os.path.join(root, rel), parse)
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"ACEBench clone {root!r}: cannot read {rel} ({getattr(err, 'strerror', None) or err}); "
                        f"{WANT}") from None
    except ValueError as err:                      # read_jsonl's and parse's, each naming path:line
        raise UserError(f"{err}; {WANT}") from None


def load_tasks(root: str, regimes=REGIMES) -> list[AceTask]:
    """The English agent tasks of the given regimes, in ACEBench's order, with their answers."""
    read_clone(root)                                   # a clone it can run, or one line now
    tasks = []
    for regime in regimes:
        if regime not in REGIMES:
            raise UserError(f"ACEBench regime {regime!r}: expected one of {', '.join(REGIMES)} "
                            "(--tasks acebench=PATH:multi_step)")
        name = f"data_agent_{regime}.json"
        answers = {a["id"]: a for a in _jsonl(root, f"{DATA}/possible_answer/{name}", ("id", "ground_truth",
                                                                                       "mile_stone"))}
        for e in _jsonl(root, f"{DATA}/{name}", ("id", "question", "initial_config", "function", "involved_classes")):
            if e["id"] not in answers:
                raise UserError(f"{os.path.join(root, DATA, 'possible_answer', name)}: no answer for {e['id']}")
            tasks.append(AceTask(e["id"], e["question"], regime, "+".join(sorted(e["involved_classes"])), root, e,
                                 answers[e["id"]]))
    return tasks


def parse_spec(spec: str) -> tuple[str, list[str]]:
    """--tasks acebench=PATH[:REGIME[,REGIME]] -> (PATH, regimes); every regime when none is named."""
    rest = spec.removeprefix("acebench=")
    path, _, named = rest.rpartition(":")
    if not path or "/" in named or not named:
        return rest, list(REGIMES)
    regimes = named.split(",")
    unknown = [r for r in regimes if r not in REGIMES]
    if unknown:
        raise UserError(f"--tasks {spec}: no ACEBench regime {unknown[0]!r}; expected {' or '.join(REGIMES)}")
    return path, regimes


# ----------------------------------------------------------------------------------------------------------------
# Replies: ACEBench's call format, read and written
# ----------------------------------------------------------------------------------------------------------------
def visible(reply: str) -> str:
    """A reply without its reasoning (what follows the last </think>; nothing, if thinking never closed)."""
    if "</think>" in reply:
        reply = reply.rsplit("</think>", 1)[1]
    elif reply.lstrip().startswith("<think>"):
        reply = ""
    return reply.strip()


def decode(text: str):
    """ACEBench's decode_function_list on our parser: brackets added where missing, then `strip("[]'")` as it does,
    then common.parse_call_list (literal values only). None: not a call list."""
    func = text.strip()
    func = func if func.startswith("[") else "[" + func
    func = func if func.endswith("]") else func + "]"
    return parse_call_list(func.strip("[]'"))


def call_list(calls) -> str:
    """Calls [(name, arguments)] in ACEBench's format: [name(key=repr(value), ...), ...]."""
    return "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + ")" for n, a in calls) + "]"


def _requoted(text: str) -> str:
    """`text` with each quoted string written again by repr, where a quote closes its string only before what can
    follow a value (, ) ] } : or the end): ACEBench's 'Domino's' becomes "Domino's"."""
    out, i = [], 0
    while i < len(text):
        quote = text[i]
        if quote not in "'\"":
            out.append(quote)
            i += 1
            continue
        j, chars = i + 1, []
        while j < len(text) and not (text[j] == quote and text[j + 1:].lstrip()[:1] in ("", ",", ")", "]", "}", ":")):
            chars.append(text[j + 1] if text[j] == "\\" and j + 1 < len(text) else text[j])
            j += 2 if text[j] == "\\" else 1
        out.append(repr("".join(chars)))
        i = j + 1
    return "".join(out)


def _readable(text: str):
    """The calls of a text that reads as a list of well-formed calls, else None."""
    calls = decode(text)
    return calls if calls and all(n is not None for n, _ in calls) else None


def milestone_replies(task: AceTask, verbatim: bool = False) -> list[str]:
    """ACEBench's milestones of a task (the first list, where it gives alternatives) as the agent's replies: each as
    ACEBench wrote it where it reads as calls; where it does not, its calls re-quoted (`_requoted`) in ACEBench's
    format instead, or with `verbatim` after it (multi-step, where every message goes to execution: the
    milestone score then finds each milestone's own text)."""
    stones = task.answer["mile_stone"]
    stones = stones[0] if stones and isinstance(stones[0], list) else stones
    out = []
    for text in (s.strip() for s in stones):
        requoted = None if _readable(text) else _readable(_requoted(text))
        out += [text] if requoted is None or verbatim else []
        out += [call_list(requoted)] if requoted else []
    return out


def _fill(template: str, **values: str) -> str:
    """template.format(**values) for plain {name} fields only: str.format would let the clone's text reach the
    values' attributes ({functions.__class__})."""
    for k, v in values.items():
        template = template.replace("{" + k + "}", v)
    return template


# ----------------------------------------------------------------------------------------------------------------
# The worker: the clone's API instances, the calls on them and ACEBench's scoring, in a confined process; one JSON
# request a line, one JSON answer. The clone's modules come as source texts (it reads no file of the clone); what
# they print is swallowed.
# ----------------------------------------------------------------------------------------------------------------
WORKER = r'''
import copy, importlib, importlib.abc, importlib.util, inspect, io, json, os, sys, traceback
answer, sys.stdout = sys.stdout, io.StringIO()
sources, packages, stubs, instances, methods = {}, set(), {}, {}, {}

class Clone(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name in sources or name in packages or name in stubs:
            return importlib.util.spec_from_loader(name, self, is_package=name in packages)
        return None
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        name = module.__name__
        if name in sources:
            exec(compile(sources[name], name.replace(".", "/") + ".py", "exec"), module.__dict__)
        else:
            module.__dict__.update({k: type(k, (), {}) for k in stubs.get(name, ())})

def load(srcs, stub_names):
    sources.update(srcs)
    stubs.update({k: v for k, v in stub_names.items() if k not in sources})
    names = set(sources) | set(stubs)
    packages.update(n.rsplit(".", k)[0] for n in names for k in range(1, n.count(".") + 1))
    sys.meta_path.insert(0, Clone())
    return {"ok": True}

def start(classes, config):
    for name, module in classes:
        obj = getattr(importlib.import_module(module), name)()
        obj._load_scenario(copy.deepcopy(config.get(name, {})), long_context=False)
        obj._load_scenario(copy.deepcopy(config.get("BaseApi", {})), long_context=False)
        instances[name] = obj
        for n, m in inspect.getmembers(obj, inspect.ismethod):
            if not n.startswith("_"):
                methods.setdefault(n, []).append(m)
    return {"ok": True}

def shown(result):
    if not isinstance(result, str):
        try:
            result = json.dumps(result) if isinstance(result, dict) else str(result)
        except (TypeError, ValueError):
            result = str(result)
    try:
        return result, repr(json.loads(result))
    except (ValueError, RecursionError):
        return result, repr(result)

def call(name, args):
    try:
        if name not in methods:
            raise AttributeError("no function %s" % name)
        for method in methods[name]:
            result = method(**copy.deepcopy(args))
    except Exception as err:
        text = "Error during execution: %s" % err
        return {"ok": False, "text": text, "shown": repr(text)}
    text, seen = shown(result)
    return {"ok": True, "text": text, "shown": seen}

def state(saved):
    out = [{name: {k: v for k, v in vars(obj).items() if k in saved.get(name, [])}} for name, obj in instances.items()]
    return {"state": json.loads(json.dumps(out, default=str))}

def score(category, results, prompts, answers):
    folder = os.path.join("score_all", "score_en", "lopd")
    os.makedirs(folder, exist_ok=True)
    ev = importlib.import_module("eval_main")
    ev.language, ev.OUTPUT_PATH = "en", "./score_all/score_en/"
    end, process = ev.agent_eval(results, prompts, answers, category, "lopd")
    with open(os.path.join(folder, "data_%s_score.json" % category)) as f:
        head = json.loads(f.readline())
    return {"end_to_end": float(end), "process": float(process), "correct": int(head["correct_count"])}

for line in sys.stdin:
    req = json.loads(line)
    try:
        out = {"load": lambda: load(req["sources"], req["stubs"]),
               "start": lambda: start(req["classes"], req["config"]),
               "call": lambda: call(req["name"], req["args"]), "state": lambda: state(req["saved"]),
               "score": lambda: score(req["category"], req["results"], req["prompts"], req["answers"])}[req["op"]]()
    except BaseException:
        out = {"ok": False, "error": traceback.format_exc()[-2000:]}
    sys.stdout.seek(0), sys.stdout.truncate()
    answer.write(json.dumps(out) + "\n")
    answer.flush()
'''


def open_worker(clone: Clone, limits: sandbox.SandboxLimits = LIMITS) -> sandbox.Worker | None:
    """A confined worker with the clone's modules importable; None if it does not come up."""
    worker = sandbox.Worker(WORKER, limits)
    answer = worker.request(op="load", sources=clone.sources, stubs=STUBS)
    return worker if answer and answer.get("ok") is True else worker.close()


def score(tasks: list[AceTask], records: list[dict], worker: sandbox.Worker | None = None) -> dict:
    """ACEBench's own verdict on episodes of one regime: eval_main.agent_eval (model_eval/checker.py's
    agent_checker on each final state, agent_eval_process's milestone score), in a confined worker (`worker`, or
    one of its own). records: per task {"result": its final state, "process": its messages that went to
    execution}. -> {"end_to_end", "process": ACEBench's accuracies (3 decimals), "correct": tasks passed};
    zeros, and "error", where the worker gives no verdict."""
    regime, = {t.variant for t in tasks}
    own = worker is None
    worker = open_worker(read_clone(tasks[0].root)) if own else worker
    answer = worker and worker.request(op="score", category=f"agent_{regime}", results=records,
                                       prompts=[t.entry for t in tasks], answers=[t.answer for t in tasks])
    if own and worker:
        worker.close()
    ok = isinstance(answer, dict) and all(isinstance(answer.get(k), (int, float)) for k in ("end_to_end", "process",
                                                                                           "correct"))
    ok = ok and all(0 <= answer[k] <= 1 for k in ("end_to_end", "process"))      # NaN fails it too: a reward in [0, 1]
    if not ok:
        error = (answer or {}).get("error") or "the worker did not answer"
        return {"end_to_end": 0.0, "process": 0.0, "correct": 0, "error": str(error)[-500:]}
    return {k: answer[k] for k in ("end_to_end", "process", "correct")}


# ----------------------------------------------------------------------------------------------------------------
# The user simulator
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class ModelUser:
    """ACEBench's user simulator (APIUSER) played by a local chat model: messages -> its next line, greedy, through
    the project's generator (deviation 3). Any callable of the same shape will do (tests/test_acebench.py scripts
    one)."""
    model: object
    tokenizer: object
    max_new_tokens: int = USER_MAX_TOKENS

    def __call__(self, messages: list[dict]) -> str:
        import engine              # only a model-backed user needs torch; the world itself does not
        cfg = engine.SampleConfig(temperature=0.0, max_new_tokens=self.max_new_tokens, max_len=10 ** 9)
        ids = engine.prompt_ids(self.tokenizer, messages)
        (new, _, _), = engine.generate_replies(self.model, self.tokenizer, [ids], cfg)
        return visible(self.tokenizer.decode(new, skip_special_tokens=True))


def _bracketed(text: str) -> bool:
    """ACEBench's agent's test for a call (its regex: a "[" then a "]" later on one line), in one pass over each
    line: the regex retries from every "[", quadratic in a reply of many."""
    return any(0 <= line.find("[") < line.rfind("]") for line in text.split("\n"))


def _without_role(text: str) -> str:
    """APIUSER.step's remove_prefix: an agent message that starts with its role's label reaches the user without
    it."""
    for prefix in ("user:", "agent:"):
        if text.startswith(prefix):
            return text[len(prefix):]
    return text


# ----------------------------------------------------------------------------------------------------------------
# The environment
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class AceBenchWorld(Environment):
    """An ACEBench agent task as an episode (the module docstring says how it runs and how it is scored). The task's
    API instances live in the episode's worker (`WORKER`), started at its first call; a worker that hangs, dies or
    answers nonsense ends the episode, and its state counts as none."""
    user: object = None            # multi-turn: the user simulator, messages -> its next line (ModelUser)
    log: dict | None = None        # task_id -> {"passed", "process", "record", "error"} once scored (eval.py)
    max_messages: int = MAX_MESSAGES
    limits: sandbox.SandboxLimits = field(default_factory=lambda: LIMITS)
    task: AceTask | None = None
    untrusted_code = True          # the clone's code and the model's values: in a confined worker

    def reset(self, task: AceTask) -> list[dict]:
        self.close()
        self.task, self.trace, self.process, self.messages, self.saved = task, [], [], 0, False
        self.clone, self.started = read_clone(task.root), False
        self.docs = {f["name"]: f for f in task.entry["function"]}
        prompts, classes = self.clone.prompts, task.entry["involved_classes"]
        if task.variant == "multi_step":
            system, template, first = prompts["step_system"], prompts["step_user"], task.text
        else:
            system = prompts["turn_system"] + (prompts["travel_rules"] if "Travel" in classes else "") + \
                (prompts["phone_rules"] if "BaseApi" in classes else "")
            template, first = prompts["turn_user"], self._opening(task)
        user = _fill(template, functions=str(task.entry["function"]), history=f"user:{first}\n")
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    def _opening(self, task: AceTask) -> str:
        """The simulator's first line: APIUSER's system prompt with the task's instruction, then its opening."""
        if self.user is None:
            raise UserError("ACEBench's multi-turn tasks need a user simulator (AceBenchWorld(user=...))")
        prompt = self.clone.prompts["user_phone" if "BaseApi" in task.entry["involved_classes"] else "user_travel"]
        self.dialogue = [{"role": "system", "content": _fill(prompt, instruction=task.text)},
                         {"role": "user", "content": self.clone.prompts["user_opening"]}]
        line = visible(self.user(list(self.dialogue)))
        self.dialogue.append({"role": "assistant", "content": line})
        return line

    def _ends(self, text: str) -> str:
        """ACEBench's stop, or "": "done" at "finish conversation" in the third message or later, "step cap" at the
        message cap (common.ENDS)."""
        if self.messages > 2 and FINISH in text:
            return "done"
        return "step cap" if self.messages >= self.max_messages else ""

    def _result(self, text: str, n_calls: int = 0, errors: int = 0, user: str | None = None) -> StepResult:
        """A step's result with nothing to observe but the next user line, ended where `_ends(text)` says."""
        end = self._ends(text)
        return StepResult([], bool(end), n_calls, errors, user=user, end=end)

    def step(self, reply: str) -> StepResult:
        text = visible(reply)
        self.messages += 1                                        # the agent's message
        if self._ends(text):
            return self._result(text)
        calls = decode(text)
        if self.task.variant == "multi_turn" and not (calls is not None and _bracketed(text)):
            return self._to_user(text)
        self.process.append(text)                                 # what the milestone score reads
        if calls is None:                                         # multi-step: ACEBench's answer to prose
            self.messages += 1
            return self._result("", 0, 1, EXECUTION["multi_step"] + self.clone.prompts["unparsed"])
        ran = self._run(calls)
        if ran is None:                                           # the worker is gone: the episode ends
            return StepResult([GONE], True, len(calls), len(calls), end="error")
        message, errors = ran
        self.saved = self.saved or self.task.variant == "multi_step" or errors == 0   # ACEBench keeps the state
        self.messages += 1
        return self._result("", len(calls), errors, EXECUTION[self.task.variant] + message)

    def _to_user(self, text: str) -> StepResult:
        """Multi-turn: a message that is no call goes to the user simulator; its line comes back."""
        self.dialogue.append({"role": "user", "content": _without_role(text)})
        line = visible(self.user(list(self.dialogue)))
        self.dialogue.append({"role": "assistant", "content": line})
        self.messages += 1
        return self._result(line, user="user:" + line)

    def _run(self, calls) -> tuple[str, int] | None:
        """The calls of one reply on the task's instances -> (the execution's message: ACEBench's list of results,
        errors), or None once the worker is gone. In multi-turn a failed call stops the rest, as in ACEBench."""
        shown, errors = [], 0
        for name, args in calls:
            problem = self._problem(name, args)
            answer = {"ok": False, "shown": repr(f"Error: {problem}")} if problem else self._call(name, args)
            if answer is None:
                return None
            shown.append(answer["shown"])
            errors += not answer["ok"]
            if not answer["ok"] and self.task.variant == "multi_turn":
                break
        return "[" + ", ".join(shown) + "]", errors

    def _problem(self, name, args) -> str | None:
        """Why a parsed call is not executed (deviation 1), or None for a call that runs."""
        if name is None:                                          # a call that did not parse: args is the error
            return str(args).removeprefix("Error: ")
        if name not in self.docs:
            return f"no function {name!r} is available; the functions are {', '.join(self.docs)}"
        return literal_problem(name, args, self.docs[name])

    def _worker(self) -> sandbox.Worker | None:
        """The episode's worker with the task's instances, started at its first use; None once it is gone."""
        if not self.started:
            self.started, entry = True, self.task.entry
            self.worker = open_worker(self.clone, self.limits)
            modules = self.clone.modules[self.task.variant]
            classes = [[c, modules.get(c, "")] for c in entry["involved_classes"]]
            up = self.worker and self.worker.request(op="start", classes=classes, config=entry["initial_config"])
            if not (up and up.get("ok") is True):
                self.close()
        return getattr(self, "worker", None)

    def _call(self, name: str, args: dict) -> dict | None:
        """One call in the worker -> {"text", "shown": its result as text and as ACEBench shows it, "ok"}, or None
        once the worker is gone; the texts as UTF-8 can carry them (common.utf8_text)."""
        worker = self._worker()
        answer = worker and worker.request(op="call", name=name, args=args)
        if not (answer and all(isinstance(answer.get(k), t) for k, t in (("text", str), ("shown", str),
                                                                          ("ok", bool)))):
            self.close()
            return None
        answer = {"text": utf8_text(answer["text"]), "shown": utf8_text(answer["shown"]), "ok": answer["ok"]}
        self.trace.append((name, args, answer["text"]))
        return answer

    def final_state(self) -> list:
        """ACEBench's result: the saved attributes of every instance, once a message was executed; else []."""
        worker = self._worker() if self.saved else None
        answer = worker and worker.request(op="state", saved=self.clone.saved)
        return answer["state"] if answer and isinstance(answer.get("state"), list) else []

    def reward(self) -> float:
        """ACEBench's process score of the episode (1.0 when it passes end to end); its verdict goes to `log`."""
        record = {"result": self.final_state(), "process": list(self.process)}
        verdict = score([self.task], [record], getattr(self, "worker", None))     # in the episode's, if it runs
        if self.log is not None:
            passed = verdict["correct"] == 1
            reason = ("" if passed else f"the final state differs from the ground truth's; milestones "
                      f"{verdict['process']:.2f}")
            reason = f"ACEBench's checker gave no verdict: {verdict['error']}" if verdict.get("error") else reason
            self.log[self.task.task_id] = {"passed": passed, "process": verdict["process"], "record": record,
                                           "error": verdict.get("error"), "reason": reason}
        self.close()
        return float(verdict["process"])

    def close(self):
        """Stop the episode's worker, if it runs."""
        if getattr(self, "worker", None) is not None:
            self.worker = self.worker.close()

    def oracle_trace(self, task) -> str:
        return "\n".join(milestone_replies(task))
