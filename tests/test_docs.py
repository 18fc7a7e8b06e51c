"""The reader's guide stays true to the code: README's reading-order table names only functions that exist, the
README stays a front page, no two files of the project import each other (directly or around a circle), and no text
file points at something the repository lacks (a note kept beside it, a missing doc, a broken link or heading).

Run: python -m pytest tests/test_docs.py -q      (about a second; docs/walkthrough.md runs as its own doctest file)
"""
import ast
import glob
import importlib
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("worlds", "scripts")       # the worlds and benchmarks; the entry points beside train.py and eval.py


def modules(root: str = ROOT) -> list[str]:
    """The project's modules by import name: the top level's files, then each folder's ("worlds.common")."""
    top = [f[:-3] for f in os.listdir(root) if f.endswith(".py")]
    inner = [f"{d}.{f[:-3]}" for d in FOLDERS if os.path.isdir(os.path.join(root, d))
             for f in os.listdir(os.path.join(root, d)) if f.endswith(".py") and f != "__init__.py"]
    return sorted(top + inner)


MODULES = modules()


def readme() -> str:
    return open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()


def reading_order_names() -> list[str]:
    """Every `file.py:name` in README's reading-order section."""
    text = readme()
    section = text[text.index("## Reading order"):]
    section = section[:section.index("\n## ", 1)]
    return [(path.replace("/", "."), name) for path, name in re.findall(r"`([\w/]+)\.py:([\w.]+)`", section)]


def test_readme_is_a_front_page():
    assert len(readme()) < 12_000, len(readme())


def missing(names) -> list[str]:
    """The (module, dotted name) pairs that do not resolve to an attribute of the imported module."""
    out = []
    for module, path in names:
        obj = importlib.import_module(module)
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                out.append(f"{module.replace('.', '/')}.py:{path}")
                break
    return out


def test_every_name_in_the_reading_order_exists():
    names = reading_order_names()
    assert len(names) >= 40, "the table lost its rows"
    assert not missing(names), f"README names what the code does not have: {missing(names)}"
    # the check can fail: a name that is not in the code, or a method that its class does not have
    assert missing([("losses", "no_such_loss"), ("composer", "Composer.no_such_method")]) == [
        "losses.py:no_such_loss", "composer.py:Composer.no_such_method"]


def local_imports(module: str, root: str = ROOT) -> set[str]:
    """The project's own modules that `module` imports anywhere (top level or inside a function): `import x`,
    `import worlds.common`, `from worlds import common`, `from worlds.common import Environment`."""
    path = os.path.join(root, module.replace(".", os.sep) + ".py")
    tree = ast.parse(open(path, encoding="utf-8").read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return (found & set(modules(root))) - {module}


def find_cycle(graph: dict) -> list | None:
    """A list of modules that import each other around a circle, or None (depth-first search)."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        state[m] = "done"
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_no_import_circle(tmp_path):
    graph = {m: local_imports(m) for m in MODULES}
    assert "train" in graph["eval"] and "eval" not in graph["train"]     # eval.py loads runs through train.py
    assert "worlds.common" in graph["worlds.tool_world"]                  # the folders' imports are read too
    assert find_cycle(graph) is None, f"import circle: {' -> '.join(find_cycle(graph))}"
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]   # the search can find one
    # a circle planted inside a worlds folder is found, whichever way its files import each other
    (tmp_path / "worlds").mkdir()
    (tmp_path / "worlds" / "a.py").write_text("from worlds import b\n")
    (tmp_path / "worlds" / "b.py").write_text("import worlds.c\n")
    (tmp_path / "worlds" / "c.py").write_text("def f():\n    from worlds.a import g\n")
    planted = {m: local_imports(m, str(tmp_path)) for m in modules(str(tmp_path))}
    assert find_cycle(planted) == ["worlds.a", "worlds.b", "worlds.c", "worlds.a"]


# ------------------------------------------------------------------------------------------------------------
# The repository stands alone: every reference in a text file points at something a clone has
# ------------------------------------------------------------------------------------------------------------
TEXT_SUFFIXES = (".py", ".md", ".ini", ".txt")
TEXT_NAMES = (".ci/run",)
SELF = "tests/test_docs.py"          # holds the fabricated references of the check below, on purpose
# Files that live beside the repository, not in it: a design note, the paper's text, a `shared` folder. An absolute
# `/shared/...` (a cluster's shared disk in an example command) is allowed; a relative or `/work/` one is not.
OUTSIDE = re.compile(r"DESIGN\.md|lopd-paper[\w-]*\.md|(?:^|[^\w/]|\.\./|/work/)shared/|[\"']shared[\"'],")
# A path that starts at one of the repository's folders (or `paper`, which it does not have), read from the root;
# `../` makes it relative to the file's folder. runs/ and OUT/ are outputs, not references: never checked.
ROOTED = re.compile(r"(?<![\w./-])((?:\.\./)*(?:docs|tests|assets|\.ci|paper)/[\w.*<>{}/-]*)")
OUTPUTS = ("runs/", "OUT/", "assets/offline")       # what a command writes (assets/offline/: python -m scripts.assets)
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")             # a markdown link or image: [text](target)
CITED = re.compile(r',\s*"([^"\n]+)"')                        # `docs/design.md, "Correctness traps"`
# A README section cited by name: `README "Run and test"`, `README.md, "Status"`, `README's "Reading order"` (the
# start of a heading is enough: "Reading order" names "Reading order: the paper's math in the code").
README_CITED = re.compile(r"\bREADME(?:\.md)?(?:'s)?(?:,\s*|\s+)\"([^\"\n]+)\"")


def text_files() -> list[str]:
    """The repository's text files, relative to ROOT: tracked or new but not ignored (git), else a walk."""
    try:
        names = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):                     # not a git checkout (an unpacked archive)
        names = walked()
    return sorted(n for n in names if (n.endswith(TEXT_SUFFIXES) or n in TEXT_NAMES) and n != SELF
                  and os.path.isfile(os.path.join(ROOT, n)))          # a tracked file deleted in the work tree


