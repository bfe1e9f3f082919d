"""Typed run configuration: the schema Hydra composes into, validation, and derived numbers.

The flow is one-directional: Hydra composes `conf/` + overrides into a DictConfig; `validate`
merges it into the structured schema below (unknown keys and wrong types fail here, as one
line), converts it to dataclass instances and freezes them. `derive` then computes every
number that depends on the config and the machine (batch per process, total steps, schedule,
paths) in one place; the trainer only reads these two objects.

Sections: `arch`, `data`, `optim`, `mesh`, `run` are Hydra groups; `train` (when things
happen) and `distributed` (how processes join) are set by overrides or experiments. Every
default lives here (arch defaults in the models' schemas); conf/<group>/*.yaml hold only what
each option changes.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import logging
import math
import operator
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Optional, cast

import jax.numpy as jnp
import numpy as np
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from runtime.errors import UserError, one_line
from runtime.registry import arch_schemas, dataset_kind, family_of
from runtime.run_ids import RUN_ID
from runtime.task import AUTO_DTYPE, platform_compute_dtype
from runtime.frozen import Freezable, freeze
from runtime.grad_accum import micro_batch_error
from runtime.metrics_sinks import WandbConsole, WandbMode
from runtime.optimizers import OPTIMIZERS
from runtime.ranges import INT32_MAX, Rule, name_problem, range_problem
from runtime.ranges import above as _above
from runtime.ranges import at_least as _at_least
from runtime.ranges import within as _within


@dataclass
class TaskDataConfig(Freezable):
    """One dataset of a multi-task run (data.name=multitask, data.tasks.<task>): its own puzzle
    table and heads, the reasoning core shared (models/multitask.py). Splits come from data.*."""

    name: str = MISSING  # a dataset kind that can be mixed: sudoku | maze | arc
    path: str = MISSING
    batch_fraction: float = 1.0  # share of each global batch: fraction / sum of fractions
    eval_max_examples: Optional[int] = None  # None = data.eval_max_examples
    # As in DataConfig: what the dataset is, and a missing local path is built from these.
    generate_if_missing: bool = False
    generate_puzzles: int = 1000
    generate_test_puzzles: int = 200
    generate_num_aug: int = 0
    generate_min_givens: int = 30
    generate_grid_size: Optional[int] = None
    generate_seed: int = 0
    regenerate: bool = False


@dataclass
class DataConfig(Freezable):
    name: str = MISSING  # a registered dataset kind (data_pipeline/kinds/): sudoku | maze | arc | sft | multitask
    path: str = MISSING  # dataset root, local path or gs://bucket/prefix
    train_split: str = "train"
    eval_split: str = "test"
    eval_max_examples: Optional[int] = None  # cap the eval set (None = all of it)
    # What the dataset is (the builder's arguments; data configs name `path` after them):
    # training puzzles (--subsample-size / --generate), augmentations per puzzle (--num-aug),
    # held-out puzzles, Sudoku givens, maze side. With generate_if_missing, a missing local
    # `path` is built from these (demos, CI, scaled-down runs); on a pod, build it beforehand.
    # Only into a folder that does not exist, is empty or holds an earlier generated build (its
    # .podrunner-generated marker, data_pipeline/marker.py): any other folder is never written.
    generate_if_missing: bool = False
    generate_puzzles: int = 1000
    generate_test_puzzles: int = 200
    generate_num_aug: int = 0
    generate_min_givens: int = 30
    generate_grid_size: Optional[int] = None  # maze side (None = the builder's 30)
    generate_seed: int = 0
    # A generated set at `path` is used only when its marker's parameters equal these; otherwise
    # the run stops with one line naming the difference, and regenerate=true replaces it.
    regenerate: bool = False
    # SFT (name=sft): token length of a generated set (and of compile-only plans without data);
    # the tokenizer (default <path>/tokenizer.model); greedy-generation eval on the first N prompts.
    seq_len: int = 128
    tokenizer: Optional[str] = None
    eval_generate_examples: int = 0
    eval_max_new_tokens: int = 64
    # name=multitask: the datasets trained together (path is then unused), e.g. conf/data/sudoku_maze.yaml
    tasks: dict[str, TaskDataConfig] = field(default_factory=dict)


class StateDtype(StrEnum):
    """optim.state_dtype: how the optimizer's moments are stored (bf16 halves them)."""

    float32 = "float32"
    bfloat16 = "bfloat16"


class DistributedMode(StrEnum):
    """distributed.mode: how the processes of a job find each other (runtime/distributed.py)."""

    auto = "auto"  # JAX cluster detection on a TPU VM, explicit values as the fallback, else single
    single = "single"  # one process, no coordinator
    cluster = "cluster"  # JAX's cluster detection only
    explicit = "explicit"  # coordinator_address, num_processes, process_id (config or JAX_* environment)


