"""`.venv/bin/python -m experiments.launcher.worker.doctor_checks HOST SPEC [--secrets FILE]`: what `launch.py doctor`
(experiments/doctor.py) checks and measures on one worker, answered as one doctor line
(runtime/wire.py `DoctorReport`). SPEC is the launcher's JSON (`Spec` below).

The checks run one after another, each within its budget (`BUDGETS`, seconds): one that overruns is
one `overrun` verdict and the next starts. Everything that starts the TPU runs in a child process
(`--jax`: imports, jax.distributed, the devices, HBM, an all-reduce; then, for each variant given,
two short runs of the real trainer), killed with its process group when its budget ends, so that no
process of the doctor holds the TPU after it. The TPU checks come first: a TPU held by another
process is named (pid, command line) and the children are not started. What it writes: objects
under the bucket's scratch prefix (deleted), and the short runs' folder there or in a folder of
its own under --measure-root (removed).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable

from experiments.launcher.worker import procs, versions
from runtime import gce_metadata, wire

# Seconds each check may take (the launcher's --port-wait adds to `ports`; `measure` is per variant).
BUDGETS = {"software": 30.0, "tpu": 15.0, "disk": 5.0, "metadata": 10.0, "maintenance": 10.0, "ports": 10.0,
           "slice": 240.0, "storage": 180.0, "wandb": 30.0, "measure": 900.0}
GROUPS = ("software", "tpu", "disk", "metadata", "maintenance", "ports", "slice", "storage", "wandb", "measure")
MODULE = "experiments.launcher.worker.doctor_checks"  # this file, as its children run it
LOCKFILE = "/tmp/libtpu_lockfile"  # libtpu's; PODRUNNER_LIBTPU_LOCKFILE for tests (as worker/stop.py)
HELLO, WELCOME = b"podrunner-doctor-hello\n", b"podrunner-doctor-welcome\n"
WANDB_URL = "https://api.wandb.ai"  # W&B's API; WANDB_BASE_URL (W&B's own variable) names another
HANG_ENV = "PODRUNNER_DOCTOR_HANG"  # tests only: WORKER:CHECK:SECONDS, that check there hangs (a child) past that budget


@dataclass
class Spec:
    """What the launcher asks: the check groups, the ports, the bucket's scratch prefix, sizes."""
    only: list[str] = field(default_factory=lambda: list(GROUPS))
    port: int = 8482  # distributed.port
    liveness_port: int | None = None  # distributed.liveness_port (None: the port + 1)
    port_wait: float = 60.0  # how long worker 0 waits for the others (late workers)
    scratch: str = "doctor"  # the run's own name: ~/podrunner-doctor/<scratch>, <bucket>/<scratch>/
    bucket: str | None = None  # gs://bucket[/prefix]
    checkpoint_mb: float = 64.0
    disk_need_gb: float = 10.0  # a checkpoint and the dataset on the worker's disk
    allreduce_mb: list[float] = field(default_factory=lambda: [1.0, 16.0, 64.0])
    variants: list[list[str]] = field(default_factory=list)  # each: a variant's trainer overrides
    measure_steps: int = 4
    sent: float | None = None  # when the launcher started the ssh (Unix seconds): the launch figure
    measure_budget: float = 900.0  # seconds per variant, both runs
    measure_root: str | None = None  # the short runs' run.root, seen by every worker (None: <bucket>/<scratch>/runs)


@dataclass
class Worker:
    """One worker's doctor run: its verdicts and figures as they come."""
    host: str
    spec: Spec
    checks: list[wire.Check] = field(default_factory=list)
    figures: list[wire.Measured] = field(default_factory=list)
    platform: str | None = None
    facts: dict[str, Any] = field(default_factory=dict)

    def say(self, name: str, status: str, detail: str, fix: str = "", seconds: float = 0.0) -> None:
        self.checks.append(wire.Check(name, status, " ".join(detail.split())[:600], fix, round(seconds, 3)))

    def failed(self, *names: str) -> bool:
        return any(c.status in ("fail", "overrun") for c in self.checks if c.name in names)


_ASKED: dict[str, str | None] = {}


