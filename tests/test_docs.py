"""The reader's guide stays true to the code: README's reading-order table names only functions that exist, the
README stays a front page, and no two files of the project import each other (directly or around a circle).

Run: python -m pytest tests/test_docs.py -q      (about a second; docs/walkthrough.md runs as its own doctest file)
"""
import ast
import importlib
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = sorted(f[:-3] for f in os.listdir(ROOT) if f.endswith(".py"))


def readme() -> str:
    return open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()


def reading_order_names() -> list[str]:
    """Every `file.py:name` in README's reading-order section."""
    text = readme()
    section = text[text.index("## Reading order"):]
    section = section[:section.index("\n## ", 1)]
    return re.findall(r"`(\w+)\.py:([\w.]+)`", section)


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
                out.append(f"{module}.py:{path}")
                break
    return out


def test_every_name_in_the_reading_order_exists():
    names = reading_order_names()
    assert len(names) >= 40, "the table lost its rows"
    assert not missing(names), f"README names what the code does not have: {missing(names)}"
    # the check can fail: a name that is not in the code, or a method that its class does not have
    assert missing([("losses", "no_such_loss"), ("composer", "Composer.no_such_method")]) == [
        "losses.py:no_such_loss", "composer.py:Composer.no_such_method"]


def local_imports(module: str) -> set[str]:
    """The project's own modules that `module` imports anywhere (top level or inside a function)."""
    tree = ast.parse(open(os.path.join(ROOT, module + ".py"), encoding="utf-8").read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return (found & set(MODULES)) - {module}


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


def test_no_import_circle():
    graph = {m: local_imports(m) for m in MODULES}
    assert "train" in graph["eval"] and "eval" not in graph["train"]     # eval.py loads runs through train.py
    assert find_cycle(graph) is None, f"import circle: {' -> '.join(find_cycle(graph))}"
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]   # the search can find one
