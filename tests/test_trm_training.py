"""TRM end to end through `pretrain_jax.py`: it learns; the puzzle table and the carry are sharded
over the batch axes. (The ACT carry checkpointed mid-ACT and restored, resumes giving the
uninterrupted losses, across process counts: test_pod.py.)"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from helpers import read_jsonl, train, train_losses, trm_overrides


@pytest.mark.slow
@pytest.mark.devices(1)  # learning, not the mesh
def test_trm_learns(sudoku_dir, tmp_path):
    steps = 80
    train(trm_overrides(sudoku_dir, tmp_path, steps) + [f"train.eval_every={steps}"])
    out = tmp_path / "test" / "t"
    losses = train_losses(out)
    assert sorted(losses) == list(range(1, steps + 1))
    assert np.mean([losses[s] for s in range(steps - 4, steps + 1)]) < 0.6 * losses[1], losses
    rows = read_jsonl(out / "metrics.jsonl")
    last = [r for r in rows if r.get("train/count", 0) > 0][-1]  # a step where some rows halted
    assert last["train/token_accuracy"] > 0.4  # above copying the givens (30 of 81)
    ev = [r for r in rows if "eval/exact_accuracy" in r][-1]
    assert ev["eval/steps"] == 3.0  # eval runs halt_max_steps ACT steps for every row
    assert ev["eval/token_accuracy"] > 0.4
    for k in ("eval/token_accuracy", "eval/q_halt_accuracy", "eval/exact_accuracy"):
        assert 0 <= ev[k] <= 1


def test_puzzle_table_and_carry_sharded_over_batch_axes():
    from models import build_task
    from models.recursive_reasoning import TRMConfig
    from runtime.task import DataShape
    from runtime.config import MeshConfig, OptimConfig, resolve_mesh_shape
    from runtime.sharding import make_mesh
    from runtime.train_step import abstract_batch, build_steps, lr_schedule, make_optimizer, puzzle_lr_schedule

    mesh = make_mesh(resolve_mesh_shape(MeshConfig(data=2, fsdp=4, tensor=1), 8))
    arch = TRMConfig(hidden=32, heads=2, L_layers=1, H_cycles=2, L_cycles=1, halt_max_steps=2, puzzle_emb_ndim=32,
                     puzzle_emb_len=1, forward_dtype="float32")
    task = build_task(arch, DataShape(examples=0, vocab_size=11, seq_len=9, num_puzzle_identifiers=16))
    optim = OptimConfig(name="adam_atan2", ema_rate=0.9, puzzle_emb_lr=0.1, puzzle_emb_weight_decay=0.0)
    schedule = lr_schedule(optim, 10, 1)
    tx = make_optimizer(optim, schedule, puzzle_lr_schedule(optim, 10, 1))
    steps = build_steps(task, tx, schedule, mesh, 9, 0.9, global_batch=16)
    state = steps.init(jax.random.key_data(jax.random.key(0)))
    table = state.params["puzzle_emb"]
    assert table.shape == (16, 32)
    assert table.sharding.spec == P(("data", "fsdp"), None)
    assert table.addressable_shards[0].data.shape == (2, 32)  # 1/8 of the rows per device
    assert "puzzle_emb" not in state.ema_params  # EMA excludes the table (evaluated live)
    assert state.carry.inner.z_H.sharding.spec == P(("data", "fsdp"), None, None)
    assert state.carry.halted.sharding.spec == P(("data", "fsdp"))
    assert state.carry.current_data["inputs"].sharding.spec == P(("data", "fsdp"), None)

    # One step: only the rows of ids in the batch move (sign-SGD), and everything keeps its sharding.
    rng = np.random.default_rng(0)
    ids = np.array([1, 3, 5, 7] * 4, np.int32)
    host = {"inputs": rng.integers(1, 11, (16, 9)).astype(np.int32), "labels": rng.integers(1, 11, (16, 9)).astype(np.int32),
            "puzzle_identifiers": ids}
    batch = {k: jax.device_put(v, s.sharding) for (k, v), s in
             zip(host.items(), abstract_batch(mesh, 16, 9).values())}
    new, metrics = steps.train(state, batch)
    moved = np.abs(np.asarray(new.params["puzzle_emb"])).sum(-1) > 0
    assert set(np.flatnonzero(moved)) == {1, 3, 5, 7}
    assert new.params["puzzle_emb"].sharding == table.sharding
    assert new.carry.inner.z_L.sharding.spec == P(("data", "fsdp"), None, None)
    assert bool(metrics["finite"]) and int(new.step) == 1
    sums = steps.eval(new.params, new.ema_params, batch)
    assert int(sums["steps"]) == 2 * int(sums["count"])  # eval: halt_max_steps steps per row