def worker_id() -> str | None:
    """This worker's number: TPU_WORKER_ID or JAX_PROCESS_ID, else the metadata server's (asked once), else None."""
    given = os.environ.get("TPU_WORKER_ID") or os.environ.get("JAX_PROCESS_ID")
    if given is None and on_gce() and "worker" not in _ASKED:
        try:
            _ASKED["worker"] = gce_metadata.get("instance/attributes/agent-worker-number")
        except (OSError, ValueError):
            _ASKED["worker"] = None
    return given or _ASKED.get("worker")


def run_within(w: Worker, group: str, budget: float, fn: Callable[[Worker], None]) -> None:
    """`fn(w)` in a thread given `budget` seconds; past it, one `overrun` verdict (the thread is left
    to end with the process: a check that waits on the network only)."""
    t0 = time.monotonic()
    errors: list[BaseException] = []

    def body() -> None:
        try:
            fn(w)
        except Exception as e:  # noqa: BLE001 - a check that crashed is its verdict
            errors.append(e)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(budget)
    took = time.monotonic() - t0
    if thread.is_alive():
        w.say(group, "overrun", f"did not finish within its budget of {budget:g} s",
              "run `launch.py doctor --only " + group + "` again; if it overruns again, that is the finding", took)
    elif errors:
        w.say(group, "fail", f"the check itself failed: {type(errors[0]).__name__}: {errors[0]}",
              "report it with this line", took)


# --- software ----------------------------------------------------------------------------------

def check_software(w: Worker) -> None:
    t0 = time.monotonic()
    row = {"commit": versions.commit(), "python": sys.version.split()[0], "venv": sys.prefix,
           "tree": os.environ.get("PODRUNNER_SHIPPED_TREE")}
    row.update({p: versions.version(p) for p in versions.COMPARED})
    w.facts["versions"] = row
    found = versions.problems(False)
    if found:
        w.say("software", "fail", "the .venv does not fit the project: " + "; ".join(found),
              "run `launch.py setup` (setup_tpu.sh installs the pins)", time.monotonic() - t0)
    else:
        w.say("software", "ok", "Python {python}, jax {jax}, jaxlib {jaxlib}, libtpu {libtpu}, commit {commit}"
              .format(**row), seconds=time.monotonic() - t0)
    launch = next((m.seconds for m in w.figures if m.name == "launch"), None)
    if launch is not None:  # what a launch's versions check costs: the ssh and python's start, then the check
        w.figures.append(wire.Measured("setup_check", launch + time.monotonic() - t0, "the ssh to this worker and "
                                       "its versions check (the launch figure + the software check)"))


# --- the TPU -----------------------------------------------------------------------------------

def check_tpu(w: Worker) -> None:
    t0 = time.monotonic()
    holders = [(pid, " ".join(argv)) for pid, argv, _ours, holds in procs.processes(True) if holds]
    lock = os.path.expanduser(os.environ.get("PODRUNNER_LIBTPU_LOCKFILE", LOCKFILE))
    users = procs.open_by(lock) if os.path.exists(lock) else []
    holders += [(pid, _cmdline(pid)) for pid in users if pid not in {p for p, _ in holders}]
    if holders:
        pid, cmd = holders[0]
        w.say("tpu-free", "fail", f"pid {pid} holds the TPU: {cmd[:300]}"
              + (f" (and {len(holders) - 1} more)" if len(holders) > 1 else ""),
              f"`launch.py stop` ends it if it is this login's, else `sudo kill -9 {pid}`", time.monotonic() - t0)
    else:
        w.say("tpu-free", "ok", "no process holds the TPU", seconds=time.monotonic() - t0)
    if os.path.exists(lock) and not users:
        w.say("lockfile", "fail", f"stale libtpu lockfile {lock} (no process has it open)",
              "`launch.py stop` removes it", time.monotonic() - t0)
    else:
        w.say("lockfile", "ok", f"no stale {lock}", seconds=time.monotonic() - t0)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


# --- disk, metadata, maintenance ---------------------------------------------------------------

def disk_free(path: str) -> int:
    return shutil.disk_usage(path).free


def check_disk(w: Worker) -> None:
    home = os.path.expanduser("~")
    free, need = disk_free(home), w.spec.disk_need_gb * 1e9
    verdict = "ok" if free >= need else "fail"
    w.say("disk", verdict, f"{free / 1e9:.1f} GB free on {home}'s disk, {need / 1e9:g} GB needed (a checkpoint "
                           "and the dataset)", "" if verdict == "ok" else f"free space on {home}'s disk, or give "
                           "the slice a larger boot disk")


