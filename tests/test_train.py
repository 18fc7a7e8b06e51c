"""Smoke, determinism, resume and bad-input tests of the command-line pipeline (train.py, eval.py) in subprocesses.

Run: python -m pytest tests/test_train.py -q      (under a minute on 2 idle CPU cores)
A tiny toy backbone folder is built once (it holds toy_backbone.json, so train.py applies TOY_DEFAULTS to it).
The runs that must be separate processes (two seeded runs, one SIGKILLed and rerun, eval.py) are real
`python train.py ...` commands at tiny size: 30 training tasks, 2 cold-start steps, 3 LOPD steps; independent
ones are started together to use both cores. Bad-input cases call `train.main(argv)` in-process.
"""
import argparse
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from runtime import checkpoints  # noqa: E402
from scripts import experiments  # noqa: E402
import train  # noqa: E402
from worlds import toy_backbone as toy  # noqa: E402

STEPS = 3
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
LOPD_KEYS = {"reward/student", "loss/distill", "privilege/delta", "dual/beta", "loss/anchor"}


def train_cmd(model, out, *extra):
    return [sys.executable, "train.py", "--model", str(model), "--out", str(out), "--n-train", "30", "--n-test", "6",
            "--bank-threshold", "0.0", "--cold-steps", "2", "--steps", str(STEPS), "--rollouts-per-step", "4",
            "--micro-batch", "2", "--latents", "2", "--save-every", "1", "--max-new-tokens", "32", *extra]


