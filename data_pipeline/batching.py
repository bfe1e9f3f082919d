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
    idx = np.arange(batch * global_batch, (batch + 1) * global_batch)
    valid = idx < num_examples
    return np.where(valid, idx, 0), valid