def walked() -> list[str]:
    """Every file under ROOT outside hidden folders (but .ci) and runs/."""
    out = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d == ".ci" or not (d.startswith(".") or d in ("runs", "__pycache__"))]
        out += [os.path.relpath(os.path.join(folder, f), ROOT).replace(os.sep, "/") for f in files]
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: str) -> set[str]:
    """The anchors of a markdown file's headings."""
    lines = open(path, encoding="utf-8").read().splitlines()
    return {slug(line.lstrip("#")) for line in lines if re.match(r"#{1,6} ", line)}


def exists(base: str, path: str) -> bool:
    """Does `path` (relative to `base`) name something? Placeholders match anything: upper-case words (FILE, K in
    toy-backbone-kK), <name>, {name} and * become wildcards."""
    pattern = re.sub(r"<[^>]*>|\{[^}]*\}?|[A-Z]+", "*", path)
    return bool(glob.glob(os.path.join(base, pattern)))


def check_target(base: str, target: str, anchor: str | None) -> str | None:
    """Why `target` (a path, relative to `base`) with an optional `#anchor` / cited heading is broken, or None."""
    if not exists(base, target):
        return f"no such file: {target}"
    path = os.path.join(base, target)
    if anchor is not None and path.endswith(".md") and os.path.isfile(path) and slug(anchor) not in anchors(path):
        return f"{target} has no heading {anchor!r}"
    return None


def line_of(text: str, pos: int) -> int:
    """The 1-based line of `text` that holds position `pos`."""
    return text.count("\n", 0, pos) + 1


def dangling(text: str, folder: str = "", markdown: bool = True) -> list[tuple[int, str]]:
    """(line, what) for each reference in `text` to something the repository lacks; `folder` is the file's folder
    relative to ROOT, `markdown` whether its [text](target) links count."""
    found = [(line_of(text, m.start()), f"outside the repository: {m.group().strip()}")
             for m in OUTSIDE.finditer(text)]
    if markdown:
        found += dangling_links(text, folder)
        text = LINK.sub(lambda m: " " * len(m.group()), text)           # a link's text is checked as its target
    for m in README_CITED.finditer(text):
        if not any(a.startswith(slug(m.group(1))) for a in anchors(os.path.join(ROOT, "README.md"))):
            found.append((line_of(text, m.start()), f"README.md has no heading {m.group(1)!r}"))
    for m in ROOTED.finditer(text):
        path = m.group(1).rstrip(".")                                   # a sentence may end right after a path
        if path.startswith(OUTPUTS):
            continue
        base = os.path.join(ROOT, folder) if path.startswith("../") else ROOT
        cited = CITED.match(text, m.end()) if path.endswith(".md") else None
        if why := check_target(base, path, cited and cited.group(1)):
            found.append((line_of(text, m.start()), why))
    return sorted(found)


