"""The programme runs itself: a durable queue of experiment variants on one or more preemptible TPU
slices, each variant supervised, with a ledger of pod-hours, results and status
(`launch.py programme submit | run | status | stop | retry | skip`).

State: one directory per programme (default outputs/programmes/<name>/):
  programme.json  what was submitted (variants in order, slices, budget, overrides); only the budget changes
  ledger.json     every variant's state, attempts, supervision record (experiments/launcher/supervise.py),
                  pod time, last step, result; every slice's READY clock; pod-hours over time
  controller.log  one `[programme] <UTC time> <event> key=value ...` line per event
  commands/       stop / retry / skip requests, applied by the running controller
  logs/           each variant's launch output; launch-logs/: each launch's (pod.launch_pod)
The directory is mirrored (--mirror, e.g. gs://BUCKET/programmes/<name>) after every change, so a
controller on another machine takes over from the mirror (`programme run NAME --mirror URI`).

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
held it.

Exit codes of `run`: 0 nothing left to run (every variant completed, failed or skipped), the
budget reached, or stopped by `programme stop`; 1 stopped on a repeated infrastructure failure;
2 bad input (preflight), a held lease, no credentials, a refused request; 130 interrupted.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shlex
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, TextIO

from experiments.launcher import pod, supervise
from experiments.launcher.gcloud import Target
from runtime import events, hydra_compose
from runtime.errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_STORAGE, EXIT_USER_ERROR, UserError

QUEUED, RUNNING, COMPLETED, FAILED, SKIPPED = "queued", "running", "completed", "failed", "skipped"


@dataclass
class Submission:
    """What `programme submit` was asked (programme.json)."""
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
            at_end="keep", create_attempts=self.create_attempts, events_file=self.events_file(variant))

    def events_file(self, variant: str) -> str | None:
        """The variant's events beside its checkpoints (runtime/run_files.py), when its directory is known."""
        directory = self.checkpoint_dirs.get(variant)
        return f"{directory.rstrip('/')}/run_files/{events.FILE}" if directory else None

    def planned_hours(self, variant: str) -> float | None:
        return (self.planned.get(variant) or {}).get("pod_hours")


# --- preflight -------------------------------------------------------------------------------------

def read_plan(path: Path) -> dict[str, dict]:
    """{group/variant: {"pod_hours", "steps", "step_s"}} from a CSV of `launch.py plan`."""
    planned = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row["variant"] == "TOTAL" or row["group"] == "ALL":
                continue
            planned[f"{row['group']}/{row['variant']}"] = {
                "pod_hours": float(row["pod_hours"]) if row["pod_hours"] else None,
                "steps": int(row["steps"]) if row["steps"] else None,
                "step_s": float(row["step_s"]) if row["step_s"] else None}
    return planned


def choose_variants(groups: list[str], only: list[str]) -> list[str]:
    """group/variant of the groups (`all`: every group) in plan order, or just `only` of them
    (each `group/variant`, or a variant name of any of the groups)."""
    from experiments.compose import variants
    from experiments.programme import GROUPS

    names = list(GROUPS) if groups == ["all"] else groups
    unknown = [g for g in names if g not in GROUPS]
    if unknown:
        raise UserError(f"unknown group(s) {unknown}; the groups are {list(GROUPS)} (or all)")
    chosen = [f"{g}/{v}" for g in names for v in variants(g)]
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
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url)
        return fs.exists(path)
    except Exception:  # noqa: BLE001 - an unreachable bucket is as good as missing here
        return False


# --- state ---------------------------------------------------------------------------------------

