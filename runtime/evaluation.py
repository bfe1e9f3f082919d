"""One evaluation: the task's loss metrics over the eval set (with the EMA weights when EMA is
on), plus whatever the run's evaluators add (a dataset kind's or a model family's)."""

from __future__ import annotations

import pickle
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from runtime.task import Evaluator


def local_rows(arrays: dict[str, jax.Array]) -> dict[str, np.ndarray]:
    """This process's rows of batch-sharded global arrays, in row order (replicas counted once)."""
    out = {}
    for name, arr in arrays.items():
        shards = {(s.index[0].start or 0): s.data for s in arr.addressable_shards}
        out[name] = np.concatenate([np.asarray(shards[k]) for k in sorted(shards)])
    return out


def gather_objects(obj: Any) -> list[Any]:
    """`obj` from every process (pickled through a uint8 all-gather), in process order."""
    if jax.process_count() == 1:
        return [obj]
    data = np.frombuffer(pickle.dumps(obj), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int64))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:data.size] = data
    everything = np.asarray(multihost_utils.process_allgather(padded))
    return [pickle.loads(everything[i, :int(n)].tobytes()) for i, n in enumerate(sizes)]


def evaluate(steps, state, feeder, max_examples: int | None, evaluators: Sequence[Evaluator] = (),
             beat: Callable[[], None] = lambda: None) -> dict[str, float]:
    """`eval/`-prefixed metrics over the eval set. Evaluators that want per-row outputs get the
    task's `eval_outputs` of every batch; every evaluator's `finish` adds its metrics."""
    for e in evaluators:
        e.start()
    rows_wanted = any(e.wants_rows for e in evaluators)
    totals: dict[str, float] = {}
    rows = 0
    for batch in feeder.eval_batches(max_examples):
        beat()
        rows += feeder.global_batch
        outputs = None
        if rows_wanted:
            sums, outputs = steps.eval_rows(state.params, state.ema_params, batch)
        else:
            sums = steps.eval(state.params, state.ema_params, batch)
        for e in evaluators:
            e.update(batch, outputs if e.wants_rows else None)
        for k, v in jax.device_get(sums).items():
            totals[k] = totals.get(k, 0) + float(v)
    metrics = {f"eval/{k}": float(v) for k, v in steps.summarize(totals, rows, False).items()} if totals else {}
    for e in evaluators:
        beat()
        metrics |= {f"eval/{k}": v for k, v in e.finish(state.params).items()}
    return metrics
