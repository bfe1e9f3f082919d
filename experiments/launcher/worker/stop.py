"""`python3 -m experiments.launcher.worker.stop HOST GRACE`: end this login's training processes (and the
launch guards that started them) and any of its processes holding the TPU: SIGTERM first when
GRACE > 0 (the trainer checkpoints), SIGKILL after it. Then remove the libtpu lockfile unless a
live process still has it open, and the secrets files of launches that never started. One line
per process killed and a summary line, each prefixed `[HOST]`; exit 1 when something is left.

Processes of another login are reported with a `sudo kill` hint, never touched.
PODRUNNER_LIBTPU_LOCKFILE (default /tmp/libtpu_lockfile) names the lockfile for tests.
"""

import glob
import os
import signal
import sys

from experiments.launcher.worker import SECRETS_PREFIX, procs
from runtime.errors import EXIT_FAILURE  # standard library only, like this


def _signal(pids, sig):
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def stop(host, grace):
    targets, foreign = [], []
    for pid, argv, ours, holds in procs.processes(True):
        if procs.is_training(argv) or holds:
            (targets if ours else foreign).append((pid, " ".join(argv), holds))
    pids = [t[0] for t in targets]
    if grace > 0 and pids:  # SIGTERM first: the trainer checkpoints on preemption
        _signal(pids, signal.SIGTERM)
        procs.wait_gone(pids, grace)
    for pid, cmd, holds in targets:
        if procs.alive(pid):
            _signal([pid], signal.SIGKILL)
        note = " (held the TPU)" if holds else ""
        print(f"[{host}] killed pid {pid}{note}: {cmd[:300]}", flush=True)
    left = procs.wait_gone(pids, 10)
    for pid, cmd, _ in foreign:
        print(f"[{host}] not killed: pid {pid} of user {procs.owner(pid)} (another login): {cmd[:300]}; "
              f"`sudo kill -9 {pid}` if it is stale", flush=True)
    code = EXIT_FAILURE if left else 0
    lock_note, lock_code = free_lockfile()
    summary = f"killed {len(targets)} process(es)" if targets else "nothing running"
    if left:
        summary += f", still alive: {left}"
    print(f"[{host}] {summary}; {lock_note}{remove_secrets()}", flush=True)
    return max(code, lock_code)


def free_lockfile():
    lock = os.path.expanduser(os.environ.get("PODRUNNER_LIBTPU_LOCKFILE", "/tmp/libtpu_lockfile"))
    users = procs.open_by(lock)
    if users:  # a live libtpu still holds it: the lock is not stale, and removing it would hurt
        return f"kept {lock}: still open by pid {users}", EXIT_FAILURE
    try:
        os.remove(lock)
        return f"removed {lock}", 0
    except FileNotFoundError:
        return f"no {lock}", 0
    except OSError as e:
        return f"could not remove {lock} ({e}); `sudo rm -f {lock}`", EXIT_FAILURE


def remove_secrets():
    """The secrets files of launches that never started (a run removes its own at once)."""
    removed = 0
    for path in glob.glob(os.path.join(glob.escape(procs.HOME), SECRETS_PREFIX + "*")):
        try:
            os.remove(path)
            removed += 1
        except OSError:
            pass
    return f"; removed {removed} leftover secrets file(s)" if removed else ""


if __name__ == "__main__":
    sys.exit(stop(sys.argv[1], float(sys.argv[2])))
