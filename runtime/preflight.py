"""The command line, checked before torch loads: engineering, skip it on a first read.

    python train.py --method lopdd       # train.py: error: --method must be one of lopd, ... (did you mean 'lopd'?)
    python -m pytest tests/test_flags.py -q

train.py and eval.py import this file before torch. When one of them is the script being run (`python train.py`,
`torchrun train.py`, `python eval.py`), the import checks sys.argv against that script's flags, and a mistake ends
the process at once with one line and exit status 2, instead of after the seconds that loading torch and the
project take. Imported by anything else (the tests, scripts/, eval.py's own `import train`) it checks nothing, and
the scripts check everything again after their imports, with the same functions: `train.main(argv)` called from
Python prints the same line.

One list of flags: train.py's `Args` (with CHOICES, POSITIVE and NON_NEGATIVE) and the `add_argument` calls of
eval.py's `main` are read here from their source with `ast`, a name such as `lopd.LOPDConfig.margin` followed into
the file that assigns it (`value_of`); nothing is copied, and train.py's parser is built by the same `parser_of`.
Checked here: unknown flags (the closest one named), ints and floats, the choices and the positive settings, --env
(a registered world, or a FILE.py that is there and binds CLASS; left out, `default_world`'s), the paths that must
exist (--model where it is a folder, --chat-template, --tasks of a shipped world, eval.py's --run and --tasks files),
each with the closest name in the same folder, and eval.py's BFCL-v3 categories (the closest named). Left to the
scripts: whatever needs a world's code, a model or torch (a user's FILE.py world is parsed here, never run, nor a hub
id looked up), and any value that the source alone does not give (`Unknown`).

Also here, because they import no torch: the settings' pieces that train.py and eval.py build their command lines
from (`default_world`, the world a run takes when --env is left out; `arg`, `OneLineParser`, `did_you_mean`,
`parser_of`, `parse_with_preset`, `check_values`).
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))     # the project: runtime/ is one folder in it


# ----------------------------------------------------------------------------------------------------------------
# Settings: a dataclass of fields made flags (train.Args), their values checked
# ----------------------------------------------------------------------------------------------------------------
def arg(default, help: str):
    """A settings field: its default, and its --help text (`parser_of` reads it from the field's metadata)."""
    return dataclasses.field(default=default, metadata={"help": help})


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag or value is answered in one line (what was wrong, and where the flags are listed),
    not after the whole usage: train.py has some seventy flags, and the line that matters came last."""

    def error(self, message):
        if message.startswith("unrecognized arguments: "):         # a misspelt flag: name the closest
            flags = [f for f in message.split(": ", 1)[1].split() if f.startswith("--")]
            message += "".join(did_you_mean(f.split("=")[0], self._option_string_actions) for f in flags[:1])
        self.exit(2, f"{self.prog}: error: {message} (--help lists every flag)\n")


def did_you_mean(value, allowed) -> str:
    """' (did you mean 'grpo'?)' for a close misspelling of one of `allowed`, else ''."""
    close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def parser_of(cls, description: str, notes: dict | None = None, add_help: bool = True) -> argparse.ArgumentParser:
    """An argparse parser with a flag per field of the dataclass `cls` (--field-name, its metadata's help, `notes`
    appended by name): bool fields are switches (--x), those that default to True --x / --no-x, and `bool | None`
    ones --x / --no-x (None: decided later)."""
    p = OneLineParser(description=description, add_help=add_help)
    for f in dataclasses.fields(cls):
        flag, doc = "--" + f.name.replace("_", "-"), f.metadata["help"]
        doc += f" ({notes[f.name]})" if notes and f.name in notes else ""
        if f.type in ("bool", bool) and f.default is not True:
            p.add_argument(flag, action="store_true", help=doc)
        elif f.type in ("bool", bool, "bool | None"):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=doc)
        else:
            typ = {"int": int, "float": float, "str": str}[str(f.type)]
            p.add_argument(flag, type=typ, default=f.default, help=doc + f" (default: {f.default})")
    return p


def parse_with_preset(p, argv, preset: dict, switch: str) -> dict:
    """p's values by field; where the switch (--quick) is on, `preset` fills each of its fields that the command
    line did not give (a flag given beside it wins, even at its default value)."""
    defaults = {k: p.get_default(k) for k in preset}
    p.set_defaults(**dict.fromkeys(preset))                  # None: the command line did not give it
    given = vars(p.parse_args(argv))
    given.update({k: preset[k] if given[switch] else defaults[k] for k in preset if given[k] is None})
    return given


def check_values(p, args, choices: dict, positive=(), non_negative=()):
    """A one-line error (exit 2) for a field outside its `choices` (with a close match, if any), or not positive /
    below 0."""
    for name, allowed in choices.items():
        if getattr(args, name) not in allowed:
            p.error(f"--{name.replace('_', '-')} must be one of {', '.join(map(str, allowed))}, not "
                    f"{getattr(args, name)!r}{did_you_mean(getattr(args, name), allowed)}")
    for name in tuple(positive) + tuple(non_negative):
        if getattr(args, name) is not None and getattr(args, name) < (name in positive):
            p.error(f"--{name.replace('_', '-')} must be {'positive' if name in positive else 'at least 0'}, "
                    f"got {getattr(args, name)}")


# ----------------------------------------------------------------------------------------------------------------
# The checks that need no world, model or torch: train.py's `_check`, eval.py's `main` and the early check call them
# ----------------------------------------------------------------------------------------------------------------
def close_path(path: str) -> str:
    """' (did you mean 'runs/toy'?)' for a path that is not there where a close name with its extension is, in the
    same folder."""
    folder, name = os.path.split(path.rstrip(os.sep))
    if os.path.exists(path) or not name or not os.path.isdir(folder or "."):
        return ""
    stem, ext = os.path.splitext(name)
    names = {os.path.splitext(n)[0]: n for n in os.listdir(folder or ".") if os.path.splitext(n)[1] == ext}
    close = difflib.get_close_matches(stem, list(names), n=1, cutoff=0.6)
    return f" (did you mean {os.path.join(folder, names[close[0]])!r}?)" if close else ""


def check_paths(p, a, task_files=None):
    """train.py's paths that must be there: --model where it is not a hub id (org/name), --chat-template, and
    --tasks DIR holding the world's `task_files` (None: not known here). argparse's one line (exit 2) otherwise."""
    if a.model and not os.path.isdir(a.model) and (a.model.startswith((".", "/")) or a.model.count("/") != 1):
        p.error(f"--model {a.model!r}: no such folder, and not a hub id of the form org/name{close_path(a.model)}")
    if a.chat_template and not os.path.isfile(a.chat_template):
        p.error(f"--chat-template {a.chat_template!r}: no such file (give a Jinja chat-template file)"
                f"{close_path(a.chat_template)}")
    if a.tasks and task_files and not all(os.path.isfile(os.path.join(a.tasks, f)) for f in task_files):
        p.error(f"--tasks {a.tasks!r}: expected a folder holding {' and '.join(task_files)}{close_path(a.tasks)}")


TOY_MARKER = "toy_backbone.json"      # what worlds/toy_backbone.py writes into a toy backbone's folder


def is_toy_model(model: str) -> bool:
    """The toy backbone: no --model, or a folder that worlds/toy_backbone.py wrote (it holds TOY_MARKER)."""
    return not model or os.path.isfile(os.path.join(model, TOY_MARKER))


def default_world(model: str, env: str, tasks: str) -> tuple[str, str]:
    """--env and --tasks where the command line leaves them empty, the one rule train.py, eval.py and the early
    check read: the toy backbone trains on the toy tool world (tools, its generated tasks); any other backbone on
    the paper's experiment, EnvScaler (B.2-B.3), whose data is --tasks DIR or else the Hub's datasets (hf:
    huggingface_hub's cache first, fetched when online)."""
    env = env or ("tools" if is_toy_model(model) else "envscaler")
    return env, tasks or ("hf" if env == "envscaler" else "")


def expected_worlds(envs) -> str:
    return f"expected {' or '.join(envs)}, or FILE.py:CLASS naming a subclass of worlds.common.Environment"


def env_error(spec: str, envs: dict) -> str | None:
    """--env's value against `envs` (worlds/common.ENVS): the one-line error for a name that is not registered (the
    closest named), a FILE.py that is not there, or a CLASS that its source binds nowhere (the closest of its classes
    named; the file is parsed, not run), else None (worlds/common.environment_class imports the rest)."""
    where, _, name = envs.get(spec, spec).rpartition(":")
    if not where or not name:
        close = difflib.get_close_matches(spec, list(envs), n=1, cutoff=0.6)
        return f"--env {spec!r}: " + (f"did you mean {close[0]!r}? " if close else "") + expected_worlds(envs)
    if where.endswith(".py") and not os.path.isfile(where):
        return f"--env {spec!r}: no such file {where!r}{close_path(where)}; {expected_worlds(envs)}"
    path = where if where.endswith(".py") else os.path.join(ROOT, *where.split(".")) + ".py"
    bound = names_bound(path) if os.path.isfile(path) else None
    if bound is not None and name not in bound[0]:
        return (f"--env {spec!r}: {where} has no class {name!r}{did_you_mean(name, bound[1])}; expected one of its "
                f"classes ({', '.join(bound[1]) or 'none'}) that subclasses worlds.common.Environment")
    return None


def names_bound(path: str) -> tuple[set, list] | None:
    """(every name the file's source binds anywhere, its classes) without running it; None where the source cannot
    say (it does not parse, or it imports *): the import then decides."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return None
    names, classes = set(), []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(a.name == "*" for a in node.names):
                return None
            names.update(a.asname or a.name.split(".")[0] for a in node.names)
        elif isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
            classes += [node.name] if isinstance(node, ast.ClassDef) else []
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names, classes


def bfcl_error(spec: str) -> str | None:
    """--tasks bfcl-v3:CAT[,CAT] against the categories worlds/bfcl.py lists (read from its source: nothing of BFCL
    loads): the one-line error for a category that is not one (the closest named), else None."""
    name, _, cats = spec.partition(":")
    if name != "bfcl-v3" or cats in ("", "single"):
        return None
    known = value_of(ast.Name("CATEGORIES"), "worlds.bfcl") + value_of(ast.Name("SINGLE_TURN"), "worlds.bfcl")
    unknown = [c for c in cats.split(",") if c not in known]
    if not unknown:
        return None
    return (f"--tasks {spec}: no BFCL-v3 category {unknown[0]!r}{did_you_mean(unknown[0], known)}; expected one of "
            f"{', '.join(known)}, or single")


def check_eval(p, a, rest: list, names: tuple, prefixes: tuple):
    """eval.py's command line, before any run is read: train.py's flags (`rest`) only after --model, the counts, the
    --tasks files (those starting with `prefixes` name benchmarks, `names` are suggested) and BFCL's categories, a
    run or a model with tasks, the run's args.json. argparse's one line (exit 2) on a mistake."""
    if rest and not a.model:
        p.error(f"unrecognized arguments: {' '.join(rest)}")        # as parse_args says it: the closest flag named
    if a.n_test < 0 or (a.temperature is not None and a.temperature < 0):
        p.error(f"--n-test and --temperature must be at least 0, not {a.n_test} and {a.temperature}")
    missing = [f for f in a.tasks or () if not f.startswith(prefixes) and not os.path.isfile(f)]
    if missing:
        hint = did_you_mean(missing[0], names) or close_path(missing[0])          # bfcl-v4 -> bfcl-v3
        p.error(f"--tasks: no such file {missing[0]!r}{hint}; give JSONL benchmark files, bfcl-v3, envscaler=DIR "
                "or acebench=PATH")
    if problem := next(filter(None, map(bfcl_error, a.tasks or ())), None):      # bfcl-v3:basee -> base
        p.error(problem)
    if bool(a.run) == bool(a.model) or (a.model and not a.tasks):
        p.error("give --run DIR (a run of train.py), or --model ID_OR_FOLDER with --tasks (the model as released)")
    if a.run and not os.path.isfile(os.path.join(a.run, "args.json")):
        p.error(f"--run {a.run!r}: no args.json there; is it a folder written by train.py?{close_path(a.run)}")


# ----------------------------------------------------------------------------------------------------------------
# The scripts' flags and constants, read from their source
# ----------------------------------------------------------------------------------------------------------------
class Unknown(Exception):
    """A value that the source alone does not give (a call, an object, a name from outside the project): the check
    that needs it is left to the script."""


@functools.lru_cache(maxsize=None)
def source(module: str) -> ast.Module:
    """The parsed file of a project module ("lopd", "worlds.common")."""
    with open(os.path.join(ROOT, *module.split(".")) + ".py", encoding="utf-8") as f:
        return ast.parse(f.read())


def is_module(name: str) -> bool:
    return bool(name) and os.path.isfile(os.path.join(ROOT, *name.split(".")) + ".py")


def assigned(body: list, name: str):
    """What the last statement of `body` binding `name` gives it: an assignment's expression (`X = ...`,
    `x: int = ...`, `A, B = a, b`) or a class; None where none does."""
    found = None
    for node in body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            found = node
        elif isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == name and node.value:
            found = node.value
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if getattr(target, "id", None) == name:
                    found = node.value
                elif isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    found = next((v for t, v in zip(target.elts, node.value.elts) if getattr(t, "id", None) == name),
                                 found)
    return found


@functools.lru_cache(maxsize=None)
def imports(module: str) -> dict:
    """Name -> what the top-level imports of `module` bind it to: a module ("worlds.tool_world") or a name in one
    ("composer.Composer")."""
    out = {}
    for node in source(module).body:
        if isinstance(node, ast.Import):
            out.update({a.asname or a.name.split(".")[0]: a.name if a.asname else a.name.split(".")[0]
                        for a in node.names})
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
    return out


def find(expr, module: str):
    """-> (the node that a name or dotted name of `module`'s source refers to, the module it is in); a project
    module is (None, its name). Unknown for what no project file defines."""
    if isinstance(expr, ast.Name):
        node = assigned(source(module).body, expr.id)
        if node is not None:
            return node, module
        target = imports(module).get(expr.id, "")
        if is_module(target):
            return None, target
        owner, _, name = target.rpartition(".")
        if is_module(owner):
            return find(ast.Name(name), owner)
    elif isinstance(expr, ast.Attribute):
        node, where = find(expr.value, module)
        if node is None:
            return find(ast.Name(expr.attr), where)
        if isinstance(node, ast.ClassDef):
            return member(node, where, expr.attr)
    raise Unknown(ast.unparse(expr))


def member(cls: ast.ClassDef, module: str, name: str):
    """A class attribute's node and module: the class's own assignment, else the first of its bases' that has one."""
    node = assigned(cls.body, name)
    if node is not None:
        return node, module
    for base in cls.bases:
        try:
            found, where = find(base, module)
            if isinstance(found, ast.ClassDef):
                return member(found, where, name)
        except Unknown:
            continue
    raise Unknown(f"{cls.name}.{name}")


def value_of(expr, module: str):
    """What an expression of `module`'s source evaluates to, where the source says: a literal, a name or dotted name
    assigned one (a class's field too: `lopd.LOPDConfig.margin`), `tuple(x)`, a dict (`{"lopd": ..., **METHODS}`;
    a value the source does not give is None there, the keys are what a choice needs). Unknown otherwise."""
    if isinstance(expr, (ast.Name, ast.Attribute)):
        node, where = find(expr, module)
        if node is None or isinstance(node, ast.ClassDef):
            raise Unknown(ast.unparse(expr))
        return value_of(node, where)
    if isinstance(expr, ast.Call) and getattr(expr.func, "id", None) == "tuple" and len(expr.args) == 1:
        return tuple(value_of(expr.args[0], module))
    if isinstance(expr, ast.Dict):
        out = {}
        for key, value in zip(expr.keys, expr.values):
            if key is None:                                     # {**other}
                out.update(value_of(value, module))
            else:
                out[value_of(key, module)] = known(value, module)
        return out
    if isinstance(expr, (ast.Tuple, ast.List)):
        items = [value_of(e, module) for e in expr.elts]
        return tuple(items) if isinstance(expr, ast.Tuple) else items
    try:
        return ast.literal_eval(expr)
    except (ValueError, TypeError, SyntaxError):
        raise Unknown(ast.unparse(expr)) from None


def known(expr, module: str, default=None):
    try:
        return value_of(expr, module)
    except Unknown:
        return default


@functools.lru_cache(maxsize=None)
def train_args() -> type:
    """train.Args rebuilt from train.py's source: each field's name, type as written, default and help (a default
    the source does not give is None: only the help shows defaults, and this parser prints none)."""
    cls, fields = assigned(source("train").body, "Args"), []
    if not isinstance(cls, ast.ClassDef):
        raise Unknown("train.Args")
    for node in cls.body:
        if isinstance(node, ast.AnnAssign):
            call = node.value                                   # arg(default, help)
            if not (isinstance(call, ast.Call) and len(call.args) == 2):
                raise Unknown(f"Args.{node.target.id}")
            fields.append((node.target.id, ast.unparse(node.annotation),
                           arg(known(call.args[0], "train"), value_of(call.args[1], "train"))))
    return dataclasses.make_dataclass("Args", fields)


def registered_worlds() -> dict:
    return value_of(ast.Name("ENVS"), "worlds.common")


def task_files(spec: str):
    """What --tasks DIR must hold for a registered world: its class's `task_files`; None for any other --env."""
    module, _, name = registered_worlds().get(spec, "").partition(":")
    if not is_module(module):
        return None
    try:
        cls, where = find(ast.Name(name), module)
        return value_of(*member(cls, where, "task_files")) if isinstance(cls, ast.ClassDef) else None
    except Unknown:
        return None


TYPES = {"int": int, "float": float, "str": str}      # the type= of eval.py's flags


def eval_parser() -> OneLineParser:
    """eval.py's parser, rebuilt from the `p.add_argument(...)` statements of its `main` (literal arguments, a
    builtin type=); its -h only noted, for eval.py to print the help."""
    main = next((n for n in source("eval").body if isinstance(n, ast.FunctionDef) and n.name == "main"), None)
    if main is None:
        raise Unknown("eval.main")
    calls = [n.value for n in main.body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)
             and getattr(n.value.func, "attr", None) == "add_argument"]
    p = OneLineParser(add_help=False)
    p.add_argument("-h", "--help", action="store_true")
    for call in calls:
        if any(k.arg == "type" and getattr(k.value, "id", None) not in TYPES for k in call.keywords):
            raise Unknown(ast.unparse(call))
        p.add_argument(*(value_of(x, "eval") for x in call.args),
                       **{k.arg: TYPES[k.value.id] if k.arg == "type" else value_of(k.value, "eval")
                          for k in call.keywords})
    return p


# ----------------------------------------------------------------------------------------------------------------
# The early check: train.py's or eval.py's command line, when it is the script being run
# ----------------------------------------------------------------------------------------------------------------
def check_train(argv: list):
    """train.py's command line from its source: argparse's parsing (unknown flags, ints, floats), --env, the given
    settings of CHOICES, POSITIVE and NON_NEGATIVE, the paths (`check_paths`). One line and exit 2 on a mistake."""
    cls = train_args()
    p = parser_of(cls, "", add_help=False)
    p.add_argument("-h", "--help", action="store_true")      # train.py prints the help, with its notes
    given = vars(p.parse_args(argv))
    if given.pop("help"):
        return
    a = cls(**given)
    a.env, a.tasks = default_world(a.model, a.env, a.tasks)
    if problem := env_error(a.env, registered_worlds()):
        print(f"error: {problem}", file=sys.stderr)          # as devices.one_line_errors prints train.py's
        raise SystemExit(2)
    const = functools.partial(value_of, module="train")
    choices = {k: v for k, v in const(ast.Name("CHOICES")).items() if v is not None and getattr(a, k) is not None}
    check_values(p, a, choices, const(ast.Name("POSITIVE")), const(ast.Name("NON_NEGATIVE")))
    check_paths(p, a, task_files(a.env))


def check_eval_command(argv: list):
    """eval.py's command line from its source (`check_eval`), and with --model train.py's flags after it."""
    p = eval_parser()
    a, rest = p.parse_known_args(argv)
    if a.help:
        return
    const = functools.partial(value_of, module="eval")
    check_eval(p, a, rest, const(ast.Name("BENCHMARK_NAMES")), const(ast.Name("TOOL_USE")))
    if a.model:
        check_train(["--model", a.model, *rest])


def check_script():
    """The command line of train.py or eval.py where that is the script being run (the module __main__); what the
    source does not give (Unknown) is left to the script, which checks everything again."""
    script = os.path.realpath(getattr(sys.modules.get("__main__"), "__file__", None) or os.devnull)
    checks = {os.path.join(ROOT, "train.py"): check_train, os.path.join(ROOT, "eval.py"): check_eval_command}
    if script in checks:
        try:
            checks[script](sys.argv[1:])
        except Unknown:
            pass


check_script()
