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
"$VENV/bin/python" -m experiments.launcher.worker.tpu_check
# Every pinned package at its pin and importable (a pip that failed half-way leaves a .venv that is not).
"$VENV/bin/python" -m experiments.launcher.worker.versions "$(hostname)" --imports
echo "setup_tpu.sh: ok"
