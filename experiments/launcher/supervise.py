"""Supervise one run on a preemptible TPU VM slice until it completes (`launch.py supervise`).

The loop (`Supervisor.run`): ensure_ready (describe; create, re-create or wait), ensure_setup
(versions, setup when they differ), launch (`pod.launch_pod` with the run's fixed id), then what
the trainer's events and the exit code say decides what follows. The loop, its table of endings,
the state (supervision.json), the events and the pod time (`ReadyClock`) are in
docs/OPERATIONS.md, "Running a multi-week run unattended". The vocabulary is typed
(experiments/launcher/ledger.py: `Outcome`, `Status`, `Cause`); failure classes and their
policies are the trainer's (runtime/events.py's `Failure`). The run queue's controller
(experiments/launcher/controller.py) runs each variant through a Supervisor of its own.
"""

from __future__ import annotations

import contextlib
import enum
import io
import json
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence, TextIO

import fsspec

from experiments.launcher import gcloud, pod
from experiments.launcher.account import launch_timing
from experiments.launcher.gcloud import Runner, Shape, run_quiet
from experiments.launcher.ledger import (Cause, End, InFlight, LaunchRecord, LaunchTiming, Outcome, ReadyClock,
                                         Status, SupervisionRecord, append_text, as_json, load_supervision, log_line,
                                         read_state, supervision_text, write_text)
from runtime import events, wire
from runtime.errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_PREEMPTED, EXIT_USER_ERROR
from runtime.events import Failure, Kind, Policy


class TpuState(enum.StrEnum):
    """The states of a TPU VM node and of a queued resource that the loop compares (gcloud's words),
    and two of ours: MISSING (gcloud says NOT_FOUND) and UNKNOWN (the describe failed)."""
    READY = "READY"
    CREATING = "CREATING"
    PREEMPTED = "PREEMPTED"
    TERMINATED = "TERMINATED"
    PROVISIONING = "PROVISIONING"  # a queued resource's, from here on
    ACTIVE = "ACTIVE"
    FAILED = "FAILED"
    SUSPENDED = "SUSPENDED"
    MISSING = "MISSING"
    UNKNOWN = "UNKNOWN"


GONE = (TpuState.PREEMPTED, TpuState.TERMINATED)  # must be deleted before the name can be created again
QUEUE_DEAD = (TpuState.FAILED, TpuState.SUSPENDED)  # delete (--force: with its node) and queue again


@dataclass
class Spec:
    """What to create and how to run: the TPU, its tier, the run, the timings."""
    target: pod.Target
    run_id: str
    overrides: list[str]
    accelerator_type: str | None = None
    runtime_version: str | None = None
    tier: str | None = None  # "spot", "reserved" or None (on demand)
    queued_resource: str | None = None
    max_restarts: int = 10
    repo_dir: str = pod.DEFAULT_REPO_DIR
    log_dir: Path = pod.DEFAULT_LOG_DIR
    env: dict[str, str] = field(default_factory=dict)
    forward_env: list[str] = field(default_factory=list)
    poll_s: float = 30.0  # first wait while CREATING/queued; grows x1.5 up to 300 s (or poll_s, if longer)
    storage_backoff_s: float = 120.0
    stop_grace_s: float = 30.0
    state_mirror: str | None = None  # gs://.../supervision.json beside the checkpoints (see state_mirror)
    ship: pod.Pack | None = None  # --ship: the working tree packed once, sent with every launch
    clone_url: str | None = None  # setup clones the repo from here where it is missing (fresh disks)
    at_end: str | None = None  # "delete" or "keep" the TPU when the run ends; None: delete when state_mirror is set
    create_attempts: int | None = None  # refused creates in a row before giving up (None: never; wait instead)
    events_file: str | None = None  # the run's events.jsonl beside its checkpoints (runtime/run_files.py), if readable
    owner: str | None = None  # a programme's slices: labelled with it at create, and only those it labels deleted

    @property
    def shape(self) -> Shape:
        return Shape(self.accelerator_type, self.runtime_version, self.tier, self.queued_resource, self.owner)


# --- state and events ---------------------------------------------------------------------------

class Supervision:
    """A supervision record, the lock every change to it is made under (see `changing`), the file it
    is saved in (`path`) and the stream its events go to. Each holder defines `save()` and
    `event(name, **fields)`: supervision.json (`FileSupervision`), or a programme's ledger
    (experiments/launcher/controller.py)."""

    prefix = "[supervise]"

    def __init__(self, record: SupervisionRecord, lock: threading.RLock, stream: TextIO, path: Path) -> None:
        self.record, self.lock, self.stream, self.path = record, lock, stream, path

    def host_seconds(self, clock: ReadyClock) -> float:
        """The host-seconds this run was charged: here the slice's own (a programme's variant: its
        share of the slice, experiments/launcher/controller.py)."""
        return clock.host_total()

    @contextlib.contextmanager
    def changing(self) -> Iterator[SupervisionRecord]:
        """Change the record under its lock, then save it (the holder's `save`)."""
        with self.lock:
            yield self.record
        self.save()