@dataclass
class OptimConfig(Freezable):
    name: str = "adamw"  # a key of runtime.optimizers.OPTIMIZERS (the network; a puzzle table always gets sign-SGD)
    lr: float = 1e-3
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 20  # linear warmup from step 1, then cosine to lr * lr_min_ratio
    lr_min_ratio: float = 0.1  # 1.0 = constant after warmup
    grad_clip_norm: Optional[float] = None
    ema_rate: Optional[float] = None  # EMA of params, e.g. 0.999; None = off
    state_dtype: StateDtype = StateDtype.float32
    # Sparse sign-SGD on the puzzle-embedding table (models with one: TRM, HRM); same schedule shape.
    puzzle_emb_lr: float = 1e-2
    puzzle_emb_weight_decay: float = 0.1


@dataclass
class MeshConfig(Freezable):
    # Device-mesh axis sizes; exactly one may be -1 (= the remaining devices).
    data: int = -1
    fsdp: int = 1
    tensor: int = 1


@dataclass
class WandbConfig(Freezable):
    mode: WandbMode = WandbMode.offline
    project: str = "podrunner"
    entity: Optional[str] = None
    tags: list[str] = field(default_factory=list)
    # Process 0's run only: host and accelerator utilisation charts (W&B's system monitor), and
    # its stdout/stderr in the run's Logs (wrap | off; see runtime.metrics_sinks.WandbConsole).
    system_metrics: bool = True
    console: WandbConsole = WandbConsole.wrap


@dataclass
class CheckpointConfig(Freezable):
    dir: Optional[str] = None  # local path or gs://bucket/prefix; None = <output_dir>/checkpoints
    keep: int = 3  # newest N kept (>= 1: older ones are deleted as new ones are saved)
    async_save: bool = True
    resume: bool = True  # resume from the latest complete step found in `dir`


@dataclass
class LeaseConfig(Freezable):
    """The run directory lease (runtime/lease.py): one writer per run directory."""

    renew_every_s: float = 30.0  # the holder's heartbeat
    stale_after_s: float = 90.0  # a lease not renewed for this long is taken over (a crashed holder)


