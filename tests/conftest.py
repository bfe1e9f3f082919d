"""Shared test setup: CPU devices, isolated W&B, a small generated dataset, and a runner
for `pretrain_jax.py` as a real subprocess (the way users and the pod launcher run it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# Before jax/gcsfs are imported anywhere in the session.
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # never probe for a TPU (libtpu may be installed)
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # else gcsfs stalls on the emulator

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # helper modules: gcs_emulator, wandb_offline


def child_env(devices: int = 8, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "JAX_COORDINATOR", "JAX_NUM_PROC", "JAX_PROCESS_ID"))}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false", PYTHONUNBUFFERED="1", WANDB_SILENT="true")
    env.update(extra)
    return env


def run_pretrain(overrides: list[str], *, devices: int = 8, timeout: float = 300, env: dict | None = None,
                 check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(REPO / "pretrain_jax.py"), *overrides], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=env or child_env(devices))
    if check and proc.returncode != 0:
        raise AssertionError(f"pretrain_jax.py exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def train_losses(output_dir: Path) -> dict[int, float]:
    """step -> train/loss from a run's metrics.jsonl (log_every=1 gives every step)."""
    return {r["step"]: r["train/loss"] for r in read_jsonl(Path(output_dir) / "metrics.jsonl") if "train/loss" in r}


@pytest.fixture(scope="session")
def sudoku_dir(tmp_path_factory) -> Path:
    """A small generated Sudoku dataset in the reference format (built once per session)."""
    from data_pipeline.build_sudoku import build_sudoku_dataset

    root = tmp_path_factory.mktemp("data") / "sudoku"
    build_sudoku_dataset(root, generate=360, test_size=40, min_givens=30, seed=0)
    return root


def base_overrides(data: Path, root: Path, *, steps: int = 8, name: str = "t") -> list[str]:
    """A fast run: tiny model, batch 16, every step logged, checkpoints at half-way and end."""
    return [f"data.path={data}", "data.generate_if_missing=false", f"run.root={root}", "run.progress_bar=false",
            "run.group=test", f"run.name={name}", f"train.steps={steps}", "train.log_every=1",
            f"train.checkpoint_every={steps // 2}", f"train.eval_every={steps}", "train.global_batch_size=16",
            "arch.hidden=32", "arch.heads=2", "optim.warmup_steps=2"]
