"""One evaluation: the task's loss metrics over the eval set (with the EMA weights when EMA is
on), plus whatever the run's evaluators add (a dataset kind's or a model family's).

An evaluation of the whole eval set (capped by data.eval_max_examples) logs under `eval/`; one of
a subset of its units (train.eval_subset: the intermediate evaluations) under `eval_subset/`, with
the subset's size (`units`, `examples`) and the binomial standard error sqrt(p (1 - p) / n) of
every fraction-of-units metric (exact accuracy, ARC's pass@k; n = the units evaluated). So an
analysis reading `eval/` never mixes a subset's estimate with the whole set's figure.
"""

from __future__ import annotations

import math
import pickle
import re
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from runtime.task import Evaluator

WHOLE, SUBSET = "eval", "eval_subset"  # the metrics' prefixes
BINOMIAL = re.compile(r"(^|/)(exact_accuracy|pass@\d+)$")  # metrics that are a fraction of the units evaluated


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
             beat: Callable[[], None] = lambda: None, subset: int | None = None) -> dict[str, float]:
    """Metrics over the eval set, or over `subset` of its units (see the module docstring).
    Evaluators that want per-row outputs get the task's `eval_outputs` of every batch; every
    evaluator's `finish` adds its metrics."""
    selections = feeder.eval_selections(max_examples, subset)
    prefix = WHOLE if all(s.whole for s in selections.values()) else SUBSET
    for e in evaluators:
        e.start()
    rows_wanted = any(e.wants_rows for e in evaluators)
    totals: dict[str, float] = {}
    rows = 0
    for batch in feeder.eval_batches(max_examples, subset):
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
    metrics = {f"{prefix}/{k}": float(v) for k, v in steps.summarize(totals, rows, False).items()} if totals else {}
    for e in evaluators:
        beat()
        metrics |= {f"{prefix}/{k}": v for k, v in e.finish(state.params).items()}
    if prefix == SUBSET:
        metrics |= subset_figures(metrics, selections)
    return metrics


def binomial_stderr(p: float, n: int) -> float:
    """The standard error of a fraction `p` of `n` independent units: sqrt(p (1 - p) / n)."""
    return math.sqrt(max(p * (1.0 - p), 0.0) / n) if n else float("nan")


def subset_figures(metrics: Mapping[str, Any], selections: Mapping[str, Any]) -> dict[str, float]:
    """A subset evaluation's size and the standard error of each fraction-of-units metric. A
    metric of one set ("<task>/exact_accuracy", or any of a single set's) has its set's units as
    n; a mixture's mean over tasks ("exact_accuracy") the error of a mean of independent ones."""
    units = {key: sel.units for key, sel in selections.items()}
    out: dict[str, float] = {f"{SUBSET}/units": sum(units.values()),
                             f"{SUBSET}/examples": sum(sel.rows.size for sel in selections.values())}
    for key, value in metrics.items():
        name = key[len(SUBSET) + 1:]
        if not BINOMIAL.search(name) or not isinstance(value, (int, float)):
            continue
        head = name.split("/", 1)[0] + "/"
        if "/" in name and head in units:
            error = binomial_stderr(value, units[head])
        elif "" in units:
            error = binomial_stderr(value, units[""])
        else:
            parts = [binomial_stderr(metrics[f"{SUBSET}/{t}{name}"], n) for t, n in units.items()
                     if f"{SUBSET}/{t}{name}" in metrics]
            if not parts:
                continue
            error = math.sqrt(sum(e * e for e in parts)) / len(parts)
        out[f"{key}_stderr"] = error
    return out
