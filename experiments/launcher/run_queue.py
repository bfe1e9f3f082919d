"""The programme runs itself: a durable queue of experiment variants on one or more preemptible TPU
slices, each variant supervised, with a ledger of pod-hours, results and status
(`launch.py programme submit | run | status | stop | retry | skip`).

State: one directory per programme (default outputs/programmes/<name>/):
  programme.json  what was submitted (variants in order, slices, budget, overrides); only the budget changes
  ledger.json     every variant's state, attempts, supervision record (experiments/launcher/supervise.py),
                  pod time, last step, result, each launch's time by category; every slice's READY
                  clock and idle time; pod-hours over time; the records are typed and versioned in
                  experiments/launcher/ledger.py (`"schema": 3`; a ledger written before is read as it is)
  controller.log  one `[programme] <UTC time> <event> key=value ...` line per event
  commands/       stop / retry / skip / budget requests, each with an id, applied once by the controller
  logs/           each variant's launch output; launch-logs/: each launch's (pod.launch_pod)
The state is mirrored (--mirror, e.g. gs://BUCKET/programmes/<name>) after every change as one
object, state.json (the submission and the ledger of one moment, with the ledger's save count
`seq`), beside a copy of controller.log; a controller on another machine takes over from it
(`programme run NAME --mirror URI`; a mirror written before state.json, as three files, is read
too). Requests are left on the mirror as well (<mirror>/commands/): a controller running
elsewhere looks there every MIRROR_POLL_S seconds.

Consistency: every change to the submission and the ledger is made under `State.lock`, and a
save writes a copy taken under it (`State.save`), so slice threads changing their variants'
records never tear a save. A variant's state changes only through ledger.move (the table
ledger.TRANSITIONS; docs/OPERATIONS.md's state table).

One controller at a time: it holds a lease on the state directory and the mirror (runtime/lease.py:
a second controller is refused in one line; a controller that died leaves a lease that is taken
over once stale, at once on the same host when its process is gone).

The controller (`Controller.run`): one thread per slice takes the next queued variant (plan order,
or cheapest first), runs it under the supervisor's logic (create or re-create the slice, set up,
launch with the variant's fixed run id, resume after preemptions) until it completes or fails for
good, and takes the next; a slice with nothing left to run is deleted. A variant whose run has
completed (its `completed` event beside its checkpoints, or a committed checkpoint at its final
step) is never launched again.

Failure classes:
  permanent       bad input, non-finite loss, does not fit: the variant is failed with its one
                  line; the queue moves on (`programme retry` queues it again)
  infrastructure  handled inside the variant's supervision (relaunch, backoff); a variant whose
                  supervision gives up (restarts without progress, creates refused) is failed with
                  the cause, or queued again at the back when the slice could not be had; when the
                  same one ends `--infra-streak` variants in a row (default 3) the controller stops
                  with one line instead of burning through the queue
  credentials, a request GCP refuses (a wrong flag): the controller stops at once, in one line
Budget: no variant starts when the pod-hours spent plus its planned pod-hours (the plan's CSV)
would exceed --budget; the controller says so in one line and lets the running ones finish.

Pod-hours are the slices' READY hours (what GCP bills; the plan's unit, the whole slice held);
host-hours are that times the hosts. A variant is charged the READY time of its slice while it
held it (from the slice taking it to its run there ending; a controller that died in between
leaves the mark, and the next one charges it); a slice's READY time while it holds no variant is
its idle time, the programme's. Where each one's time went: experiments/launcher/account.py.

Damage and faults (`State.load`, `repair`): every file is read through one loader that checks it
against its typed record (programme.json, ledger.json, the mirror's state.json; the directory's
files and folders where they belong) before anything is written: a damaged one is one line
(ledger.RecordError) naming it and the good copy, and `programme repair` restores the state from
the mirror's. Every write of the state goes through runtime/atomic.py (ledger.write_text,
append_text): one that fails is ledger.StateWriteError (exit 6), its file as it was. Names follow
the trainer's rules (runtime/ranges.py); a request file that cannot be applied is said once
(`command-ignored`) and dropped.

Exit codes of `run`: 0 nothing left to run (every variant completed, failed or skipped), the
budget reached, or stopped by `programme stop`; 1 stopped on a repeated infrastructure failure;
2 bad input (preflight), a damaged state file, a held lease, no credentials, a refused request;
6 a state file that cannot be written; 130 interrupted.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import errno
import io
import json
import math
import os
import secrets
import shlex
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, TextIO

import fsspec

from experiments.launcher import pod, supervise
from experiments.launcher.gcloud import Target
from experiments.launcher.account import charge, idle_from, idle_until, live_ready_seconds, mark
from experiments.launcher.ledger import (SCHEMA, Command, ControllerStatus, Ledger, Move, ReadyClock, RecordError,
                                         SliceRecord, Snapshot, StateWriteError, Status, Streak, Strict,
                                         SupervisionRecord, VariantRecord, VariantState, Verb, append_text, can_move,
                                         decode, dumps, load_ledger, load_snapshot, log_line, move, parse_json,
                                         read_state, to_text, write_text)
from experiments.programme import GROUPS
from runtime import events
from runtime.errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_STORAGE, EXIT_USER_ERROR, UserError, one_line
from runtime.events import Kind
from runtime.lease import LEASE_FILE, Lease, LeaseHeld
from runtime.ranges import Rule, at_least, name_problem, range_problem

SNAPSHOT = "state.json"  # the mirror's copy of the state: one object
COMMANDS = "commands"  # requests for the controller, in the directory and on the mirror
MIRROR_POLL_S = 10.0  # how often a controller looks for requests on the mirror
KEEP_APPLIED = 200  # ids of the last requests applied, kept in the ledger (a request is applied once)
BUDGET: Rule = (at_least(0), "pod-hours")  # --budget, `programme budget HOURS` and a budget request's value
FILES = {"programme.json": "submission", "ledger.json": "ledger", "controller.log": "controller log"}
FOLDERS = {COMMANDS: "the controller's requests", "logs": "each variant's output",
           "launch-logs": "each launch's output"}


@dataclass
class Submission(Strict):
    """What `programme submit` was asked (programme.json, read strictly as the ledger's records)."""
    name: str
    variants: list[str]  # "group/variant", in the order they run
    slices: list[str]
    zone: str
    accelerator_type: str
    runtime_version: str
    project: str | None = None
    tier: str | None = None
    queued: bool = False  # create each slice through a queued resource <slice>-qr
    budget: float | None = None  # pod-hours
    planned: dict[str, dict] = field(default_factory=dict)  # variant -> {"pod_hours": h, "steps": n} (the plan's CSV)
    overrides: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    forward_env: list[str] = field(default_factory=list)
    repo_dir: str = pod.DEFAULT_REPO_DIR
    clone_url: str | None = None
    mirror: str | None = None
    max_restarts: int = 10
    poll_s: float = 30.0
    backoff_s: float = 120.0
    stop_grace_s: float = 30.0
    create_attempts: int = 3
    infra_streak: int = 3
    checkpoint_dirs: dict[str, str] = field(default_factory=dict)  # variant -> its run's checkpoint directory
    total_steps: dict[str, int] = field(default_factory=dict)  # variant -> its steps, where known before its run
    resident: bool = True  # a slice's variants run back to back in resident trainers (worker/resident.py)

    def run_id(self, variant: str) -> str:
        """The variant's fixed run id (every launch resumes its checkpoint): letters, digits, . _ -."""
        raw = f"{self.name}-{variant.replace('/', '-')}"
        return "".join(c if c.isalnum() or c in "._-" else "-" for c in raw)[:64]

    def overrides_of(self, variant: str) -> list[str]:
        """The trainer's overrides: the experiment, the programme's own, and its name as a W&B tag."""
        given = [o for o in self.overrides if not o.startswith("run.wandb.tags=")]
        tags = next((o.split("=", 1)[1].strip("[]") for o in self.overrides if o.startswith("run.wandb.tags=")), "")
        tags = ",".join(t for t in [*tags.split(","), self.name] if t.strip())
        return [f"+experiment={variant}", *given, f"run.wandb.tags=[{tags}]"]

    def spec(self, variant: str, slice_name: str, state_dir: Path) -> supervise.Spec:
        return supervise.Spec(
            Target(slice_name, self.zone, self.project), self.run_id(variant), self.overrides_of(variant),
            accelerator_type=self.accelerator_type, runtime_version=self.runtime_version, tier=self.tier,
            queued_resource=f"{slice_name}-qr" if self.queued else None, max_restarts=self.max_restarts,
            repo_dir=self.repo_dir, log_dir=state_dir / "launch-logs", env=dict(self.env),
            forward_env=list(self.forward_env), poll_s=self.poll_s, max_poll_s=max(self.poll_s, 300.0),
            storage_backoff_s=self.backoff_s, stop_grace_s=self.stop_grace_s, clone_url=self.clone_url,
            at_end="keep", create_attempts=self.create_attempts, events_file=self.events_file(variant),
            resident=self.resident)

    def events_file(self, variant: str) -> str | None:
        """The variant's events beside its checkpoints (runtime/run_files.py), when its directory is known."""
        directory = self.checkpoint_dirs.get(variant)
        return f"{directory.rstrip('/')}/run_files/{events.FILE}" if directory else None

    def planned_hours(self, variant: str) -> float | None:
        return (self.planned.get(variant) or {}).get("pod_hours")


# --- preflight -------------------------------------------------------------------------------------

def read_plan(path: Path) -> dict[str, dict]:
    """{group/variant: {"pod_hours", "steps", "step_s"}} from a CSV of `launch.py plan`; one that cannot
    be read as such (missing, another CSV, a number that is not one) is one line (UserError)."""
    planned = {}
    try:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                if row["variant"] == "TOTAL" or row["group"] == "ALL":
                    continue
                hours = float(row["pod_hours"]) if row["pod_hours"] else None
                if hours is not None and (not math.isfinite(hours) or range_problem(hours, BUDGET)):
                    raise ValueError(f"pod_hours {hours} of {row['group']}/{row['variant']}")
                planned[f"{row['group']}/{row['variant']}"] = {
                    "pod_hours": hours, "steps": int(row["steps"]) if row["steps"] else None,
                    "step_s": float(row["step_s"]) if row["step_s"] else None,
                    "executables": row.get("executables") or ""}
    except (OSError, UnicodeDecodeError, KeyError, ValueError, TypeError, csv.Error) as e:
        detail = f"no column {e}" if isinstance(e, KeyError) else getattr(e, "strerror", None) or str(e)
        raise UserError(f"--plan {path} cannot be read as the CSV of `launch.py plan` ({detail}); give the file that "
                        "`launch.py plan GROUP ... --csv PATH` wrote") from None
    return planned


def with_executables(overrides: list[str], planned: dict[str, dict], variants: list[str]) -> list[str]:
    """The programme's overrides, with `run.executables=FOLDER` when its plan kept the variants'
    steps compiled ahead in FOLDER (`plan --executables`), priced so, and the overrides do not say
    otherwise: the runs read what the budget assumed they would."""
    folders = sorted({(planned.get(v) or {}).get("executables") or "" for v in variants} - {""})
    if not folders or any(o.split("=", 1)[0].lstrip("+") == "run.executables" for o in overrides):
        return overrides
    if len(folders) > 1:
        raise UserError(f"--plan keeps the variants' steps compiled ahead in {len(folders)} folders ({', '.join(folders)}); "
                        "plan them into one (plan --executables FOLDER) or give -- run.executables=FOLDER")
    return [*overrides, f"run.executables={folders[0]}"]


def check_run_ids(sub: Submission) -> None:
    """Each variant's run id is its own (they are cut at 64 characters: a long programme name would
    give two variants one id, and one would resume the other's checkpoint)."""
    seen: dict[str, str] = {}
    for variant in sub.variants:
        other = seen.setdefault(sub.run_id(variant), variant)
        if other != variant:
            raise UserError(f"{other} and {variant} would share the run id {sub.run_id(variant)!r} (run ids are "
                            "<programme>-<group>-<variant>, cut at 64 characters): choose a shorter programme NAME")


def choose_variants(groups: list[str], only: list[str]) -> list[str]:
    """group/variant of the groups (`all`: every group) in plan order, or just `only` of them
    (each `group/variant`, or a variant name of any of the groups)."""
    from experiments.compose import variants as group_variants  # here: JAX and Hydra take seconds; only submit and run compose

    names = list(GROUPS) if groups == ["all"] else groups
    unknown = [g for g in names if g not in GROUPS]
    if unknown:
        raise UserError(f"unknown group(s) {unknown}; the groups are {list(GROUPS)} (or all)")
    chosen = [f"{g}/{v}" for g in names for v in group_variants(g)]
    if not only:
        return chosen
    picked = [c for c in chosen if c in only or c.split("/", 1)[1] in only]
    missing = [o for o in only if not any(c == o or c.split("/", 1)[1] == o for c in picked)]
    if missing:
        raise UserError(f"no variant(s) {missing} in {names}; `launch.py list {' '.join(names)}` shows them")
    return picked


def preflight(sub: Submission) -> list[str]:
    """One line per problem of a variant: its config does not compose or validate, its dataset on
    gs:// is missing, no planned pod-hours under a budget; and the budget must cover the first.
    Fills in each variant's checkpoint directory."""
    from runtime import hydra_compose  # here: JAX and Hydra take seconds; only submit and run compose
    from runtime.config import run_dirs

    problems = []
    for variant in sub.variants:
        try:  # under the workers' environment (PODRUNNER_DATA names the data), os.environ untouched
            config = hydra_compose.composed(sub.overrides_of(variant), env=sub.env)
        except Exception as e:  # noqa: BLE001 - what the trainer would say, in one line
            problems.append(f"{variant}: {' '.join(str(e).split())[:300]}")
            continue
        sub.checkpoint_dirs[variant] = run_dirs(config)[1]
        total = config.train.steps or (sub.planned.get(variant) or {}).get("steps")  # epochs: the plan's count
        if total:
            sub.total_steps[variant] = int(total)
        if str(config.data.path).startswith("gs://") and not _exists(str(config.data.path)):
            problems.append(f"{variant}: dataset {config.data.path} does not exist")
        if sub.budget is not None and sub.planned_hours(variant) is None:
            problems.append(f"{variant}: no planned pod-hours for the budget: give --plan with the CSV of "
                            "`launch.py plan` for these groups")
    first = sub.variants[0] if sub.variants else None
    if first and sub.budget is not None and (sub.planned_hours(first) or 0.0) > sub.budget:
        problems.append(f"{first}: its planned {sub.planned_hours(first):.3f} pod-hours exceed the budget "
                        f"{sub.budget:g}: raise --budget")
    return problems


def _exists(url: str) -> bool:
    try:
        fs, path = fsspec.core.url_to_fs(url)
        return fs.exists(path)
    except Exception:  # noqa: BLE001 - an unreachable bucket is as good as missing here
        return False


# --- state ---------------------------------------------------------------------------------------

class State:
    """The programme's directory: submission, ledger, event log, commands; mirrored after each change.

    Locks, always taken in this order: `lock` (every change to the submission and the ledger is made
    holding it), `write_lock` (one writer of the files at a time), `log_lock` (controller.log and
    the console). A save takes a copy of the ledger under `lock` and writes it outside; of two saves
    the later copy (`Ledger.seq`) is the one left on disk and on the mirror."""

    def __init__(self, directory: Path, stream: TextIO | None = None) -> None:
        self.dir = Path(directory)
        self.stream = stream or sys.stdout
        self.lock = threading.RLock()
        self.write_lock = threading.Lock()
        self.log_lock = threading.Lock()
        self.sub: Submission | None = None
        self.ledger = Ledger()
        self.written = -1  # the seq of the ledger on disk
        self.mirror_failed = self.mirror_unread = False  # said once until the mirror answers again
        self.ignored: set[str] = set()  # requests said to be unusable (each said once)

    @property
    def name(self) -> str:
        return self.dir.name

    def create(self, sub: Submission) -> None:
        """A new programme's files: the submission, its `submitted` event, the ledger (and the mirror's
        snapshot). A write that fails (StateWriteError) removes what this call wrote: nothing is left
        half-submitted, and what was there before is as it was."""
        made = [p for p in (self.dir, *(self.dir / name for name in FILES)) if not p.exists()]
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StateWriteError(self.dir, e, "programme's folder") from None
        self.sub = sub
        self.ledger = Ledger(variants={v: VariantRecord(order=i, run_id=sub.run_id(v))
                                       for i, v in enumerate(sub.variants)},
                             slices={s: SliceRecord() for s in sub.slices})
        try:
            self.save_submission()
            self.event("submitted", variants=len(sub.variants), slices=",".join(sub.slices), state=self.dir)
            self.save()  # the ledger, then the mirror's snapshot: last, once the rest is here
        except StateWriteError:
            for path in reversed(made):
                with contextlib.suppress(OSError):
                    path.rmdir() if path == self.dir else path.unlink()
            raise

    def good_copy(self, mirror: str | None) -> str | None:
        """Where an intact copy of the state is and how to restore it (the mirror's snapshot), or None."""
        if not mirror:
            return None
        return (f"{mirror}/{SNAPSHOT} (`launch.py programme repair {self.name} --state-dir {self.dir.parent} "
                f"--mirror {mirror}`)")

    def load(self, mirror: str | None = None) -> None:
        """From the directory, or (a controller on another machine) first from the mirror. Every file is
        checked against its record before anything is written: a damaged one (not JSON, of another
        shape, a folder in its place, unreadable, or a ledger that does not fit its submission) is one
        line (ledger.RecordError, or a UserError for the folders) naming it, what is wrong and the
        good copy (the mirror's)."""
        good_copy = self.good_copy(mirror)
        self.check_layout()
        paths = {name: self.dir / name for name in FILES}
        if mirror and not paths["programme.json"].exists() and not paths["ledger.json"].exists():
            self.fetch(mirror)
        raw: dict[str, bytes | None] = {}
        for name in ("programme.json", "ledger.json"):
            try:
                raw[name] = read_state(paths[name], FILES[name], good_copy=good_copy,
                                       fresh="submit the programme again")
            except FileNotFoundError:
                raw[name] = None
        if raw["programme.json"] is None and raw["ledger.json"] is None:
            raise UserError(f"no programme at {self.dir}" + (f" nor at {mirror}" if mirror else "") +
                            "; submit it first (launch.py programme submit)")
        for name, other in (("programme.json", "ledger.json"), ("ledger.json", "programme.json")):
            if raw[name] is None:
                raise RecordError(FILES[name], paths[name], "missing", good_copy=good_copy,
                                  fresh="submit the programme again", wrong=f"is missing beside its {other}")
        sub = submission_of(parse_json(raw["programme.json"], what="submission", file=paths["programme.json"],
                                       good_copy=good_copy, fresh="submit the programme again"),
                            paths["programme.json"], good_copy)
        good_copy = good_copy or self.good_copy(sub.mirror)
        ledger = load_ledger(raw["ledger.json"], paths["ledger.json"], good_copy)
        check_fits(sub, ledger, paths["programme.json"], paths["ledger.json"], good_copy)
        self.sub, self.ledger = sub, ledger

    def check_writable(self) -> None:
        """The directory can be made and written (a read-only file system, no permission, a file on
        its path: StateWriteError before a submit's preflight; a full disk shows at the first write)."""
        here = self.dir
        while not here.exists() and here != here.parent:
            here = here.parent
        if not here.is_dir():
            raise StateWriteError(self.dir, NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR)),
                                  "programme's folder")
        read_only = os.statvfs(here).f_flag & os.ST_RDONLY
        if read_only or not os.access(here, os.W_OK):
            code = errno.EROFS if read_only else errno.EACCES
            raise StateWriteError(self.dir, OSError(code, os.strerror(code)), "programme's folder")

    def check_layout(self) -> None:
        """The directory, its files and its folders are what they should be (before anything is read
        or written): a file where a folder goes, or a folder where a file goes, is one line."""
        if self.dir.exists() and not self.dir.is_dir():
            raise UserError(f"the programme's state {self.dir} is a file, where its folder should be; move it away "
                            "(or give another --state-dir) and run the same command again")
        for name, what in FILES.items():
            path = self.dir / name
            if path.exists() and not path.is_file():  # a folder, or a pipe that reading would wait on forever
                kind = "a folder" if path.is_dir() else "no regular file"
                raise UserError(f"the {what} {path} is {kind}, where its file should be; move it away and run the "
                                "same command again")
        for name, what in FOLDERS.items():
            path = self.dir / name
            if path.exists() and not path.is_dir():
                raise UserError(f"{path} is a file, where the folder of {what} should be; move it away and run the "
                                "same command again")

    def fetch(self, mirror: str) -> None:
        """The mirror's state into the directory (read_mirror: all of it read and checked first),
        programme.json last; a write that fails removes what this call wrote."""
        made = []
        try:
            for name, text in read_mirror(mirror).items():
                if not (self.dir / name).exists():
                    made.append(self.dir / name)
                write_text(self.dir / name, text, FILES[name])
        except StateWriteError:
            for path in made:
                path.unlink(missing_ok=True)
            raise

    def save(self) -> None:
        """Write the ledger (its text taken under the lock), then the mirror's snapshot."""
        with self.lock:
            self.ledger.seq += 1
            seq, text = self.ledger.seq, to_text(self.ledger)
            snapshot = (to_text(Snapshot(schema=SCHEMA, seq=seq, submission=asdict(self.sub), ledger=self.ledger))
                        if self.sub and self.sub.mirror else None)
        with self.write_lock:
            if seq <= self.written:  # a later copy is on disk already
                return
            write_text(self.dir / "ledger.json", text, "ledger")  # StateWriteError: the ledger on disk as it was
            self.written = seq
            if snapshot is not None:
                self.push(snapshot)

    def push(self, snapshot: str) -> None:
        """The mirror's copy: the controller's log, then the snapshot (state.json, one object: the
        submission and the ledger of one moment). A failure is said once; the next save tries again."""
        mirror = self.sub.mirror
        try:
            log = self.dir / "controller.log"
            if log.exists():
                write_text(f"{mirror}/controller.log", log.read_text())
            write_text(f"{mirror}/{SNAPSHOT}", snapshot)
            self.mirror_failed = False
        except Exception as e:  # noqa: BLE001 - the local state stands
            if not self.mirror_failed:
                self.mirror_failed = True
                self.event("mirror-failed", uri=mirror, detail=shlex.quote(" ".join(str(e).split())[:200]))

    def event(self, name: str, **fields) -> None:
        line = log_line("[programme]", name, fields)
        with self.log_lock:
            append_text(self.dir / "controller.log", line + "\n", "controller log")
            self.stream.write(line + "\n")
            self.stream.flush()

    def command(self, verb: Verb, variant: str | None = None, value: float | None = None,
                mirror: str | None = None) -> Command:
        """Leave a request for the controller, here and on the mirror (a controller on another machine
        reads it there); it applies it once, now or when it next starts."""
        command = Command(id=f"{time.time_ns()}-{secrets.token_hex(3)}", verb=verb, variant=variant, value=value)
        text = to_text(command)
        write_text(self.dir / COMMANDS / f"{command.id}.json", text, "request")
        mirror = mirror or (self.sub.mirror if self.sub else None)
        if mirror:
            try:
                write_text(f"{mirror}/{COMMANDS}/{command.id}.json", text)
            except Exception as e:  # noqa: BLE001 - the local copy stands
                print(f"WARNING cannot leave the request on the mirror {mirror} ({' '.join(str(e).split())[:200]}): "
                      "only a controller on this machine sees it", file=sys.stderr, flush=True)
        return command

    def save_submission(self) -> None:
        with self.lock:
            text = dumps(asdict(self.sub))
        write_text(self.dir / "programme.json", text, "submission")

    def commands(self, mirror: bool = False) -> list[Command]:
        """The requests left since the last call (each file taken once read), in the order they were
        made: the directory's, and with `mirror` the mirror's too. A file that is no usable request
        (not JSON, fields of the wrong type or missing, a budget that is no number of pod-hours, a
        folder) is said once in one `command-ignored` line, its copies here and on the mirror one
        request, and dropped."""
        found: dict[str, Command] = {}
        folder = self.dir / COMMANDS
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            try:
                raw = path.read_bytes()
            except OSError as e:  # a folder named like a request: said once, left where it is
                self._ignore(path.stem, path, str(e.strerror or e))
                continue
            self._take_command(raw, path, found)
            try:
                path.unlink(missing_ok=True)
            except OSError as e:  # the directory turned read-only: as any state write
                raise StateWriteError(path, e, "request") from None
        if mirror and self.sub.mirror:
            try:
                fs, root = fsspec.core.url_to_fs(self.sub.mirror)
                for path in sorted(fs.glob(f"{root}/{COMMANDS}/*.json")):
                    where = f"{self.sub.mirror}/{COMMANDS}/{Path(path).name}"
                    try:
                        raw = fs.cat_file(path)
                    except OSError as e:  # a folder named like a request: said once, left where it is
                        self._ignore(Path(path).stem, where, str(e.strerror or e))
                        continue
                    self._take_command(raw, where, found)
                    fs.rm_file(path)
                self.mirror_unread = False
            except Exception as e:  # noqa: BLE001 - the mirror out of reach: the next poll tries again
                if not self.mirror_unread:
                    self.mirror_unread = True
                    self.event("mirror-commands-failed", uri=self.sub.mirror,
                               detail=shlex.quote(" ".join(str(e).split())[:200]))
        return [found[key] for key in sorted(found)]

    def _take_command(self, raw: bytes, where: object, found: dict[str, Command]) -> None:
        stem = Path(str(where)).stem
        try:
            data = json.loads(raw)
        except ValueError as e:
            return self._ignore(stem, where, f"not JSON ({e})")
        if isinstance(data, dict):  # a request left before requests had ids: its file's name
            data.setdefault("id", stem)
        key = data["id"] if isinstance(data, dict) and isinstance(data["id"], str) else stem
        try:
            command = decode(Command, data, what="request", file=where)
        except RecordError as e:
            return self._ignore(key, where, f"{e.field}: {e.problem}" if e.field else e.problem)
        problem = command_problem(command)
        if problem:
            return self._ignore(key, where, problem)
        found[command.id] = command

    def _ignore(self, key: str, where: object, reason: str) -> None:
        """A request that cannot be applied: one `command-ignored` line, once (by its id, or its file's
        name: the copy here and the one on the mirror are one request)."""
        if key in self.ignored:
            return
        self.ignored.add(key)
        self.event("command-ignored", id=shlex.quote(key), file=shlex.quote(str(where)),
                   reason=shlex.quote(" ".join(reason.split())[:300]))


