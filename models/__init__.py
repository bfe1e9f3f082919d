"""The model families. Importing this package registers each with the runtime
(`runtime/registry.py`): its arch config schema and its `build_task(arch, shape, **options)`,
which returns a `runtime.task.Task` (what the generic train step needs to know about a family).

Parameters carry logical axis names (flax `with_logical_partitioning`); the runtime maps them
to mesh axes with the rules in `runtime/sharding.py`.

Families: `tiny_transformer` (a stateless test model, softmax CE), `trm` / `hrm` (recursive
reasoning: ACT carry, one optimizer step per ACT step, stablemax CE + Q losses; a mixture of
datasets trains one shared core, models/multitask.py) and `gemma` (supervised fine-tuning on
token sequences, models/gemma/task.py). A new family is one module that calls
`register_model_family(...)`, imported below.
"""

from __future__ import annotations

from typing import Any

from models import tiny_transformer  # noqa: F401  (each module registers its family)
from models.gemma import task as gemma_task  # noqa: F401
from models.recursive_reasoning import task as recursive_task  # noqa: F401
from runtime.registry import family_of
from runtime.task import DataShape, Task


def build_task(arch: Any, shape: DataShape, **options: Any) -> Task:
    """The Task of a validated arch config for a dataset of `shape` (its family's builder)."""
    return family_of(arch).build_task(arch, shape, **options)


__all__ = ["build_task"]
