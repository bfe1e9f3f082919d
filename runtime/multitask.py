"""Multi-task runs (data.name=multitask): several puzzle datasets in every global batch.

* `load_multitask_split`: each task's split (data.tasks.<task>.path), as one `MultiTaskSplit`;
* `sub_batches`: rows of each task per global batch, ``round(fraction * global_batch / sum)``;
  `check_sub_batches` refuses (one line, before any compile) shares that do not add up to the
  global batch, do not divide over the batch shards (data x fsdp), or exceed a task's data;
* `task_seed`: each task's shuffling seed (its order depends on the run's seed and its name only);
* `build_multitask_task`: the `models.multitask.MultiTaskACT` for a plan.

Feeding is `runtime.data_feed.MultiTaskFeeder`; the model is `models/multitask.py`.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from runtime.config import Config, Plan, task_data_configs
from runtime.errors import UserError


@dataclass(frozen=True)
class TaskShape:
    """What planning needs of one task's training set."""

    examples: int
    vocab_size: int
    seq_len: int
    num_puzzle_identifiers: int


@dataclass(frozen=True)
class MultiTaskMetadata:
    """The few fields the trainer reads of a split's metadata, for the whole mixture."""

    vocab_size: int  # largest of the tasks'
    seq_len: int  # mean tokens per row of a global batch (throughput figures)
    num_puzzle_identifiers: int  # all tables' rows
    packed: bool = False


class MultiTaskSplit:
    """One split of every task: ``splits[task]`` is that task's `PuzzleSplit`."""

    def __init__(self, splits: Mapping[str, Any], fractions: Mapping[str, float],
                 eval_caps: Mapping[str, int | None] | None = None):
        self.splits = dict(splits)
        self.eval_caps = dict(eval_caps or {})  # per-task eval_max_examples (None = the run's)
        self.fractions = {t: float(fractions[t]) for t in self.splits}
        total = sum(self.fractions.values())
        metas = {t: s.metadata for t, s in self.splits.items()}
        self.metadata = MultiTaskMetadata(
            vocab_size=max(m.vocab_size for m in metas.values()),
            seq_len=round(sum(self.fractions[t] * m.seq_len for t, m in metas.items()) / total),
            num_puzzle_identifiers=sum(m.num_puzzle_identifiers for m in metas.values()))

    def __len__(self) -> int:
        return sum(len(s) for s in self.splits.values())

    def task_shapes(self) -> dict[str, TaskShape]:
        return {t: TaskShape(len(s), s.metadata.vocab_size, s.metadata.seq_len, s.metadata.num_puzzle_identifiers)
                for t, s in self.splits.items()}


def fractions(config: Config) -> dict[str, float]:
    return {t: float(c.batch_fraction) for t, c in config.data.tasks.items()}


def load_multitask_split(config: Config, split: str) -> MultiTaskSplit:
    from data_pipeline.puzzle_format import load_split

    tasks = task_data_configs(config.data)
    return MultiTaskSplit({t: load_split(d.path, split) for t, d in tasks.items()}, fractions(config),
                          {t: config.data.tasks[t].eval_max_examples for t in tasks})


def sub_batches(task_fractions: Mapping[str, float], global_batch: int) -> dict[str, int]:
    """Rows of each task in a global batch: round(fraction * global_batch / sum of fractions)."""
    total = sum(task_fractions.values())
    return {t: round(f * global_batch / total) for t, f in task_fractions.items()}


def task_seed(seed: int, task: str) -> int:
    """The shuffling seed of one task's training order (independent of the other tasks)."""
    return int(np.random.SeedSequence([seed, zlib.crc32(task.encode())]).generate_state(1)[0])


def check_sub_batches(config: Config, plan: Plan, shapes: Mapping[str, TaskShape] | None = None) -> dict[str, int]:
    """Each task's rows per global batch, or a one-line UserError naming the fix."""
    gb = plan.global_batch_size
    shards = plan.mesh_shape["data"] * plan.mesh_shape["fsdp"]
    sizes = sub_batches(fractions(config), gb)
    shown = ", ".join(f"{t}={n}" for t, n in sizes.items())
    if sum(sizes.values()) != gb:
        raise UserError(f"data.tasks batch fractions split train.global_batch_size={gb} into {shown} rows, "
                        f"{sum(sizes.values())} in all; choose data.tasks.<task>.batch_fraction values (or a global "
                        f"batch) for which each task's share fraction / sum x {gb} is a whole number")
    bad = [t for t, n in sizes.items() if n <= 0 or n % shards]
    if bad:
        raise UserError(f"data.tasks sub-batches {shown} of train.global_batch_size={gb}: {', '.join(bad)} "
                        f"{'does' if len(bad) == 1 else 'do'} not divide over data x fsdp = {shards} devices; choose "
                        f"data.tasks.<task>.batch_fraction (or train.global_batch_size) so that every task's share is a "
                        f"positive multiple of {shards}")
    for t, n in sizes.items():
        if shapes is not None and shapes[t].examples < n:
            raise UserError(f"data.tasks.{t} has {shapes[t].examples} training examples, fewer than its {n} rows per "
                            "global batch; lower its batch_fraction or train.global_batch_size, or use more data")
    return sizes


def build_multitask_task(config: Config, plan: Plan, shapes: Mapping[str, TaskShape] | None, arch: Any = None,
                         init_states: Any = None, exploration: Any = None):
    """The MultiTaskACT of this run (after `check_sub_batches`); `arch` defaults to config.arch
    (a curriculum stage passes its own)."""
    if shapes is None:
        raise ValueError("a multi-task plan needs each task's dataset shape (tasks=)")
    from models.multitask import MultiTaskACT, TaskSpec

    if set(shapes) != set(config.data.tasks):
        raise UserError(f"dataset shapes for tasks {sorted(shapes)} but data.tasks has {sorted(config.data.tasks)}")
    sizes = check_sub_batches(config, plan, shapes)
    specs = {t: TaskSpec(vocab_size=shapes[t].vocab_size, seq_len=shapes[t].seq_len,
                         num_puzzle_identifiers=shapes[t].num_puzzle_identifiers, batch_size=sizes[t])
             for t in config.data.tasks}
    return MultiTaskACT(config.arch if arch is None else arch, specs, init_states=init_states, exploration=exploration)