def read_mirror(mirror: str) -> dict[str, str]:
    """The state files the mirror holds, checked as a local state is ({} when it holds none): from its
    snapshot (state.json), or the three files a mirror written before the snapshot holds; in the
    order they are written, programme.json last (a programme is there once it is)."""
    try:
        fs, root = fsspec.core.url_to_fs(mirror)
        files: dict[str, str] = {}
        if fs.exists(f"{root}/{SNAPSHOT}"):
            where = f"{mirror}/{SNAPSHOT}"
            snapshot = load_snapshot(fs.cat_file(f"{root}/{SNAPSHOT}"), where)
            sub = decode(Submission, snapshot.submission, what="programme snapshot", file=where,
                         fresh="take over from the directory's own files", prefix=("submission",))
            check_fits(sub, snapshot.ledger, where, where, None)
            files = {"ledger.json": to_text(snapshot.ledger), "programme.json": dumps(asdict(sub))}
        elif fs.exists(f"{root}/programme.json") and fs.exists(f"{root}/ledger.json"):
            text = {name: fs.cat_file(f"{root}/{name}") for name in ("programme.json", "ledger.json")}
            sub = submission_of(parse_json(text["programme.json"], what="submission", file=f"{mirror}/programme.json"),
                                f"{mirror}/programme.json", None)
            ledger = load_ledger(text["ledger.json"], f"{mirror}/ledger.json")
            check_fits(sub, ledger, f"{mirror}/programme.json", f"{mirror}/ledger.json", None)
            files = {"ledger.json": to_text(ledger), "programme.json": dumps(asdict(sub))}
        if files and fs.exists(f"{root}/controller.log"):
            files = {"controller.log": fs.cat_file(f"{root}/controller.log").decode(errors="replace"), **files}
        return files
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - out of reach, no credentials: said in one line
        raise UserError(f"cannot read the programme's mirror {mirror} ({one_line(e)[:200]}); check the URI and "
                        "access to it, then run the same command again") from None


