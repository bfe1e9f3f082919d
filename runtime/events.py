"""The trainer's life as events: what the launchers act on, never the trainer's log text.

One JSON object per event, with `event`, `time` (Unix seconds) and `process`:

  started     run_id, step (where this launch starts), total (the run's last step), resumed
  checkpoint  step: a checkpoint committed (a relaunch can resume from it)
  preempted   step (its checkpoint committed), noticed (when the stop signal was acted on)
  completed   step, metrics (the final train and eval metrics), evaluated (an eval_only run)
  failed      exit_code, failure (its class: a `Failure` label), line (the one line the process printed)
  timing      step, steps_run, saves, seconds (per category since the process started), wall, hits, misses:
              at every log row, every commit and just before the end's event; cumulative (runtime/goodput.py)

Process 0 appends them to `<output dir>/events.jsonl` (copied beside the checkpoints at every
checkpoint, runtime/run_files.py). Where a launcher asks for them (the launch guard sets
`wire.EVENTS_ENV`), each is also printed on stdout as an event line (runtime/wire.py), the live
stream that launcher reads; every other process prints its own `failed` only. A person at a
terminal sees the trainer's human lines instead.

Exit codes say the same for a shell: 0 completed, EXIT_PREEMPTED (8) preempted with its
checkpoint saved, the others in runtime/errors.py.

`Failure` is the one list of failure classes: each has its label (the wire value in `failed`),
the exit code it stands for (none for a finer class an exception names, e.g. LeaseHeld's
`lease-held`), what a supervisor does about it (`Policy`) and the cause it records
(experiments/launcher/supervise.py, docs/OPERATIONS.md's failure table).

Standard library only, and Python 3.10 syntax: runtime/liveness.py and runtime/watchdog.py report
through `failed` from their threads as the process ends, and the worker tools
(experiments/launcher/worker/) import this module under a TPU VM's system python3.
"""

from __future__ import annotations

import enum
import json
import math
import os
import sys
import threading
import time
from typing import Any, Mapping

from runtime import wire
from runtime.errors import (EXIT_DOES_NOT_FIT, EXIT_FAILURE, EXIT_HANG, EXIT_NONFINITE, EXIT_PEER_LOST,
                            EXIT_STORAGE, EXIT_USER_ERROR)

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # Python 3.10 (a TPU VM's system python3): the same, by hand
    class StrEnum(str, enum.Enum):
        __str__ = str.__str__
        __format__ = str.__format__

FILE = "events.jsonl"


class Kind(StrEnum):
    """The events (the module docstring), and the launch guard's own `sigterm`
    (experiments/launcher/worker/once.py)."""
    STARTED = "started"
    CHECKPOINT = "checkpoint"
    PREEMPTED = "preempted"
    COMPLETED = "completed"
    FAILED = "failed"
    TIMING = "timing"
    SIGTERM = "sigterm"


class Policy(StrEnum):
    """What a supervisor does after a launch failed this way (experiments/launcher/supervise.py)."""
    PERMANENT = "permanent"  # no relaunch fixes it: stop, with its code and line
    BACK_OFF = "back off"  # wait (storage to come back, a dead run's lease to go stale), then relaunch
    RESTART = "restart"  # stop stale processes on the workers, relaunch at once


class Failure(StrEnum):
    """A failure class: its label (the value), exit code, policy and the cause a supervisor records."""

    exit_code: int | None  # annotations only (no value): attributes each member sets in __new__, not members
    policy: Policy
    cause: str

    CRASH = ("crash", EXIT_FAILURE, Policy.RESTART, "crash")
    BAD_INPUT = ("bad-input", EXIT_USER_ERROR, Policy.PERMANENT, "bad input")
    NON_FINITE = ("non-finite", EXIT_NONFINITE, Policy.PERMANENT, "non-finite loss")
    HANG = ("hang", EXIT_HANG, Policy.RESTART, "hang watchdog")
    DOES_NOT_FIT = ("does-not-fit", EXIT_DOES_NOT_FIT, Policy.PERMANENT, "does not fit")
    STORAGE = ("storage", EXIT_STORAGE, Policy.BACK_OFF, "storage failure")
    PEER_LOST = ("peer-lost", EXIT_PEER_LOST, Policy.RESTART, "worker lost")
    # Finer classes of bad input an exception names for itself (its `failure` attribute):
    LEASE_HELD = ("lease-held", None, Policy.BACK_OFF, "lease held")  # runtime/lease.py: the run before still holds it
    TPU_BUSY = ("tpu-busy", None, Policy.RESTART, "TPU busy")  # runtime/distributed.py: another process holds the TPU

    def __new__(cls, label: str, exit_code: int | None, policy: Policy, cause: str) -> "Failure":
        member = str.__new__(cls, label)
        member._value_ = label
        member.exit_code, member.policy, member.cause = exit_code, policy, cause
        return member

    @classmethod
    def of_exit(cls, exit_code: int) -> "Failure | None":
        """The class an exit code stands for, else None."""
        return next((f for f in cls if f.exit_code == exit_code), None)

    @classmethod
    def of_label(cls, label: object) -> "Failure | None":
        """The class a `failed` event names, else None (an unknown label, e.g. "exit 9")."""
        return next((f for f in cls if f.value == label), None)

