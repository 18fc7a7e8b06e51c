"""A world of the user's own (docs/adding-an-environment.md): the doc's two example files, exactly as printed there
(greeter.py, single-turn; pantry.py, multi-turn with tools), are loaded with --env FILE.py:CLASS, unit-checked and
trained end to end by train.py (pantry by the doc's own smoke command); wrong --env values are one line.

Run: python -m pytest tests/test_custom_env.py -q      (about a minute on 2 CPU cores: one tiny train.py run)
"""
import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import train  # noqa: E402
from worlds import common, tool_world  # noqa: E402

DOC = os.path.join(ROOT, "docs", "adding-an-environment.md")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def example(file: str = "greeter.py") -> tuple[str, str, str]:
    """The doc's ```python block whose docstring names `file` -> (its source, its file name, the Environment
    subclass it defines)."""
    blocks = re.findall(r"^```python\n(.*?)^```", open(DOC, encoding="utf-8").read(), flags=re.S | re.M)
    named = [b for b in blocks if b.startswith(f'"""{file}:')]          # the docstring names the file
    assert len(named) == 1, f"expected one python block of {file} in {DOC}, found {len(named)}"
    cls = re.search(r"^class (\w+)\(common\.Environment\):", named[0], flags=re.M).group(1)
    return named[0], file, cls


def write_example(folder, file: str = "greeter.py") -> str:
    """The example written to a file of its own: --env's value for it, FILE.py:CLASS."""
    source, name, cls = example(file)
    path = folder / name
    path.write_text(source)
    return f"{path}:{cls}"


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> str:
    return write_example(tmp_path_factory.mktemp("world"))


@pytest.fixture(scope="module")
def world(spec):
    """(the example's class, its module's names: OFFICES, SCHEMAS, ...)"""
    cls = common.environment_class(spec)
    return cls, cls.reward.__globals__


def splits(cls, seed=0, n_train=40, n_test=10):
    return cls.make_splits(train.parse_args(["--seed", str(seed), "--n-train", str(n_train),
                                             "--n-test", str(n_test)]))


def right_reply(names, task) -> str:
    """The reply that follows the task's office's hidden form."""
    return names["OFFICES"][task.variant].format(names["SCHEMAS"][task.schema][1].format(task.guest))


@pytest.mark.parametrize("file, most", [("greeter.py", 60), ("pantry.py", 90)])
def test_each_example_is_one_short_file(file, most):
    source, name, cls = example(file)
    lines = source.splitlines()
    assert 30 <= len(lines) <= most, len(lines)
    assert max(map(len, lines)) <= 118
    compile(source, name, "exec")
    assert f"--env {name}:{cls}" in open(DOC, encoding="utf-8").read()   # the doc's command runs this file


def test_env_loads_it_by_path(spec, world):
    cls, _ = world
    assert issubclass(cls, common.Environment) and cls is not common.Environment
    args = train.parse_args(["--env", spec])
    assert train.environment(args) is cls
    env = train.env_factory(args)()
    assert isinstance(env, cls) and env.toy_world is None


def test_splits_are_seeded_and_disjoint(world):
    cls, _ = world
    tr, te = splits(cls)
    assert (len(tr), len(te)) == (40, 10)
    for t in tr + te:
        assert all(isinstance(getattr(t, k), str) for k in ("task_id", "text", "variant", "schema"))
    assert len({t.task_id for t in tr + te}) == 50
    assert not {t.text for t in tr} & {t.text for t in te}               # disjoint by what the model sees
    assert len({t.variant for t in tr}) > 1 and len({t.schema for t in tr}) > 1
    again, other = splits(cls), splits(cls, seed=1)
    assert [t.text for t in again[0] + again[1]] == [t.text for t in tr + te]
    assert [t.text for t in other[0] + other[1]] != [t.text for t in tr + te]


