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

# Check: TPU platform, device counts, and the versions this worker runs (compare across workers).
"$VENV/bin/python" - <<'PY'
import sys
from importlib import metadata

import jax

devices = jax.devices()
versions = {p: metadata.version(p) for p in ("jax", "jaxlib", "libtpu")}
line = (f"worker {jax.process_index()}: platform={devices[0].platform} kind={devices[0].device_kind} "
        f"local_devices={jax.local_device_count()} global_devices={jax.device_count()} "
        + " ".join(f"{k}={v}" for k, v in versions.items()))
print(line, flush=True)
if devices[0].platform != "tpu":
    sys.exit(f"setup_tpu.sh: jax sees {devices[0].platform}, not TPU devices; is another process holding the TPU "
             "(`python experiments/launch.py stop`) or is libtpu missing?")
PY
echo "setup_tpu.sh: ok"
