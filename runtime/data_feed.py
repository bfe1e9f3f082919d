"""Feeding global batches: each process materialises only the rows its devices hold.

The order comes from `data_pipeline.batching` (same on every process); this module works
out which rows of the global batch live on this process's devices under the batch sharding,
reads just those rows, and assembles the global array with
`jax.make_array_from_process_local_data`.

Evaluation reads the eval set in order, or for an intermediate evaluation a seeded subset of its
units (`train.eval_subset`): the rows of a unit stay together (a puzzle's augmented copies, which
ARC's voting aggregates). Which rows form a unit the dataset kind says (`units`); by default every
row is one.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping, cast

import jax
import numpy as np
from jax.sharding import NamedSharding

from data_pipeline.batching import capped_units, epoch_permutation, eval_batch_rows, eval_subset_rows
from runtime.task import IGNORE_LABEL


def process_rows(sharding: NamedSharding, global_batch: int) -> np.ndarray:
    """The global-batch rows held by this process's devices, in increasing order.

    On a TPU pod the mesh follows the physical topology, so one host's devices need not hold
    one contiguous block of rows; `jax.make_array_from_process_local_data` takes the rows of
    all local shards concatenated in this order.
    """
    # a NamedSharding gives each of its devices a slice (JAX's None is for devices it leaves out)
    index_map = cast(Mapping[Any, tuple[slice, ...]], sharding.addressable_devices_indices_map((global_batch,)))
    blocks = sorted({(ix[0].start or 0, global_batch if ix[0].stop is None else ix[0].stop) for ix in index_map.values()})
    return np.concatenate([np.arange(a, b) for a, b in blocks])


@dataclass(frozen=True)
class EvalSelection:
    """What one evaluation of one eval set reads."""

    rows: np.ndarray  # the rows, in dataset order
    units: int  # the units (puzzles) they make up
    whole: bool  # every unit of the (capped) eval set


class BatchFeeder:
    """Global batches for training (shuffled by (seed, step)) and eval (in order, padded).

    units: row offsets [U + 1] of the eval set's units (rows of a unit are contiguous); None: each
    row is a unit."""

    def __init__(self, split: Any, sharding: NamedSharding, global_batch: int, seed: int, prefetch: bool = True,
                 units: np.ndarray | None = None):
        self.split = split
        self.unit_offsets = units
        self._selections: dict[tuple[int | None, int | None], EvalSelection] = {}
        self.sharding = sharding
        self.global_batch = global_batch
        self.seed = seed
        self.rows = process_rows(sharding, global_batch)
        self.num_examples = len(split)
        self.steps_per_epoch = self.num_examples // global_batch
        self._pool = ThreadPoolExecutor(1) if prefetch else None
        self._pending: tuple[int, Any] | None = None

    @lru_cache(maxsize=2)
    def _permutation(self, epoch: int) -> np.ndarray:
        return epoch_permutation(self.seed, epoch, self.num_examples)

    def _local_train_rows(self, step: int) -> dict[str, np.ndarray]:
        epoch, within = divmod(step, self.steps_per_epoch)
        idx = self._permutation(epoch)[within * self.global_batch + self.rows]
        order = np.argsort(idx)  # read rows in file order (memory-mapped arrays), then restore the batch order
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        return {f: rows[inverse] for f, rows in self.split.rows(idx[order]).items()}

    def _assemble(self, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        out = {}
        for name, rows in local.items():
            global_shape = (self.global_batch,) + rows.shape[1:]
            sharding = self.sharding if rows.ndim == 1 else NamedSharding(
                self.sharding.mesh, jax.sharding.PartitionSpec(self.sharding.spec[0], *([None] * (rows.ndim - 1))))
            out[name] = jax.make_array_from_process_local_data(sharding, rows, global_shape)
        return out

    def train_batch(self, step: int) -> dict[str, jax.Array]:
        """Global batch number `step` (0-based); reads the next one in the background."""
        if self._pending is not None and self._pending[0] == step:
            local = self._pending[1].result()
        else:
            local = self._local_train_rows(step)
        if self._pool is not None:
            self._pending = (step + 1, self._pool.submit(self._local_train_rows, step + 1))
        return self._assemble(local)

    def eval_selection(self, max_examples: int | None = None, subset: int | None = None) -> EvalSelection:
        """The rows an evaluation reads: the first `max_examples` rows (None: all), or of their units
        a seeded `subset` (None: all), kept whole. The same on every call and every resume."""
        key = (max_examples, subset)
        if key not in self._selections:
            n = self.num_examples if max_examples is None else min(max_examples, self.num_examples)
            offsets = capped_units(self.unit_offsets, n)
            rows, units = eval_subset_rows(offsets, subset)
            self._selections[key] = EvalSelection(rows, units, units == len(offsets) - 1)
        return self._selections[key]

    def eval_selections(self, max_examples: int | None = None, subset: int | None = None) -> dict[str, EvalSelection]:
        """The selection of each eval set by its metrics' prefix ("" here: one set)."""
        return {"": self.eval_selection(max_examples, subset)}

    def eval_count(self, max_examples: int | None = None, subset: int | None = None) -> tuple[int, int]:
        """(examples evaluated, eval batches)."""
        n = self.eval_selection(max_examples, subset).rows.size
        return n, -(-n // self.global_batch)

    def eval_batch(self, rows: np.ndarray, b: int) -> dict[str, jax.Array]:
        """Eval batch `b` of the eval rows `rows`; past their end, a batch of padding only."""
        idx, valid = eval_batch_rows(rows, self.global_batch, b)
        idx, valid = idx[self.rows], valid[self.rows]
        local = self.split.rows(idx)
        local["labels"] = np.where(valid[:, None], local["labels"], IGNORE_LABEL).astype(np.int32)
        return self._assemble(local)

    def eval_batches(self, max_examples: int | None = None, subset: int | None = None):
        """The eval set (`eval_selection`) in order, as padded global batches; rows of padding get
        IGNORE_LABEL so they count nowhere."""
        rows = self.eval_selection(max_examples, subset).rows
        for b in range(-(-rows.size // self.global_batch)):
            yield self.eval_batch(rows, b)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
