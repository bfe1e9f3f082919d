"""data.name=multitask: several puzzle datasets in every global batch (data.tasks.<task>), one
shared reasoning core (models/multitask.py).

* each task's rows per global batch: ``round(fraction * global_batch / sum)``
  (`DataShape.sub_batches`); `check_plan` refuses (one line, before any compile) shares that do
  not add up to the global batch, do not divide over the batch shards, or exceed a task's data;
* each task's shuffling seed depends on the run's seed and its name only (`task_seed`);
* `MultiTaskFeeder`: one `BatchFeeder` per task, keys prefixed ``<task>/``.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Mapping

import jax
import numpy as np

from data_pipeline.kinds.puzzle import unit_offsets
from runtime.config import DataConfig, TaskDataConfig
from runtime.data_feed import BatchFeeder, EvalSelection
from runtime.errors import UserError
from runtime.registry import DATASET_KINDS, DatasetKind, dataset_kind, register_dataset_kind
from runtime.task import DataShape, sub_batches


def task_data_configs(data: Any) -> dict[str, DataConfig]:
    """Each task as a single-dataset DataConfig (its path, builder arguments and eval cap;
    splits from `data`), in data.tasks order."""
    out = {}
    for key, task in data.tasks.items():
        fields = {f.name: getattr(task, f.name) for f in dataclasses.fields(TaskDataConfig)
                  if f.name not in ("batch_fraction", "eval_max_examples")}
        eval_max = task.eval_max_examples if task.eval_max_examples is not None else data.eval_max_examples
        out[key] = DataConfig(**fields, train_split=data.train_split, eval_split=data.eval_split,
                              eval_max_examples=eval_max)
    return out


# A task's setting named in its kind's messages (data.generate_grid_size, data.regenerate=true,
# data.generate_* values), not inside a path.
_TASK_SETTING = re.compile(r"(?<![\w/.-])data\.(?=(?:%s)(?!\w))" % "|".join(
    [f.name for f in dataclasses.fields(TaskDataConfig)] + [r"generate_\*"]))


@contextmanager
def as_task(task: str):
    """A task's one-line errors name its own settings (data.tasks.<task>.regenerate=true), which
    are what the user sets: the task's kind sees a plain DataConfig and says data.regenerate."""
    try:
        yield
    except UserError as e:
        e.args = (_TASK_SETTING.sub(f"data.tasks.{task}.", str(e)),)
        raise


def task_seed(seed: int, task: str) -> int:
    """The shuffling seed of one task's training order (independent of the other tasks)."""
    return int(np.random.SeedSequence([seed, zlib.crc32(task.encode())]).generate_state(1)[0])


@dataclass(frozen=True)
class MultiTaskMetadata:
    """The few fields a run reads of a split's metadata, for the whole mixture."""

    vocab_size: int  # largest of the tasks'
    seq_len: int  # mean tokens per row of a global batch (throughput figures)
    num_puzzle_identifiers: int  # all tables' rows


class MultiTaskSplit:
    """One split of every task: ``splits[task]`` is that task's split."""

    def __init__(self, splits: Mapping[str, Any], fractions: Mapping[str, float],
                 eval_caps: Mapping[str, int | None] | None = None, units: Mapping[str, np.ndarray] | None = None):
        self.splits = dict(splits)
        self.eval_caps = dict(eval_caps or {})  # per-task eval_max_examples (None = the run's)
        self.units = dict(units or {})  # per-task row offsets of its eval units (absent: each row is one)
        self.fractions = {t: float(fractions[t]) for t in self.splits}
        total = sum(self.fractions.values())
        metas = {t: s.metadata for t, s in self.splits.items()}
        self.metadata = MultiTaskMetadata(
            vocab_size=max(m.vocab_size for m in metas.values()),
            seq_len=round(sum(self.fractions[t] * m.seq_len for t, m in metas.items()) / total),
            num_puzzle_identifiers=sum(m.num_puzzle_identifiers for m in metas.values()))

    def __len__(self) -> int:
        return sum(len(s) for s in self.splits.values())


