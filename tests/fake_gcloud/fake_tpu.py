"""The fake TPU control plane behind tests/fake_gcloud/gcloud, and the test hooks that act on it.

State: $FAKE_GCLOUD_ROOT/control.json, {"tpus": {NAME: {...}}, "queued": {ID: {...}}, "ready_log":
[[NAME, start, end, hosts], ...]}, read and written under an flock (several gcloud calls and the
test may touch it at once). While the file does not exist, the fake has no control plane: every
TPU exists and is READY (the launcher tests).

A TPU: {"state": CREATING|READY|PREEMPTED, "describes": n, "accelerator": T, "spot": bool,
"hosts": n, "ready_since": time or None, "workers": [process group of each worker's latest ssh
command], "groups": [every such group]}. CREATING becomes READY on the $FAKE_GCLOUD_CREATE_POLLS-th
describe (default 1). A queued resource: {"state": ACCEPTED|PROVISIONING|ACTIVE|SUSPENDED, "node":
NAME, "describes": n}; each state lasts $FAKE_GCLOUD_QUEUE_POLLS describes (default 1); ACTIVE
creates its node, READY. `ready_log` holds every interval a TPU was READY (what GCP bills).

Disks: with $FAKE_GCLOUD_ROOT/image (the boot image: helpers.make_fake_workers(image=True)), the
workers of TPU NAME live in $FAKE_GCLOUD_ROOT/NAME/worker-<i>, made from the image when the TPU is
created (a re-created TPU has fresh disks, as on GCP). Without one, in $FAKE_GCLOUD_ROOT/worker-<i>.

A worker "VM" is every process whose HOME is that worker's home (its ssh commands and all they
start, W&B's wandb-core in a session of its own included). Test hooks (`preempt`, `kill_worker`):
what GCP and a crash do to them. A preemption is a VM shutdown: SIGTERM to every process of the
VM, SIGKILL to what is left after GCE's 30 s window.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

TRAINER = "pretrain_jax"  # a trainer's cmdline holds this ...
GUARD = "experiments.launcher.worker.once"  # ... and so does its launch guard's, which is not a trainer
SHUTDOWN_WINDOW_S = 30.0  # GCE: a preempted VM is stopped 30 s after its processes get SIGTERM


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
        state.setdefault("ready_log", [])
        yield state
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, path)


def enable(root: Path, tpus: dict | None = None, workers: int = 2) -> None:
    """Start a control plane (tests): no TPU, or the given ones (their disks made from the image)."""
    with control(root, create=True) as state:
        for name, tpu in (tpus or {}).items():
            state["tpus"][name] = {"describes": 0, "hosts": workers, "ready_since": None, "workers": [], "groups": [],
                                   **tpu}
            fresh_disks(root, name, workers)
            if tpu.get("state") == "READY":
                state["tpus"][name]["state"] = None
                became(state, name, "READY")


# --- disks ----------------------------------------------------------------------------------------

def homes(root: Path, tpu: str, workers: int) -> list[Path]:
    """The workers' home directories of TPU `tpu` (see the module docstring)."""
    root = Path(root)
    if (root / "image").is_dir():
        return [root / tpu / f"worker-{i}" for i in range(workers)]
    return [root / f"worker-{i}" for i in range(workers)]


def fresh_disks(root: Path, tpu: str, workers: int) -> None:
    """A created TPU's workers start from the boot image."""
    image = Path(root) / "image"
    if not image.is_dir():
        return
    for home in homes(root, tpu, workers):
        if home.exists():
            shutil.rmtree(home)
        shutil.copytree(image, home, symlinks=True)


# --- READY time -----------------------------------------------------------------------------------