def on_gce() -> bool:
    """A metadata server to ask: GCE_METADATA_IP given, or a TPU VM (its accelerator type set)."""
    return bool(os.environ.get("GCE_METADATA_IP") or os.environ.get("TPU_ACCELERATOR_TYPE")
                or os.path.exists("/sys/class/dmi/id/product_name")
                and "Google" in open("/sys/class/dmi/id/product_name").read())


def check_metadata(w: Worker) -> None:
    if not on_gce():
        w.say("metadata", "skip", "not a GCE VM (no metadata server here: a CPU stand-in)")
        return
    try:
        kind = gce_metadata.get("instance/attributes/accelerator-type")
        w.facts["accelerator"] = kind
        w.say("metadata", "ok", f"the metadata server answers (accelerator-type {kind})")
    except (OSError, ValueError) as e:
        w.say("metadata", "fail", f"the metadata server does not answer ({e})",
              "check the VM's network (the metadata server is 169.254.169.254); recreate the slice if it persists")


def check_maintenance(w: Worker) -> None:
    if not on_gce():
        w.say("maintenance", "skip", "not a GCE VM (no maintenance-event endpoint here)")
        return
    try:
        event = gce_metadata.get("instance/maintenance-event")
    except (OSError, ValueError) as e:
        w.say("maintenance", "fail", f"instance/maintenance-event does not answer ({e})",
              "check the VM's network to the metadata server; a preemption notice would not arrive")
        return
    try:
        preempted = gce_metadata.get("instance/preempted")
    except (OSError, ValueError):
        preempted = "unknown"
    status = "ok" if event == "NONE" else "fail"
    w.say("maintenance", status, f"maintenance-event {event}, preempted {preempted}",
          "" if status == "ok" else "a maintenance event is pending: wait for it, or recreate the slice")


# --- the network between workers ---------------------------------------------------------------

def coordinator(w: Worker) -> tuple[str, int, int, int, int] | None:
    """(worker 0's host, coordinator port, liveness port, this process's id, process count) as the
    trainer would join (runtime/distributed.py explicit_values), None for a single process."""
    from runtime.config import DistributedConfig
    from runtime.distributed import explicit_values

    values = explicit_values(DistributedConfig(port=w.spec.port, liveness_port=w.spec.liveness_port), os.environ)
    if values is None or values.num_processes == 1:
        return None
    host, _, port = values.coordinator_address.rpartition(":")
    live = w.spec.liveness_port if w.spec.liveness_port is not None else int(port) + 1
    return host.strip("[]"), int(port), live, values.process_id, values.num_processes


