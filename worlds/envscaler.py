"""EnvScaler as released: the paper's training environments (§4.1; 191 environments, ~2,550 RL scenarios), read
from their two published files and run by the official episode rules, each environment's code in a sandboxed
worker process.

    python train.py --model Qwen/Qwen3-4B --env envscaler --tasks DIR     # DIR: env_metadata.json, train.jsonl,
                                                                          # test.jsonl (EnvScaler's files)
    python -m pytest tests/test_envscaler.py -q

The files (the official loader's fields, bingreeky/LOPD envs/envscaler/data.py):
    DIR/env_metadata.json   the env-meta file: a JSON list (or an object of records) of {env_id, env_class_code,
                            tools, environment_introduction, constraints_rules}
    DIR/train.jsonl, test.jsonl   scenario records {task_id, env_id, env_class_name, task, init_config,
                            checklist_with_func: [{check_item, check_func}]}, one per line or as one JSON list;
                            split the released scenario file into the two as you like.

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

Deviations from the official code:
1. A method name starting with "_" is not a tool (the official code would call any attribute).
2. Only the first call of a reply runs, as the official parser reads only the first; the others are counted but not
   answered (the system prompt asks for one call a step).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import inject
from runtime import UserError
from worlds.common import Environment, StepResult, parse_tool_calls
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
        return {"reward": 0.0}
    final = state()
    return {"reward": round(sum(check(c["check_func"], copy.deepcopy(final)) for c in checklist) / len(checklist), 4)}

for line in sys.stdin:
    req = json.loads(line)
    try:
        out = {"start": lambda: start(req["code"], req["cls"], req["config"]),
               "call": lambda: call(req["name"], req["args"]), "reward": lambda: reward(req["checklist"])}[req["op"]]()
    except BaseException:
        out = {"ok": False, "status": "raised", "text": traceback.format_exc()}
    sys.stdout.seek(0), sys.stdout.truncate()
    answer.write(json.dumps(out, default=str) + "\n")
    answer.flush()
'''


# ----------------------------------------------------------------------------------------------------------------
# The released files
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class EnvScalerTask:
    """One RL scenario in the project's task fields (common.Environment), with its environment's record."""
    task_id: str
    text: str                      # the scenario's task: the user message
    variant: str                   # its env_id: --retrieval other skips the same environment's experience
    schema: str                    # its env_id too: the cold start balances over environments
    scenario: dict = field(repr=False)
    env: dict = field(repr=False)


def _records(path: str) -> list[dict]:
    """A JSON list (or an object of records) or JSONL, as the releases come; a bad file is one line naming it."""
    try:
        text = open(path, encoding="utf-8").read()
    except OSError as err:
        raise UserError(f"--env envscaler: cannot read {path!r} ({err.strerror}); --tasks DIR needs "
                        "env_metadata.json, train.jsonl and test.jsonl") from None
    try:
        data = json.loads(text)
        return list(data.values()) if isinstance(data, dict) else data
    except json.JSONDecodeError:
        pass
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise UserError(f"{path}:{n}: not JSON ({err.msg}); give a JSON list or one record a line") from None
    return out


def tool_schema(tool) -> dict:
    """A tool of the env-meta file as the chat template takes it ({"type": "function", "function": {...}})."""
    tool = json.loads(tool) if isinstance(tool, str) else tool
    return tool if "function" in tool else {"type": "function", "function": tool}


def load_scenarios(path: str) -> list[EnvScalerTask]:
    """The scenarios of one file, joined to their environments from env_metadata.json in the same folder."""
    meta = {}
    for rec in _records(os.path.join(os.path.dirname(path), "env_metadata.json")):
        tools = json.loads(rec["tools"]) if isinstance(rec.get("tools"), str) else rec.get("tools") or []
        meta[rec["env_id"]] = {**rec, "tools": [tool_schema(t) for t in tools]}
    tasks = []
    for n, s in enumerate(_records(path), 1):
        if s.get("env_id") not in meta:
            raise UserError(f"{path}: scenario {n} ({s.get('task_id')}) names env_id {s.get('env_id')!r}, which "
                            "env_metadata.json lacks")
        config = json.loads(s["init_config"]) if isinstance(s.get("init_config"), str) else s.get("init_config")
        scenario = {**s, "init_config": config or {}, "checklist_with_func": s.get("checklist_with_func") or []}
        tasks.append(EnvScalerTask(str(s["task_id"]), s["task"], s["env_id"], s["env_id"], scenario, meta[s["env_id"]]))
    return tasks


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
    """A worker's answer to a call, if it is one ({"status": ok | invalid | raised, "text": str}), else None."""
    if isinstance(answer, dict) and answer.get("status") in STATUSES and isinstance(answer.get("text", ""), str):
        return answer
    return None


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

    def reset(self, task: EnvScalerTask) -> list[dict]:
        """The first messages; the worker starts at the first step (a prompt rendered for scoring needs none)."""
        self.close()
        self.task, self.trace, self.steps, self._reward = task, [], 0, 0.0
        self.tools = task.env["tools"]
        return [{"role": "system", "content": system_prompt(task.env)}, {"role": "user", "content": task.text}]

    def _start(self) -> bool:
        """The episode's worker: the class code executed, the instance built and its initial state kept."""
        self.worker = sandbox.Worker(WORKER, self.limits)
        scenario = self.task.scenario
        started = self.worker.request(op="start", code=self.task.env["env_class_code"],
                                      cls=scenario["env_class_name"], config=scenario["init_config"])
        return bool(started and started.get("ok") is True)

    def step(self, reply: str) -> StepResult:
        self.steps += 1
        if self.steps == 1 and not self._start():               # code that fails, hangs or escapes: the episode ends
            return self._end(GONE)
        calls = parse_tool_calls(reply, self.response_template)
        if not calls:                                            # "Task Completed": scored by the checklist
            reward = reward_answer(self.worker.request(op="reward",
                                                       checklist=self.task.scenario["checklist_with_func"]))
            return StepResult([], True) if self._scored(reward) else self._end(GONE)
        name, args = calls[0]                                    # the official parser reads the first call only
        if name is None:                                         # malformed: an observation, the episode goes on
            return self._capped(StepResult([f"Error: malformed response. {args}"], False, len(calls), 1))
        answer = call_answer(self.worker.request(op="call", name=name, args=args))
        if answer is None:                                       # hung, died, or answered nonsense
            return self._end(GONE, len(calls))
        self.trace.append((name, args, answer.get("text", "")))
        if answer["status"] == "invalid":
            return self._capped(StepResult([f"Error: '{name}' is not a valid tool of this environment."], False,
                                           len(calls), 1))
        if answer["status"] == "raised":                         # the official rule: a raising tool ends it, 0
            return self._end("Error: <Exception>\n" + answer.get("text", ""), len(calls))
        return self._capped(StepResult([answer.get("text", "")], False, len(calls), 0))

    def _scored(self, reward: float | None) -> bool:
        """Keep the checklist's reward; False (reward 0) when the worker gave none."""
        self._reward = reward or 0.0
        return reward is not None

    def _capped(self, result: StepResult) -> StepResult:
        """At the step cap the episode ends unscored (reward 0), as the official one does."""
        result.done = result.done or self.steps >= self.max_steps
        return result

    def _end(self, text: str, n_calls: int = 0) -> StepResult:
        self._reward = 0.0
        return StepResult([text], True, n_calls, 1)

    def reward(self) -> float:
        self.close()
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
    def check_args(cls, args) -> str | None:
        if not args.tasks:
            return ("--env envscaler reads EnvScaler's files: give --tasks DIR (env_metadata.json, train.jsonl, "
                    "test.jsonl)")
        return super().check_args(args)