def start(cmd, logs):
    """Start cmd with stdout and stderr going to files logs.out / logs.err (pipes that nobody reads while another
    run is polled could fill up and stall the process)."""
    with open(f"{logs}.out", "w") as out, open(f"{logs}.err", "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=out, stderr=err)
    proc.logs = str(logs)
    return proc


def finish(proc, timeout=180, ok=True):
    """Wait for a started process; with ok, fail with its stderr tail unless it exited 0. -> (rc, stdout, stderr)"""
    proc.wait(timeout=timeout)
    out, err = read(f"{proc.logs}.out"), read(f"{proc.logs}.err")
    if ok:
        assert proc.returncode == 0, f"{' '.join(proc.args)}\nexit {proc.returncode}\n{err[-3000:]}"
    return proc.returncode, out, err


def read(path):
    with open(path) as f:
        return f.read()


def records(run, stage=None):
    rows = [json.loads(line) for line in read(os.path.join(run, "metrics.jsonl")).splitlines()]
    return [r for r in rows if stage is None or r["stage"] == stage]


def untimed(rec):
    return {k: v for k, v in rec.items() if k != "seconds"}


def kill_after_first_checkpoint(proc, out, timeout=180, folder="ckpt"):
    """SIGKILL `proc` as soon as OUT/<folder>/LATEST exists (replaced atomically): the joint stage's OUT/ckpt, or
    the cold start's OUT/cold_ckpt. -> checkpoint step."""
    latest = os.path.join(out, folder, "LATEST")
    t0 = time.time()
    while not os.path.exists(latest):
        assert proc.poll() is None, f"run ended before its first checkpoint:\n{read(proc.logs + '.err')[-3000:]}"
        assert time.time() - t0 < timeout, "no checkpoint within the timeout"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    return torch.load(os.path.join(checkpoints.latest_checkpoint(out, folder), "state.pt"), weights_only=False)["step"]


@pytest.fixture(scope="module")
def backbone(toy_backbone_dir):
    return toy_backbone_dir               # conftest's tiny toy backbone, built once per session


@pytest.fixture(scope="module")
def runs(backbone, tmp_path_factory):
    """a, b: two uninterrupted runs with the same seed; c: the same run SIGKILLed after its first checkpoint, then
    the same command again, no flag added (its cached stages, backbone excepted, come from the killed run)."""
    root = tmp_path_factory.mktemp("runs")
    a, b, c = (str(root / name) for name in "abc")
    procs = [start(train_cmd(backbone, out), out + "-log") for out in (a, b, c)]
    killed_at = kill_after_first_checkpoint(procs[2], c)
    finish(procs[0])
    finish(procs[1])
    _, resumed_log, _ = finish(start(train_cmd(backbone, c), c + "-rerun-log"))
    return dict(a=a, b=b, c=c, killed_at=killed_at, resumed_log=resumed_log)


# ------------------------------------------------------------------------------------------------------------
def test_smoke_run_writes_results_and_one_record_per_step(runs):
    a = runs["a"]
    result = json.loads(read(os.path.join(a, "results.json")))
    assert list(result["rows"]) == ["vanilla", "base + composer", "LOPD student"]
    table = read(os.path.join(a, "results.md"))
    for row in ("| vanilla |", "| base + composer |", "| LOPD student |"):
        assert row in table
    lopd = records(a, "lopd")
    assert [r["step"] for r in lopd] == list(range(STEPS))
    for r in lopd:
        assert LOPD_KEYS <= set(r) and r["skipped"] == 0, r
    assert {r["stage"] for r in records(a)} >= {"base_rollouts", "bank", "cold_start", "cold_start_done", "lopd"}


def folder_bytes(folder) -> dict:
    """Every file under `folder` (relative path -> its bytes)."""
    return {os.path.relpath(os.path.join(d, f), folder): open(os.path.join(d, f), "rb").read()
            for d, _, files in os.walk(folder) for f in files}


def test_eval_script_on_a_finished_run(runs, tmp_path):
    """eval.py, started from another directory, leaves every file of the training run byte-identical and writes
    its rows into files of its own, named by what it evaluated."""
    before = folder_bytes(runs["a"])
    cmd = [sys.executable, os.path.join(ROOT, "eval.py"), "--run", runs["a"], "--n-test", "4", "--inspect-latents"]
    with open(tmp_path / "eval.out", "w") as so, open(tmp_path / "eval.err", "w") as se:
        rc = subprocess.run(cmd, cwd=tmp_path, env=ENV, stdout=so, stderr=se, timeout=180).returncode
    out, err = read(tmp_path / "eval.out"), read(tmp_path / "eval.err")
    assert rc == 0, err[-3000:]
    for row in ("vanilla", "base + composer", "LOPD student"):
        assert f"| {row} |" in out
    after = folder_bytes(runs["a"])
    assert {k: v for k, v in after.items() if k in before} == before
    new = sorted(k for k in after if k not in before)                    # its rows, then each row's read-back file
    assert new[:2] == ["eval_4tasks.json", "eval_4tasks.md"] and len(new) == 5
    assert all(k.startswith(checkpoints.ROWS_DIR + os.sep) for k in new[2:])
    assert list(json.loads(after["eval_4tasks.json"])["rows"]) == ["vanilla", "base + composer", "LOPD student"]
    # --inspect-latents: the similarity table (by shop and by task family, for both retrievals), then the teacher's
    # eight most moved tokens
    assert "| references | same variant | other variant | same schema | other schema |" in out, out[-2000:]
    assert len(re.findall(r"^\| (same|other) \|( [+-]\d\.\d{3} \|){4}$", out, re.M)) == 2, out[-2000:]
    assert len(re.findall(r"^ *[+-]\d+\.\d\d nats ", out, re.M)) == 8, out[-2000:]
    # --conventions is the toy code world's; on the tool world it is refused with the flag and the run named
    rc, _, err = finish(start([sys.executable, "eval.py", "--run", runs["a"], "--conventions"], tmp_path / "conv"),
                        ok=False)
    assert rc == 2 and "--conventions" in err and runs["a"] in err


def test_same_seed_gives_identical_metrics(runs):
    a, b = records(runs["a"]), records(runs["b"])
    assert len(a) == len(b) and len(records(runs["a"], "lopd")) == STEPS
    for ra, rb in zip(a, b):
        assert untimed(ra) == untimed(rb)


def reused_lines(log: str, out: str, stages) -> dict:
    """{stage: how many lines of `log` say it was reused from OUT/<its folder or file>}"""
    return {stage: log.splitlines().count(f"{stage}: reusing {os.path.join(out, where)}") for stage, where in stages}


CACHED = (("base rollouts", "base_rollouts.jsonl"), ("bank and retriever", "bank"), ("cold start (φ0)", "composer0"))


def test_sigkill_then_the_same_command_continues_the_uninterrupted_run(runs):
    """The command rerun as it was after a kill in the joint stage says in one line where it continues, and one line
    for each cached stage it reuses, and ends with the uninterrupted run's records."""
    at, c = runs["killed_at"], runs["c"]
    assert 1 <= at < STEPS, "the kill must land after a checkpoint and before the run's end"
    assert (f"joint stage: continuing from {os.path.join(c, 'ckpt', f'step-{at:06d}')} at step {at} of {STEPS} "
            "(--no-resume starts over)") in runs["resumed_log"].splitlines()
    assert reused_lines(runs["resumed_log"], c, CACHED) == dict.fromkeys(dict(CACHED), 1)
    # steps after the checkpoint may have been logged twice (before the kill, and again after resuming): the
    # resumed run's record, the last one, is the one that counts
    last = {r["step"]: untimed(r) for r in records(runs["c"], "lopd")}
    want = {r["step"]: untimed(r) for r in records(runs["a"], "lopd")}
    assert last == want
    # the resumed process reused the cached stages (base rollouts, bank, composer φ0) instead of redoing them
    stages = [r["stage"] for r in records(runs["c"])]
    assert stages.count("base_rollouts") == stages.count("bank") == stages.count("cold_start_done") == 1


def test_sigkill_then_resume_ends_with_the_same_weights_optimizers_and_beta(runs):
    """Not only the logged metrics: the resumed run's final checkpoint holds the uninterrupted run's student and
    composer weights, both AdamW states (moments and step counts), β and RNG streams, bit for bit. The kill lands
    after step 1 or 2, so the resumed steps read optimizer moments that only the checkpoint carries."""
    from safetensors.torch import load_file

    def tensors(run):
        ckpt, out = checkpoints.latest_checkpoint(run), {}
        for root, _, files in os.walk(ckpt):
            for f in files:
                if f.endswith(".safetensors"):
                    out.update({f"{os.path.relpath(root, ckpt)}/{f}:{k}": v
                                for k, v in load_file(os.path.join(root, f)).items()})
        return out, torch.load(os.path.join(ckpt, "state.pt"), weights_only=False)

    (wa, sa), (wc, sc) = tensors(runs["a"]), tensors(runs["c"])
    assert sa["step"] == sc["step"] == STEPS and sa["state"] == sc["state"] and sa["generations"] == sc["generations"]
    assert wa.keys() == wc.keys() and any(k.startswith("composer") for k in wa)
    assert all(torch.equal(wa[k], wc[k]) for k in wa), [k for k in wa if not torch.equal(wa[k], wc[k])]
    for opt in ("opt_s", "opt_c"):
        a, c = sa[opt]["state"], sc[opt]["state"]
        assert a.keys() == c.keys() and a
        assert all(torch.equal(a[i][k], c[i][k]) for i in a for k in a[i]), opt
    assert torch.equal(sa["rng"]["torch"], sc["rng"]["torch"]) and sa["rng"]["tasks"] == sc["rng"]["tasks"]


COLD_STEPS = 30


@pytest.fixture(scope="module")
def cold_runs(backbone, tmp_path_factory):
    """d: a run of COLD_STEPS cold-start steps, a checkpoint every 2, then no joint stage (--steps 0); e: the same
    run SIGKILLed in its cold start after its first checkpoint, then the same command again, no flag added."""
    root = tmp_path_factory.mktemp("cold")
    d, e = str(root / "d"), str(root / "e")
    flags = ("--cold-steps", str(COLD_STEPS), "--cold-save-every", "2", "--steps", "0", "--n-test", "2")
    procs = [start(train_cmd(backbone, out, *flags), out + "-log") for out in (d, e)]
    killed_at = kill_after_first_checkpoint(procs[1], e, folder=checkpoints.COLD_CKPT)
    killed_in_cold_start = not os.path.exists(os.path.join(e, "composer0"))
    finish(procs[0])
    _, resumed_log, _ = finish(start(train_cmd(backbone, e, *flags), e + "-rerun-log"))
    return dict(d=d, e=e, killed_at=killed_at, killed_in_cold_start=killed_in_cold_start, resumed_log=resumed_log)


def test_a_cold_start_killed_and_rerun_matches_the_uninterrupted_one(cold_runs):
    """The cold start SIGKILLed after a checkpoint goes on from it when the same command is run again, saying so in
    one line (composer, AdamW state, the batch sampler's and the global RNG streams, the step), and ends with the
    uninterrupted run's records and φ0, bit for bit; its checkpoints are gone once φ0 is written, and φ before
    training (composer_init) is the killed run's."""
    from safetensors.torch import load_file
    d, e = cold_runs["d"], cold_runs["e"]
    assert cold_runs["killed_in_cold_start"] and 2 <= cold_runs["killed_at"] < COLD_STEPS
    at, log = cold_runs["killed_at"], cold_runs["resumed_log"]
    assert (f"cold start: continuing from {os.path.join(e, checkpoints.COLD_CKPT, f'step-{at:06d}')} at step {at} "
            f"of {COLD_STEPS} (--no-resume starts over)") in log.splitlines()
    assert reused_lines(log, e, CACHED) == {"base rollouts": 1, "bank and retriever": 1, "cold start (φ0)": 0}
    last = {(r["stage"], r.get("step")): untimed(r) for r in records(e)}      # a step logged twice: the resumed one
    assert last == {(r["stage"], r.get("step")): untimed(r) for r in records(d)}
    assert [r["step"] for r in records(e, "cold_start")][-1] == COLD_STEPS - 1
    stages = [r["stage"] for r in records(e)]
    assert stages.count("base_rollouts") == stages.count("bank") == stages.count("cold_start_done") == 1
    for folder in ("composer0", "composer_init"):
        want, got = folder_bytes(os.path.join(d, folder)), folder_bytes(os.path.join(e, folder))
        assert want.keys() == got.keys() and any(k.endswith(".safetensors") for k in want)
        for k in want:
            if k.endswith(".safetensors"):
                a, b = load_file(os.path.join(d, folder, k)), load_file(os.path.join(e, folder, k))
                assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), (folder, k)
    assert not any(os.path.exists(os.path.join(run, checkpoints.COLD_CKPT)) for run in (d, e))


