"""The hang watchdog on its own: it fires only after the timeout since the last beat, and a
fatal abort (what JAX does when a peer dies) still names the stalled step."""

from __future__ import annotations

import subprocess
import sys

from helpers import REPO, child_env


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=child_env(1), capture_output=True, text=True,
                          timeout=60)


def test_fires_after_timeout_with_the_stalled_step():
    proc = run("import time\nfrom runtime.watchdog import Watchdog\n"
               "w = Watchdog(2).start()\n"
               "for s in range(1, 6):\n    w.beat(s)\n    time.sleep(0.5)\n"  # beats keep it quiet
               "print('alive', flush=True)\ntime.sleep(30)\n")
    assert proc.returncode == 4, proc.stderr[-2000:]
    assert "alive" in proc.stdout  # it did not fire while beats came
    assert "step 6 stalled (train; last completed step 5)" in proc.stderr
    assert "in <module>" in proc.stderr  # the main thread's stack was dumped


def test_not_armed_before_first_beat_and_stops_cleanly():
    proc = run("import time\nfrom runtime.watchdog import Watchdog\n"
               "w = Watchdog(1).start()\ntime.sleep(3)\nw.beat(1)\nw.stop()\ntime.sleep(2)\nprint('done')\n")
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr[-2000:]


def test_fatal_abort_dump_names_the_step():
    proc = run("import os, time\nfrom runtime.watchdog import Watchdog\n"
               "w = Watchdog(600).start()\nw.beat(7, 'eval')\ntime.sleep(2.5)\nos.abort()\n")
    assert proc.returncode < 0  # killed by SIGABRT
    assert '"<podrunner: last completed step 7, in step 8 (eval)>"' in proc.stderr
