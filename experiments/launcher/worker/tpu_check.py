"""`.venv/bin/python -m experiments.launcher.worker.tpu_check`, run by setup_tpu.sh after installing:
one line with what jax sees on this worker, then exit 1 with one line when jax does not see TPU
devices, or not as many as a worker of this slice type has (TPU_ACCELERATOR_TYPE, else the
metadata server; unknown: not checked).
"""

import os
import sys
from importlib import metadata

import jax

from runtime.compile_only import expected_local_devices
from runtime.distributed import metadata_attribute
from runtime.errors import EXIT_FAILURE

VERSIONS = ("jax", "jaxlib", "libtpu")


def accelerator_type(env):
    """This slice's accelerator type (v4-64), or None where nothing says it."""
    try:
        return env.get("TPU_ACCELERATOR_TYPE") or metadata_attribute("accelerator-type", env)
    except OSError:
        return None


def problem(platform, local_devices, kind):
    """What is wrong with the devices jax sees, in one phrase; None when they fit."""
    if platform != "tpu":
        return (f"jax sees {platform}, not TPU devices; is another process holding the TPU "
                "(`python experiments/launch.py stop`) or is libtpu missing?")
    if kind:
        expected = expected_local_devices(kind)
        if local_devices != expected:
            return (f"jax sees {local_devices} local TPU devices, a {kind} worker has {expected}; "
                    "stop stale processes (`launch.py stop`) and check the TPU VM's health")
    return None


def main():
    devices = jax.local_devices()
    kind = accelerator_type(os.environ)
    versions = " ".join(f"{p}={metadata.version(p)}" for p in VERSIONS)
    print(f"platform={devices[0].platform} kind={devices[0].device_kind} accelerator={kind} "
          f"local_devices={len(devices)} {versions}", flush=True)
    found = problem(devices[0].platform, len(devices), kind)
    if found:
        print(f"setup_tpu.sh: {found}", file=sys.stderr, flush=True)
        return EXIT_FAILURE
    return 0


if __name__ == "__main__":
    sys.exit(main())
