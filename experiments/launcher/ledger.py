"""The launcher's records, typed: a variant's states and how they change, a supervision's
outcomes and statuses, and the dataclasses of `ledger.json` (the run queue's,
experiments/launcher/queue_state.py) and `supervision.json` (experiments/launcher/supervise.py).

Vocabulary: `StrEnum`s (VariantState, Move, Outcome, Cause, Status, ControllerStatus, Verb);
`TRANSITIONS` lists every legal change of a variant's state (docs/RUNNING.md's state table
says the same, and a test compares the two), and any other change is a bug (`IllegalTransition`).
The trainer's failure classes are runtime/events.py's `Failure`.

Each fact is said once: a launch's steps, total, W&B run id and failure line are its
`LaunchRecord`'s (the one under way: its `InFlight`); a supervision's and a variant's are derived
from them (`SupervisionRecord.said`, `VariantRecord.said`, `VariantRecord.verdict`).

Files. `ledger.json` is `Ledger` as JSON with `"schema": 5`; `supervision.json` is
`SupervisionRecord` with the same key. Older schemas are read and migrated (`MIGRATIONS`; a file
without the key is version 1). Loading is strict: a file that is not JSON, whose shape differs (a
key missing or unknown, a value of the wrong type, a number no float holds), or that cannot be
read at all (a folder in its place, no permission), raises `RecordError` naming the file, the
field, the problem and where a good copy may be (`read_state` reads one).

Writes: `write_text` replaces a file whole (locally through runtime/atomic.py's `write_atomic`),
`append_text` adds a log's line; a local write that fails raises `StateWriteError` (exit 6), the
file as it was. `Snapshot` is a mirror's state.json. Strict reading and writing go through
pydantic (a TypeAdapter over these standard dataclasses).
"""

from __future__ import annotations

import enum
import functools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

import fsspec
import pydantic
from fsspec.implementations.local import LocalFileSystem

from runtime.atomic import append_atomic, write_atomic
from runtime.errors import EXIT_STORAGE, UserError, storage_fault, storage_fix

SCHEMA = 5


# --- the vocabulary ------------------------------------------------------------------------------