def test_evaluation_rows_already_written_are_read_back(runs, tmp_path, monkeypatch):
    """Stage 6 writes each row once finished (OUT/eval_rows) and reads it back instead of rolling it out again when
    the key is the same: the training run's own rows for an evaluation of the same tasks, sampling and checkpoint,
    a row left by a kill; a changed key (other tasks, another temperature) rolls the rows out again."""
    out = str(tmp_path / "run")
    shutil.copytree(runs["a"], out)                       # copy2: the checkpoint's files keep their times
    args = dataclasses.replace(train.load_args(out), out=out)
    run = train.load_run(args)
    calls = []
    for name in ("eval_vanilla", "eval_teacher", "eval_student"):
        fn = getattr(train, name)
        monkeypatch.setattr(train, name, lambda *a, fn=fn, name=name, **k: calls.append(name) or fn(*a, **k))
    final = json.loads(read(os.path.join(out, "results.json")))["rows"]
    assert train.evaluate(args, run, run.student, run.test, cache=True) == final and calls == []
    assert train.evaluate(args, run, run.student, run.test) == final and len(calls) == 3       # no cache: computed
    calls.clear()
    rows_dir = os.path.join(out, checkpoints.ROWS_DIR)
    before = set(os.listdir(rows_dir))                    # run a's own rows (and those of eval.py's tests on it)
    three = train.evaluate(args, run, run.student, run.test[:3], cache=True)
    assert calls == ["eval_vanilla", "eval_teacher", "eval_student"]
    new = sorted(set(os.listdir(rows_dir)) - before)
    assert [f.split("-")[0] for f in new] == ["base", "student", "vanilla"]         # a file a row
    os.remove(os.path.join(rows_dir, new[1]))
    calls.clear()
    assert train.evaluate(args, run, run.student, run.test[:3], cache=True) == three
    assert calls == ["eval_student"]                      # the row the "kill" left unwritten, alone
    calls.clear()
    train.evaluate(args, run, run.student, run.test[:3], temperature=0.0, cache=True)
    assert len(calls) == 3


def test_a_run_draws_its_curves(runs, cold_runs):
    """OUT/curves.png (worlds/results.py) holds a panel for each kind of number the run logged: the student's reward,
    the losses, Δ and β, the cold start's loss and the evaluation rows; a run without a joint stage has the last
    two. Without matplotlib the run says so in one line and writes no figure."""
    from worlds import results
    a = runs["a"]
    lopd = records(a, "lopd")
    panels = results.curve_panels(results.logged(a), json.loads(read(os.path.join(a, "results.json")))["rows"], 0.05)
    assert list(panels) == ["student reward", "losses", "Δ, the teacher's privilege (eq. 12)",
                            "β, the dual variable (eq. 13)", "cold start", "evaluation"]
    assert [c[0] for c in panels["losses"]] == [k for k in lopd[0] if k.startswith("loss/")]
    assert panels["student reward"][0][1:3] == (list(range(STEPS)), [r["reward/student"] for r in lopd])
    assert [c[0] for c in panels["evaluation"]] == ["vanilla, final", "base + composer, final", "LOPD student, final"]
    cold_only = results.curve_panels(results.logged(cold_runs["d"]), {}, 0.05)
    assert list(cold_only) == ["cold start"] and cold_only["cold start"][0][1] == [0, COLD_STEPS - 1]
    if importlib.util.find_spec("matplotlib"):
        assert os.path.getsize(os.path.join(a, "curves.png")) > 0 and results.plot_curves(a) == list(panels)
    else:
        assert not os.path.exists(os.path.join(a, "curves.png"))
        assert "matplotlib is not installed: OUT/curves.png is skipped" in read(a + "-log.out")


def test_show_opens_an_evaluations_records(runs, backbone, tmp_path, capsys):
    """eval.py --show FILE.records.jsonl --index K: the K-th record (as eval.py's evaluations write them) on the
    token view, its reply tokens scored by the run's student and teacher, into FILE.show<K>.html; an index past the
    file's end is one line and exit status 2."""
    import types

    import engine
    import eval as ev
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(backbone)
    rollouts = [json.loads(line) for line in read(os.path.join(runs["a"], "base_rollouts.jsonl")).splitlines()[:3]]
    eps = [engine.Episode.from_record(r, types.SimpleNamespace(task_id=r["task_id"])) for r in rollouts]
    path = tmp_path / "toy_all.records.jsonl"
    path.write_text("".join(json.dumps(ev.task_record(tok, "toy", ep, None)) + "\n" for ep in eps))
    ev.main(["--run", runs["a"], "--show", str(path), "--index", "1"])
    page = (tmp_path / "toy_all.show1.html").read_text()
    assert f"wrote {tmp_path / 'toy_all.show1.html'}" in capsys.readouterr().out
    assert rollouts[1]["task_id"] in page and page.count("<section") == 2     # the episode, then its world check
    assert page.count('class="tok"') == 2 * sum(rollouts[1]["mask"])        # every reply token, in each section
    with pytest.raises(SystemExit) as stop:
        ev.main(["--run", runs["a"], "--show", str(path), "--index", "3"])
    assert stop.value.code == 2 and "--index 3" in capsys.readouterr().err


