"""The run manifest: what ran, where, on what, and how it ended, written by process 0.

It is produced from the live run (never filled in by hand): at start with status "running",
and again at the end with the final metrics and exit status. It sits in the output
directory and beside the checkpoints (so it survives with them on GCS), and goes to W&B.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Sequence

import jax

from runtime.atomic import write_whole

PACKAGES = ("jax", "jaxlib", "libtpu", "flax", "optax", "orbax-checkpoint", "tensorstore", "hydra-core",
            "wandb", "gcsfs", "google-cloud-storage", "numpy")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def shipped_tree() -> dict[str, Any] | None:
    """What `launch.py pod --ship` sent (tree_hash, base_commit, diff_summary; experiments/launcher/ship.py),
    None for a run of the checkout itself. A shipped tree has no .git: git_commit is None then."""
    text = os.environ.get("PODRUNNER_SHIPPED_TREE")
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:  # a record, never a reason to stop the run
        return {"unparsed": text[:1000]}


def source_commit(manifest: dict[str, Any]) -> str | None:
    """The commit the run's code came from: the checkout's HEAD, else the base commit of a shipped
    tree (which may differ from it: its diff_summary and tree_hash are in manifest["shipped"])."""
    return manifest["git_commit"] or (manifest["shipped"] or {}).get("base_commit")


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def new_manifest(*, config: dict[str, Any], plan: dict[str, Any], run_id: str, resumed_from: int | None,
                 schedule_change: dict[str, Any] | None = None, quarantined: Sequence[tuple[int, str | None]] = ()) -> dict[str, Any]:
    """`schedule_change`: the lr schedule before and after a resume with other planned total steps
    (runtime.trainer.schedule_change); `quarantined`: (step, moved to) of unreadable checkpoint steps
    moved aside before resuming."""
    devices = jax.devices()
    return {
        "run_id": run_id,
        "status": "running",
        "exit_code": None,
        "start_time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "end_time": None,
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "shipped": shipped_tree(),
        "command": sys.argv,
        "python": platform.python_version(),
        "host": platform.node(),
        "packages": package_versions(),
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "device_count": jax.device_count(),
        "process_count": jax.process_count(),
        "resumed_from_step": resumed_from,
        "schedule_change": schedule_change,
        "quarantined_checkpoints": [{"step": step, "moved_to": target} for step, target in quarantined],
        "plan": plan,
        "config": config,
        "final_metrics": None,
    }


def finish(manifest: dict[str, Any], *, exit_code: int, status: str, final_metrics: dict[str, Any] | None) -> dict[str, Any]:
    return manifest | {
        "status": status,
        "exit_code": exit_code,
        "end_time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "final_metrics": final_metrics,
    }


def write(manifest: dict[str, Any], *directories: str) -> list[str]:
    """Write run_manifest.json into each directory (local or gs://); returns the paths. A local
    file is replaced whole (temp file + rename): a failed write leaves the previous one."""
    paths = []
    text = json.dumps(manifest, indent=2, default=str)
    for d in directories:
        path = f"{d.rstrip('/')}/run_manifest.json"
        write_whole(path, text)
        paths.append(path)
    return paths