class VariantState(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    SKIPPED = "skipped"


class Move(enum.StrEnum):
    """What happens to a variant (docs/RUNNING.md, the state table)."""
    START = "start"  # a slice takes it
    COMPLETE = "complete"  # its run completed, or was found complete beside its checkpoints
    FAIL = "fail"  # failed for good, or its supervision gave up
    REQUEUE = "requeue"  # stopped before its end: the controller stopped or died, or its slice could not be had
    SKIP = "skip"  # `programme skip` (a running one once it has stopped)
    RETRY = "retry"  # `programme retry`


# (from, move) -> to: every change of a variant's state there is.
TRANSITIONS: dict[tuple[VariantState, Move], VariantState] = {
    (VariantState.QUEUED, Move.START): VariantState.RUNNING,
    (VariantState.RUNNING, Move.COMPLETE): VariantState.COMPLETED,
    (VariantState.RUNNING, Move.FAIL): VariantState.FAILED,
    (VariantState.RUNNING, Move.REQUEUE): VariantState.QUEUED,
    (VariantState.RUNNING, Move.SKIP): VariantState.SKIPPED,
    (VariantState.QUEUED, Move.SKIP): VariantState.SKIPPED,
    (VariantState.FAILED, Move.SKIP): VariantState.SKIPPED,
    (VariantState.FAILED, Move.RETRY): VariantState.QUEUED,
    (VariantState.SKIPPED, Move.RETRY): VariantState.QUEUED,
}


class IllegalTransition(RuntimeError):
    """A change of a variant's state that TRANSITIONS does not list: a bug in the controller."""


def can_move(state: VariantState, how: Move) -> bool:
    return (state, how) in TRANSITIONS


def move(record: "VariantRecord", how: Move) -> VariantState:
    """Change the variant's state as TRANSITIONS says (the only place that does)."""
    to = TRANSITIONS.get((record.state, how))
    if to is None:
        raise IllegalTransition(f"a {record.state} variant cannot {how} (see ledger.TRANSITIONS)")
    record.state = to
    return to


class Outcome(enum.StrEnum):
    """How one launch ended (experiments/launcher/supervise.py's `classify`)."""
    COMPLETED = "completed"
    PREEMPTED = "preempted"  # back to making sure the slice is READY; not a restart
    FATAL = "fatal"  # a permanent failure: the supervision fails
    BACKOFF = "backoff"  # wait, then relaunch (a restart)
    RESTART = "restart"  # stop stale processes, relaunch (a restart)
    STOPPED = "stopped"  # asked to stop (`programme stop`, `skip`, Ctrl-C): neither a preemption nor a restart


class Cause(enum.StrEnum):
    """The launcher's own causes of an end (a launch's or a supervision's `cause`, a streak's `kind`);
    the trainer's are its Failure classes' (runtime/events.py)."""
    GCLOUD_REFUSED = "gcloud-refused"  # GCP refused a request for good (a wrong flag): the programme stops
    GCLOUD_CREDENTIALS = "gcloud-credentials"  # gcloud has no valid credentials: the programme stops
    QUOTA = "quota"  # the slice's creates were refused for quota
    CREATE_REFUSED = "create refused"  # ... for another reason (a stockout)
    SUPERVISOR_DIED = "stopped: its supervisor had died"  # a launch found in flight, stopped by the next supervisor
    STOPPED = "stopped: asked to"  # a launch stopped by `programme stop` / `skip` or Ctrl-C, its slice READY


STOPS_PROGRAMME = (Cause.GCLOUD_REFUSED, Cause.GCLOUD_CREDENTIALS)  # no variant fares better: the controller stops


class Status(enum.StrEnum):
    """A supervision's status (and the event that ends it)."""
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    GAVE_UP = "gave-up"
    INTERRUPTED = "interrupted"
    RELEASED = "released"  # a programme's slice given back (its own record, never saved)


class ControllerStatus(enum.StrEnum):
    SUBMITTED = "submitted"
    RUNNING = "running"
    STOPPED = "stopped"
    BUDGET = "budget"
    DONE = "done"


class Verb(enum.StrEnum):
    """A request for the running controller (`programme stop | skip | retry | budget`)."""
    STOP = "stop"
    SKIP = "skip"
    RETRY = "retry"
    BUDGET = "budget"


# --- the records ---------------------------------------------------------------------------------

class Strict:
    """A record read strictly: an unknown key is a file of another shape, and a float field holds a
    finite number (pydantic reads the config)."""
    __pydantic_config__ = pydantic.ConfigDict(extra="forbid", allow_inf_nan=False)


@dataclass
class ReadyClock(Strict):
    """How long a slice was READY (billed), and that times its hosts; a supervisor started again goes
    on counting from `ready_since`. Changed under the lock of the record that holds it."""
    ready_since: float | None = None
    hosts: int = 0
    ready_seconds: float = 0.0
    host_seconds: float = 0.0

    def ready(self, since: float, hosts: int) -> None:
        if self.ready_since is None:
            self.ready_since = since
        self.hosts = hosts or self.hosts

    def gone(self, at: float) -> None:
        if self.ready_since is None:
            return
        seconds = max(0.0, at - self.ready_since)
        self.ready_seconds += seconds
        self.host_seconds += seconds * self.hosts
        self.ready_since = None

    def _open(self, now: float | None) -> float:
        return 0.0 if self.ready_since is None else max(0.0, (now or time.time()) - self.ready_since)

    def ready_total(self, now: float | None = None) -> float:
        """READY seconds so far, the open stretch included."""
        return self.ready_seconds + self._open(now)

    def host_total(self, now: float | None = None) -> float:
        """Host-seconds so far, the open stretch included."""
        return self.host_seconds + self._open(now) * self.hosts


@dataclass
class LaunchTiming(Strict):
    """Where one launch's time went (experiments/launcher/account.py adds it up): the trainer's last
    `timing` event (runtime/goodput.py: `seconds` by category since its process started, the last
    `step` completed, `steps_run`, `saves`, the compilation cache's `hits` and `misses`, the `time`
    it was said) and what the supervisor measured beside it: `setup`, the READY seconds before the
    launch (the versions check, setup, stale processes stopped), and `unpaid`, the part of
    `seconds` after the slice stopped being billed (a preempted trainer's last save), by category.
    `seconds` is empty when the trainer said nothing (it failed first, or older code ran)."""
    setup: float = 0.0
    setup_ran: bool = False  # the workers were set up (a fresh slice's disks, versions that differed), not only checked
    seconds: dict[str, float] = field(default_factory=dict)
    step: int | None = None
    steps_run: int = 0
    saves: int = 0
    hits: int = 0
    misses: int = 0
    wall: float = 0.0
    time: float | None = None
    unpaid: dict[str, float] = field(default_factory=dict)


@dataclass
class LaunchRecord(Strict):
    """One launch: when, its exit code, how it ended and why, where the run got to."""
    started: float
    ended: float
    code: int
    outcome: Outcome
    cause: str  # a Failure's cause ("bad input"), a Cause, "completed", "preempted" or "exit N ..."
    line: str | None = None  # the trainer's one line of its failure
    last_step: int | None = None
    total: int | None = None
    wandb_run_id: str | None = None
    tpu_state_after: str | None = None  # as gcloud said it (None: not asked, the launch ended well)
    metrics: dict[str, Any] | None = None
    first_step: int | None = None  # where it started (its `started` event's step): a resume point
    timing: LaunchTiming | None = None
    unwatched: bool = False  # it ran while no supervisor watched: recorded later, from the run's events
    saved_step: int | None = None  # the newest step it could resume from when it ended (its start, a committed checkpoint)


@dataclass
class InFlight(Strict):
    """The launch under way, as far as its last `started` or `checkpoint` event said (status pages
    read it): a supervisor killed meanwhile leaves it, and the next one records that launch from it
    and from the run's events."""
    started: float
    setup: float = 0.0
    first_step: int | None = None
    last_step: int | None = None
    total: int | None = None
    wandb_run_id: str | None = None
    timing: LaunchTiming | None = None  # from the trainer's last `timing` event seen by then


@dataclass
class End(Strict):
    """How a supervision ended (the fields of its last event)."""
    status: Status
    code: int
    line: str | None = None
    cause: str | None = None
    reason: str | None = None  # gave up: max-restarts or no-progress
    max_restarts: int | None = None


@dataclass
class SupervisionRecord(Strict):
    """One run's supervision (supervision.json, or a variant's `supervision` in the ledger)."""
    run_id: str | None = None
    tpu: str | None = None
    zone: str | None = None
    restarts: int = 0
    preemptions: int = 0
    status: Status = Status.RUNNING
    launches: list[LaunchRecord] = field(default_factory=list)
    slice: ReadyClock = field(default_factory=ReadyClock)  # `supervise`'s own slice (a variant's is the ledger's)
    create_refusals: int = 0  # refused creates in a row
    in_flight: bool = False  # a launch runs (a supervisor killed meanwhile finds it so)
    launch: InFlight | None = None  # that launch, while it runs
    setup_pending: bool = False  # the last setup failed
    commit: str | None = None  # the commit every worker first agreed on
    end: End | None = None

    def said(self, name: str) -> Any:
        """What the newest launch that said it said of `name` (last_step, total, wandb_run_id), the
        one under way first."""
        launches = [*self.launches, *([self.launch] if self.launch else [])]
        return next((v for launch in reversed(launches) if (v := getattr(launch, name)) is not None), None)


@dataclass
class Mark(Strict):
    """Where the slice's clock stood when a running variant started: it is charged what follows."""
    ready: float = 0.0
    host: float = 0.0


@dataclass
class VariantRecord(Strict):
    state: VariantState = VariantState.QUEUED
    order: int = 0
    run_id: str = ""
    attempts: int = 0
    slice: str | None = None
    supervision: SupervisionRecord = field(default_factory=SupervisionRecord)
    ready_seconds: float = 0.0
    host_seconds: float = 0.0
    metrics: dict[str, Any] | None = None
    line: str | None = None  # why it ended where no launch says it (the slice could not be had)
    failure: str | None = None  # the cause, in words ("bad input", "quota", ...)
    found_step: int | None = None  # the step its run was found complete at, beside its checkpoints
    started: float | None = None
    ended: float | None = None
    mark: Mark | None = None  # while running
    skip: bool = False  # `programme skip` asked while it ran: skipped once it has stopped

    def said(self, name: str) -> Any:
        """last_step, total or wandb_run_id: as its launches said it (the step: or its run found complete)."""
        return self.found_step if name == "last_step" and self.found_step is not None else self.supervision.said(name)

    def verdict(self) -> str | None:
        """The line that ended it: its own, its supervision's, or its last launch's."""
        sup = self.supervision
        last = sup.launches[-1] if sup.launches else None
        said = (sup.end.line if sup.end else None) or (last.line or last.cause if last else None)
        if sup.status == Status.GAVE_UP and last and not last.line:
            said = f"gave up: {last.cause}"
        return self.line or said


@dataclass
class SliceRecord(Strict):
    """A slice: its READY clock, the variant it runs, and its idle time (READY with no variant: between
    variants, while the controller is stopped, before it is deleted), the programme's own."""
    clock: ReadyClock = field(default_factory=ReadyClock)
    variant: str | None = None  # the variant it runs (kept when the controller stops: it resumes there)
    free: Mark | None = None  # where its clock stood when it last held no variant (idle since)
    idle_seconds: float = 0.0
    idle_host_seconds: float = 0.0
    gaps: list[float] = field(default_factory=list)  # each idle stretch that ended with a variant taking it


@dataclass
class Streak(Strict):
    """The variants the same infrastructure failure ended, in a row."""
    kind: str | None = None
    variants: list[str] = field(default_factory=list)


@dataclass
class ControllerRecord(Strict):
    status: ControllerStatus = ControllerStatus.SUBMITTED
    pid: int | None = None
    started: float | None = None
    streak: Streak = field(default_factory=Streak)
    line: str | None = None
    ended: float | None = None
    applied: list[str] = field(default_factory=list)  # ids of the last commands applied (each once)


@dataclass
class Ledger(Strict):
    """The queue's ledger (ledger.json). `seq` counts its saves: of two copies the higher is newer."""
    schema: int = SCHEMA
    seq: int = 0
    variants: dict[str, VariantRecord] = field(default_factory=dict)
    slices: dict[str, SliceRecord] = field(default_factory=dict)
    history: list[tuple[float, float]] = field(default_factory=list)  # (time, pod-hours spent)
    controller: ControllerRecord = field(default_factory=ControllerRecord)


@dataclass
class Snapshot(Strict):
    """A mirror's state.json: the submission (programme.json) and the ledger of one moment; `seq`
    is the ledger's (of two snapshots the higher is the newer)."""
    schema: int
    seq: int
    submission: dict[str, Any]
    ledger: Ledger


@dataclass
class Command(Strict):
    """A request left for the controller (`<state dir>/commands/<id>.json`, and on the mirror)."""
    id: str
    verb: Verb
    variant: str | None = None
    value: float | None = None
    release: bool | None = None  # a stop: delete the slices (True) or keep them READY (False); None: the default


# --- reading and writing -------------------------------------------------------------------------

class RecordError(UserError):
    """A state file that cannot be read as its record (`what`: "ledger", "supervision record", ...):
    the `file`, the `field` within it (None: the file as a whole), the `problem`, and `good_copy`,
    where an intact copy may be (the mirror). One line (a UserError: exit 2)."""

    def __init__(self, what: str, file: object, problem: str, *, field: str | None = None,
                 good_copy: str | None = None, fresh: str = "start anew", wrong: str | None = None) -> None:
        self.what, self.file, self.field, self.problem, self.good_copy = what, str(file), field, problem, good_copy
        wrong = wrong or f"is not a {what} this code reads ({field + ': ' if field else ''}{problem})"
        copy = f"restore it from {good_copy}" if good_copy else "restore it from a copy"
        super().__init__(f"the {what} {file} {wrong}; {copy}, or move it away to {fresh}")


class StateWriteError(UserError):
    """A state file that could not be written (a full disk, a read-only or unwritable folder, a file
    where a folder goes): one line naming it and the fix; the file is as it was (exit 6)."""

    exit_code = EXIT_STORAGE

    def __init__(self, file: object, error: OSError, what: str = "state file", also: str = "") -> None:
        self.file, self.error = str(file), error
        fault = storage_fault(error) or ("a file stands where a folder goes" if isinstance(error, FileExistsError)
                                         else error.strerror or type(error).__name__)
        fix = storage_fix(fault, str(Path(str(file)).parent)) + (f", {also}" if also else "")
        super().__init__(f"cannot write the {what} {file} ({fault}); {fix}, then run the same command again (the "
                         f"{what} on disk is as it was)")


def read_state(path: Path, what: str, *, good_copy: str | None = None, fresh: str = "start anew") -> bytes:
    """A local state file's bytes; FileNotFoundError when there is none, RecordError when it cannot be
    read (a folder in its place, no permission)."""
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise
    except IsADirectoryError:
        raise RecordError(what, path, "a folder", good_copy=good_copy, fresh=fresh,
                          wrong="is a folder where its file should be") from None
    except OSError as e:
        problem = storage_fault(e) or e.strerror or type(e).__name__
        raise RecordError(what, path, problem, good_copy=good_copy, fresh=fresh,
                          wrong=f"cannot be read ({problem})") from None


T = TypeVar("T")


@functools.cache
def _adapter(kind: type) -> pydantic.TypeAdapter:
    return pydantic.TypeAdapter(kind)


def _path(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, str) and part.isidentifier():
            out += f".{part}" if out else part
        else:  # an index, or a key that is no name: as JSON, in brackets
            out += f"[{json.dumps(part)}]"
    return out


def _problem(error: Mapping[str, Any]) -> str:
    known = {"missing": "missing", "unexpected_keyword_argument": "a field this version does not know"}
    value = json.dumps(error.get("input"))
    return known.get(error["type"]) or f"{error['msg'][0].lower()}{error['msg'][1:]}, got {value[:80]}"


def _each_fact_once(data: dict) -> dict:
    """Schema 3 -> 4 (a ledger or a supervision record; a snapshot's ledger is upgraded on its own):
    a launch under way takes its supervision's `progress` (total, W&B run id), its raw `timing` event
    becomes a LaunchTiming; an end and a variant drop their copies of the launches' facts (a variant
    keeps the step its run was found complete at). A malformed part is left for `decode` to name."""
    def supervision(record: Any) -> list:
        if not isinstance(record, dict):
            return []
        progress, launch = record.pop("progress", None), record.get("launch")
        if isinstance(launch, dict):
            launch.update({k: progress.get(k) for k in ("total", "wandb_run_id")} if isinstance(progress, dict) else {})
            if isinstance(launch.get("timing"), dict):
                from experiments.launcher.account import launch_timing  # here: account reads these records

                launch["timing"] = as_json(launch_timing([launch["timing"]], setup=launch.get("setup") or 0.0))
        if isinstance(record.get("end"), dict):
            record["end"].pop("last_step", None)
        launches = record.get("launches") if isinstance(record.get("launches"), list) else []
        return [launch.get("last_step") for launch in launches if isinstance(launch, dict)]

    if "submission" in data or not isinstance(data.get("variants"), dict):
        supervision(data if "submission" not in data else None)
        return data
    for variant in (v for v in data["variants"].values() if isinstance(v, dict)):
        said = supervision(variant.get("supervision"))
        step, _, _ = (variant.pop(k, None) for k in ("last_step", "total", "wandb_run_id"))
        if step is not None and step not in said and variant.get("state") == "completed":
            variant["found_step"] = step
    return data


def _without_residents(data: dict) -> dict:
    """Schema 4 -> 5 (a ledger or a supervision record): each launch's `resident` mode dropped."""
    variants = data.get("variants") if isinstance(data.get("variants"), dict) else {}
    records = [v.get("supervision") for v in variants.values() if isinstance(v, dict)] or [data]
    for record in (r for r in records if isinstance(r, dict)):
        for launch in record.get("launches") if isinstance(record.get("launches"), list) else []:
            if isinstance(launch, dict):
                launch.pop("resident", None)
    return data


# Schema n -> n + 1, on the parsed JSON of a file of schema n. Version 2 only typed version 1's
# records (the same keys, read as they are) and added fields with defaults: nothing to rewrite.
# Version 3 added the time accounts, fields with defaults: a version-2 launch has no `timing` (its
# time is `other`), a slice no idle time (what its clock counted before is the programme's
# unattributed time, experiments/launcher/account.py). Version 4 says each fact once. Version 5
# has no resident trainers (retired): a launch drops its `resident` mode.
MIGRATIONS: dict[int, Callable[[dict], dict]] = {1: lambda data: data, 2: lambda data: data, 3: _each_fact_once,
                                                 4: _without_residents}


def decode(kind: type[T], data: Any, *, what: str, file: object, good_copy: str | None = None,
           fresh: str = "start anew", prefix: tuple = ()) -> T:
    """`data` (parsed JSON of the current schema) as a `kind` record, strictly, or RecordError."""
    try:
        return _adapter(kind).validate_json(json.dumps(data), strict=True)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        raise RecordError(what, file, _problem(first), field=_path(prefix + tuple(first["loc"])) or None,
                          good_copy=good_copy, fresh=fresh) from None


def parse_json(text: str | bytes, *, what: str, file: object, good_copy: str | None = None,
               fresh: str = "start anew") -> dict:
    """The JSON object of a state file, at the current schema (older ones migrated), or RecordError."""
    try:
        data = json.loads(text)
    except ValueError as e:
        raise RecordError(what, file, str(e), good_copy=good_copy, fresh=fresh,
                          wrong=f"is truncated or garbled ({e})") from None
    return upgrade(data, what=what, file=file, good_copy=good_copy, fresh=fresh)


def upgrade(data: Any, *, what: str, file: object, good_copy: str | None = None, fresh: str = "start anew",
            prefix: tuple = ()) -> dict:
    """A record's JSON object at the current schema: older schemas migrated, newer ones refused."""
    if not isinstance(data, dict):
        raise RecordError(what, file, f"a JSON {type(data).__name__}, not an object", field=_path(prefix) or None,
                          good_copy=good_copy, fresh=fresh)
    schema = data.get("schema", 1)
    if not isinstance(schema, int) or not 1 <= schema <= SCHEMA:
        raise RecordError(what, file, f"{schema!r}, where this code reads 1 to {SCHEMA} (a newer version wrote "
                                      "it? run that one)", field=_path((*prefix, "schema")), good_copy=good_copy,
                          fresh=fresh)
    for version in range(schema, SCHEMA):
        data = MIGRATIONS[version](data)
    return {**data, "schema": SCHEMA}


def load_snapshot(text: str | bytes, file: object) -> Snapshot:
    """A mirror's state.json as a Snapshot, or RecordError."""
    kw = dict(what="programme snapshot", file=file, fresh="take over from the directory's own files")
    data = parse_json(text, **kw)
    if "ledger" in data:
        data["ledger"] = upgrade(data["ledger"], prefix=("ledger",), **kw)
    return decode(Snapshot, data, **kw)


def load_ledger(text: str | bytes, file: object, good_copy: str | None = None) -> Ledger:
    """ledger.json's text as a Ledger (any schema this code reads), or RecordError."""
    kw = dict(what="ledger", file=file, good_copy=good_copy, fresh="submit the programme again")
    return decode(Ledger, parse_json(text, **kw), **kw)


def load_supervision(text: str | bytes, file: object, good_copy: str | None = None) -> SupervisionRecord:
    """supervision.json's text as a SupervisionRecord, or RecordError."""
    kw = dict(what="supervision record", file=file, good_copy=good_copy,
              fresh="start a new history for this run id")
    data = parse_json(text, **kw)
    data.pop("schema")
    return decode(SupervisionRecord, data, **kw)


def as_json(record: Any) -> Any:
    """A record as plain JSON data (a copy)."""
    return _adapter(type(record)).dump_python(record, mode="json")


def to_text(record: Any) -> str:
    """A record as the text of its file (take it under the lock its record is changed under)."""
    return _adapter(type(record)).dump_json(record, indent=1).decode() + "\n"


def supervision_text(record: SupervisionRecord) -> str:
    """supervision.json's text: the record, with its schema first."""
    return dumps({"schema": SCHEMA, **as_json(record)})


def dumps(data: Any) -> str:
    return json.dumps(data, indent=1) + "\n"


def write_text(uri: str | Path, text: str | bytes, what: str = "state file") -> None:
    """Replace a state file whole: a local path through write_atomic (StateWriteError when that
    fails, the file as it was), a remote object (gs://) in one write (an object is replaced whole or
    not at all)."""
    fs, path = fsspec.core.url_to_fs(str(uri))
    if isinstance(fs, LocalFileSystem):
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, text)
        except OSError as e:
            raise StateWriteError(path, e, what) from None
    else:
        fs.pipe_file(path, text.encode() if isinstance(text, str) else text)


def append_text(path: Path, text: str, what: str = "log") -> None:
    """Add `text` to the end of a local log (runtime/atomic.py's `append_atomic`): a write that fails
    (StateWriteError) leaves the log as it was, never a torn line."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        append_atomic(path, text)
    except OSError as e:  # a full disk, a read-only one, a folder in its place
        raise StateWriteError(path, e, what) from None


def log_line(prefix: str, event: str, fields: Mapping[str, object], when: float | None = None) -> str:
    """One event line of a controller or supervisor log: `<prefix> <UTC time> <event> key=value ...`."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when))
    return " ".join([prefix, stamp, event, *(f"{k}={v}" for k, v in fields.items())])