def command_problem(command: Command) -> str | None:
    """What makes a request of the right types unusable, or None: a budget needs its value (pod-hours,
    as `programme budget` checks it); skip and retry need a variant."""
    if command.verb == Verb.BUDGET:
        if command.value is None:
            return "value: missing (a budget request holds the pod-hours)"
        problem = range_problem(command.value, BUDGET)
        return f"value: {command.value:g} is out of range: {problem}" if problem else None
    if command.verb in (Verb.SKIP, Verb.RETRY) and not command.variant:
        return f"variant: missing (a {command.verb} request names its variant)"
    return None


def check_fits(sub: Submission, ledger: Ledger, sub_file: object, file: object, good_copy: str | None) -> None:
    """The ledger (`file`) is the one of this submission (`sub_file`): the same variants and slices
    (each submitted once), and each slice's own variant one of them; else RecordError naming the field."""
    names = [("name", sub.name), *(("slices", n) for n in sub.slices),
             *(("variants", part) for v in sub.variants for part in v.split("/", 1))]
    unsafe = next(((f, n) for f, n in names if name_problem(n)), None)  # checked as `programme submit` does
    problems = [("variants", "names a variant twice", len(set(sub.variants)) < len(sub.variants)),
                ("slices", "names a slice twice", len(set(sub.slices)) < len(sub.slices)),
                ("slices", "names no slice", not sub.slices)]
    if unsafe:
        problems.append((unsafe[0], f"{unsafe[1][:60]!r} is no safe name: {name_problem(unsafe[1])}", True))
    for field_, problem, bad in problems:
        if bad:
            raise RecordError("submission", sub_file, problem, field=field_, good_copy=good_copy,
                              fresh="submit the programme again")
    for field_, held, submitted in (("variants", ledger.variants, sub.variants), ("slices", ledger.slices, sub.slices)):
        if set(held) != set(submitted):
            raise RecordError("ledger", file, f"{sorted(held)} where programme.json has {sorted(submitted)}",
                              field=field_, good_copy=good_copy, fresh="submit the programme again")
    for name, record in ledger.slices.items():
        if record.variant is not None and record.variant not in ledger.variants:
            raise RecordError("ledger", file, f"{record.variant!r} is no variant of the programme",
                              field=f'slices["{name}"].variant', good_copy=good_copy,
                              fresh="submit the programme again")


