"""Gradient accumulation (train.grad_accum_steps): the update of k micro-batches equals the
full batch's (parameters, ACT carry, metric sums, gradient norm); micro-batches keep each device's
rows; bad settings are one line before any compile. (On a 2-process pod, through the trainer: the
TRM in test_pod.py, Gemma in test_gemma_training.py.)"""

from __future__ import annotations

import re

import numpy as np
import pytest

import grad_accum_case
from helpers import REFERENCE_EXTRA, base_overrides, compose_config, train, train_losses


def assert_same_updates(full: dict[str, np.ndarray], accum: dict[str, np.ndarray]) -> None:
    """Every array of the accumulated run equals the full-batch run's to float32 rounding
    (relative to each array's scale)."""
    assert full.keys() == accum.keys() and any("grad_norm" in k for k in full)
    for key, want in full.items():
        scale = float(np.max(np.abs(want))) if want.size else 0.0
        np.testing.assert_allclose(accum[key], want, rtol=1e-5, atol=1e-6 * max(scale, 1.0), err_msg=key)


# --- quick tier: row placement and validation ------------------------------------------------

def test_micro_batches_keep_each_devices_rows():
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from runtime import grad_accum
    from runtime.sharding import make_mesh

    mesh = make_mesh({"data": 4, "fsdp": 2, "tensor": 1})
    rows = jax.device_put(jnp.arange(32), NamedSharding(mesh, P(("data", "fsdp"))))
    held = {s.device: set(np.asarray(s.data).tolist()) for s in rows.addressable_shards}
    micro = jax.jit(lambda x: grad_accum.split(x, 4, mesh))(rows)
    assert micro.shape == (4, 8)
    for shard in micro.addressable_shards:  # every micro-batch's rows on a device are rows it held
        assert shard.data.shape == (4, 1) and set(np.asarray(shard.data).ravel().tolist()) <= held[shard.device]
    assert sorted(np.asarray(micro).ravel().tolist()) == list(range(32))
    assert np.array_equal(jax.jit(lambda m: grad_accum.join(m, 4, mesh))(micro), np.arange(32))


def test_range_rule():
    from runtime.errors import UserError

    with pytest.raises(UserError, match=r"train.grad_accum_steps=0 is out of range: it must be >= 1"):
        compose_config(["train.grad_accum_steps=0"])


@pytest.mark.parametrize("k,message", [
    (3, "splits the global batch of 16 rows into micro-batches of 5.33333, which must be a whole multiple of the 8 "
        r"batch devices \(data x fsdp\); use grad_accum_steps in \[1, 2\]"),
    (4, "micro-batches of 4, which must be a whole multiple of the 8 batch devices"),
])
def test_micro_batch_must_divide_over_the_batch_devices(sudoku_dir, tmp_path, k, message):
    result = train(base_overrides(sudoku_dir, tmp_path) + [f"train.grad_accum_steps={k}"], check=False)
    assert result.code == 2 and "\n" not in result.error
    assert re.search(message, result.error), result.error
    assert "compiled" not in result.log and not list((tmp_path / "test" / "t").glob("checkpoints/[0-9]*"))


def test_every_sub_batch_of_a_mixture_must_split():
    import optax

    from runtime.errors import UserError
    from runtime.sharding import make_mesh
    from runtime.train_step import build_steps

    task, _ = grad_accum_case._task("multitask")  # two sub-batches of 8 rows: 4 per micro-batch, over 8 devices
    mesh = make_mesh({"data": 8, "fsdp": 1, "tensor": 1})
    with pytest.raises(UserError, match=r"splits the batch field 'a/inputs' of 8 rows into micro-batches of 4, which "
                                        r"must be a whole multiple of the 8 batch devices .*use grad_accum_steps in \[1\]"):
        build_steps(task, optax.sgd(0.1), optax.constant_schedule(0.1), mesh, 0, None, global_batch=16,
                    grad_accum_steps=2)


# --- slow: equality of the updates ------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("family", ["trm", "gemma", "multitask"])
def test_accumulated_update_equals_full_batch(family):
    """TRM (ACT carry kept row for row, puzzle table) on data 4 x fsdp 2 with 2 micro-batches;
    Gemma (token-weighted loss, micro-batches with different target counts) on 2 x 2 x 2 with 4;
    a two-task TRM mixture (each task's sub-batch and carry split) on 2 x 2 with 2."""
    full = grad_accum_case.run(family, 1)
    accum = grad_accum_case.run(family, grad_accum_case.ACCUM[family])
    if family != "gemma":
        assert any(k.startswith("step3/carry") for k in full)
    assert_same_updates(full, accum)


@pytest.mark.slow
def test_trainer_with_accumulation_matches_reference_run(sudoku_dir, tmp_path, reference_losses):
    """Through the trainer (config -> plan -> steps -> loop): the shared reference's first two
    losses (the second after one accumulated update; warmup makes the lr independent of the run's length)."""
    result = train(base_overrides(sudoku_dir, tmp_path, steps=2) + REFERENCE_EXTRA + ["train.grad_accum_steps=2"])
    assert "gradient accumulation: 2 micro-batches of 8 rows per optimizer step" in result.log
    losses = train_losses(tmp_path / "test" / "t")
    assert losses == pytest.approx({s: reference_losses[s] for s in (1, 2)}, rel=1e-5)
