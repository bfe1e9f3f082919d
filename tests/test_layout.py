"""Rules of the code's layout that a grep would check, as tests that read the source (in this
process, no imports of it):

- no program in a string: experiments/ composes no multi-step shell or Python program in its
  string constants (what a worker runs is a module of experiments/launcher/worker/; a remote
  command line is a short sequence of calls), and no shell file feeds a program to an interpreter
  through a here-document or a multi-line `-c`;
- exit codes come from runtime/errors.py only: no `sys.exit`/`os._exit`/`SystemExit` of a
  non-zero number, no `exit N` in a string, no command's `main`/`cmd_*` (or what it returns
  through) returning a non-zero number, and no variable, parameter or keyword named `code` or
  `exit_code` given one.

Each check returns its findings, `path:line: what`, for any checkout (`root`).
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[1]
PROGRAM_SCOPE = ("experiments",)  # where remote and local commands are composed
# readmes.py writes documentation: the commands in its strings are printed in a group's README for a
# person to read and type, never run by the code. dashboard.py's `$name`s are GraphQL's variables.
PROGRAM_EXEMPT = ("experiments/readmes.py", "experiments/dashboard.py")
EXIT_SCOPE = ("runtime", "experiments", "models", "data_pipeline", "bench", "pretrain_jax.py")
EXIT_CODES_HOME = "runtime/errors.py"
SHELL_SCOPE = ("setup_tpu.sh", "scripts", "experiments")

# What makes a string a shell program rather than a call: state (variables, assignments, options),
# control flow (conditions, loops, grouped fallbacks, substitutions holding commands) and inline
# input. `$HOME` (paths that expand on the worker), `$?` (passing an exit code on) and a plain
# `$(hostname)` are what a call needs; `${a.b}` is OmegaConf's, not the shell's.
SHELL_PROGRAM = (
    (re.compile(r"\$(?!HOME\b)(?:[A-Za-z_$]|\{[A-Za-z_]\w*(?:[}%#/^,]|:[-=?+]))"), "a shell variable"),
    (re.compile(r"(?:^|[;&|{]\s*)(?:export|local|declare|readonly)\s+[A-Za-z_]\w*="), "a shell variable"),
    (re.compile(r"(?:^|[;&|{]\s*)[A-Za-z_]\w*=[^\s;]*\s*;"), "a shell assignment"),
    (re.compile(r"(?:^|[;&|]\s*)set\s+[-+][a-zA-Z]"), "shell options"),
    (re.compile(r";\s*(?:then|do|done|fi|esac)\b"), "shell control flow"),
    (re.compile(r"\{\s[^{}]*(?:\|\||&&)[^{}]*;\s*\}"), "a shell group holding a condition"),
    (re.compile(r"\$\([^)]*(?:\|\||&&|;|\|)[^)]*\)"), "a command substitution holding several commands"),
    (re.compile(r"<<-?\s*['\"]?[A-Za-z_]\w*"), "a here-document"),
)
# A here-document or a multi-line -c argument given to an interpreter, in a shell file.
SHELL_FILE_PROGRAM = (
    (re.compile(r"(?:python\S*|\bbash|\bsh|\bperl|\bnode)\b[^\n]*<<"), "a here-document for an interpreter"),
    (re.compile(r"\s-c\s+(['\"])(?:(?!\1).)*\n", re.S), "a multi-line -c program"),
)
SHELL_EXIT = re.compile(r"\bexit\s+[1-9]\d*\b")
EXITS = {("sys", "exit"), ("os", "_exit"), (None, "exit"), (None, "quit"), (None, "SystemExit")}
CODE_NAMES = {"code", "exit_code"}  # a variable, parameter or keyword that holds an exit code


@functools.lru_cache(maxsize=None)
def parsed(file: Path) -> tuple[list[ast.AST], dict[str, list[ast.Return]]]:
    """A module's nodes (one walk), and the returns of each function by name (a nested
    function's are its own)."""
    nodes: list[ast.AST] = []
    returns: dict[str, list[ast.Return]] = {}

    def visit(node: ast.AST, function: list[ast.Return] | None) -> None:
        nodes.append(node)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = returns.setdefault(node.name, [])
        elif isinstance(node, ast.Return) and function is not None:
            function.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(file.read_text(), str(file)), None)
    return nodes, returns


