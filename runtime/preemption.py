"""Preemption: on SIGTERM (TPU maintenance, spot preemption) every process stops at the same
step, saves a checkpoint and exits 8 (`EXIT_PREEMPTED`, runtime/errors.py); the next launch
resumes from it.

With jax.distributed up, JAX's preemption service catches SIGTERM and agrees with the other
processes on a safe step (`reached_preemption_sync_point`, called at every step by every
process). A single process has no such service, so a signal handler sets a flag instead.
"""

from __future__ import annotations

import signal

import jax
from jax.experimental import multihost_utils


class PreemptionWatcher:
    def __init__(self):
        self.distributed = jax.distributed.is_initialized()
        self.signalled = False
        self._previous = None
        if not self.distributed:
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.signalled = True

    def should_stop(self, step: int) -> bool:
        """True at the step where all processes save and stop. Call at every step."""
        if self.distributed:
            return multihost_utils.reached_preemption_sync_point(step)
        return self.signalled

    def close(self) -> None:
        if not self.distributed:  # whoever handled SIGTERM before the run handles it again
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
