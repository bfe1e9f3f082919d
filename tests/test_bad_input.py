"""Every bad input is one line naming the fix, a non-zero exit, and comes before any compile.

The command line's own handling (Hydra and config errors, the coordinator check that runs before
JAX starts) goes through `pretrain_jax.py`; the trainer's checks run in process, where the
UserError's message is the line the script prints."""

from __future__ import annotations

import pytest

from helpers import assert_exit_one_line, assert_user_error, base_overrides, free_port, run_pretrain, train


@pytest.mark.parametrize("override,needles", [
    ("train.stepz=3", ["train.stepz"]),                     # unknown key
    ("arch=tiny_transfomer", ["arch/tiny_transfomer", "tiny_transformer"]),  # typo'd group: lists the options
    ("optim.lr=abc", ["optim.lr=abc", "could not be converted"]),  # wrong type
    ("+experiment=example/smal", ["experiment/example/smal"]),  # typo'd experiment variant
    ("run.wandb.mode=onine", ["run.wandb.mode", "offline"]),
])
def test_config_errors(override, needles):
    assert_exit_one_line(run_pretrain([override], check=False), 2, *needles)


def test_mesh_that_does_not_match_devices(sudoku_dir, tmp_path):
    result = train(base_overrides(sudoku_dir, tmp_path) + ["mesh.data=3"], check=False)
    assert_user_error(result, "3 devices, but this job has 8")


def test_batch_that_does_not_divide(sudoku_dir, tmp_path):
    result = train(base_overrides(sudoku_dir, tmp_path) + ["train.global_batch_size=12"], check=False)
    assert_user_error(result, "global_batch_size=12", "multiple of 8")


def test_missing_dataset(tmp_path):
    proc = run_pretrain([f"data.path={tmp_path}/nope", "data.generate_if_missing=false", f"run.root={tmp_path}"],
                        check=False)
    assert_exit_one_line(proc, 2, f"{tmp_path}/nope", "build_sudoku")  # a trainer error, printed by the script


@pytest.mark.slow  # waits out the coordinator's timeout
def test_unreachable_coordinator(tmp_path):
    proc = run_pretrain([f"distributed.coordinator_address=127.0.0.1:{free_port()}", "distributed.num_processes=2",
                         "distributed.process_id=1", "distributed.initialization_timeout_s=3"], check=False)
    assert_exit_one_line(proc, 2, "did not answer within 3s")


def test_partial_distributed_values():
    assert_user_error(train(["distributed.coordinator_address=127.0.0.1:1234"], check=False),
                      "distributed.num_processes", "distributed.process_id")


@pytest.mark.slow
@pytest.mark.devices(1)  # the refusal, not the mesh
def test_incompatible_checkpoint_is_refused_and_left_intact(sudoku_dir, tmp_path):
    train(base_overrides(sudoku_dir, tmp_path, steps=2))
    ckpt = tmp_path / "test" / "t" / "checkpoints"
    before = sorted(p.name for p in ckpt.iterdir())
    result = train(base_overrides(sudoku_dir, tmp_path, steps=4) + ["arch.hidden=48"], check=False)
    assert_user_error(result, "arch.hidden=32", "48", "run.name")
    assert sorted(p.name for p in ckpt.iterdir()) == before  # nothing written, nothing removed

    result = train(base_overrides(sudoku_dir, tmp_path, steps=4) + ["run.checkpoint.resume=false"], check=False)
    assert_user_error(result, "already holds checkpoints", "run.name")
    assert sorted(p.name for p in ckpt.iterdir()) == before
