#!/usr/bin/env bash
# Install the pinned stack with the TPU extra on this TPU VM worker and check it.
# Run on every worker at once:
#   gcloud compute tpus tpu-vm ssh NAME --zone Z --worker=all --command "cd ~/podrunner && bash setup_tpu.sh"
# Idempotent: re-running re-checks and installs nothing new. Fails loudly (non-zero exit)
# when jax does not see the expected TPU devices.
set -euo pipefail
REPO="$(cd "$(dirname "$0")" && pwd)"
VENV="${VENV:-$REPO/.venv}"
PYTHON="${PYTHON:-python3}"

[ -d "$VENV" ] || "$PYTHON" -m venv "$VENV"
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
echo "setup_tpu.sh: ok"