class FileSupervision(Supervision):
    """The run's supervision record in <log dir>/<run id>/supervision.json (and its mirror), its
    events in supervise.log beside it."""

    def __init__(self, spec: Spec, stream: TextIO) -> None:
        folder = Path(spec.log_dir) / spec.run_id
        self.log_path, self.mirror = folder / "supervise.log", spec.state_mirror
        self.write_lock = threading.Lock()  # saves one at a time, each writing a copy at least as new as the last
        path = folder / "supervision.json"
        record = load(path, self.mirror) or self.load_mirror() or SupervisionRecord(
            run_id=spec.run_id, tpu=spec.target.tpu, zone=spec.target.zone)
        super().__init__(record, threading.RLock(), stream, path)

    def save(self) -> None:
        with self.write_lock:
            with self.lock:
                text = supervision_text(self.record)  # a copy taken under the lock
            write_text(self.path, text, "supervision record")  # killed or failing mid-write: the previous record stays
            if self.mirror:
                try:
                    write_text(self.mirror, text)
                except Exception as e:  # noqa: BLE001 - the local record stands; the next save tries again
                    self.event("state-mirror-failed", uri=self.mirror,
                               detail=shlex.quote(" ".join(str(e).split())[:200]))

    def load_mirror(self) -> SupervisionRecord | None:
        """The record beside the checkpoints, when this machine has none (a supervisor moved here)."""
        if not self.mirror:
            return None
        try:
            with fsspec.open(self.mirror, "r") as f:
                return load_supervision(f.read(), self.mirror)
        except FileNotFoundError:
            return None

    def event(self, name: str, **fields) -> None:
        line = log_line(self.prefix, name, fields)
        append_text(self.log_path, line + "\n", "supervisor's log")  # StateWriteError: the log as it was
        self.stream.write(line + "\n")
        self.stream.flush()


def load(path: Path, mirror: str | None = None) -> SupervisionRecord | None:
    """The record at `path`, None when there is none; one that cannot be read (not JSON, of another
    shape, a folder in its place, unreadable) is one line (ledger.RecordError, naming `mirror` as
    the good copy): it is the run's history, so it is never replaced silently."""
    good_copy = mirror or "a copy beside the checkpoints, when they are on gs://"
    try:
        text = read_state(path, "supervision record", good_copy=good_copy, fresh="start a new history for this run id")
    except FileNotFoundError:
        return None
    return load_supervision(text, path, good_copy)


# --- what went wrong for good -------------------------------------------------------------------

class GiveUp(Exception):
    """GCP refused a request in a way that waiting does not fix (a wrong flag, no permission)."""


class NoCredentials(GiveUp):
    """gcloud has no valid credentials: the message is gcloud's own line."""


class Unavailable(Exception):
    """The slice cannot be had: creates refused `attempts` times in a row (quota, stockout); `kind`
    names the refusal (a programme stops when the same one repeats across variants)."""

    def __init__(self, kind: Cause, line: str) -> None:
        super().__init__(line)
        self.kind, self.line = kind, line


# --- 1. the TPU ---------------------------------------------------------------------------------

def tpu_state(spec: Spec, run: Runner) -> tuple[str, int, str | None]:
    """(state as gcloud says it, number of workers, its gcloud.OWNER_LABEL or None); MISSING when
    gcloud says NOT_FOUND."""
    node = _described(run, gcloud.describe_argv(spec.target))
    if not isinstance(node, dict):
        return node, 0, None
    owner = (node.get("labels") or {}).get(gcloud.OWNER_LABEL)
    return node.get("state", TpuState.UNKNOWN), len(node.get("networkEndpoints") or []), owner


def queue_state(spec: Spec, run: Runner) -> tuple[str, str | None]:
    """(the queued resource's state, the OWNER_LABEL it gives its node or None); MISSING when gcloud
    says NOT_FOUND."""
    queued = _described(run, gcloud.queued_describe_argv(spec.target, spec.shape))
    if not isinstance(queued, dict):
        return queued, None
    if not isinstance(queued.get("state"), dict):
        return TpuState.UNKNOWN, None
    try:
        owner = queued["tpu"]["nodeSpec"][0]["node"]["labels"].get(gcloud.OWNER_LABEL)
    except (KeyError, IndexError, TypeError, AttributeError):  # no node spec with labels: no owner said
        owner = None
    return queued["state"].get("state", TpuState.UNKNOWN), owner


def _described(run: Runner, argv: list[str]) -> dict | TpuState:
    """A describe's JSON object (stdout's; a stderr notice may follow it); MISSING when gcloud says
    NOT_FOUND, UNKNOWN when the describe failed or said no object."""
    code, out = run(argv)
    if code != 0:
        _check_credentials(out)
        return TpuState.MISSING if gcloud.not_found(out) else TpuState.UNKNOWN
    try:
        found = json.JSONDecoder().raw_decode(out, out.index("{"))[0]
    except ValueError:
        return TpuState.UNKNOWN
    return found if isinstance(found, dict) else TpuState.UNKNOWN


def _check_credentials(out: str) -> None:
    line = gcloud.auth_failure(out)
    if line:
        raise NoCredentials(f"gcloud has no valid credentials ({line}); run `gcloud auth login` (or `gcloud config "
                            "set account ACCOUNT`) and start this command again")


# --- the loop -----------------------------------------------------------------------------------

