"""Supervise one run on a preemptible TPU VM slice until it completes (`launch.py supervise`).

The loop, top to bottom (`supervise`):
  1. ensure_ready: describe the TPU (and its queued resource); create it when missing, delete
     and re-create it when PREEMPTED/TERMINATED (GCP does not restart those), wait with backoff
     while it is CREATING or queued.
  2. ensure_setup: ask every worker for its versions; run setup only when they differ.
  3. launch: `pod.launch_pod` with the run's fixed id, so every launch resumes its checkpoint.
  4. classify how the launch ended, and act:
       completed (exit 0)                          -> done, exit 0
       preempted (the trainer's "preempted (SIGTERM)" line, or the ssh dropped and the TPU is
                  no longer READY)                 -> back to 1 (not counted as a restart)
       hang (4), peer lost (7), anything else      -> `stop` stale processes, relaunch (a restart)
       storage (6), a failed setup, or the run directory's lease
       still held by the run before (exit 2)       -> back off, relaunch (a restart)
       bad input (2), non-finite (3), no fit (5)   -> stop with that code
     and stop (exit 1) when restarts exceed --max-restarts, or when two restarts in a row ended
     at the same last step as the launch before them (no progress).

State: <log dir>/<run id>/supervision.json, rewritten after every change; a supervisor started
again with the same run id carries on from it (restart count, history, pod time), and when the one
before was killed mid-launch, first stops what still runs on the workers (they checkpoint).
Stopping the supervisor (Ctrl-C, SIGTERM) stops the run too (`run_until_done`). Events: one
`[supervise] <UTC time> <event> key=value ...` line each, on the console and appended to
<log dir>/<run id>/supervise.log.

Pod time is host-hours: the wall time from seeing the TPU READY to the end of each launch, times
its number of workers (hosts; chips = hosts x chips per host).
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence, TextIO

from experiments import pod
from runtime.errors import (EXIT_DOES_NOT_FIT, EXIT_FAILURE, EXIT_HANG, EXIT_NONFINITE, EXIT_PEER_LOST,
                            EXIT_INTERRUPTED, EXIT_STORAGE, EXIT_USER_ERROR)

READY = "READY"
GONE = ("PREEMPTED", "TERMINATED")  # must be deleted before the name can be created again
MISSING = "MISSING"
QUEUE_WAITING = ("CREATING", "ACCEPTED", "PROVISIONING", "WAITING_FOR_RESOURCES", "ACTIVE")
QUEUE_DEAD = ("FAILED", "SUSPENDED")  # delete (--force: with its node) and queue again
FATAL = {EXIT_USER_ERROR: "bad input", EXIT_NONFINITE: "non-finite loss", EXIT_DOES_NOT_FIT: "does not fit"}
RESTART = {EXIT_HANG: "hang watchdog", EXIT_PEER_LOST: "worker lost", EXIT_STORAGE: "storage failure"}
SSH_DROPPED = 255
_PREEMPTED_LINE = re.compile(r"preempted \(SIGTERM\): checkpoint saved at step (\d+)")
_STEP = re.compile(r"(?<!ends at )(?<!lr at )\bstep (\d+)\b")  # not the schedule-change line's total or lr step
# runtime/lease.py's refusal (exit 2): after a hard preemption the dead run's lease is only stale
# after run.lease.stale_after_s, so this "bad input" passes: back off and relaunch.
_LEASE_HELD = "is in use by another run"


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
    poll_s: float = 30.0  # first wait while CREATING/queued; grows x1.5 up to max_poll_s
    max_poll_s: float = 300.0
    storage_backoff_s: float = 120.0
    stop_grace_s: float = 30.0
    state_mirror: str | None = None  # gs://.../supervision.json beside the checkpoints (see state_mirror)
    ship: pod.Pack | None = None  # --ship: the working tree packed once, sent with every launch
    clone_url: str | None = None  # setup clones the repo from here where it is missing (fresh disks)


# --- the gcloud commands ------------------------------------------------------------------------

def _at(t: pod.Target) -> list[str]:
    return ["--zone", t.zone, *(["--project", t.project] if t.project else [])]


def _tier(spec: Spec) -> list[str]:
    return [f"--{spec.tier}"] if spec.tier else []


def _tpu_vm(spec: Spec, verb: str, *flags: str) -> list[str]:
    return ["gcloud", "compute", "tpus", "tpu-vm", verb, spec.target.tpu, *_at(spec.target), *flags]


def describe_argv(spec: Spec) -> list[str]:
    return _tpu_vm(spec, "describe", "--format=json")


def create_argv(spec: Spec) -> list[str]:
    return _tpu_vm(spec, "create", f"--accelerator-type={spec.accelerator_type}", f"--version={spec.runtime_version}",
                   *_tier(spec))


def delete_argv(spec: Spec) -> list[str]:
    return _tpu_vm(spec, "delete", "--quiet")


def queued_describe_argv(spec: Spec) -> list[str]:
    t = spec.target
    return ["gcloud", "compute", "tpus", "queued-resources", "describe", spec.queued_resource, *_at(t),
            "--format=value(state.state)"]


def queued_create_argv(spec: Spec) -> list[str]:
    t = spec.target
    return ["gcloud", "compute", "tpus", "queued-resources", "create", spec.queued_resource, f"--node-id={t.tpu}",
            *_at(t), f"--accelerator-type={spec.accelerator_type}", f"--runtime-version={spec.runtime_version}",
            *_tier(spec)]


def queued_delete_argv(spec: Spec) -> list[str]:
    t = spec.target
    return ["gcloud", "compute", "tpus", "queued-resources", "delete", spec.queued_resource, *_at(t),
            "--quiet", "--force"]


def versions_command(repo_dir: str) -> str:
    """Each worker's versions line (as `setup` prints it), without running setup."""
    return (f"cd {pod.remote_path(repo_dir)} && .venv/bin/python -c {shlex.quote(pod._VERSIONS_SCRIPT)} "
            '"$(hostname)"')


