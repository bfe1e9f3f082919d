"""`python3 -m experiments.launcher.worker.status HOST OUTPUTS RUN_ID`, run from the repo: this
worker's training processes (pid, seconds running), its last step and its newest worker log, as
one status line (runtime/wire.py). The last step: the newest metrics.jsonl under the repo's
OUTPUTS (process 0's), else the newest event with a step in the newest worker log (of RUN_ID when
given).
"""

import contextlib
import glob
import json
import os
import sys

from experiments.launcher.worker import procs
from runtime import wire  # standard library only, like this


def newest(paths):
    stamped = []
    for p in paths:
        with contextlib.suppress(OSError):  # gone meanwhile
            stamped.append((os.path.getmtime(p), p))
    return max(stamped)[1] if stamped else None


def tail(path, size=65536):
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - size))
        return f.read().decode(errors="replace")


def json_row(line):
    try:
        return json.loads(line)
    except ValueError:
        return None


def last_step(metrics, log):
    for path, read, source in ((metrics, json_row, "metrics"), (log, wire.event, "log")):
        if path:
            for line in reversed(tail(path).splitlines()):
                row = read(line)
                if isinstance(row, dict) and isinstance(row.get("step"), int):
                    return row["step"], source
    return None, None


def worker_id(host):
    """TPU_WORKER_ID, else the `-w-<i>` at the end of a TPU VM's hostname."""
    _, sep, number = host.rpartition("-w-")
    return os.environ.get("TPU_WORKER_ID") or (number if sep and number.isdigit() else None)


def status(host, repo, outputs, run_id):
    tick, uptime = os.sysconf("SC_CLK_TCK"), float(open("/proc/uptime").read().split()[0])
    running = []
    for pid, argv, ours, _ in procs.processes(False):
        if ours and procs.is_trainer(argv):
            with contextlib.suppress(OSError, ValueError, IndexError):  # gone meanwhile, or an odd stat line
                running.append([pid, int(uptime - int(procs.stat(pid)[19]) / tick)])
    metrics = newest(glob.glob(os.path.join(repo, outputs, "**", "metrics.jsonl"), recursive=True))
    log = newest(glob.glob(os.path.join(procs.HOME, "podrunner-logs", glob.escape(run_id) if run_id else "*",
                                        "worker-*.log")))
    step, source = last_step(metrics, log)
    print(wire.Status(host=host, worker=worker_id(host), processes=running, step=step, step_from=source,
                      metrics=metrics, log=log).line(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(status(sys.argv[1], os.getcwd(), *sys.argv[2:4]))