class Supervisor:
    """One run kept going on one slice (see the module docstring). `clock` counts the slice's READY
    time. `interrupt()` (from another thread) ends the loop at its next step, the run checkpointed.
    `owns_slice`: the run's end decides the slice's fate (--at-end) and stops its clock; a
    programme's variant leaves both to the programme. `report` says a stopping error (one line)."""

    def __init__(self, spec: Spec, sup: Supervision, clock: ReadyClock, *, run: Runner = run_quiet,
                 sleep: Callable[[float], None] | None = None, owns_slice: bool = True,
                 report: Callable[[str], None] | None = None) -> None:
        self.spec, self.sup, self.clock, self.run_gcloud = spec, sup, clock, run
        self.stop = threading.Event()
        self.sleep = sleep or self.stop.wait  # a wait that an interrupt cuts short
        self.owns_slice = owns_slice
        self.report = report or (lambda line: print(f"error: {line}", file=sys.stderr, flush=True))
        self.gcloud_proc: subprocess.Popen | None = None
        self.seen_down = False  # the TPU was seen gone, missing or being created since this supervisor started
        self.setup_from: float | None = None  # when the READY time before the next launch began (its setup)
        self.setup_carry = 0.0  # setup seconds of rounds whose setup failed: the next launch's
        self.setup_ran = False  # setup ran (not only the versions check) since the last launch
        self.billing_stopped: float | None = None  # when the clock last stopped (a preempted trainer goes on past it)
        self.queue_asked: float | None = None  # when the queued resource was last described

    def act(self, argv: list[str], event: str) -> tuple[int, str]:
        """Run a gcloud command and say it; GCP refusing it for good (or no credentials) raises."""
        code, out = self.run_gcloud(argv)
        self.sup.event(event if code == 0 else event + "-failed", code=code,
                       **({} if code == 0 else {"detail": shlex.quote(" ".join(out.split())[-300:])}))
        if code != 0:
            _check_credentials(out)
            if gcloud.refused(out):
                raise GiveUp(f"`{shlex.join(argv[:5])}` was refused: {gcloud.error_line(out)}; fix the flags")
        return code, out

    def create(self, argv: list[str], event: str) -> None:
        """A create (TPU or queued resource); after `create_attempts` refusals in a row: Unavailable."""
        code, out = self.act(argv, event)
        with self.sup.changing() as record:
            record.create_refusals = 0 if code == 0 else record.create_refusals + 1
            refusals = record.create_refusals
        if code and self.spec.create_attempts and refusals >= self.spec.create_attempts:
            kind = Cause.QUOTA if gcloud.quota(out) else Cause.CREATE_REFUSED
            raise Unavailable(kind, f"{refusals} creates of {self.spec.target.tpu} refused in a row "
                                    f"({gcloud.error_line(out)})")

    def gone(self, at: float) -> None:
        with self.sup.changing():
            if self.clock.ready_since is not None:
                self.billing_stopped = at
            self.clock.gone(at)

    def went(self, seen: float) -> float:
        """When a TPU seen gone at `seen` went: when the trainer acted on its preemption (its
        `preempted` event, beside the checkpoints: a supervisor started again after that sees it
        only now), else `seen`."""
        since = self.clock.ready_since
        if since is None:
            return seen
        noticed = [e.get("noticed") for e in self.run_events() if e.get("event") == Kind.PREEMPTED]
        return min([seen, *(t for t in noticed if isinstance(t, (int, float)) and t > since)])

    def theirs(self, owner: str | None) -> bool:
        """A TPU labelled with another owner than this spec's (gcloud.OWNER_LABEL): never deleted here."""
        return owner is not None and owner != (gcloud.owner_label(self.spec.owner) if self.spec.owner else None)

    def step_towards_ready(self, state: str, owner: str | None = None) -> str | None:
        """One action for a TPU that is not READY: create, delete + create, or nothing (wait: also for
        a gone TPU another owner labelled, which that owner re-creates). The queued resource's state as
        it was seen (None: no queued resource)."""
        spec, target, shape = self.spec, self.spec.target, self.spec.shape
        if state != TpuState.UNKNOWN:
            self.gone(self.went(time.time()))
        if state in GONE and self.theirs(owner):
            self.sup.event("waiting", tpu_state=state, owner=owner)
            return None
        if spec.queued_resource:
            self.queue_asked = time.time()
            queued, owner = queue_state(spec, self.run_gcloud)
            if queued in QUEUE_DEAD and self.theirs(owner):  # another owner's to delete and queue again
                self.sup.event("waiting", tpu_state=state, queued_state=queued, owner=owner)
                return queued
            if queued in QUEUE_DEAD:
                self.act(gcloud.queued_delete_argv(target, shape), "queued-resource-deleted")
                queued = state = TpuState.MISSING  # --force deleted its node too
            if queued == TpuState.MISSING:
                if state in GONE:
                    self.act(gcloud.delete_argv(target), "tpu-deleted")
                self.create(gcloud.queued_create_argv(target, shape), "queued-resource-created")
            else:
                self.sup.event("waiting", tpu_state=state, queued_state=queued)
            return queued
        if state in GONE:
            self.act(gcloud.delete_argv(target), "tpu-deleted")
            state = TpuState.MISSING
        if state == TpuState.MISSING:
            self.create(gcloud.create_argv(target, shape), "tpu-created")
        else:
            self.sup.event("waiting", tpu_state=state)
        return None

    def ensure_ready(self) -> int:
        """Wait until the TPU is READY (creating it as needed); its number of workers."""
        wait, looked_again = self.spec.poll_s, False
        while not self.stop.is_set():
            asked = time.time()
            state, hosts, owner = tpu_state(self.spec, self.run_gcloud)
            if state in (*GONE, TpuState.MISSING, TpuState.CREATING):
                self.seen_down = True
            if state == TpuState.READY:
                with self.sup.changing():  # READY since that describe, or since the queue said its node was made
                    self.clock.ready(self.queue_asked if looked_again and self.queue_asked else asked, hosts)
                self.sup.event("tpu-ready", hosts=hosts)
                return hosts
            queued = self.step_towards_ready(state, owner)
            if queued == TpuState.ACTIVE and not looked_again:  # its node is made: describe it now, once (the
                looked_again = True  # READY time starts at the describe that sees it)
                continue
            looked_again = False
            self.sleep(wait)
            # While the TPU is being made, every poll_s (the ledger's READY time starts at the describe that
            # sees it, so it is short of GCP's by at most one poll interval per creation, docs/BILL.md);
            # while queued or gone, longer and longer
            being_made = state == TpuState.CREATING or queued == TpuState.PROVISIONING
            wait = self.spec.poll_s if being_made else min(wait * 1.5, max(self.spec.poll_s, 300.0))
        return 0

    # --- 2. setup

    def ensure_setup(self, hosts: int) -> int:
        """0 when every worker's .venv fits and all report the same versions (setup skipped), else
        setup's code. The commit the workers first ran is recorded, and a later setup (a re-created
        TPU's fresh clone would otherwise be at the remote's default HEAD) checks that commit out."""
        spec, sup = self.spec, self.sup
        rows: list[dict] = []
        code = pod.run_gcloud(gcloud.ssh_argv(spec.target, pod.versions_command(spec.repo_dir)),
                              on_line=lambda l: rows.append(r) if (r := wire.versions(l)) else None)
        if code == 0 and not sup.record.setup_pending and pod.versions_agree(rows, hosts):
            sup.event("setup-skipped", reason="versions-match", workers=len(rows))
            self.record_commit(rows)
            return 0
        if sup.record.setup_pending:
            why = "the last setup failed"
        elif len(rows) != hosts:
            why = f"{len(rows)} of {hosts} workers answered"
        else:
            why = next((f"{r.get('host')}: {r['problem']}" for r in rows if r.get("problem")), "versions differ")
        git_ref = sup.record.commit
        self.setup_ran = True
        sup.event("setup-started", workers_answering=len(rows), commit=git_ref or "as-cloned",
                  reason=shlex.quote(str(why)[:200]))
        rows = []
        code = pod.setup_pod(spec.target, repo_dir=spec.repo_dir, git_ref=git_ref, clone_url=spec.clone_url,
                             stream=sup.stream, on_versions=rows.append)
        with sup.changing() as record:
            record.setup_pending = code != 0  # a failed setup is run again, whatever the versions say then
        sup.event("setup-done" if code == 0 else "setup-failed", code=code)
        if code == 0:
            self.record_commit(rows)
        return code

    def record_commit(self, rows: list[dict]) -> None:
        """Keep the first commit every worker agreed on (the run's code for its whole life)."""
        if self.sup.record.commit is None and rows and rows[0].get("commit"):
            with self.sup.changing() as record:
                record.commit = rows[0]["commit"]

    # --- 3. the launch, 4. how it ended

    def launch_once(self, hosts: int) -> tuple[str, int, "LaunchEvents"]:
        """Launch the run, record the launch; (outcome, exit code, what the trainer said)."""
        spec, sup = self.spec, self.sup

        def on_progress(seen: LaunchEvents) -> None:  # the launch under way, for status pages, at each checkpoint
            with sup.changing() as record:
                if record.launch is not None:
                    launch = record.launch
                    launch.first_step, launch.last_step, launch.total = seen.first_step, seen.last_step, seen.total
                    launch.wandb_run_id = seen.run_id
                    launch.timing = launch_timing(list(seen.timings), setup=launch.setup) if seen.timings else None

        seen = LaunchEvents(on_progress)
        started = time.time()
        setup = self.setup_carry + (max(0.0, started - self.setup_from) if self.setup_from is not None else 0.0)
        setup_ran, self.setup_carry, self.setup_from, self.setup_ran = self.setup_ran, 0.0, None, False
        sup.event("launch", run_id=spec.run_id, attempt=len(sup.record.launches) + 1)
        with sup.changing() as record:
            record.in_flight = True
            record.launch = InFlight(started=started, setup=round(setup, 3))
        code = pod.launch_pod(spec.target, spec.overrides, repo_dir=spec.repo_dir, run_id=spec.run_id,
                              log_dir=spec.log_dir, env=spec.env, forward_env=spec.forward_env,
                              interrupt_grace=spec.stop_grace_s, ship=spec.ship or False, stream=sup.stream,
                              on_line=seen.line, on_gcloud=self._gcloud_started)
        self.gcloud_proc = None
        state_after = billed_until = None
        if code != 0 or seen.stopped_at() is not None:  # the TPU may have gone, even under a run that completed
            looked = time.time()
            state_after = tpu_state(spec, self.run_gcloud)[0]
            if state_after not in (TpuState.READY, TpuState.UNKNOWN):  # it went when a worker was told to stop
                billed_until = min(looked, seen.stopped_at() or looked)
                self.gone(billed_until)
        outcome = classify(code, seen, state_after)
        said_cause = cause(code, outcome, seen)
        if self.stop.is_set() and outcome not in (Outcome.COMPLETED, Outcome.FATAL) and state_after in (
                None, TpuState.READY, TpuState.UNKNOWN):  # asked to stop, its slice still there: not a preemption
            outcome, said_cause = Outcome.STOPPED, Cause.STOPPED
        launch = seen.record(started, time.time(), code, outcome, state_after, said_cause,
                             launch_timing(list(seen.timings), setup=setup, setup_ran=setup_ran,
                                           billed_until=billed_until))
        self.end_launch(launch)
        sup.event("launch-ended", code=code, outcome=outcome, cause=shlex.quote(launch.cause), last_step=seen.last_step,
                  tpu_state=state_after or TpuState.READY)
        return outcome, code, seen

    def end_launch(self, launch: LaunchRecord, preempted: bool | None = None) -> None:
        """Record a launch that ended, in one change (a kill cannot record it without its preemption);
        `preempted`: it counts as a preemption (default: its outcome says so)."""
        with self.sup.changing() as record:
            record.launches.append(launch)
            if launch.outcome == Outcome.PREEMPTED if preempted is None else preempted:
                record.preemptions += 1
            record.in_flight, record.launch = False, None

    def record_unwatched(self, *, down: bool) -> LaunchRecord | None:
        """The launch a supervisor killed meanwhile left in flight has ended (`down`: its slice went
        down under it, a preemption; else this supervisor stopped it, not one, or its run is complete):
        record it from what that supervisor knew and the run's events beside the checkpoints (those said
        since it started). The record; None for a supervision record of older code, which did not keep
        the launch."""
        with self.sup.lock:
            was = self.sup.record.launch
        if was is None:  # only the preemption
            with self.sup.changing() as record:
                record.preemptions += 1 if down else 0
                record.in_flight = False
            return None
        said = [e for e in self.run_events() if isinstance(t := e.get("time"), (int, float)) and t >= was.started]
        newest = max((e["time"] for e in said if e.get("event") == Kind.TIMING), default=None)
        if was.timing and (newest is None or newest < (was.timing.time or 0)):  # the file is behind (or unread)
            said.append({**as_json(was.timing), "event": Kind.TIMING})
        seen = LaunchEvents()
        for event in said:
            seen.event(event)
        seen.first_step = seen.first_step if seen.first_step is not None else was.first_step
        seen.last_step = max((s for s in (seen.last_step, was.last_step) if s is not None), default=None)
        said_code = (seen.failure() or {}).get("exit_code")
        code = (0 if seen.completed else EXIT_PREEMPTED if seen.preempted or not seen.failures
                else said_code if isinstance(said_code, int) and not isinstance(said_code, bool) else EXIT_FAILURE)
        state_after = TpuState.PREEMPTED if down else None
        outcome = classify(code, seen, state_after)
        billed_until = self.billing_stopped if down and (self.billing_stopped or 0) > was.started else None
        ended = max([was.started, *(t for e in said if isinstance(t := e.get("time"), (int, float)))])
        stopped = not down and outcome == Outcome.PREEMPTED  # by this supervisor: its run checkpointed
        launch = seen.record(was.started, ended, code, outcome, state_after,
                             Cause.SUPERVISOR_DIED if stopped else cause(code, outcome, seen),
                             launch_timing(list(seen.timings), setup=was.setup, billed_until=billed_until),
                             unwatched=True)
        self.end_launch(launch, preempted=down)
        return launch

    def run_events(self) -> list[dict]:
        """The run's events beside its checkpoints ([] when there are none or they cannot be read)."""
        if not self.spec.events_file:
            return []
        try:
            return events.read(self.spec.events_file)
        except Exception:  # noqa: BLE001 - storage out of reach: what the supervisor knew or saw stands
            return []

    def _gcloud_started(self, proc: subprocess.Popen) -> None:
        self.gcloud_proc = proc

    def interrupt(self) -> None:
        """From another thread: the run checkpoints and stops (SIGTERM on every worker), and the loop ends."""
        self.stop.set()
        if self.gcloud_proc is not None:
            pod.stop_pod(self.spec.target, grace=self.spec.stop_grace_s, stream=io.StringIO(),
                         repo_dir=self.spec.repo_dir)

    # --- 5. the end

    def release_tpu(self, status: Status) -> None:
        """Delete the TPU or keep it, as --at-end says (by default: delete when the checkpoints are on gs://)."""
        at_end = self.spec.at_end or ("delete" if self.spec.state_mirror else "keep")
        if at_end == "delete" and status in (Status.COMPLETED, Status.FAILED, Status.GAVE_UP):
            self.delete_slice()
            return
        if self.clock.ready_since is not None:  # still billed; no longer counted here
            self.sup.event("tpu-kept", at_end=at_end if status != Status.INTERRUPTED else Status.INTERRUPTED)
        self.gone(time.time())

    def delete_slice(self) -> None:
        """Delete the TPU, and its queued resource when it was made through one (`--force`: the queued
        resource and its node, so that nothing is left queued to make a node that bills later). Not a
        TPU labelled with another owner, nor, by a programme (spec.owner), one it did not label: another
        programme's slice of that name (whose variant was refused there) runs on."""
        target, shape = self.spec.target, self.spec.shape
        state, _, owner = tpu_state(self.spec, self.run_gcloud)
        queued = None
        if shape.queued_resource:  # no node yet: its queued resource says whose it will be
            queued, queued_owner = queue_state(self.spec, self.run_gcloud)
            owner = owner or queued_owner
        unseen = (None, TpuState.MISSING, TpuState.UNKNOWN)  # nothing there, or not known to be
        if (state not in unseen or queued not in unseen) and (self.theirs(owner) or self.spec.owner and not owner):
            self.sup.event("tpu-left-alone", tpu=target.tpu, owner=owner or "none", reason=shlex.quote(
                "labelled by another owner: not deleted" if owner else "not labelled by this programme: not deleted"))
            self.gone(time.time())  # no longer counted here
            return
        if shape.queued_resource:
            deleting = None
            if queued != TpuState.MISSING:
                deleting = time.time()  # the READY time ends at the request that deletes the node
                if self.act(gcloud.queued_delete_argv(target, shape), "queued-resource-deleted")[0] != 0:
                    return
            looked = time.time()
            if tpu_state(self.spec, self.run_gcloud)[0] == TpuState.MISSING:
                self.gone(deleting or looked)
                return
        deleting = time.time()
        if self.act(gcloud.delete_argv(target), "tpu-deleted")[0] == 0:
            self.gone(deleting)

    def finish(self, status: Status, code: int, release: bool = True, *, line: str | None = None,
               cause: str | None = None, reason: str | None = None, max_restarts: int | None = None) -> int:
        """Record how the run ended (`line`: one no launch said); delete or keep the TPU (not while a
        launch may still run on it, nor without gcloud credentials)."""
        sup = self.sup
        if self.owns_slice and release and not (status == Status.INTERRUPTED and sup.record.in_flight):
            try:
                self.release_tpu(status)
            except GiveUp:
                self.gone(time.time())
        elif self.owns_slice:
            self.gone(time.time())
        with sup.changing() as record:
            record.status = status
            record.end = End(status=status, code=code, line=line, cause=cause, reason=reason, max_restarts=max_restarts)
            restarts, preemptions, last_step = record.restarts, record.preemptions, record.said("last_step")
        said = {k: v for k, v in (("cause", cause and shlex.quote(cause)), ("reason", reason),
                                  ("max_restarts", max_restarts), ("last_step", last_step)) if v is not None}
        sup.event(status, code=code, restarts=restarts, preemptions=preemptions,
                  host_hours=f"{sup.host_seconds(self.clock) / 3600:.3f}", **said)
        return code

    def run(self) -> int:
        """Until the run completes (0), fails for good (its code) or stops making progress (1)."""
        spec, sup = self.spec, self.sup
        with sup.changing() as record:
            resumed = bool(record.launches)
            orphaned = record.in_flight  # the supervisor before was killed mid-launch
            record.status = Status.RUNNING
            restarts, launches = record.restarts, len(record.launches)
        sup.event("start", run_id=spec.run_id, tpu=spec.target.tpu, resumed=resumed, restarts=restarts,
                  launches=launches, state=sup.path, mirror=spec.state_mirror or "none",
                  shipped_tree=spec.ship.tree_hash[:16] if spec.ship else "none")
        while True:
            round_started = time.time()
            try:
                hosts = self.ensure_ready()
            except GiveUp as e:  # without credentials, gcloud cannot delete the TPU either
                self.report(str(e))
                creds = isinstance(e, NoCredentials)
                return self.finish(Status.FAILED, EXIT_USER_ERROR, release=not creds, line=str(e),
                                   cause=Cause.GCLOUD_CREDENTIALS if creds else Cause.GCLOUD_REFUSED)
            if self.stop.is_set():
                return self.finish(Status.INTERRUPTED, EXIT_INTERRUPTED)
            ready_at = max(round_started, self.clock.ready_since or round_started)
            unwatched = None
            if orphaned:  # the launch the supervisor before left in flight: recorded here, once
                orphaned = False
                if self.seen_down:  # the slice went down under it: a preemption no supervisor saw end
                    unwatched = self.record_unwatched(down=True)
                    sup.event("preempted-unwatched", last_step=sup.record.said("last_step"))
                else:  # its launch may still run: stop it (it checkpoints) rather than race it for the lease
                    self.stop_stale(reason="supervisor-restarted")
                    unwatched = self.record_unwatched(down=False)
                    ready_at = time.time()  # the time until now was that launch's
            self.setup_from = ready_at
            if unwatched is not None and unwatched.outcome == Outcome.COMPLETED:  # it ran to the end meanwhile
                outcome, code = Outcome.COMPLETED, 0
            elif self.ensure_setup(hosts) != 0:  # a failing setup (a network blip) waits before the next try
                self.setup_carry += max(0.0, time.time() - ready_at)
                outcome, code = Outcome.BACKOFF, EXIT_FAILURE
            else:
                outcome, code, _ = self.launch_once(hosts)
            if outcome == Outcome.COMPLETED:
                return self.finish(Status.COMPLETED, 0)
            if outcome == Outcome.FATAL:
                return self.finish(Status.FAILED, code, cause=sup.record.launches[-1].cause)
            if self.stop.is_set() or code == EXIT_INTERRUPTED:
                return self.finish(Status.INTERRUPTED, EXIT_INTERRUPTED)
            if outcome == Outcome.PREEMPTED:
                continue
            with sup.changing() as record:
                record.restarts += 1
                restarts, stuck = record.restarts, no_progress(record.launches)
            if restarts > spec.max_restarts:
                return self.finish(Status.GAVE_UP, EXIT_FAILURE, reason="max-restarts", max_restarts=spec.max_restarts)
            if stuck:
                return self.finish(Status.GAVE_UP, EXIT_FAILURE, reason="no-progress")
            if outcome == Outcome.BACKOFF:  # after a storage or setup failure, wait before the relaunch
                sup.event("backoff", seconds=spec.storage_backoff_s)
                self.sleep(spec.storage_backoff_s)
            self.stop_stale(restarts=restarts)

    def stop_stale(self, **why: object) -> None:
        """Free the TPU of the run's stale processes (they checkpoint, then stop) before a launch."""
        code = pod.stop_pod(self.spec.target, grace=self.spec.stop_grace_s, stream=self.sup.stream,
                            repo_dir=self.spec.repo_dir, run=self.spec.run_id)
        self.sup.event("stopped-stale-processes", code=code, **why)