def test_rewards_and_malformed_replies(world):
    cls, names = world
    tr, te = splits(cls)
    for task in tr[:12]:
        env = cls()
        msgs = env.reset(task)
        assert msgs[-1] == {"role": "user", "content": task.text}
        result = env.step(right_reply(names, task))
        assert isinstance(result, common.StepResult) and result.done and result.errors == 0
        assert env.reward() == 1.0
        others = [v for v in names["OFFICES"] if v != task.variant]
        env.reset(task)
        env.step(right_reply(names, dataclasses.replace(task, variant=others[0])))   # another office's form
        assert 0.0 < env.reward() < 1.0
    for bad in ("", "   ", "<tool_call>{not json", "\x00\ufffd", "Task Completed", "x" * 5000):
        env = cls()
        env.reset(te[0])
        result = env.step(bad)                                            # never raises
        assert result.done and 0.0 <= env.reward() < 1.0
        json.dumps([list(t) for t in env.trace])                          # the rollout json-dumps each call


def test_same_variant_experience_carries_what_the_task_lacks(world):
    """The point of LOPD: a solved task of the same office, as the bank keeps it, solves another task of that
    office; one of another office does not."""
    cls, names = world
    tr, _ = splits(cls, n_train=80)
    env = cls()
    a = tr[0]
    env.reset(a)
    env.step(right_reply(names, a))
    experience = env.trace_text()
    assert experience

    def words(t):
        return names["SCHEMAS"][t.schema][1].format(t.guest)

    same = next(t for t in tr[1:] if t.variant == a.variant and t.schema == a.schema)
    other = next(t for t in tr[1:] if t.variant != a.variant and t.schema == a.schema)
    for task, want in ((same, 1.0), (other, 0.5)):
        env.reset(task)
        env.step(experience.replace(words(a), words(task)))
        assert env.reward() == want, (task, experience)


def test_tasks_round_trip_through_jsonl(world, tmp_path):
    """What the doc says `load_tasks` and `save_tasks` take: tool_world.save_tasks and common.read_jsonl."""
    cls, names = world
    tr, _ = splits(cls, n_train=5, n_test=1)
    tool_world.save_tasks(tr, str(tmp_path / "train.jsonl"))
    back = common.read_jsonl(str(tmp_path / "train.jsonl"), lambda row, where: names["Greeting"](**row))
    assert back == tr


def test_train_py_runs_it_end_to_end(spec, toy_backbone_dir, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "train.py", "--env", spec, "--model", toy_backbone_dir, "--out", str(out),
           "--n-train", "12", "--n-test", "3", "--bank-threshold", "0", "--cold-steps", "1", "--steps", "2",
           "--rollouts-per-step", "2", "--micro-batch", "1", "--latents", "2", "--max-new-tokens", "12",
           "--max-env-steps", "2", "--save-every", "1", "--embedder", "backbone"]
    res = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    table = (out / "results.md").read_text()
    for row in ("vanilla", "base + composer", "LOPD student"):
        assert f"| {row} |" in table, table
    assert table.startswith("Held-out tasks, 3 a row\n") and "(" not in table     # no EnvScaler values: not the toy
    # the run said its size first (the flags above, and --bank-rollouts' default 2), and its table under the caption
    assert res.stdout.splitlines()[0].startswith(
        "this run: 24 base rollouts (12 tasks × 2), 1 cold-start step, 2 lopd iterations of 2 rollouts, 3 rows × 3 "
        "held-out tasks at the end"), res.stdout[:500]
    assert "\nHeld-out tasks, 3 a row\n\n| row | reward | full pass |" in res.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["stage"] == "lopd"] == [0, 1]
    bank = next(r for r in rows if r["stage"] == "bank")
    assert "recall3_variant" in bank


@pytest.mark.parametrize("value", ["nofile.py:X", "worlds.tool_world:Task", "bogus", "{path}:NoSuchClass",
                                   "{path}:Greeting"])