class State:
    """The programme's directory: submission, ledger, event log, commands; mirrored after each change."""

    def __init__(self, directory: Path, stream: TextIO | None = None) -> None:
        self.dir = Path(directory)
        self.stream = stream or sys.stdout
        self.lock = threading.RLock()
        self.sub: Submission | None = None
        self.ledger: dict = {}
        self.mirror_failed = False

    @property
    def name(self) -> str:
        return self.dir.name

    def create(self, sub: Submission) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.sub = sub
        self.ledger = {"variants": {v: new_variant(v, i, sub) for i, v in enumerate(sub.variants)},
                       "slices": {s: {"clock": {}, "variant": None} for s in sub.slices},
                       "history": [], "controller": {"status": "submitted"}}
        self.save_submission()
        self.save()

    def load(self, mirror: str | None = None) -> None:
        """From the directory, or (a controller on another machine) first from the mirror."""
        if not (self.dir / "programme.json").exists() and mirror:
            self.fetch(mirror)
        try:
            self.sub = Submission(**json.loads((self.dir / "programme.json").read_text()))
            self.ledger = json.loads((self.dir / "ledger.json").read_text())
        except FileNotFoundError:
            raise UserError(f"no programme at {self.dir}" + (f" nor at {mirror}" if mirror else "") +
                            "; submit it first (launch.py programme submit)") from None

    def fetch(self, mirror: str) -> None:
        import fsspec

        fs, root = fsspec.core.url_to_fs(mirror)
        self.dir.mkdir(parents=True, exist_ok=True)
        for name in ("programme.json", "ledger.json", "controller.log"):
            if fs.exists(f"{root}/{name}"):
                fs.get_file(f"{root}/{name}", str(self.dir / name))

    def save(self) -> None:
        with self.lock:
            text = json.dumps(self.ledger, indent=1)
            _write(self.dir / "ledger.json", text)
            self.push()

    def push(self) -> None:
        """Copy the state to the mirror (a failure is said once; the next save tries again)."""
        if not (self.sub and self.sub.mirror):
            return
        import fsspec

        try:
            fs, root = fsspec.core.url_to_fs(self.sub.mirror)
            fs.makedirs(root, exist_ok=True)
            for name in ("programme.json", "ledger.json", "controller.log"):
                if (self.dir / name).exists():
                    fs.put_file(str(self.dir / name), f"{root}/{name}")
            self.mirror_failed = False
        except Exception as e:  # noqa: BLE001 - the local state stands
            if not self.mirror_failed:
                self.mirror_failed = True
                self.event("mirror-failed", uri=self.sub.mirror, detail=shlex.quote(" ".join(str(e).split())[:200]))

    def event(self, name: str, **fields) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        line = " ".join(["[programme]", stamp, name, *(f"{k}={v}" for k, v in fields.items())])
        with self.lock:
            with open(self.dir / "controller.log", "a", encoding="utf-8") as f:
                f.write(line + "\n")
            self.stream.write(line + "\n")
            self.stream.flush()

    def command(self, verb: str, variant: str | None = None, value: float | None = None) -> Path:
        """Leave a request for the controller (it applies it, now or when it next starts)."""
        folder = self.dir / "commands"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{time.time_ns()}-{verb}.json"
        _write(path, json.dumps({"verb": verb, "variant": variant, "value": value}))
        return path

    def save_submission(self) -> None:
        _write(self.dir / "programme.json", json.dumps(asdict(self.sub), indent=1))

    def commands(self) -> list[dict]:
        """The requests left since the last call (taken: each is applied once)."""
        found = []
        for path in sorted((self.dir / "commands").glob("*.json")):
            try:
                found.append(json.loads(path.read_text()))
            except ValueError:
                pass
            path.unlink(missing_ok=True)
        return found


def new_variant(variant: str, order: int, sub: Submission) -> dict:
    return {"state": QUEUED, "order": order, "run_id": sub.run_id(variant), "attempts": 0, "slice": None,
            "supervision": {}, "ready_seconds": 0.0, "host_seconds": 0.0, "last_step": None, "total": None,
            "wandb_run_id": None, "metrics": None, "line": None, "failure": None, "started": None, "ended": None}


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + f".tmp-{os.getpid()}-{threading.get_ident()}")
    tmp.write_text(text + "\n")
    os.replace(tmp, path)  # whole or not at all: a controller killed mid-write leaves the previous one


