"""Process settings that make XLA's CPU backend fast for training, applied on CPU runs only
and before JAX starts its backends (pretrain_jax.py, bench/train_step_bench.py).

What they fix, measured on the TRM train steps (hidden 512, batch 32, float32):

* The CPU backend allocates a step's temporaries afresh at every execution (4.9 GB for
  TRM-MLP). glibc maps a block this large with mmap and unmaps it at free, so the kernel
  zeroed the whole working set again at every step: about a sixth of the step's CPU time.
  Dispatched synchronously, the block is allocated and freed on the calling thread, from
  glibc's main heap, which keeps it for the next step once told never to mmap or trim.
  (Dispatched asynchronously, a worker thread frees it after the next step has allocated its
  own, and the heap grew to over three of them.)
* By default XLA:CPU hands YNNPACK the elementwise work around a dot together with the dot,
  and those fusions allocate their intermediates at every call (the same page faults). Dots
  alone, with the elementwise work in XLA's own loops, ran faster.

The costs: the process keeps its peak heap until it exits, and the Python thread waits for each
step to finish (the data feeder prefetches on its own thread). PODRUNNER_CPU_TUNING=off in the
environment leaves JAX's and glibc's defaults; `python bench/train_step_bench.py --untuned`
measures a step without these settings.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys

# jax is imported in the functions: this module is standard library only, as tests/conftest.py
# imports it (through helpers.py) before it sets JAX_PLATFORMS, which jax reads when imported

# mallopt(3) parameters (malloc.h); -1 is SIZE_MAX to glibc, whose parameter is a size_t: never trim
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
YNN_DOTS_ONLY = "--xla_cpu_experimental_ynn_fusion_type=individual_dot"


def cpu_only_host() -> bool:
    """Whether JAX will run on the CPU: JAX_PLATFORMS names cpu first, or it is unset and this
    machine has no TPU or NVIDIA device."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not any(glob.glob(pattern) for pattern in ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*"))


def _keep_freed_heap() -> bool:
    """glibc: serve large blocks from the heap (no mmap) and never trim it; False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # a C library without mallopt (musl)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, -1) == 1


def tune_cpu_backend() -> bool:
    """Apply the settings above when JAX will run on the CPU and has not started its backends
    (they are read when the backend starts); True if applied."""
    if os.environ.get("PODRUNNER_CPU_TUNING") == "off" or not cpu_only_host():
        return False
    import jax  # here: pretrain_jax.py imports this module before JAX; only a CPU run needs it

    from runtime.jax_internals import backends_started

    if backends_started():
        return False

    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_experimental_ynn_fusion_type" not in flags:  # a user's own choice stands
        os.environ["XLA_FLAGS"] = f"{flags} {YNN_DOTS_ONLY}".strip()
    if _keep_freed_heap():  # synchronous dispatch helps only with the heap kept
        jax.config.update("jax_cpu_enable_async_dispatch", False)
    return True
