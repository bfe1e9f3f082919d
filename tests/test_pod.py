"""A simulated pod: 2 processes x 4 CPU devices joined with jax.distributed on loopback.

The same config must give the same losses on 1 process x 8 devices, and a checkpoint must
resume across process counts (the data order depends on (seed, step, global batch) only).
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest

from helpers import REPO, base_overrides, child_env, read_jsonl, train, train_losses
from experiments.local_pod import run_local_pod
from wandb_offline import read_offline_runs

pytestmark = pytest.mark.slow

# Constant LR after warmup: a run stopped at step 4 and extended to 8 follows the same schedule.
ELASTIC = ["optim.lr_min_ratio=1.0", "mesh=fsdp"]


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
    train(base_overrides(sudoku_dir, root, steps=8) + ELASTIC)
    return train_losses(root / "test" / "t")


def test_two_process_pod_matches_single_process(sudoku_dir, tmp_path, single_process_run):
    log = run_pod(base_overrides(sudoku_dir, tmp_path, steps=8, wandb="offline") + ELASTIC, tmp_path)
    assert "[p0] process 0/2, local devices 4, global devices 8, platform cpu (explicit)" in log
    assert "[p1] process 1/2, local devices 4, global devices 8, platform cpu (explicit)" in log
    losses = train_losses(tmp_path / "test" / "t")
    assert sorted(losses) == list(range(1, 9))
    assert losses == pytest.approx(single_process_run, rel=1e-5, abs=1e-6)
    assert losses[8] < losses[1]  # it trains

    # Only process 0 writes: one row per step, one W&B run, and p1 says nothing but warnings.
    rows = read_jsonl(tmp_path / "test" / "t" / "metrics.jsonl")
    assert [r["step"] for r in rows if "train/loss" in r] == list(range(1, 9))
    runs = read_offline_runs(tmp_path / "test" / "t")
    assert len(runs) == 1 and [h["_step"] for h in runs[0].history if "train/loss" in h] == list(range(1, 9))
    assert runs[0].config["train"]["global_batch_size"] == 16 and runs[0].group == "test"
    p1 = [line for line in log.splitlines() if line.startswith("[p1]")]
    assert p1 and not any(" INFO " in line for line in p1)
    manifest = json.loads((tmp_path / "test" / "t" / "run_manifest.json").read_text())
    assert manifest["process_count"] == 2 and manifest["status"] == "completed"
    # Process 0's W&B run: system metrics, its console (the trainer's log lines) and the commit.
    assert runs[0].stats and manifest["git_commit"] and runs[0].git_commit == manifest["git_commit"]
    console = (runs[0].path / "files" / "output.log").read_text()
    assert "compiled train step in" in console and "saving the checkpoint of step 8" in console


@pytest.mark.parametrize("first,then", [("pod", "single"), ("single", "pod")])
def test_elastic_resume_across_process_counts(sudoku_dir, tmp_path, single_process_run, first, then):
    overrides = base_overrides(sudoku_dir, tmp_path, steps=4) + ELASTIC
    run_pod(overrides, tmp_path) if first == "pod" else train(overrides)
    out = tmp_path / "test" / "t"
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4"]
    shutil.copy(out / "metrics.jsonl", tmp_path / "first.jsonl")

    overrides = base_overrides(sudoku_dir, tmp_path, steps=8) + ELASTIC
    log = run_pod(overrides, tmp_path) if then == "pod" else train(overrides).log
    assert "resumed from step 4" in log
    losses = train_losses(out)
    assert sorted(losses) == list(range(1, 9))  # steps 1-4 from the first run, 5-8 after resume
    assert losses == pytest.approx(single_process_run, rel=1e-5, abs=1e-6)
