"""EnvScaler as released (worlds/envscaler.py): a small dataset in the published format, written here, run by the
official episode rules with each environment's code in a sandboxed worker.

Two environments: a library (tools that read, change and raise; checklists that read the final and the initial
state, one check that returns a non-boolean) and a hostile one (a tool that reads outside its directory, one that
never returns, class code that loops when it is defined). The rewards are compared with the checklist computed here
by hand; the hostile episodes must cost only themselves.

The release as published: a small one (one environment, 230 scenarios) under each copy's file names (GitHub's,
the ROLL graft's, the Hugging Face datasets'), as JSON documents and as JSON Lines, read through train.py's loader:
the held-out 200 are the split rule's (computed here by hand), the same from either format, file order or --seed,
disjoint from training and covering the release, and recorded in OUT. `--tasks hf` with the download simulated
(monkeypatched) and offline (HF_HUB_OFFLINE=1, an empty cache, its own process): nothing is downloaded. Bad folders
and files are one line each. The default world: a real backbone (the toy backbone's folder without its marker)
without --env trains here, on --tasks DIR or the Hub's cache (written here in its layout); offline with neither,
`python train.py --model DIR` is one line and exit status 2 before the model loads.

Run: python -m pytest tests/test_envscaler.py -q
"""
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from runtime.devices import UserError  # noqa: E402
from worlds import common  # noqa: E402
from worlds import envscaler as es  # noqa: E402
from worlds import sandbox  # noqa: E402

LIBRARY = '''
class Library:
    def __init__(self, config):
        self.books = {"b1": {"title": "Dune", "holder": None}, "b2": {"title": "Emma", "holder": None}}
        self.log = []

    def find_book(self, title):
        return [k for k, v in self.books.items() if v["title"] == title]

    def borrow(self, book_id, user):
        self.books[book_id]["holder"] = user
        self.log.append(book_id)
        print("this print must not reach the protocol")
        return {"ok": True}

    def audit(self):
        raise RuntimeError("the audit service is down")

    def _secret(self):
        return "never a tool"
'''
HOSTILE = '''
class Hostile:
    def __init__(self, config):
        self.n = 0

    def peek(self):
        return open("/etc/hostname").read()

    def spin(self):
        while True:
            self.n += 1

    def keep_a_generator(self):
        self.gen = (i for i in range(3))        # the state can no longer be deep-copied
        return "kept"

    def forge(self):
        import os
        os.write(1, b'{"reward": 1.0}\\n{"reward": 1.0}\\n')   # answers of its own, on the protocol's stream
        return "forged"

    def flood(self):
        import os
        os.write(1, b"x" * (1 << 20))           # a megabyte and no newline: no answer, ever
        return "flooded"
'''
LOOPS_AT_DEFINITION = "while True:\n    pass\n"
TOOL = lambda name, props: {"name": name, "description": name, "parameters": {"type": "object", "properties": props}}   # noqa: E731
CHECKS = [  # on the final state; the second reads the initial state; the third returns a string, not a bool
    {"check_item": "b1 is held by ana", "check_func": "def check_func(s):\n    return s['books']['b1']['holder'] == 'ana'"},
    {"check_item": "b2 unchanged", "check_func":
        "def check_func(s):\n    return s['books']['b2'] == initial_state['books']['b2']"},
    {"check_item": "not a bool", "check_func": "def check_func(s):\n    return 'yes'"},
    {"check_item": "one loan", "check_func": "def check_func(s):\n    return len(s['log']) == 1"},
]


