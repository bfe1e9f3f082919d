"""A simulated pod: 2 processes x 4 CPU devices joined with jax.distributed on loopback, training
the tiny TRM (its puzzle table, ACT carry and reference optimizers all sharded over the mesh).

The same config must give the same losses on 1 process x 8 devices, and a checkpoint must
resume across process counts, the carry mid-ACT included (the data order depends on (seed,
step, global batch) only).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from helpers import REPO, child_env, read_jsonl, saved_steps, train, train_losses, trm_overrides
from experiments.local_pod import run_local_pod
from wandb_offline import read_offline_runs

pytestmark = pytest.mark.slow

FSDP = ["mesh=fsdp"]  # parameters and optimizer state sharded too, not only the batch


def run_pod(overrides: list[str], tmp_path: Path, processes: int = 2, devices: int = 4) -> str:
    out = io.StringIO()
    env = {k: v for k, v in child_env(devices).items() if k != "XLA_FLAGS"}
    code = run_local_pod(processes, devices, overrides, script=str(REPO / "pretrain_jax.py"), extra_env=env,
                         log_dir=tmp_path / f"pod-logs-{len(list(tmp_path.glob('pod-logs-*')))}", stream=out,
                         timeout=300)
    assert code == 0, out.getvalue()[-6000:]
    return out.getvalue()


@pytest.fixture(scope="module")
def single_process_run(sudoku_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("single")
    train(trm_overrides(sudoku_dir, root, 8) + FSDP)
    return train_losses(root / "test" / "t")


def test_pod_run_resumed_by_one_process(sudoku_dir, tmp_path, single_process_run):
    """A 2-process pod trains steps 1-4 with the single process's losses, only process 0 writing;
    one process x 8 devices resumes its checkpoint and continues with the same losses."""
    overrides = trm_overrides(sudoku_dir, tmp_path, 4, wandb="offline") + FSDP
    log = run_pod(overrides, tmp_path)
    assert "[p0] process 0/2, local devices 4, global devices 8, platform cpu (explicit)" in log
    assert "[p1] process 1/2, local devices 4, global devices 8, platform cpu (explicit)" in log
    out = tmp_path / "test" / "t"
    assert saved_steps(out / "checkpoints") == [2, 4]
    assert train_losses(out) == pytest.approx({s: single_process_run[s] for s in range(1, 5)}, rel=1e-5, abs=1e-6)

    # Only process 0 writes: one row per step, one W&B run, and p1 says nothing but warnings.
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows if "train/loss" in r] == list(range(1, 5))
    runs = read_offline_runs(out)
    assert len(runs) == 1 and [h["_step"] for h in runs[0].history if "train/loss" in h] == list(range(1, 5))
    assert runs[0].config["train"]["global_batch_size"] == 16 and runs[0].group == "test"
    p1 = [line for line in log.splitlines() if line.startswith("[p1]")]
    assert p1 and not any(" INFO " in line for line in p1)
    manifest = json.loads((out / "run_manifest.json").read_text())
    assert manifest["process_count"] == 2 and manifest["status"] == "completed"
    # Process 0's W&B run: system metrics, its console (the trainer's log lines) and the commit.
    assert runs[0].stats and manifest["git_commit"] and runs[0].git_commit == manifest["git_commit"]
    console = (runs[0].path / "files" / "output.log").read_text()
    assert "compiled train step in" in console and "saving the checkpoint of step 4" in console

    assert "resumed from step 4" in train(trm_overrides(sudoku_dir, tmp_path, 8) + FSDP).log
    losses = train_losses(out)
    assert sorted(losses) == list(range(1, 9))  # steps 1-4 from the pod, 5-8 after the resume
    assert losses == pytest.approx(single_process_run, rel=1e-5, abs=1e-6)
    assert losses[8] < losses[1]  # it trains


def test_one_process_run_resumed_by_a_pod(sudoku_dir, tmp_path, single_process_run):
    train(trm_overrides(sudoku_dir, tmp_path, 4) + FSDP)
    log = run_pod(trm_overrides(sudoku_dir, tmp_path, 8) + FSDP, tmp_path)
    assert "resumed from step 4" in log
    losses = train_losses(tmp_path / "test" / "t")
    assert sorted(losses) == list(range(1, 9))  # steps 1-4 from the first run, 5-8 on the pod
    assert losses == pytest.approx(single_process_run, rel=1e-5, abs=1e-6)