_lock = threading.Lock()
_state: dict[str, Any] = {"path": None, "primary": True, "process": 0, "failed": False}


def attach(output_dir: str, *, process: int) -> None:
    """From now on process 0 appends its events to <output_dir>/events.jsonl, and the other
    processes print only their own failure."""
    with _lock:
        _state.update(process=process, primary=process == 0,
                      path=os.path.join(output_dir, FILE) if process == 0 else None)


def detach() -> None:
    with _lock:
        _state.update(path=None, primary=True, process=0, failed=False)


def emit(event: str, **fields: Any) -> dict[str, Any]:
    """Record one event (see the module docstring); a write that fails never stops the run."""
    record = {"event": event, "time": round(time.time(), 3), "process": _state["process"], **_plain(fields)}
    with _lock:
        if _state["primary"] or event == Kind.FAILED:
            _say(wire.event_line(record))
        if _state["path"]:
            _append(_state["path"], json.dumps(record, allow_nan=False) + "\n")
    return record


def failed(exit_code: int, line: str, failure: Failure | str | None = None) -> None:
    """This process fails with `exit_code`, said in `line`: one `failed` event per process (the
    first cause; what follows from it is not reported again). Its class: `failure` (a Failure or
    its label), else the exit code's (an exit code of no class: "exit N")."""
    with _lock:
        if _state["failed"]:
            return
        _state["failed"] = True
    kind = Failure.of_exit(exit_code)
    label = str(failure) if failure else kind.value if kind else f"exit {exit_code}"
    emit(Kind.FAILED, exit_code=exit_code, failure=label, line=" ".join(str(line).split())[:1000])


def failure_of(exc: BaseException) -> Failure | None:
    """The finer class an exception names for itself (e.g. LeaseHeld: Failure.LEASE_HELD), else None."""
    return Failure.of_label(getattr(exc, "failure", None))


def read(path: str) -> list[dict[str, Any]]:
    """The events of a run's events.jsonl (local or gs://), [] when there is none."""
    import fsspec  # not at the top: this module is standard library only (see the module docstring)

    try:
        with fsspec.open(path, "r") as f:
            text = f.read()
    except FileNotFoundError:
        return []
    return [e for e in (_loads(line) for line in text.splitlines()) if e is not None]


def _loads(line: str) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except ValueError:  # a torn last line
        return None
    return record if isinstance(record, dict) else None


def _plain(value: Any) -> Any:
    """JSON-safe: numbers as Python floats and ints (non-finite as strings, as metrics.jsonl has them)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    if math.isfinite(number):
        return int(number) if isinstance(value, int) else number
    return "nan" if math.isnan(number) else ("inf" if number > 0 else "-inf")


def _say(text: str) -> None:
    """On stdout only for a launcher that asked (wire.EVENTS_ENV); stdout may be gone (a dropped
    ssh took the pipe's reader): the event file still has it."""
    if os.environ.get(wire.EVENTS_ENV) != "1":
        return
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except (OSError, ValueError):
        pass


def _append(path: str, text: str) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, text.encode())  # one write of a whole line
        finally:
            os.close(fd)
    except OSError as e:  # a full output disk fails metrics.jsonl too, which stops the run with one line
        print(f"WARNING cannot append to {path} ({e.strerror})", file=sys.stderr, flush=True)
