"""The GCE metadata server, read by the trainer (runtime/distributed.py) and the worker tools
(experiments/launcher/worker/doctor_checks.py). Standard library only: the doctor asks it before
anything imports JAX."""

from __future__ import annotations

import os
import urllib.request
from typing import Mapping


def get(path: str, env: Mapping[str, str] | None = None, timeout: float = 5.0) -> str:
    """GET computeMetadata/v1/<path> (e.g. instance/attributes/accelerator-type) from the server at
    GCE_METADATA_IP when set (as JAX honours it), else metadata.google.internal. OSError when it does
    not answer within `timeout` (no metadata server here)."""
    host = (os.environ if env is None else env).get("GCE_METADATA_IP") or "metadata.google.internal"
    request = urllib.request.Request(f"http://{host}/computeMetadata/v1/{path}", headers={"Metadata-Flavor": "Google"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read().decode().strip()