def submission_of(data: dict, file: object, good_copy: str | None) -> Submission:
    """programme.json's data as a Submission (strictly, as the ledger's records), or RecordError."""
    data = {k: v for k, v in data.items() if k != "schema"}
    return decode(Submission, data, what="submission", file=file, good_copy=good_copy,
                  fresh="submit the programme again")


class VariantSupervision(supervise.Supervision):
    """A variant's supervision record inside the programme's ledger (changed under the ledger's
    lock), its events in the controller's log and the variant's own."""

    prefix = "[programme]"

    def __init__(self, state: State, variant: str, slice_name: str) -> None:
        self.state, self.variant, self.slice = state, variant, slice_name
        self.lock, self.mirror = state.lock, None
        with state.lock:
            held = state.ledger.variants[variant]
            self.record = held.supervision
            self.record.run_id = self.record.run_id or held.run_id
            self.record.zone = self.record.zone or state.sub.zone
            self.record.tpu = slice_name
        self.log_path = state.dir / "logs" / f"{variant.replace('/', '__')}.log"
        try:
            self.log_path.parent.mkdir(exist_ok=True)
            self.stream = open(self.log_path, "a", encoding="utf-8")
        except OSError as e:
            raise StateWriteError(self.log_path, e, "variant's log") from None
        self.path = state.dir / "ledger.json"

    def save(self) -> None:
        self.state.save()

    def event(self, name: str, **fields) -> None:
        self.state.event(name, variant=self.variant, slice=self.slice, **fields)
        try:
            self.stream.write(log_line(self.prefix, name, fields) + "\n")
            self.stream.flush()
        except OSError as e:
            raise StateWriteError(self.log_path, e, "variant's log") from None