def listener_of(port: int) -> str:
    """Who listens on TCP `port` here ('pid P: cmdline'), from /proc/net/tcp*, where it can be seen."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                for row in f.read().splitlines()[1:]:
                    cols = row.split()
                    if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":
                        inodes.add(cols[9])
        except (OSError, IndexError, ValueError):
            pass
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}").strip("socket:[]") in inodes:
                    return f"pid {pid}: {_cmdline(int(pid))[:200]}"
        except OSError:
            continue
    return "a process this login cannot see"


def check_ports(w: Worker) -> None:
    where = coordinator(w)
    if where is None:
        w.say("ports", "skip", "one process: no coordinator to reach")
        return
    host, port, live, me, count = where
    w.facts["coordinator"] = f"{host}:{port}"
    deadline = time.monotonic() + w.spec.port_wait
    both = [threading.Thread(target=_serve, args=(w, f"{name}-port", p, count, deadline)) if me == 0 else
            threading.Thread(target=_reach, args=(w, f"{name}-port", host, p, me, deadline))
            for name, p in (("coordinator", port), ("liveness", live))]  # at once: each side waits for the other
    for t in both:
        t.start()
    for t in both:
        t.join()


def _serve(w: Worker, check: str, port: int, count: int, deadline: float) -> None:
    """Worker 0: listen on `port` until every other worker said hello (or the deadline)."""
    try:
        server = socket.create_server(("", port), reuse_port=False)
    except OSError as e:
        w.say(check, "fail", f"port {port} on worker 0 cannot be listened on ({e.strerror}): held by "
                             f"{listener_of(port)}",
              "end that process, or give the doctor and the runs another port (distributed.port / --port)")
        return
    seen: set[str] = set()
    with server:
        while len(seen) < count - 1 and time.monotonic() < deadline:
            server.settimeout(max(0.05, deadline - time.monotonic()))
            try:
                conn, _ = server.accept()
            except (socket.timeout, OSError):
                break
            with conn:
                conn.settimeout(5)
                try:
                    said = conn.recv(64)
                    if said.startswith(HELLO):
                        seen.add(said[len(HELLO):].decode(errors="replace").strip())
                        conn.sendall(WELCOME)
                except OSError:
                    pass
    missing = count - 1 - len(seen)
    if missing:
        w.say(check, "fail", f"{missing} of {count - 1} workers did not reach worker 0 on port {port} within "
                             f"{w.spec.port_wait:g} s (reached: {sorted(seen) or 'none'})",
              f"open TCP {port} between the workers (a firewall rule for the slice's network), or raise --port-wait "
              "for late workers")
    else:
        w.say(check, "ok", f"every worker reached port {port} here")


def _reach(w: Worker, check: str, host: str, port: int, me: int, deadline: float) -> None:
    """Another worker: connect to worker 0's `port` (retrying until the deadline: it may come late)."""
    last = ""
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=min(5.0, max(0.1, deadline - time.monotonic()))) as s:
                s.settimeout(max(0.1, deadline - time.monotonic()))
                s.sendall(HELLO + f"{me}\n".encode())
                if s.recv(64).startswith(WELCOME):
                    w.say(check, "ok", f"worker 0 ({host}) reached on port {port}")
                    return
                last = "something else answers there"
                break
        except OSError as e:
            last = str(e.strerror or e)
            time.sleep(0.2)  # worker 0 may not listen yet: try again until the deadline
    w.say(check, "fail", f"cannot reach worker 0 ({host}) on port {port} within {w.spec.port_wait:g} s ({last})",
          f"open TCP {port} from every worker to worker 0 (a firewall rule), and end whatever else listens there")


# --- storage -----------------------------------------------------------------------------------

def check_storage(w: Worker) -> None:
    if not w.spec.bucket:
        w.say("bucket", "skip", "no --bucket given")
        return
    import fsspec  # gs:// goes through gcsfs, as the trainer's writes (runtime/atomic.py)

    prefix = f"{w.spec.bucket.rstrip('/')}/{w.spec.scratch}/{w.host}"
    fs, _ = fsspec.core.url_to_fs(prefix)
    small = f"{prefix}/small"
    try:
        t0 = time.monotonic()
        fs.pipe_file(small, b"podrunner doctor")
        if fs.cat_file(small) != b"podrunner doctor":
            raise OSError("read back other bytes than were written")
        fs.rm_file(small)
        w.say("bucket", "ok", f"{w.spec.bucket} writable, readable and deletable from here",
              seconds=time.monotonic() - t0)
    except Exception as e:  # noqa: BLE001 - gcsfs raises many kinds; the line says which
        w.say("bucket", "fail", f"{w.spec.bucket}: a small object could not be written, read or deleted "
                                f"({type(e).__name__}: {str(e)[:200]})",
              "grant the workers' service account roles/storage.objectAdmin on the bucket, or fix its name")
        return
    data = os.urandom(int(w.spec.checkpoint_mb * 1e6))
    big = f"{prefix}/checkpoint-sized"
    try:
        t0 = time.monotonic()
        fs.pipe_file(big, data)
        wrote = time.monotonic() - t0
        t0 = time.monotonic()
        same = fs.cat_file(big) == data
        read = time.monotonic() - t0
    finally:
        try:
            fs.rm_file(big)
        except Exception:  # noqa: BLE001 - the launcher deletes the scratch prefix again at the end
            pass
    mb = len(data) / 1e6
    w.say("bucket-throughput", "ok" if same else "fail",
          f"{mb:g} MB written in {wrote:.2f} s ({mb / wrote:.0f} MB/s), read in {read:.2f} s ({mb / read:.0f} MB/s)",
          "" if same else "the bucket returned other bytes: check its object versioning and retention")
    w.figures.append(wire.Measured("gcs_write", wrote, f"{mb:g} MB written to {w.spec.bucket} by one worker"))
    w.figures.append(wire.Measured("gcs_read", read, f"{mb:g} MB read from {w.spec.bucket} by one worker"))


