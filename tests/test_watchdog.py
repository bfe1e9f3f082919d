"""The hang watchdog on its own: it fires only after the timeout since the last beat (judged by
its own clock, stepped here by the test), and when it fires, or when a fatal abort comes first
(what JAX does when a peer dies), the process's stderr names the stalled step."""

from __future__ import annotations

import subprocess
import sys

from helpers import REPO, child_env
from runtime.watchdog import Watchdog


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=child_env(1), capture_output=True, text=True,
                          timeout=60)


def test_stalled_only_after_the_timeout_since_the_last_beat():
    now = [0.0]
    watchdog = Watchdog(2, clock=lambda: now[0])
    now[0] = 1000.0
    assert watchdog.stalled() is None  # not armed before the first beat: compiling is not watched
    for step in range(1, 6):  # beats every 1.5 s keep it quiet
        watchdog.beat(step)
        now[0] += 1.5
        assert watchdog.stalled() is None
    now[0] += 0.5  # 2.0 s since step 5's beat: not more than the timeout
    assert watchdog.stalled() is None
    now[0] += 0.01
    assert watchdog.stalled() == (1006.0, 5, "train")


def test_stops_cleanly():
    watchdog = Watchdog(0.05, clock=lambda: 0.0).start()  # its clock never moves: it never fires
    watchdog.beat(1)
    watchdog.stop()
    watchdog._thread.join(30)
    assert not watchdog._thread.is_alive()


def test_fires_with_the_stalled_step():
    proc = run("import time\nfrom runtime.watchdog import Watchdog\n"
               "w = Watchdog(1).start()\nw.beat(5)\nprint('alive', flush=True)\ntime.sleep(60)\n")
    assert proc.returncode == 4, proc.stderr[-2000:]
    assert "alive" in proc.stdout
    assert "step 6 stalled (train; last completed step 5)" in proc.stderr
    assert "in <module>" in proc.stderr  # the main thread's stack was dumped


def test_fatal_abort_dump_names_the_step():
    """The abort comes once the watchdog thread waits under its new label (polled, not slept for)."""
    proc = run("import os, sys, time\nfrom runtime.watchdog import Watchdog\n"
               "w = Watchdog(600).start()\nw.beat(7, 'eval')\n"
               "label = '<podrunner: last completed step 7, in step 8 (eval)>'\n"
               "def chain(f):\n    while f:\n        yield f\n        f = f.f_back\n"
               "waiting = lambda: any(g.f_code.co_filename == label for f in sys._current_frames().values() for g in chain(f))\n"
               "deadline = time.monotonic() + 50\n"
               "while not waiting() and time.monotonic() < deadline:\n    time.sleep(0.01)\n"
               "os.abort()\n")
    assert proc.returncode < 0  # killed by SIGABRT
    assert '"<podrunner: last completed step 7, in step 8 (eval)>"' in proc.stderr