# --- the controller ------------------------------------------------------------------------------

class Stop(Exception):
    """The controller stops, said in one line, with an exit code."""

    def __init__(self, line: str, code: int) -> None:
        super().__init__(line)
        self.line, self.code = line, code


class Controller:
    """Runs the programme's queue on its slices until nothing is left (see the module docstring).
    Every change of a variant's state goes through ledger.move (the transition table)."""

    def __init__(self, state: State, *, alert: Callable[[str, str], None] | None = None,
                 sleep_s: float = 0.5, mirror_poll_s: float = MIRROR_POLL_S) -> None:
        self.state, self.sub, self.ledger = state, state.sub, state.ledger
        self.alert = alert or Alerts(state.sub).send
        self.stop = threading.Event()
        self.stopping: Stop | None = None  # why the controller stops (None: the queue ran out)
        self.budget_line: str | None = None
        self.supervisors: dict[str, supervise.Supervisor] = {}  # running variant -> its supervisor
        self.sleep_s = sleep_s  # how often the directory's requests are looked for
        self.mirror_poll_s = mirror_poll_s  # how often the mirror's
        self.mirror_polled: float | None = None
        self.lock = state.lock

    # -- time and money

    def clock(self, slice_name: str) -> ReadyClock:
        return self.ledger.slices[slice_name].clock

    def spent_hours(self, now: float | None = None) -> float:
        """Pod-hours: the slices' READY hours so far."""
        return sum(s.clock.ready_total(now) for s in self.ledger.slices.values()) / 3600

    def ahead_hours(self) -> float:
        """Pod-hours the running variants are still planned to take (their plan less what they spent):
        on several slices, a new variant must fit the budget beside them."""
        return sum(max(0.0, (self.sub.planned_hours(variant) or 0.0) - live_ready_seconds(self.ledger, record) / 3600)
                   for variant, record in self.ledger.variants.items()
                   if record.state == VariantState.RUNNING and record.mark and record.slice in self.ledger.slices)

    def note_spending(self) -> None:
        self.ledger.history.append((round(time.time(), 3), round(self.spent_hours(), 6)))

    # -- the queue

    def _queued(self) -> list[str]:
        """The queued variants a slice may take, in queue order (call under the lock)."""
        return sorted((v for v, r in self.ledger.variants.items() if r.state == VariantState.QUEUED
                       and not self._held(v)), key=lambda v: self.ledger.variants[v].order)

    def coming(self) -> list[str] | None:
        """The overrides of the variant a slice would take next (the first queued one), if any: a
        resident trainer compiles its steps ahead (experiments/launcher/worker/resident.py)."""
        with self.lock:
            queued = self._queued()
        return self.sub.overrides_of(queued[0]) if queued else None

    def take(self, slice_name: str) -> str | None:
        """The variant this slice runs next: its own that was running when the controller stopped
        (its processes may still run there), else the first queued one; None when nothing is left
        or the budget would be exceeded (said once)."""
        with self.lock:
            if self.stop.is_set() or self.budget_line:
                return None
            own = self.ledger.slices[slice_name].variant
            if own and self.ledger.variants[own].state in (VariantState.QUEUED, VariantState.RUNNING):
                return self._start(own, slice_name)
            queued = self._queued()
            if not queued:
                return None
            variant = queued[0]
            planned = self.sub.planned_hours(variant) or 0.0
            ahead = self.ahead_hours() if self.sub.budget is not None else 0.0
            if self.sub.budget is not None and self.spent_hours() + planned <= self.sub.budget < (
                    self.spent_hours() + ahead + planned):
                # It fits only if the running variants end under their plans: this slice is given
                # back, and the slice of the last one running takes it then, if it still fits.
                self.state.event("budget-wait", variant=variant, slice=slice_name, ahead=f"{ahead:.3f}")
                return None
            if self.sub.budget is not None and self.spent_hours() + planned > self.sub.budget:
                self.budget_line = (f"budget: {variant} not started: {self.spent_hours():.3f} pod-hours spent + "
                                    f"{planned:.3f} planned > budget {self.sub.budget:g}; to go on, raise it: "
                                    f"launch.py programme budget {self.state.name} HOURS")
                self.state.event("budget-stop", variant=variant, spent=f"{self.spent_hours():.3f}",
                                 planned=f"{planned:.3f}", budget=self.sub.budget)
                return None
            return self._start(variant, slice_name)

    def _held(self, variant: str) -> bool:
        """Another slice's own variant (it resumes there)."""
        return any(s.variant == variant for s in self.ledger.slices.values())

    def _start(self, variant: str, slice_name: str) -> str:
        with self.lock:
            record = self.ledger.variants[variant]
            move(record, Move.START)
            charge(record, self.ledger.slices)  # the slice it held when a controller died: its own time
            record.slice, record.started = slice_name, record.started or time.time()
            record.attempts += 1
            idle_until(self.ledger.slices[slice_name], taken=True)
            record.mark = mark(self.clock(slice_name))
            self.ledger.slices[slice_name].variant = variant
        self.state.save()
        return variant

    def already_complete(self, variant: str) -> dict | None:
        """A run that needs no launch: the `completed` event beside its checkpoints, else its newest
        committed checkpoint at its final step (the event lost: the run stopped right after that
        commit, or copying its events failed). None when neither, or when they cannot be read from
        here (the trainer then finds out)."""
        directory = self.sub.checkpoint_dirs.get(variant)
        if not directory:
            return None
        try:
            said = events.read(self.sub.events_file(variant))
        except Exception:  # noqa: BLE001 - unreadable here: the checkpoints may still tell
            said = []
        completed = [e for e in said if e.get("event") == Kind.COMPLETED]
        if completed:
            return completed[-1]
        totals = [e["total"] for e in said if e.get("event") == Kind.STARTED and isinstance(e.get("total"), int)]
        total = totals[-1] if totals else self.sub.total_steps.get(variant)
        if not total:
            return None
        try:
            # Not at the top: Orbax adds a second to every `programme` command, for a check only the controller makes.
            from runtime.checkpointing import newest_committed

            newest = newest_committed(directory)
        except Exception:  # noqa: BLE001 - as above
            return None
        if newest is None or newest[0] < total:
            return None
        return {"event": Kind.COMPLETED, "step": newest[0], "metrics": newest[1].get("metrics"), "from": "checkpoint"}

    # -- one variant on one slice

    def record_left_in_flight(self, variant: str, slice_name: str) -> None:
        """The launch a controller that died left in flight, its run since found complete: recorded from
        the run's events beside its checkpoints (where its time went, its steps)."""
        with self.lock:
            if not self.ledger.variants[variant].supervision.in_flight:
                return
        sup = VariantSupervision(self.state, variant, slice_name)
        try:
            supervise.Supervisor(self.sub.spec(variant, slice_name, self.state.dir), sup, self.clock(slice_name),
                                 owns_slice=False, report=lambda line: None).record_unwatched(down=False)
        finally:
            sup.stream.close()

    def run_variant(self, variant: str, slice_name: str) -> None:
        done = self.already_complete(variant)
        if done is not None:
            self.record_left_in_flight(variant, slice_name)
            self.state.event("skipped-complete", variant=variant, step=done.get("step"),
                             seen=done.get("from", "completed-event"))
            with self.lock:
                launches = self.ledger.variants[variant].supervision.launches
                total = launches[-1].total if launches else None
            self.end(variant, slice_name, Move.COMPLETE, metrics=done.get("metrics"), last_step=done.get("step"),
                     total=total)
            return
        sup = VariantSupervision(self.state, variant, slice_name)
        spec = dataclasses.replace(self.sub.spec(variant, slice_name, self.state.dir), next_overrides=self.coming)
        supervisor = supervise.Supervisor(spec, sup, self.clock(slice_name), owns_slice=False, report=lambda line: None)
        with self.lock:
            stopping = self.stop.is_set()
            if not stopping:
                self.supervisors[variant] = supervisor
        if stopping:
            sup.stream.close()
            return self.end(variant, slice_name, Move.REQUEUE)
        try:
            supervisor.run()
        except supervise.Unavailable as e:  # the slice could not be had: back of the queue
            self.end(variant, slice_name, Move.REQUEUE, line=e.line, failure=e.kind, back=True)
            self.infrastructure(variant, e.kind, e.line)
            return
        finally:
            with self.lock:
                self.supervisors.pop(variant, None)
            sup.stream.close()
        with self.lock:
            record = sup.record
            status, end, skip = record.status, record.end, self.ledger.variants[variant].skip
            last = record.launches[-1] if record.launches else None
        result = dict(last_step=last.last_step if last else None, total=last.total if last else None,
                      wandb=last.wandb_run_id if last else None)
        if status == Status.COMPLETED:
            self.end(variant, slice_name, Move.COMPLETE, metrics=last.metrics if last else None, **result)
            self.streak_reset()
        elif status == Status.INTERRUPTED:
            self.end(variant, slice_name, Move.SKIP if skip else Move.REQUEUE, **result)
        elif status == Status.FAILED and end and end.cause in ("gcloud-refused", "gcloud-credentials"):
            raise Stop(end.line or "gcloud refused a request", end.code or EXIT_USER_ERROR)  # none fares better
        elif status == Status.FAILED:
            line = (end.line if end else None) or (last.line or last.cause if last else None)
            self.end(variant, slice_name, Move.FAIL, line=line, failure=last.cause if last else None, **result)
            self.alert(f"{self.state.name}: {variant} failed", line or "")
        else:  # gave up: restarts without progress or past --max-restarts
            cause = (last.cause if last else None) or str(status)
            line = (last.line if last else None) or f"gave up: {cause}"
            self.end(variant, slice_name, Move.FAIL, line=line, failure=cause, **result)
            self.alert(f"{self.state.name}: {variant} failed", f"gave up after restarts: {cause}")
            self.infrastructure(variant, cause, (last.line if last else None) or cause)

    def end(self, variant: str, slice_name: str, how: Move, *, back: bool = False, metrics: dict | None = None,
            line: str | None = None, failure: str | None = None, last_step: int | None = None,
            total: int | None = None, wandb: str | None = None) -> None:
        """The variant's run on the slice ended: charge it the slice's READY time since it started
        there, record what it got to, and move it (`how`)."""
        with self.lock:
            record = self.ledger.variants[variant]
            charge(record, self.ledger.slices)
            for name, value in (("line", line), ("failure", failure), ("last_step", last_step), ("total", total)):
                if value is not None:
                    setattr(record, name, value)
            state = move(record, how)
            if how == Move.SKIP:
                record.skip = False  # honoured
            record.ended = time.time()
            record.wandb_run_id = wandb or record.wandb_run_id
            if metrics is not None:
                record.metrics = metrics
            if back:
                record.order = max(r.order for r in self.ledger.variants.values()) + 1
            if self.ledger.slices[slice_name].variant == variant:
                self.ledger.slices[slice_name].variant = None
            if self.ledger.slices[slice_name].variant is None:
                idle_from(self.ledger.slices[slice_name])
            self.note_spending()
        self.state.save()
        self.state.event("variant-" + state, variant=variant, slice=slice_name,
                         **({"failure": shlex.quote(str(failure))} if failure else {}))

    # -- repeated infrastructure failures

    def infrastructure(self, variant: str, kind: str, line: str) -> None:
        with self.lock:
            streak = self.ledger.controller.streak
            if streak.kind != kind:
                streak.kind, streak.variants = kind, []
            if variant not in streak.variants:
                streak.variants.append(variant)
            count = len(streak.variants)
        self.state.save()
        if count >= self.sub.infra_streak:
            raise Stop(f"the same infrastructure failure ended {count} variants in a row ({kind}: {line}); fix it, "
                       f"then `launch.py programme run {self.state.name}` carries on", EXIT_FAILURE)

    def streak_reset(self) -> None:
        with self.lock:
            self.ledger.controller.streak = Streak()
        self.state.save()

    # -- the slices

    def slice_worker(self, slice_name: str) -> None:
        try:
            while not self.stop.is_set():
                variant = self.take(slice_name)
                if variant is None:
                    break
                self.run_variant(variant, slice_name)
            if not self.stop.is_set():
                self.release(slice_name)
        except Stop as e:
            self.halt(e)
        except supervise.GiveUp as e:
            self.halt(Stop(str(e), EXIT_USER_ERROR))
        except UserError as e:  # a state file could not be written (StateWriteError): all stop, in its line
            self.halt(Stop(str(e), e.exit_code))
        except Exception as e:  # noqa: BLE001 - a bug: stop the others too, with its line
            self.halt(Stop(f"controller thread of {slice_name} crashed: {type(e).__name__}: {e}", EXIT_FAILURE))
            raise

    def release(self, slice_name: str) -> None:
        """Nothing left for this slice: delete it (its READY time ends)."""
        supervisor = supervise.Supervisor(
            supervise.Spec(Target(slice_name, self.sub.zone, self.sub.project), f"{self.state.name}-{slice_name}", [],
                           at_end="delete"), _SliceRecord(self.state, slice_name), self.clock(slice_name))
        state, _ = supervise.tpu_state(supervisor.spec, supervisor.run_gcloud)
        if state != supervise.TpuState.MISSING:
            supervisor.release_tpu(Status.COMPLETED)
        else:
            supervisor.gone(time.time())
        with self.lock:
            idle_until(self.ledger.slices[slice_name], taken=False)
            self.note_spending()
        self.state.save()

    def halt(self, why: Stop) -> None:
        """Stop everything: the running variants checkpoint and stop, no new one starts."""
        with self.lock:
            if self.stopping is None:
                self.stopping = why
            self.stop.set()
            running = list(self.supervisors.values())
        for supervisor in running:
            supervisor.interrupt()

    # -- requests (programme stop | skip | retry | budget)

    def apply_commands(self, *, mirror: bool | None = None) -> None:
        """Apply the requests left since the last look; the mirror's every `mirror_poll_s` (or when
        `mirror` says)."""
        now = time.monotonic()
        if mirror is None:
            mirror = self.mirror_polled is None or now - self.mirror_polled >= self.mirror_poll_s
        if mirror:
            self.mirror_polled = now
        for command in self.state.commands(mirror=mirror):
            self.apply(command)

    def apply(self, command: Command) -> None:
        """One request, once (the ledger keeps the ids of those applied: one left both here and on the
        mirror is one request)."""
        with self.lock:
            applied = self.ledger.controller.applied
            if command.id in applied:
                return
            applied.append(command.id)
            del applied[:-KEEP_APPLIED]
        verb, variant = command.verb, command.variant
        self.state.event("command", verb=verb, variant=variant or "-")
        if verb == Verb.STOP:
            self.state.save()
            self.halt(Stop("stopped by `programme stop`: the running variants checkpointed", 0))
            return
        if verb == Verb.BUDGET:
            with self.lock:
                self.sub.budget, self.budget_line = command.value, None
            self.state.save_submission()
            self.state.save()
            return
        interrupt = None
        with self.lock:
            record = self.ledger.variants.get(variant)
            if record is None:
                self.state.event("command-ignored", reason=shlex.quote(f"no variant {variant}"))
            elif verb == Verb.RETRY and can_move(record.state, Move.RETRY):
                move(record, Move.RETRY)
                record.line = record.failure = None
                record.supervision.restarts, record.supervision.status = 0, Status.RUNNING
            elif verb == Verb.SKIP and record.state == VariantState.RUNNING:
                record.skip = True  # skipped once it has stopped
                interrupt = self.supervisors.get(variant)
            elif verb == Verb.SKIP and can_move(record.state, Move.SKIP):
                move(record, Move.SKIP)
            else:
                self.state.event("command-ignored", reason=shlex.quote(f"{variant} is {record.state}"))
        self.state.save()
        if interrupt is not None:
            threading.Thread(target=interrupt.interrupt, daemon=True).start()

    def run(self) -> int:
        """Until nothing is left to run, the budget is reached, or a stop; the exit code."""
        self.recover()
        with self.lock:
            self.ledger.controller.status = ControllerStatus.RUNNING
            self.ledger.controller.pid, self.ledger.controller.started = os.getpid(), time.time()
        self.state.save()
        self.state.event("start", programme=self.state.name, variants=len(self.ledger.variants),
                         slices=",".join(self.sub.slices), budget=self.sub.budget if self.sub.budget is not None else "none",
                         spent=f"{self.spent_hours():.3f}")
        self.apply_commands(mirror=True)
        workers = [threading.Thread(target=self.slice_worker, args=(s,), name=f"slice-{s}", daemon=True)
                   for s in self.sub.slices]
        for w in workers:
            w.start()
        while any(w.is_alive() for w in workers):
            try:
                try:
                    self.apply_commands()
                except UserError as e:  # a state file could not be written (StateWriteError): all stop, in its line
                    if not self.stop.is_set():
                        self.halt(Stop(str(e), e.exit_code))
                time.sleep(self.sleep_s)  # how often requests are looked for
            except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (`run` turns it into this)
                self.halt(Stop("interrupted: the running variants checkpointed; run it again to carry on",
                               EXIT_INTERRUPTED))
        return self.finish()

    def recover(self) -> None:
        """A controller killed mid-run: its variants were running; each resumes on its own slice
        (a skip asked meanwhile is honoured once it has stopped)."""
        with self.lock:
            for record in self.ledger.variants.values():
                if record.state == VariantState.RUNNING:
                    move(record, Move.REQUEUE)
        self.state.save()

    def finish(self) -> int:
        with self.lock:
            for record in self.ledger.variants.values():
                if record.skip and record.state == VariantState.QUEUED:
                    move(record, Move.SKIP)
                record.skip = False
            why = self.stopping
            if why is not None:
                status, line, code = ControllerStatus.STOPPED, why.line, why.code
            elif self.budget_line:
                status, line, code = ControllerStatus.BUDGET, self.budget_line, 0
            else:
                status, line, code = ControllerStatus.DONE, None, 0
            controller = self.ledger.controller
            controller.status, controller.line, controller.ended = status, line, time.time()
            self.note_spending()
            counts = {s: sum(r.state == s for r in self.ledger.variants.values())
                      for s in (VariantState.COMPLETED, VariantState.FAILED, VariantState.SKIPPED, VariantState.QUEUED)}
        self.state.save()
        self.state.event("controller-" + status, code=code, spent=f"{self.spent_hours():.3f}", **counts)
        if line:
            print(f"error: {line}" if code else line, file=sys.stderr if code else sys.stdout, flush=True)
        if status == ControllerStatus.STOPPED and code:
            self.alert(f"{self.state.name}: the controller stopped", line or "")
        return code


