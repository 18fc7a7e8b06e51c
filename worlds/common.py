"""What every world shares: the interface the learner reads (`Environment`, `StepResult`, a task's `TASK_FIELDS`),
the loader of --env, the tool-call parsers of the model families, and the small helpers of task files and traces
(paper A.3, A.5).

    python train.py --env my_world.py:MyWorld      # a world of your own: a subclass of Environment
    python -m pytest tests/test_envs.py tests/test_custom_env.py -q

The shipped worlds, one file each beside this one: tool_world.py (the toy tool-use world, the default), code_world.py
(single-turn programs; code_benchmarks.py reads TACO, LiveCodeBench and EvalPlus as released), bfcl.py (BFCL-v3),
envscaler.py (EnvScaler's released environments), acebench.py (ACEBench, for evaluation); worlds/sandbox.py confines
the code they run, results.py tabulates what they score, toy_backbone.py builds the offline backbone that knows the
toy worlds. `ENVS` names them for --env.

A reply is text: the parsers turn it into (name, arguments) pairs of JSON values, in one pass over the reply, and a
call that cannot be read is an error observation, never an exception and never code. Nothing here evaluates text.
A call's arguments are a JSON object or the call is an error (`json_problem`): a tuple, a set, bytes, a complex
number, NaN, a key that is no string are refused, not converted, so that every reader after the parser (the
engine's count, a worker's JSON request, a checker) gets what the tool schemas describe.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import importlib.util
import json
import math
import os
import sys
from dataclasses import dataclass

import inject
from runtime import preflight
import retrieval

DONE_TEXT = "Task Completed"       # A.5: the reply that ends an episode (a reply without a call ends it too)


def read_jsonl(path: str, parse) -> list:
    """parse(row, "path:line") for each non-blank line of a JSONL file; a line that is not JSON raises ValueError
    naming `path:line`, and parse raises its own, naming the same place."""
    out = []
    with open(path, encoding="utf-8") as f:          # JSON is UTF-8 (RFC 8259), whatever the locale
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            out.append(parse(row, f"{path}:{n}"))
    return out


# ----------------------------------------------------------------------------------------------------------------
# Tool calls: the formats of the model families (Qwen3/Hermes, Llama 3, Olmo 3), or the tokenizer's own parser
# ----------------------------------------------------------------------------------------------------------------
# A model whose template lists the tools answers in its family's format; one whose template ignores them is told
# the Qwen3 format (engine.tools_block). Each parser returns (name, arguments) per call, or (None, error message)
# for a call that is there but malformed: the error is the call's observation, never an exception.
#   Qwen3 / Hermes   <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number per reply
#   Llama 3.x        the whole reply is JSON {"name": ..., "parameters": {...}} (calls may be joined by ";"),
#                    optionally after <|python_tag|>
#   Olmo 3           <function_calls>name(key=value, ...)</function_calls>, one Python-style call a line with
#                    keyword arguments and literal values (as the official code's olmo3 protocol parses it)
# A tokenizer with a `response_template` (transformers >= 5 reads it from tokenizer_config.json) parses its own
# replies (`parse_with_template`); where it finds no call, the formats above are tried.
PYTHON_TAG = "<|python_tag|>"
MAX_DEPTH = 32     # how deeply a call's argument values may nest: no tool schema nests near it, and each reader after
#                    the parser (json.dumps, a checker's compare, a worker's deepcopy) recurses once a level


def tagged_blocks(text: str, open_tag: str, close_tag: str) -> list[str]:
    """The text between each `open_tag` and the first `close_tag` after it, left to right (what the regex
    open(.*?)close finds), in one pass: a reply of n unclosed tags costs n steps, not n² (the regex retries the
    search for a close tag from every open tag)."""
    blocks, i = [], 0
    while (start := text.find(open_tag, i)) >= 0:
        end = text.find(close_tag, start + len(open_tag))
        if end < 0:                        # no close tag after this one, so none after any later one either
            break
        blocks.append(text[start + len(open_tag):end])
        i = end + len(close_tag)
    return blocks


def _call_from_object(obj, key: str = "arguments"):
    """(name, arguments) from a decoded call object, or (None, error)."""
    if isinstance(obj, dict) and isinstance(obj.get("function"), dict):      # OpenAI style {"function": {...}}
        obj = obj["function"]
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, "Error: tool call needs a string 'name'"
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):                                                # arguments sent as a JSON string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):    # not JSON, an integer past Python's digit limit, or nested too deep
            return None, f"Error: '{key}' is not valid JSON"
    if not isinstance(args, dict):
        return None, f"Error: '{key}' must be an object"
    return _checked_call(obj["name"], args)


def _json_call(body: str, key: str = "arguments"):
    try:
        return _call_from_object(json.loads(body), key)
    except (ValueError, RecursionError):        # not JSON, an integer past Python's digit limit, or nested too deep
        return None, "Error: tool call is not valid JSON"


def parse_qwen_calls(text: str):
    """Qwen3 / Hermes: each <tool_call> block; an unterminated one is an error."""
    calls = [_json_call(body) for body in tagged_blocks(text, "<tool_call>", "</tool_call>")]
    if text.count("<tool_call>") > len(calls):
        calls.append((None, "Error: unterminated <tool_call>"))
    return calls


def parse_llama_calls(text: str):
    """Llama 3.x: the reply is a JSON call (or several joined by ';'). Prose, even prose quoting JSON, is no call."""
    body = text.strip()
    body = body[len(PYTHON_TAG):].strip() if body.startswith(PYTHON_TAG) else body
    if not body.startswith("{"):
        return []
    calls, decoder, i = [], json.JSONDecoder(), 0
    while i < len(body):
        try:
            obj, i = decoder.raw_decode(body, i)
        except (ValueError, RecursionError):
            return calls + [(None, "Error: tool call is not valid JSON")]
        calls.append(_call_from_object(obj, "parameters"))
        while i < len(body) and body[i] in " \t\r\n;":
            i += 1
    return calls


def parse_olmo_calls(text: str):
    """Olmo 3: each line inside <function_calls> is name(key=literal, ...)."""
    calls, blocks = [], tagged_blocks(text, "<function_calls>", "</function_calls>")
    for block in blocks:
        calls += [_olmo_call(line) for line in filter(None, (x.strip() for x in block.splitlines()))]
    if text.count("<function_calls>") > len(blocks):
        calls.append((None, "Error: unterminated <function_calls>"))
    return calls


def _olmo_call(line: str):
    """One line of an Olmo 3 block -> (name, arguments), or (None, error)."""
    try:
        node = ast.parse(line, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:     # the parser's own limits too
        return None, f"Error: malformed function call {line[:60]!r} ({str(err)[:200]})"
    if not isinstance(node, ast.Call):
        return None, f"Error: malformed function call {line[:60]!r} (a call needs the form name(key=value, ...))"
    return _literal_call(node)


def parse_call_list(text: str):
    """A reply in the Python call-list format `[name(key=literal, ...), ...]` (ACEBench's; one bare call too),
    read with `ast` and never evaluated. None where the text is no list of calls (prose: the caller decides what
    that means); else per call (name, arguments), or (None, error) for a call that is no plain name with keyword
    arguments of literal values: an expression, a lambda, a name or a call as a value is an error, not code."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):      # the parser's own limits too
        return None
    items = node.elts if isinstance(node, (ast.List, ast.Tuple)) else [node]
    if not items or not all(isinstance(c, ast.Call) for c in items):
        return None
    return [_literal_call(c) for c in items]


def _literal_call(node: ast.Call):
    """One parsed call node -> (name, arguments) from its literal keyword values, or (None, error)."""
    if not isinstance(node.func, ast.Name):
        return None, "Error: a call needs a plain function name: name(key=value, ...)"
    name = node.func.id
    if node.args or any(k.arg is None for k in node.keywords):
        return None, f"Error: {name} takes keyword arguments only: {name}(key=value, ...)"
    try:      # TypeError: a set of lists, or a dict with a list for a key ({[1]: 2}), cannot be built
        args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return None, (f"Error: the arguments of {name} must be literal values (strings, numbers, True/False/None, "
                      "lists, dicts), not expressions")
    return _checked_call(name, args)


def _checked_call(name: str, args: dict):
    """(name, args) where the name is text and the arguments a JSON object (`json_problem`), else (None, error)."""
    if _text_problem(name):
        return None, f"Error: the function name {name!r} is not text"
    problem = json_problem(args, MAX_DEPTH + 1)                       # + 1: the arguments object itself
    if problem:
        return None, f"Error: the arguments of {name} must be JSON values: {problem}"
    return name, args


def json_problem(value, depth: int = MAX_DEPTH) -> str | None:
    """Why `value` is no JSON value, or None: a JSON value is a string of Unicode, a finite number, a boolean, None,
    or a list or a dict with string keys of JSON values, with at most `depth` lists and dicts nested. Python's
    parsers give more (a tuple, a set, bytes, 1j, NaN, 1e999, {1: 2}, an int too long to print, "\\ud800"), which
    json.dumps would refuse, or write changed (a tuple as a list, the key 1 as "1")."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, str):
        return _text_problem(value)
    if isinstance(value, int):
        return _int_problem(value)
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{value} is no JSON number"
    if isinstance(value, (list, dict)) and depth <= 0:
        return f"a value nests deeper than {MAX_DEPTH} lists and objects"
    if isinstance(value, list):
        return next(filter(None, (json_problem(v, depth - 1) for v in value)), None)
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            return "object keys must be strings"
        return next(filter(None, (_text_problem(k) or json_problem(v, depth - 1) for k, v in value.items())), None)
    return f"a {type(value).__name__} is no JSON value"


def _text_problem(text: str) -> str | None:
    """Half a surrogate pair (JSON's "\\ud800", Python's '\\ud800') is no Unicode: UTF-8, and so a tokenizer reading
    an observation that echoes it, cannot encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "a string holds half a surrogate pair"
    return None


def _int_problem(n: int) -> str | None:
    """An int Python cannot print (past its digit limit: a long hex literal) cannot be written as JSON either."""
    try:
        str(n)
    except ValueError:
        return "an integer too long to write"
    return None


def utf8_text(text: str) -> str:
    """A worker's answer as UTF-8 can carry it: JSON may bring back half a surrogate pair (the environment's code
    wrote one), which would reach the tokenizer in an observation; each becomes '?'."""
    return text.encode("utf-8", "replace").decode("utf-8")


def parse_with_template(text: str, response_template: dict):
    """The tokenizer's own parser (transformers' `parse_response` on its `response_template`). A call region it
    cannot parse is an error observation."""
    from transformers.utils.chat_parsing import parse_response
    try:      # the library's parser, not ours: whatever it raises on a reply is that reply's error
        parsed = parse_response(text, response_template, prefix="")
    except Exception as err:
        return [(None, f"Error: tool call could not be parsed ({(str(err).splitlines() or [''])[0][:200]})")]
    found = (parsed.get("tool_calls") if isinstance(parsed, dict) else None) or []
    return [_call_from_object(c) for c in (found if isinstance(found, list) else [found])]   # one call, unlisted


def parse_tool_calls(text: str, response_template: dict | None = None):
    """Every tool call in one reply, in whichever family's format it is written: a list of (name, arguments) or
    (None, error message). The tokenizer's own parser first, where it has one."""
    if response_template:
        calls = parse_with_template(text, response_template)
        if calls:
            return calls
    for parse in (parse_qwen_calls, parse_olmo_calls, parse_llama_calls):
        calls = parse(text)
        if calls:
            return calls
    return []


def format_call(name: str, args: dict) -> str:
    """The assistant text of one tool call, exactly as the Qwen3 chat template renders `tool_calls`."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


# ----------------------------------------------------------------------------------------------------------------
# The environment: reset / step / reward
# ----------------------------------------------------------------------------------------------------------------
# Why an episode ended (engine.Episode.end, in an evaluation's records): a world names its own reason when it ends
# an episode (`StepResult.end`); the engine names the two budgets it enforces itself.
ENDS = {"done": "the task's end: 'Task Completed', BFCL's last turn answered, ACEBench's 'finish conversation', "
                "a code world's one program",
        "no call": "a reply without a tool call (A.5: it ends the episode, as 'Task Completed' does)",
        "step cap": "--max-env-steps reached (BFCL: steps in a turn, its forced quit; ACEBench: its message cap)",
        "error": "the world ended it: a tool raised, its worker is gone, the session was aborted",
        "world": "the world ended it and named no reason (its StepResult.end is empty)",
        "token budget": "the engine: the reply was cut at --max-new-tokens",
        "context full": "the engine: the next reply might not fit --max-len"}


def reply_end(reply: str) -> str:
    """Why a reply without a call ends an episode: "done" where it says DONE_TEXT, else "no call"."""
    return "done" if DONE_TEXT in reply else "no call"


@dataclass
class StepResult:
    observations: list            # one tool-result string per call (empty when the episode ended)
    done: bool
    n_calls: int = 0
    errors: int = 0
    user: str | None = None       # a multi-turn task's next user message, once a reply has ended a turn (BFCL)
    end: str = ""                 # where done: why, one of ENDS ("" = "world")


TASK_FIELDS = ("task_id", "text", "variant", "schema")     # what every task holds (`Environment`'s docstring)


def missing_task_field(world: str, *splits) -> str | None:
    """The one-line error for the first task of `splits` that lacks one of TASK_FIELDS, naming the field and --env's
    `world`, else None. train.load_splits asks as the splits are made, before a stage reads a field (the cold start
    reads `schema`, retrieval `variant`)."""
    for task in (t for split in splits for t in split):
        if missing := [f for f in TASK_FIELDS if not hasattr(task, f)]:
            return (f"--env {world!r}: its tasks ({type(task).__name__}) have no field {missing[0]!r}; every task "
                    f"holds {', '.join(TASK_FIELDS)} ('' where it has no variant or schema; worlds/common.Environment)")
    return None


class Environment:
    """What the learner reads of an environment, all of it: lopd.py and train.py use nothing else, and find nothing
    by getattr. A world subclasses this, implements the three episode methods and the task source, and keeps or
    overrides the rest. One instance plays one episode at a time; `engine.rollout` makes one per episode.

    A task is any object with these four fields (the tool world's `Task`, code_env's `CodeProblem`):
        task_id   unique; retrieval never returns a task's own bank entries (eq. 16)
        text      the user message: what the student sees
        variant   the family of hidden rules it follows ("" if none): --retrieval other skips it, bank recall reads it
        schema    the kind of task ("" if none): the cold start (A.2) draws schema-balanced batches (our choice)
    """
    # -- what the learner reads: prompts, tools, retrieval --------------------------------------------------------
    system_prompt: str = ""            # the first message (reset's to write; an empty one may be left out)
    framing: tuple = inject.AGENTIC_FRAMING   # the words before and after the teacher's latent block (A.5)
    tools: list | None = None          # JSON schemas for the chat template (`tools=`); None: no tools are listed.
    #                                    A world whose tasks list their own tools sets them in reset (BFCL)
    retrieval_instruction: str = retrieval.DEFAULT_INSTRUCTION   # the retriever's query prompt (eq. 15)
    parallel_steps: bool = False       # True: a batch's step() calls run in threads (CodeWorld: one sandbox each)
    untrusted_code: bool = False       # True: step() runs code nobody here wrote, or feeds a model's values to a
    #                                    benchmark's code, in worlds/sandbox.py's confined processes; train.py checks
    #                                    first that this machine can confine them (CodeWorld, BFCL, EnvScaler)
    response_template: dict | None = None   # the tokenizer's reply parser; engine.rollout sets it where there is one
    # -- what train.py reads: the run ------------------------------------------------------------------------------
    toy_world: str | None = None       # the toy backbone that knows this world (toy_backbone.py --world): tools | code
    toy_defaults: dict = {}            # settings of the toy run that differ from train.TOY_DEFAULTS, and why
    paper_defaults: dict = {}          # settings of a real model's run that differ from train.PAPER_DEFAULTS
    results: str = "behaviour"         # the results table: behaviour (Table 3's columns) | table3 (the same, with
    #                                    the paper's EnvScaler values in brackets: the tool world) | pass@1 (Table 2)
    task_files: tuple = ("train.jsonl", "test.jsonl")   # what --tasks DIR must hold (train.parse_args checks); ()
    #                                    for a world that reads a layout of its own (read_splits; EnvScaler)

    def __init__(self):
        self.trace = []                # [(name, arguments, result)] of the episode's actions: Table 3's counts

    # -- the episode --------------------------------------------------------------------------------------------
    def reset(self, task) -> list[dict]:
        """Start an episode of `task` -> its first chat messages ([system, user])."""
        raise NotImplementedError

    def step(self, reply: str) -> "StepResult":
        """Act on one assistant reply. Never raises on what the model wrote: a malformed action is an observation."""
        raise NotImplementedError

    def reward(self) -> float:
        """The episode's reward in [0, 1], read from its final state (A = 2r − 1, eq. 12)."""
        raise NotImplementedError

    def trace_text(self) -> str:
        """The experience the bank keeps of a successful episode (A.3): the observation-lite trace by default."""
        return lite_trace(self.trace)

    def oracle_trace(self, task) -> str | None:
        """A known-good trajectory of `task` as text, or None. OPSD's pool falls back on it (baselines.opsd_pool)."""
        return None

    # -- the run: how train.py makes episodes and tasks -------------------------------------------------------------
    @classmethod
    def for_run(cls, args, toy: bool) -> "Environment":
        """A fresh environment for a run with settings `args` (train.Args); `toy`: the backbone is toy_backbone.py's."""
        return cls()

    @classmethod
    def make_splits(cls, args) -> tuple[list, list]:
        """Generated (train, test) tasks from args.seed, args.n_train, args.n_test, when no --tasks is given."""
        raise NotImplementedError(f"{cls.__name__} generates no tasks: give --tasks DIR")

    @classmethod
    def load_tasks(cls, path: str) -> list:
        """The tasks of one JSONL file (--tasks DIR holds train.jsonl and test.jsonl)."""
        raise NotImplementedError(f"{cls.__name__} reads no task files: leave --tasks out")

    @classmethod
    def read_splits(cls, args, record: bool = True) -> tuple[list, list]:
        """(train, test) of --tasks: DIR/train.jsonl and DIR/test.jsonl through `load_tasks`. A world whose release
        has a layout of its own overrides it (EnvScaler: one scenario file, split by the world, which writes the
        split into args.out when `record`)."""
        return tuple(cls.load_tasks(os.path.join(args.tasks, f"{name}.jsonl")) for name in ("train", "test"))

    @classmethod
    def save_tasks(cls, tasks, path: str) -> None:
        """Write generated tasks to OUT/tasks (optional: a world that cannot write them keeps none)."""

    @classmethod
    def check_args(cls, args) -> str | None:
        """A one-line error for settings this world cannot run, or None."""
        return None


# The shipped worlds by --env name. Any other world is --env FILE.py:CLASS (or module:CLASS), a subclass of
# Environment in the user's own file: `environment_class` loads both the same way.
ENVS = {"tools": "worlds.tool_world:ToolWorld", "code": "worlds.code_world:CodeWorld", "bfcl": "worlds.bfcl:BFCLWorld",
        "envscaler": "worlds.envscaler:EnvScalerWorld"}


@functools.lru_cache(maxsize=None)
def environment_class(spec: str) -> type:
    """--env's value -> its class: a name in ENVS, or FILE.py:CLASS / module:CLASS. A ValueError of one line
    naming what was expected otherwise."""
    want = preflight.expected_worlds(ENVS)
    if problem := preflight.env_error(spec, ENVS):       # no such name (the closest named), or no such FILE.py
        raise ValueError(problem)
    where, _, name = ENVS.get(spec, spec).rpartition(":")
    try:
        if where.endswith(".py"):
            folder = os.path.dirname(os.path.abspath(where))
            if folder not in sys.path:                    # the file may import its neighbours
                sys.path.append(folder)
            # a module name of its own: a world saved as calendar.py must not take the place of Python's calendar
            own = "lopd_world_" + hashlib.sha1(os.path.abspath(where).encode()).hexdigest()[:10]
            module_spec = importlib.util.spec_from_file_location(own, where)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_spec.name] = module        # dataclasses with string annotations look it up there
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ValueError:
        raise
    except Exception as err:                              # SyntaxError, NameError, ...: the user's file, one line
        raise ValueError(f"--env {spec!r}: cannot import {where!r} ({type(err).__name__}: {err}); {want}") from None
    cls = getattr(module, name, None)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"--env {spec!r}: {where} has no class {name!r} that subclasses common.Environment; {want}")
    missing = [m for m in ("reset", "step", "reward") if getattr(cls, m) is getattr(Environment, m)]
    if missing:
        raise ValueError(f"--env {spec!r}: {name} does not implement {', '.join(missing)}, the episode methods of "
                         "worlds.common.Environment (docs/adding-an-environment.md)")
    return cls


def lite_trace(trace: list) -> str:
    """Observation-lite action-result trace (A.3): `1. tool(k="v") -> result`, one line per call."""
    lines = []
    for n, (name, args, result) in enumerate(trace, 1):
        arg_text = ", ".join(f"{k}={json.dumps(v)}" for k, v in args.items())
        lines.append(f"{n}. {name}({arg_text}) -> {result}")
    return "\n".join(lines)


def scripted_replies(calls, done: str = DONE_TEXT) -> list[str]:
    """The replies of a scripted episode (a demonstration, a test's ground truth): each entry one (name, arguments)
    call, or a list of them for one reply with several calls, in the Qwen3 format; then `done`, which ends it."""
    return ["\n".join(format_call(n, a) for n, a in (c if isinstance(c, list) else [c])) for c in calls] + [done]
