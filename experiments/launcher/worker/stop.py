"""`python3 -m experiments.launcher.worker.stop HOST GRACE [RUN]`: end this login's training processes
and TPU holders (SIGTERM first when GRACE > 0, so the trainer checkpoints; SIGKILL after), then
remove the libtpu lockfile unless a live process has it open, and unused secrets files. Exit 1
when something is left.

With RUN (a supervisor freeing the TPU for its relaunch), another run's trainers are left running:
a launcher never ends a job that is not its own. Another login's processes are never touched.
PODRUNNER_LIBTPU_LOCKFILE (default /tmp/libtpu_lockfile) names the lockfile for tests.
"""

import contextlib
import glob
import os
import signal
import sys

from experiments.launcher.worker import SECRETS_PREFIX, procs
from runtime.errors import EXIT_FAILURE  # standard library only, like this


def _signal(pids, sig):
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, sig)


def stop(host, grace, run=None):
    targets, foreign, others = [], [], []
    for pid, argv, ours, holds in procs.processes(True):
        if not (procs.is_training(argv) or holds):
            continue
        other_run = run is not None and procs.is_training(argv) and procs.run_of(pid, argv) not in (run, None)
        (others if ours and other_run else targets if ours else foreign).append((pid, " ".join(argv), holds))
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
    for pid, cmd, _ in others:
        print(f"[{host}] not killed: pid {pid} runs another run than {run}: {cmd[:300]}", flush=True)
    for pid, cmd, _ in foreign:
        print(f"[{host}] not killed: pid {pid} of user {procs.owner(pid)} (another login): {cmd[:300]}; "
              f"`sudo kill -9 {pid}` if it is stale", flush=True)
    lock_note, lock_code = free_lockfile()
    summary = f"killed {len(targets)} process(es)" if targets else "nothing running"
    if left:
        summary += f", still alive: {left}"
    print(f"[{host}] {summary}; {lock_note}{remove_secrets()}", flush=True)
    return max(EXIT_FAILURE if left else 0, lock_code)


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
        with contextlib.suppress(OSError):
            os.remove(path)
            removed += 1
    return f"; removed {removed} leftover secrets file(s)" if removed else ""


if __name__ == "__main__":
    sys.exit(stop(sys.argv[1], float(sys.argv[2]), *sys.argv[3:4]))
