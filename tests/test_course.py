"""The course stays runnable: every command the docs give names flags its script has.

Run: python -m pytest tests/test_course.py -q      (about 10 s: each script's --help once)
"""
import functools
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("train.py", "eval.py", "experiments.py", "toy.py", "bench.py")
DOCS = ["README.md"] + [os.path.join("docs", f) for f in sorted(os.listdir(os.path.join(ROOT, "docs")))
                        if f.endswith(".md")]


def commands(text: str) -> list[tuple[str, str]]:
    """(script, command line) for each line of a ```bash block that runs one of SCRIPTS, with the block's shell
    variables (F="...") expanded and continuation lines joined."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        block = block.replace("\\\n", " ")
        env = dict(re.findall(r'^(\w+)="([^"]*)"', block, re.M))
        for line in block.splitlines():
            line = re.sub(r"\$(\w+)", lambda m: env.get(m.group(1), m.group(0)), line.split(" #")[0])
            for script in SCRIPTS:
                if re.search(rf"(^|\s){re.escape(script)}(\s|$)", line):
                    out.append((script, line))
    return out


@functools.lru_cache(maxsize=None)
def flags_of(script: str) -> frozenset:
    """The --flags that `python SCRIPT --help` lists (experiments.py passes the rest to train.py)."""
    help_text = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True,
                               timeout=120).stdout
    found = set(re.findall(r"(--[a-z][a-z0-9-]*)", help_text))
    return frozenset(found | (flags_of("train.py") if script == "experiments.py" else set()))


def unknown_flags(script: str, line: str) -> list[str]:
    used = re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", line.split(script, 1)[1])
    return [f for f in used if f not in flags_of(script)]


def test_every_documented_command_names_flags_its_script_has():
    seen, bad = 0, []
    for doc in DOCS:
        for script, line in commands(open(os.path.join(ROOT, doc), encoding="utf-8").read()):
            seen += 1
            bad += [f"{doc}: {line.strip()} -> {f}" for f in unknown_flags(script, line)]
    assert seen >= 30, seen                                                 # the docs' commands were found
    assert not bad, "\n".join(bad)
    # the check can fail: a flag that train.py does not have
    fake = commands('```bash\nG="--steps 2"\npython train.py --out x $G --no-such-flag 3\n```\n')
    assert fake == [("train.py", "python train.py --out x --steps 2 --no-such-flag 3")]
    assert unknown_flags(*fake[0]) == ["--no-such-flag"]


def test_the_adding_a_method_diff_gives_a_method_that_trains(tmp_path, toy_backbone_dir):
    """Exercise 7 as a student does it: apply docs/adding-a-method.md's diff to a copy of the code, then run its test
    and two steps of `--method reinforce` (tests/test_docs.py checks the diff applies to this tree)."""
    import json
    import shutil
    if shutil.which("git") is None:
        import pytest
        pytest.skip("applying the diff needs git")
    copy = tmp_path / "repo"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", "runs", "__pycache__", "assets", ".pytest_cache"))
    text = open(os.path.join(ROOT, "docs", "adding-a-method.md"), encoding="utf-8").read()
    diff = re.findall(r"```diff\n(.*?)```", text, re.S)[0]
    applied = subprocess.run(["git", "apply", "-"], input=diff, text=True, cwd=copy, capture_output=True)
    assert applied.returncode == 0, applied.stderr
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    test = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_baselines.py",
                           "-k", "reinforce"], cwd=copy, capture_output=True, text=True, env=env, timeout=300)
    assert test.returncode == 0 and "passed" in test.stdout, test.stdout[-2000:]
    out = tmp_path / "run"
    run = subprocess.run([sys.executable, "train.py", "--method", "reinforce", "--model", toy_backbone_dir, "--out",
                          str(out), "--n-train", "16", "--n-test", "4", "--bank-threshold", "0", "--cold-steps", "1",
                          "--steps", "2", "--rollouts-per-step", "4", "--latents", "2", "--max-new-tokens", "24",
                          "--eval-every", "0"], cwd=copy, capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    steps = [r for r in rows if r["stage"] == "reinforce"]
    assert [r["step"] for r in steps] == [0, 1] and all("loss/reinforce" in r and r["skipped"] == 0 for r in steps)
    assert "| REINFORCE student |" in open(out / "results.md").read()
