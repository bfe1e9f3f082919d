"""Every tagged line between the trainer, the launch guard, the worker tools and the launchers:
one `<tag>` and what follows it, printed on a worker and found by the launcher anywhere in a line
of gcloud's interleaved `--worker=all` output (gcloud may prefix it). Each kind has its emit and
its parse here, and nowhere else:

  event     `podrunner-event {json}`: the trainer's events (runtime/events.py says what each means)
            and the guard's own `sigterm` (experiments/launcher/worker/once.py)
  start     `podrunner-start host=H commit=C launch_id=ID log=LOG` (`tree=HASH` for a shipped
            tree): the guard's first line of a launch in the worker's log
  versions  `podrunner-versions {json}`: a worker's commit, Python, packages and verdict
            (experiments/launcher/worker/versions.py)
  status    `podrunner-status {json}`: a worker's training processes, last step and newest log
            (experiments/launcher/worker/status.py)
  doctor    `podrunner-doctor {json}`: a worker's verdicts and measured figures for `launch.py
            doctor` (experiments/launcher/worker/doctor_checks.py, `DoctorReport`)

The formats are what older trees print and what logs on disk hold: a change here must still read
them. Standard library only, and Python 3.10 syntax: the worker tools import this module under a
TPU VM's system python3.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

_EVENT = "podrunner-event "
_START = "podrunner-start "
_VERSIONS = "podrunner-versions "
_STATUS = "podrunner-status "
_DOCTOR = "podrunner-doctor "


def _payload(line: str, tag: str) -> Any:
    """The JSON after `tag` anywhere in the line, else None."""
    i = line.find(tag)
    if i < 0:
        return None
    try:
        return json.loads(line[i + len(tag):])
    except ValueError:
        return None


# --- events ----------------------------------------------------------------------------------

def event_line(record: dict[str, Any]) -> str:
    """An event's line (its JSON-safe fields: runtime/events.py `emit` makes them so)."""
    return _EVENT + json.dumps(record, allow_nan=False)


def event(line: str) -> dict[str, Any] | None:
    """The event in a line (an object with a string `event`), else None."""
    record = _payload(line, _EVENT)
    return record if isinstance(record, dict) and isinstance(record.get("event"), str) else None


# A launcher that reads the trainer's events from its output sets this in the trainer's
# environment (the launch guard, experiments/launcher/worker/once.py); otherwise they go to the
# run's events.jsonl only, and a person at a terminal sees the trainer's human lines alone.
EVENTS_ENV = "PODRUNNER_EVENTS_ON_STDOUT"

# Library chatter a person does not need on the console (the launchers keep it in the logs):
# Gloo's connection lines on CPU pods.
_CHATTER = ("[Gloo] ",)


def for_people(line: str) -> bool:
    """Whether a launcher shows `line` on its console: not a tagged line, not library chatter."""
    return not any(tag in line for tag in (_EVENT, _START, _VERSIONS, _STATUS, _DOCTOR, *_CHATTER))


def replayed(line: str) -> bool:
    """A line a guard's re-run replays to its launcher (once.py): an event or a start line."""
    return event(line) is not None or start(line) is not None


# --- start lines -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Start:
    """A launch's start on one worker. `launch`: the launcher's own fields, as the guard was given
    them (`launch_id=ID`: experiments/launcher/pod.py pod_command)."""
    host: str
    log: str
    commit: str | None = None
    tree: str | None = None  # a shipped tree's hash, instead of the commit
    launch: str = ""

    def line(self) -> str:
        version = f"tree={self.tree}" if self.tree else f"commit={self.commit}"
        return _START + " ".join([f"host={self.host}", version, *([self.launch] if self.launch else []),
                                  f"log={self.log}"])

    @property
    def version(self) -> str | None:
        return self.tree or self.commit


def start(line: str) -> Start | None:
    """The start line in a line, else None."""
    i = line.find(_START)
    if i < 0:
        return None
    pairs = [word.split("=", 1) for word in line[i + len(_START):].split() if "=" in word]
    named = {k: v for k, v in pairs if k in ("host", "log", "commit", "tree")}
    if "host" not in named:
        return None
    launch = " ".join(f"{k}={v}" for k, v in pairs if k not in named)
    return Start(host=named["host"], log=named.get("log", ""), commit=named.get("commit"), tree=named.get("tree"),
                 launch=launch)


# --- versions --------------------------------------------------------------------------------

def versions_line(row: dict[str, Any]) -> str:
    """A worker's versions row: host, commit, python, a version per compared package, ok, problem
    (experiments/launcher/worker/versions.py)."""
    return _VERSIONS + json.dumps(row)


def versions(line: str) -> dict[str, Any] | None:
    row = _payload(line, _VERSIONS)
    return row if isinstance(row, dict) else None


# --- status ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Status:
    """One worker's answer to `launch.py status`."""
    host: str
    worker: str | None
    processes: list[list[int]]  # [pid, elapsed seconds]
    step: int | None
    step_from: str | None  # "metrics" or "log"
    metrics: str | None
    log: str | None

    @property
    def alive(self) -> bool:
        return bool(self.processes)

    def line(self) -> str:
        return _STATUS + json.dumps(asdict(self))


def status(line: str) -> Status | None:
    data = _payload(line, _STATUS)
    if not isinstance(data, dict):
        return None
    values: dict[str, Any] = {f.name: data.get(f.name) for f in fields(Status)}  # as the JSON line has them
    return Status(**values)


# --- doctor ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Check:
    """One verdict: `status` ok, fail, skip (does not apply here, `detail` says why) or overrun (its
    time budget ended first); `fix` what to do when it is not ok."""
    name: str
    status: str
    detail: str
    fix: str = ""
    seconds: float = 0.0


@dataclass(frozen=True)
class Measured:
    """A figure measured on a worker: `name` as in the plan's figures (experiments/plan/bill.py
    FIGURES) where it is one of them; `variant` the group/variant it was measured for, if any."""
    name: str
    seconds: float
    what: str
    variant: str | None = None


@dataclass(frozen=True)
class DoctorReport:
    """One worker's answer to `launch.py doctor`: `platform` the devices jax saw (None: not asked),
    `time` when it answered (Unix seconds), `versions` what the workers must agree on."""
    host: str
    worker: str | None
    platform: str | None
    time: float
    checks: list[Check]
    figures: list[Measured]
    versions: dict[str, Any]

    def line(self) -> str:
        return _DOCTOR + json.dumps(asdict(self))


def doctor(line: str) -> DoctorReport | None:
    data = _payload(line, _DOCTOR)
    if not isinstance(data, dict):
        return None
    try:
        return DoctorReport(
            host=str(data["host"]), worker=data.get("worker"), platform=data.get("platform"),
            time=float(data.get("time", 0.0)), versions=dict(data.get("versions") or {}),
            checks=[Check(**c) for c in data.get("checks", [])], figures=[Measured(**m) for m in data.get("figures", [])])
    except (KeyError, TypeError, ValueError):
        return None
