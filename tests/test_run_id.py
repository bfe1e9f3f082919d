"""The run id (W&B run, manifest, checkpoints): a fresh run takes run.id, else the launcher's
proposal (PODRUNNER_RUN_ID), else a new one; a resumed run keeps its checkpoint's, and a given
run.id that differs is refused in one line before anything is built."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from helpers import base_overrides, train

pytestmark = pytest.mark.slow


def files(directory: Path) -> dict[str, str]:
    """Every file under `directory`: relative path -> content hash."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def manifest_run_id(out: Path) -> str:
    return json.loads((out / "run_manifest.json").read_text())["run_id"]


@pytest.mark.devices(1)  # ids, not the mesh
def test_a_resumed_run_keeps_its_checkpoint_id(sudoku_dir, tmp_path, monkeypatch):
    overrides, out = base_overrides(sudoku_dir, tmp_path, steps=2), tmp_path / "test" / "t"
    monkeypatch.setenv("PODRUNNER_RUN_ID", "launch-1")
    fresh = train(overrides)
    assert "run id launch-1 (a fresh run: the launcher's PODRUNNER_RUN_ID)" in fresh.log.splitlines()
    assert manifest_run_id(out) == "launch-1"
    checkpoints = files(out / "checkpoints")

    refused = train(overrides + ["run.id=other-2"], check=False)
    assert refused.code == 2
    assert refused.error == (
        f"run.id=other-2 differs from the run id launch-1 of the checkpoint (step 2) in {out / 'checkpoints'}; "
        "drop run.id (launch.py: --run-id) to resume as launch-1, or use a new run.name (or run.checkpoint.dir) "
        "to start a fresh run")
    assert "parameters (" not in refused.log  # before the model was built
    assert files(out / "checkpoints") == checkpoints  # untouched, manifest included

    monkeypatch.setenv("PODRUNNER_RUN_ID", "launch-3")  # a new launch's proposal: the checkpoint's id wins
    resumed = train(overrides)
    assert "run id launch-1 (resumed from the checkpoint)" in resumed.log.splitlines()
    assert manifest_run_id(out) == "launch-1"

    monkeypatch.delenv("PODRUNNER_RUN_ID")  # a fixed id equal to the checkpoint's just resumes
    assert "run id launch-1 (resumed from the checkpoint)" in train(overrides + ["run.id=launch-1"]).log
