#!/usr/bin/env bash
# Install the pinned stack with the TPU extra on this TPU VM worker and check it.
# Run on every worker at once:
#   gcloud compute tpus tpu-vm ssh NAME --zone Z --worker=all --command "cd ~/podrunner && bash setup_tpu.sh"
# Idempotent: re-running re-checks and installs nothing new. Fails loudly (non-zero exit)
# when jax does not see the expected TPU devices.
set -euo pipefail
REPO="$(cd "$(dirname "$0")" && pwd)"
VENV="${VENV:-$REPO/.venv}"
# shellcheck source=scripts/find_python.sh
. "$REPO/scripts/find_python.sh"

# A .venv of a Python that does not fit (an earlier setup with the image's 3.10) is made again.
if [ -x "$VENV/bin/python" ] && ! fits "$VENV/bin/python"; then rm -rf "$VENV"; fi
if [ ! -d "$VENV" ]; then
  PY="$(find_python)" || { echo "setup_tpu.sh: no Python >= 3.11 here, and uv could not install one" >&2; exit 1; }
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet -e "$REPO[tpu]"

# Check: TPU platform, this worker's device count for the slice type, and the versions it runs
# (`launch.py setup` compares these across workers).
cd "$REPO"
"$VENV/bin/python" - <<'PY'
import os
import sys
import urllib.request
from importlib import metadata

import jax

from runtime.compile_only import expected_local_devices


def accelerator_type() -> str | None:
    if os.environ.get("TPU_ACCELERATOR_TYPE"):
        return os.environ["TPU_ACCELERATOR_TYPE"]
    url = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/accelerator-type"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers={"Metadata-Flavor": "Google"}), timeout=5) as r:
            return r.read().decode().strip()
    except OSError:
        return None


devices = jax.local_devices()
versions = {p: metadata.version(p) for p in ("jax", "jaxlib", "libtpu")}
kind = accelerator_type()
print(f"platform={devices[0].platform} kind={devices[0].device_kind} accelerator={kind} "
      f"local_devices={len(devices)} " + " ".join(f"{k}={v}" for k, v in versions.items()), flush=True)
if devices[0].platform != "tpu":
    sys.exit(f"setup_tpu.sh: jax sees {devices[0].platform}, not TPU devices; is another process holding the TPU "
             "(`python experiments/launch.py stop`) or is libtpu missing?")
if kind:
    expected = expected_local_devices(kind)
    if len(devices) != expected:
        sys.exit(f"setup_tpu.sh: jax sees {len(devices)} local TPU devices, a {kind} worker has {expected}; "
                 "stop stale processes (`launch.py stop`) and check the TPU VM's health")
PY
# Every pinned package at its pin and importable (a pip that failed half-way leaves a .venv that is not).
"$VENV/bin/python" -m experiments.launcher.worker.versions "$(hostname)" --imports
echo "setup_tpu.sh: ok"