class LaunchEvents:
    """What the trainer said during one launch: its events, from every worker's output."""

    KEEP_TIMINGS = 32  # the last `timing` events kept: enough to tell what came after a preemption

    def __init__(self, on_progress: Callable[["LaunchEvents"], None] | None = None) -> None:
        self.on_progress = on_progress  # called after a `started` or `checkpoint` event
        self.run_id = self.total = self.last_step = self.first_step = None
        self.saved_step: int | None = None  # its start or its newest committed checkpoint: where a relaunch resumes
        self.completed: dict | None = None
        self.preempted: dict | None = None
        self.failures: list[dict] = []
        self.timings: deque[dict] = deque(maxlen=self.KEEP_TIMINGS)  # the trainer's account, the last one its whole
        self.sigterm: float | None = None  # the first SIGTERM a worker's launch guard got (experiments/launcher/worker/once.py)

    def line(self, line: str) -> None:
        event = wire.event(line)
        if event is not None:
            self.event(event)

    def event(self, event: dict) -> None:
        kind, step = event["event"], event.get("step")
        if isinstance(step, int):
            self.last_step = max(step, self.last_step if self.last_step is not None else step)
        if kind == Kind.STARTED:
            self.run_id, self.total = event.get("run_id"), event.get("total")
            self.first_step = step if isinstance(step, int) else None
        elif kind == Kind.TIMING:
            self.timings.append(event)
        elif kind == Kind.COMPLETED:
            self.completed = event
        elif kind == Kind.PREEMPTED:
            self.preempted = event
        elif kind == Kind.FAILED:
            self.failures.append(event)
        elif kind == Kind.SIGTERM and isinstance(event.get("time"), (int, float)):
            self.sigterm = min(event["time"], self.sigterm or event["time"])
        if kind in (Kind.STARTED, Kind.CHECKPOINT, Kind.PREEMPTED, Kind.COMPLETED) and isinstance(step, int):
            self.saved_step = max(step, self.saved_step if self.saved_step is not None else step)
        if kind in (Kind.STARTED, Kind.CHECKPOINT) and self.on_progress is not None:
            self.on_progress(self)

    def stopped_at(self) -> float | None:
        """When the workers were told to stop: a launch guard's SIGTERM, else the trainer's `preempted`."""
        return self.sigterm or (self.preempted or {}).get("noticed")

    def failure(self) -> dict | None:
        """The cause: a process's own failure rather than the others' "a peer was lost"."""
        own = [f for f in self.failures if f.get("failure") != Failure.PEER_LOST]
        return (own or self.failures or [None])[0]

    def record(self, started: float, ended: float, code: int, outcome: Outcome, state_after: str | None,
               said_cause: str, timing: LaunchTiming, **more) -> LaunchRecord:
        """The launch's record: what the trainer said, and how the supervisor saw it end."""
        return LaunchRecord(started=started, ended=ended, code=code, outcome=outcome, cause=said_cause,
                            line=(self.failure() or {}).get("line"), last_step=self.last_step, total=self.total,
                            wandb_run_id=self.run_id, tpu_state_after=state_after,
                            metrics=(self.completed or {}).get("metrics"), first_step=self.first_step, timing=timing,
                            saved_step=self.saved_step, **more)