# --- W&B ---------------------------------------------------------------------------------------

def check_wandb(w: Worker) -> None:
    key, mode = os.environ.get("WANDB_API_KEY"), os.environ.get("WANDB_MODE", "online")
    if worker_id() not in (None, "0"):
        w.say("wandb", "skip", "checked from worker 0")
        return
    if not key or mode in ("offline", "disabled"):
        w.say("wandb", "skip", "offline: no WANDB_API_KEY sent" if not key else f"WANDB_MODE={mode}")
        return
    url = os.environ.get("WANDB_BASE_URL", WANDB_URL).rstrip("/") + "/graphql"
    body = json.dumps({"query": "query Viewer { viewer { id entity } }"}).encode()
    import base64

    auth = base64.b64encode(f"api:{key}".encode()).decode()
    request = urllib.request.Request(url, body, {"Content-Type": "application/json", "Authorization": f"Basic {auth}"})
    try:
        with urllib.request.urlopen(request, timeout=15) as response:
            viewer = (json.loads(response.read() or b"{}").get("data") or {}).get("viewer")
    except urllib.error.HTTPError as e:
        w.say("wandb", "fail", f"W&B refused the key from this worker (HTTP {e.code} from {url})",
              "send a valid key: export WANDB_API_KEY (from https://wandb.ai/authorize) where you run launch.py")
        return
    except (OSError, ValueError) as e:
        w.say("wandb", "fail", f"W&B does not answer from this worker ({e})",
              "open HTTPS to api.wandb.ai from the workers, or run with run.wandb.mode=offline")
        return
    if not viewer:
        w.say("wandb", "fail", f"W&B knows no user for this key ({url})", "send a valid WANDB_API_KEY")
    else:
        w.say("wandb", "ok", f"the key works from worker 0 (entity {viewer.get('entity')})")


# --- the children that start the TPU -----------------------------------------------------------

