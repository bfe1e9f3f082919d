"""Ranges of numbers and shapes of names, in the form every tool's table uses.

A range rule is ((test, bound), meaning): `test(value)` says whether a value is in range,
`bound` says the range in words (">= 1", "in [0, 1)"), `meaning` what the boundary value
means ("0 = only at the end"). The Hydra schema's table is runtime/config.py `_RULES`; each
command-line tool keeps its own table of its options (experiments/launch.py, the data
builders, runtime/export.py, experiments/examples.py) and checks it with `check_args` right after
parsing, so a nonsense number (an infinite float included) is one line rather than a hang, a
crash or a silently odd result.

An option that takes a path or a name and was given the empty string (`--out ''`: the working
directory) is refused by `check_given`, as the schema's settings are (runtime/config.py `_NOT_EMPTY`).

Names that become one component of a path (run.group, run.name, a split's folder; a programme's
name, its slices and variants in experiments/launch.py) are checked by `name_problem`, and
`name_error` says it in the one line every tool uses: a bad one would write outside its root,
beside another run, past what a folder name can hold, or break a gs:// URL or a shell command line.
"""

from __future__ import annotations

import argparse
import math
import re
from typing import Any, Callable, Mapping

INT32_MAX = 2**31 - 1  # step counters and cadences are int32 on the device

Bound = tuple[Callable[[Any], bool], str]
Rule = tuple[Bound, str]


def at_least(low: float, *, at_most: float | None = None) -> Bound:
    if at_most is None:
        return (lambda v: v >= low), f">= {low}"
    return (lambda v: low <= v <= at_most), f">= {low} and <= {at_most}"


def above(low: float, *, at_most: float | None = None) -> Bound:
    if at_most is None:
        return (lambda v: v > low), f"> {low}"
    return (lambda v: low < v <= at_most), f"> {low} and <= {at_most}"


def within(low: float, high: float, *, high_open: bool = False) -> Bound:
    return (lambda v: low <= v < high if high_open else low <= v <= high), f"in [{low}, {high}{')' if high_open else ']'}"


def range_problem(value: Any, rule: Rule) -> str | None:
    """"it must be >= 1 (what the boundary means)" when `value` is outside `rule`; None inside."""
    (ok, bound), meaning = rule
    if ok(value):
        return None
    return f"it must be {bound}{' (' + meaning + ')' if meaning else ''}"


def check_args(args: argparse.Namespace, rules: Mapping[str, Rule], error: type[Exception]) -> None:
    """Every option of `rules` ("--jobs") that `args` holds a value for (None: not given, fine)
    within its range; else `error` with one line naming the option."""
    for option, rule in rules.items():
        value = getattr(args, option.lstrip("-").replace("-", "_"), None)
        if value is None:
            continue
        # nan fails every bound; inf passes an open one, and no tool can wait or count that long
        infinite = isinstance(value, float) and math.isinf(value)
        problem = "it must be a finite number" if infinite else range_problem(value, rule)
        if problem:
            raise error(f"{option} {value:g} is out of range: {problem}" if isinstance(value, float)
                        else f"{option} {value} is out of range: {problem}")


def check_given(args: argparse.Namespace, options: tuple[str, ...], error: type[Exception]) -> None:
    """Each of `options` ("--out") that takes a path or a name and was given is not the empty string
    (or blank), which names nothing: as a path, the working directory; else `error` in one line."""
    for option in options:
        value = getattr(args, option.lstrip("-").replace("-", "_"), None)
        if isinstance(value, str) and not value.strip():
            raise error(f"{option} {value!r} is empty, which names nothing; give what it names, or leave {option} out "
                        "where it has a default")


# One path component: letters, digits and _ . = , + - (what a sweep job's name is made of), not
# starting with '-' (an option to a shell command) and not '.' or '..'.
NAME = re.compile(r"[A-Za-z0-9_.=,+][A-Za-z0-9_.=,+-]*")
MAX_NAME = 255  # bytes in one folder name on common file systems (NAME_MAX); NAME's characters are one byte each


def name_problem(value: str) -> str | None:
    """What makes `value` unusable as one path component (empty, '/', '..', other characters, too
    long), or None."""
    if not value:
        return "it is empty"
    if "/" in value or value in (".", ".."):
        return "it must be one folder name, without '/' and not '.' or '..'"
    if not NAME.fullmatch(value):
        return ("it may hold only letters, digits and _ . = , + - (not first), so that it stays one folder under "
                "its root and works in gs:// URLs and shell commands")
    if len(value) > MAX_NAME:
        return f"it is {len(value)} characters long, and a folder name holds at most {MAX_NAME}"
    return None


def name_error(what: str, value: str) -> str | None:
    """"<what>='<value>' cannot name a folder: <why>; choose another <what>" when `value` is no safe
    folder name (name_problem), else None (a long value is shown shortened)."""
    problem = name_problem(value)
    if problem is None:
        return None
    shown = value if len(value) <= 60 else value[:40] + "..."
    return f"{what}={shown!r} cannot name a folder: {problem}; choose another {what}"
