"""How long a run has left (devices.Clock, devices.stages_left): after the first batch of each stage that rolls out (the
bank's base rollouts, the cold start's first step, the joint stage's first step, the evaluation's first batch) the run
prints one line of each stage's remaining time from the rates measured so far.

Run: python -m pytest tests/test_time_left.py -q
Math checks with hand numbers (`time_left`, `duration`, `time_line`, `stages_left`), then a tiny run of train.py on
the shipped toy backbone: four lines, each what the rates measured when it was printed give.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from runtime import devices  # noqa: E402
import train  # noqa: E402
from runtime.devices import Stage  # noqa: E402

STAGES = [Stage("bank", {"rollout": 336}),                       # 400 base rollouts, the first 64 done
          Stage("cold start", {"cold step": 500}),
          Stage("60 steps", {"step": 60, "rollout": 300}, {"rollout": 60 * 32 + 300}),   # 3 evaluations of 50 × 2
          Stage("evaluation", {"rollout": 600})]


def test_each_stage_at_its_measured_rate():
    """0.5 s a rollout, 12 s a joint step: the bank 336 × 0.5, the steps 60 × 12 + 300 × 0.5, the evaluation
    600 × 0.5; the cold start has no rate yet."""
    rates = {"rollout": 0.5, "step": 12.0}
    assert devices.time_left(STAGES, rates) == [("bank", 168.0, False), ("cold start", None, False),
                                                ("60 steps", 870.0, False), ("evaluation", 300.0, False)]


def test_an_untimed_step_is_at_least_its_rollouts():
    """Before a joint step is timed, a step costs at least its 32 rollouts: (60 × 32 + 300) × 0.5 s, a lower bound;
    once the cold start's step is timed (1.5 s), its 500 steps are 750 s."""
    rates = {"rollout": 0.5, "cold step": 1.5}
    assert devices.time_left(STAGES, rates) == [("bank", 168.0, False), ("cold start", 750.0, False),
                                                ("60 steps", 1110.0, True), ("evaluation", 300.0, False)]
    assert devices.time_left([Stage("2 steps", {"step": 2})], rates) == [("2 steps", None, False)]   # RFT: no floor


def test_durations_and_the_line():
    assert [devices.duration(s) for s in (29, 40, 89, 870, 11400)] == ["29 s", "40 s", "1 min", "14 min",
                                                                       "3 h 10 min"]
    line = devices.time_line(devices.time_left(STAGES, {"rollout": 0.5, "step": 12.0}))
    assert line == ("time: bank ~3 min left, cold start not timed yet, 60 steps ~14 min, evaluation ~5 min; in all "
                    "≥22 min (estimates from the first batch)")                  # 168 + 870 + 300 = 1338 s
    exact = devices.time_line([("evaluation", 300.0, False)])
    assert exact == "time: evaluation ~5 min left; in all ~5 min (estimates from the first batch)"


def test_what_each_stage_has_left(tmp_path):
    """The toy's settings by hand: 100 tasks × 2 bank rollouts, 500 cold steps, 60 steps of 32 rollouts with an
    evaluation of 5 tasks × 2 rows every 20 steps, 3 rows × 20 held-out tasks at the end."""
    args = train.parse_args(["--out", str(tmp_path), "--n-train", "100", "--n-test", "20", "--eval-tasks", "5"])
    assert (args.bank_rollouts, args.cold_steps, args.steps, args.rollouts_per_step, args.eval_every) == (
        2, 500, 60, 32, 20)
    bank = devices.stages_left(args, 100, 20, "bank", 64, drift_rows=2)      # LOPD: the teacher drifts too
    assert [(s.name, s.work, s.floor) for s in bank] == [
        ("bank", {"rollout": 136}, None), ("cold start", {"cold step": 500}, None),
        ("60 steps", {"step": 60, "rollout": 30}, {"rollout": 1950}), ("evaluation", {"rollout": 60}, None)]
    joint = devices.stages_left(args, 100, 20, "joint", 21, drift_rows=2)    # after step 21: at 40 and 60
    assert [(s.name, s.work) for s in joint] == [("39 steps", {"step": 39, "rollout": 20}),
                                                 ("evaluation", {"rollout": 60})]
    rft = train.parse_args(["--out", str(tmp_path), "--method", "rft", "--eval-every", "0"])
    assert devices.stages_left(rft, 100, 20, "joint", 1)[0].floor is None      # RFT's steps roll nothing out
    assert [s.name for s in devices.stages_left(args, 100, 20, "evaluation", 8)] == ["evaluation"]


def test_a_tiny_run_says_the_time_left_once_a_stage(tmp_path, capsys, monkeypatch):
    """train.py at tiny size (12 tasks × 2 bank rollouts in batches of 8, 2 cold-start steps, 2 joint steps, 4
    held-out tasks): one line after the bank's first batch, the cold start's and the joint stage's first step and
    the evaluation's first batch, each equal to what the rates measured by then and the stages left give."""
    said = []
    first = devices.Clock.first

    def spy(clock, unit, seconds, n):                   # what each line was computed from
        fresh = clock.stage is not None and clock.stage not in clock.said
        first(clock, unit, seconds, n)
        if fresh:
            said.append((clock.stage, clock.done + n, dict(clock.rates)))
    monkeypatch.setattr(devices.Clock, "first", spy)
    argv = ["--out", str(tmp_path / "run"), "--n-train", "12", "--n-test", "4", "--gen-batch", "8",
            "--cold-steps", "2", "--steps", "2", "--rollouts-per-step", "4", "--eval-every", "0",
            "--bank-threshold", "0", "--max-new-tokens", "24", "--device", "cpu"]
    train.main(argv)
    lines = [x[x.index("time: "):] for x in capsys.readouterr().out.splitlines() if "time: " in x]
    assert [stage for stage, _, _ in said] == ["bank", "cold start", "joint", "evaluation"]
    starts = ("time: bank ~", "time: cold start ~", "time: 1 step ~", "time: evaluation ~")
    assert len(lines) == 4 and all(x.startswith(s) for x, s in zip(lines, starts)), lines
    args = train.parse_args(argv)
    for line, (stage, done, rates) in zip(lines, said):
        left = devices.stages_left(args, 12, 4, stage, done, drift_rows=2)
        assert line == devices.time_line(devices.time_left(left, rates))
    assert said[0][1] == 8 and set(said[0][2]) == {"rollout"}      # the bank's first batch: 8 of 24 rollouts
