"""Hang watchdog: a step that stops making progress must bring the job down, not hang forever.

A dead or silent peer is the liveness channel's business (runtime/liveness.py, exit 7, naming
it); this watchdog catches the rest: a stall with every process alive (data on a stalled mount,
a collective mismatch, a wedged device). The loop calls `beat(step)` as it makes progress; if no
beat comes for `timeout_s` (compile is excluded: the watchdog is armed by the first beat), the
process logs the stalled step, dumps every thread's Python stack to stderr, tells the other
processes, and exits with EXIT_HANG. `progress_phrase()` says where this process is, for the
liveness channel's line.

Should JAX's coordination service abort the process from C++ (exit 134, "another task died"),
faulthandler still dumps the Python stacks, and the watchdog thread waits inside a code object
whose file name states the progress ("<podrunner: last completed step 7, in step 8 (train)>"),
so that dump names the stalled step too.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from typing import Callable

from runtime import events, liveness
from runtime.errors import EXIT_HANG

log = logging.getLogger(__name__)
_latest: tuple[int, str] | None = None  # (completed step, phase) of the latest beat of any watchdog


def progress_phrase() -> str:
    """Where this process is, for a one-line error: "at step 8 (step 7 done; train)"."""
    latest = _latest
    if latest is None:
        return "before the first step (start-up or compile)"
    return f"at step {latest[0] + 1} (step {latest[0]} done; {latest[1]})"


def _labelled_wait(label: str) -> Callable[[threading.Event, float], bool]:
    """`Event.wait` called from a frame whose file name is `label` (shown in fatal stack dumps)."""
    code = compile("stop.wait(timeout)", f"<podrunner: {label}>", "eval")
    return lambda stop, timeout: eval(code, {"stop": stop, "timeout": timeout})


class Watchdog:
    def __init__(self, timeout_s: float, clock=time.monotonic):
        self.timeout_s = timeout_s
        self._clock = clock  # seconds; a test steps its own
        self._last: tuple[float, int, str] | None = None  # (clock time, completed step, phase) of the latest beat
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        faulthandler.enable(all_threads=True)  # Python stacks on fatal signals, JAX's abort included
        if self.timeout_s > 0:
            self._thread.start()
        return self

    def beat(self, completed_step: int, phase: str = "train") -> None:
        global _latest
        self._last = (self._clock(), completed_step, phase)
        _latest = (completed_step, phase)

    def stop(self) -> None:
        self._stop.set()

    def stalled(self) -> tuple[float, int, str] | None:
        """The latest beat (time, completed step, phase) when it is more than timeout_s old, else
        None (also before the first beat: compile is not watched)."""
        last = self._last
        return last if last is not None and self._clock() - last[0] > self.timeout_s else None

    def _watch(self) -> None:
        label: str | None = None
        wait: Callable[[threading.Event, float], bool] | None = None
        while True:
            last = self.stalled()
            if last is not None:
                self._fire(*last)
            last = self._last
            new_label = "not started" if last is None else f"last completed step {last[1]}, in step {last[1] + 1} ({last[2]})"
            if wait is None or new_label != label:
                label, wait = new_label, _labelled_wait(new_label)
            if wait(self._stop, min(1.0, self.timeout_s / 4)):
                return

    def _fire(self, since: float, step: int, phase: str) -> None:
        line = (f"watchdog: no progress for {self._clock() - since:.0f}s (limit {self.timeout_s:.0f}s): "
                f"step {step + 1} stalled ({phase}; last completed step {step}). A worker probably died or hangs; "
                "dumping Python stacks and exiting")
        print(line, file=sys.stderr, flush=True)
        events.failed(EXIT_HANG, line)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        liveness.leave(EXIT_HANG)  # the others stop too, with their own stall or naming this one
        os._exit(EXIT_HANG)  # not sys.exit: the main thread is the one that is stuck