# What a supervisor does after a failure, by its class's policy (runtime/events.py's Failure).
OUTCOME_OF = {Policy.PERMANENT: Outcome.FATAL, Policy.BACK_OFF: Outcome.BACKOFF, Policy.RESTART: Outcome.RESTART}


def classify(code: int, seen: LaunchEvents, state_after: str | None) -> Outcome:
    """How the launch ended: completed, preempted, or after a failure as its class's policy says
    (an unknown class, or no event at all: a restart)."""
    if seen.completed:
        return Outcome.COMPLETED
    if seen.preempted or code == EXIT_PREEMPTED:
        return Outcome.PREEMPTED
    if state_after not in (None, TpuState.READY, TpuState.UNKNOWN):  # UNKNOWN: the describe failed, the rest decides
        return Outcome.PREEMPTED  # the ssh dropped (or the workers died) because the TPU went away
    if code == 0:
        return Outcome.COMPLETED  # a trainer that reports no events (older code on the workers)
    failure = seen.failure()
    kind = Failure.of_label(failure.get("failure")) if failure else None
    return OUTCOME_OF[kind.policy] if kind else Outcome.RESTART


def cause(code: int, outcome: Outcome, seen: LaunchEvents) -> str:
    if outcome in (Outcome.COMPLETED, Outcome.PREEMPTED):
        return str(outcome)
    failure = seen.failure()
    if failure:
        kind = Failure.of_label(failure.get("failure"))
        return kind.cause if kind else str(failure.get("failure"))
    return f"exit {code}" + (" (no event from the trainer: the worker command failed)" if code else "")


