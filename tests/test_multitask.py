"""Multi-task training (data.name=multitask): per-task sub-batches and orders, one shared
reasoning core with separate puzzle tables and heads, a run end to end (per-task metrics,
resume), the one-line refusal of shares that do not divide; and generated maze datasets."""

from __future__ import annotations

import shutil
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import SMALL_TRM, compose_config, read_jsonl, train, train_losses
from data_pipeline import maze
from data_pipeline.batching import epoch_permutation
from data_pipeline.puzzle_format import load_split
from runtime.config import register_schemas
from runtime.errors import UserError

register_schemas()

TINY_TRM = SMALL_TRM | dict(heads=2, H_cycles=1, L_cycles=1, halt_max_steps=2, puzzle_emb_len=1)


def cpu_mesh(n: int):
    from runtime.sharding import make_mesh

    return make_mesh({"data": n, "fsdp": 1, "tensor": 1}, jax.devices()[:n])


class FakeSplit:
    """Example i: inputs all `base + i`, label `base + i`, puzzle id i (the PuzzleSplit interface)."""

    def __init__(self, n: int, seq_len: int, base: int):
        self.n, self.base = n, base
        self.metadata = types.SimpleNamespace(vocab_size=base + n, seq_len=seq_len, num_puzzle_identifiers=n)

    def __len__(self):
        return self.n

    def rows(self, idx):
        idx = np.asarray(idx)
        return {"inputs": np.repeat((self.base + idx)[:, None], self.metadata.seq_len, 1).astype(np.int32),
                "labels": np.repeat((self.base + idx)[:, None], self.metadata.seq_len, 1).astype(np.int32),
                "puzzle_identifiers": idx.astype(np.int32)}


# ---------------------------------------------------------------------------- batches


def test_batch_composition_and_per_task_orders():
    from data_pipeline.kinds.multitask import MultiTaskFeeder, MultiTaskSplit, task_seed
    from runtime.sharding import batch_sharding

    def feeder(seed, split=None):
        split = split or MultiTaskSplit({"sudoku": FakeSplit(36, 5, 0), "maze": FakeSplit(20, 7, 1000)},
                                        {"sudoku": 0.75, "maze": 0.25})
        return MultiTaskFeeder(split, batch_sharding(cpu_mesh(4), 1), 16, seed, prefetch=False)

    f = feeder(3)
    assert f.sizes == {"sudoku": 12, "maze": 4}
    batches = [{k: np.asarray(v) for k, v in f.train_batch(s).items()} for s in range(6)]
    b = batches[0]
    assert set(b) == {f"{t}/{k}" for t in ("sudoku", "maze") for k in ("inputs", "labels", "puzzle_identifiers")}
    assert b["sudoku/inputs"].shape == (12, 5) and b["maze/inputs"].shape == (4, 7)
    assert b["sudoku/puzzle_identifiers"].shape == (12,) and b["maze/labels"].shape == (4, 7)
    for batch in batches:  # every row comes from its own dataset, and is consistent across fields
        assert (batch["sudoku/inputs"] < 1000).all() and (batch["maze/inputs"] >= 1000).all()
        np.testing.assert_array_equal(batch["sudoku/inputs"][:, 0], batch["sudoku/puzzle_identifiers"])
        np.testing.assert_array_equal(batch["maze/labels"][:, 0] - 1000, batch["maze/puzzle_identifiers"])

    # Each task walks through its own shuffled epochs: sudoku 3 steps per epoch, maze 5.
    sudoku_ids = np.concatenate([x["sudoku/puzzle_identifiers"] for x in batches])
    maze_ids = np.concatenate([x["maze/puzzle_identifiers"] for x in batches])
    s_seed, m_seed = task_seed(3, "sudoku"), task_seed(3, "maze")
    assert s_seed != m_seed
    np.testing.assert_array_equal(sudoku_ids[:36], epoch_permutation(s_seed, 0, 36))
    np.testing.assert_array_equal(sudoku_ids[36:], epoch_permutation(s_seed, 1, 36))
    np.testing.assert_array_equal(maze_ids[:20], epoch_permutation(m_seed, 0, 20))
    np.testing.assert_array_equal(maze_ids[20:], epoch_permutation(m_seed, 1, 20)[:4])
    assert sorted(sudoku_ids[:36]) == list(range(36)) and sorted(maze_ids[:20]) == list(range(20))
    assert not np.array_equal(sudoku_ids[:36], np.arange(36))  # shuffled

    # Deterministic by seed: a new feeder repeats it (from any step), another seed does not.
    again = feeder(3)
    np.testing.assert_array_equal(np.asarray(again.train_batch(4)["maze/inputs"]), batches[4]["maze/inputs"])
    other = np.concatenate([np.asarray(feeder(4).train_batch(s)["sudoku/puzzle_identifiers"]) for s in range(3)])
    assert not np.array_equal(other, sudoku_ids[:36])


