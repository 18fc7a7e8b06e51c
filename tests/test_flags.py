"""scripts/bench.py and eval.py name a bad flag instead of crashing on it (scripts/bench.py prints figures and asserts none)."""
import importlib

import pytest

from scripts import bench


@pytest.mark.parametrize("flag", ["--rollouts", "--micro-batch", "--tokens", "--top-m", "--repeats", "--programs"])
def test_bench_names_a_flag_below_one(capsys, flag):
    with pytest.raises(SystemExit) as err:
        bench.main(["--loss", flag, "0"])
    assert err.value.code == 2 and f"{flag} must be at least 1, not 0" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--n-test", "-1"], ["--temperature", "-0.5"]])
def test_eval_names_a_negative_flag(tmp_path, capsys, flags):
    evaluate = importlib.import_module("eval")                 # eval.py (the module, not the builtin)
    with pytest.raises(SystemExit) as err:
        evaluate.main(["--run", str(tmp_path), *flags])
    assert err.value.code == 2 and "--n-test and --temperature must be at least 0" in capsys.readouterr().err


def test_bench_dist_step_times_every_phase_of_a_toy_iteration(capsys):
    """scripts/bench.py --dist-step patches the functions lopd_step calls, in the modules it calls them through (runtime's
    collectives, lopd's phases, losses' objective), and restores nothing it did not find: one process, 4 rollouts."""
    import engine
    import lopd
    import losses
    import runtime
    from worlds import toy_backbone as toy
    saved = {(m, n): getattr(m, n) for m, n in ((engine, "rollout"), (lopd, "compose"), (lopd, "retrieve"),
                                                (lopd, "student_teacher_logits"), (engine, "optimizer_step"),
                                                (engine, "summarize_all"), (runtime, "all_sum"), (runtime, "all_true"),
                                                (runtime, "sync_grads"), (runtime, "gathered"),
                                                (losses, "lopd_objective"))}
    try:
        bench.main(["--dist-step", "--model", toy.SHIPPED, "--rollouts", "4", "--repeats", "1"])
    finally:
        for (m, n), f in saved.items():
            setattr(m, n, f)
    out = capsys.readouterr().out
    assert "one toy LOPD iteration, 4 rollouts over 1 process(es)" in out
    for phase in ("rollout", "compose", "forward", "optimizer", "loss", "backward"):
        assert f"  {phase}" in out, out