def no_progress(launches: list[LaunchRecord]) -> bool:
    """The last two launches were restarts and both ended at the step the launch before them did."""
    if len(launches) < 3:
        return False
    a, b, c = launches[-3:]
    restarts = (Outcome.RESTART, Outcome.BACKOFF)
    return b.outcome in restarts and c.outcome in restarts and a.last_step == b.last_step == c.last_step


def state_mirror(overrides: Sequence[str]) -> str | None:
    """<run.checkpoint.dir>/supervision.json when the checkpoints are on gs://, else None, from the
    config the trainer composes (conf/ + the overrides)."""
    from runtime import hydra_compose  # here: JAX and Hydra take seconds to import; `status` needs neither
    from runtime.config import run_dirs

    try:
        checkpoints = run_dirs(hydra_compose.composed(overrides))[1]
    except Exception:  # noqa: BLE001 - the trainer reports a bad override itself, in one line
        return None
    return checkpoints.rstrip("/") + "/supervision.json" if checkpoints.startswith("gs://") else None


def sigterm_as_ctrl_c(_sig, _frame) -> None:
    """SIGTERM (systemd's stop) handled as Ctrl-C: the run on the workers checkpoints, then stops."""
    raise KeyboardInterrupt


def run_until_done(spec: Spec) -> int:
    """`supervise` for the command line: stopped by Ctrl-C or SIGTERM, the run on the workers
    checkpoints and the supervisor exits 130."""
    signal.signal(signal.SIGTERM, sigterm_as_ctrl_c)
    sup = FileSupervision(spec, sys.stdout)
    supervisor = Supervisor(spec, sup, sup.record.slice)
    try:
        return supervisor.run()
    except KeyboardInterrupt:
        with sup.lock:
            sup.record.in_flight = False  # launch_pod stopped the workers (they checkpointed)
        return supervisor.finish(Status.INTERRUPTED, EXIT_INTERRUPTED)