class VariantSupervision(supervise.Supervision):
    """A variant's supervision record inside the programme's ledger, its events in the controller's log."""

    prefix = "[programme]"

    def __init__(self, state: State, variant: str, slice_name: str) -> None:
        record = state.ledger["variants"][variant]
        self.state, self.variant, self.slice = state, variant, slice_name
        self.data = record["supervision"]
        for key, value in (("run_id", record["run_id"]), ("tpu", slice_name), ("zone", state.sub.zone), ("restarts", 0),
                           ("preemptions", 0), ("status", "running"), ("launches", []), ("slice", {})):
            self.data.setdefault(key, value)
        self.data["tpu"] = slice_name
        logs = state.dir / "logs"
        logs.mkdir(exist_ok=True)
        self.stream = open(logs / f"{variant.replace('/', '__')}.log", "a", encoding="utf-8")
        self.path = state.dir / "ledger.json"

    def save(self) -> None:
        self.state.save()

    def event(self, name: str, **fields) -> None:
        self.state.event(name, variant=self.variant, slice=self.slice, **fields)
        self.stream.write(f"[programme] {name} " + " ".join(f"{k}={v}" for k, v in fields.items()) + "\n")
        self.stream.flush()


# --- the controller ------------------------------------------------------------------------------

class Stop(Exception):
    """The controller stops, said in one line, with an exit code."""

    def __init__(self, line: str, code: int) -> None:
        super().__init__(line)
        self.line, self.code = line, code


def live_ready_seconds(ledger: dict, record: dict, now: float | None = None) -> float:
    """A variant's READY seconds, with those of the launch under way on its slice (a running
    variant's record is settled only when its launch ends)."""
    seconds, mark = record["ready_seconds"], record.get("mark")
    if record["state"] == RUNNING and mark and record.get("slice") in ledger["slices"]:
        clock = supervise.ReadyClock(dict(ledger["slices"][record["slice"]]["clock"]))  # a copy: read only
        seconds += max(0.0, clock.ready_seconds(now) - mark["ready"])
    return seconds