def python_files(root: Path, scope: tuple[str, ...]) -> Iterator[Path]:
    for part in scope:
        path = root / part
        for file in [path] if path.is_file() else sorted(path.rglob("*.py")):
            if "tests" not in file.relative_to(root).parts:
                yield file


def _docstrings(nodes: list[ast.AST]) -> set[int]:
    found = set()
    for node in nodes:
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                found.add(id(first.value))
    return found


def strings(nodes: list[ast.AST]) -> Iterator[tuple[int, str]]:
    """(line, text) of every string constant among a module's `nodes` but the docstrings; an
    f-string whole, with a NUL for each value put in (no shell or Python syntax of its own)."""
    skip = _docstrings(nodes)
    for node in nodes:
        if isinstance(node, ast.JoinedStr):
            skip.update(id(v) for v in node.values)
            yield node.lineno, "".join(v.value if isinstance(v, ast.Constant) else "\0" for v in node.values)
    for node in nodes:
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            yield node.lineno, node.value


def python_program(text: str) -> bool:
    """Whether `text` is a Python program of more than one statement (a bare name or constant on
    a line, as prose can parse, does not count)."""
    if "\n" not in text and ";" not in text:
        return False
    try:
        body = ast.parse(text).body
    except (SyntaxError, ValueError):
        return False
    bare = (ast.Name, ast.Constant, ast.Attribute)
    return len(body) > 1 and any(not (isinstance(s, ast.Expr) and isinstance(s.value, bare)) for s in body)


def programs_in_strings(root: Path = REPO) -> list[str]:
    found = []
    for file in python_files(root, PROGRAM_SCOPE):
        if file.relative_to(root).as_posix() in PROGRAM_EXEMPT:
            continue
        for line, text in strings(parsed(file)[0]):
            whats = [what for pattern, what in SHELL_PROGRAM if pattern.search(text)]
            if python_program(text):
                whats.append("a Python program")
            found += [f"{file.relative_to(root)}:{line}: {what}: {text[:80]!r}" for what in dict.fromkeys(whats)]
    for part in SHELL_SCOPE:
        path = root / part
        for file in [path] if path.is_file() else sorted(path.rglob("*.sh")):
            text = file.read_text()
            for pattern, what in SHELL_FILE_PROGRAM:
                for m in pattern.finditer(text):
                    found.append(f"{file.relative_to(root)}:{text.count(chr(10), 0, m.start()) + 1}: {what}")
    return found


def _called(node: ast.Call) -> tuple[str | None, str] | None:
    f = node.func
    if isinstance(f, ast.Name):
        return None, f.id
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
        return f.value.id, f.attr
    return None


def _outcomes(expr: ast.AST | None) -> Iterator[ast.AST]:
    """What `expr` can evaluate to, through `a if c else b` and `a or b`."""
    if isinstance(expr, ast.IfExp):
        yield from (*_outcomes(expr.body), *_outcomes(expr.orelse))
    elif isinstance(expr, ast.BoolOp):
        yield from (o for v in expr.values for o in _outcomes(v))
    elif expr is not None:
        yield expr


def _literal_codes(expr: ast.AST | None) -> list[int]:
    """The non-zero int literals `expr` can evaluate to."""
    return [o.value for o in _outcomes(expr) if isinstance(o, ast.Constant) and type(o.value) is int and o.value]


def _exit_code_functions(nodes: list[ast.AST], returns: dict[str, list[ast.Return]]) -> dict[str, list[ast.Return]]:
    """A module's functions whose return value is an exit code (with their returns): `main`,
    `cmd_*`, what it passes to sys.exit(...), and what those return the result of."""
    todo = [name for name in returns if name == "main" or name.startswith("cmd_")]
    for node in nodes:
        if isinstance(node, ast.Call) and _called(node) in EXITS and node.args and isinstance(node.args[0], ast.Call):
            inner = _called(node.args[0])
            if inner and inner[0] is None and inner[1] in returns:
                todo.append(inner[1])
    chosen: dict[str, list[ast.Return]] = {}
    while todo:
        name = todo.pop()
        if name not in chosen:
            chosen[name] = returns[name]
            todo += [inner[1] for node in chosen[name] for o in _outcomes(node.value) if isinstance(o, ast.Call)
                     and (inner := _called(o)) and inner[0] is None and inner[1] in returns]
    return chosen


