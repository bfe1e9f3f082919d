"""The global batch order: a pure function of (seed, step, dataset size, global batch).

Every process computes the same order and then reads only its own rows, so the order does
not depend on how many processes there are: a checkpoint written by a 2-process job resumes
in a 1-process job (or 8) on exactly the same batches.
"""

from __future__ import annotations

import numpy as np


def epoch_permutation(seed: int, epoch: int, num_examples: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def global_batch_indices(seed: int, step: int, num_examples: int, global_batch: int) -> np.ndarray:
    """Example indices of global batch `step` (0-based). Each epoch is a fresh permutation;
    the last partial batch of an epoch is dropped."""
    steps_per_epoch = num_examples // global_batch
    epoch, within = divmod(step, steps_per_epoch)
    start = within * global_batch
    return epoch_permutation(seed, epoch, num_examples)[start : start + global_batch]


def eval_batch_indices(num_examples: int, global_batch: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices of eval batch `batch` in dataset order, padded to a full batch; plus a validity mask."""
    return eval_batch_rows(np.arange(num_examples), global_batch, batch)


def eval_batch_rows(rows: np.ndarray, global_batch: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Eval batch `batch` of the rows `rows` (in their order), padded to a full batch with row 0;
    plus a validity mask (False on padding)."""
    idx = rows[batch * global_batch:(batch + 1) * global_batch]
    valid = np.arange(global_batch) < idx.size
    return np.concatenate([idx, np.zeros(global_batch - idx.size, idx.dtype)]), valid


# The seed of the intermediate evaluations' subset: fixed, so every evaluation, every resume and
# every variant with the same eval set evaluates the same units (their differences are paired).
EVAL_SUBSET_SEED = 20260301


def capped_units(unit_offsets: np.ndarray | None, num_examples: int) -> np.ndarray:
    """Row offsets [U + 1] of the eval units within the first `num_examples` rows (the last unit
    cut there); `unit_offsets` None: every row is a unit of its own."""
    if unit_offsets is None:
        return np.arange(num_examples + 1)
    starts = np.asarray(unit_offsets[:-1])
    return np.append(starts[starts < num_examples], num_examples)


def eval_subset_rows(unit_offsets: np.ndarray, subset: int | None, seed: int = EVAL_SUBSET_SEED) -> tuple[np.ndarray, int]:
    """(rows, units) an evaluation reads: `subset` of the units whose rows `unit_offsets` [U + 1]
    delimit, drawn by `seed` and kept whole, in dataset order; all of them when `subset` is None or
    not smaller than U."""
    total = len(unit_offsets) - 1
    if subset is None or subset >= total:
        return np.arange(unit_offsets[0], unit_offsets[-1]), total
    units = np.sort(np.random.default_rng(seed).choice(total, size=subset, replace=False))
    starts, ends = unit_offsets[units], unit_offsets[units + 1]
    lengths = ends - starts
    first = np.concatenate([[0], np.cumsum(lengths)[:-1]])  # where each unit's rows begin in the output
    return np.arange(lengths.sum()) + np.repeat(starts - first, lengths), subset