def test_checkpoint_is_whole_and_loadable(runs, backbone):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from composer import Composer
    a = runs["a"]
    assert sorted(os.listdir(os.path.join(a, "ckpt"))) == ["LATEST", f"step-{STEPS:06d}"]   # no temp left
    ckpt = checkpoints.latest_checkpoint(a)
    assert sorted(os.listdir(ckpt)) == ["composer", "state.pt", "student"]
    state = torch.load(os.path.join(ckpt, "state.pt"), weights_only=False)
    assert state["step"] == STEPS
    assert state["state"]["beta"] == pytest.approx(records(a, "lopd")[-1]["dual/beta"], abs=1e-5)
    assert {"python", "numpy", "torch", "tasks"} <= set(state["rng"])
    student = AutoModelForCausalLM.from_pretrained(os.path.join(ckpt, "student"))
    tok = AutoTokenizer.from_pretrained(backbone)
    assert student.config.vocab_size == len(tok)
    comp = Composer.load(os.path.join(ckpt, "composer"), AutoModelForCausalLM.from_pretrained(backbone), tok)
    assert comp.cfg.n_latents == 2
    with torch.no_grad():
        c = comp(["[alder shop] x"], [["a", "b", "c"]])                  # (1, J·K, d)
    assert c.shape == (1, 3 * 2, student.config.hidden_size) and torch.isfinite(c).all()


def test_joint_training_changes_the_student(runs, backbone):
    from safetensors.torch import load_file
    base = load_file(os.path.join(backbone, "model.safetensors"))
    trained = load_file(os.path.join(checkpoints.latest_checkpoint(runs["a"]), "student", "model.safetensors"))
    assert any(not torch.equal(base[k], trained[k]) for k in base)


# In-process from here: `train.main(argv)` is exactly what the command line runs, without paying a new interpreter's
# ~5 s of imports per case.
def test_frozen_composer_run(runs, backbone, tmp_path):
    out = tmp_path / "frozen"
    out.mkdir()
    for name in ("tasks", "base_rollouts.jsonl", "bank", "composer0"):   # reuse run a's cached stages
        subprocess.run(["cp", "-r", os.path.join(runs["a"], name), str(out / name)], check=True)
    train.main(train_cmd(backbone, out, "--freeze-composer", "--steps", "1")[2:])
    lopd = records(str(out), "lopd")
    assert len(lopd) == 1 and lopd[0]["loss/anchor"] == 0.0