def test_a_wrong_env_is_one_line_and_status_2(value, spec, capsys):
    value = value.format(path=spec.rpartition(":")[0])
    with pytest.raises(SystemExit) as exit_:
        train.main(["--env", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [err[-1]] and not any("usage:" in line for line in err), err   # one line, no usage
    assert "error: --env" in err[-1] and "expected" in err[-1], err[-1]


@pytest.mark.parametrize("body, says", [
    ("from worlds import common\nclass W(common.Environment):\n    def reset(self, task):\n        return []\n",
     "does not implement step, reward"),
    ("from worlds import common\nundefined_name\nclass W(common.Environment):\n    pass\n",      # W is there: runs
     "NameError: name 'undefined_name' is not defined"),
    ("from worlds import common\ndef broken(:\n", "SyntaxError"),
])
def test_a_broken_world_file_is_one_line_before_any_model_loads(body, says, tmp_path, capsys):
    path = tmp_path / "world.py"
    path.write_text(body)
    with pytest.raises(SystemExit) as exit_:
        train.main(["--env", f"{path}:W", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and err == [err[-1]] and says in err[-1], err
    assert not (tmp_path / "run").exists()                               # nothing ran


def test_a_world_file_imports_its_neighbours(tmp_path):
    (tmp_path / "helpers_for_world.py").write_text("GREETING = 'hi'\n")
    (tmp_path / "neighbour_world.py").write_text(
        "from worlds import common\nfrom helpers_for_world import GREETING\n\nclass N(common.Environment):\n"
        "    def reset(self, task):\n        return [{'role': 'user', 'content': GREETING}]\n"
        "    def step(self, reply):\n        return common.StepResult([], True)\n"
        "    def reward(self):\n        return 0.0\n")
    cls = common.environment_class(f"{tmp_path / 'neighbour_world.py'}:N")
    assert cls().reset(None)[0]["content"] == "hi"



def test_a_world_file_named_like_a_module_does_not_replace_it(tmp_path):
    """A world saved as calendar.py is loaded under a module name of its own: Python's calendar stays itself (before,
    `--env calendar.py:Calendar` put the user's file in its place in sys.modules)."""
    import calendar
    import sys
    (tmp_path / "calendar.py").write_text(
        "from dataclasses import dataclass\nfrom worlds import common\n\n@dataclass\nclass Slot:\n    day: str\n\n"
        "class Calendar(common.Environment):\n    def reset(self, task):\n        return [{'role': 'user', "
        "'content': Slot('mon').day}]\n    def step(self, reply):\n        return common.StepResult([], True)\n"
        "    def reward(self):\n        return 0.0\n")
    cls = common.environment_class(f"{tmp_path / 'calendar.py'}:Calendar")
    assert cls().reset(None)[0]["content"] == "mon"                       # its dataclass resolves its annotations
    assert sys.modules["calendar"] is calendar and hasattr(sys.modules["calendar"], "monthrange")
    assert sys.modules[cls.__module__].__file__ == str(tmp_path / "calendar.py")


@pytest.mark.parametrize("value, close", [("tool", "tools"), ("envscalar", "envscaler"), ("bfc", "bfcl")])
def test_a_misspelt_env_names_the_closest_world(value, close, capsys):
    with pytest.raises(SystemExit) as exit_:
        train.main(["--env", value])
    assert exit_.value.code == 2
    assert f"did you mean {close!r}?" in capsys.readouterr().err

# ----------------------------------------------------------------------------------------------------------------
# pantry.py: multi-turn, with tools
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pantry(tmp_path_factory):
    spec = write_example(tmp_path_factory.mktemp("pantry"), "pantry.py")
    return spec, common.environment_class(spec)


def play(cls, task, replies) -> tuple:
    """An episode of `replies` (stopping where the world says done) -> (environment, observations per step)."""
    env, seen = cls(), []
    env.reset(task)
    for reply in replies:
        result = env.step(reply)
        seen.append(result.observations)
        if result.done:
            break
    return env, seen


def test_pantry_tools_turns_and_its_kitchens_rules(pantry):
    _, cls = pantry
    tr, _ = splits(cls, n_train=30, n_test=5)
    check = lambda t: common.format_call("check_stock", {"item": t.schema})                   # noqa: E731
    order = lambda t, q=None: common.format_call("order", {"item": t.schema, "qty": q or t.qty})  # noqa: E731
    north = next(t for t in tr if t.variant == "north")
    south = next(t for t in tr if t.variant == "south")
    assert [tool["function"]["name"] for tool in cls.tools] == ["check_stock", "order"]
    env, seen = play(cls, north, [check(north), order(north), "Done."])                   # the north rule kept
    assert env.reward() == 1.0 and seen[0][0].endswith("in stock") and seen[2] == []
    env, seen = play(cls, north, [order(north), check(north) + order(north), "Done."])    # broken, then kept
    assert seen[0] == ["Error: check the stock first"] and env.reward() == 0.5
    env, seen = play(cls, south, [check(south), order(south), "Done."])                   # the north rule, in south
    assert seen[0][0].startswith("Error") and env.reward() == 0.5
    env, _ = play(cls, south, [order(south), "Done."])
    assert env.reward() == 1.0
    env, _ = play(cls, south, [order(south, south.qty % 9 + 1), "Done."])                  # the wrong quantity
    assert env.reward() == 0.0
    for bad in ("<tool_call>{not json", "<tool_call>\n{\"name\": \"order\", \"arguments\": 3}\n</tool_call>",
                common.format_call("order", {"item": "eggs", "qty": "two"}), common.format_call("steal", {})):
        env, seen = play(cls, north, [bad])                                             # never raises
        assert seen[0] and all(o.startswith("Error") for o in seen[0]) and env.reward() == 0.0
        json.dumps([list(t) for t in env.trace])
    env = cls.for_run(train.parse_args(["--max-env-steps", "2"]), toy=False)
    env.reset(north)
    assert not env.step(check(north)).done and env.step(check(north)).done           # the step cap of the flag


def test_the_docs_scripted_check_prints_what_the_doc_shows(tmp_path):
    """check_pantry.py, as printed, run from a folder holding it, pantry.py and the assets: its output is the doc's."""
    for name in ("pantry.py", "check_pantry.py"):
        (tmp_path / name).write_text(example(name)[0] if name == "pantry.py" else next(
            b for b in re.findall(r"^```python\n(.*?)^```", open(DOC, encoding="utf-8").read(), flags=re.S | re.M)
            if b.startswith('"""check_pantry.py:')))
    (tmp_path / "assets").symlink_to(os.path.join(ROOT, "assets"))
    res = subprocess.run([sys.executable, "check_pantry.py"], cwd=tmp_path, capture_output=True, text=True,
                         env={**ENV, "PYTHONPATH": ROOT}, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    shown = open(DOC, encoding="utf-8").read().split("It prints")[1].split("```\n")[1]   # the block after it
    assert res.stdout == shown


def test_the_docs_smoke_command_runs_pantry_for_two_steps(pantry, tmp_path):
    """The doc's CPU smoke command, as printed, with the example's path and a fresh --out."""
    spec, _ = pantry
    text = open(DOC, encoding="utf-8").read()
    line = next(x for x in text.splitlines() if x.startswith("python train.py --env pantry.py:Pantry --model "))
    argv = line.split()[2:]
    argv[argv.index("--env") + 1] = spec
    argv[argv.index("--out") + 1] = str(tmp_path / "run")
    res = subprocess.run([sys.executable, "train.py", *argv], cwd=ROOT, env=ENV, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["stage"] == "lopd"] == [0, 1]
    assert "| LOPD student |" in (tmp_path / "run" / "results.md").read_text()
