"""Train steps with and without gradient accumulation from the same start on the same batches
(TRM, Gemma, multi-task TRM), for tests/test_grad_accum.py, in the test process (8 CPU devices).
(On a 2-process pod, through the trainer: the TRM in tests/test_pod.py, Gemma in
tests/test_gemma_training.py.)

SGD on the network (an update proportional to the gradient, so a wrongly scaled gradient shows in
the parameters; Adam's would hide it), sign-SGD on the TRM puzzle table, no halt exploration (its
random draws are per micro-batch), float32 forward passes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
BATCH, STEPS = 16, 3
MESHES = {"trm": {"data": 4, "fsdp": 2, "tensor": 1}, "gemma": {"data": 2, "fsdp": 2, "tensor": 2},
          "multitask": {"data": 2, "fsdp": 2, "tensor": 1}}
# micro-batches of 8 rows over 8 batch devices; of 4 over 4; of 2 + 2 rows (two tasks' sub-batches) over 2
ACCUM = {"trm": 2, "gemma": 4, "multitask": 2}
TOKENS, PUZZLES = 6, 5  # token ids drawn from [1, TOKENS), puzzle ids from [0, PUZZLES)


def _task(family: str):
    """(task, seq_len) of a tiny model of `family`."""
    from helpers import SMALL_TRM
    from runtime.task import DataShape

    trm = SMALL_TRM | dict(heads=2, halt_max_steps=2)
    if family == "trm":
        from models.recursive_reasoning.task import build_task
        from models.recursive_reasoning.trm import TRMConfig

        return build_task(TRMConfig(**trm), DataShape(examples=BATCH, vocab_size=TOKENS, seq_len=16,
                                                      num_puzzle_identifiers=PUZZLES)), 16
    if family == "multitask":
        from models.multitask import MultiTaskACT, TaskSpec
        from models.recursive_reasoning.trm import TRMConfig

        specs = {"a": TaskSpec(TOKENS, 16, PUZZLES, BATCH // 2), "b": TaskSpec(TOKENS + 2, 9, PUZZLES, BATCH // 2)}
        return MultiTaskACT(TRMConfig(**(trm | {"H_cycles": 1, "L_cycles": 1})), specs), 0
    from models.gemma.config import GemmaConfig
    from models.gemma.task import GemmaTask
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "arch" / "gemma_tiny.yaml"))
    raw.pop("defaults")
    return GemmaTask(GemmaConfig(**(raw | {"dtype": "float32", "loss_chunk_size": 64}))), 16


def _batches(shapes: dict[str, tuple[int, ...]]) -> list[dict[str, np.ndarray]]:
    """STEPS batches of these field shapes; labels ignored at random (whole rows too), so
    micro-batches differ in their target-token counts."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(STEPS):
        batch = {}
        for field, shape in shapes.items():
            if field.endswith("puzzle_identifiers"):
                batch[field] = rng.integers(0, PUZZLES, shape, dtype=np.int32)
            elif field.endswith("labels"):
                keep = rng.random(shape) < rng.random((shape[0], 1))  # each row its own share of targets
                batch[field] = np.where(keep, rng.integers(1, TOKENS, shape), -100).astype(np.int32)
            else:
                batch[field] = rng.integers(1, TOKENS, shape, dtype=np.int32)
        out.append(batch)
    return out


def _host_arrays(tree) -> dict[str, np.ndarray]:
    """Every leaf as a numpy array, keyed by its path."""
    import jax

    leaves = jax.tree_util.tree_leaves_with_path(jax.device_get(tree))
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves}


def run(family: str, grad_accum_steps: int) -> dict[str, np.ndarray]:
    """Params, carry and metrics after each of STEPS train steps (keys 'step<i>/...')."""
    import jax
    import optax

    from runtime.optimizers import recursive_optimizer
    from runtime.sharding import make_mesh
    from runtime.train_step import abstract_batch, build_steps

    task, seq_len = _task(family)
    mesh = make_mesh(MESHES[family])
    schedule = optax.constant_schedule(0.5)
    tx = optax.sgd(schedule) if family == "gemma" else recursive_optimizer(optax.sgd(schedule), 0.01, 0.0)
    steps = build_steps(task, tx, schedule, mesh, seq_len, None, global_batch=BATCH, grad_accum_steps=grad_accum_steps)
    example = abstract_batch(mesh, BATCH, seq_len, steps.batch_fields, steps.batch_shapes)
    state = steps.init(jax.random.key_data(jax.random.key(0)))
    out = {}
    for i, host in enumerate(_batches({k: v.shape for k, v in example.items()}), start=1):
        batch = {k: jax.make_array_from_callback(v.shape, example[k].sharding, lambda idx, v=v: v[idx])
                 for k, v in host.items()}
        state, metrics = steps.train(state, batch)
        parts = {"params": state.params, "carry": state.carry, "sums": metrics["sums"], "grad_norm": metrics["grad_norm"]}
        out |= {f"step{i}/{name}{key}": value for name, tree in parts.items() for key, value in _host_arrays(tree).items()}
    return out