def test_a_finished_run_rerun_reuses_every_stage_and_a_changed_one_says_how_to_go_on(runs, backbone, tmp_path, capsys):
    """A finished run's command again (in a copy of its folder) trains and rolls out nothing: each cached stage, the
    finished joint stage and each evaluation row is one line. Under a changed --lr the same folder stops in one line
    naming the change and --no-resume, args.json untouched; with --no-resume it trains from step 0, the old
    checkpoint removed first."""
    out = str(tmp_path / "again")
    shutil.copytree(runs["a"], out)                       # copy2: the files keep their times (the rows' keys)
    cmd, n, ckpt = train_cmd(backbone, out)[2:], len(records(out)), os.path.join(out, "ckpt", f"step-{STEPS:06d}")
    capsys.readouterr()
    train.main(cmd)
    log = capsys.readouterr().out
    assert (f"joint stage: finished ({STEPS} steps, --steps {STEPS}): reusing {ckpt} (--no-resume trains it again)"
            in log.splitlines())
    assert reused_lines(log, out, CACHED) == dict.fromkeys(dict(CACHED), 1)
    rows = re.findall(rf"^evaluation, (.+): reusing {re.escape(os.path.join(out, checkpoints.ROWS_DIR))}", log, re.M)
    assert rows == ["vanilla", "base + composer", "student"] and len(records(out)) == n, log
    with pytest.raises(SystemExit) as stop:
        train.main(cmd + ["--lr", "0.01"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("error: ") == 1, err
    assert "--lr 0.0001 (now 0.01)" in err and "--no-resume" in err and "another --out" in err
    assert json.loads(read(os.path.join(out, "args.json")))["lr"] == 1e-4 and os.path.isdir(ckpt)
    train.main(cmd + ["--lr", "0.01", "--no-resume", "--steps", "1"])
    assert f"joint stage: starting over at step 0 (--no-resume); removing {ckpt}" in capsys.readouterr().out
    assert sorted(os.listdir(os.path.join(out, "ckpt"))) == ["LATEST", "step-000001"]
    assert [r["step"] for r in records(out, "lopd")] == [*range(STEPS), 0]


def test_generation_counter_counts_the_bank_rollouts(runs):
    n_bank = len(read(os.path.join(runs["a"], "base_rollouts.jsonl")).splitlines())   # 30 tasks x 2 rollouts
    assert n_bank == 60
    assert [r["generations"] for r in records(runs["a"], "lopd")] == [n_bank + 4 * (s + 1) for s in range(STEPS)]


def test_rft_control_run(runs, backbone, tmp_path):
    """--method rft: NLL on the bank's successes on the student's optimizer; no teacher, no new generations."""
    from safetensors.torch import load_file
    out = tmp_path / "rft"
    out.mkdir()
    for name in ("tasks", "base_rollouts.jsonl", "bank", "composer0"):
        subprocess.run(["cp", "-r", os.path.join(runs["a"], name), str(out / name)], check=True)
    train.main(train_cmd(backbone, out, "--method", "rft", "--steps", "2")[2:])
    rft = records(str(out), "rft")
    assert [r["step"] for r in rft] == [0, 1] and not records(str(out), "lopd")
    assert all(r["generations"] == 60 and r["loss/rft"] > 0 and r["skipped"] == 0 for r in rft)
    base = load_file(os.path.join(backbone, "model.safetensors"))
    trained = load_file(os.path.join(checkpoints.latest_checkpoint(str(out)), "student", "model.safetensors"))
    assert any(not torch.equal(base[k], trained[k]) for k in base)


def test_each_baseline_runs_in_a_subprocess(runs, backbone, tmp_path):
    """--method grpo|opsd|sdpo|sdft|skillsd at tiny size, started together; each logs its own stage, spends 4
    generations a step (GRPO, SDPO, Skill-SD: one task x G = 4), counts the bank only where it uses it (OPSD's and
    SDFT's pool, Skill-SD's first skills) and changes θ; SDFT and SDPO checkpoint their EMA teacher, Skill-SD its
    skill bank in OUT/skill_bank.jsonl."""
    from safetensors.torch import load_file
    procs = {}
    for method in ("grpo", "opsd", "sdpo", "sdft", "skillsd"):
        out = tmp_path / method
        out.mkdir()
        for name in ("tasks", "base_rollouts.jsonl", "bank", "composer0"):
            subprocess.run(["cp", "-r", os.path.join(runs["a"], name), str(out / name)], check=True)
        procs[method] = (out, start(train_cmd(backbone, out, "--method", method, "--steps", "2"), out / "log"))
    base = load_file(os.path.join(backbone, "model.safetensors"))
    for method, (out, proc) in procs.items():
        _, stdout, _ = finish(proc)
        recs = records(str(out), method)
        bank = 60 if train.METHODS[method].uses_bank else 0
        assert [r["generations"] for r in recs] == [bank + 4, bank + 8], method
        assert all(r["skipped"] == 0 and "reward/student" in r for r in recs), recs
        assert f"| {train.METHODS[method].label} |" in stdout
        trained = load_file(os.path.join(checkpoints.latest_checkpoint(str(out)), "student", "model.safetensors"))
        assert any(not torch.equal(base[k], trained[k]) for k in base), method
    for method in ("sdpo", "sdft"):
        assert os.path.isdir(os.path.join(checkpoints.latest_checkpoint(str(procs[method][0])), "ema_teacher"))
    skills = [json.loads(line) for line in open(procs["skillsd"][0] / "skill_bank.jsonl")]
    assert skills[0]["event"] == "skill" and skills[0]["source"] == "base rollouts"
    assert [e["step"] for e in skills if e["event"] == "pulls"] == [0, 1]
    assert all("loss/sdl" in r and r["skillsd/skills"] >= 1 for r in records(str(procs["skillsd"][0]), "skillsd"))


@pytest.mark.parametrize("flag, value, named", [("--model", "/nonexistent/folder", "/nonexistent/folder"),
                                                ("--device", "tpu", "--device"), ("--method", "ppo", "--method"),
                                                ("--retrieval", "all", "--retrieval")])
def test_bad_flag_exits_nonzero_naming_it(tmp_path, capsys, flag, value, named):
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--out", str(tmp_path / "run"), flag, value])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert named in err and value in err, err


def test_defaults_follow_the_backbone_and_the_world(backbone, tmp_path):
    """Unset flags take the toy's values on a toy folder, the code world's student rate there, and the paper's
    values on any other model; a flag given on the command line always wins."""
    toy = train.parse_args(["--out", str(tmp_path), "--model", backbone])
    code = train.parse_args(["--out", str(tmp_path), "--model", backbone, "--env", "code"])
    real = train.parse_args(["--out", str(tmp_path), "--model", str(tmp_path)])   # no toy_backbone.json there
    given = train.parse_args(["--out", str(tmp_path), "--model", backbone, "--env", "code", "--lr", "2e-5"])
    assert (toy.lr, code.lr, real.lr, given.lr) == (1e-4, 3e-4, 1e-5, 2e-5)
    assert (toy.latents, code.latents, real.latents) == (8, 8, 32)


def test_a_runs_paths_work_from_any_directory(backbone, tmp_path, monkeypatch):
    """Paths given relative to where training starts are stored absolute: --model, --env FILE.py:CLASS."""
    (tmp_path / "worlds").mkdir()
    (tmp_path / "worlds" / "mine.py").write_text("from worlds.tool_world import ToolWorld\n\n\nclass Mine(ToolWorld):\n    pass\n")
    monkeypatch.chdir(os.path.dirname(backbone))
    args = train.parse_args(["--out", str(tmp_path / "run"), "--model", os.path.basename(backbone),
                             "--env", os.path.relpath(tmp_path / "worlds" / "mine.py") + ":Mine"])
    assert args.model == os.path.abspath(backbone) and args.env == f"{tmp_path / 'worlds' / 'mine.py'}:Mine"


def test_bad_task_line_fails_naming_file_and_line(backbone, tmp_path):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    good = json.dumps({"task_id": "t0", "shop": "alder", "schema": "cancel", "text": "x", "db": {}, "goal": {},
                       "checklist": []})
    (tasks / "train.jsonl").write_text(good + "\n{not json\n")
    (tasks / "test.jsonl").write_text(good + "\n")
    with pytest.raises(ValueError, match=r"train\.jsonl:2"):
        train.main(train_cmd(backbone, tmp_path / "run", "--tasks", str(tasks))[2:])


def test_figure4_command_writes_the_curves(runs, backbone, tmp_path):
    """scripts/experiments.py figure4 at tiny size (one seed, 10 steps: one evaluated point after step 0) from run a's
    cached stages."""
    out = tmp_path / "f4"
    (out / "seed0").mkdir(parents=True)
    for name in ("tasks", "base_rollouts.jsonl", "bank", "composer0"):
        subprocess.run(["cp", "-r", os.path.join(runs["a"], name), str(out / "seed0" / name)], check=True)
    experiments.main(["figure4", "--seeds", "1", *train_cmd(backbone, out, "--steps", "10")[2:]])
    lines = read(os.path.join(out, "figure4.csv")).splitlines()
    assert lines[0] == "method,seed,step,generations,training_generations,reward"
    rows = [dict(zip(lines[0].split(","), line.split(","))) for line in lines[1:]]
    assert [(r["method"], r["step"]) for r in rows] == [(m, s) for m in experiments.FIGURE4_METHODS
                                                        for s in ("0", "10")]
    for r in rows:
        bank = 60 if train.METHODS[r["method"]].uses_bank else 0
        assert int(r["generations"]) == bank + int(r["training_generations"]) == bank + 4 * int(r["step"])
    assert len({r["reward"] for r in rows if r["step"] == "0"}) == 1     # every curve starts at the same vanilla
    table = read(os.path.join(out, "figure4.md"))
    assert "| training generations | LOPD | GRPO | Skill-SD | OPSD | SDPO | SDFT |" in table
    assert ("Paper (Qwen3-4B, EnvScaler, §4.3: LOPD's by generation 576, the others' at 1,600): LOPD 0.637, "
            "GRPO 0.611, Skill-SD 0.588.") in table


def test_dial_command_at_tiny_size(runs, backbone, tmp_path):
    """scripts/experiments.py dial for K = 2 on the tests' tiny backbone (one seed, stages 1-4 copied from run a): four
    joint runs, the CSV's measures, the table; then --ks 3 with that K = 2 backbone fails in one line."""
    out = tmp_path / "dial"
    (out / "k2" / "seed0").mkdir(parents=True)
    for name in ("tasks", "base_rollouts.jsonl", "bank", "composer0"):
        subprocess.run(["cp", "-r", os.path.join(runs["a"], name), str(out / "k2" / "seed0" / name)], check=True)
    flags = train_cmd(backbone, out, "--steps", "4", "--eval-every", "2", "--eval-tasks", "3")[2:]
    experiments.main(["dial", "--seeds", "1", "--ks", "2", *flags])
    lines = (out / "dial.csv").read_text().splitlines()
    assert lines[0] == "k,seed,method,measure,step,generations,value"
    rows = [dict(zip(lines[0].split(","), line.split(","))) for line in lines[1:]]
    got = {(r["method"], r["measure"], r["step"]) for r in rows}
    for m in experiments.DIAL_METHODS:
        assert {(m, "student", s) for s in ("0", "2", "4")} | {(m, "student_end", "4")} <= got
    assert {("base", "vanilla", "0"), ("base", "teacher", "0"), ("lopd", "teacher", "4"),
            ("lopd-phi0", "teacher", "4"), ("grpo", "flat_groups", "4")} <= got
    flat = next(float(r["value"]) for r in rows if r["measure"] == "flat_groups")
    zero = [json.loads(line).get("grpo/zero_adv_groups") for line in open(out / "k2" / "seed0" / "grpo" / "metrics.jsonl")]
    assert flat == sum(z for z in zero if z is not None) / (4 * 1)       # 4 steps of one group of 4
    assert "| K | vanilla | teacher φ0 | LOPD |" in (out / "dial.md").read_text()
    for m in ("base", *experiments.DIAL_METHODS):                          # convention_split: K = 2's two
        assert {(m, "kept_verify", "0"), (m, "kept_commit", "0")} <= got
    # retrieval_split: the groups partition the held-out tasks, and their rewards add up to the teacher at φ0
    value = {r["measure"]: float(r["value"]) for r in rows if r["method"] == "base"}
    shares = [value.get(f"share_refs_{g}", 0.0) for g in ("all", "some", "none")]
    assert sum(shares) == pytest.approx(1.0)
    assert sum(s * value.get(f"teacher_refs_{g}", 0.0) for s, g in zip(shares, ("all", "some", "none"))) == \
        pytest.approx(value["teacher"])
    r = subprocess.run([sys.executable, "-m", "scripts.experiments", "dial", "--seeds", "1", "--ks", "3", *flags], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "built for the tool world with 2 conventions" in r.stderr


def test_figure4_table_reports_where_lopd_reaches_grpos_and_skillsds_final_rewards():
    def rows(method, rewards, bank=0):
        return [dict(method=method, seed=seed, step=10 * k, generations=bank + 320 * k, training_generations=320 * k,
                     reward=r + 0.02 * seed) for seed in (0, 1) for k, r in enumerate(rewards)]
    data = rows("lopd", [0.40, 0.55, 0.62, 0.64], bank=2000) + rows("grpo", [0.40, 0.45, 0.50, 0.60])
    table = experiments.figure4_table(data + rows("skillsd", [0.40, 0.50, 0.63, 0.64]))
    # Skill-SD ends at LOPD's own final mean (0.65), above LOPD's earlier points: LOPD reaches it at its last point
    assert "Skill-SD's final reward 0.650 after 960 generations. LOPD first reaches it after 960" in table
    # GRPO's final mean is 0.61 after 960 generations; LOPD's mean first reaches it at 640 (0.63 >= 0.61)
    assert "GRPO's final reward 0.610 after 960 generations" in table
    assert "after 640 training generations (67% of GRPO's; 275% counting the 2000 rollouts" in table
    assert "| 320 | 0.560 ± 0.014 | 0.460 ± 0.014 |" in table     # two seeds 0.02 apart: sample std 0.02/√2
    assert "did not improve" not in table
    # a GRPO that ends below where it started: "LOPD reaches it at 0 generations" is true and empty, so it is flagged
    flat = experiments.figure4_table(rows("lopd", [0.40, 0.42, 0.50, 0.55], bank=2000)
                                     + rows("grpo", [0.40, 0.38, 0.36, 0.35]))
    assert "GRPO did not improve on the base (0.410 -> 0.360)" in flat and "after 0 training generations" in flat


def test_toy_code_world_pipeline(tmp_path):
    """python train.py --env code (a subprocess) on a tiny toy code backbone: problems generated and saved,
    single-turn rollouts verified in the sandbox, the whole pipeline and the three rows (pipeline only)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    bb = toy.build_backbone(str(tmp_path / "code-bb"), seed=0, n_demos=200, steps=40, batch=16, lr=3e-3, hidden=32,
                            layers=2, log=lambda *_: None, world="code")
    torch.set_num_threads(n)
    out = tmp_path / "run"
    finish(start(train_cmd(bb, out, "--env", "code", "--n-train", "12", "--steps", "2"), tmp_path / "log"))
    problems = [json.loads(line) for line in read(os.path.join(out, "tasks", "train.jsonl")).splitlines()]
    assert len(problems) == 12 and all(p["variant"] in ("alder", "cedar", "delta", "flint") for p in problems)
    rows = json.loads(read(os.path.join(out, "results.json")))["rows"]
    assert set(rows) == {"vanilla", "base + composer", "LOPD student"}
    assert all(set(r) == {"pass@1", "reply_tokens"} for r in rows.values())   # single-turn: pass@1, no calls
    assert [r["step"] for r in records(str(out), "lopd")] == [0, 1]
    # eval.py --conventions on that run: the three rows' convention rates, each a fraction
    _, text, _ = finish(start([sys.executable, "eval.py", "--run", str(out), "--n-test", "4", "--conventions"],
                              tmp_path / "eval"))
    table = text[text.index("| row | pass | prefix |"):].splitlines()
    assert [line.split(" | ")[0] for line in table[2:5]] == ["| vanilla", "| base + composer", "| LOPD student"]
    assert all(0.0 <= float(x) <= 1.0 for line in table[2:5] for x in line.strip(" |").split(" | ")[1:])


def test_latent_similarity_groups_tasks_by_what_their_latents_add():
    """eval.latent_similarity against a hand computation: tasks whose latents differ by a per-group direction are
    alike within a group (cosine 1) and opposite across two groups (cosine −1); groups that explain nothing come
    out near 0 on both sides of the table."""
    import eval as ev
    torch.manual_seed(0)
    shared, direction = torch.randn(1, 3, 4), torch.randn(3, 4)
    lat = torch.cat([shared + direction, shared + direction, shared - direction, shared - direction])   # (4, 3, 4)
    assert ev.latent_similarity(lat, ["a", "a", "b", "b"]) == pytest.approx((1.0, -1.0), abs=1e-5)
    # grouped the other way, each pair holds one task of each kind: same-group pairs are opposite (−1), and of the
    # four cross-group pairs two are alike and two opposite (mean 0)
    assert ev.latent_similarity(lat, ["a", "b", "a", "b"]) == pytest.approx((-1.0, 0.0), abs=1e-5)


def test_absorb_command_at_tiny_size(runs, backbone, tmp_path, monkeypatch):
    """scripts/experiments.py absorb on a subset of its rows (one seed, 2 steps, stages 1-3 copied from run a): the
    official row cold-starts its own φ0 (K = 32, split optimizers) in its folder, the best LOPD row and GRPO go on
    to 4 steps from their checkpoints, and the table's efficiency and gaps are the rows' own numbers."""
    rows = {k: experiments.ABSORB_ROWS[k] for k in (experiments.VANILLA, "LOPD, toy defaults", "GRPO", "RFT",
                                                    "official at toy scale (all six)")}
    monkeypatch.setitem(experiments.ROWS, "absorb", rows)
    out = tmp_path / "absorb"
    (out / "seed0").mkdir(parents=True)
    for name in ("tasks", "base_rollouts.jsonl", "bank", "composer0"):
        subprocess.run(["cp", "-r", os.path.join(runs["a"], name), str(out / "seed0" / name)], check=True)
    experiments.main(["absorb", "--seeds", "1", *train_cmd(backbone, out, "--steps", "2")[2:]])
    got = {r["row"]: r for r in json.load(open(out / "seed0" / "absorb.json"))}
    best = max(("LOPD, toy defaults", "official at toy scale (all six)"), key=lambda r: got[r]["student"])
    assert set(got) == {*rows, best + experiments.LONG, "GRPO" + experiments.LONG}
    official = out / "seed0" / "official-at-toy-scale-all-six"
    assert json.load(open(official / "composer0" / "composer.json"))["n_latents"] == 32
    assert got["GRPO"]["generations"] == 8 and got["GRPO" + experiments.LONG]["generations"] == 16
    assert got["LOPD, toy defaults"]["generations"] == 60 + 8 and got[best + experiments.LONG]["generations"] == 76
    steps = [json.loads(line)["step"] for line in open(out / "seed0" / "grpo-twice-the-iterations" / "metrics.jsonl")
             if '"stage": "grpo"' in line]
    assert steps == [0, 1, 2, 3]                                       # the 2-step run's records, then 2 more
    v = got[experiments.VANILLA]["vanilla"]
    lopd_row = got["LOPD, toy defaults"]
    summary = experiments.absorb_summary(list(got.values()))["LOPD, toy defaults"]
    if lopd_row["teacher"] != v:
        assert summary["efficiency"] == [pytest.approx((lopd_row["student"] - v) / (lopd_row["teacher"] - v))]
    assert summary["LOPD − GRPO"] == [pytest.approx(lopd_row["student"] - got["GRPO"]["student"])]
    assert summary["LOPD − RFT"] == [pytest.approx(lopd_row["student"] - got["RFT"]["student"])]
    table = (out / "absorb.md").read_text()
    assert "| official at toy scale (all six) |" in table and "| GRPO, twice the iterations |" in table
    assert len((out / "absorb.csv").read_text().splitlines()) == 1 + 7
    assert not list(out.glob("seed0/*.claim"))                          # every claim released
    # --kept: the default row's final student and teacher again, split by convention; their rewards are the row's
    experiments.main(["absorb", "--kept", "--seeds", "1", *train_cmd(backbone, out, "--steps", "2")[2:]])
    kept = {(r["who"], r["convention"]): r["kept"] for r in json.load(open(out / "absorb_kept.json"))}
    assert kept[("LOPD student", "reward")] == lopd_row["student"]
    assert kept[("base + composer", "reward")] == lopd_row["teacher"] and kept[("vanilla", "reward")] == v
    assert {c for _, c in kept} == {"verify", "commit", "reward"}


def test_absorb_claims_a_job_once_and_takes_over_a_dead_workers(tmp_path):
    a = argparse.Namespace(out=str(tmp_path))
    assert experiments._claim(a, "GRPO") and not experiments._claim(a, "GRPO")      # ours: not twice
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    with open(experiments._row_dir(a, "RFT") + ".claim", "w") as f:
        f.write(dead.stdout.strip())                                    # a worker that has exited
    assert experiments._claim(a, "RFT")
    assert open(experiments._row_dir(a, "RFT") + ".claim").read() == str(os.getpid())


def test_course_command_runs_the_staged_path_at_tiny_size(runs, backbone, tmp_path, monkeypatch):
    """scripts/experiments.py course --stages on two of its stages and an exercise's row (one seed, 2 steps, from run a's
    cached stages): the exercise's row is not run; OPSD's row has no latent teacher; a LOPD stage logs its last Δ
    and β and its teacher along the way."""
    stage3 = "3. the composer learns, no margin (m = 0)"
    rows = {k: experiments.COURSE_ROWS[k] for k in [*list(experiments.COURSE_ROWS)[:2], stage3, "exercise 8: RFT"]}
    monkeypatch.setitem(experiments.ROWS, "course", rows)
    out = tmp_path / "course"
    (out / "seed0").mkdir(parents=True)
    for name in ("tasks", "base_rollouts.jsonl", "bank", "composer0"):
        subprocess.run(["cp", "-r", os.path.join(runs["a"], name), str(out / "seed0" / name)], check=True)
    flags = train_cmd(backbone, out, "--steps", "2", "--eval-every", "1", "--eval-tasks", "2")[2:]
    experiments.main(["course", "--stages", "--seeds", "1", *flags])   # --n-train 30 and --n-test 6 given: kept
    got = {r["row"]: r for r in json.load(open(out / "seed0" / "course.json"))}
    assert sorted(got) == sorted(list(rows)[:3])                # the exercise's row waits for a run without --stages
    opsd, m0 = got["1. OPSD: the teacher reads a success as text"], got[stage3]
    assert "teacher" not in opsd and "delta" not in opsd
    folder = experiments._row_dir(argparse.Namespace(out=str(out / "seed0")), stage3)
    last = [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl")) if '"stage": "lopd"' in line][-1]
    assert (m0["delta"], m0["beta"]) == (last["privilege/delta"], last["dual/beta"]) and len(m0["teacher_curve"]) == 2
    assert "| delta | beta |" in (out / "course.md").read_text()
    if importlib.util.find_spec("matplotlib"):                  # the Δ and β curves of the stage that learns φ
        assert (out / "course-curves.png").stat().st_size > 0


def test_workers_split_the_cores_between_them(monkeypatch):
    """scripts/experiments.py --workers N starts N − 1 more copies of the same command (without --workers), and every
    process, this one too, runs on cores / N threads."""
    from scripts import experiments
    started, threads = [], []
    monkeypatch.setattr(experiments.subprocess, "Popen", lambda cmd, env, cwd: started.append((cmd, env)) or cmd)
    monkeypatch.setattr(experiments.torch, "set_num_threads", threads.append)
    monkeypatch.setattr(experiments.os, "cpu_count", lambda: 8)
    assert experiments.start_workers(1, ["absorb", "--out", "x"]) == [] and threads == []
    experiments.start_workers(4, ["absorb", "--workers", "4", "--out", "x", "--workers=4"])
    assert threads == [2] and len(started) == 3
    for cmd, env in started:
        assert cmd[1:] == ["-m", "scripts.experiments", "absorb", "--out", "x"] and env["OMP_NUM_THREADS"] == "2"


def test_a_run_that_cannot_fit_stops_before_any_work(backbone, tmp_path):
    """The pre-flight check: a run whose trained states leave no room for one conversation in the memory given
    (--memory 0.002: 2 MB, the backbone included) is one line on stderr and exit status 2, before the base
    rollouts; it names what fits, and no --max-len, which could not help."""
    proc = start(train_cmd(backbone, tmp_path / "run", "--memory", "0.002"), tmp_path / "log")
    rc, out, err = finish(proc, timeout=120, ok=False)
    last = err.strip().splitlines()[-1]
    assert rc == 2 and "Traceback" not in err, err[-2000:]
    assert last.startswith("error: memory plan: cpu ") and "no --max-len fits. What fits: a machine with " in last
    assert "--max-len" not in last.split("What fits:")[1]
    assert not os.path.exists(tmp_path / "run" / "base_rollouts.jsonl")


def test_the_papers_base_plus_composer_stands_beside_lopds_teacher():
    """B.4's "Base + Composer" (0.631) is the jointly optimised composer on the unadapted backbone: the ablation
    table sets it beside the LOPD (m = 0.05) row, whose teacher that is, not beside φ0's world-check row."""
    from scripts import experiments
    seed = {"vanilla": {"student": 0.4, "generations": 0},
            "base + composer": {"teacher": 0.7, "generations": 2000},
            "LOPD (m = 0.05)": {"student": 0.6, "teacher": 0.75, "generations": 3920}}
    rows = {line.split(" | ")[0].lstrip("| "): line for line in experiments.ablation_table([seed]).splitlines()[2:]
            if line.startswith("| ")}
    assert "0.631" in rows["LOPD (m = 0.05)"] and "0.637" in rows["LOPD (m = 0.05)"]
    assert "0.631" not in rows["base + composer"] and "0.486" in rows["vanilla"]


def test_quick_is_the_same_pipeline_small_and_flags_beside_it_win():
    """--quick (README's first command) fills QUICK's fields where the command line left their defaults; a flag
    given beside it wins; nothing else of the default run changes."""
    quick, plain = train.parse_args(["--quick"]), train.parse_args([])
    assert {k: getattr(quick, k) for k in train.QUICK} == train.QUICK
    assert train.parse_args(["--quick", "--steps", "3"]).steps == 3
    assert train.parse_args(["--quick", "--n-test", "200"]).n_test == 200              # given at its default: kept
    same = {f.name for f in dataclasses.fields(train.Args)} - set(train.QUICK) - {"quick"}
    assert all(getattr(quick, k) == getattr(plain, k) for k in same)
    assert plain.steps == 60 and plain.n_train == 1000                 # the check can fail: the default run differs


def test_the_size_line_counts_what_the_resolved_args_hold():
    """Issue 62: a run says its size before its first stage (`devices.size_line`, printed by `prepare`), each number
    the resolved settings', worked out here from QUICK, the defaults and the flags."""
    from runtime import devices
    q, d = train.QUICK, train.parse_args([])
    quick = train.parse_args(["--quick"])
    assert devices.size_line(quick, q["n_train"], q["n_test"]) == (
        f"quick run: {q['n_train'] * d.bank_rollouts} base rollouts ({q['n_train']} tasks × {d.bank_rollouts}), "
        f"{q['cold_steps']} cold-start steps, {q['steps']} lopd iterations of {q['rollouts_per_step']} rollouts, "
        f"3 rows × {q['n_test']} held-out tasks at the end; the time left is said after each stage's first batch")
    # the default run: TOY_DEFAULTS' steps and checks, thousands written with a comma
    line = devices.size_line(d, d.n_train, d.n_test)
    checks = train.TOY_DEFAULTS["steps"] // train.TOY_DEFAULTS["eval_every"]
    assert line.startswith(f"this run: {d.n_train * d.bank_rollouts:,} base rollouts ({d.n_train:,} tasks × "
                           f"{d.bank_rollouts}), {train.TOY_DEFAULTS['cold_steps']} cold-start steps, "
                           f"{train.TOY_DEFAULTS['steps']} lopd iterations of {d.rollouts_per_step} rollouts, "
                           f"{checks} checks on {d.eval_tasks} held-out tasks, 3 rows × {d.n_test} held-out tasks")
    # from the flags, not constants: another command, other numbers; RFT rolls nothing out; no steps, no student row
    other = train.parse_args(["--quick", "--n-train", "7", "--bank-rollouts", "3", "--cold-steps", "1",
                              "--method", "rft", "--steps", "40", "--eval-every", "20", "--eval-tasks", "9"])
    assert devices.size_line(other, 7, 5).startswith(
        "quick run: 21 base rollouts (7 tasks × 3), 1 cold-start step, 40 rft iterations on the bank (no rollouts), "
        "2 checks on 5 held-out tasks, 3 rows × 5 held-out tasks at the end")
    assert "iteration" not in devices.size_line(train.parse_args(["--steps", "0"]), 10, 4)
    assert "2 rows × 4 held-out tasks" in devices.size_line(train.parse_args(["--steps", "0"]), 10, 4)
