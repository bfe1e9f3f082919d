"""A simulated pod: 2 processes x 2 CPU devices joined with jax.distributed on loopback, training
the tiny TRM (its puzzle table, ACT carry and reference optimizers all sharded over the mesh), its
gradient accumulated over 2 micro-batches (each spread over both processes).

The same config must give the same losses and gradient norms on 1 process x 4 devices taking the
whole batch at once, and a checkpoint must resume across process counts both ways, the carry
mid-ACT included (the data order depends on (seed, step, global batch) only).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from helpers import REPO, child_env, read_jsonl, saved_steps, train, train_losses, trm_overrides, use_cpu_devices
from experiments.launcher.local_pod import run_local_pod
from wandb_offline import read_offline_runs

# 4 devices in all: several a process and more than one process, as a pod has. (2 x 4 costs the pod's
# processes a third more CPU: their collectives go through gloo, one rank a device.)
DEVICES, PROCESSES = 4, 2
pytestmark = [pytest.mark.slow, pytest.mark.devices(DEVICES)]

FSDP = ["mesh=fsdp"]  # parameters and optimizer state sharded too, not only the batch
ACCUM = ["train.grad_accum_steps=2"]  # on the pod: 2 micro-batches of 8 rows, 4 on each process


def grad_norms(output_dir: Path) -> dict[int, float]:
    """step -> train/grad_norm: a wrongly scaled accumulated gradient shows here at every step;
    the losses under AdamATan2 and sign-SGD (both blind to the gradient's scale) barely show it
    (a doubled gradient changed 3 of 8 steps' losses, none of the pod's first 4)."""
    return {r["step"]: r["train/grad_norm"] for r in read_jsonl(output_dir / "metrics.jsonl") if "train/grad_norm" in r}


def run_pod(overrides: list[str], tmp_path: Path) -> str:
    out = io.StringIO()
    devices = DEVICES // PROCESSES
    env = {k: v for k, v in child_env(devices).items() if k != "XLA_FLAGS"}
    code = run_local_pod(PROCESSES, devices, overrides, script=str(REPO / "pretrain_jax.py"), extra_env=env,
                         log_dir=tmp_path / f"pod-logs-{len(list(tmp_path.glob('pod-logs-*')))}", stream=out,
                         timeout=300)
    assert code == 0, out.getvalue()[-6000:]
    return out.getvalue()


@pytest.fixture(scope="module")
def single_process_run(sudoku_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("single")
    use_cpu_devices(DEVICES)  # a module fixture: set up before the test's own devices mark applies
    train(trm_overrides(sudoku_dir, root, 8) + FSDP)
    return train_losses(root / "test" / "t"), grad_norms(root / "test" / "t")


def test_a_run_moves_between_a_pod_and_one_process(sudoku_dir, tmp_path, single_process_run):
    """A 2-process pod, accumulating, trains steps 1-4 as the single process does at once, only
    process 0 writing; one process x 4 devices resumes its checkpoint and trains steps 5-6; the pod
    resumes that and trains 7-8. Every step's loss and gradient norm is the uninterrupted single
    process's."""
    reference, reference_norms = single_process_run
    overrides = trm_overrides(sudoku_dir, tmp_path, 4, wandb="offline") + FSDP + ACCUM
    log = run_pod(overrides, tmp_path)
    assert "[p0] process 0/2, local devices 2, global devices 4, platform cpu (explicit)" in log
    assert "[p1] process 1/2, local devices 2, global devices 4, platform cpu (explicit)" in log
    assert "gradient accumulation: 2 micro-batches of 8 rows per optimizer step" in log
    out = tmp_path / "test" / "t"
    assert saved_steps(out / "checkpoints") == [2, 4]
    assert train_losses(out) == pytest.approx({s: reference[s] for s in range(1, 5)}, rel=1e-5, abs=1e-6)
    assert grad_norms(out) == pytest.approx({s: reference_norms[s] for s in range(1, 5)}, rel=1e-5, abs=1e-6)

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
    # The checkpoint holds the ACT carry with every row in the middle of its ACT steps: a fresh
    # carry (all halted) on resume would change the losses below.
    carry = saved_carry(out / "checkpoints", 4)
    assert carry["steps"].shape == (16,) and (carry["steps"] > 0).all() and not carry["halted"].all()

    # One process resumes the pod's checkpoint (saving at 6: checkpoint_every is 6 // 2) ...
    assert "resumed from step 4" in train(trm_overrides(sudoku_dir, tmp_path, 6) + FSDP).log
    assert saved_steps(out / "checkpoints")[-1] == 6
    # ... and the pod resumes the single process's.
    assert "resumed from step 6" in run_pod(trm_overrides(sudoku_dir, tmp_path, 8) + FSDP + ACCUM, tmp_path)
    losses = train_losses(out)
    assert sorted(losses) == list(range(1, 9))  # 1-4 on the pod, 5-6 on one process, 7-8 on the pod
    assert losses == pytest.approx(reference, rel=1e-5, abs=1e-6)
    assert grad_norms(out) == pytest.approx(reference_norms, rel=1e-5, abs=1e-6)
    assert losses[8] < losses[1]  # it trains


def saved_carry(ckpt_dir: Path, step: int) -> dict:
    """The carry's `steps` and `halted` of a checkpoint, read as host arrays (whatever mesh saved it)."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    path = ckpt_dir / str(step) / "state"
    with ocp.PyTreeCheckpointer() as checkpointer:
        tree = checkpointer.metadata(path).item_metadata.tree
        as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        state = checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
    return {k: np.asarray(state["carry"][k]) for k in ("steps", "halted")}