def test_eval_batches_pad_exhausted_tasks():
    from data_pipeline.kinds.multitask import MultiTaskFeeder, MultiTaskSplit
    from runtime.sharding import batch_sharding

    split = MultiTaskSplit({"sudoku": FakeSplit(20, 5, 0), "maze": FakeSplit(10, 7, 1000)}, {"sudoku": 3, "maze": 1})
    f = MultiTaskFeeder(split, batch_sharding(cpu_mesh(4), 1), 16, 0, prefetch=False)
    batches = [{k: np.asarray(v) for k, v in b.items()} for b in f.eval_batches()]
    assert len(batches) == 3  # sudoku: 20 / 12 -> 2 batches, maze: 10 / 4 -> 3
    real = {t: [(b[f"{t}/labels"] != -100).all(-1) for b in batches] for t in ("sudoku", "maze")}
    assert [int(r.sum()) for r in real["sudoku"]] == [12, 8, 0]  # the third is all padding
    assert [int(r.sum()) for r in real["maze"]] == [4, 4, 2]
    for t, n in (("sudoku", 20), ("maze", 10)):
        for b, r in zip(batches, real[t]):
            assert (b[f"{t}/labels"][~r] == -100).all()  # padding rows have no labels at all
        seen = np.concatenate([b[f"{t}/puzzle_identifiers"][r] for b, r in zip(batches, real[t])])
        assert seen.tolist() == list(range(n))  # every eval example once, in order
    capped = list(MultiTaskFeeder(split, batch_sharding(cpu_mesh(4), 1), 16, 0, prefetch=False).eval_batches(4))
    assert len(capped) == 1 and int((np.asarray(capped[0]["sudoku/labels"]) != -100).all(-1).sum()) == 4


# ---------------------------------------------------------------------------- model


def _tiny_task(**arch):
    from models.multitask import MultiTaskACT, TaskSpec
    from models.recursive_reasoning import TRMConfig

    specs = {"sudoku": TaskSpec(vocab_size=11, seq_len=16, num_puzzle_identifiers=8, batch_size=4),
             "maze": TaskSpec(vocab_size=6, seq_len=25, num_puzzle_identifiers=5, batch_size=4)}
    return MultiTaskACT(TRMConfig(**(TINY_TRM | arch)), specs)


def _batch(task, rng):
    ids = {"sudoku": [1, 3, 1, 3], "maze": [0, 2, 2, 4]}
    out = {}
    for t, spec in task.specs.items():
        out[f"{t}/inputs"] = rng.integers(1, spec.vocab_size, (spec.batch_size, spec.seq_len)).astype(np.int32)
        out[f"{t}/labels"] = rng.integers(1, spec.vocab_size, (spec.batch_size, spec.seq_len)).astype(np.int32)
        out[f"{t}/puzzle_identifiers"] = np.array(ids[t], np.int32)
    return out