# --- state and events ---------------------------------------------------------------------------

class Supervision:
    """The run's supervision record (supervision.json) and its event log."""

    def __init__(self, spec: Spec, stream: TextIO) -> None:
        self.dir = Path(spec.log_dir) / spec.run_id
        self.path, self.log_path, self.stream = self.dir / "supervision.json", self.dir / "supervise.log", stream
        self.mirror = spec.state_mirror
        self.data = load(self.path) or self.load_mirror() or {"run_id": spec.run_id, "tpu": spec.target.tpu, "zone": spec.target.zone,
                                        "restarts": 0, "preemptions": 0, "host_seconds": 0.0,
                                        "status": "running", "launches": []}

    def save(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        os.replace(tmp, self.path)  # a supervisor killed mid-write leaves the previous record
        if self.mirror:
            try:
                import fsspec

                with fsspec.open(self.mirror, "w") as f:  # one object write: whole or not at all
                    f.write(json.dumps(self.data, indent=1) + "\n")
            except Exception as e:  # the local record stands; the next save tries again
                self.event("state-mirror-failed", uri=self.mirror, detail=shlex.quote(" ".join(str(e).split())[:200]))

    def load_mirror(self) -> dict | None:
        """The record beside the checkpoints, when this machine has none (a supervisor moved here)."""
        if not self.mirror:
            return None
        import fsspec

        try:
            with fsspec.open(self.mirror, "r") as f:
                return parse_record(f.read(), self.mirror)
        except FileNotFoundError:
            return None

    def event(self, name: str, **fields) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        line = " ".join(["[supervise]", stamp, name, *(f"{k}={v}" for k, v in fields.items())])
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
        self.stream.write(line + "\n")
        self.stream.flush()

    def last_step(self) -> int | None:
        launches = self.data["launches"]
        return launches[-1].get("last_step") if launches else None


def load(path: Path) -> dict | None:
    try:
        return parse_record(Path(path).read_text(), path)
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:  # a folder by that name, no permission
        raise pod.PodError(f"cannot read the supervision record {path} ({e.strerror or e}); fix or move it") from e


def parse_record(text: str, where) -> dict:
    """A supervision record's data; a truncated or garbled one is one line (PodError): the record is
    the run's history, so it is never replaced silently."""
    try:
        data = json.loads(text)
    except ValueError as e:
        raise pod.PodError(f"the supervision record {where} is truncated or garbled ({e}); restore it (a copy "
                           "beside the checkpoints, when they are on gs://), or move it away to start a new history "
                           "for this run id") from None
    if not isinstance(data, dict) or not isinstance(data.get("launches"), list):
        raise pod.PodError(f"the supervision record {where} is not a supervision record (no list of launches); "
                           "restore it, or move it away to start a new history for this run id")
    return data


# --- 1. the TPU ---------------------------------------------------------------------------------

Runner = Callable[[Sequence[str]], "tuple[int, str]"]


def run_quiet(argv: Sequence[str]) -> tuple[int, str]:
    """(exit code, stdout + stderr) of a short gcloud call."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise pod.PodError(f"{argv[0]} not found on PATH; install the Google Cloud CLI") from None
    return proc.returncode, proc.stdout + proc.stderr


def tpu_state(spec: Spec, run: Runner) -> tuple[str, int]:
    """(state, number of workers); MISSING when gcloud says NOT_FOUND."""
    code, out = run(describe_argv(spec))
    if code != 0:
        return (MISSING if "NOT_FOUND" in out or "not found" in out else "UNKNOWN"), 0
    try:
        node = json.JSONDecoder().raw_decode(out, out.index("{"))[0]  # stdout's JSON; a stderr notice may follow
    except ValueError:
        return "UNKNOWN", 0
    return node.get("state", "UNKNOWN"), len(node.get("networkEndpoints") or [])


def queue_state(spec: Spec, run: Runner) -> str:
    code, out = run(queued_describe_argv(spec))
    if code != 0:
        return MISSING if "NOT_FOUND" in out or "not found" in out else "UNKNOWN"
    return out.strip().splitlines()[0].strip() if out.strip() else "UNKNOWN"  # stdout's line; stderr follows


class GiveUp(Exception):
    """GCP refused a request in a way that waiting does not fix (a wrong flag, no permission)."""


# A create that fails otherwise (stockout, quota, a network error) is retried with backoff.
_REFUSED = ("INVALID_ARGUMENT", "PERMISSION_DENIED", "unrecognized arguments", "Invalid value")


def act(sup: Supervision, run: Runner, argv: list[str], event: str) -> bool:
    code, out = run(argv)
    detail = " ".join(out.split())[-300:]
    sup.event(event if code == 0 else event + "-failed", code=code,
              **({} if code == 0 else {"detail": shlex.quote(detail)}))
    if code != 0 and any(phrase in out for phrase in _REFUSED):
        raise GiveUp(f"`{shlex.join(argv[:5])}` was refused: {detail}; fix the supervise flags")
    return code == 0


def step_towards_ready(spec: Spec, sup: Supervision, run: Runner, state: str) -> None:
    """One action for a TPU that is not READY: create, delete + create, or nothing (wait)."""
    if spec.queued_resource:
        queued = queue_state(spec, run)
        if queued in QUEUE_DEAD:
            act(sup, run, queued_delete_argv(spec), "queued-resource-deleted")
            queued = state = MISSING  # --force deleted its node too
        if queued == MISSING:
            if state in GONE:
                act(sup, run, delete_argv(spec), "tpu-deleted")
            act(sup, run, queued_create_argv(spec), "queued-resource-created")
        else:
            sup.event("waiting", tpu_state=state, queued_state=queued)
        return
    if state in GONE:
        act(sup, run, delete_argv(spec), "tpu-deleted")
        state = MISSING
    if state == MISSING:
        act(sup, run, create_argv(spec), "tpu-created")
    else:
        sup.event("waiting", tpu_state=state)


def ensure_ready(spec: Spec, sup: Supervision, run: Runner, sleep: Callable[[float], None]) -> int:
    """Wait until the TPU is READY (creating it as needed); its number of workers."""
    wait = spec.poll_s
    while True:
        state, hosts = tpu_state(spec, run)
        if state == READY:
            sup.event("tpu-ready", hosts=hosts)
            return hosts
        step_towards_ready(spec, sup, run, state)
        sleep(wait)
        wait = min(wait * 1.5, spec.max_poll_s)


# --- 2. setup -----------------------------------------------------------------------------------

def ensure_setup(spec: Spec, sup: Supervision, hosts: int) -> int:
    """0 when every worker already reports the same versions (setup skipped), else setup's code.
    The commit the workers first ran is recorded, and a later setup (a re-created TPU's fresh
    clone would otherwise be at the remote's default HEAD) checks that commit out."""
    rows: list[dict] = []
    code = pod.run_gcloud(pod.gcloud_argv(spec.target, versions_command(spec.repo_dir)),
                          on_line=lambda l: rows.append(r) if (r := pod._tagged(l, pod.VERSIONS_TAG)) else None)
    if code == 0 and len(rows) == hosts and len({json.dumps({k: v for k, v in r.items() if k != "host"},
                                                            sort_keys=True) for r in rows}) == 1:
        sup.event("setup-skipped", reason="versions-match", workers=len(rows))
        record_commit(sup, rows)
        return 0
    git_ref = sup.data.get("commit")
    sup.event("setup-started", workers_answering=len(rows), commit=git_ref or "as-cloned")
    rows = []
    code = pod.setup_pod(spec.target, repo_dir=spec.repo_dir, git_ref=git_ref, clone_url=spec.clone_url,
                         stream=sup.stream, on_versions=rows.append)
    sup.event("setup-done" if code == 0 else "setup-failed", code=code)
    if code == 0:
        record_commit(sup, rows)
    return code


def record_commit(sup: Supervision, rows: list[dict]) -> None:
    """Keep the first commit every worker agreed on (the run's code for its whole life)."""
    if "commit" not in sup.data and rows and rows[0].get("commit"):
        sup.data["commit"] = rows[0]["commit"]
        sup.save()


# --- 3. the launch, 4. how it ended ------------------------------------------------------------

class _Capture:
    """The launch's output: passed through to the console, and read for steps and preemption."""

    def __init__(self, stream: TextIO) -> None:
        self.stream, self.last_step, self.preempted_at, self._buf = stream, None, None, ""
        self.lease_held = False

    def write(self, text: str) -> None:
        self.stream.write(text)
        *lines, self._buf = (self._buf + text).split("\n")
        for line in lines:
            self.lease_held = self.lease_held or _LEASE_HELD in line
            m = _PREEMPTED_LINE.search(line)
            if m:
                self.preempted_at = int(m.group(1))
            steps = [int(s) for s in _STEP.findall(line)]
            if steps:
                self.last_step = max(steps + ([self.last_step] if self.last_step is not None else []))

    def flush(self) -> None:
        self.stream.flush()


def classify(code: int, capture: _Capture, state_after: str | None) -> str:
    """completed, preempted, restart, backoff or fatal."""
    if capture.preempted_at is not None and code in (0, SSH_DROPPED):
        return "preempted"
    if code == 0:
        return "completed"
    if state_after not in (None, READY, "UNKNOWN"):  # UNKNOWN: the describe failed, the exit code decides
        return "preempted"  # the ssh dropped (or the workers died) because the TPU went away
    if code in FATAL and not (code == EXIT_USER_ERROR and capture.lease_held):
        return "fatal"
    return "backoff" if code == EXIT_STORAGE or capture.lease_held else "restart"


def cause(code: int, outcome: str, capture: _Capture) -> str:
    if outcome in ("completed", "preempted"):
        return outcome
    if capture.lease_held:
        return "lease held"
    return FATAL.get(code) or RESTART.get(code) or f"exit {code}"


def launch_once(spec: Spec, sup: Supervision, run: Runner, hosts: int, ready_at: float) -> tuple[str, int]:
    """Launch the run, record the launch; (outcome, exit code)."""
    capture = _Capture(sup.stream)
    sup.event("launch", run_id=spec.run_id, attempt=len(sup.data["launches"]) + 1)
    sup.data["in_flight"] = True
    sup.save()
    code = pod.launch_pod(spec.target, spec.overrides, repo_dir=spec.repo_dir, run_id=spec.run_id,
                          log_dir=spec.log_dir, env=spec.env, forward_env=spec.forward_env,
                          interrupt_grace=spec.stop_grace_s, ship=spec.ship or False, stream=capture)
    state_after = tpu_state(spec, run)[0] if code != 0 else None
    outcome = classify(code, capture, state_after)
    sup.data["host_seconds"] += (time.time() - ready_at) * hosts
    sup.data["launches"].append({"started": ready_at, "ended": time.time(), "code": code, "outcome": outcome,
                                 "cause": cause(code, outcome, capture), "last_step": capture.last_step,
                                 "tpu_state_after": state_after})
    sup.data["in_flight"] = False
    sup.save()
    sup.event("launch-ended", code=code, outcome=outcome, cause=shlex.quote(cause(code, outcome, capture)),
              last_step=capture.last_step, tpu_state=state_after or READY)
    return outcome, code


def no_progress(launches: list[dict]) -> bool:
    """The last two launches were restarts and both ended at the step the launch before them did."""
    if len(launches) < 3:
        return False
    a, b, c = launches[-3:]
    return (b["outcome"] in ("restart", "backoff") and c["outcome"] in ("restart", "backoff")
            and a.get("last_step") == b.get("last_step") == c.get("last_step"))


def finish(sup: Supervision, status: str, code: int, **fields) -> int:
    sup.data["status"] = status
    sup.save()
    sup.event(status, code=code, restarts=sup.data["restarts"], preemptions=sup.data["preemptions"],
              host_hours=f"{sup.data['host_seconds'] / 3600:.3f}", **fields)
    return code


def state_mirror(overrides: Sequence[str]) -> tuple[str | None, str]:
    """(<run.checkpoint.dir>/supervision.json when the checkpoints are on gs://, else None; why),
    from the config the trainer composes (conf/ + the overrides)."""
    from hydra import compose, initialize_config_dir

    from runtime.config import register_schemas, run_dirs, validate

    try:
        register_schemas()
        with initialize_config_dir(config_dir=str(Path(__file__).resolve().parent.parent / "conf"),
                                   version_base=None):
            cfg = compose(config_name="config", overrides=list(overrides))
        experiment = next((o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("experiment=")), None)
        checkpoints = run_dirs(validate(cfg, experiment))[1]
    except Exception as e:  # the trainer reports a bad override itself, in one line
        return None, f"the overrides do not compose here ({' '.join(str(e).split())[:200]})"
    if not checkpoints.startswith("gs://"):
        return None, f"checkpoints are local to the workers ({checkpoints})"
    return checkpoints.rstrip("/") + "/supervision.json", "beside the checkpoints"


# --- the loop -----------------------------------------------------------------------------------

def supervise(spec: Spec, *, stream: TextIO | None = None, run: Runner = run_quiet,
              sleep: Callable[[float], None] = time.sleep) -> int:
    """Run until the run completes (0), fails for good (its code) or stops making progress (1)."""
    sup = Supervision(spec, stream or sys.stdout)
    resumed = bool(sup.data["launches"])
    orphaned = sup.data.get("in_flight", False)  # the supervisor before was killed mid-launch
    sup.data["status"] = "running"
    sup.save()
    sup.event("start", run_id=spec.run_id, tpu=spec.target.tpu, resumed=resumed,
              restarts=sup.data["restarts"], launches=len(sup.data["launches"]), state=sup.path,
              mirror=spec.state_mirror or "none", shipped_tree=spec.ship.tree_hash[:16] if spec.ship else "none")
    while True:
        try:
            hosts = ensure_ready(spec, sup, run, sleep)
        except GiveUp as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return finish(sup, "failed", EXIT_USER_ERROR, cause="gcloud-refused")
        ready_at = time.time()
        if orphaned:  # its launch may still run: stop it (it checkpoints) rather than race it for the lease
            orphaned = False
            code = pod.stop_pod(spec.target, grace=spec.stop_grace_s, stream=sup.stream)
            sup.event("stopped-stale-processes", code=code, reason="supervisor-restarted")
        if ensure_setup(spec, sup, hosts) != 0:  # a failing setup (a network blip) waits before the next try
            outcome, code = "backoff", EXIT_FAILURE
        else:
            outcome, code = launch_once(spec, sup, run, hosts, ready_at)
        if outcome == "completed":
            return finish(sup, "completed", 0, last_step=sup.last_step())
        if outcome == "fatal":
            return finish(sup, "failed", code, cause=shlex.quote(FATAL[code]))
        if outcome == "preempted":
            sup.data["preemptions"] += 1
            sup.save()
            continue
        if code == EXIT_INTERRUPTED:
            return finish(sup, "interrupted", code)
        sup.data["restarts"] += 1
        sup.save()
        if sup.data["restarts"] > spec.max_restarts:
            return finish(sup, "gave-up", EXIT_FAILURE, reason="max-restarts", max_restarts=spec.max_restarts)
        if no_progress(sup.data["launches"]):
            return finish(sup, "gave-up", EXIT_FAILURE, reason="no-progress", last_step=sup.last_step())
        recover(spec, sup, outcome, sleep)


def recover(spec: Spec, sup: Supervision, outcome: str, sleep: Callable[[float], None]) -> None:
    """Before a relaunch: free the TPU of stale processes; after a storage or setup failure, wait first."""
    if outcome == "backoff":
        sup.event("backoff", seconds=spec.storage_backoff_s)
        sleep(spec.storage_backoff_s)
    code = pod.stop_pod(spec.target, grace=spec.stop_grace_s, stream=sup.stream)
    sup.event("stopped-stale-processes", code=code, restarts=sup.data["restarts"])


def run_until_done(spec: Spec) -> int:
    """`supervise` for the command line: SIGTERM (systemd's stop) is handled as Ctrl-C, which
    stops the run on the workers (they checkpoint) and then the supervisor (exit 130)."""
    def interrupt(_sig, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    try:
        return supervise(spec)
    except KeyboardInterrupt:
        sup = Supervision(spec, sys.stdout)
        return finish(sup, "interrupted", EXIT_INTERRUPTED)


# --- what an operator sees without running anything ---------------------------------------------

def dry_run(spec: Spec) -> str:
    """The exact gcloud commands the supervisor issues in each state of the TPU."""
    q = spec.queued_resource
    ready = [shlex.join(describe_argv(spec)),
             "# versions check (setup is skipped when every worker matches):",
             shlex.join(pod.gcloud_argv(spec.target, versions_command(spec.repo_dir))),
             "# otherwise setup:", shlex.join(pod.gcloud_argv(spec.target, pod.setup_command(spec.repo_dir, clone_url=spec.clone_url))),
             "# the launch (every launch resumes the run's checkpoint):"]
    sections = {
        "missing": [shlex.join(describe_argv(spec)),
                    *([shlex.join(queued_describe_argv(spec)), shlex.join(queued_create_argv(spec))] if q
                      else [shlex.join(create_argv(spec))])],
        "CREATING (or queued: " + ", ".join(QUEUE_WAITING[:-1]) + "): wait with backoff, then again":
            [shlex.join(describe_argv(spec)), *([shlex.join(queued_describe_argv(spec))] if q else [])],
        "READY": ready,
        "PREEMPTED or TERMINATED": [shlex.join(describe_argv(spec)),
                                    *([shlex.join(queued_describe_argv(spec)), shlex.join(queued_delete_argv(spec)),
                                       shlex.join(queued_create_argv(spec))] if q
                                      else [shlex.join(delete_argv(spec)), shlex.join(create_argv(spec))])],
        "after a hang, a lost worker or an unknown failure (before the relaunch)":
            [shlex.join(pod.gcloud_argv(spec.target, pod.stop_command(spec.stop_grace_s)))],
    }
    if q:
        sections["queued resource FAILED or SUSPENDED"] = [shlex.join(queued_delete_argv(spec)),
                                                           shlex.join(queued_create_argv(spec))]
    out = []
    for state, lines in sections.items():
        out += [f"# TPU {state}:", *lines]
        if state == "READY":
            shown = io.StringIO()
            pod.launch_pod(spec.target, spec.overrides, repo_dir=spec.repo_dir, run_id=spec.run_id, env=spec.env,
                           forward_env=spec.forward_env, ship=spec.ship or False, dry_run=True, stream=shown)
            out.append(shown.getvalue())
    return "\n".join(line.rstrip("\n") for line in out) + "\n"


def status_text(log_dir: Path, run_id: str) -> str | None:
    """The supervision history of a run, for `launch.py supervise --status`; None if there is none."""
    data = load(Path(log_dir) / run_id / "supervision.json")
    if data is None:
        return None
    lines = [f"run {data['run_id']} on {data['tpu']} ({data['zone']}): {data['status']}; "
             f"{len(data['launches'])} launches, {data['restarts']} restarts, {data['preemptions']} preemptions; "
             f"{data['host_seconds'] / 3600:.3f} host-hours (READY wall time x workers)"]
    for i, launch in enumerate(data["launches"], 1):
        when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(launch["started"]))
        minutes = (launch["ended"] - launch["started"]) / 60
        lines.append(f"  {i:>3}  {when}  {minutes:7.1f} min  exit {launch['code']:>3}  {launch['cause']:<16} "
                     f"last step {launch['last_step'] if launch['last_step'] is not None else '-'}")
    return "\n".join(lines) + "\n"