def dangling_links(text: str, folder: str) -> list[tuple[int, str]]:
    """The broken [text](target) links: targets relative to the file's folder; web addresses, anchors within the
    file and outputs (runs/, OUT/) are not checked."""
    found = []
    for m in LINK.finditer(text):
        target, _, anchor = m.group(1).partition("#")
        if not target or "://" in target or target.startswith(("mailto:", *OUTPUTS)):
            continue
        if why := check_target(os.path.join(ROOT, folder), target, anchor or None):
            found.append((line_of(text, m.start()), why))
    return found


def test_every_reference_points_inside_the_repository():
    files = text_files()
    assert "docs/design.md" in files and "README.md" in files and ".ci/run" in files, files
    problems = [f"{name}:{n}: {why}" for name in files
                for n, why in dangling(open(os.path.join(ROOT, name), encoding="utf-8").read(),
                                       os.path.dirname(name), markdown=name.endswith(".md"))]
    assert not problems, "references to what a clone of the repository lacks:\n" + "\n".join(problems)


def test_the_reference_check_can_fail():
    fabricated = ("Why: DESIGN.md §3, and [the note](docs/nope.md).\n"
                  "See `tests/test_nope.py`, [a heading](docs/design.md#no-such-heading) and\n"
                  '(docs/design.md, "No such section"); the paper is at ../shared/paper/.\n'
                  'README "The code verifier" says so.\n')
    assert dangling(fabricated) == [
        (1, "no such file: docs/nope.md"), (1, "outside the repository: DESIGN.md"),
        (2, "docs/design.md has no heading 'no-such-heading'"), (2, "no such file: tests/test_nope.py"),
        (3, "docs/design.md has no heading 'No such section'"), (3, "outside the repository: ../shared/"),
        (4, "README.md has no heading 'The code verifier'")]
    # what is not a reference to check: web addresses, anchors, outputs, placeholders, a cluster's shared disk
    fine = ("[web](https://x.org/y.md) [up](#roles-and-memory) [run](runs/toy/results.md) `runs/x/OUT.md`\n"
            "`docs/FILE.md`, `assets/toy-backbone-kK`, tests/fixtures/*.jsonl, --out /shared/runs/q8,\n"
            "`assets/offline/qwen3-tokenizer/` (built by python -m scripts.assets),\n"
            '[design](docs/design.md#correctness-traps), docs/design.md, "Correctness traps".\n'
            'README "Run and test", README\'s "Reading order", README.md, "Status".\n')
    assert dangling(fine) == []


def test_the_adding_a_method_diff_applies_to_the_tree():
    """docs/adding-a-method.md's diff is what a forker applies: it must apply to the files as they are now."""
    import shutil
    import subprocess
    text = open(os.path.join(ROOT, "docs", "adding-a-method.md"), encoding="utf-8").read()
    blocks = re.findall(r"```diff\n(.*?)```", text, re.S)
    assert len(blocks) == 2 and "+def reinforce_step" in blocks[0] and "+def bucket_jsd" in blocks[1]
    if shutil.which("git") is None or not os.path.isdir(os.path.join(ROOT, ".git")):
        import pytest
        pytest.skip("git apply --check needs git and the repository's .git")
    for block in blocks:
        check = subprocess.run(["git", "apply", "--check", "-"], input=block, text=True, cwd=ROOT, capture_output=True)
        assert check.returncode == 0, check.stderr
    files = set(re.findall(r"^diff --git a/(\S+)", blocks[1], re.M)) - {"tests/test_losses.py"}
    assert files == {"losses.py", "lopd.py", "train.py"}                  # the option is three edits, one a file
    broken = blocks[0].replace('\n     "grpo": Method(', '\n     "grpo": Methods(', 1)   # a context line the tree lacks
    assert broken != blocks[0]
    assert subprocess.run(["git", "apply", "--check", "-"], input=broken, text=True, cwd=ROOT,
                          capture_output=True).returncode != 0                      # the check can fail