class _SliceRecord(supervise.Supervision):
    """The record a slice's own release writes to (never saved: the slice's clock is the ledger's):
    events into the controller's log."""

    prefix = "[programme]"

    def __init__(self, state: State, slice_name: str) -> None:
        self.state, self.slice, self.stream = state, slice_name, io.StringIO()
        self.lock, self.mirror = state.lock, None
        self.record = SupervisionRecord(status=Status.RELEASED)
        self.path = state.dir / "ledger.json"

    def save(self) -> None:
        self.state.save()

    def event(self, name: str, **fields) -> None:
        self.state.event(name, slice=self.slice, **fields)


class Alerts:
    """wandb.alert on a failed variant and when the controller stops, when W&B is online (the
    programme's runs log online, as their composed config says, and WANDB_API_KEY is set here);
    else nothing. The alerts go to a run of their own in the runs' project."""

    def __init__(self, sub: Submission) -> None:
        self.sub = sub
        self.wandb = self.runs_wandb(sub) if os.environ.get("WANDB_API_KEY") else None
        self.online = self.wandb is not None and str(getattr(self.wandb.mode, "value", self.wandb.mode)) == "online"
        self.run = None
        self.warned = False

    @staticmethod
    def runs_wandb(sub: Submission):
        """The W&B settings of the programme's runs (its first variant's composed config), or None."""
        from runtime import hydra_compose  # here: JAX and Hydra take seconds; only submit and run compose

        try:
            return hydra_compose.composed(sub.overrides_of(sub.variants[0])).run.wandb if sub.variants else None
        except Exception:  # noqa: BLE001 - the preflight said why; no alerts then
            return None

    def send(self, title: str, text: str) -> None:
        if not self.online:
            return
        try:
            import wandb  # optional and heavy: only when an alert is sent

            if self.run is None:
                self.run = wandb.init(project=self.wandb.project, entity=self.wandb.entity,
                                      name=f"programme-{self.sub.name}", id=f"programme-{self.sub.name}",
                                      job_type="programme", tags=[self.sub.name], resume="allow")
            self.run.alert(title=title, text=text[:1000])
        except Exception as e:  # noqa: BLE001 - an alert never stops the programme
            if not self.warned:
                self.warned = True
                print(f"WARNING wandb.alert failed ({type(e).__name__}: {e}); the controller log has the events",
                      file=sys.stderr, flush=True)


