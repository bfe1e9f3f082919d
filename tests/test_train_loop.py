"""The train loop on one process x 8 CPU devices: resume after a kill, NaN guard, eval,
profiler window, EMA, manifest, and parameters that are created sharded."""

from __future__ import annotations

import json

import jax
import pytest

from helpers import (REFERENCE_EXTRA, REFERENCE_STEPS, base_overrides, kill_after_step, launch_pretrain, read_jsonl,
                     resumed_step, run_pretrain, saved_steps, train, train_losses)


@pytest.mark.slow
def test_killed_run_resumes_with_identical_losses(sudoku_dir, tmp_path, reference_losses):
    steps, reference = REFERENCE_STEPS, reference_losses
    overrides = base_overrides(sudoku_dir, tmp_path, steps=steps) + REFERENCE_EXTRA + [
        "train.checkpoint_every=5", "run.checkpoint.keep=2"]
    out = tmp_path / "test" / "t"
    kill_after_step(launch_pretrain(overrides), out / "metrics.jsonl", 12)  # a real process, SIGKILLed
    complete = saved_steps(out / "checkpoints")
    assert complete and complete[-1] < steps  # killed mid-run, with some complete checkpoint behind it
    resumed_at = resumed_step(train(overrides).log)
    assert resumed_at == complete[-1]
    losses = {s: v for s, v in train_losses(out).items() if s > resumed_at}
    assert sorted(losses) == list(range(resumed_at + 1, steps + 1))
    assert losses == pytest.approx({s: reference[s] for s in losses}, rel=1e-6, abs=1e-7)
    manifest = json.loads((out / "run_manifest.json").read_text())
    assert manifest["resumed_from_step"] == resumed_at and manifest["status"] == "completed"


@pytest.mark.slow
@pytest.mark.devices(1)  # the loop, not the mesh
def test_nonfinite_loss_stops_and_keeps_last_good_checkpoint(sudoku_dir, tmp_path):
    overrides = base_overrides(sudoku_dir, tmp_path, steps=8) + ["train.checkpoint_every=1"]
    train(overrides + ["train.steps=2"])  # a good checkpoint at steps 1 and 2
    result = train(overrides + ["optim.lr=1e30"], check=False)  # resumes at 2, then blows up
    assert result.code == 3, result.log[-2000:]
    out = tmp_path / "test" / "t"
    # Step 3 starts from step 2's finite weights (finite loss and gradient); its update at lr 1e30 takes
    # the weights to about 1e30, so step 4's forward overflows: the first non-finite step is 4.
    assert "non-finite loss or gradient at step 4; stopping. Last good checkpoint: step 3 in " in result.log
    assert saved_steps(out / "checkpoints") == [1, 2, 3]  # nothing at or after the bad step was saved
    assert json.loads((out / "run_manifest.json").read_text())["status"] == "nonfinite"


@pytest.mark.slow
@pytest.mark.devices(1)  # the loop, not the mesh
def test_eval_profile_and_outputs(sudoku_dir, tmp_path):
    train(base_overrides(sudoku_dir, tmp_path, steps=6) + ["train.eval_every=3", "train.profile_start_step=2",
                                                                  "train.profile_steps=2", "arch.dtype=auto"])
    out = tmp_path / "test" / "t"
    rows = read_jsonl(out / "metrics.jsonl")
    evals = [r for r in rows if "eval/loss" in r]
    assert [r["step"] for r in evals] == [3, 6]
    assert all(0 <= r["eval/token_accuracy"] <= 1 for r in evals)
    perf = [r for r in rows if "perf/examples_per_sec" in r]
    assert perf and all(r["perf/examples_per_sec"] == pytest.approx(16 * r["perf/steps_per_sec"]) for r in perf)
    assert list((out / "profile").rglob("*.xplane.pb")), "profiler trace missing"
    manifest = json.loads((out / "run_manifest.json").read_text())
    assert manifest["device_count"] == 1 and manifest["packages"]["jax"] == jax.__version__  # its devices(1)
    assert manifest["config"]["arch"]["dtype"] == "float32"  # "auto" recorded as what it resolved to on CPU
    assert manifest["final_metrics"]["eval/loss"] == evals[-1]["eval/loss"]
    assert json.loads((out / "checkpoints" / "run_manifest.json").read_text())["status"] == "completed"


def test_parameters_are_created_sharded():
    from models.tiny_transformer import SequenceTask, TinyTransformer, TinyTransformerConfig
    from runtime.config import MeshConfig, OptimConfig, resolve_mesh_shape
    from runtime.sharding import make_mesh
    from runtime.train_step import build_steps, lr_schedule, make_optimizer

    mesh = make_mesh(resolve_mesh_shape(MeshConfig(data=1, fsdp=4, tensor=2), 8))
    model = SequenceTask(TinyTransformer(TinyTransformerConfig(hidden=64, heads=4), vocab_size=16, seq_len=8))
    schedule = lr_schedule(OptimConfig(), 10, 1)
    steps = build_steps(model, make_optimizer(OptimConfig(), schedule), schedule, mesh, 8, 0.99)
    state = steps.init(jax.random.key_data(jax.random.key(0)))
    qkv = state.params["Block_0"]["Attention_0"]["qkv"]  # [embed, 3, heads, head_dim]
    assert qkv.sharding.spec == jax.sharding.PartitionSpec("fsdp", None, "tensor", None)
    assert qkv.addressable_shards[0].data.shape == (16, 3, 2, 16)  # 1/8 of it per device
    mu = state.opt_state[0][0].mu["Block_0"]["Attention_0"]["qkv"]
    assert mu.sharding == qkv.sharding and state.ema_params["embed"].sharding == state.params["embed"].sharding
    # vocab 16 over tensor=2 divides; embed 64 over fsdp=4 divides
    assert state.params["embed"].sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")


@pytest.mark.slow
def test_sweep_runs_each_job_in_its_own_directory(sudoku_dir, tmp_path):  # `-m` is the command line's
    overrides = [o for o in base_overrides(sudoku_dir, tmp_path, steps=2) if not o.startswith("run.name=")]
    run_pretrain(["-m", *overrides, "train.seed=0,1"])
    runs = sorted((tmp_path / "test").iterdir())
    assert [r.name.rsplit("train.seed=", 1)[1].split(",")[0] for r in runs] == ["0", "1"]
    first, second = (train_losses(r) for r in runs)
    assert sorted(first) == sorted(second) == [1, 2] and first != second  # different seeds, both ran
