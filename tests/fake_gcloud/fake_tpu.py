"""The fake TPU control plane behind tests/fake_gcloud/gcloud, and the test hooks that act on it.

State: $FAKE_GCLOUD_ROOT/control.json, {"tpus": {NAME: {...}}, "queued": {ID: {...}}}, read and
written under an flock (several gcloud calls and the test may touch it at once). While the file
does not exist, the fake has no control plane: every TPU exists and is READY (the launcher tests).

A TPU: {"state": CREATING|READY|PREEMPTED, "describes": n, "accelerator": T, "spot": bool,
"workers": [process group of each worker's command of the running ssh]}. CREATING becomes READY
on the $FAKE_GCLOUD_CREATE_POLLS-th describe (default 1). A queued resource: {"state":
ACCEPTED|PROVISIONING|ACTIVE|SUSPENDED, "node": NAME, "describes": n}; each state lasts
$FAKE_GCLOUD_QUEUE_POLLS describes (default 1); ACTIVE creates its node, READY.

Test hooks (`preempt`, `kill_worker`): what GCP and a crash do to the workers' processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import time
from pathlib import Path

TRAINER = "pretrain_jax"  # the processes a preemption signals (cmdline)


def control_file(root: Path) -> Path:
    return Path(root) / "control.json"


@contextlib.contextmanager
def control(root: Path, create: bool = False):
    """The control plane's state, saved back at the end; None when there is none (and not `create`)."""
    path = control_file(root)
    if not path.exists() and not create:
        yield None
        return
    with open(Path(root) / "control.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = json.loads(path.read_text()) if path.exists() else {}
        state.setdefault("tpus", {})
        state.setdefault("queued", {})
        yield state
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, path)


def enable(root: Path, tpus: dict | None = None) -> None:
    """Start a control plane (tests): no TPU, or the given ones."""
    with control(root, create=True) as state:
        state["tpus"].update(tpus or {})


def group_members(pgid: int) -> list[tuple[int, str]]:
    """(pid, cmdline) of the live processes of process group `pgid`."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid or fields[0] in "ZX":
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                found.append((int(name), f.read().replace(b"\0", b" ").decode(errors="replace")))
        except (OSError, ValueError, IndexError):
            continue
    return found


def signal_trainers(pgid: int, sig: int) -> list[int]:
    pids = [pid for pid, cmd in group_members(pgid) if TRAINER in cmd]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    return pids


def kill_groups(groups: list[int]) -> None:
    """What deleting the VM does to what still runs on it."""
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


def preempt(root: Path, name: str) -> list[int]:
    """GCP preempts TPU `name`: its state becomes PREEMPTED and every worker's trainer gets
    SIGTERM (it checkpoints and exits; the ssh then drops). The pids signalled."""
    with control(root) as state:
        tpu = state["tpus"][name]
        tpu["state"] = "PREEMPTED"
        groups = list(tpu.get("workers", []))
    return [pid for g in groups for pid in signal_trainers(g, signal.SIGTERM)]


def kill_worker(root: Path, name: str, worker: int) -> list[int]:
    """Worker `worker`'s trainer dies (SIGKILL); the TPU stays READY."""
    with control(root) as state:
        groups = list(state["tpus"][name].get("workers", []))
    return signal_trainers(groups[worker], signal.SIGKILL)


def wait_groups_gone(groups: list[int], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while any(group_members(g) for g in groups) and time.monotonic() < deadline:
        time.sleep(0.05)