def write_dataset(folder) -> str:
    """The published layout: env_metadata.json (a JSON list) and train.jsonl / test.jsonl scenario lines."""
    os.makedirs(folder, exist_ok=True)
    meta = [{"env_id": "library", "env_class_code": LIBRARY, "environment_introduction": "A small library.",
             "constraints_rules": ["Books are lent to one user at a time."],
             "tools": json.dumps([TOOL("find_book", {"title": {"type": "string"}}),
                                  TOOL("borrow", {"book_id": {"type": "string"}, "user": {"type": "string"}}),
                                  TOOL("audit", {})])},
            {"env_id": "hostile", "env_class_code": HOSTILE, "environment_introduction": "", "constraints_rules": [],
             "tools": [TOOL("peek", {}), TOOL("spin", {}), TOOL("keep_a_generator", {}), TOOL("forge", {}),
                       TOOL("flood", {})]},
            {"env_id": "looping", "env_class_code": LOOPS_AT_DEFINITION, "environment_introduction": "",
             "constraints_rules": [], "tools": []}]
    with open(os.path.join(folder, "env_metadata.json"), "w") as f:
        json.dump(meta, f)
    lend = {"env_id": "library", "env_class_name": "Library", "init_config": "{}", "checklist_with_func": CHECKS}
    rows = {"train": [{"task_id": "lend-1", "task": "Lend Dune to ana.", **lend},
                      {"task_id": "lend-2", "task": "Lend Dune to ana, please.", **lend}],
            "test": [{"task_id": "peek", "task": "Look around.", "env_id": "hostile", "env_class_name": "Hostile",
                      "init_config": {}, "checklist_with_func": CHECKS[:1]},
                     {"task_id": "loop", "task": "Wait.", "env_id": "looping", "env_class_name": "Looping",
                      "init_config": {}, "checklist_with_func": CHECKS[:1]}]}
    for name, recs in rows.items():
        with open(os.path.join(folder, name + ".jsonl"), "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in recs))
    return str(folder)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    folder = write_dataset(tmp_path_factory.mktemp("envscaler"))
    train, test = (es.load_scenarios(os.path.join(folder, n + ".jsonl")) for n in ("train", "test"))
    return {t.task_id: t for t in train + test}


def world(**kw):
    return es.EnvScalerWorld(limits=sandbox.SandboxLimits(wall_s=2.0, cpu_s=10, memory_mb=512, output_kb=256), **kw)


def call(name, **args):
    return common.format_call(name, args)


def by_hand(final: dict, initial: dict) -> float:
    """The checklist's reward computed here: each check_func run on the state, True counts, rounded to 4 places."""
    passed = 0
    for c in CHECKS:
        scope = {"initial_state": initial}
        exec(c["check_func"], scope)
        passed += scope["check_func"](final) is True
    return round(passed / len(CHECKS), 4)


def test_the_official_prompt_and_the_checklist_reward(tasks):
    env = world()
    messages = env.reset(tasks["lend-1"])
    assert messages[0]["content"].startswith(es.SYSTEM_PROMPT) and "Books are lent to one user" in messages[0]["content"]
    assert messages[1] == {"role": "user", "content": "Lend Dune to ana."}
    assert [t["function"]["name"] for t in env.tools] == ["find_book", "borrow", "audit"]
    assert env.step(call("find_book", title="Dune")).observations == ["['b1']"]
    r = env.step(call("borrow", book_id="b1", user="ana") + call("borrow", book_id="b2", user="bo"))
    assert r.observations == ["{'ok': True}"] and r.n_calls == 2          # the first call only (deviation 2)
    r = env.step(call("_secret"))
    assert r.observations == ["Error: '_secret' is not a valid tool of this environment."] and not r.done
    assert env.step("<tool_call>\n{oops}\n</tool_call>").errors == 1      # malformed: an observation
    assert env.step("Task Completed").done
    initial = {"books": {"b1": {"title": "Dune", "holder": None}, "b2": {"title": "Emma", "holder": None}}, "log": []}
    final = {"books": {"b1": {"title": "Dune", "holder": "ana"}, "b2": {"title": "Emma", "holder": None}}, "log": ["b1"]}
    assert env.reward() == by_hand(final, initial) == 0.75
    # the same task again from a fresh instance: nothing carries over
    env.reset(tasks["lend-1"])
    assert env.step("Task Completed").done and env.reward() == by_hand(initial, initial) == 0.25


def test_a_raising_tool_ends_the_episode_with_reward_0(tasks):
    env = world()
    env.reset(tasks["lend-2"])
    env.step(call("borrow", book_id="b1", user="ana"))
    r = env.step(call("audit"))
    assert r.done and r.observations[0].startswith("Error: <Exception>") and "audit service is down" in r.observations[0]
    assert env.reward() == 0.0


def test_the_step_cap_ends_the_episode_unscored(tasks):
    env = world(max_steps=2)
    env.reset(tasks["lend-1"])
    assert not env.step(call("borrow", book_id="b1", user="ana")).done
    assert env.step(call("find_book", title="Dune")).done and env.reward() == 0.0


def checked_by(task, checks):
    """The task with another checklist (check_func sources), the rest of its scenario as it is."""
    items = [{"check_item": f"check {i}", "check_func": f} for i, f in enumerate(checks)]
    return dataclasses.replace(task, scenario={**task.scenario, "checklist_with_func": items})


def test_only_a_check_that_returns_exactly_true_counts(tasks):
    """A check counts only if it returns True itself: 1, "yes" and [0] are truthy but count 0, so 1 of 4 checks gives
    0.25 (the official check runner's `result is True`, envscaler.py's module docstring)."""
    task = checked_by(tasks["lend-1"], ["def check_func(s):\n    return True", "def check_func(s):\n    return 1",
                                        "def check_func(s):\n    return 'yes'", "def check_func(s):\n    return [0]"])
    env = world()
    env.reset(task)
    assert env.step("Task Completed").done and env.reward() == 0.25


def test_the_checklist_reward_is_rounded_to_4_places(tasks):
    """1 of 3 checks passing scores round(1/3, 4) = 0.3333 and 2 of 3 score 0.6667, not 0.333333... (the official
    reward, envscaler.py's module docstring); an empty checklist scores 0."""
    env = world()
    for ana, want in ((False, 0.3333), (True, 0.6667)):
        env.reset(checked_by(tasks["lend-1"], [CHECKS[0]["check_func"], CHECKS[1]["check_func"],
                                               CHECKS[2]["check_func"]]))    # b1 held by ana, b2 as it was, "yes"
        if ana:
            env.step(call("borrow", book_id="b1", user="ana"))
        assert env.step("Task Completed").done and env.reward() == want
    env.reset(checked_by(tasks["lend-1"], []))
    assert env.step("Task Completed").done and env.reward() == 0.0


def test_steps_that_run_nothing_count_towards_the_step_cap(tasks):
    """The cap counts every step, an invalid tool and a malformed call included: at max_steps = 2 either as the second
    step ends the episode unscored, reward 0, where its checklist would give 0.75 (envscaler.py: the official episode
    ends unscored at --max-env-steps); a completion before the cap is scored."""
    for second in (call("_secret"), "<tool_call>\n{oops}\n</tool_call>"):     # an invalid tool; a malformed call
        env = world(max_steps=2)
        env.reset(tasks["lend-1"])
        assert not env.step(call("borrow", book_id="b1", user="ana")).done
        r = env.step(second)
        assert r.done and r.errors == 1 and env.reward() == 0.0
    env = world(max_steps=3)
    env.reset(tasks["lend-1"])
    assert not env.step(call("borrow", book_id="b1", user="ana")).done
    assert env.step("Task Completed").done and env.reward() == 0.75         # scored before the cap: 3 of 4 checks


def test_hostile_code_costs_its_episode_not_the_run(tasks):
    env = world()
    env.reset(tasks["peek"])
    r = env.step(call("peek"))               # reading outside: not there (the sandbox's mount namespace) or refused
    assert r.done and "/etc/hostname" in r.observations[0]
    assert "FileNotFoundError" in r.observations[0] or "PermissionError" in r.observations[0]
    assert env.reward() == 0.0
    env.reset(tasks["peek"])
    t0 = time.time()
    r = env.step(call("spin"))                                   # never returns: killed at the wall-clock limit
    assert r.done and r.observations == [es.GONE] and time.time() - t0 < 10
    pid = env.worker.proc and env.worker.proc.pid
    assert env.reward() == 0.0 and pid is None                   # the worker is gone
    env.reset(tasks["loop"])                                     # class code that loops at its definition
    r = env.step(call("anything"))
    assert r.done and r.observations == [es.GONE] and env.reward() == 0.0
    env.reset(tasks["lend-1"])                                   # and the next episode runs normally
    env.step(call("borrow", book_id="b1", user="ana"))
    assert env.step("Task Completed").done and env.reward() == 0.75


def test_a_prompt_needs_no_worker(tasks, monkeypatch):
    monkeypatch.setattr(sandbox, "Worker", lambda *a: pytest.fail("a worker was started to render a prompt"))
    env = world()
    env.reset(tasks["lend-1"])
    assert env.tools and env.reward() == 0.0


# ----------------------------------------------------------------------------------------------------------------
# The release as published: its file names and formats, the held-out split, --tasks hf
# ----------------------------------------------------------------------------------------------------------------
N_RELEASE = 230                  # more than the 200 held out, as the release's 2,550 are
RELEASE_NAMES = {"github": ("191_env_metadata.json", "rl_scenario_metadata.json"),
                 "roll": ("191_env_metadata.json", "envscaler_rl_scenario_metadata.json"),
                 "hf": ("191_env_metadata_processed.json", "envscaler_rl_scenario_metadata.json")}


def release_records(n=N_RELEASE):
    """The library environment as the release stores it (tools and init_config as JSON strings), and n scenarios."""
    meta = {"env_id": "env_1_rl", "env_class_code": LIBRARY, "environment_introduction": "A small library.",
            "constraints_rules": ["Books are lent to one user at a time."], "env_class_name": "Library",
            "tools": json.dumps([TOOL("find_book", {"title": {"type": "string"}}), TOOL("audit", {})])}
    scenarios = [{"env_id": "env_1_rl", "env_class_name": "Library", "task_id": f"env_1_rl-task_{i}",
                  "init_config": "{}", "task": f"Lend book {i}.", "checklist_with_func": CHECKS[:1]}
                 for i in range(1, n + 1)]
    return meta, scenarios


def write_release(folder, copy="github", fmt="json", n=N_RELEASE, order=1) -> str:
    """The release's two files under `copy`'s names. fmt json: one document (the env-meta file an object keyed by
    env_id, as the GitHub copy has it; the scenarios a list); jsonl: one record a line. order -1: scenarios reversed."""
    os.makedirs(folder, exist_ok=True)
    meta, scenarios = release_records(n)
    meta_name, scenario_name = RELEASE_NAMES[copy]
    with open(os.path.join(folder, meta_name), "w") as f:
        f.write(json.dumps({meta["env_id"]: meta}, indent=1) if fmt == "json" else json.dumps(meta) + "\n")
    with open(os.path.join(folder, scenario_name), "w") as f:
        rows = scenarios[::order]
        f.write(json.dumps(rows, indent=1) if fmt == "json" else "".join(json.dumps(r) + "\n" for r in rows))
    return str(folder)


def read(folder, out, record=True, seed=0):
    """The run's loader (train.load_splits calls the world's read_splits with --tasks and --out)."""
    args = types.SimpleNamespace(tasks=str(folder), out=str(out), seed=seed)
    return es.EnvScalerWorld.read_splits(args, record)


def ids(tasks):
    return [t.task_id for t in tasks]


def split_by_hand(all_ids, test_size=200, seed=0):
    """The split rule computed here: the test_size ids of smallest sha256(f"{seed}:{id}")."""
    return set(sorted(all_ids, key=lambda i: hashlib.sha256(f"{seed}:{i}".encode()).hexdigest())[:test_size])


@pytest.mark.parametrize("copy, fmt", [("github", "json"), ("roll", "jsonl"), ("hf", "json"), ("github", "jsonl")])
def test_the_release_is_read_under_its_own_names_and_split(tmp_path, copy, fmt):
    folder = write_release(tmp_path / "release", copy, fmt)
    train, test = read(folder, tmp_path / "run")
    every = {f"env_1_rl-task_{i}" for i in range(1, N_RELEASE + 1)}
    assert len(test) == 200 and len(train) == N_RELEASE - 200
    assert set(ids(train)) | set(ids(test)) == every and not set(ids(train)) & set(ids(test))
    assert set(ids(test)) == split_by_hand(every)
    task = test[0]                                   # joined to its environment, the JSON strings decoded
    assert task.variant == "env_1_rl" and task.scenario["init_config"] == {}
    assert [t["function"]["name"] for t in task.env["tools"]] == ["find_book", "audit"]
    assert task.text == f"Lend book {task.task_id.rsplit('_', 1)[1]}."
    with open(tmp_path / "run" / es.SPLIT_RECORD) as f:
        record = json.load(f)
    assert record["train"] == ids(train) and record["test"] == ids(test) and record["seed"] == es.SPLIT_SEED
    assert set(record["sha256"]) == set(RELEASE_NAMES[copy])


def test_train_py_takes_the_release_folder(tmp_path):
    """train.py's own path: the folder passes parse_args (no train.jsonl asked for) and load_splits splits it."""
    import train
    folder = write_release(tmp_path / "release", "roll", "jsonl")
    args = train.parse_args(["--env", "envscaler", "--tasks", folder, "--out", str(tmp_path / "run")])
    tr, te = train.load_splits(args)
    assert len(te) == 200 and ids(te) == json.loads((tmp_path / "run" / es.SPLIT_RECORD).read_text())["test"]
    os.makedirs(tmp_path / "empty")
    with pytest.raises(UserError, match="holds none of its files"):              # refused before any model loads
        train.parse_args(["--env", "envscaler", "--tasks", str(tmp_path / "empty"), "--out", str(tmp_path / "r")])


def test_the_same_release_gives_the_same_split(tmp_path):
    """Whatever the format, the order of the file and --seed: the split reads the task ids alone."""
    a = read(write_release(tmp_path / "a", "github", "json"), tmp_path / "run-a", seed=0)
    b = read(write_release(tmp_path / "b", "roll", "jsonl", order=-1), tmp_path / "run-b", seed=7)
    assert [ids(a[0]), ids(a[1])] == [ids(b[0]), ids(b[1])]
    assert (tmp_path / "run-a" / es.SPLIT_RECORD).read_text().count("env_1_rl-task_") == N_RELEASE
    train, test = es.split_ids(ids(a[0] + a[1]), "here", seed=1)     # another split seed, another split
    assert set(test) != set(ids(a[1])) and set(test) == split_by_hand(ids(a[0] + a[1]), seed=1)


def test_a_run_read_back_must_find_its_split(tmp_path):
    folder = write_release(tmp_path / "release")
    read(folder, tmp_path / "unrecorded", record=False)
    assert not (tmp_path / "unrecorded" / es.SPLIT_RECORD).exists()      # a run read back writes nothing
    train, test = read(folder, tmp_path / "run")
    assert ids(read(folder, tmp_path / "run", record=False)[1]) == ids(test)
    write_release(folder, n=N_RELEASE + 5)                                # the release changed under the run
    with pytest.raises(UserError, match="gives another split than .*envscaler_split.json") as err:
        read(folder, tmp_path / "run")
    assert "\n" not in str(err.value)


def test_a_split_of_ones_own_comes_first(tmp_path):
    """The three-file layout: train.jsonl and test.jsonl beside env_metadata.json, even with a release file there."""
    folder = write_dataset(tmp_path / "data")
    with open(os.path.join(folder, "rl_scenario_metadata.json"), "w") as f:
        json.dump(release_records()[1], f)
    train, test = read(folder, tmp_path / "run")
    assert ids(train) == ["lend-1", "lend-2"] and ids(test) == ["peek", "loop"]
    with open(tmp_path / "run" / es.SPLIT_RECORD) as f:
        assert json.load(f)["rule"].startswith("given")
    with open(os.path.join(folder, "test.jsonl"), "w") as f:             # one record on its one line
        f.write(json.dumps({"task_id": "lend-1", "task": "again", "env_id": "library", "env_class_name": "Library"}))
    with pytest.raises(UserError, match="share 1 task ids .*'lend-1'.*disjoint"):
        read(folder, tmp_path / "run2")


def test_tasks_hf_fetches_the_two_datasets(tmp_path, monkeypatch):
    """Online, simulated: snapshot_download of each dataset gives a folder; the two are read as one release."""
    import huggingface_hub
    meta, scenarios = release_records()
    folders = {}
    for repo, (name, rows) in zip(es.HF_DATASETS, [("191_env_metadata_processed.json", [meta]),
                                                    ("envscaler_rl_scenario_metadata.json", scenarios)]):
        folders[repo] = str(tmp_path / repo.replace("/", "--"))
        os.makedirs(folders[repo])
        with open(os.path.join(folders[repo], name), "w") as f:
            json.dump(rows, f)
    calls = []

    def snapshot_download(repo_id, repo_type=None, **kw):
        calls.append((repo_id, repo_type))
        return folders[repo_id]
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    import train as train_py
    args = train_py.parse_args(["--env", "envscaler", "--tasks", "hf", "--out", str(tmp_path / "run")])
    assert args.tasks == "hf"                        # the Hub: not made a folder's absolute path like a DIR
    train, test = read(args.tasks, args.out)
    assert calls == [(r, "dataset") for r in es.HF_DATASETS]
    assert set(ids(test)) == split_by_hand(ids(train + test)) and len(train) == N_RELEASE - 200


def test_tasks_hf_offline_is_one_line(tmp_path):
    """Offline (HF_HUB_OFFLINE=1, an empty cache), in a process of its own: one line naming what to download."""
    code = ("from runtime.devices import UserError\nfrom worlds import envscaler\n"
            "try:\n    envscaler.find_release('hf')\nexcept UserError as err:\n    print('UserError:', err)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hf")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("UserError: --tasks hf ("), out.stdout + out.stderr
    assert "cannot fetch" in lines[0] and all(repo in lines[0] for repo in es.HF_DATASETS)
    assert "--repo-type dataset" in lines[0] and "give --tasks DIR" in lines[0] and "--env tools" in lines[0]


# ----------------------------------------------------------------------------------------------------------------
# The default world (preflight.default_world): a real backbone without --env trains on EnvScaler, B.2-B.3
# ----------------------------------------------------------------------------------------------------------------
def real_model(tmp_path) -> str:
    """The shipped toy backbone without its toy_backbone.json: a real model to train.py, and a small one."""
    from worlds import toy_backbone as toy
    folder = tmp_path / "model"
    shutil.copytree(toy.SHIPPED, folder)
    os.remove(folder / "toy_backbone.json")
    return str(folder)


def test_a_real_backbone_without_env_trains_on_envscaler(tmp_path):
    """--tasks DIR alone names the release: a real model's world is EnvScaler, so its data is what --tasks points
    at; without --tasks, the Hub's (hf). The toy backbone keeps the toy world, and --env tools takes a real model
    there."""
    import train
    from worlds import toy_backbone as toy
    model, folder, out = real_model(tmp_path), write_release(tmp_path / "release", "hf"), str(tmp_path / "run")
    args = train.parse_args(["--model", model, "--tasks", folder, "--out", out])
    assert (args.env, args.tasks) == ("envscaler", folder)
    tr, te = train.load_splits(args)
    assert len(te) == 200 and set(ids(te)) == split_by_hand(ids(tr + te)) and len(tr) == N_RELEASE - 200
    hub = train.parse_args(["--model", model, "--out", out])            # nothing fetched until the tasks are read
    assert (hub.env, hub.tasks, hub.max_len) == ("envscaler", "hf", 40960)
    toy_world = [train.parse_args(argv + ["--out", out]) for argv in ([], ["--model", toy.SHIPPED],
                                                                       ["--model", model, "--env", "tools"])]
    assert [(a.env, a.tasks) for a in toy_world] == [("tools", "")] * 3


def write_hub_cache(root) -> str:
    """The two datasets as huggingface_hub's cache holds them (datasets--OWNER--NAME/refs/main naming a snapshot
    folder), under the Hugging Face copy's file names."""
    meta, scenarios = release_records()
    for repo, (name, rows) in zip(es.HF_DATASETS, [("191_env_metadata_processed.json", [meta]),
                                                    ("envscaler_rl_scenario_metadata.json", scenarios)]):
        folder, revision = root / ("datasets--" + repo.replace("/", "--")), "0" * 40
        os.makedirs(folder / "refs")
        (folder / "refs" / "main").write_text(revision)
        os.makedirs(folder / "snapshots" / revision)
        (folder / "snapshots" / revision / name).write_text(json.dumps(rows))
    return str(root)


def offline(tmp_path, cache) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_CACHE": cache}


def test_the_default_release_comes_from_the_hub_cache(tmp_path):
    """Offline, its own process: `python train.py --model DIR` with the datasets in huggingface_hub's cache reads
    them (`hub_snapshots`, as after a download) and splits them by B.3's rule."""
    model, cache = real_model(tmp_path), write_hub_cache(tmp_path / "cache")
    code = (f"import train\nargs = train.parse_args(['--model', {model!r}, '--out', {str(tmp_path / 'run')!r}])\n"
            "tr, te = train.load_splits(args)\nprint(args.env, args.tasks, len(tr), len(te))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=offline(tmp_path, cache), capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.split() == ["envscaler", "hf", str(N_RELEASE - 200), "200"], out.stderr[-2000:]


def test_no_release_offline_is_one_line_before_the_model_loads(tmp_path):
    """`python train.py --model DIR`, offline with an empty cache: exit status 2 and one line saying what to
    download or to give --env tools, before the model loads (no memory plan said, no args.json written)."""
    model, run = real_model(tmp_path), tmp_path / "run"
    res = subprocess.run([sys.executable, "train.py", "--model", model, "--out", str(run)], cwd=ROOT,
                         env=offline(tmp_path, str(tmp_path / "empty-cache")), capture_output=True, text=True,
                         timeout=120)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert lines[0].startswith("error: --tasks hf (EnvScaler's data, the default world of a real --model)")
    assert f"hf download {es.HF_DATASETS[0]} --repo-type dataset --local-dir DIR" in lines[0]
    assert "give --tasks DIR" in lines[0] and "--env tools for the toy world" in lines[0]
    assert "memory plan" not in res.stdout and not (run / "args.json").exists()


def one_line(call, match):
    with pytest.raises(UserError, match=match) as err:
        call()
    assert "\n" not in str(err.value)
    return str(err.value)


def test_bad_folders_and_files_are_one_line_errors(tmp_path):
    empty = tmp_path / "empty"
    os.makedirs(empty)
    msg = one_line(lambda: read(empty, tmp_path / "run"), "holds none of its files")
    assert str(empty) in msg and "191_env_metadata.json and rl_scenario_metadata.json" in msg and "or hf" in msg
    one_line(lambda: read(tmp_path / "nowhere", tmp_path / "run"), "no such folder")
    folder = write_release(tmp_path / "release")
    os.remove(os.path.join(folder, "rl_scenario_metadata.json"))
    one_line(lambda: read(folder, tmp_path / "run"), "holds only 191_env_metadata.json")

    folder = write_release(tmp_path / "cut")                             # a download cut short
    path = os.path.join(folder, "rl_scenario_metadata.json")
    text = open(path).read()
    open(path, "w").write(text[:len(text) // 2])
    one_line(lambda: read(folder, tmp_path / "run"), r"rl_scenario_metadata.json:\d+: not JSON .*download it again")
    path = os.path.join(folder, "191_env_metadata.json")                # the env-meta object, cut short too
    text = open(path).read()
    open(path, "w").write(text[:len(text) // 2])
    one_line(lambda: read(folder, tmp_path / "run"), r"191_env_metadata.json:\d+: not JSON .*download it again")
    folder = write_release(tmp_path / "lines", fmt="jsonl")              # a JSON Lines file with a broken line
    path = os.path.join(folder, "rl_scenario_metadata.json")
    rows = open(path).read().splitlines()
    open(path, "w").write("\n".join(rows[:3] + ["{oops"] + rows[3:]))
    one_line(lambda: read(folder, tmp_path / "run"), r"rl_scenario_metadata.json:4: not JSON")
    open(path, "w").write(json.dumps([1, 2]))                            # JSON, but not records
    one_line(lambda: read(folder, tmp_path / "run"), "rl_scenario_metadata.json: expected records")
    meta, scenarios = release_records()
    del scenarios[5]["env_class_name"]
    open(path, "w").write(json.dumps(scenarios))
    one_line(lambda: read(folder, tmp_path / "run"), r"record 6 \(env_1_rl-task_6\) lacks env_class_name")
    scenarios[5]["env_class_name"], scenarios[7]["task_id"] = "Library", "env_1_rl-task_1"
    open(path, "w").write(json.dumps(scenarios))
    one_line(lambda: read(folder, tmp_path / "run"), "task_id 'env_1_rl-task_1' appears twice")
    scenarios[7]["task_id"], scenarios[2]["init_config"] = "env_1_rl-task_8", "{not json"
    open(path, "w").write(json.dumps(scenarios))
    one_line(lambda: read(folder, tmp_path / "run"), r"scenario 3 \(env_1_rl-task_3\): init_config is a string but")
    write_release(folder, n=150)
    one_line(lambda: read(folder, tmp_path / "run"), "150 scenarios, too few to hold out 200")

    folder = write_dataset(tmp_path / "data")                            # the three-file layout
    with open(os.path.join(folder, "test.jsonl"), "a") as f:
        f.write(json.dumps({"task_id": "x", "task": "t", "env_id": "nowhere", "env_class_name": "X"}) + "\n")
    one_line(lambda: es.load_scenarios(os.path.join(folder, "test.jsonl")),
             "names env_id 'nowhere', which the env-meta file lacks")
    os.remove(os.path.join(folder, "env_metadata.json"))
    one_line(lambda: es.load_scenarios(os.path.join(folder, "train.jsonl")), "has no env-meta file")
    assert "give --tasks DIR" in es.EnvScalerWorld.check_args(type("A", (), {"tasks": "", "conventions": 2})())


def test_every_answer_a_worker_can_give_costs_the_episode_not_the_run(tasks):
    """A state that cannot be copied (the checklist's worker raises), an answer of the wrong kind written on the
    protocol's own stream, a flood without a newline, a worker killed under the trainer: each ends its episode with
    an error observation, `step` and `reward` never raise, and the next episode scores as before. (Environment code
    that forges well-formed answers in the right order can still fool its own checklist: worlds/sandbox.py, "the verdict".)"""
    env = world()
    env.reset(tasks["peek"])
    assert env.step(call("keep_a_generator")).observations == ["kept"]
    r = env.step("Task Completed")                               # the worker answers {"ok": False, "status": "raised"}
    assert r.done and r.observations == [es.GONE] and env.reward() == 0.0
    env.reset(tasks["peek"])
    r = env.step(call("forge"))                                  # a reward line where a call's answer belongs
    assert r.done and r.observations == [es.GONE] and env.reward() == 0.0
    env.reset(tasks["peek"])
    t0 = time.time()
    r = env.step(call("flood"))
    assert r.done and r.observations == [es.GONE] and env.reward() == 0.0 and time.time() - t0 < 10
    env.reset(tasks["lend-1"])
    env.step(call("find_book", title="Dune"))
    os.kill(env.worker.proc.pid, 9)                              # the worker dies between two requests
    env.worker.proc.wait()
    r = env.step(call("borrow", book_id="b1", user="ana"))
    assert r.done and r.observations == [es.GONE] and env.reward() == 0.0
    env.reset(tasks["lend-1"])
    env.step(call("borrow", book_id="b1", user="ana"))
    assert env.step("Task Completed").done and env.reward() == 0.75


@pytest.mark.parametrize("answer, ok", [({"status": "ok", "text": "x"}, True), ({"status": "raised", "text": "t"}, True),
                                        ({"ok": False, "status": "raised"}, True), ({"status": "weird"}, False),
                                        ({"status": "ok", "text": 3}, False), (None, False), ([1], False)])
def test_call_answers_are_checked(answer, ok):
    assert (es.call_answer(answer) is not None) == ok


@pytest.mark.parametrize("answer, value", [({"reward": 0.5}, 0.5), ({"reward": 1}, 1.0), ({"reward": 1.5}, None),
                                          ({"reward": float("nan")}, None), ({"reward": True}, None),
                                          ({"ok": False, "status": "raised"}, None), (None, None)])
def test_reward_answers_are_checked(answer, value):
    assert es.reward_answer(answer) == value