# ------------------------------------------------------------------------------------------------------------
# The house's plan: the tree shows the architecture (README's file map)
# ------------------------------------------------------------------------------------------------------------
METHOD_FILES = ("engine", "lopd", "losses", "composer", "inject", "retrieval", "baselines")


def project_trees(include_tests: bool = False):
    """(module name, parsed tree) of every project module (and of the tests, if asked)."""
    names = MODULES + ([f"tests.{f[:-3]}" for f in os.listdir(os.path.join(ROOT, "tests")) if f.endswith(".py")]
                       if include_tests else [])
    for m in names:
        yield m, ast.parse(open(os.path.join(ROOT, m.replace(".", os.sep) + ".py"), encoding="utf-8").read())


def test_the_top_holds_the_papers_files_the_shared_ones_and_the_engineering():
    top = sorted(f for f in os.listdir(ROOT) if f.endswith(".py"))
    assert top == ["baselines.py", "composer.py", "engine.py", "eval.py", "inject.py", "lopd.py", "losses.py",
                   "retrieval.py", "train.py"], top
    assert os.path.isfile(os.path.join(ROOT, "runtime", "__init__.py"))      # the engineering: one folder
    assert len(open(os.path.join(ROOT, "train.py"), encoding="utf-8").read().splitlines()) <= 700


def test_no_method_file_imports_a_world():
    """The engine and the method's files know no world (the worlds know the engine); a planted import is found."""
    graph = {m: local_imports(m) for m in MODULES}
    for m in METHOD_FILES:
        assert not {i for i in graph[m] if i.startswith("worlds")}, (m, graph[m])
    planted = ast.parse("def f():\n    from worlds import tool_world\n")
    found = {a.name for n in ast.walk(planted) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert found == {"tool_world"}


def positional_params(fn) -> int:
    bound = bool(fn.args.args) and fn.args.args[0].arg in ("self", "cls")
    return len(fn.args.posonlyargs) + len(fn.args.args) - bound


def test_functions_of_the_method_files_take_at_most_six_positional_parameters():
    """Where a call needs more, it passes a config or keywords (keyword-only parameters do not count)."""
    wide = [f"{m}.{n.name}: {positional_params(n)}" for m, tree in project_trees() if m in METHOD_FILES
            for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and positional_params(n) > 6]
    assert not wide, wide
    assert positional_params(ast.parse("def f(a, b, c, d, e, f, g, *, h): pass").body[0]) == 7   # it can count


def test_eq13_is_built_by_keyword_and_no_private_name_crosses_a_file():
    """Eq13(...) with positional arguments anywhere (tests and docs included) fills a field silently wrong; a private
    name of one project module used in another is a contract nobody wrote down."""
    docs = "\n".join(open(os.path.join(ROOT, "docs", f), encoding="utf-8").read()
                     for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
    assert not re.search(r"Eq13\((?!\*|beta=|\))[^)=]*,", docs)
    bad, crossing = [], []
    for m, tree in project_trees(include_tests=True):
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", "")) == "Eq13" and n.args:
                bad.append(f"{m}:{n.lineno}")
            if m.startswith("tests."):
                continue
            if isinstance(n, ast.ImportFrom) and n.module in MODULES:
                crossing += [f"{m}: from {n.module} import {a.name}" for a in n.names if a.name.startswith("_")]
            if (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in
                    {x.split(".")[-1] for x in MODULES} and n.attr.startswith("_") and not n.attr.startswith("__")):
                crossing.append(f"{m}:{n.lineno}: {n.value.id}.{n.attr}")
    assert not bad, f"Eq13 built positionally: {bad}"
    assert not crossing, crossing


def test_every_column_of_the_results_table_is_defined_in_the_glossary():
    """Issue 62: "full pass" and "1st-step len" were defined nowhere. Each column worlds/results.py prints (Table 3's
    and a code world's) has a row of its own in docs/glossary.md's "The results table"."""
    from worlds import results
    text = open(os.path.join(ROOT, "docs", "glossary.md"), encoding="utf-8").read()
    section = text[text.index("## The results table"):]
    section = section[:section.index("\n## ", 1)]
    defined = {name.strip() for cell in re.findall(r"^\| ([^|]+) \|", section, flags=re.M) for name in cell.split(",")}
    columns = ["row"] + [c for _, c in results.COLUMNS + results.CODE_COLUMNS]
    assert set(columns) <= defined, set(columns) - defined