class Controller:
    """Runs the programme's queue on its slices until nothing is left (see the module docstring)."""

    def __init__(self, state: State, *, alert: Callable[[str, str], None] | None = None,
                 sleep_s: float = 0.5) -> None:
        self.state, self.sub, self.ledger = state, state.sub, state.ledger
        self.alert = alert or Alerts(state.sub).send
        self.stop = threading.Event()
        self.stopping: Stop | None = None  # why the controller stops (None: the queue ran out)
        self.budget_line: str | None = None
        self.supervisors: dict[str, supervise.Supervisor] = {}  # running variant -> its supervisor
        self.sleep_s = sleep_s
        self.lock = state.lock

    # -- time and money

    def clock(self, slice_name: str) -> supervise.ReadyClock:
        return supervise.ReadyClock(self.ledger["slices"][slice_name]["clock"])

    def spent_hours(self, now: float | None = None) -> float:
        """Pod-hours: the slices' READY hours so far."""
        return sum(self.clock(s).ready_seconds(now) for s in self.ledger["slices"]) / 3600

    def ahead_hours(self) -> float:
        """Pod-hours the running variants are still planned to take (their plan less what they spent):
        on several slices, a new variant must fit the budget beside them."""
        return sum(max(0.0, (self.sub.planned_hours(variant) or 0.0) - live_ready_seconds(self.ledger, record) / 3600)
                   for variant, record in self.ledger["variants"].items()
                   if record["state"] == RUNNING and record.get("mark") and record.get("slice") in self.ledger["slices"])

    def note_spending(self) -> None:
        self.ledger["history"].append([round(time.time(), 3), round(self.spent_hours(), 6)])

    # -- the queue

    def take(self, slice_name: str) -> str | None:
        """The variant this slice runs next: its own that was running when the controller stopped
        (its processes may still run there), else the first queued one; None when nothing is left
        or the budget would be exceeded (said once)."""
        with self.lock:
            if self.stop.is_set() or self.budget_line:
                return None
            own = self.ledger["slices"][slice_name]["variant"]
            if own and self.ledger["variants"][own]["state"] in (QUEUED, RUNNING):
                return self._start(own, slice_name)
            queued = sorted((v for v, r in self.ledger["variants"].items() if r["state"] == QUEUED
                             and not self._held(v)), key=lambda v: self.ledger["variants"][v]["order"])
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
        return any(s["variant"] == variant for s in self.ledger["slices"].values())

    def _start(self, variant: str, slice_name: str) -> str:
        record = self.ledger["variants"][variant]
        record.update(state=RUNNING, slice=slice_name, started=record["started"] or time.time())
        record["attempts"] += 1
        record["mark"] = {"ready": self.clock(slice_name).ready_seconds(), "host": self.clock(slice_name).host_seconds()}
        self.ledger["slices"][slice_name]["variant"] = variant
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
        completed = [e for e in said if e.get("event") == "completed"]
        if completed:
            return completed[-1]
        totals = [e["total"] for e in said if e.get("event") == "started" and isinstance(e.get("total"), int)]
        total = totals[-1] if totals else self.sub.total_steps.get(variant)
        if not total:
            return None
        try:
            from runtime.checkpointing import newest_committed

            newest = newest_committed(directory)
        except Exception:  # noqa: BLE001 - as above
            return None
        if newest is None or newest[0] < total:
            return None
        return {"event": "completed", "step": newest[0], "metrics": newest[1].get("metrics"), "from": "checkpoint"}

    # -- one variant on one slice

    def run_variant(self, variant: str, slice_name: str) -> None:
        record = self.ledger["variants"][variant]
        done = self.already_complete(variant)
        if done is not None:
            self.state.event("skipped-complete", variant=variant, step=done.get("step"),
                             seen=done.get("from", "completed-event"))
            self.end(variant, slice_name, COMPLETED, metrics=done.get("metrics"), last_step=done.get("step"))
            return
        sup = VariantSupervision(self.state, variant, slice_name)
        supervisor = supervise.Supervisor(self.sub.spec(variant, slice_name, self.state.dir), sup,
                                          self.clock(slice_name), owns_slice=False, report=lambda line: None)
        with self.lock:
            if self.stop.is_set():
                return self.end(variant, slice_name, QUEUED)
            self.supervisors[variant] = supervisor
        try:
            code = supervisor.run()
        except supervise.Unavailable as e:  # the slice could not be had: back of the queue
            self.end(variant, slice_name, QUEUED, line=e.line, failure=e.kind, back=True)
            self.infrastructure(variant, e.kind, e.line)
            return
        finally:
            with self.lock:
                self.supervisors.pop(variant, None)
            sup.stream.close()
        status, end, launches = sup.data["status"], sup.data.get("end") or {}, sup.data["launches"]
        last = launches[-1] if launches else {}
        result = {"last_step": last.get("last_step"), "total": last.get("total"), "wandb": last.get("wandb_run_id")}
        if status == "completed":
            self.end(variant, slice_name, COMPLETED, metrics=last.get("metrics"), **result)
            self.streak_reset()
        elif status == "interrupted":
            self.end(variant, slice_name, SKIPPED if record.pop("skip", False) else QUEUED, **result)
        elif status == "failed" and end.get("cause") in ("gcloud-refused", "gcloud-credentials"):
            raise Stop(end.get("line") or "gcloud refused a request", code or EXIT_USER_ERROR)  # none fares better
        elif status == "failed":
            line = end.get("line") or last.get("line") or last.get("cause")
            self.end(variant, slice_name, FAILED, line=line, failure=last.get("cause"), **result)
            self.alert(f"{self.state.name}: {variant} failed", line or "")
        else:  # gave up: restarts without progress or past --max-restarts
            cause = last.get("cause") or status
            self.end(variant, slice_name, FAILED, line=last.get("line") or f"gave up: {cause}", failure=cause, **result)
            self.alert(f"{self.state.name}: {variant} failed", f"gave up after restarts: {cause}")
            self.infrastructure(variant, cause, last.get("line") or cause)

    def end(self, variant: str, slice_name: str, state: str, *, back: bool = False, metrics: dict | None = None,
            **fields) -> None:
        with self.lock:
            record = self.ledger["variants"][variant]
            mark = record.pop("mark", None) or {"ready": 0.0, "host": 0.0}
            clock = self.clock(slice_name)
            record["ready_seconds"] += max(0.0, clock.ready_seconds() - mark["ready"])
            record["host_seconds"] += max(0.0, clock.host_seconds() - mark["host"])
            wandb_id = fields.pop("wandb", None)
            record.update({k: v for k, v in fields.items() if v is not None}, state=state, ended=time.time())
            record["wandb_run_id"] = wandb_id or record["wandb_run_id"]
            if metrics is not None:
                record["metrics"] = metrics
            if back:
                record["order"] = max(r["order"] for r in self.ledger["variants"].values()) + 1
            if self.ledger["slices"][slice_name]["variant"] == variant:
                self.ledger["slices"][slice_name]["variant"] = None
            self.note_spending()
            self.state.save()
        self.state.event("variant-" + state, variant=variant, slice=slice_name,
                         **({"failure": shlex.quote(str(fields["failure"]))} if fields.get("failure") else {}))

    # -- repeated infrastructure failures

    def infrastructure(self, variant: str, kind: str, line: str) -> None:
        with self.lock:
            streak = self.ledger["controller"].setdefault("streak", {"kind": None, "variants": []})
            if streak["kind"] != kind:
                streak.update(kind=kind, variants=[])
            if variant not in streak["variants"]:
                streak["variants"].append(variant)
            self.state.save()
            if len(streak["variants"]) >= self.sub.infra_streak:
                raise Stop(f"the same infrastructure failure ended {len(streak['variants'])} variants in a row "
                           f"({kind}: {line}); fix it, then `launch.py programme run {self.state.name}` carries on",
                           EXIT_FAILURE)

    def streak_reset(self) -> None:
        with self.lock:
            self.ledger["controller"]["streak"] = {"kind": None, "variants": []}
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
        except Exception as e:  # noqa: BLE001 - a bug: stop the others too, with its line
            self.halt(Stop(f"controller thread of {slice_name} crashed: {type(e).__name__}: {e}", EXIT_FAILURE))
            raise

    def release(self, slice_name: str) -> None:
        """Nothing left for this slice: delete it (its READY time ends)."""
        supervisor = supervise.Supervisor(
            supervise.Spec(Target(slice_name, self.sub.zone, self.sub.project), f"{self.state.name}-{slice_name}", [],
                           at_end="delete"), _SliceRecord(self.state, slice_name), self.clock(slice_name))
        state, _ = supervise.tpu_state(supervisor.spec, supervisor.run_gcloud)
        if state != supervise.MISSING:
            supervisor.release_tpu("completed")
        else:
            supervisor.gone(time.time())
        with self.lock:
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

    def apply(self, command: dict) -> None:
        verb, variant = command.get("verb"), command.get("variant")
        self.state.event("command", verb=verb, variant=variant or "-")
        if verb == "stop":
            self.halt(Stop("stopped by `programme stop`: the running variants checkpointed", 0))
            return
        if verb == "budget":
            with self.lock:
                self.sub.budget, self.budget_line = command.get("value"), None
                self.state.save_submission()
            return
        with self.lock:
            record = self.ledger["variants"].get(variant)
            if record is None:
                self.state.event("command-ignored", reason=shlex.quote(f"no variant {variant}"))
                return
            if verb == "retry" and record["state"] in (FAILED, SKIPPED):
                record.update(state=QUEUED, line=None, failure=None)
                record["supervision"].update(restarts=0, status="running")
            elif verb == "skip" and record["state"] in (QUEUED, FAILED):
                record["state"] = SKIPPED
            elif verb == "skip" and record["state"] == RUNNING:
                record["skip"] = True
                supervisor = self.supervisors.get(variant)
                if supervisor:
                    threading.Thread(target=supervisor.interrupt, daemon=True).start()
            self.state.save()

    def run(self) -> int:
        """Until nothing is left to run, the budget is reached, or a stop; the exit code."""
        self.recover()
        self.ledger["controller"].update(status="running", pid=os.getpid(), started=time.time())
        self.state.save()
        self.state.event("start", programme=self.state.name, variants=len(self.ledger["variants"]),
                         slices=",".join(self.sub.slices), budget=self.sub.budget if self.sub.budget is not None else "none",
                         spent=f"{self.spent_hours():.3f}")
        for command in self.state.commands():
            self.apply(command)
        workers = [threading.Thread(target=self.slice_worker, args=(s,), name=f"slice-{s}", daemon=True)
                   for s in self.sub.slices]
        for w in workers:
            w.start()
        while any(w.is_alive() for w in workers):
            try:
                for command in self.state.commands():
                    self.apply(command)
                time.sleep(self.sleep_s)  # how often requests are looked for
            except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (`run` turns it into this)
                self.halt(Stop("interrupted: the running variants checkpointed; run it again to carry on",
                               EXIT_INTERRUPTED))
        return self.finish()

    def recover(self) -> None:
        """A controller killed mid-run: its variants were running; each resumes on its own slice
        (a skip asked meanwhile is honoured once it has stopped)."""
        for variant, record in self.ledger["variants"].items():
            if record["state"] == RUNNING:
                record["state"] = QUEUED
        self.state.save()

    def finish(self) -> int:
        for variant, record in self.ledger["variants"].items():
            if record.pop("skip", False) and record["state"] == QUEUED:
                record["state"] = SKIPPED
        why = self.stopping
        if why is not None:
            status, line, code = "stopped", why.line, why.code
        elif self.budget_line:
            status, line, code = "budget", self.budget_line, 0
        else:
            status, line, code = "done", None, 0
        self.ledger["controller"].update(status=status, line=line, ended=time.time())
        self.note_spending()
        self.state.save()
        counts = {s: sum(r["state"] == s for r in self.ledger["variants"].values())
                  for s in (COMPLETED, FAILED, SKIPPED, QUEUED)}
        self.state.event("controller-" + status, code=code, spent=f"{self.spent_hours():.3f}",
                         **{k: v for k, v in counts.items()})
        if line:
            print(f"error: {line}" if code else line, file=sys.stderr if code else sys.stdout, flush=True)
        if status == "stopped" and code:
            self.alert(f"{self.state.name}: the controller stopped", line or "")
        return code


