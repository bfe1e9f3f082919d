"""One job of the trainer, from its config to its exit code: what `python pretrain_jax.py` runs.

`run_job` never exits the process: how the process ends is its caller's (pretrain_jax.py `_exit`). Every failure is said (an `error:` line for bad input, else the traceback,
and a `failed` event) and becomes the exit code (runtime/errors.py).
"""

from __future__ import annotations

import sys
import traceback
from typing import Callable

from runtime import events, libtpu_flags, liveness
from runtime.compile_only import plan_for_topology
from runtime.config import Config
from runtime.cpu_backend import tune_cpu_backend
from runtime.errors import EXIT_FAILURE, EXIT_PREEMPTED, UserError, end_progress_bars, one_line
from runtime.hydra_compose import config_error
from runtime.trainer import run


def run_job(compose: Callable[[], Config], *, started: float | None = None) -> int:
    """The job whose config `compose()` returns (composing is part of the job: a config that does
    not compose is its failure), trained, or planned for a topology with `compile_only`.
    `started`: when its process began (its time account starts there; None: now)."""
    try:
        config = compose()
        libtpu_flags.apply()  # before JAX starts a TPU backend (runtime/libtpu_flags.py)
        if config.compile_only:  # compile for a TPU topology, print memory and FLOPs, exit without training
            code = plan_for_topology(config)
        else:
            tune_cpu_backend()  # CPU runs: before JAX starts its backend (runtime/cpu_backend.py)
            code = run(config, started=started)
    except Exception as e:  # noqa: BLE001 - every failure of the job is its exit code
        code = failed(e)
    if code not in (0, EXIT_PREEMPTED):  # said already where it failed; else its code at least
        events.failed(code, f"exited with code {code}; the log above says why")
    return code


def failed(e: Exception) -> int:
    """Say why the job failed with `e` and return its exit code: bad input (a UserError, a config
    that does not compose) is one `error:` line, a crash its traceback. In a pod, a failure can be
    the echo of a peer that died: the liveness channel names that peer instead, and exits, if it
    finds one (runtime/liveness.py)."""
    liveness.failing()
    error = e if isinstance(e, UserError) else config_error(e)
    if error is None:
        traceback.print_exc()
        events.failed(EXIT_FAILURE, one_line(e), events.failure_of(e))
        return EXIT_FAILURE
    end_progress_bars()  # a dataset build's bar cut short: the line starts a line of its own
    print(f"error: {error}", file=sys.stderr, flush=True)
    events.failed(error.exit_code, str(error), events.failure_of(error))
    return error.exit_code