@dataclass
class RunConfig(Freezable):
    # Where things go. group/name default to the +experiment=<group>/<variant> choice.
    group: Optional[str] = None
    name: Optional[str] = None
    id: Optional[str] = None  # W&B run id; must match the checkpoint's when resuming; None = the checkpoint's, else a new one
    root: str = "outputs"  # local root for metrics.jsonl, W&B files, manifest
    wandb: WandbConfig = field(default_factory=WandbConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    lease: LeaseConfig = field(default_factory=LeaseConfig)
    progress_bar: bool = True
    # JAX's persistent compilation cache (runtime/compile_cache.py): "auto" = the process's own
    # (JAX_COMPILATION_CACHE_DIR) if it has one, else gs://<bucket>/compile_cache when the checkpoints
    # are on gs://, else <run.root>/compile_cache; a folder (local or gs://bucket/prefix); null = off.
    compile_cache: Optional[str] = "auto"
    # Steps compiled ahead for this slice (`launch.py plan --executables FOLDER`, runtime/executables.py):
    # a folder (local or gs://bucket/prefix) a run reads its train and eval steps from instead of
    # compiling them, where one of the same program is there; null = compile them.
    executables: Optional[str] = None
    # The sha256 of the plan's manifest of that folder (`sha256:...`, which the plan prints and writes
    # in its CSV): only files it vouches for are loaded (runtime/executables.py). Needed with executables.
    executables_digest: Optional[str] = None


@dataclass
class TrainConfig(Freezable):
    # When things happen.
    # Ranges are checked by `validate` (_RULES below); cadences are in optimizer steps.
    seed: int = 0  # >= 0
    global_batch_size: int = 64  # >= 1
    # Micro-batches per optimizer step (>= 1): the gradient of the global batch is summed over
    # this many slices of it, one at a time, so activations take 1/k of the memory; the update
    # is the full batch's. The micro-batch (global / k) must divide over the data x fsdp devices.
    grad_accum_steps: int = 1
    steps: Optional[int] = 200  # total optimizer steps (> 0); or give epochs (> 0) and steps=null
    epochs: Optional[float] = None
    log_every: int = 20  # >= 1 (the last step is always logged)
    eval_every: int = 100  # >= 0; 0 = only at the end
    checkpoint_every: int = 100  # >= 0; 0 = only at the end
    # Also save when this many minutes have passed since the last save (> 0; null = off), decided
    # by process 0's clock at log rows and agreed by all processes (Young's rule: docs/BILL.md).
    checkpoint_every_minutes: Optional[float] = None
    # The same cadences in epochs (the reference's eval_interval); when set they replace the
    # above (>= 0; 0 = only at the end, as for the step forms).
    eval_every_epochs: Optional[float] = None
    checkpoint_every_epochs: Optional[float] = None
    # Intermediate evaluations run on this many units of the eval set (puzzles: a puzzle's augmented
    # copies stay together), the same seeded subset every time and on every resume, and log under
    # eval_subset/ with the subset's size and exact_accuracy's standard error; the last evaluation
    # (and eval_only) is always the whole set, under eval/. >= 1; null = the whole set every time
    # (the reference's protocol).
    eval_subset: Optional[int] = 8192
    # Rows per eval batch (a multiple of data x fsdp and of the processes); null = the global batch.
    # Evaluation is forward only, so it usually fits a larger batch than training.
    eval_batch_size: Optional[int] = None
    profile_start_step: Optional[int] = None  # jax.profiler trace window (>= 0; None = no trace)
    profile_steps: int = 5  # >= 1
    # No step for this long (compile excluded) = a dead or hung worker: dump stacks, exit 4.
    # >= 0; 0 = no watchdog.
    watchdog_timeout_s: float = 1800.0
    # A fresh run starts from these parameters instead of a random init: a directory written by
    # `python -m models.recursive_reasoning.import_reference` (params/, init_states/), local or
    # gs://. Ignored when resuming (the checkpoint has the parameters).
    init_params_from: Optional[str] = None
    eval_only: bool = False  # evaluate the starting parameters (init_params_from or the latest checkpoint), exit


@dataclass
class RampConfig(Freezable):
    """A value that moves from `start` to `end` over the first `fraction` of training, then holds.
    Integer quantities (cycle counts) take the floor, so each value between gets an equal share."""

    start: Optional[float] = None  # None (with end None) = no ramp: the arch's value throughout
    end: Optional[float] = None
    fraction: float = 1.0  # of the run's total steps
    shape: str = "linear"  # linear | cosine

    @property
    def on(self) -> bool:
        return self.start is not None


@dataclass
class CurriculumConfig(Freezable):
    # Values that change during training, e.g. curriculum.L_cycles={start: 2, end: 6, fraction: 0.2}
    # (start null = the arch's value throughout). Each distinct (H_cycles, L_cycles) pair is its
    # own compiled train step, built when first reached.
    H_cycles: RampConfig = field(default_factory=RampConfig)
    L_cycles: RampConfig = field(default_factory=RampConfig)
    halt_exploration_prob: RampConfig = field(default_factory=RampConfig)  # traced: no recompiles


@dataclass
class DistributedConfig(Freezable):
    mode: DistributedMode = DistributedMode.auto
    coordinator_address: Optional[str] = None  # host or host:port of process 0
    num_processes: Optional[int] = None
    process_id: Optional[int] = None
    port: int = 8482  # JAX's Cloud TPU coordinator port since 0.8.1 (8476 before)
    initialization_timeout_s: int = 300
    heartbeat_timeout_s: int = 100  # JAX aborts a worker silent this long; at least 2 x liveness_timeout_s
    # Process 0's port for the start-up barrier and liveness channel (runtime/liveness.py); None: the
    # coordinator's port + 1. It must be open between workers, like the coordinator's.
    liveness_port: Optional[int] = None
    liveness_timeout_s: float = 30.0  # a peer silent this long is lost (a dead process: at once)
    shutdown_timeout_s: int = 300


@dataclass
class Config(Freezable):
    arch: Any = MISSING  # a registered model family's schema, chosen by the arch group
    data: DataConfig = MISSING
    optim: OptimConfig = MISSING
    mesh: MeshConfig = MISSING
    run: RunConfig = MISSING
    train: TrainConfig = field(default_factory=TrainConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    # Compile the real train step for a TPU topology (e.g. v4-64, v5e-8), print per-chip
    # memory and FLOPs, and exit without training.
    compile_only: Optional[str] = None


_CALC_NAMES = {"sqrt": math.sqrt, "log2": math.log2, "min": min, "max": max, "round": round, "int": int}


def _calc(expression: str) -> float | int:
    """`${calc:'1e-4 * sqrt(${train.global_batch_size} / 6144)'}`: arithmetic on numbers (after
    interpolation), + - * / // ** and the functions in _CALC_NAMES; nothing else evaluates."""
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Pow: operator.pow, ast.USub: operator.neg}

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in ops:
            return ops[type(node.op)](ev(node.operand))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _CALC_NAMES:
            return _CALC_NAMES[node.func.id](*[ev(a) for a in node.args])
        raise ValueError(f"calc: unsupported expression {ast.dump(node)[:80]}")

    return ev(ast.parse(str(expression), mode="eval"))


if not OmegaConf.has_resolver("calc"):
    OmegaConf.register_new_resolver("calc", _calc)


def register_schemas() -> None:
    """Register the schema with Hydra: each conf/<group>/*.yaml extends its `base_*` entry."""
    cs = ConfigStore.instance()
    cs.store(name="schema", node=Config)
    cs.store(group="data", name="base_data", node=DataConfig)
    cs.store(group="optim", name="base_optim", node=OptimConfig)
    cs.store(group="mesh", name="base_mesh", node=MeshConfig)
    cs.store(group="run", name="base_run", node=RunConfig)
    for arch_name, schema in arch_schemas().items():
        cs.store(group="arch", name=f"base_{arch_name}", node=schema)


# Option fields that are plain strings, checked against the registry the construction reads.
# (Closed sets of options are Enums in the schema: OmegaConf checks those when composing.)
_CHOICES = {
    ("optim", "name"): OPTIMIZERS,
}


# Ranges of the numeric settings (a null, where the schema allows one, is always fine), with what
# the boundary value means. Checked before anything runs, so a nonsense number is one line rather
# than a crash, a hang or a silently odd run (run.checkpoint.keep=0 would delete every checkpoint).
_RULES: dict[str, Rule] = {
    "train.seed": (_at_least(0), ""),
    "train.global_batch_size": (_at_least(1, at_most=INT32_MAX), ""),
    "train.grad_accum_steps": (_at_least(1), "1 = no accumulation"),
    "train.steps": (_above(0, at_most=INT32_MAX), "steps count in int32; or steps=null with train.epochs > 0"),
    "train.epochs": (_above(0), "or epochs=null with train.steps > 0"),
    "train.log_every": (_at_least(1), "the last step is always logged"),
    "train.eval_every": (_at_least(0, at_most=INT32_MAX), "0 = only at the end"),
    "train.checkpoint_every": (_at_least(0, at_most=INT32_MAX), "0 = only at the end"),
    "train.eval_every_epochs": (_at_least(0), "0 = only at the end; null = use train.eval_every"),
    "train.checkpoint_every_epochs": (_at_least(0), "0 = only at the end; null = use train.checkpoint_every"),
    "train.checkpoint_every_minutes": (_above(0), "null = no time-based saves"),
    "train.eval_subset": (_at_least(1, at_most=INT32_MAX), "null = the whole eval set at every evaluation"),
    "train.eval_batch_size": (_at_least(1, at_most=INT32_MAX), "null = train.global_batch_size"),
    "train.profile_start_step": (_at_least(0), "null = no trace"),
    "train.profile_steps": (_at_least(1), ""),
    "train.watchdog_timeout_s": (_at_least(0), "0 = no watchdog"),
    "optim.lr": (_at_least(0), ""),
    "optim.weight_decay": (_at_least(0), ""),
    "optim.b1": (_within(0, 1, high_open=True), ""),
    "optim.b2": (_within(0, 1, high_open=True), ""),
    "optim.eps": (_above(0), ""),
    "optim.warmup_steps": (_at_least(0), ""),
    "optim.lr_min_ratio": (_within(0, 1), "1 = constant after warmup"),
    "optim.grad_clip_norm": (_above(0), "null = no clipping"),
    "optim.ema_rate": (_within(0, 1, high_open=True), "null = no EMA"),
    "optim.puzzle_emb_lr": (_at_least(0), ""),
    "optim.puzzle_emb_weight_decay": (_at_least(0), ""),
    "run.checkpoint.keep": (_at_least(1), "how many of the newest checkpoints are kept"),
    "data.eval_max_examples": (_at_least(1), "null = the whole eval set"),
    "data.seq_len": (_at_least(2), ""),
    "data.eval_generate_examples": (_at_least(0), "0 = no generation eval"),
    "data.eval_max_new_tokens": (_at_least(1), ""),
    "data.generate_puzzles": (_at_least(1), ""),
    "data.generate_test_puzzles": (_at_least(1), ""),
    "data.generate_num_aug": (_at_least(0), ""),
    "data.generate_min_givens": (_within(17, 81), "fewer than 17 givens never have a unique solution"),
    "data.generate_grid_size": (_at_least(5), "the smallest maze; null = the builder's 30"),
    "data.generate_seed": (_at_least(0), ""),
    "distributed.port": (_within(1, 65535), ""),
    "distributed.num_processes": (_at_least(1), ""),
    "distributed.process_id": (_at_least(0), ""),
    "distributed.initialization_timeout_s": (_at_least(1), ""),
    "distributed.heartbeat_timeout_s": (_at_least(1), ""),
    "distributed.shutdown_timeout_s": (_at_least(1), ""),
    "distributed.liveness_port": (_within(1, 65535), "null = the coordinator's port + 1"),
    "distributed.liveness_timeout_s": (_above(0), ""),
}


def check_ranges(config: Config) -> None:
    """Every `_RULES` setting within its range (each task of a mixture too); else one UserError."""
    for key, rule in _RULES.items():
        section, _, name = key.rpartition(".")
        owners = {section: _get(config, section)}
        if section == "data":
            owners |= {f"data.tasks.{t}": task for t, task in config.data.tasks.items()}
        for where, owner in owners.items():
            value = getattr(owner, name, None)
            problem = None if value is None else range_problem(value, rule)
            if problem:
                raise UserError(f"{where}.{name}={value!r} is out of range: {problem}")


def _check_no_added_keys(node: DictConfig, where: str) -> None:
    """Hydra's `+section.key=value` adds a key its schema lacks, and OmegaConf keeps it (an
    attribute nothing reads): a misspelt setting would be silently ignored. Refuse it."""
    schema = OmegaConf.get_type(node)
    known = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
    for key in node.keys():
        path = f"{where}.{key!s}" if where else str(key)
        if known is not None and key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f"did you mean {where + '.' if where else ''}{close[0]}?" if close else f"settings: {sorted(known)}"
            name = cast(type, schema).__name__  # a dataclass: `known` is its fields
            raise UserError(f"unknown config key {path}: {name} has no such setting; {hint}")
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            _check_no_added_keys(child, path)


def _get(config: Any, dotted: str) -> Any:
    for key in dotted.split("."):
        config = getattr(config, key)
    return config


def validate(cfg: DictConfig, experiment: Optional[str] = None, sweep_job: Optional[str] = None) -> Config:
    """Composed DictConfig -> frozen typed Config, or one-line UserError.

    `experiment` is Hydra's choice for the experiment group ("<group>/<variant>"), which names
    the run unless run.group / run.name are set. In a sweep (`-m`), `sweep_job` holds the job's
    values of the swept keys ("train.seed=1"), appended to the name so that each job of the
    sweep has its own run directory and checkpoints.
    """
    arch = cfg.get("arch")
    schemas = arch_schemas()
    if arch is None or OmegaConf.get_type(arch) not in schemas.values():
        raise UserError(f"arch must extend one of {sorted(schemas)}; pick one with arch=<name>")
    schema = OmegaConf.structured(Config)
    schema.arch = OmegaConf.structured(OmegaConf.get_type(arch))
    try:
        merged = cast(DictConfig, OmegaConf.merge(schema, cfg))  # unknown keys and wrong types fail here
        _check_no_added_keys(merged, "")
        config = cast(Config, OmegaConf.to_object(merged))
    except UserError:
        raise
    except Exception as e:  # omegaconf's errors are multi-line; say it in one, naming the key
        key = getattr(e, "full_key", None)
        raise UserError(f"invalid config: {key + ': ' if key else ''}{one_line(e)}") from e

    for path, allowed in _CHOICES.items():
        value = config
        for key in path:
            value = getattr(value, key)
        if value not in allowed:
            raise UserError(f"{'.'.join(path)}={value!r} is not one of {sorted(allowed)}")
    family = family_of(config.arch)
    if family.validate is not None:
        family.validate(config.arch)
    t = config.train
    if (t.steps is None) == (t.epochs is None):
        raise UserError("set exactly one of train.steps and train.epochs (the other =null)")
    check_ranges(config)
    lease = config.run.lease
    if not 0 < lease.renew_every_s < lease.stale_after_s:
        raise UserError(f"run.lease needs 0 < renew_every_s < stale_after_s (got {lease.renew_every_s:g} and "
                        f"{lease.stale_after_s:g}); a lease goes stale after a few missed renewals, e.g. 30 and 90")
    dist = config.distributed
    if dist.liveness_timeout_s > dist.heartbeat_timeout_s / 2:
        raise UserError(f"distributed.liveness_timeout_s={dist.liveness_timeout_s:g} must be at most half of "
                        f"distributed.heartbeat_timeout_s={dist.heartbeat_timeout_s}, so a lost worker is named before "
                        "JAX's own heartbeat check aborts the process")
    _check_curriculum(config)
    sizes = [config.mesh.data, config.mesh.fsdp, config.mesh.tensor]
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise UserError(f"mesh sizes data={sizes[0]} fsdp={sizes[1]} tensor={sizes[2]}: use positive sizes and at most one -1")
    dataset_kind(config.data.name).validate(config.data)

    check_path_names(config)
    check_not_empty(config)
    _check_compile_cache(config.run.compile_cache)
    check_folder("run.executables", config.run.executables, "null (compile every step)")
    if config.run.executables is not None and not re.fullmatch(r"sha256:[0-9a-f]{64}", config.run.executables_digest or ""):
        raise UserError(f"run.executables_digest={config.run.executables_digest!r}: give the sha256:... that `plan "
                        "--executables` printed for the folder (its CSV's executables_digest; `programme submit --plan` "
                        "passes it): a folder's files are loaded only where the manifest of that digest vouches for them")
    group, _, variant = (experiment or "").rpartition("/")
    if config.run.group is None:
        config.run.group = group or (experiment or "default")
    if config.run.name is None:
        config.run.name = variant or "default"
        if sweep_job:
            config.run.name += "_" + re.sub(r"[^A-Za-z0-9_.=,+-]", "-", sweep_job)
    return freeze(config)


# Settings that name one folder (or a W&B run's folder): <run.root>/<run.group>/<run.name>, a
# dataset's <data.path>/<split>. Null takes the default (the experiment's names, the checkpoint's id).
_PATH_NAMES = ("run.group", "run.name", "data.train_split", "data.eval_split")


def check_path_names(config: Config) -> None:
    """Each of _PATH_NAMES that is set is one safe folder name (runtime/ranges.py name_problem):
    run.name=../../x would write outside run.root, run.name='' beside the group's other runs."""
    for key in _PATH_NAMES:
        value = _get(config, key)
        problem = None if value is None else name_problem(str(value))
        if problem:
            raise UserError(f"{key}={value!r} cannot name a folder: {problem}; choose another {key}")
    run_id = config.run.id
    if run_id is not None and not RUN_ID.fullmatch(str(run_id)):
        raise UserError(f"run.id={run_id!r} is not a run id: use 1-64 letters, digits, '.', '_' or '-', starting with "
                        "a letter or digit (it names the W&B run and its folders)")


# Settings that take a topology, a path or a name, where the empty string means nothing (`if value:`
# would read it as off, `value or default` as the default, a path join as the file system's root):
# each with what it takes instead. run.compile_cache and run.executables: check_folder; the names of
# folders: _PATH_NAMES.
_NOT_EMPTY = {
    "compile_only": "a TPU topology such as v5e-8, or leave it out to train",
    "run.root": "a folder, local or gs://bucket/prefix",
    "run.checkpoint.dir": "a folder, local or gs://bucket/prefix, or null (<output dir>/checkpoints)",
    "data.path": "the dataset's folder, local or gs://bucket/prefix",
    "data.tokenizer": "a tokenizer.model file, or null (<data.path>/tokenizer.model)",
    "train.init_params_from": "a folder of imported parameters, or null (a random init)",
    "distributed.coordinator_address": "worker 0's host or host:port, or null (found by the cluster's detection)",
    "run.wandb.project": "a W&B project name",
    "run.wandb.entity": "a W&B entity, or null (the API key's default)",
}


def check_not_empty(config: Config) -> None:
    """No `_NOT_EMPTY` setting (nor a task's path) is the empty string or blank."""
    values = {key: _get(config, key) for key in _NOT_EMPTY}
    values |= {f"data.tasks.{name}.path": task.path for name, task in config.data.tasks.items()}
    for key, value in values.items():
        if isinstance(value, str) and not value.strip():
            takes = _NOT_EMPTY.get(key, _NOT_EMPTY["data.path"])
            raise UserError(f"{key}={value!r} is empty, which names nothing; give {takes}")


def _check_compile_cache(value: Optional[str]) -> None:
    """run.compile_cache is auto, null, a local folder or gs://bucket[/prefix] (runtime/compile_cache.py)."""
    if value != "auto":
        check_folder("run.compile_cache", value, "auto (the default) or null (no cache)")


def check_folder(key: str, value: Optional[str], others: str) -> None:
    """`key` is null, a local folder or gs://bucket[/prefix]."""
    if value is None:
        return
    problem = None
    if not value.strip():
        problem = "it is empty (null turns it off)"
    elif value.startswith("~"):
        problem = "'~' is not expanded; give an absolute folder or one relative to the working directory"
    elif "://" in value and not value.startswith("gs://"):
        problem = "it can be a local folder or on gs:// only"
    elif value.startswith("gs://") and not value[len("gs://"):].split("/", 1)[0]:
        problem = "it names no bucket"
    if problem:
        raise UserError(f"{key}={value!r}: {problem}; use a folder, gs://bucket/prefix, {others}")


def _check_curriculum(config: Config) -> None:
    """Each ramp: both ends or neither, on an arch that has the value, a known shape, cycles >= 1."""
    for name in ("H_cycles", "L_cycles", "halt_exploration_prob"):
        ramp = getattr(config.curriculum, name)
        if (ramp.start is None) != (ramp.end is None):
            raise UserError(f"curriculum.{name} needs both start and end (or neither), got start={ramp.start} end={ramp.end}")
        if not ramp.on:
            continue
        if not hasattr(config.arch, name):
            raise UserError(f"curriculum.{name} is set but arch {config.arch.name!r} has no {name}; use a TRM/HRM arch or "
                            f"curriculum.{name}.start=null curriculum.{name}.end=null")
        if ramp.shape not in ("linear", "cosine") or not 0 < ramp.fraction <= 1:
            raise UserError(f"curriculum.{name}: shape must be linear|cosine and 0 < fraction <= 1, got "
                            f"shape={ramp.shape!r} fraction={ramp.fraction}")
        if name != "halt_exploration_prob" and min(ramp.start, ramp.end) < 1:
            raise UserError(f"curriculum.{name} must stay >= 1 (start={ramp.start}, end={ramp.end})")


def compute_dtype(arch: Any) -> Optional[str]:
    """The arch's compute dtype setting (possibly "auto"); None for a family without one."""
    name = family_of(arch).compute_dtype
    return None if name is None else getattr(arch, name)


def resolve_compute_dtype(config: Config, platform: str, saved_arch: Optional[dict[str, Any]] = None) -> Config:
    """`config` with an arch compute dtype of "auto" made concrete: the value in `saved_arch` (the
    arch of the checkpoint a run resumes), so that a run resumes in the dtype it started in on
    any machine, else the platform's (`platform_compute_dtype`). An explicit dtype is kept, and
    a resolved config is returned unchanged: the run's manifest, W&B config and checkpoints
    record the concrete value."""
    name = family_of(config.arch).compute_dtype
    if name is None or getattr(config.arch, name) != AUTO_DTYPE:
        return config
    saved = (saved_arch or {}).get(name)
    value = saved if saved not in (None, AUTO_DTYPE) else platform_compute_dtype(platform)
    logging.getLogger("runtime").info("arch.%s=auto: %s (%s)", name, value,
                                      "the checkpoint's" if value == saved else f"on {platform}")
    return freeze(dataclasses.replace(config, arch=dataclasses.replace(config.arch, **{name: value})))


def to_dict(config: Config) -> dict[str, Any]:
    """The resolved config as plain data (for W&B, the manifest, checkpoint snapshots); enum
    options as their names (plain strings)."""
    return cast(dict[str, Any], OmegaConf.to_container(OmegaConf.structured(config), resolve=True, enum_to_str=True))


@dataclass(frozen=True)
class Plan:
    """Every number derived from the config and the machine, computed once, printed once."""

    num_processes: int
    num_devices: int
    mesh_shape: dict[str, int]
    global_batch_size: int
    eval_batch_size: int  # rows per eval batch (train.eval_batch_size, else the global batch)
    per_process_batch_size: int
    per_device_batch_size: float  # a batch shard spans data x fsdp devices; tensor replicas share it
    train_examples: int
    epoch_examples: int  # examples per epoch (puzzle sets: one augmented copy of each puzzle)
    steps_per_epoch: float
    total_steps: int
    epochs: float
    warmup_steps: int
    log_every: int
    eval_every: int
    checkpoint_every: int
    output_dir: str
    checkpoint_dir: str

    @property
    def batch_shards(self) -> int:
        """Devices one global batch is split over (data x fsdp; tensor replicas share a shard)."""
        return self.mesh_shape["data"] * self.mesh_shape["fsdp"]

    def table(self) -> str:
        rows = [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def resolve_mesh_shape(mesh: MeshConfig, num_devices: int) -> dict[str, int]:
    sizes = {"data": mesh.data, "fsdp": mesh.fsdp, "tensor": mesh.tensor}
    known = math.prod(s for s in sizes.values() if s != -1)
    for axis, size in sizes.items():
        if size == -1:
            if num_devices % known:
                raise UserError(
                    f"mesh {sizes} cannot fill {num_devices} devices: {num_devices} is not divisible by "
                    f"{known}; change mesh.* so the product divides the device count"
                )
            sizes[axis] = num_devices // known
    if math.prod(sizes.values()) != num_devices:
        raise UserError(
            f"mesh data={sizes['data']} x fsdp={sizes['fsdp']} x tensor={sizes['tensor']} = "
            f"{math.prod(sizes.values())} devices, but this job has {num_devices}; set one mesh axis to -1 "
            "or make the product equal the device count"
        )
    return sizes


def run_dirs(config: Config) -> tuple[str, str]:
    """(output dir for metrics/W&B/manifest, checkpoint dir): <run.root>/<group>/<name>[/checkpoints]."""
    output_dir = f"{config.run.root.rstrip('/')}/{config.run.group}/{config.run.name}"
    return output_dir, config.run.checkpoint.dir or f"{output_dir}/checkpoints"


def _every(steps: int, epochs: Optional[float], steps_per_epoch: float, total_steps: int) -> int:
    """A cadence in steps: from epochs when given (at least 1 step), else steps; 0 = only at the end."""
    if epochs:
        return max(1, round(epochs * steps_per_epoch))
    return total_steps if epochs == 0 else steps or total_steps


def ramp_value(ramp: RampConfig, step, total_steps: int):
    """`ramp` at optimizer step `step` of a `total_steps` run: a traced array inside the train
    step, a Python number on the host (the train loop asks every step: no device dispatch)."""
    xp = np if isinstance(step, (int, float)) else jnp
    span = max(1.0, ramp.fraction * total_steps)
    progress = xp.clip(xp.asarray(step, xp.float32) / span, 0.0, 1.0)
    if ramp.shape == "cosine":
        progress = 0.5 * (1.0 - xp.cos(xp.pi * progress))
    start, end = cast(float, ramp.start), cast(float, ramp.end)  # callers ask ramps that are on: both set
    return start + (end - start) * progress


def cycles_at(config: Config, step: int, total_steps: int) -> tuple[int, int]:
    """(H_cycles, L_cycles) in use at `step` under config.curriculum (the arch's when unset)."""
    c = config.curriculum
    out = []
    for name in ("H_cycles", "L_cycles"):
        ramp = getattr(c, name)
        out.append(int(math.floor(float(ramp_value(ramp, step, total_steps)) + 1e-6)) if ramp.on else getattr(config.arch, name))
    return out[0], out[1]


def planned_steps(steps: Optional[int], epochs: Optional[float], steps_per_epoch: float) -> int:
    """The run's total optimizer steps: train.steps, else train.epochs worth of steps (at least 1)."""
    # validate() requires exactly one of steps and epochs
    return steps if steps is not None else max(1, math.ceil(cast(float, epochs) * steps_per_epoch - 1e-9))


def derive(config: Config, *, num_processes: int, num_devices: int, train_examples: int,
           epoch_examples: int | None = None) -> Plan:
    """All derived numbers, with the checks that need the machine (before any compile).

    `epoch_examples`: examples per epoch when that is not the whole training set. Puzzle sets
    follow the reference (epoch = total_groups x mean_puzzle_examples: one augmented copy of each
    original puzzle), so 50k epochs of Sudoku-Extreme 1000 x 1000-aug are 50k x 1000 examples,
    not 50k passes over the million augmented rows."""
    t = config.train
    mesh_shape = resolve_mesh_shape(config.mesh, num_devices)
    batch_shards = mesh_shape["data"] * mesh_shape["fsdp"]
    if t.global_batch_size % batch_shards:
        raise UserError(
            f"train.global_batch_size={t.global_batch_size} does not divide over data x fsdp = {batch_shards} "
            f"devices; use a multiple of {batch_shards}"
        )
    if t.grad_accum_steps > 1 and (problem := micro_batch_error({"global batch": t.global_batch_size},
                                                                 t.grad_accum_steps, batch_shards)):
        raise UserError(problem)
    if t.global_batch_size % num_processes:
        raise UserError(
            f"train.global_batch_size={t.global_batch_size} does not divide over {num_processes} processes"
        )
    eval_batch = t.eval_batch_size or t.global_batch_size
    if eval_batch % batch_shards or eval_batch % num_processes:
        raise UserError(f"train.eval_batch_size={eval_batch} does not divide over data x fsdp = {batch_shards} devices "
                        f"and {num_processes} processes; use a multiple of {math.lcm(batch_shards, num_processes)}")
    if train_examples < t.global_batch_size:
        raise UserError(
            f"the training set has {train_examples} examples, fewer than one global batch "
            f"({t.global_batch_size}); lower train.global_batch_size or use a larger dataset"
        )
    steps_per_epoch = (epoch_examples or train_examples) / t.global_batch_size
    total_steps = planned_steps(t.steps, t.epochs, steps_per_epoch)
    output_dir, checkpoint_dir = run_dirs(config)
    return Plan(
        num_processes=num_processes,
        num_devices=num_devices,
        mesh_shape=mesh_shape,
        global_batch_size=t.global_batch_size,
        eval_batch_size=eval_batch,
        per_process_batch_size=t.global_batch_size // num_processes,
        per_device_batch_size=t.global_batch_size / batch_shards,
        train_examples=train_examples,
        epoch_examples=epoch_examples or train_examples,
        steps_per_epoch=round(steps_per_epoch, 4),
        total_steps=total_steps,
        epochs=round(total_steps / steps_per_epoch, 4),
        warmup_steps=min(config.optim.warmup_steps, total_steps),
        log_every=t.log_every,
        eval_every=_every(t.eval_every, t.eval_every_epochs, steps_per_epoch, total_steps),
        checkpoint_every=_every(t.checkpoint_every, t.checkpoint_every_epochs, steps_per_epoch, total_steps),
        output_dir=output_dir,
        checkpoint_dir=checkpoint_dir,
    )