# --- commands ------------------------------------------------------------------------------------

def hold_lease(state: State):
    """The programme's lease (state directory and mirror): a second controller is refused in one line."""
    targets = [(str(state.dir), f"programme {state.name}", "--state-dir")]
    if state.sub and state.sub.mirror:
        targets.append((state.sub.mirror, f"programme {state.name} (mirror)", "--mirror"))

    def lost(error) -> None:  # another controller took over: this one must not launch anything more
        print(f"error: {error}", file=sys.stderr, flush=True)
        os._exit(EXIT_STORAGE)

    try:
        return Lease(targets, run=f"programme/{state.name}", on_lost=lost).acquire()
    except LeaseHeld:
        raise
    except UserError as e:
        if isinstance(e.__cause__, OSError):  # the state directory cannot be written: as any state write
            raise StateWriteError(state.dir / LEASE_FILE, e.__cause__, "controller's lease") from None
        raise


def run(state_dir: Path, mirror: str | None = None, *, stream: TextIO | None = None,
        alert: Callable[[str, str], None] | None = None) -> int:
    """`programme run`: take the lease, then run the controller to its end. SIGTERM (systemd's
    stop) is handled as Ctrl-C: the running variants checkpoint, the controller exits 130."""
    state = State(state_dir, stream)
    state.load(mirror)
    if mirror and not state.sub.mirror:
        state.sub.mirror = mirror
    lease = hold_lease(state)  # LeaseHeld: the caller says it in one line
    previous = signal.signal(signal.SIGTERM, _interrupt) if threading.current_thread() is threading.main_thread() else None
    try:
        return Controller(state, alert=alert).run()
    finally:
        lease.release()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def repair(state_dir: Path, mirror: str | None) -> str:
    """`programme repair`: a state directory whose programme.json or ledger.json is damaged or missing,
    or with a file or folder where one of its folders or files goes, gets the mirror's state (read
    and checked whole first): what was in the way is moved into damaged-<UTC time>/ inside it, the
    mirror's files are written (the directory's own controller.log is kept). Refused in one line,
    nothing changed, when the directory's state reads, when the mirror holds no good copy, or while
    a controller runs (the lease). Returns the line to print."""
    state = State(state_dir, io.StringIO())
    try:
        state.load()
    except UserError:
        pass  # the damage this repairs
    else:
        raise UserError(f"nothing to repair: the programme's state at {state.dir} reads (ledger save "
                        f"{state.ledger.seq}); `programme status {state.name}` shows it")
    if state.dir.exists() and not state.dir.is_dir():
        state.check_layout()  # its line: move the file away
    mirror = mirror or submitted_mirror(state.dir / "programme.json")
    if not mirror:
        raise UserError(f"give the mirror to restore {state.dir} from: `programme repair {state.name} --mirror URI` "
                        "(its programme.json names none, or cannot be read)")
    files = read_mirror(mirror)
    if not files:
        raise UserError(f"the mirror {mirror} holds no programme ({SNAPSHOT}) to restore {state.dir} from; restore "
                        "its files from another copy, or move the directory away and submit the programme again")
    try:
        state.dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StateWriteError(state.dir, e, "programme's folder") from None
    lease = hold_lease(state)
    aside = state.dir / f"damaged-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    moved: list[Path] = []
    try:
        in_the_way = [state.dir / name for name in ("programme.json", "ledger.json") if (state.dir / name).exists()]
        in_the_way += [state.dir / name for name in ("controller.log", *FOLDERS)
                       if (state.dir / name).exists() and (state.dir / name).is_dir() != (name in FOLDERS)]
        try:
            if in_the_way:
                aside.mkdir()
            for path in in_the_way:
                path.rename(aside / path.name)
                moved.append(path)
            for name, text in files.items():
                if not (name == "controller.log" and (state.dir / name).exists()):
                    write_text(state.dir / name, text, FILES[name])
        except (OSError, StateWriteError) as e:  # put back what was there: the directory as it was
            for name in ("programme.json", "ledger.json"):
                if state.dir / name not in moved:
                    (state.dir / name).unlink(missing_ok=True)
            for path in moved:
                (aside / path.name).rename(path)
            with contextlib.suppress(OSError):
                aside.rmdir()
            raise e if isinstance(e, StateWriteError) else StateWriteError(aside, e, "damaged files' folder") from None
    finally:
        lease.release()
    seq = json.loads(files["ledger.json"])["seq"]
    kept = f"; what was in the way is in {aside}" if moved else ""
    return (f"restored {state.dir} from the mirror {mirror} (ledger save {seq}){kept}; "
            f"`programme run {state.name}` carries on")


def submitted_mirror(path: Path) -> str | None:
    """The mirror a programme.json names, or None (none, or the file cannot be read)."""
    try:
        return submission_of(parse_json(read_state(path, "submission"), what="submission", file=path), path,
                             None).mirror
    except (OSError, UserError):
        return None


def _interrupt(_sig, _frame) -> None:
    raise KeyboardInterrupt