def became(state: dict, name: str, new: str, at: float | None = None) -> None:
    """TPU `name` changes state (`at`: when the request that changed it arrived): open or close its
    READY interval."""
    tpu, now = state["tpus"][name], at or time.time()
    if new == "READY" and tpu.get("ready_since") is None:
        tpu["ready_since"] = now
    elif new != "READY" and tpu.get("ready_since") is not None:
        state["ready_log"].append([name, tpu["ready_since"], now, tpu.get("hosts", 1)])
        tpu["ready_since"] = None
    tpu["state"] = new


def ready_host_seconds(root: Path, now: float | None = None) -> float:
    """Seconds each TPU was READY x its hosts, summed (intervals still open: up to `now`, default now)."""
    with control(root) as state:
        now = time.time() if now is None else now
        closed = sum((end - start) * hosts for _, start, end, hosts in state["ready_log"])
        open_ = sum((now - t["ready_since"]) * t.get("hosts", 1) for t in state["tpus"].values() if t.get("ready_since"))
    return closed + open_


# --- processes ------------------------------------------------------------------------------------

def _proc(pid: str) -> tuple[list[str], str, bytes] | None:
    """(stat fields after the name, cmdline, environ) of a live process we may read, else None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        if fields[0] in "ZX":
            return None
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
        return fields, cmd, env
    except (OSError, IndexError):
        return None


def group_members(pgid: int) -> list[tuple[int, str]]:
    """(pid, cmdline) of the live processes of process group `pgid`."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and (p := _proc(name)) is not None and int(p[0][2]) == pgid:
            found.append((int(name), p[1]))
    return found


def vm_processes(home: Path) -> list[tuple[int, str]]:
    """(pid, cmdline) of every process of the worker VM whose home is `home`."""
    marker = b"HOME=" + os.fsencode(os.path.realpath(home))
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid() and (p := _proc(name)) is not None:
            if marker in p[2].split(b"\0"):
                found.append((int(name), p[1]))
    return found


def is_trainer(cmd: str) -> bool:
    return TRAINER in cmd and GUARD not in cmd


def signal_trainers(pgid: int, sig: int) -> list[int]:
    pids = [pid for pid, cmd in group_members(pgid) if is_trainer(cmd)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    return pids


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def kill_groups(groups: list[int]) -> None:
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


def power_off(vm_homes: list[Path]) -> None:
    """What stopping or deleting the VMs does to what still runs on them."""
    _signal([pid for home in vm_homes for pid, _ in vm_processes(home)], signal.SIGKILL)


def _workers(state: dict, name: str) -> int:
    return state["tpus"][name].get("hosts") or int(os.environ.get("FAKE_GCLOUD_WORKERS", "2"))


def preempt(root: Path, name: str, window: float = SHUTDOWN_WINDOW_S) -> list[int]:
    """GCP preempts TPU `name` (READY or still CREATING): its state becomes PREEMPTED and each
    worker VM shuts down: SIGTERM to every process of the VM (the trainer checkpoints; W&B's
    wandb-core dies), SIGKILL to what is left `window` seconds later. The trainers signalled."""
    with control(root) as state:
        became(state, name, "PREEMPTED")
        vm_homes = homes(root, name, _workers(state, name))
    processes = [p for home in vm_homes for p in vm_processes(home)]
    _signal([pid for pid, _ in processes], signal.SIGTERM)
    threading.Thread(target=_end_of_window, args=(vm_homes, window), daemon=True).start()
    return [pid for pid, cmd in processes if is_trainer(cmd)]


def _end_of_window(vm_homes: list[Path], window: float) -> None:
    deadline = time.monotonic() + window
    while any(vm_processes(h) for h in vm_homes) and time.monotonic() < deadline:
        time.sleep(0.1)
    power_off(vm_homes)


def kill_worker(root: Path, name: str, worker: int) -> list[int]:
    """Worker `worker`'s trainer dies (SIGKILL); the TPU stays READY."""
    with control(root) as state:
        groups = list(state["tpus"][name].get("workers", []))
    return signal_trainers(groups[worker], signal.SIGKILL)