# --- what an operator sees without running anything ---------------------------------------------

def dry_run(spec: Spec) -> str:
    """The exact gcloud commands the supervisor issues in each state of the TPU."""
    t, shape, q = spec.target, spec.shape, spec.queued_resource
    j = shlex.join
    describe, create, delete = j(gcloud.describe_argv(t)), j(gcloud.create_argv(t, shape)), j(gcloud.delete_argv(t))
    q_describe, q_create, q_delete = (j(argv(t, shape)) if q else "" for argv in (
        gcloud.queued_describe_argv, gcloud.queued_create_argv, gcloud.queued_delete_argv))
    launch = io.StringIO()
    pod.launch_pod(t, spec.overrides, repo_dir=spec.repo_dir, run_id=spec.run_id, env=spec.env,
                   forward_env=spec.forward_env, ship=spec.ship or False, dry_run=True, stream=launch)
    ready = [describe, "# versions check (setup is skipped when every worker's .venv fits and all match):",
             j(gcloud.ssh_argv(t, pod.versions_command(spec.repo_dir))),
             "# otherwise setup:", j(gcloud.ssh_argv(t, pod.setup_command(spec.repo_dir, clone_url=spec.clone_url))),
             "# the launch (every launch resumes the run's checkpoint):", launch.getvalue()]
    sections = {
        "missing": [describe, *([q_describe, q_create] if q else [create])],
        "CREATING (or queued: CREATING, ACCEPTED, PROVISIONING, WAITING_FOR_RESOURCES): wait with backoff, then again":
            [describe, *([q_describe] if q else [])],
        TpuState.READY: ready,
        "PREEMPTED or TERMINATED": [describe, *([q_describe, q_delete, q_create] if q else [delete, create])],
        "after a hang, a lost worker or an unknown failure (before the relaunch)":
            [j(gcloud.ssh_argv(t, pod.stop_command(spec.stop_grace_s, spec.repo_dir, spec.run_id)))],
        "when the run has ended, with --at-end delete": [*([q_describe, q_delete] if q else []), delete],
    }
    if q:
        sections["queued resource FAILED or SUSPENDED"] = [q_delete, q_create]
    out = [line for state, lines in sections.items() for line in (f"# TPU {state}:", *lines)]
    return "\n".join(line.rstrip("\n") for line in out) + "\n"


def status_text(log_dir: Path, run_id: str) -> str | None:
    """The supervision history of a run, for `launch.py supervise --status`; None if there is none."""
    record = load(Path(log_dir) / run_id / "supervision.json")
    if record is None:
        return None
    clock = record.slice
    lines = [f"run {record.run_id} on {record.tpu} ({record.zone}): {record.status}; "
             f"{len(record.launches)} launches, {record.restarts} restarts, {record.preemptions} preemptions; "
             f"{clock.ready_total() / 3600:.3f} pod-hours READY, {clock.host_total() / 3600:.3f} host-hours "
             "(READY time x workers)"]
    for i, launch in enumerate(record.launches, 1):
        when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(launch.started))
        minutes = (launch.ended - launch.started) / 60
        lines.append(f"  {i:>3}  {when}  {minutes:7.1f} min  exit {launch.code:>3}  {launch.cause:<16} "
                     f"last step {launch.last_step if launch.last_step is not None else '-'}")
    return "\n".join(lines) + "\n"
