"""The marker a dataset builder leaves in the folder it builds, and where a build may write.

Every builder (build_sudoku, build_maze, build_arc, build_sft) first `claim`s its output folder:
it builds only into a folder that does not exist, is empty, or holds its own marker (an earlier
build of the same builder, finished or interrupted). Any other folder is someone's data: the
build is refused with one line and nothing in it is touched. The marker, `.podrunner-generated`
(JSON: builder, parameters, started, finished), also says how the set was made: an earlier build
made with other parameters (finished, or its dataset.json gone) is rebuilt only when asked
(`--rebuild`; a run's data.regenerate=true), else refused with one line naming the first that
differs.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Mapping, Sequence

import fsspec

from data_pipeline.puzzle_format import DatasetError
from runtime.atomic import write_whole
from runtime.errors import UserError

MARKER = ".podrunner-generated"
# A run that builds its set (data.generate_if_missing) at a path that does not exist says so: the
# set follows from data.generate_*, so a misspelt data.path costs a build, never other data.
ABSENT = "does not exist"


def build_note(reason: str) -> str:
    """What a run adds to its "building at data.path" log line."""
    return "; if you meant an existing dataset, fix data.path" if reason == ABSENT else ""


def _fs(root: str):
    fs, base = fsspec.core.url_to_fs(str(root))
    return fs, base.rstrip("/")


def read_marker(root: str) -> dict[str, Any] | None:
    """The marker of `root` (None when there is none or it does not parse)."""
    fs, base = _fs(root)
    try:
        with fs.open(f"{base}/{MARKER}", "r") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def build_target(root: str, builder: str, missing: str | None = None, inputs: Sequence[str | None] = (),
                 wanted: Mapping[str, tuple[Any, str]] | None = None, rebuild: bool = False) -> str:
    """Why `builder` may write into `root` ("does not exist", "is empty", "holds an earlier build
    of <builder>"), or a DatasetError naming the folder and the fix. `missing`: what a run found
    lacking there (e.g. "train/dataset.json"), for its message; `inputs`: the build's own source
    files, which may sit in `root` (an SFT set's JSONL and tokenizer). `wanted` (a builder's
    parameters, each with its option, as `generated_difference` takes them): an earlier build of
    `builder` made with other parameters is refused unless `rebuild`."""
    fs, base = _fs(root)
    if not fs.exists(base):
        if "://" not in str(root) and os.path.lexists(base):  # a link that leads nowhere: makedirs would fail late
            raise DatasetError(f"{root} is a symbolic link that leads nowhere (a loop, or its target is missing); "
                               "point the path at a real folder, or fix the link")
        return ABSENT
    if not fs.isdir(base):
        raise DatasetError(f"{root} is a file, not a dataset folder; choose another path for the dataset")
    entries = sorted(set(_names(fs, base)) - _own(base, inputs))
    if not entries:
        return "is empty"
    marker = read_marker(root)
    if marker is not None and marker.get("builder") == builder:
        difference = None if wanted is None or rebuild else generated_difference(root, builder, wanted)
        if difference:
            raise DatasetError(f"--output-dir {root} holds a set {builder} built with other options: {difference}; "
                               f"build with the options in its {MARKER}, choose a new --output-dir, or add --rebuild "
                               "to replace that set")
        state = "a finished" if marker.get("finished") else "an unfinished"
        return f"holds {state} build of {builder} ({MARKER})"
    owner = f"a {marker.get('builder')} build, not {builder}" if marker else f"no {MARKER} marker"
    shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
    if missing:
        raise DatasetError(f"{root} is not a complete dataset ({missing} is missing) and holds {owner} ({shown}), so "
                           "nothing is written there; point data.path at the dataset's folder, or at a new path to "
                           "build a fresh set there")
    raise DatasetError(f"{root} already holds files ({shown}) and {owner}, so nothing is written there; choose a new "
                       "output folder, or empty this one first")


def _names(fs, base: str) -> list[str]:
    return [str(p).rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(base, detail=False)]


def _own(base: str, inputs: Sequence[str | None]) -> set[str]:
    """The names of the build's own source files that sit in `base`."""
    return {os.path.basename(str(p)) for p in inputs
            if p and os.path.dirname(os.path.abspath(str(p))) == os.path.abspath(base)}


def run_build_target(root: str, builder: str, missing: str) -> str:
    """`build_target` for a run (data.generate_if_missing): a UserError (exit 2) when `root` is a
    folder a build must not write into."""
    try:
        return build_target(root, builder, missing)
    except DatasetError as e:
        raise UserError(str(e)) from e


def generated_difference(root: str, builder: str, wanted: Mapping[str, tuple[Any, str]]) -> str | None:
    """How the set `builder` generated at `root` (its marker) differs from the one a run asks for,
    in words ("generate=60 there, 2200 here (data.generate_puzzles + data.generate_test_puzzles)");
    None when it does not (or `root` holds no marker of `builder`: nothing to compare with).
    `wanted`: parameter -> (the run's value, the setting it comes from). A parameter an older
    marker does not record is not compared."""
    marker = read_marker(root)
    if marker is None or marker.get("builder") != builder:
        return None
    recorded = marker.get("parameters") or {}
    for key, (value, setting) in wanted.items():
        if key in recorded and recorded[key] != _plain(value):
            return f"{key}={recorded[key]!r} there, {_plain(value)!r} here ({setting})"
    return None


def check_generated(root: str, builder: str, wanted: Mapping[str, tuple[Any, str]], regenerate: bool) -> bool:
    """For a run with data.generate_if_missing: whether the generated set at `root` must be built
    again because its marker's parameters differ from the run's (data.regenerate=true), else a
    UserError naming the first parameter that differs; False when they agree."""
    difference = generated_difference(root, builder, wanted)
    if difference is None:
        return False
    if not regenerate:
        raise UserError(f"data.path={root} holds a set {builder} generated with other parameters: {difference}; "
                        "point data.path at a new folder for this set, set the data.generate_* values of the set "
                        "there, or data.regenerate=true to replace it with a new build")
    return True


def remove_generated(root: str, builder: str) -> None:
    """Delete the set `builder` generated at `root` (its marker says so), before building it again."""
    marker = read_marker(root)
    if marker is None or marker.get("builder") != builder:
        raise DatasetError(f"{root} holds no {MARKER} marker of {builder}, so nothing there is deleted")
    fs, base = _fs(root)
    fs.rm(base, recursive=True)


def claim(root: str, builder: str, wanted: Mapping[str, tuple[Any, str]], inputs: Sequence[str | None] = (),
          rebuild: bool = False) -> str:
    """Check `root` may be built into (`build_target`), then write the marker (unfinished) with
    the parameters of `wanted` (parameter -> (value, option)). With `rebuild`, an earlier build of
    `builder` there is deleted first (but the build's `inputs`): nothing of it stays beside the
    new one. Returns the reason the folder could be used."""
    reason = build_target(root, builder, inputs=inputs, wanted=wanted, rebuild=rebuild)
    fs, base = _fs(root)
    if rebuild and reason.startswith("holds"):
        for name in set(_names(fs, base)) - _own(base, inputs):
            fs.rm(f"{base}/{name}", recursive=True)
    fs.makedirs(base, exist_ok=True)
    _write(root, {"builder": builder, "parameters": {k: _plain(v) for k, (v, _) in wanted.items()},
                  "started": _now(), "finished": None})
    return reason


def finish(root: str) -> None:
    """Mark the build in `root` finished (after its last file is written)."""
    marker = read_marker(root) or {}
    _write(root, dict(marker, finished=_now()))


def _write(root: str, marker: dict) -> None:
    """Whole or not at all: a marker cut short (a build that filled its disk) would make the
    folder no longer the builder's, and the same build again refused."""
    write_whole(f"{str(root).rstrip('/')}/{MARKER}", json.dumps(marker, indent=1))


def _plain(value: Any) -> Any:
    return value if value is None or isinstance(value, (bool, int, float, str, list)) else str(value)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def rebuild_hint(root: str) -> str:
    """How to rebuild the set at `root`: from its marker when it has one."""
    marker = read_marker(root)
    if marker is None:
        return ("rebuild the dataset with the data_pipeline builder that made it (python -m data_pipeline.build_<kind> "
                "--output-dir NEW_DIR ...) or point data.path at an intact copy")
    return (f"rebuild it: delete {root} and run python -m data_pipeline.{marker.get('builder')} with the parameters in "
            f"{root}/{MARKER} (a run with data.generate_if_missing=true rebuilds a generated set itself)")
