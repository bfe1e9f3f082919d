"""The two plug-in registries: dataset kinds (by `data.name`) and model families (by the arch
config's `name`). The runtime looks things up here and never compares names itself.

A plug-in registers itself when its module is imported; `load_plugins()` imports the built-in
ones (the `models` package and `data_pipeline.kinds`), and a test or a user package may
register more at any time before the config is validated.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any, Callable

from runtime.data_feed import BatchFeeder
from runtime.errors import UserError
from runtime.task import DataShape, Evaluator, Task

BUILTIN_PLUGIN_MODULES = ("models", "data_pipeline.kinds")


class DatasetKind:
    """One kind of dataset (sudoku, maze, arc, sft, ...), keyed by `data.name`.

    Subclasses implement `load_split` and `shape`; the other hooks default to "nothing to do".
    `data` is the run's `DataConfig`, `config` the whole run config."""

    name: str = ""
    mixable: bool = False  # may be one task of a mixture (data.name=multitask)

    def validate(self, data: Any) -> None:
        """Config checks of this kind (before anything is read); raise `UserError`."""
        if data.tasks:
            raise UserError(f"data.tasks is set but data.name={data.name!r}; use data.name=multitask (e.g. "
                            "data=sudoku_maze) or drop data.tasks")

    def load_split(self, data: Any, split: str) -> Any:
        """A split object: `len()`, `.metadata`, and the rows the feeders ask for."""
        raise NotImplementedError

    def ensure_built(self, data: Any) -> None:
        """Build a generated set that is missing (local paths, `data.generate_if_missing`), only
        where data_pipeline/marker.py allows; raise `UserError` for a folder that is not one."""

    def preflight(self, data: Any, gcs: Any) -> None:
        """Check what the run will read (train and eval splits) before anything compiles;
        raise `UserError`. `gcs` is the preflight's bounded GCS client."""

    def shape(self, data: Any, train_split: Any) -> DataShape:
        """The shape of a loaded training split."""
        raise NotImplementedError

    def planned_shape(self, data: Any, config: Any) -> DataShape:
        """The shape without the arrays (compile-only planning): from the split's metadata, or
        from the config's sizes when the set is not on this machine."""
        raise UserError(f"compile_only cannot plan data.name={self.name} without its dataset at {data.path}")

    def check_plan(self, data: Any, plan: Any, shape: DataShape) -> None:
        """Checks that need the plan (batch splits over the mesh); raise `UserError`."""

    def make_feeder(self, split: Any, sharding: Any, global_batch: int, seed: int, prefetch: bool = True) -> Any:
        return BatchFeeder(split, sharding, global_batch, seed, prefetch=prefetch)

    def evaluators(self, data: Any, context: Any) -> list[Evaluator]:
        """Extra evaluations of this kind (ARC: voting, pass@k, submission.json)."""
        return []


@dataclass(frozen=True)
class ModelFamily:
    """A model family: its arch config schema and `build_task(arch, shape, **options) -> Task`.

    Options the builder passes: `init_states` (imported recurrent init states or None),
    `exploration` (a traceable step -> halt exploration probability, or None) and
    `global_batch` (for families that split the batch, e.g. a mixture of tasks)."""

    name: str
    schema: type
    build_task: Callable[..., Task]
    validate: Callable[[Any], None] | None = None  # config checks of an arch; raise UserError
    # The arch field naming the compute dtype, where "auto" picks one by platform
    # (runtime/config.resolve_compute_dtype); None: the family has no such setting.
    compute_dtype: str | None = None
    # Arch fields that choose how a step computes, not what (the attention's kernel): a checkpoint
    # resumes under any value of them.
    forms: tuple[str, ...] = ()
    # `check_platform(arch, platform, shape)`: an explicit form the platform's devices cannot run
    # (one `auto` would not choose there) raises UserError, before anything compiles; None: none.
    check_platform: Callable[[Any, str, Any], None] | None = None
    # The arch field naming the pretrained weights a run starts from (read when the config is
    # validated); a run's own checkpoint holds the weights and the arch they determined, so a
    # tool reading that checkpoint (runtime.export) drops it. None: the family has none.
    pretrained: str | None = None


DATASET_KINDS: dict[str, DatasetKind] = {}
MODEL_FAMILIES: dict[str, ModelFamily] = {}


def register_dataset_kind(kind: DatasetKind) -> DatasetKind:
    DATASET_KINDS[kind.name] = kind
    return kind


def register_model_family(family: ModelFamily) -> ModelFamily:
    MODEL_FAMILIES[family.name] = family
    return family


def load_plugins() -> None:
    """Import the built-in plug-ins (each registers itself on import)."""
    for module in BUILTIN_PLUGIN_MODULES:
        importlib.import_module(module)


def dataset_kind(name: str) -> DatasetKind:
    load_plugins()
    if name not in DATASET_KINDS:
        raise UserError(f"data.name={name!r} is not a registered dataset kind; use one of {sorted(DATASET_KINDS)}")
    return DATASET_KINDS[name]


def model_family(name: str) -> ModelFamily:
    load_plugins()
    if name not in MODEL_FAMILIES:
        raise UserError(f"arch.name={name!r} is not a registered model family; use one of {sorted(MODEL_FAMILIES)}")
    return MODEL_FAMILIES[name]


def family_of(arch: Any) -> ModelFamily:
    """The family whose schema `arch` (a validated arch config) is an instance of."""
    load_plugins()
    for family in MODEL_FAMILIES.values():
        if type(arch) is family.schema:
            return family
    raise UserError(f"arch config {type(arch).__name__} belongs to no registered model family")


def family_of_saved(arch: Any) -> ModelFamily:
    """The family of an arch config saved as plain data (a checkpoint's config snapshot): the
    one whose schema has all its keys and the fewest others (a preset's `name` need not be the
    family's; a checkpoint written before a field was added lacks that field)."""
    load_plugins()
    keys = set(arch)
    fields = {name: {f.name for f in dataclasses.fields(f.schema)} for name, f in MODEL_FAMILIES.items()}
    covering = sorted((len(names - keys), name) for name, names in fields.items() if keys <= names)
    if covering:
        return MODEL_FAMILIES[covering[0][1]]
    return model_family(str(arch.get("name")))


def arch_schemas() -> dict[str, type]:
    load_plugins()
    return {name: family.schema for name, family in MODEL_FAMILIES.items()}