def child(w: Worker, argv: list[str], budget: float, name: str) -> tuple[int | None, str]:
    """(exit code or None when killed at its budget, output) of a child in a process group of its own,
    which is gone when this returns."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env=dict(os.environ, **{wire.EVENTS_ENV: "1"}))
    LIVE.add(proc)
    try:
        out, _ = proc.communicate(timeout=budget)
        return proc.returncode, out.decode(errors="replace")
    except subprocess.TimeoutExpired:
        end(proc)
        out, _ = proc.communicate()
        return None, out.decode(errors="replace") + f"\n{name}: killed at its budget of {budget:g} s"
    finally:
        end(proc)


LIVE: set[subprocess.Popen] = set()  # the children started: none outlives this process


def end(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its children too: nothing of it may hold the TPU
    except ProcessLookupError:
        pass
    proc.wait()
    LIVE.discard(proc)


def check_slice(w: Worker) -> None:
    """The jax child (`jax_main`): its verdicts and figures become ours."""
    budget = BUDGETS["slice"] - 5  # ends before the check's own budget does
    spec = json.dumps(w.spec.__dict__)
    code, out = child(w, [sys.executable, "-m", MODULE, "--jax", w.host, spec, repr(time.time())], budget,
                      "the jax check")
    report = next((r for r in map(wire.doctor, out.splitlines()) if r is not None), None)
    if report is None:
        tail = " | ".join(line for line in out.splitlines()[-6:] if line.strip())
        status = "overrun" if code is None else "fail"
        w.say("slice", status, f"the jax check ended with {'no answer' if code is None else f'exit {code}'}: {tail}",
              "stop stale processes (`launch.py stop`), check every worker answered, then run the doctor again")
        return
    w.platform = report.platform
    w.checks += report.checks
    w.figures += report.figures


def jax_main(host: str, spec: Spec, spawned: float) -> int:
    """In the child: imports, jax.distributed, the backend (runtime_init, split), the devices, HBM,
    one all-reduce across every chip, checked and timed at a few sizes."""
    w = Worker(host, spec)
    t0 = time.time()
    import jax
    import numpy as np

    from runtime.config import DistributedConfig
    from runtime.distributed import initialize
    imports = time.time() - t0
    t1 = time.time()
    try:
        info = initialize(DistributedConfig(port=spec.port, liveness_port=spec.liveness_port,
                                            initialization_timeout_s=int(max(10, spec.port_wait))))
    except Exception as e:  # noqa: BLE001 - the join's failure is the verdict
        w.say("join", "fail", f"jax.distributed did not join: {e}", "open the coordinator and liveness ports "
              "between workers (distributed.port), start every worker, run `launch.py stop` first")
        print(wire.DoctorReport(host, worker_id(), None, time.time(), w.checks, w.figures, {}).line(), flush=True)
        os._exit(0)  # no shutdown barrier with workers that never joined
    joined = time.time() - t1
    t2 = time.time()
    devices = jax.devices()
    backend = time.time() - t2
    local = jax.local_devices()
    platform = local[0].platform
    init = time.time() - spawned
    split = f"imports {imports:.2f} s, jax.distributed and the backend {joined + backend:.2f} s"
    w.say("join", "ok", f"{info.line()}; {split}")
    w.figures.append(wire.Measured("runtime_init", init, f"the process's start to the {platform} backend and "
                                   f"jax.distributed ({info.process_count} processes): {split}"))
    _devices(w, platform, len(local), local[0].device_kind)
    _hbm(w, local)
    _allreduce(w, jax, np, devices, platform, local[0].device_kind)
    print(wire.DoctorReport(host, worker_id(), platform, time.time(), w.checks, w.figures, {}).line(), flush=True)
    # The shutdown barrier: worker 0 hosts the coordination service, and a worker still finishing its
    # report when worker 0 exits is ended by JAX as if a task had died (seen: exit with no report).
    with contextlib.suppress(Exception):
        jax.distributed.shutdown()
    os._exit(0)


def _devices(w: Worker, platform: str, local: int, kind: str) -> None:
    from runtime.compile_only import expected_local_devices

    accelerator = os.environ.get("TPU_ACCELERATOR_TYPE")
    if platform != "tpu":
        status = "fail" if accelerator else "ok"
        w.say("devices", status, f"{local} local {platform} devices ({kind})" + (
            f", not TPU devices on a {accelerator} slice" if accelerator else ": a CPU stand-in, figures labelled cpu"),
            "run `launch.py stop` (another process may hold the TPU) and `launch.py setup` (libtpu)" if accelerator
            else "")
        return
    if not accelerator:
        w.say("devices", "ok", f"{local} local TPU devices ({kind}); accelerator type unknown, count not checked")
        return
    expected = expected_local_devices(accelerator)
    if local == expected:
        w.say("devices", "ok", f"{local} local TPU devices ({kind}), as a {accelerator} worker has")
    else:
        w.say("devices", "fail", f"{local} local TPU devices, a {accelerator} worker has {expected}",
              "stop stale processes (`launch.py stop`) and check the TPU VM's health (tpu-info)")


def _hbm(w: Worker, local: list) -> None:
    free = []
    for d in local:
        stats = d.memory_stats() or {}
        if "bytes_limit" in stats:
            free.append((stats["bytes_limit"] - stats.get("bytes_in_use", 0)) / 2**30)
    if not free:
        w.say("hbm", "skip", f"{local[0].platform} devices report no memory figures")
        return
    low = min(free)
    w.say("hbm", "ok" if low > 1.0 else "fail", f"HBM free per chip: {', '.join(f'{x:.1f}' for x in free)} GiB",
          "" if low > 1.0 else "another process holds HBM: `launch.py stop`")


def _allreduce(w: Worker, jax, np, devices: list, platform: str, kind: str) -> None:
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(devices), ("d",))
    n = len(devices)
    reduce = jax.jit(lambda x: x.sum(axis=0), out_shardings=NamedSharding(mesh, PartitionSpec()))
    rows = []
    for mb in w.spec.allreduce_mb:
        per = max(1, int(mb * 1e6 / 4))
        x = jax.make_array_from_callback((n, per), NamedSharding(mesh, PartitionSpec("d")),
                                         lambda index: np.ones((1, per), np.float32))
        out = reduce(x).block_until_ready()  # compiles; the timed calls below do not
        value = float(np.asarray(out.addressable_data(0))[0])
        if value != n:
            w.say("all-reduce", "fail", f"an all-reduce of ones over {n} devices gave {value}",
                  "the slice's interconnect or a worker is unhealthy: recreate the slice")
            return
        t0 = time.perf_counter()
        for _ in range(3):
            out = reduce(x)
        out.block_until_ready()
        seconds = (time.perf_counter() - t0) / 3
        bus = 2 * (n - 1) / n * per * 4 / seconds / 1e9  # ring all-reduce: each chip sends and gets 2(n-1)/n of it
        rows.append(f"{mb:g} MB {seconds * 1e3:.2f} ms {bus:.1f} GB/s")
        w.figures.append(wire.Measured(f"allreduce_{mb:g}mb", seconds, f"an all-reduce of {mb:g} MB per device over "
                                       f"{n} {platform} devices: bus bandwidth {bus:.2f} GB/s"))
    w.say("all-reduce", "ok", f"ones over {n} devices sum to {n}; {'; '.join(rows)}; " + ici_figure(platform, kind))


def ici_figure(platform: str, kind: str) -> str:
    """ICI's published bandwidth for the generation (runtime/compile_only.py TOPOLOGIES, with its
    source there), or why there is none."""
    if platform != "tpu":
        return f"{platform} devices: no ICI figure to compare with"
    from runtime.compile_only import TOPOLOGIES

    gen = next((g for g in TOPOLOGIES.values() if g.device_kind.lower() in kind.lower()), None)
    return (f"ICI published: {gen.ici_gbytes_s:.0f} GB/s per chip one way (runtime/compile_only.py TOPOLOGIES, "
            "from the Cloud TPU system-architecture pages)" if gen else f"{kind}: ICI figure unknown")


# --- measurements: short runs of the real trainer ----------------------------------------------

def check_measure(w: Worker) -> None:
    """Per variant: a run of `measure_steps` steps saving at its end (cold compilation cache), then
    the same run extended by as many steps (it restores, and hits the cache): compile cold/warm,
    step time, eval-step time, a save's blocking part, the restore, from the trainer's own `timing` events."""
    if not w.spec.variants:
        w.say("measure", "skip", "no variant given (--programme DIR or +experiment=G/V)")
        return
    base = w.spec.measure_root or w.spec.bucket
    if not base:
        w.say("measure", "skip", "no --bucket: the short runs' checkpoints need a folder every worker sees")
        return
    # a folder of its own, removed whole (under the bucket: with the scratch prefix, by the launcher)
    scratch = f"{base.rstrip('/')}/{w.spec.scratch}" + ("" if w.spec.measure_root else "/runs")
    for i, overrides in enumerate(w.spec.variants):
        name = next((o.split("=", 1)[1] for o in overrides if o.startswith("+experiment=")), f"variant-{i}")
        root, k = f"{scratch}/{i}", w.spec.measure_steps
        common = [*overrides, f"run.root={root}", f"run.compile_cache={root}/compile_cache", f"run.id=doctor-{i}",
                  "run.wandb.mode=disabled", "run.progress_bar=false", "train.epochs=null",
                  "train.eval_every_epochs=null", "train.checkpoint_every_epochs=null", "train.log_every=1",
                  "data.eval_max_examples=1"]  # each evaluation one eval batch (padded: the step's full cost)
        timings = []
        for steps in (k, 2 * k):
            argv = [sys.executable, "pretrain_jax.py", *common, f"train.steps={steps}",
                    f"train.checkpoint_every={k}", f"train.eval_every={2 * k}"]
            code, out = child(w, argv, w.spec.measure_budget / 2 - 5, f"the trainer run of {name}")
            said = [e for e in map(wire.event, out.splitlines()) if e and e["event"] == "timing"]
            if code != 0:
                tail = " | ".join(line for line in out.splitlines()[-4:] if line.strip())
                w.say("measure", "overrun" if code is None else "fail",
                      f"{name}: the {steps}-step run ended with {'its budget' if code is None else f'exit {code}'}: "
                      f"{tail[:400]}", "run it with `launch.py pod` to see the whole log")
                return
            timings.append(said[-1] if said else None)
        _measured(w, name, timings)
    if w.spec.measure_root and worker_id() in (None, "0"):
        shutil.rmtree(scratch, ignore_errors=True)


def _measured(w: Worker, name: str, timings: list) -> None:
    cold, warm = timings
    if cold is None or warm is None:  # only process 0 says its timing
        w.say("measure", "ok", f"{name}: ran (process 0 reports the figures)")
        return
    first, second = cold["seconds"], warm["seconds"]
    figures = [("compile_cold", first["program_startup"], "compile, empty compilation cache"),
               ("compile_cache_hit", second["program_startup"] / max(1, warm["hits"]),
                f"program start-up per cache hit ({warm['hits']} hits, {warm['misses']} misses)"),
               ("step_time", (first["train"] + second["train"]) / max(1, cold["steps_run"] + warm["steps_run"]),
                f"train seconds per step over {cold['steps_run'] + warm['steps_run']} steps"),
               ("eval_step", (first["eval"] + second["eval"]) / 2, "eval seconds per eval step (each run's last "
                "step evaluates one batch)"),
               ("save", first["checkpoint_save"] / max(1, cold["saves"]), "checkpoint_save per save (the last waited)"),
               ("restore", second["checkpoint_restore"], "the checkpoint read back by the extended run")]
    # A variant without an eval set evaluates nothing: no eval-step figure (a 0 would scale the plan's to 0)
    figures = [f for f in figures if f[0] != "eval_step" or f[1] > 0]
    for figure, seconds, what in figures:
        w.figures.append(wire.Measured(figure, round(seconds, 4), f"{name}: {what}", variant=name))
    w.say("measure", "ok", f"{name}: " + ", ".join(f"{f} {s:.3f} s" for f, s, _ in figures))


# --- the worker's run --------------------------------------------------------------------------

CHECKS: dict[str, Callable[[Worker], None]] = {
    "software": check_software, "tpu": check_tpu, "disk": check_disk, "metadata": check_metadata,
    "maintenance": check_maintenance, "ports": check_ports, "slice": check_slice, "storage": check_storage,
    "wandb": check_wandb, "measure": check_measure}


def _hang(w: Worker) -> None:
    """HANG_ENV's check: a child that never ends (its check overruns; `main` ends the child)."""
    child(w, [sys.executable, "-m", MODULE, "--hang"], 1e6, "the hung check")


