"""The worker's processes, read from /proc: which are this login's, which hold the TPU."""

import os
import pwd
import time
from fnmatch import fnmatch

HOME = os.path.realpath(os.path.expanduser("~"))
# The TPU's device files; PODRUNNER_TPU_DEVICES (':'-separated globs, `~` expands) for tests.
DEVICES = "/dev/accel*:/dev/vfio/[0-9]*"


def stat(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()  # [0] state, [1] ppid, [19] start time


def alive(pid):
    try:
        return stat(pid)[0] not in "ZX"  # a zombie has released the TPU
    except (OSError, IndexError):
        return False


def ancestors():
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            pid = int(stat(pid)[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def _open_files(pid):
    """Where the process's open files point (nothing for one we may not look at)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return
    for fd in fds:
        try:
            yield os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue


def _environ(pid):
    """The process's environment (OSError: it is private to its owner)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)


def processes(with_fds):
    """(pid, argv, ours, holds_tpu) of every live process except this one and its ancestors.
    "Ours": started with this HOME, i.e. by this login, the ones it may kill."""
    devices = [os.path.expanduser(p) for p in os.environ.get("PODRUNNER_TPU_DEVICES", DEVICES).split(":") if p]
    skip = ancestors()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in skip:
            continue
        pid = int(name)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:  # gone
            continue
        if not argv:  # kernel thread or zombie
            continue
        try:
            proc_home = _environ(pid).get(b"HOME", b"").decode(errors="replace")
            ours = bool(proc_home) and os.path.realpath(proc_home) == HOME
        except OSError:
            ours = False
        yield pid, argv, ours, with_fds and ours and any(fnmatch(f, d) for f in _open_files(pid) for d in devices)


def is_training(argv):
    """A training process or the launch guard that started it (anything running pretrain_jax.py)."""
    return any(os.path.basename(a) == "pretrain_jax.py" or a.endswith(" pretrain_jax.py") for a in argv)


def is_trainer(argv):
    """The trainer itself: a python whose script is pretrain_jax.py (not the launch guard)."""
    return (is_training(argv) and os.path.basename(argv[0]).startswith("python")
            and "experiments.launcher.worker.once" not in argv)


def run_of(pid, argv):
    """The run a training process is part of: its guard's `launch_id=RUN`, or the trainer's
    PODRUNNER_RUN_ID (experiments/launcher/pod.py sets both); None when neither says (pid None: argv only)."""
    for a in argv:
        if a.startswith("launch_id="):
            return a.split("=", 1)[1].split()[0]
    if pid is None:
        return None
    try:
        run = _environ(pid).get(b"PODRUNNER_RUN_ID")
    except OSError:
        return None
    return run.decode(errors="replace") if run else None


def trainers_of_ours():
    """(pid, run, command line) of this login's live trainers (not the launch guards)."""
    return [(pid, run_of(pid, argv), " ".join(argv)) for pid, argv, ours, _ in processes(False)
            if ours and is_trainer(argv)]


def owner(pid):
    try:
        return pwd.getpwuid(os.stat(f"/proc/{pid}").st_uid).pw_name
    except (OSError, KeyError):
        return "?"


def open_by(path):
    """Pids (that we may look at) with `path` open."""
    real = os.path.realpath(path)
    return [int(name) for name in os.listdir("/proc") if name.isdigit() and real in _open_files(name)]


def wait_gone(pids, seconds):
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]