def _named_codes(node: ast.AST) -> Iterator[tuple[str, int]]:
    """(name, number) where `node` gives a CODE_NAMES variable, parameter default or keyword a
    non-zero number."""
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            if isinstance(target, ast.Name) and target.id in CODE_NAMES:
                yield from ((target.id, c) for c in _literal_codes(node.value))
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        args = node.args
        positional = [*args.posonlyargs, *args.args]
        pairs = [*zip(positional[len(positional) - len(args.defaults):], args.defaults),
                 *((a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None)]
        for arg, default in pairs:
            if arg.arg in CODE_NAMES:
                yield from ((arg.arg, c) for c in _literal_codes(default))
    elif isinstance(node, ast.Call):
        for keyword in node.keywords:
            if keyword.arg in CODE_NAMES:
                yield from ((keyword.arg, c) for c in _literal_codes(keyword.value))


def exit_code_literals(root: Path = REPO) -> list[str]:
    found = []
    for file in python_files(root, EXIT_SCOPE):
        where = file.relative_to(root)
        if where.as_posix() == EXIT_CODES_HOME:
            continue
        nodes, returns = parsed(file)
        for node in nodes:
            if isinstance(node, ast.Call) and _called(node) in EXITS and node.args:
                found += [f"{where}:{node.lineno}: {ast.unparse(node)}" for _ in _literal_codes(node.args[0])[:1]]
            found += [f"{where}:{node.lineno}: {name} = {value}" for name, value in _named_codes(node)]
        for line, text in strings(nodes):
            found += [f"{where}:{line}: {m.group()!r} in a string" for m in SHELL_EXIT.finditer(text)]
        for name, its_returns in _exit_code_functions(nodes, returns).items():
            found += [f"{where}:{node.lineno}: {name}: {ast.unparse(node)}" for node in its_returns
                      if _literal_codes(node.value)]
    return found


def test_no_program_in_a_string():
    assert programs_in_strings() == []


def test_exit_codes_come_from_runtime_errors_only():
    assert exit_code_literals() == []


def test_the_checks_find_what_they_look_for(tmp_path):
    """Each rule on a line of the kind it forbids (the checks above must not pass by seeing nothing)."""
    shell = ['SHIP=~/x; PACK=~/y', 'trap \'rm -f "$SECRETS"\' EXIT', 'export A=1 B=2', 'set -o pipefail',
             '{ git checkout a 2>/dev/null || git checkout b; } || exit 2', 'commit=$(git rev-parse HEAD || echo unknown)',
             'if [ -d x ]; then rm x; fi', "python - <<'PY'"]
    for text in shell:
        assert any(p.search(text) for p, _ in SHELL_PROGRAM), text
    calls = ['cd "$HOME"/repo || { echo "podrunner: $(hostname): no repo" >&2; exit X; }',
             '. .venv/bin/activate', 'exec python -m experiments.launcher.worker.once --host "$(hostname)" -- python x.py',
             "trap 'rm -f \"$HOME\"/.podrunner-secrets-1' EXIT", "run.name=a", "error: use --run-id; the run ..."]
    for text in calls:
        assert not any(p.search(text) for p, _ in SHELL_PROGRAM), text
    assert python_program("import os\nprint(os.getcwd())") and not python_program("one line\nof prose")
    (tmp_path / "m.py").write_text("import sys\ndef main():\n    return 2 if x else first()\ndef first():\n    return 1\n"
                                   "def helper():\n    return 3\ndef run():\n    return 0\nsys.exit(run())\n")
    nodes, returns = parsed(tmp_path / "m.py")
    assert sorted(_exit_code_functions(nodes, returns)) == ["first", "main", "run"]
    assert [c for n in nodes if isinstance(n, ast.Return) for c in _literal_codes(n.value)] == [2, 1, 3]
    assert SHELL_EXIT.search("{ echo no; exit 2; }") and not SHELL_EXIT.search("exit 0; exit $?")
    named = ast.parse("def fail(message, code: int = 2): pass\ncode = 1 if left else 0\nrecord(exit_code=3)\nrc = 4")
    assert sorted(c for n in ast.walk(named) for _, c in _named_codes(n)) == [1, 2, 3]