class _SliceRecord(supervise.Supervision):
    """The record a slice's own release writes to: events into the controller's log."""

    prefix = "[programme]"

    def __init__(self, state: State, slice_name: str) -> None:
        self.state, self.slice, self.stream = state, slice_name, io.StringIO()
        self.data = {"restarts": 0, "preemptions": 0, "launches": [], "status": "released"}
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
        try:
            return hydra_compose.composed(sub.overrides_of(sub.variants[0])).run.wandb if sub.variants else None
        except Exception:  # noqa: BLE001 - the preflight said why; no alerts then
            return None

    def send(self, title: str, text: str) -> None:
        if not self.online:
            return
        try:
            import wandb

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
    from runtime.lease import Lease

    targets = [(str(state.dir), f"programme {state.name}", "--state-dir")]
    if state.sub.mirror:
        targets.append((state.sub.mirror, f"programme {state.name} (mirror)", "--mirror"))

    def lost(error) -> None:  # another controller took over: this one must not launch anything more
        print(f"error: {error}", file=sys.stderr, flush=True)
        os._exit(EXIT_STORAGE)

    return Lease(targets, run=f"programme/{state.name}", on_lost=lost).acquire()


def run(state_dir: Path, mirror: str | None = None, *, stream: TextIO | None = None,
        alert: Callable[[str, str], None] | None = None) -> int:
    """`programme run`: take the lease, then run the controller to its end. SIGTERM (systemd's
    stop) is handled as Ctrl-C: the running variants checkpoint, the controller exits 130."""
    import signal

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


def _interrupt(_sig, _frame) -> None:
    raise KeyboardInterrupt
