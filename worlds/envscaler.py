"""EnvScaler as released: the paper's training environments (§4.1; 191 environments, ~2,550 RL scenarios), read
from their published files, split into the paper's training tasks and 200 held-out ones (B.2, B.3), and run by the
official episode rules, each environment's code in a sandboxed worker process.

    python train.py --model Qwen/Qwen3-4B                # a real --model's default world: --tasks hf, below
    python train.py --model Qwen/Qwen3-4B --tasks DIR    # DIR: the release's files (below)
    python -m pytest tests/test_envscaler.py -q

What --tasks reads (`find_release`), each file one JSON document or JSON Lines (one record a line), with the
fields the official LOPD code reads (bingreeky/LOPD envs/envscaler/data.py):
    env-meta file   191_env_metadata.json, RUC-NLPIR/EnvScaler's name (interact_with_env/ and its ROLL graft's
                    envscaler_env/data/; an object keyed by env_id), or 191_env_metadata_processed.json (the name
                    others' code fetches from the Hugging Face dataset; a list), or env_metadata.json. Records
                    {env_id, env_class_code, tools (a list, or a JSON string), environment_introduction,
                    constraints_rules}
    scenarios       rl_scenario_metadata.json, EnvScaler's name (envscaler_rl_scenario_metadata.json in the ROLL
                    graft, and as others fetch it from Hugging Face), split here (below); or train.jsonl and
                    test.jsonl, a split of your own, which comes first when the folder holds both. Records {task_id,
                    env_id, env_class_name, task, init_config (an object, or a JSON string), checklist_with_func:
                    [{check_item, check_func}]}
    --tasks hf      the datasets XXHStudyHard/EnvScaler-191-Env and XXHStudyHard/EnvScaler-RL-Scenario through
                    huggingface_hub (snapshot_download into its cache); offline and not cached, one line names what
                    to download and where to put it. A folder named hf is ./hf. The default: a real --model
                    without --env trains here, on hf unless --tasks DIR (preflight.default_world), and the data
                    is read before the model loads.

The split (`split_ids`), when --tasks gives the release's one scenario file: every task id ranked by
sha256(f"{SPLIT_SEED}:{task_id}") with SPLIT_SEED = 0, the first 200 held out (B.3's test split), the rest trained
on. It reads the ids alone (not the file's order or format, not --seed), so two users with the same release hold
out the same tasks, and every run compares on them. The run writes the rule, the files it read (with their sha256)
and both sides' task ids to OUT/envscaler_split.json; a run resumed or read back that finds another split there
stops with one line. A bad folder or file is one line naming it and what to change.

An episode, as the official code runs it (envs/envscaler/env.py, runtime.py): the system prompt is the official
one, the environment's introduction and rules, and its tools (the chat template's block, as the official code
writes it); the class code is executed, the instance built from init_config (then each key set on it), and its
state copied. Each reply's first tool call calls the method of that name; a name the instance lacks is an error
observation; a tool that raises ends the episode with reward 0; a reply without a call ("Task Completed") ends it
with the checklist's reward: the fraction of check functions (run with `initial_state` in their globals) that
return True on the final state, rounded to 4 places. At --max-env-steps (30) the episode ends with reward 0, as
the official episode ends unscored. Results report mean reward and full-pass rate (`results = "behaviour"`).

The dataset's code is written by a model, so none of it runs in the trainer: each episode has a worker process
(`WORKER`) that the kernel confines (worlds/sandbox.py: no file read outside the interpreter's folders, no write outside
its scratch directory, no network, no new processes, no signal to another process; CPU and memory limits, a
wall-clock limit per request). A worker that hangs, dies, breaks a limit or answers anything but an answer costs its
episode (an error observation and reward 0), not the run.

The verdict is the checklist's, run in the worker on the state the tool calls produced: the reply's text never reaches
it, a call reaches the environment only as a listed tool with its declared arguments (deviation 3), and an answer the
environment's code queued ahead of the worker's own lacks the request's fresh id and answers nothing
(tests/test_verdicts.py). Environment code that runs during the checklist itself could still forge it: the dataset's
code shares the worker with its checker, as in the official code.

Choices the paper leaves open:
1. The held-out split. B.3 samples 200 tasks at random from the pool and publishes no ids; the rule above is ours.
   The release's 2,550 scenarios less 200 leave 2,350 training tasks; B.2 says 2,349 and does not say which one it
   left out, so none is left out here.

Deviations from the official code:
1. A method name starting with "_" is not a tool (the official code would call any attribute).
2. Only the first call of a reply runs, as the official parser reads only the first; the others are counted but not
   answered (the system prompt asks for one call a step).
3. A call must name one of the environment's listed tools (else it is an invalid tool, as a missing method is) and
   pass only the arguments that tool declares (else the episode ends with reward 0, as the official code's TypeError
   ends it): the official code calls any public attribute with any keywords, so a public helper the tool list lacks,
   or a tool taking **kwargs, could set the fields the checklist reads.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import textwrap
from dataclasses import dataclass, field

import inject
from runtime import checkpoints, parallel
from runtime.devices import UserError
from worlds.common import Environment, StepResult, parse_tool_calls, reply_end, utf8_text
from worlds import sandbox

# The official system prompt (envs/envscaler/runtime.py, SYSTEM_PROMPT), word for word
SYSTEM_PROMPT = (
    "You are a helpful assistant. When given a specific task, your goal is to complete it in an interactive "
    "environment by making step-by-step use of available tools. \n"
    "- Before completing the task, at each step, select a tool from the tool list and fill in all required "
    "parameters, making sure that the values are valid. Avoid making parallel tool calls in one step.\n"
    "- When you believe the task has been completed, respond only with 'Task Completed' to end the trajectory, "
    "without adding any other content or making any tool calls.\n"
    "- It is recommended to first call query tools to gather sufficient information, then use modification tools "
    "to complete the task. Adjust actions promptly based on the feedback from the environment, i.e., the tool "
    "results.\n")
LIMITS = sandbox.SandboxLimits(wall_s=10.0, cpu_s=60, memory_mb=1024, output_kb=1024)   # per episode; per request

# The worker: reads one JSON request a line, answers one JSON line. What the environment code prints is swallowed.
WORKER = r'''
import copy, io, json, sys, traceback, types
answer, sys.stdout = sys.stdout, io.StringIO()
env, init_state = None, {}

def state():
    return copy.deepcopy({k: v for k, v in vars(env).items() if not (k.startswith("__") and k.endswith("__"))})

def start(code, cls, config):
    global env, init_state
    module = types.ModuleType("envscaler_env_code")
    exec(code, module.__dict__)
    if not hasattr(module, cls):
        return {"ok": False, "text": f"class {cls!r} not found in env_class_code"}
    config = copy.deepcopy(config or {})
    try:
        env = getattr(module, cls)(config) if isinstance(config, dict) and config else getattr(module, cls)({})
    except TypeError:
        env = getattr(module, cls)()
    for k, v in (config or {}).items():
        setattr(env, k, v)
    init_state = state()
    return {"ok": True}

def call(name, args):
    if name.startswith("_") or not hasattr(env, name) or not isinstance(args, dict):
        return {"status": "invalid"}
    try:
        return {"status": "ok", "text": f"{getattr(env, name)(**args)}"}
    except Exception:
        return {"status": "raised", "text": traceback.format_exc()}

def check(code, final):
    scope = {"__builtins__": __builtins__, "initial_state": copy.deepcopy(init_state)}
    try:
        exec(code, scope)
        result = scope["check_func"](final)
        return result is True
    except Exception:
        return False

def reward(checklist):
    if not checklist:
        return {"reward": 0.0, "passed": []}
    final = state()
    passed = [check(c["check_func"], copy.deepcopy(final)) for c in checklist]
    return {"reward": round(sum(passed) / len(checklist), 4), "passed": passed}

for line in sys.stdin:
    req = json.loads(line)
    try:
        out = {"start": lambda: start(req["code"], req["cls"], req["config"]),
               "call": lambda: call(req["name"], req["args"]), "reward": lambda: reward(req["checklist"])}[req["op"]]()
    except BaseException:
        out = {"ok": False, "status": "raised", "text": traceback.format_exc()}
    out["id"] = req.get("id")
    sys.stdout.seek(0), sys.stdout.truncate()
    answer.write(json.dumps(out, default=str) + "\n")
    answer.flush()
'''


# ----------------------------------------------------------------------------------------------------------------
# The released files
# ----------------------------------------------------------------------------------------------------------------
# The file names, as each copy of the release spells them (the module docstring says where each comes from)
META_FILES = ("191_env_metadata.json", "191_env_metadata_processed.json", "env_metadata.json")
SCENARIO_FILES = ("rl_scenario_metadata.json", "envscaler_rl_scenario_metadata.json")
SPLIT_FILES = ("train.jsonl", "test.jsonl")        # a split of the user's own, beside an env-meta file
META_FIELDS = ("env_id", "env_class_code")         # and tools, environment_introduction, constraints_rules
SCENARIO_FIELDS = ("task_id", "env_id", "env_class_name", "task")   # and init_config, checklist_with_func
HF_DATASETS = ("XXHStudyHard/EnvScaler-191-Env", "XXHStudyHard/EnvScaler-RL-Scenario")   # --tasks hf
TEST_SIZE = 200                      # B.3: the held-out tasks
SPLIT_SEED = 0                       # the split's own: runs of any --seed hold out the same tasks, so they compare
SPLIT_RECORD = "envscaler_split.json"   # in OUT: the rule and the task ids of both sides
WANT = (f"--tasks wants EnvScaler's release ({META_FILES[0]} and {SCENARIO_FILES[0]}; ROLL's copy names the "
        f"second {SCENARIO_FILES[1]}), or an env-meta file with train.jsonl and test.jsonl of your own, or hf")


@dataclass
class EnvScalerTask:
    """One RL scenario in the project's task fields (common.Environment), with its environment's record."""
    task_id: str
    text: str                      # the scenario's task: the user message
    variant: str                   # its env_id: --retrieval other skips the same environment's experience
    schema: str                    # its env_id too: the cold start balances over environments
    scenario: dict = field(repr=False)
    env: dict = field(repr=False)


def _parse(path: str):
    """The file's JSON: one document, or one value a line (JSON Lines). A bad file is one line naming it."""
    try:
        text = open(path, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"--env envscaler: cannot read {path!r} ({getattr(err, 'strerror', None) or err}); "
                        f"{WANT}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        document = f"{path}:{err.lineno}: not JSON ({err.msg}); the file is cut short or was edited: download it again"
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:       # not even the first line a record: a broken document
                raise UserError(document if not rows else f"{path}:{n}: not JSON ({err.msg}); give one JSON "
                                "document (a list of records) or one record a line") from None
    return rows


def _records(path: str, key: str | None = None) -> list[dict]:
    """The records of a file as the releases come: a JSON list, an object of records (the GitHub copy's env-meta
    file, keyed by env_id: the key fills `key` where a record lacks it), or one record a line."""
    data = _parse(path)
    if isinstance(data, dict):
        keyed = data and all(isinstance(v, dict) for v in data.values())
        data = [{key: k, **v} if key else v for k, v in data.items()] if keyed else [data]
    if not isinstance(data, list) or not data or not all(isinstance(r, dict) for r in data):
        raise UserError(f"{path}: expected records (a JSON list of objects, an object of them, or one a line); "
                        f"found {type(data).__name__ if not isinstance(data, list) else 'no objects'}; {WANT}")
    return data


def _need(path: str, n: int, rec: dict, fields: tuple) -> None:
    missing = [f for f in fields if f not in rec]
    if missing:
        name = rec.get("task_id") or rec.get("env_id") or "no id"
        raise UserError(f"{path}: record {n} ({name}) lacks {', '.join(missing)}; EnvScaler's records carry "
                        f"{', '.join(fields)}")


def _decoded(value, where: str, what: str):
    """A field the release stores as a JSON string (tools, init_config), decoded; a decoded one as it is."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as err:
        raise UserError(f"{where}: {what} is a string but not JSON ({err.msg}); give it as JSON") from None


def tool_schema(tool) -> dict:
    """A tool of the env-meta file as the chat template takes it ({"type": "function", "function": {...}})."""
    tool = json.loads(tool) if isinstance(tool, str) else tool
    return tool if "function" in tool else {"type": "function", "function": tool}


def load_meta(path: str) -> dict:
    """The env-meta file -> {env_id: record}, its tools as chat-template schemas."""
    meta = {}
    for n, rec in enumerate(_records(path, key="env_id"), 1):
        _need(path, n, rec, META_FIELDS)
        tools = _decoded(rec.get("tools"), f"{path}: record {n} ({rec['env_id']})", "tools") or []
        meta[str(rec["env_id"])] = {**rec, "tools": [tool_schema(t) for t in tools]}
    return meta


def load_scenarios(path: str, meta: dict | None = None) -> list[EnvScalerTask]:
    """The scenarios of one file joined to their environments (`meta`: load_meta's; by default the env-meta file
    in the same folder). Task ids are unique within the file."""
    if meta is None:
        folder = os.path.dirname(path)
        found = _first([folder], META_FILES)
        if found is None:
            raise UserError(f"--env envscaler: {folder or '.'!r} has no env-meta file ({' or '.join(META_FILES)}) "
                            f"beside {os.path.basename(path)}; {WANT}")
        meta = load_meta(found)
    tasks, seen = [], set()
    for n, s in enumerate(_records(path, key="task_id"), 1):
        _need(path, n, s, SCENARIO_FIELDS)
        task_id, env_id, where = str(s["task_id"]), str(s["env_id"]), f"{path}: scenario {n} ({s['task_id']})"
        if env_id not in meta:
            raise UserError(f"{where} names env_id {env_id!r}, which the env-meta file lacks; give the env-meta "
                            "file of the same release")
        if task_id in seen:
            raise UserError(f"{where}: task_id {task_id!r} appears twice; task ids must be unique")
        seen.add(task_id)
        scenario = {**s, "init_config": _decoded(s.get("init_config"), where, "init_config") or {},
                    "checklist_with_func": _decoded(s.get("checklist_with_func"), where, "checklist_with_func") or []}
        tasks.append(EnvScalerTask(task_id, s["task"], env_id, env_id, scenario, meta[env_id]))
    return tasks


# ----------------------------------------------------------------------------------------------------------------
# Where --tasks points, and the held-out split
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Release:
    """The files of a --tasks value: the env-meta file, and the scenarios as the release's one file (split here)
    or as a split of the user's own (train.jsonl and test.jsonl)."""
    meta: str
    scenarios: str | None = None
    train: str | None = None
    test: str | None = None


def _first(folders: list, names: tuple) -> str | None:
    """The first of `names` found in any of `folders`, in the order of `names`."""
    for name in names:
        for folder in folders:
            if os.path.isfile(os.path.join(folder, name)):
                return os.path.join(folder, name)
    return None


def hub_snapshots() -> list[str]:
    """--tasks hf: the two datasets' folders in huggingface_hub's cache, fetched when the Hub answers. Offline and
    not cached: one line naming what to download and where to put it."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError
    try:
        return [snapshot_download(repo, repo_type="dataset", allow_patterns=["*.json", "*.jsonl"])
                for repo in HF_DATASETS]
    except (OSError, HfHubHTTPError) as err:
        why = textwrap.shorten(f"{type(err).__name__}: {err}", 160, placeholder=" ...").split(". ")[0].rstrip(" .")
        raise UserError(f"--tasks hf (EnvScaler's data, the default world of a real --model): cannot fetch the "
                        f"datasets {' and '.join(HF_DATASETS)} ({why}); where the Hub is reachable run `hf download "
                        f"{HF_DATASETS[0]} --repo-type dataset --local-dir DIR` and the same for {HF_DATASETS[1]}, "
                        f"copy DIR here (it holds {META_FILES[1]} and {SCENARIO_FILES[1]}) and give --tasks DIR; "
                        "or give --env tools for the toy world") from None


def find_release(spec: str) -> Release:
    """--tasks DIR (or hf) -> its files. A split of one's own (train.jsonl, test.jsonl) comes before the release's
    scenario file when a folder holds both."""
    if spec == "hf":
        folders = hub_snapshots()
    elif os.path.isdir(spec):
        folders = [spec]
    else:
        raise UserError(f"--tasks {spec!r}: no such folder; {WANT}")
    meta, scenarios = _first(folders, META_FILES), _first(folders, SCENARIO_FILES)
    train, test = (_first(folders, (name,)) for name in SPLIT_FILES)
    if meta and train and test:
        return Release(meta, train=train, test=test)
    if meta and scenarios:
        return Release(meta, scenarios=scenarios)
    held = ", ".join(os.path.basename(p) for p in (meta, scenarios, train, test) if p)
    raise UserError(f"--tasks {spec!r}: {f'holds only {held}' if held else 'holds none of its files'} (in "
                    f"{', '.join(folders)}); {WANT}")


def split_ids(ids: list[str], where: str, test_size: int = TEST_SIZE, seed: int = SPLIT_SEED) -> tuple[list, list]:
    """B.3's held-out split of the release's scenarios -> (train ids, test ids): every id ranked by
    sha256(f"{seed}:{task_id}"), the first `test_size` held out, the rest trained on, each side in that order. It
    reads the ids alone: not the file's order or format, not --seed."""
    if len(ids) <= test_size:
        raise UserError(f"{where}: {len(ids)} scenarios, too few to hold out {test_size} (B.3); give a split of "
                        "your own as train.jsonl and test.jsonl beside the env-meta file")
    ranked = sorted(ids, key=lambda i: hashlib.sha256(f"{seed}:{i}".encode()).hexdigest())
    return ranked[test_size:], ranked[:test_size]


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def load_release(spec: str) -> tuple[list, list, dict]:
    """--tasks DIR (or hf) -> (train tasks, test tasks, the split's record for OUT/envscaler_split.json: the rule,
    the files read, and the task ids of both sides in order)."""
    rel = find_release(spec)
    meta = load_meta(rel.meta)
    if rel.scenarios:
        tasks = {t.task_id: t for t in load_scenarios(rel.scenarios, meta)}
        train_ids, test_ids = split_ids(list(tasks), rel.scenarios)
        train, test = [tasks[i] for i in train_ids], [tasks[i] for i in test_ids]
        rule = f"held out: the {TEST_SIZE} task ids of smallest sha256(f'{SPLIT_SEED}:{{task_id}}'); trained: the rest"
    else:
        train, test = load_scenarios(rel.train, meta), load_scenarios(rel.test, meta)
        both = {t.task_id for t in train} & {t.task_id for t in test}
        if both:
            raise UserError(f"--tasks {spec!r}: train.jsonl and test.jsonl share {len(both)} task ids (e.g. "
                            f"{sorted(both)[0]!r}); the held-out tasks must be disjoint from training (B.3)")
        rule = "given: the folder's train.jsonl and test.jsonl"
    files = [p for p in (rel.scenarios, rel.train, rel.test) if p]
    record = {"rule": rule, "seed": SPLIT_SEED, "env_metadata": rel.meta, "scenarios": files,
              "sha256": {os.path.basename(p): _sha256(p) for p in [rel.meta, *files]},
              "train": [t.task_id for t in train], "test": [t.task_id for t in test]}
    return train, test, record


def system_prompt(env: dict) -> str:
    """The official system prompt, then the environment's introduction and rules (construct_env_introduction)."""
    rules = "".join(f"- {r}\n" for r in env.get("constraints_rules") or [])
    return (SYSTEM_PROMPT + "\n\n# Environment Information\n\n"
            f"## Brief Introduction:  \n{env.get('environment_introduction', '')}\n\n"
            f"## Environment Rules / Constraints:  \n{rules}")


# ----------------------------------------------------------------------------------------------------------------
# The environment
# ----------------------------------------------------------------------------------------------------------------
GONE = "Error: the environment did not answer (it hung, crashed or broke a sandbox limit); the episode ends"
STATUSES = ("ok", "invalid", "raised")


def call_answer(answer) -> dict | None:
    """A worker's answer to a call, if it is one ({"status": ok | invalid | raised, "text": str}), else None; its
    text as UTF-8 can carry it (common.utf8_text)."""
    if isinstance(answer, dict) and answer.get("status") in STATUSES and isinstance(answer.get("text", ""), str):
        return {"status": answer["status"], "text": utf8_text(answer.get("text", ""))}
    return None


def checklist_reason(checklist: list, passed) -> str:
    """The checklist's verdict in words: "2 of 3 checks passed; failed: <its check_item>, ..." (the items are the
    release's text; the worker's answer only says which, and is read only where it is a list of booleans)."""
    if not (isinstance(passed, list) and len(passed) == len(checklist) and all(isinstance(p, bool) for p in passed)):
        return "the checklist's reward (no per-check answer)"
    failed = [str(c.get("check_item", f"check {k + 1}")) for k, (c, p) in enumerate(zip(checklist, passed)) if not p]
    return f"{sum(passed)} of {len(passed)} checks passed" + (f"; failed: {'; '.join(failed)}"[:300] if failed else "")


def reward_answer(answer) -> float | None:
    """A worker's answer to the checklist, if it is one (a reward in [0, 1]), else None."""
    value = answer.get("reward") if isinstance(answer, dict) else None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and 0 <= value <= 1:
        return float(value)
    return None


@dataclass
class EnvScalerWorld(Environment):
    """An EnvScaler scenario as an episode (the module docstring gives the official rules it follows). Whatever the
    worker answers (a tool that raised, a checklist that could not run, a hang, a death, a line that is not an
    answer), the episode gets an error observation or ends scored; `step` never raises."""
    framing: tuple = inject.AGENTIC_FRAMING
    results: str = "behaviour"
    max_steps: int = 30                         # the paper's 30 environment steps (B.2)
    limits: sandbox.SandboxLimits = field(default_factory=lambda: LIMITS)
    task: EnvScalerTask | None = None
    untrusted_code = True                       # the dataset's class code and check functions
    task_files = ()                             # --tasks: the release's layout (find_release), checked by check_args
    log: dict | None = None                     # task_id -> {"reward", "reason"} once an episode ends (eval.py)

    def reset(self, task: EnvScalerTask) -> list[dict]:
        """The first messages; the worker starts at the first step (a prompt rendered for scoring needs none)."""
        self.close()
        self.task, self.trace, self.steps, self._reward = task, [], 0, 0.0
        self.reason = "unscored: the episode ended before 'Task Completed'"
        self.tools = task.env["tools"]
        return [{"role": "system", "content": system_prompt(task.env)}, {"role": "user", "content": task.text}]

    def _start(self) -> bool:
        """The episode's worker: the class code executed, the instance built and its initial state kept."""
        self.worker = sandbox.Worker(WORKER, self.limits)
        scenario = self.task.scenario
        started = self._ask(op="start", code=self.task.env["env_class_code"], cls=scenario["env_class_name"],
                            config=scenario["init_config"])
        return bool(started and started.get("ok") is True)

    def step(self, reply: str) -> StepResult:
        self.steps += 1
        if self.steps == 1 and not self._start():               # code that fails, hangs or escapes: the episode ends
            return self._end(GONE)
        calls = parse_tool_calls(reply, self.response_template)
        if not calls:                                            # "Task Completed": scored by the checklist
            answer = self._ask(op="reward", checklist=self.task.scenario["checklist_with_func"])
            if not self._scored(reward_answer(answer)):
                return self._end(GONE)
            self.reason = checklist_reason(self.task.scenario["checklist_with_func"], answer.get("passed"))
            return StepResult([], True, end=reply_end(reply))
        name, args = calls[0]                                    # the official parser reads the first call only
        if name is None:                                         # malformed: an observation, the episode goes on
            return self._capped(StepResult([f"Error: malformed response. {args}"], False, len(calls), 1))
        refused = self._refused(name, args, len(calls))
        if refused:                                              # deviation 3: never reaches the environment
            return refused
        answer = call_answer(self._ask(op="call", name=name, args=args))
        if answer is None:                                       # hung, died, or answered nonsense
            return self._end(GONE, len(calls))
        self.trace.append((name, args, answer.get("text", "")))
        if answer["status"] == "invalid":
            return self._capped(StepResult([f"Error: '{name}' is not a valid tool of this environment."], False,
                                           len(calls), 1))
        if answer["status"] == "raised":                         # the official rule: a raising tool ends it, 0
            return self._end("Error: <Exception>\n" + answer.get("text", ""), len(calls))
        return self._capped(StepResult([answer.get("text", "")], False, len(calls), 0))

    def _ask(self, **request) -> dict | None:
        """One request to the worker, with a fresh id its answer must carry: a line the environment's code wrote ahead
        of the worker's own answer (a forged answer queued on the stream) answers no request, and ends the episode."""
        tag = secrets.token_hex(8)
        answer = self.worker.request(id=tag, **request)
        return answer if isinstance(answer, dict) and answer.get("id") == tag else None

    def _refused(self, name: str, args: dict, n_calls: int) -> StepResult | None:
        """A call the checker's state must never see (deviation 3): a name the tool list lacks is an invalid tool, as
        a missing method is; an argument the tool does not declare ends the episode with reward 0, as the official
        code's TypeError does (a tool taking **kwargs would otherwise write it into the state)."""
        tool = next((t["function"] for t in self.tools if t.get("function", {}).get("name") == name), None)
        if tool is None:
            return self._capped(StepResult([f"Error: '{name}' is not a valid tool of this environment."], False,
                                           n_calls, 1))
        declared = (tool.get("parameters") or {}).get("properties")
        extra = [k for k in args if k not in declared] if isinstance(declared, dict) and isinstance(args, dict) else []
        if extra:
            return self._end(f"Error: <Exception>\n{name}() got an unexpected keyword argument {extra[0]!r}", n_calls)
        return None

    def _scored(self, reward: float | None) -> bool:
        """Keep the checklist's reward; False (reward 0) when the worker gave none."""
        self._reward = reward or 0.0
        return reward is not None

    def _capped(self, result: StepResult) -> StepResult:
        """At the step cap the episode ends unscored (reward 0), as the official one does."""
        if not result.done and self.steps >= self.max_steps:
            result.done, result.end = True, "step cap"
            self.reason = f"unscored: the step cap ({self.max_steps} steps) came before 'Task Completed'"
        return result

    def _end(self, text: str, n_calls: int = 0) -> StepResult:
        self._reward, self.reason = 0.0, "unscored: " + text.removeprefix("Error: ")[:300]
        return StepResult([text], True, n_calls, 1, end="error")

    def reward(self) -> float:
        """The checklist's reward; what it was and why goes to `log`."""
        self.close()
        if self.log is not None:
            self.log[self.task.task_id] = {"reward": self._reward, "reason": self.reason}
        return self._reward

    def close(self):
        """Stop the episode's worker, if it runs."""
        if getattr(self, "worker", None) is not None:
            self.worker = self.worker.close()

    # -- the run --------------------------------------------------------------------------------------------------
    @classmethod
    def for_run(cls, args, toy: bool) -> "EnvScalerWorld":
        return cls(max_steps=args.max_env_steps)

    @classmethod
    def load_tasks(cls, path: str) -> list:
        return load_scenarios(path)

    @classmethod
    def read_splits(cls, args, record: bool = True) -> tuple[list, list]:
        """--tasks DIR or hf -> (train, test), the split recorded in OUT/envscaler_split.json; a run resumed or read
        back must find the same split there."""
        train, test, split = load_release(args.tasks)
        path = os.path.join(args.out, SPLIT_RECORD)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                kept = json.load(f)
            if [kept.get("train"), kept.get("test")] != [split["train"], split["test"]]:
                raise UserError(f"--tasks {args.tasks!r} gives another split than {path} records (another release, "
                                "or files changed); give the files this run was made with, or a new --out")
        elif record and parallel.rank() == 0:
            os.makedirs(args.out, exist_ok=True)
            checkpoints.write_json(path, split)
        return train, test

    @classmethod
    def check_args(cls, args) -> str | None:
        if not args.tasks:
            return ("--env envscaler reads EnvScaler's files: give --tasks DIR (the release's "
                    f"{META_FILES[0]} and {SCENARIO_FILES[0]}, or env_metadata.json, train.jsonl and test.jsonl) "
                    "or --tasks hf (its Hugging Face datasets)")
        own_split = all(os.path.isfile(os.path.join(args.tasks, f)) for f in SPLIT_FILES)
        if args.tasks != "hf" and not own_split:   # the Hub, and a split's env-meta file, when the tasks are read
            try:
                find_release(args.tasks)
            except UserError as err:
                return str(err)
        return super().check_args(args)
