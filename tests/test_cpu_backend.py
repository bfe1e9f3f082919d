"""runtime/cpu_backend.py: the CPU settings pretrain_jax.py applies before JAX starts its backend."""

from __future__ import annotations

import subprocess
import sys

from helpers import REPO, child_env
from runtime.cpu_backend import YNN_DOTS_ONLY, tune_cpu_backend

PROBE = """
from runtime.cpu_backend import tune_cpu_backend
applied = tune_cpu_backend()
import os, jax
jax.devices()  # the backend starts with the settings
print(applied, jax.config.values["jax_cpu_enable_async_dispatch"], os.environ.get("XLA_FLAGS", ""), tune_cpu_backend())
"""


def probe(**env: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=child_env(1, XLA_FLAGS="", **env))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split()


def test_applied_before_the_backend_starts_and_never_after():
    applied, async_dispatch, flags, again = probe()
    assert (applied, async_dispatch, flags, again) == ("True", "False", YNN_DOTS_ONLY, "False")
    assert probe(PODRUNNER_CPU_TUNING="off") == ["False", "True", "False"]  # no flags: XLA_FLAGS stays empty
    import jax

    jax.devices()
    assert tune_cpu_backend() is False  # this test process's backend is running: nothing changes