class MultiTaskFeeder:
    """Global batches of a mixture: one `BatchFeeder` per task with its sub-batch rows and its
    own shuffled order, keys prefixed ``<task>/``.

    Eval: batch b holds batch b of every task's eval set; a task whose set is exhausted fills
    its rows with padding (ignored labels, counted nowhere), so every batch has the same fields.
    `max_examples` caps each task's eval set (a task's own cap, ``split.eval_caps[task]``, wins);
    `subset` takes that many of each task's puzzles (its augmented copies together).
    """

    def __init__(self, split: MultiTaskSplit, sharding: Any, global_batch: int, seed: int, prefetch: bool = True):
        self.split = split
        self.global_batch = global_batch
        self.seed = seed
        self.sizes = sub_batches(split.fractions, global_batch)
        if sum(self.sizes.values()) != global_batch:
            raise ValueError(f"sub-batches {self.sizes} do not add up to the global batch {global_batch}")
        self.feeders = {t: BatchFeeder(s, sharding, self.sizes[t], task_seed(seed, t), prefetch, units=split.units.get(t))
                        for t, s in split.splits.items()}
        self.eval_caps = dict(split.eval_caps)
        self.num_examples = len(split)

    def train_batch(self, step: int) -> dict[str, jax.Array]:
        out = {}
        for t, feeder in self.feeders.items():
            out |= {f"{t}/{k}": v for k, v in feeder.train_batch(step).items()}
        return out

    def eval_selections(self, max_examples: int | None = None, subset: int | None = None) -> dict[str, EvalSelection]:
        """Each task's eval selection, by its metrics' prefix ("<task>/")."""
        out = {}
        for t, feeder in self.feeders.items():
            cap = self.eval_caps.get(t)
            out[f"{t}/"] = feeder.eval_selection(cap if cap is not None else max_examples, subset)
        return out

    def eval_batches(self, max_examples: int | None = None, subset: int | None = None):
        rows = {t: sel.rows for t, sel in zip(self.feeders, self.eval_selections(max_examples, subset).values())}
        batches = max((-(-r.size // self.feeders[t].global_batch) for t, r in rows.items()), default=0)
        for b in range(batches):
            out = {}
            for t, feeder in self.feeders.items():
                out |= {f"{t}/{k}": v for k, v in feeder.eval_batch(rows[t], b).items()}
            yield out

    def close(self) -> None:
        for feeder in self.feeders.values():
            feeder.close()


def _mixture(tasks: Mapping[str, DataShape], source: str) -> DataShape:
    """The mixture's shape from its tasks' shapes (each with its batch_fraction)."""
    total = sum(s.batch_fraction for s in tasks.values())
    return DataShape(examples=sum(s.examples for s in tasks.values()),
                     vocab_size=max(s.vocab_size for s in tasks.values()),
                     seq_len=round(sum(s.batch_fraction * s.seq_len for s in tasks.values()) / total),
                     num_puzzle_identifiers=sum(s.num_puzzle_identifiers for s in tasks.values()),
                     epoch_examples=sum(s.epoch_examples or s.examples for s in tasks.values()),
                     source=source, tasks=dict(tasks), examples_exact=all(s.examples_exact for s in tasks.values()))


class MultiTaskKind(DatasetKind):
    name = "multitask"

    def validate(self, data: Any) -> None:
        """data.tasks is set, its names are sane, each task's kind can be mixed, fractions > 0."""
        if not data.tasks:
            raise UserError("data.name=multitask needs data.tasks (e.g. data=sudoku_maze)")
        for key, task in data.tasks.items():
            if not key or "/" in key:
                raise UserError(f"data.tasks key {key!r}: task names cannot be empty or hold '/'")
            if not dataset_kind(task.name).mixable:
                raise UserError(f"data.tasks.{key}.name={task.name!r} cannot be a task of a mixture; use one of "
                                f"{sorted(n for n, k in DATASET_KINDS.items() if k.mixable)}")
            if not task.batch_fraction > 0:
                raise UserError(f"data.tasks.{key}.batch_fraction={task.batch_fraction} must be > 0")

    def _each(self, data: Any):
        return {t: (dataset_kind(d.name), d) for t, d in task_data_configs(data).items()}

    def load_split(self, data: Any, split: str) -> MultiTaskSplit:
        splits = {t: kind.load_split(d, split) for t, (kind, d) in self._each(data).items()}
        # every mixable kind is a puzzle kind: its eval units are puzzles with their augmented copies
        return MultiTaskSplit(splits, {t: c.batch_fraction for t, c in data.tasks.items()},
                              {t: c.eval_max_examples for t, c in data.tasks.items()},
                              {t: unit_offsets(s) for t, s in splits.items()})

    def shape(self, data: Any, train_split: MultiTaskSplit) -> DataShape:
        tasks = {t: dataclasses.replace(kind.shape(d, train_split.splits[t]), batch_fraction=data.tasks[t].batch_fraction)
                 for t, (kind, d) in self._each(data).items()}
        return _mixture(tasks, f"{len(tasks)} tasks")

    def planned_shape(self, data: Any, config: Any) -> DataShape:
        tasks = {t: dataclasses.replace(kind.planned_shape(d, config), batch_fraction=data.tasks[t].batch_fraction)
                 for t, (kind, d) in self._each(data).items()}
        return _mixture(tasks, f"{len(tasks)} tasks: " + ", ".join(f"{t} seq_len {s.seq_len}" for t, s in tasks.items()))

    def ensure_built(self, data: Any) -> None:
        for t, (kind, d) in self._each(data).items():
            with as_task(t):
                kind.ensure_built(d)

    def preflight(self, data: Any, gcs: Any) -> None:
        for t, (kind, d) in self._each(data).items():
            with as_task(t):
                kind.preflight(d, gcs)

    def check_plan(self, data: Any, plan: Any, shape: DataShape) -> None:
        """Each task's rows per global batch add up, divide over the batch shards and fit its data."""
        gb = plan.global_batch_size
        shards = plan.batch_shards
        sizes = shape.sub_batches(gb)
        shown = ", ".join(f"{t}={n}" for t, n in sizes.items())
        if sum(sizes.values()) != gb:
            raise UserError(f"data.tasks batch fractions split train.global_batch_size={gb} into {shown} rows, "
                            f"{sum(sizes.values())} in all; choose data.tasks.<task>.batch_fraction values (or a global "
                            f"batch) for which each task's share fraction / sum x {gb} is a whole number")
        bad = [t for t, n in sizes.items() if n <= 0 or n % shards]
        if bad:
            raise UserError(f"data.tasks sub-batches {shown} of train.global_batch_size={gb}: {', '.join(bad)} "
                            f"{'does' if len(bad) == 1 else 'do'} not divide over data x fsdp = {shards} devices; choose "
                            f"data.tasks.<task>.batch_fraction (or train.global_batch_size) so that every task's share is "
                            f"a positive multiple of {shards}")
        if plan.eval_batch_size != gb:
            raise UserError(f"train.eval_batch_size={plan.eval_batch_size}: a mixture evaluates at its global batch "
                            f"(its tasks' sub-batches are built for {gb}); use train.eval_batch_size=null")
        for t, n in sizes.items():
            if shape.tasks[t].examples < n:
                raise UserError(f"data.tasks.{t} has {shape.tasks[t].examples} training examples, fewer than its {n} "
                                "rows per global batch; lower its batch_fraction or train.global_batch_size, or use "
                                "more data")

    def make_feeder(self, split: Any, sharding: Any, global_batch: int, seed: int, prefetch: bool = True) -> Any:
        return MultiTaskFeeder(split, sharding, global_batch, seed, prefetch)

    def evaluators(self, data: Any, context: Any) -> list:
        return []


register_dataset_kind(MultiTaskKind())