def test_shared_core_separate_tables_and_gradients():
    import flax.linen as nn
    import optax

    from runtime.optimizers import param_labels

    task = _tiny_task()
    host = _batch(task, np.random.default_rng(0))
    batch = {k: jnp.asarray(v) for k, v in host.items()}
    params = nn.meta.unbox(jax.jit(task.init)(jax.random.key(0), batch))

    # One core, one table and one set of heads per task.
    assert set(params) == {"L_level", "puzzle_emb", "tasks"}
    assert set(params["puzzle_emb"]) == set(params["tasks"]) == {"sudoku", "maze"}
    assert params["puzzle_emb"]["sudoku"].shape == (8, 32) and params["puzzle_emb"]["maze"].shape == (5, 32)
    assert params["tasks"]["sudoku"]["embed_tokens"].shape == (11, 32)
    assert params["tasks"]["maze"]["lm_head"].shape == (32, 6)
    for own in params["tasks"].values():
        assert "L_level" not in own and "puzzle_emb" not in own
    labels = param_labels(params)
    assert labels["puzzle_emb"] == {"sudoku": "puzzle_emb", "maze": "puzzle_emb"}
    assert set(jax.tree.leaves(labels["L_level"])) == set(jax.tree.leaves(labels["tasks"])) == {"main"}

    # The core's gradient is the sum of both tasks' contributions; a task's loss does not reach
    # the other task's heads.
    @jax.jit
    def grads(params, batch):  # of [the multi-task loss, the sudoku part alone, the maze part alone]
        carry, rng, parts = task.init_carry(batch), jax.random.key(1), task.split(batch)

        def part(p, t, i):
            loss = task.acts[t].train_loss(task.task_params(p, t), carry[t], parts[t], jax.random.fold_in(rng, i))[0]
            return loss * task.specs[t].batch_size / task.global_batch

        def losses(p):
            return jnp.stack([task.train_loss(p, carry, batch, rng)[0], part(p, "sudoku", 0), part(p, "maze", 1)])

        return jax.jacrev(losses)(params)

    jac = grads(params, batch)
    total, g_sudoku, g_maze = (jax.tree.map(lambda x, i=i: x[i], jac) for i in range(3))
    summed = jax.tree.map(jnp.add, g_sudoku["L_level"], g_maze["L_level"])
    for a, b in zip(jax.tree.leaves(total["L_level"]), jax.tree.leaves(summed)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert optax.tree.norm(g_sudoku["L_level"]) > 0 and optax.tree.norm(g_maze["L_level"]) > 0
    assert optax.tree.norm(jax.tree.map(jnp.subtract, total["L_level"], g_sudoku["L_level"])) > 0
    assert optax.tree.norm(g_maze["tasks"]["sudoku"]) == 0 and optax.tree.norm(g_maze["puzzle_emb"]["sudoku"]) == 0
    for a, b in zip(jax.tree.leaves(total["tasks"]["maze"]), jax.tree.leaves(g_maze["tasks"]["maze"])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)

    with pytest.raises(UserError, match="mlp_t"):
        _tiny_task(mlp_t=True)


def test_train_step_moves_each_table_by_its_own_ids():
    from jax.sharding import PartitionSpec as P

    from runtime.config import OptimConfig
    from runtime.train_step import abstract_batch, build_steps, lr_schedule, make_optimizer, puzzle_lr_schedule

    task = _tiny_task()
    mesh = cpu_mesh(4)
    optim = OptimConfig(name="adam_atan2", lr=1e-3, ema_rate=0.9, puzzle_emb_lr=0.1, puzzle_emb_weight_decay=0.0)
    schedule = lr_schedule(optim, 10, 1)
    tx = make_optimizer(optim, schedule, puzzle_lr_schedule(optim, 10, 1))
    steps = build_steps(task, tx, schedule, mesh, 0, 0.9, global_batch=8)
    state = steps.init(jax.random.key_data(jax.random.key(0)))
    assert "puzzle_emb" not in state.ema_params and set(state.ema_params) == {"L_level", "tasks"}
    assert state.carry["maze"].inner.z_H.shape == (4, 26, 32)  # per-task carry: prefix 1 + 25 positions
    assert state.carry["sudoku"].halted.sharding.spec == P(("data", "fsdp"))
    example = abstract_batch(mesh, 8, 0, steps.batch_fields, steps.batch_shapes)
    host = _batch(task, np.random.default_rng(0))
    batch = {k: jax.device_put(v, example[k].sharding) for k, v in host.items()}
    core_before = [np.asarray(x) for x in jax.tree.leaves(state.params["L_level"])]  # the state is donated
    new, metrics = steps.train(state, batch)
    assert bool(metrics["finite"])
    moved = {t: set(np.flatnonzero(np.abs(np.asarray(new.params["puzzle_emb"][t])).sum(-1) > 0))
             for t in ("sudoku", "maze")}
    assert moved == {"sudoku": {1, 3}, "maze": {0, 2, 4}}
    core_after = jax.tree.leaves(new.params["L_level"])
    assert all(not np.allclose(a, b) for a, b in zip(core_before, core_after))
    assert set(metrics["sums"]) >= {"sudoku/lm_loss", "maze/lm_loss", "maze/count"}
    summary = steps.summarize(jax.device_get(metrics["sums"]), 8, True)
    assert summary["loss"] == pytest.approx((summary["sudoku/loss"] + summary["maze/loss"]) / 2, rel=1e-5)  # 4 rows each


def test_sign_sgd_takes_ids_per_table():
    from runtime.optimizers import sparse_sign_sgd

    tables = {"puzzle_emb": {"a": jnp.ones((4, 2)), "b": jnp.ones((3, 2))}}
    grads = jax.tree.map(lambda x: -jnp.ones_like(x), tables)
    tx = sparse_sign_sgd(0.5, 0.0)
    upd, _ = tx.update(grads, tx.init(tables), tables, puzzle_identifiers={"a": jnp.array([0, 2]), "b": jnp.array([1])})
    assert np.flatnonzero(np.asarray(upd["puzzle_emb"]["a"])[:, 0]).tolist() == [0, 2]
    assert np.flatnonzero(np.asarray(upd["puzzle_emb"]["b"])[:, 0]).tolist() == [1]
    with pytest.raises(ValueError, match="no puzzle_identifiers"):
        tx.update(grads, tx.init(tables), tables, puzzle_identifiers={"a": jnp.array([0])})


def test_sub_batch_checks():
    from runtime.config import derive
    from runtime.registry import dataset_kind

    def check(*overrides, devices=8):
        config = compose_config(["data=sudoku_maze", "arch=trm_att", *overrides])
        kind = dataset_kind(config.data.name)
        shape = kind.planned_shape(config.data, config)
        plan = derive(config, num_processes=1, num_devices=devices, train_examples=10_000)
        kind.check_plan(config.data, plan, shape)
        return shape.sub_batches(plan.global_batch_size)

    assert check("train.global_batch_size=32") == {"sudoku": 16, "maze": 16}
    assert check("train.global_batch_size=16", "data.tasks.sudoku.batch_fraction=3", "data.tasks.maze.batch_fraction=1",
                 devices=4) == {"sudoku": 12, "maze": 4}
    with pytest.raises(UserError, match="sudoku, maze do not divide over data x fsdp = 8"):
        check("train.global_batch_size=16", "data.tasks.sudoku.batch_fraction=0.75", "data.tasks.maze.batch_fraction=0.25")
    with pytest.raises(UserError, match="whole number"):
        check("train.global_batch_size=15", devices=1)  # 7.5 + 7.5 rows round to 8 + 8
    with pytest.raises(UserError, match="batch_fraction=-1.0 must be > 0"):
        compose_config(["data=sudoku_maze", "data.tasks.maze.batch_fraction=-1"])


# ---------------------------------------------------------------------------- maze datasets


def test_generated_50x50_maze_dataset(tmp_path):
    from runtime.registry import dataset_kind
    from runtime.trainer import ensure_dataset

    def dataset_shape(config):
        s = dataset_kind(config.data.name).planned_shape(config.data, config)
        return s.examples, s.vocab_size, s.seq_len, s.num_puzzle_identifiers

    info = types.SimpleNamespace(is_primary=True, process_count=1)
    config = compose_config(["data=maze_50x50", f"data.path={tmp_path / 'm50'}", "data.generate_puzzles=8",
                      "data.generate_test_puzzles=2", "data.generate_num_aug=0"])
    assert dataset_shape(config)[:4] == (8, maze.VOCAB_SIZE, 2500, 1)  # before it is built
    ensure_dataset(config, info)
    train, test = load_split(str(tmp_path / "m50"), "train"), load_split(str(tmp_path / "m50"), "test")
    assert (len(train), len(test), train.metadata.seq_len, train.metadata.vocab_size) == (8, 2, 2500, 6)
    for split in (train, test):
        for x, y in zip(split.inputs, split.labels):
            question, answer = maze.decode(x.reshape(50, 50)), maze.decode(y.reshape(50, 50))
            assert maze.count_shortest_paths(question) == 1
            np.testing.assert_array_equal(maze.solve(question), answer)  # the label is the unique shortest path
            assert maze.path_length(answer) >= 10
    assert dataset_shape(config)[:4] == (8, 6, 2500, 1)  # from the built set

    aug = compose_config(["data=maze_50x50", f"data.path={tmp_path / 'aug'}", "data.generate_puzzles=2",
                   "data.generate_test_puzzles=1", "data.generate_grid_size=9"])
    assert dataset_shape(aug)[:3] == (16, 6, 81)
    ensure_dataset(aug, info)
    assert len(load_split(str(tmp_path / "aug"), "train")) == 16  # 2 mazes x 8 dihedral images


# ---------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny_sudoku(tmp_path_factory) -> Path:
    from data_pipeline.build_sudoku import build_sudoku_dataset

    root = tmp_path_factory.mktemp("mt") / "sudoku"
    build_sudoku_dataset(root, generate=48, test_size=8, min_givens=30, seed=0)
    return root


def run_overrides(sudoku: Path, maze_dir: Path, root: Path, steps: int, *extra: str) -> list[str]:
    return ["arch=trm_att", "optim=adam_atan2", "data=sudoku_maze", f"data.tasks.sudoku.path={sudoku}",
            f"data.tasks.maze.path={maze_dir}", "data.tasks.maze.generate_if_missing=true",
            "data.tasks.maze.generate_puzzles=24", "data.tasks.maze.generate_test_puzzles=6",
            "data.tasks.maze.generate_grid_size=6", "data.tasks.maze.generate_num_aug=0",
            f"run.root={root}", "run.progress_bar=false", "run.wandb.mode=disabled", "run.group=test", "run.name=t", f"train.steps={steps}",
            "train.log_every=1", "train.checkpoint_every=2", "train.eval_every=4", "train.global_batch_size=16",
            "arch.hidden=32", "arch.heads=2", "arch.L_layers=1", "arch.H_cycles=1", "arch.L_cycles=1",
            "arch.halt_max_steps=2", "arch.puzzle_emb_len=1", "arch.forward_dtype=float32", "optim.lr=3e-3",
            "optim.puzzle_emb_lr=1e-2", "optim.warmup_steps=1", "optim.ema_rate=0.9", *extra]


@pytest.mark.slow
def test_multitask_run_metrics_and_resume(tiny_sudoku, tmp_path):
    overrides = run_overrides(tiny_sudoku, tmp_path / "maze", tmp_path / "out", 4)
    train(overrides)
    assert load_split(str(tmp_path / "maze"), "train").metadata.seq_len == 36  # generated by the trainer
    out = tmp_path / "out" / "test" / "t"
    rows = read_jsonl(out / "metrics.jsonl")
    reference = train_losses(out)
    assert sorted(reference) == [1, 2, 3, 4]
    halted = [r for r in rows if r.get("train/sudoku/count", 0) > 0]
    assert halted and all(r["train/maze/count"] > 0 for r in halted)
    for r in halted:
        for t in ("sudoku", "maze"):
            assert 0 <= r[f"train/{t}/token_accuracy"] <= 1 and np.isfinite(r[f"train/{t}/loss"])
        assert r["train/exact_accuracy"] == pytest.approx((r["train/sudoku/exact_accuracy"] +
                                                           r["train/maze/exact_accuracy"]) / 2)
    ev = [r for r in rows if "eval/exact_accuracy" in r][-1]
    assert ev["step"] == 4
    assert ev["eval/sudoku/count"] == 8 and ev["eval/maze/count"] == 6  # every eval example once, padding nowhere
    assert ev["eval/sudoku/steps"] == ev["eval/maze/steps"] == 2.0
    assert ev["eval/maze/q_halt_loss"] < 1.0  # the 2 padding rows of the maze sub-batch add no loss

    # Resume: drop the final checkpoint, run again to step 4 from the one at step 2: same losses.
    shutil.rmtree(out / "checkpoints" / "4")
    assert "resumed from step 2" in train(overrides).log
    resumed = train_losses(out)
    assert {s: resumed[s] for s in (3, 4)} == pytest.approx({s: reference[s] for s in (3, 4)}, rel=1e-6, abs=1e-7)


def test_shares_that_do_not_divide_fail_before_compile(tiny_sudoku, tmp_path):
    overrides = run_overrides(tiny_sudoku, tmp_path / "maze", tmp_path / "out", 4, "data.tasks.sudoku.batch_fraction=0.75",
                              "data.tasks.maze.batch_fraction=0.25")
    result = train(overrides, check=False)
    assert result.code == 2 and "\n" not in result.error, result.log[-2000:]
    assert "sudoku, maze do not divide over data x fsdp = 8" in result.error and "batch_fraction" in result.error
    assert "compiled" not in result.log
