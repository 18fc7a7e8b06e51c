"""bench.py and eval.py name a bad flag instead of crashing on it (bench.py prints figures and asserts none)."""
import importlib

import pytest

import bench


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