def main(argv: list[str]) -> int:
    if argv[0] == "--hang":  # HANG_ENV's child: it never ends by itself
        threading.Event().wait()
    if argv[0] == "--jax":
        return jax_main(argv[1], Spec(**json.loads(argv[2])), float(argv[3]))
    host, spec = argv[0], Spec(**json.loads(argv[1]))
    reached = time.time()
    if argv[2:4] and argv[2] == "--secrets":  # WANDB_API_KEY, sent as `pod` sends it: read, the file removed
        from experiments.launcher.worker.once import read_secrets

        try:
            os.environ.update(read_secrets(os.path.expanduser(argv[3])))
        except OSError:
            pass  # it did not arrive: the W&B check says there is no key
    w = Worker(host, spec)
    if spec.sent is not None:  # this machine's clock against the launcher's (NTP-synced on GCE)
        w.figures.append(wire.Measured("launch", max(0.0, reached - spec.sent), "the launcher's ssh started to this "
                                       "worker's doctor process running (gcloud, ssh, python's start)"))
    for group in GROUPS:
        if group not in spec.only:
            continue
        if group in ("slice", "measure") and w.failed("tpu-free", "lockfile", "coordinator-port",
                                                       "liveness-port"):
            w.say(group, "skip", "not started: an earlier check failed (see it)")
            continue
        budget = BUDGETS[group] + (2 * spec.port_wait if group == "ports" else 0.0)
        if group == "measure":
            budget = spec.measure_budget * max(1, len(spec.variants)) + 10
        fn, hang = CHECKS[group], os.environ.get(HANG_ENV, "").split(":")
        if len(hang) == 3 and hang[1] == group and hang[0] == worker_id():  # a test's hung check
            budget, fn = float(hang[2]), _hang
        run_within(w, group, budget, fn)
    for proc in list(LIVE):  # a check that overran left its child: end it now
        end(proc)
    print(wire.DoctorReport(host, worker_id(), w.platform, time.time(), w.checks, w.figures,
                            w.facts.get("versions", {})).line(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
