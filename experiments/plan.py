"""Plan the programme before spending pod time: `launch.py plan <group|all> --topology v4-64`.

For every variant of the chosen groups, at full pod scale on the topology's compile-only devices
(runtime/compile_only.py): does its train step fit the chips' HBM, its estimated step time
(`compile_only.StepEstimate`), its number of steps, and its whole bill (experiments/bill.py):
the train steps, the evaluations its protocol asks for (its eval step compiled and estimated the
same way), each start's fixed costs (the plan's own compiles, the figures of `bill.FIGURES`), the
checkpoints' blocking part and, at a given MTBF, the preemptions' replayed steps and restarts;
then each group's and the programme's totals, goodput and wall-clock days on N slices. A
variant that does not fit names the first of remat, a smaller batch per chip, or FSDP that a
compile shows to fit.

Compiles are cached by what is compiled, not by the config: the key is the step's lowered
StableHLO with every literal that cannot change the compiled program's cost blanked out
(`hlo_key`), plus the topology. Variants that differ only in a learning rate, betas, an EMA
rate, a seed, names, step counts or cadences lower to the same key and share one compile;
anything that changes a shape, a dtype, a sharding or an op lowers differently. Results are kept
on disk (`CACHE_DIR/<jax and libtpu versions>_<recorder>/<key>.json`, `cache_dir`), so a second
run compiles nothing. (A run's persistent compilation cache keys on the exact program, literals
included: `exact_key`, what the plan uses to tell which starts would find their steps there.)
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import hashlib
import importlib.metadata
import inspect
import json
import math
import multiprocessing
import os
import re
import sys
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, as_completed, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Mapping

import jax

from data_pipeline.kinds.multitask import task_data_configs
from data_pipeline.kinds.puzzle import PuzzleKind, stored_rows
from data_pipeline.puzzle_format import DatasetError
from data_pipeline.sft_format import load_sft_metadata
from experiments import bill
from experiments.compose import compose
from runtime import compile_cache, compile_only, executables, hlo_cost, libtpu_flags
from runtime.builder import eval_step_args, planned_steps
from runtime.compile_only import (GiB, CompiledStep, compile_step, compile_train_step, estimate_step, parse_topology,
                                  topology_devices)
from runtime.config import TrainConfig, cycles_at, to_dict, validate
from runtime.errors import UserError
from runtime.perf import formula_flops_per_step
from runtime.registry import dataset_kind
from runtime.task import sub_batches

REPO = Path(__file__).resolve().parent.parent
CACHE_DIR = REPO / "outputs" / "plan" / "cache"
CSV_DIR = REPO / "outputs" / "plan"
# A compiling process only grows (to 5-7 GB after some 25 steps at v4-64), so the pool of them is
# replaced after this many compiles per process. By the Planner, not by max_tasks_per_child, which
# hangs the executor once it replaces a process (Python 3.11).
COMPILES_PER_PROCESS = 8

# Literal values kept in the key: the ones XLA's simplifier treats specially (x*1, x+0, x**2,
# x**0.5, select on a constant predicate), so a variant that sets one is never merged with one
# that does not. Every other scalar or splat literal outside a loop condition is blanked.
_KEPT_VALUES = {0.0, 1.0, -1.0, 2.0, 0.5, -0.5}
_CONSTANT = re.compile(r"(stablehlo\.constant dense<)(.*?)(> : tensor<(?:[\d?]+x)*(\w+)>)")


@dataclass(frozen=True)
class Job:
    """One config to plan: +experiment=<group>/<variant> with `overrides`."""

    group: str
    variant: str
    overrides: tuple[str, ...] = ()

    @property
    def experiment(self) -> str:
        return f"{self.group}/{self.variant}"


@dataclass(frozen=True)
class Protocol:
    """A variant's evaluations and checkpoints, from its config and plan (no compile)."""

    evaluations: int = 0  # at every eval_every steps and at the last
    eval_batch: int = 0  # rows of one eval batch (train.eval_batch_size, else the global batch)
    batches: int = 0  # eval batches of an intermediate evaluation (on train.eval_subset, else the whole set)
    final_batches: int = 0  # of the last one (the whole set)
    examples: int | None = None  # the whole eval set (capped by data.eval_max_examples); None: not known here
    subset: int | None = None  # train.eval_subset
    source: str = ""  # where `examples` comes from
    checkpoint_every: int = 0  # steps
    checkpoint_minutes: float | None = None
    compile_cache: bool = False  # run.compile_cache is set


@dataclass(frozen=True)
class Lowered:
    """A job lowered for the topology: its cache keys and what the table needs beside the compiles."""

    key: str = ""
    error: str = ""  # the job could not be planned (a UserError's message)
    steps: int = 0  # 0: not known here (an epoch count of a dataset that is not on this machine)
    model_flops: float | None = None  # per chip per step, by formula, of the compiled stage
    compute_scale: float = 1.0  # a curriculum's mean formula FLOPs per step / the compiled stage's
    global_batch: int = 0
    per_device_batch: float = 0.0
    remat: bool | None = None  # the family's remat knob (None: it has none)
    fsdp_over_all: bool = False  # the mesh already shards over every device
    note: str = ""
    exact: str = ""  # `exact_key` of the train step: same program, same persistent-cache entry
    stages: int = 1  # train steps a run compiles (a curriculum's (H_cycles, L_cycles) stages)
    eval_key: str = ""  # the eval step's `hlo_key` ("": not lowered)
    eval_exact: str = ""
    protocol: Protocol = Protocol()
    data: str = ""  # the dataset(s) it reads: a long-lived trainer that has them loaded reuses them
    run_key: str = ""  # the resolved config less the run's names: equal for two variants that train the same run


@dataclass
class Row:
    """One variant's line of the plan. `estimate` and `steps` are the variant's own, or, when it
    does not fit, those of its `change` (the overrides a compile showed to fit); `bill` is set
    by `price_programme`."""

    group: str
    variant: str
    fits: bool | None = None  # None: not planned (see note)
    total_gib: float | None = None
    hbm_gib: float | None = None
    estimate: object | None = None  # compile_only.StepEstimate
    steps: int | None = None
    change: str = ""
    note: str = ""
    key: str = ""
    lowered: Lowered = Lowered()
    compile_s: float = 0.0  # the train step's compile (x its curriculum stages), as this plan measured it
    eval_estimate: object | None = None  # the eval step's StepEstimate; None: see eval_note
    eval_compile_s: float = 0.0
    eval_gib: float | None = None
    eval_note: str = ""
    bill: bill.Bill | None = None
    same_as: str = ""  # under --what-if dedupe: the variant whose run this one is (it costs nothing)
    executables: str = ""  # the folder its steps compiled ahead are in (plan --executables; "" none)

    @property
    def train_h(self) -> float | None:
        """The train steps alone: steps x estimated step time."""
        total = getattr(self.estimate, "total_s", None)
        return None if total is None or not self.steps else self.steps * total / 3600

    @property
    def pod_hours(self) -> float | None:
        """All in (`bill.Bill.total_s`): what the budget and the ETA read."""
        return None if self.bill is None else self.bill.total_s / 3600


def exact_key(stablehlo: str, topology: str) -> str:
    """The program itself, literals included: what a run's persistent compilation cache keys on
    (with the compiler's version and options, the same for every start of a programme)."""
    return hashlib.sha256((stablehlo + "\n" + topology).encode()).hexdigest()[:24]


def hlo_key(stablehlo: str, topology: str) -> str:
    """The compile cache key of a lowered train step (see the module docstring).

    Literals inside a while loop's `cond` region stay (they are trip counts), as do values in
    `_KEPT_VALUES` and anything `_kept` keeps; shapes, dtypes, shardings, ops and attributes are
    never touched, so two steps with one key compile to the same program up to the values of
    scalars and of floating-point arrays."""
    lines, in_cond = [], 0
    for line in stablehlo.splitlines():
        stripped = line.strip()
        if stripped == "cond {":
            in_cond += 1
        elif stripped == "} do {":
            in_cond -= 1
        elif not in_cond:
            line = _CONSTANT.sub(lambda m: m.group(0) if _kept(m.group(2), m.group(4)) else f"{m.group(1)}_{m.group(3)}",
                                 line)
        lines.append(line)
    return hashlib.sha256(("\n".join(lines) + "\n" + topology).encode()).hexdigest()[:24]


def _kept(value: str, element: str) -> bool:
    """Whether a literal stays in the key: anything but a plain number or floating-point array
    data (integer arrays stay: XLA may turn a gather with constant indices into slices)."""
    try:
        number = float(value)
    except ValueError:
        return not (value.startswith('"0x') and element.startswith(("f", "bf")))
    return number in _KEPT_VALUES or not math.isfinite(number)


@lru_cache(maxsize=None)
def _topology(name: str):
    gen, shape, devices = topology_devices(name)
    return gen, devices, len({d.process_index for d in devices})


def _build(job: Job, topology: str):
    """(config, plan, mesh, steps, abstract batch, data shape) of the job on the topology's devices."""
    gen, devices, hosts = _topology(topology)
    config = validate(compose(job.experiment, job.overrides), job.experiment)
    return planned_steps(config, devices=devices, num_processes=hosts)  # "auto" dtype: the TPU's, not this host's


def eval_set_size(data) -> tuple[int | None, str]:
    """(examples, source) of the eval split: the built split's own rows where it is on this
    machine, else the size the data config states for it (data.generate_test_puzzles: what a
    generated build holds out, and what a reference build's config records of its test set)."""
    kind = dataset_kind(data.name)
    if isinstance(kind, PuzzleKind):
        try:
            return stored_rows(data.path, data.eval_split), f"dataset {data.path}/{data.eval_split}"
        except (OSError, ValueError):
            if kind.can_generate:
                return data.generate_test_puzzles, f"data.generate_test_puzzles: the {data.name} set is not here"
            return None, f"the {data.name} set is not here: plan with data.path at the built set"
    if data.name == "sft":
        try:
            return load_sft_metadata(data.path, data.eval_split).num_rows, f"dataset {data.path}/{data.eval_split}"
        except (DatasetError, OSError):
            return None, "SFT set not built: plan with data.path at the built set"
    return None, f"no eval size known for data.name={data.name}"


def protocol(config, plan) -> Protocol:
    """The variant's evaluations (how many, on how many batches) and checkpoint cadence."""
    total, every = plan.total_steps, max(1, plan.eval_every)
    evaluations = total // every + (1 if total % every else 0)
    rows = plan.eval_batch_size  # train.eval_batch_size, else the global batch
    subset = getattr(config.train, "eval_subset", None)
    if config.data.name == "multitask":
        tasks = task_data_configs(config.data)
        sizes = sub_batches({t: c.batch_fraction for t, c in config.data.tasks.items()}, rows)
    else:
        tasks, sizes = {"": config.data}, {"": rows}
    counts, sources = {}, []
    for name, data in tasks.items():
        n, source = eval_set_size(data)
        sources.append(f"{name + ': ' if name else ''}{n if n is None else f'{n:,}'} ({source})")
        counts[name] = None if n is None else min(n, data.eval_max_examples or n)
    known = all(n is not None for n in counts.values())

    def batches(limit: int | None) -> int:
        return max(math.ceil(min(n, limit or n) / sizes[t]) for t, n in counts.items()) if known else 0

    return Protocol(evaluations=evaluations, eval_batch=rows, batches=batches(subset), final_batches=batches(None),
                    examples=sum(counts.values()) if known else None, subset=subset, source="; ".join(sources),
                    checkpoint_every=plan.checkpoint_every,
                    checkpoint_minutes=getattr(config.train, "checkpoint_every_minutes", None),
                    compile_cache=bool(getattr(config.run, "compile_cache", None)))


def lower(job: Job, topology: str) -> Lowered:
    """The job's cache keys and plan figures; a UserError (e.g. a batch that does not divide over
    the topology) is the row's note, not a failure of the whole plan."""
    try:
        config, plan, mesh, steps, batch, data = _build(job, topology)
    except UserError as e:
        return Lowered(error=f"not planned on {topology}: {e}")
    text = steps.train.lower(steps.abstract_state, batch).as_text()
    key, exact = hlo_key(text, topology), exact_key(text, topology)
    eval_step, eval_args = eval_step_args(plan, mesh, steps, data.seq_len)
    eval_text = eval_step.lower(*eval_args).as_text()
    eval_key, eval_exact = hlo_key(eval_text, topology), exact_key(eval_text, topology)
    devices = plan.num_devices
    flops = formula_flops_per_step(steps.task, data.seq_len, plan.global_batch_size, devices)
    scale, stages, note = _curriculum_scale(config, plan.total_steps, steps, data.seq_len)
    remat = getattr(config.arch, "remat", None)
    counted = config.train.steps is not None or data.examples_exact
    if not counted:
        note = "; ".join(n for n in (note, f"steps unknown: train.epochs of a set not on this machine ({data.source}); "
                                           "plan with data.path at the built set") if n)
    return Lowered(key=key, steps=plan.total_steps if counted else 0, model_flops=flops, compute_scale=scale,
                   global_batch=plan.global_batch_size, per_device_batch=plan.per_device_batch_size,
                   remat=remat if isinstance(remat, bool) else None,
                   fsdp_over_all=plan.mesh_shape["fsdp"] == devices, note=note, exact=exact, stages=stages,
                   eval_key=eval_key, eval_exact=eval_exact, protocol=protocol(config, plan),
                   data=data_identity(config), run_key=run_identity(config))


def run_identity(config) -> str:
    """The resolved config without what only names the run (run.group, run.name, run.id, W&B tags)."""
    resolved = to_dict(config)
    resolved["run"] = {k: v for k, v in resolved["run"].items() if k not in ("group", "name", "id", "wandb")}
    return hashlib.sha256(json.dumps(resolved, sort_keys=True, default=str).encode()).hexdigest()[:24]


def data_identity(config) -> str:
    """The dataset(s) a variant reads, with the splits: equal for two variants that read the same."""
    data = config.data
    paths = [t.path for t in task_data_configs(data).values()] if data.name == "multitask" else [data.path]
    return f"{data.name}:{','.join(paths)}:{data.train_split}:{data.eval_split}"


def _curriculum_scale(config, total_steps: int, steps, seq_len: int) -> tuple[float, int, str]:
    """A curriculum compiles one step per (H_cycles, L_cycles) stage; only the arch's own is
    compiled here. The others' compute is taken in proportion to their formula FLOPs, their
    compiles as long as its. (scale, stages, note)."""
    c = config.curriculum
    if not (c.H_cycles.on or c.L_cycles.on):
        return 1.0, 1, ""
    first_step, counts = {}, Counter()
    for step in range(total_steps):
        stage = cycles_at(config, step, total_steps)
        first_step.setdefault(stage, step)
        counts[stage] += 1
    base = steps.task.flops_per_example(seq_len)
    if not base:
        return 1.0, len(counts), "curriculum: every stage taken at the compiled stage's time"
    ratios = {s: steps.at_step(first_step[s]).task.flops_per_example(seq_len) / base for s in counts}
    scale = sum(counts[s] * ratios[s] for s in counts) / total_steps
    note = (f"curriculum: {len(counts)} stages; the arch's (H_cycles, L_cycles) compiled, the others' compute scaled "
            f"by their formula FLOPs (mean {scale:.3f} of it), each compile taken as long as its")
    if max(ratios.values()) > 1 + 1e-9:
        note += "; a stage larger than the compiled one was not checked for memory"
    return scale, len(counts), note


# ----------------------------------------------------------------------------- compile cache


def cache_dir(root: Path) -> Path:
    """`root/<jax and libtpu versions>_<recorder>`: a compiler update, or a change to the code that
    turns a compile into a `CompiledStep`, starts a fresh cache."""
    try:
        libtpu = importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        libtpu = "none"
    c = compile_only
    recorder = [c.CompiledStep, c.compile_step, c.cost_figures, c._xla_oom, hlo_cost]  # hlo_cost: the whole module
    flags = libtpu_flags.with_defaults(os.environ.get("LIBTPU_INIT_ARGS", ""))  # what the compiles start libtpu with
    digest = hashlib.sha256(("".join(inspect.getsource(f) for f in recorder) + flags).encode()).hexdigest()[:8]
    return root / f"jax-{jax.__version__}_libtpu-{libtpu}_{digest}"


def cached(directory: Path, key: str) -> CompiledStep | None:
    path = directory / f"{key}.json"
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    data["collectives"] = {k: tuple(v) for k, v in data["collectives"].items()}
    return CompiledStep(**data)


def store(directory: Path, key: str, compiled) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{key}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(dataclasses.asdict(compiled)))
    tmp.replace(directory / f"{key}.json")  # whole or absent: a killed run leaves no half file


TRAIN, EVAL = "train", "eval"  # what a compile task compiles


def compile_seconds(compiled: CompiledStep) -> float:
    """What a start pays for this compile: its wall time, or its CPU time where that is less
    (other work on this machine stretches the wall time of a compile, not its CPU time)."""
    return min(compiled.compile_s, compiled.compile_cpu_s) if compiled.compile_cpu_s else compiled.compile_s


def compile_job(job: Job, topology: str, kind: str = TRAIN) -> CompiledStep:
    """The job's train or eval step compiled for the topology (a worker process's task)."""
    config, plan, mesh, steps, batch, data = _build(job, topology)
    gen = _topology(topology)[0]
    if kind == EVAL:
        return compile_step(*eval_step_args(plan, mesh, steps, data.seq_len), gen)
    return compile_train_step(steps, batch, gen)


def keep_job(job: Job, topology: str, folder: str, kind: str = TRAIN) -> bool:
    """The job's train or eval step compiled for the topology and kept in `folder` for its runs to
    read (runtime/executables.py), unless its program's file is there already. False: it cannot be
    kept (the run compiles it)."""
    config, plan, mesh, steps, batch, data = _build(job, topology)
    step, args = eval_step_args(plan, mesh, steps, data.seq_len) if kind == EVAL else (
        steps.train, (steps.abstract_state, batch))
    lowered = step.lower(*args)
    key = executables.key_of(lowered, mesh)
    if executables.exists(folder, key):
        return True
    with compile_cache.off():  # a fresh compile: one read back from JAX's cache may not serialize whole
        compiled = lowered.compile()
    return executables.save(compiled, folder, key)


def programs_to_keep(rows: list[Row]) -> dict[str, tuple[int, str]]:
    """{exact_key: (the index of the first row that runs it, TRAIN or EVAL)}: every distinct program
    of the variants that fit as they are. A curriculum's train steps are left to its runs (one
    program a stage; the plan lowers the first)."""
    todo: dict[str, tuple[int, str]] = {}
    for i, row in enumerate(rows):
        low = row.lowered
        if not row.fits or row.change or not low.exact:
            continue
        if low.stages == 1:
            todo.setdefault(low.exact, (i, TRAIN))
        if low.eval_exact:
            todo.setdefault(low.eval_exact, (i, EVAL))
    return todo


def keep_ahead(jobs: list[Job], rows: list[Row], topology: str, folder: str, workers: int = 1,
               progress: Callable[[str], None] = lambda line: None) -> frozenset[str]:
    """`programs_to_keep` compiled for the topology into `folder` (`plan --executables`): the exact
    keys kept."""
    todo = {exact: (jobs[i], kind) for exact, (i, kind) in programs_to_keep(rows).items()}
    kept: set[str] = set()
    if not todo:
        return frozenset()
    progress(f"keeping {len(todo)} programs compiled for {topology} in {folder} ({workers} process"
             f"{'es' if workers > 1 else ''})")
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context, max_tasks_per_child=COMPILES_PER_PROCESS) as pool:
        futures = {pool.submit(keep_job, job, topology, folder, kind): (exact, job, kind)
                   for exact, (job, kind) in todo.items()}
        for future in as_completed(futures):
            exact, job, kind = futures[future]
            try:
                if future.result():
                    kept.add(exact)
                    progress(f"kept [{len(kept)}/{len(todo)}] {kind} {job.experiment}")
                else:
                    progress(f"not kept: {kind} {job.experiment} (its runs compile it)")
            except Exception as e:  # noqa: BLE001 - one program its runs compile; the plan goes on
                progress(f"not kept: {kind} {job.experiment} ({str(e).splitlines()[0][:200]})")
    return frozenset(kept)


# ----------------------------------------------------------------------------- the plan


def grad_accum_in_schema() -> bool:
    """Whether TrainConfig has `grad_accum_steps` (micro-batches per optimizer step)."""
    return "grad_accum_steps" in {f.name for f in dataclasses.fields(TrainConfig)}


def fix_candidates(lowered: Lowered, compiled) -> list[tuple[str, ...]]:
    """Changes to try, in order, for a step that does not fit: remat (where the family has the
    knob), a smaller batch per chip (gradient accumulation where the schema has it, else a
    smaller global batch), FSDP over every device. The batch factor k starts at the power of two
    that covers the overshoot (the activations scale with the batch) and is tried doubled once."""
    out: list[tuple[str, ...]] = []
    if lowered.remat is False:
        out.append(("arch.remat=true",))
    k = 2 ** max(1, math.ceil(math.log2(max(compiled.total_bytes / compiled.hbm_bytes, 1.0))))
    for factor in (k, 2 * k):
        if lowered.per_device_batch % factor or lowered.per_device_batch < factor:
            break
        out.append((f"train.grad_accum_steps={factor}",) if grad_accum_in_schema()
                   else (f"train.global_batch_size={lowered.global_batch // factor}",))
    if not lowered.fsdp_over_all:
        out.append(("mesh.data=1", "mesh.fsdp=-1"))
    return out


class Planner:
    """Lowers, compiles (cached on disk) and tabulates jobs for one topology.

    Event-driven, so that the `workers` compile processes never wait for the plan: each job's
    train and eval compiles start as soon as lowering finds a new key, and a train step that
    does not fit starts its search for a change (`fix_candidates`, one compile each) as soon as
    its result is in."""

    def __init__(self, topology: str, cache_root: Path = CACHE_DIR, workers: int = 1,
                 progress: Callable[[str], None] | None = None):
        self.topology, self.workers = topology, workers
        self.directory = cache_dir(cache_root)
        self.progress = progress or (lambda line: print(line, file=sys.stderr, flush=True))
        self.lowered: dict[Job, Lowered] = {}
        self.errors: dict[str, str] = {}  # key -> why its compile failed (not for lack of memory)
        self.fixes: dict[Job, Job | None] = {}  # a job that does not fit -> the first candidate that does
        self._candidates: dict[Job, list[tuple[str, ...]]] = {}
        self._waiting: dict[str, list[tuple[Job, Job | None, str]]] = {}  # key -> (job, its trial or None, kind)
        self._running: dict[Future, tuple[str, Job, str]] = {}  # at most `workers` compiles in the pool at once
        self._queued: list[tuple[str, Job, str]] = []  # compiles waiting for a free process
        self._pool: ProcessPoolExecutor | None = None
        self._pool_compiles, self._pool_broken = 0, False  # submitted to the current pool; a process of it died
        self._t0, self._compiled = time.perf_counter(), 0

    def plan(self, jobs: list[Job]) -> list[Row]:
        self.progress(f"plan for {self.topology}: lowering {len(jobs)} variants, compiling each train and eval step "
                      f"not in {self.directory} ({self.workers} process{'es' if self.workers > 1 else ''})")
        try:
            for job in jobs:
                self._want(job, None)
                self._want(job, None, EVAL)
                self._collect(timeout=0)
            keys = {self.lowered[j].key for j in jobs if self.lowered[j].key}
            evals = {self.lowered[j].eval_key for j in jobs if self.lowered[j].eval_key}
            self.progress(f"lowered: {len(keys)} distinct train steps, {len(evals)} eval steps "
                          f"({time.perf_counter() - self._t0:.0f} s)")
            while self._running:
                self._collect(timeout=None)
        finally:
            if self._pool is not None:
                self._pool.shutdown(cancel_futures=True)
        return [self._row(job) for job in jobs]

    def _collect(self, timeout: float | None) -> None:
        """Take in the compiles that have finished (waiting up to `timeout` for one; None: no limit),
        then start queued ones in the processes that are free."""
        done, _ = wait(self._running, timeout=timeout, return_when=FIRST_COMPLETED)
        for future in done:
            key, job, kind = self._running.pop(future)
            self._compiled_key(key, job, kind, future)
        self._start_queued()

    def _start_queued(self) -> None:
        """Submit queued compiles while a process is free. A pool that has had its share of
        compiles takes no more: once its last one is in, it is shut down and a fresh one started.
        A pool whose process died (BrokenProcessPool, e.g. killed for memory) is replaced too."""
        while self._queued and len(self._running) < self.workers:
            spent = self._pool_compiles >= max(1, round(self.workers * COMPILES_PER_PROCESS))
            if self._pool is not None and (spent or self._pool_broken):
                if self._running and not self._pool_broken:
                    return  # drain the old pool first: never more than `workers` compiling processes
                self._pool.shutdown(cancel_futures=True)
                self._pool = None
            if self._pool is None:
                self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
                self._pool_compiles, self._pool_broken = 0, False
            key, job, kind = self._queued.pop(0)
            self._running[self._pool.submit(compile_job, job, self.topology, kind)] = (key, job, kind)
            self._pool_compiles += 1

    def compiled(self, job: Job, kind: str = TRAIN) -> CompiledStep | None:
        low = self.lowered[job]
        return cached(self.directory, low.eval_key if kind == EVAL else low.key)

    def _want(self, job: Job, origin: Job | None, kind: str = TRAIN) -> None:
        """Lower `job` and see its `kind` compile through; `origin`: the job whose change it tries."""
        if job not in self.lowered:
            self.lowered[job] = lower(job, self.topology)
        key = self.lowered[job].eval_key if kind == EVAL else self.lowered[job].key
        if not key:
            return
        if key in self.errors or cached(self.directory, key) is not None:
            self._known(job, origin, kind)
            return
        first = key not in self._waiting
        self._waiting.setdefault(key, []).append((job, origin, kind))
        if not first:
            return
        if self.workers <= 1:
            self._compiled_key(key, job, kind, None)
            return
        self._queued.append((key, job, kind))
        self._start_queued()

    def _compiled_key(self, key: str, job: Job, kind: str, future: Future | None) -> None:
        """Cache the key's result (or note why its compile failed); tell the jobs waiting for it."""
        self._compiled += 1
        try:
            result = compile_job(job, self.topology, kind) if future is None else future.result()
            store(self.directory, key, result)
            gib = result.total_bytes / GiB
            status = f"fits, {gib:.2f} GiB" if result.fits else f"does not fit, {gib:.2f} GiB"
        except BrokenProcessPool:
            self._pool_broken = True
            status = self.errors[key] = ("compile failed: its process died (out of host memory?); "
                                         "plan this group alone, or with --jobs 1")
        except Exception as e:  # XLA's or a kernel's (Mosaic's) compile error: this row's note, the plan goes on
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            name = "" if isinstance(e, jax.errors.JaxRuntimeError) else f"{type(e).__name__}: "
            status = self.errors[key] = f"compile failed: {name}{first}"
        self.progress(f"  compiled [{self._compiled}] {kind} {job.experiment} {' '.join(job.overrides)}: {status} "
                      f"({time.perf_counter() - self._t0:.0f} s)")
        for waiter, origin, waiter_kind in self._waiting.pop(key, []):
            self._known(waiter, origin, waiter_kind)

    def _known(self, job: Job, origin: Job | None, kind: str = TRAIN) -> None:
        """The job's compile is known: a train step that does not fit starts its search for a
        change; a tried change that fits ends its origin's search, one that does not tries the next."""
        if kind == EVAL:
            return  # an eval step that does not fit is its row's note (a smaller train.eval_batch_size)
        fits = self.lowered[job].key not in self.errors and self.compiled(job).fits
        if origin is None and not fits and job not in self._candidates:
            self.fixes[job] = None
            self._candidates[job] = fix_candidates(self.lowered[job], self.compiled(job)) \
                if self.lowered[job].key not in self.errors else []
            self._next_candidate(job)
        elif origin is not None and fits:
            self.fixes[origin] = job
        elif origin is not None:
            self._next_candidate(origin)

    def _next_candidate(self, job: Job) -> None:
        if self._candidates[job]:
            self._want(Job(job.group, job.variant, job.overrides + self._candidates[job].pop(0)), job)

    def _row(self, job: Job) -> Row:
        low, fix = self.lowered[job], self.fixes.get(job)
        row = Row(job.group, job.variant, key=low.key, lowered=low, note=low.error or self.errors.get(low.key, ""))
        if row.note:
            return row
        gen = _topology(self.topology)[0]
        compiled = self.compiled(job)
        row.fits, row.total_gib, row.hbm_gib = compiled.fits, compiled.total_bytes / GiB, compiled.hbm_bytes / GiB
        used, used_compiled = low, compiled
        if not compiled.fits:
            if fix is None:
                row.note = "none of " + "; ".join(" ".join(c) for c in fix_candidates(low, compiled)) + " fits"
                return row
            used, used_compiled = self.lowered[fix], self.compiled(fix)
            row.change = " ".join(fix.overrides[len(job.overrides):])
            row.note = f"fits with the change: {used_compiled.total_bytes / GiB:.2f} GiB"
        estimate = estimate_step(used_compiled, gen, used.model_flops)
        if estimate.compute_s is not None and used.compute_scale != 1.0:
            estimate = dataclasses.replace(estimate, compute_s=estimate.compute_s * used.compute_scale)
        row.estimate, row.steps = estimate, used.steps or None
        row.compile_s = compile_seconds(used_compiled) * used.stages
        row.lowered = dataclasses.replace(used, eval_key=low.eval_key, eval_exact=low.eval_exact)
        notes = [row.note, used.note] + ([f"no step time: {estimate.compute_from}"] if estimate.total_s is None else [])
        if estimate.kernel_s or estimate.undeclared_kernels:  # the part the compiler did not model
            notes.append(f"{100 * estimate.kernel_share:.0f}% of the step from kernels' declared cost"
                         + (f", {estimate.undeclared_kernels} kernel calls with none (0 s)" if estimate.undeclared_kernels else ""))
        row.note = "; ".join(n for n in notes if n)
        self._eval_row(row, job, gen)
        return row

    def _eval_row(self, row: Row, job: Job, gen) -> None:
        """The eval step's estimate on the row, or why there is none (`eval_note`)."""
        low = self.lowered[job]
        if not low.eval_key:
            return
        if low.eval_key in self.errors:
            row.eval_note = f"eval step: {self.errors[low.eval_key]}"
            return
        compiled = self.compiled(job, EVAL)
        row.eval_compile_s, row.eval_gib = compile_seconds(compiled), compiled.total_bytes / GiB
        if not compiled.fits:
            row.eval_note = (f"the eval step does not fit at {low.protocol.eval_batch} rows ({row.eval_gib:.2f} GiB "
                             f"per chip): lower train.eval_batch_size")
            return
        estimate = estimate_step(compiled, gen, None)
        if estimate.total_s is None:
            row.eval_note = f"no eval step time: {estimate.compute_from}"
            return
        row.eval_estimate = estimate
        if row.change:
            row.eval_note = "eval step compiled as configured, without the change"
        if low.protocol.examples is None:
            row.eval_note = "; ".join(n for n in (row.eval_note, f"eval set size unknown: {low.protocol.source}") if n)


# ----------------------------------------------------------------------------- the bill


def variant_costs(row: Row, programme_compiles: Mapping[str, float] | None = None) -> bill.Variant | None:
    """What `bill.price` needs of a row with a step time (None without one); compiles as this
    plan measured them, or the ledger's median for the variant (`programme_compiles`)."""
    total = getattr(row.estimate, "total_s", None)
    if total is None or not row.steps:
        return None
    low, p = row.lowered, row.lowered.protocol
    eval_s = getattr(row.eval_estimate, "total_s", None) if p.examples is not None else None
    train_compile, eval_compile = row.compile_s, row.eval_compile_s
    measured = (programme_compiles or {}).get(f"{row.group}/{row.variant}")
    if measured is not None:  # the ledger's program start-up of one launch: both steps together
        share = train_compile / (train_compile + eval_compile) if train_compile + eval_compile else 1.0
        train_compile, eval_compile = measured * share, measured * (1 - share)
    return bill.Variant(steps=row.steps, step_s=total, evaluations=p.evaluations, eval_step_s=eval_s,
                        eval_batches=p.batches, final_eval_batches=p.final_batches,
                        checkpoint_every=p.checkpoint_every, checkpoint_minutes=p.checkpoint_minutes,
                        compile_train_s=train_compile, compile_eval_s=eval_compile, compile_cache=p.compile_cache)


@dataclass
class Programme:
    """The priced plan: rows with their bills, the figures used, the slices' hours."""

    rows: list[Row]
    figures: dict[str, bill.Figure]
    mtbf_s: float | None
    slices: int
    slice_hours: list[float]
    calibrated: str = ""  # the ledger the figures came from ("" none)
    what_if: frozenset[str] = frozenset()  # levers priced that the code does not have (WHAT_IF)
    ahead: str = ""  # `--executables`: the folder the runs read the steps this plan kept from ("" none)
    kept: int = 0  # programs kept there
    resident: bool = True  # a variant after another on its slice starts in its resident trainers

    @property
    def wall_days(self) -> float:
        return max(self.slice_hours, default=0.0) / 24


# Levers `plan --what-if` prices without them being there (the trainer or launcher does not have
# them, or, for executables, the plan has not kept the programs): what each would buy.
WHAT_IF = {
    "long-lived-trainer": "beyond the resident trainers: no setup check, launch or idle time between a slice's "
                          "variants either, a dataset loaded once, a step compiled once per process",
    "shared-programs": "values that differ between variants (learning rates, EMA rate, schedules' lengths) passed to "
                       "the steps as arguments, so variants with the same plan cache key (`hlo_key`) run one "
                       "program: its compile is a cache hit for all but the first",
    "compile-ahead": "with long-lived-trainer: a compile costs only what the variant before it on its slice did "
                     "not cover (the resident trainers' compiles ahead, which the plan prices without it, count only "
                     "the queue's next variant, and only whole)",
    "executables": "every program `--executables` would keep, priced as kept (a run reads it instead of compiling), "
                   "without the plan's keeping compiles; `--executables FOLDER` builds it",
    "dedupe": "a variant that trains exactly the run of an earlier one (the same resolved config but for its names: "
              "the groups' baseline variants) is run once, its result shared",
}


def price_programme(rows: list[Row], figures: Mapping[str, bill.Figure] = bill.FIGURES, mtbf_s: float | None = None,
                    slices: int = 1, calibration: bill.Calibration | None = None, calibrated: str = "",
                    what_if: frozenset[str] = frozenset(), ahead: frozenset[str] = frozenset(),
                    ahead_folder: str = "", resident: bool = True) -> Programme:
    """Each row's bill, in plan order (the queue's): a start finds its steps in the compilation
    cache when an earlier variant ran the same program (`exact_key`; `hlo_key` under
    shared-programs) with run.compile_cache set; the first variant on each of `slices` slices pays
    a fresh slice's setup, the others the check. A variant that follows another on its slice
    starts in its resident trainers (`bill.Variant.resident`; `resident=False`: a programme
    submitted with --no-resident), and under long-lived-trainer warm (`bill.Variant.warm`);
    which slice, from a first pricing."""
    figures = dict(calibration.figures if calibration else figures)
    compiles = calibration.program_startup if calibration else {}
    unknown = set(what_if) - set(WHAT_IF)
    if unknown:
        raise UserError(f"--what-if {sorted(unknown)[0]} is not a lever the plan prices; use one of {sorted(WHAT_IF)}")
    shared = "shared-programs" in what_if
    kept = len(ahead) if ahead_folder else 0
    if "executables" in what_if:
        ahead = ahead | frozenset(programs_to_keep(rows))
    slice_of: dict[int, int] = {}
    if "compile-ahead" in what_if and "long-lived-trainer" not in what_if:
        raise UserError("--what-if compile-ahead needs --what-if long-lived-trainer (a process that outlives a "
                        "variant)")
    for _ in range(2 if "long-lived-trainer" in what_if or resident else 1):
        seen_train, seen_eval, priced = set(), set(), 0
        last: dict[int, Row] = {}  # slice -> the row its process ran last
        ran: dict[int, set[str]] = {}  # slice -> programs its process compiled
        runs: dict[str, Row] = {}  # run_key -> the row that runs it
        previous: Row | None = None  # the row priced last: the queue's variant before this one
        for i, row in enumerate(rows):
            row.bill, row.same_as = None, ""
            costs = variant_costs(row, compiles)
            if costs is None:
                continue
            if "dedupe" in what_if and row.lowered.run_key:
                first = runs.setdefault(row.lowered.run_key, row)
                if first is not row:
                    row.bill = bill.price(bill.Variant(steps=0, step_s=0.0, evaluations=0), {
                        k: dataclasses.replace(fig, seconds=0.0) for k, fig in figures.items()})
                    row.same_as = f"{first.group}/{first.variant}"
                    continue
            low = row.lowered
            train_id, eval_id = (low.key, low.eval_key) if shared else (low.exact, low.eval_exact)
            costs = dataclasses.replace(costs, train_cached=train_id in seen_train, eval_cached=eval_id in seen_eval,
                                        first_on_slice=priced < slices, train_ahead=low.exact in ahead,
                                        eval_ahead=low.eval_exact in ahead)
            row.executables = ahead_folder if costs.train_ahead or costs.eval_ahead else ""
            where = slice_of.get(i)
            if where is not None and where in last and resident:
                costs = dataclasses.replace(costs, resident=True)
                before = last[where]
                # The controller names the queue's next variant at each launch, and the residents
                # compile its steps once their own first step ran (worker/resident.py): in the
                # compilation cache when it starts, if it follows that launch on its slice and
                # the steps before it outlast the compiles.
                if (before is previous and costs.compile_cache and low.stages == 1
                        and costs.compile_train_s + costs.compile_eval_s <= before.bill.train_s + before.bill.eval_s):
                    costs = dataclasses.replace(costs, train_cached=True, eval_cached=True)
            if where is not None and where in last and "long-lived-trainer" in what_if:
                before, done = last[where], ran[where]
                costs = dataclasses.replace(costs, warm=True, data_loaded=before.lowered.data == low.data,
                                            train_in_process=train_id in done, eval_in_process=eval_id in done)
                if "compile-ahead" in what_if:  # compiled while `before` trained: only what its steps did not cover
                    cover = before.bill.train_s + before.bill.eval_s
                    hidden_train = min(costs.compile_train_s, cover)
                    costs = dataclasses.replace(costs, compile_train_s=costs.compile_train_s - hidden_train,
                                                compile_eval_s=max(0.0, costs.compile_eval_s - (cover - hidden_train)),
                                                train_cached=False, eval_cached=False)  # in memory, not read
            if where is not None:
                last[where] = row
                ran.setdefault(where, set()).update((train_id, eval_id))
            if costs.compile_cache:
                seen_train.add(train_id)
                seen_eval.add(eval_id)
            row.bill = bill.price(costs, figures, mtbf_s)
            priced += 1
            previous = row
        indices = [i for i, r in enumerate(rows) if r.bill is not None]
        hours = [rows[i].bill.total_s / 3600 for i in indices]
        on = bill.schedule(hours, slices)
        slice_of = dict(zip(indices, on))
    slice_hours = [sum(h for h, s in zip(hours, on) if s == k) for k in range(slices)]
    return Programme(rows, figures, mtbf_s, slices, slice_hours, calibrated, frozenset(what_if), ahead_folder, kept,
                     resident)


# ----------------------------------------------------------------------------- output


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _seconds(t: float | None) -> str:
    if t is None:
        return "-"
    return f"{t:.3g} s" if t >= 1 else f"{t * 1e3:.3g} ms"


def _duration(t: float | None) -> str:
    if t is None:
        return "-"
    return f"{t / 60:.1f} min" if t < 3600 else f"{t / 3600:.2f} h"


COLUMNS = ("train_h", "eval_h", "startup_h", "checkpoint_h", "recovery_h", "total_h")


@dataclass
class Total:
    """A group's or the programme's sums."""

    hours: dict[str, float]  # COLUMNS and each bill category -> hours
    counted: int = 0
    missing: int = 0  # variants without a figure

    @property
    def goodput(self) -> float | None:
        total = self.hours.get("total_h", 0.0)
        return (self.hours.get("train_h", 0.0) + self.hours.get("eval_h", 0.0)) / total if total else None


def row_hours(b: bill.Bill) -> dict[str, float]:
    return {"train_h": b.train_s / 3600, "eval_h": b.eval_s / 3600, "startup_h": b.startup_s / 3600,
            "checkpoint_h": b.checkpoint_s / 3600, "recovery_h": b.recovery_s / 3600, "total_h": b.total_s / 3600,
            **{c: b.seconds.get(c, 0.0) / 3600 for c in bill.CATEGORIES}}


def totals(rows: list[Row]) -> dict[str, Total]:
    """{group: its Total} and "all" for the programme."""
    out: dict[str, Total] = {}
    for row in rows:
        for name in (row.group, "all"):
            entry = out.setdefault(name, Total({}))
            if row.bill is None:
                entry.missing += 1
                continue
            entry.counted += 1
            for k, v in row_hours(row.bill).items():
                entry.hours[k] = entry.hours.get(k, 0.0) + v
    return out


def _evals(row: Row) -> str:
    """'9 x 2 + 69': intermediate evaluations x their batches + the last one's batches."""
    p = row.lowered.protocol
    if not p.evaluations or p.examples is None:
        return "-"
    return f"{p.evaluations - 1} x {p.batches} + {p.final_batches}" if p.evaluations > 1 else f"{p.final_batches}"


def _total_line(label: str, t: Total, what: str) -> str:
    g = t.goodput
    return (f"| **{label}** | | | | | | | " + " | ".join(f"**{t.hours.get(c, 0.0):.3f}**" for c in COLUMNS)
            + f" | **{_cell(None if g is None else 100 * g, '.1f')}%** | {t.counted} {what}"
            + (f", {t.missing} without a figure" if t.missing else "") + " |")


def markdown(programme: Programme, topology: str, command: str) -> str:
    rows = programme.rows
    gen, chips = parse_topology(topology)
    mtbf = (f"one preemption per {programme.mtbf_s / 3600:g} paid hours (--mtbf)" if programme.mtbf_s
            else "no preemptions (give --mtbf to price them)")
    lines = [
        f"Plan for {topology} ({chips} chips, {gen.hbm_gib} GiB HBM each), {datetime.date.today().isoformat()}: "
        f"`{command}`",
        "",
        "Estimates, not measurements. Step time = compute (XLA's `optimal_seconds` of the compiled step, every loop "
        "iteration counted; custom kernels at their declared cost's roofline) + collectives (ring bytes at the chip's "
        "ICI bandwidth, every loop iteration counted), not overlapped; a floor on the "
        "real step time, so MFU is a ceiling (runtime/compile_only.py `StepEstimate`); the eval step the same way. "
        "Hours are pod-hours (the whole slice held: wall-clock hours of a slice): train_h = steps x step time; "
        "eval_h = eval step x batches (evals: intermediate evaluations x their batches + the last one's, on the "
        "whole set); startup_h = each start's fixed costs (this plan's compiles and the figures below); "
        "checkpoint_h = the blocking part of the saves before the last; recovery_h = replayed steps and restarts at "
        f"{mtbf}; total_h = their sum (the CSV's pod_hours); goodput = (train_h + eval_h) / total_h "
        "(experiments/bill.py). * = with the change that makes it fit.",
        *([""] + [f"**What-if, not what runs today**: {name}: {WHAT_IF[name]}." for name in sorted(programme.what_if)]
          if programme.what_if else []),
        "",
        "Resident trainers: " + ("a variant that follows another on its slice runs in the trainer processes the one "
                                 "before it left (experiments/launcher/worker/resident.py): it pays the hand-over "
                                 "(`resident_start`), not the runtime start-up; the first on a slice and every "
                                 "restart pay it. When it follows the queue's variant before it on the same slice, "
                                 "whose launch named it, its steps were compiled while that one trained: cache hits "
                                 "at its start (where those steps outlast the compiles)." if programme.resident else
                                 "none (--no-resident): every start pays the runtime start-up and its compiles."),
        *(["", f"**Compiled ahead**: {programme.kept} programs kept in {programme.ahead}; runs given "
               f"`run.executables={programme.ahead}` read them instead of compiling (priced as a cache hit at every "
               "start)."] if programme.ahead else []),
        "",
        f"| variant | fits (GiB per chip of {gen.hbm_gib}) | step time | MFU | steps | eval step | evals | "
        + " | ".join(COLUMNS) + " | goodput | to fit / note |",
        "|---|---|---|---|---|---|---|" + "---|" * len(COLUMNS) + "---|---|",
    ]
    sums, group = totals(rows), None
    for row in rows + [None]:
        if group is not None and (row is None or row.group != group):
            lines.append(_total_line(f"{group} total", sums[group], "variants"))
        if row is None:
            break
        group = row.group
        star = "*" if row.change else ""
        fits = "-" if row.fits is None else f"{'yes' if row.fits else 'no'} {row.total_gib:.2f}"
        mfu = getattr(row.estimate, "mfu", None)
        note = "; ".join(n for n in (f"`{row.change}`" if row.change else "",
                                     f"the run of {row.same_as} (dedupe)" if row.same_as else "",
                                     row.note, row.eval_note) if n)
        hours = row_hours(row.bill) if row.bill else {}
        if row.bill is not None and not row.bill.eval_known:
            hours["eval_h"] = None  # not priced (see the note), not zero
        cells = " | ".join(_cell(hours.get(c), ".3f") + (star if c == "train_h" and hours else "") for c in COLUMNS)
        goodput = None if row.bill is None or not row.bill.total_s else 100 * row.bill.goodput
        lines.append(f"| {row.group}/{row.variant} | {fits} | {_seconds(getattr(row.estimate, 'total_s', None))}{star} | "
                     f"{_cell(None if mfu is None else 100 * mfu, '.0f')}{'%' if mfu is not None else ''} | "
                     f"{_cell(row.steps, ',')}{star} | {_seconds(getattr(row.eval_estimate, 'total_s', None))} | "
                     f"{_evals(row)} | {cells} | {_cell(goodput, '.1f')}{'%' if goodput is not None else ''} | {note} |")
    everything = sums.get("all", Total({}))
    lines.append(_total_line("programme total", everything, "variants"))
    lines += ["", summary(programme, everything)]
    return "\n".join(lines) + "\n"


def summary(programme: Programme, everything: Total) -> str:
    """The programme's figures under the table: wall-clock, badput by category, checkpoint
    cadence (Young's rule), and every start-up figure with its source."""
    h = everything.hours
    g = everything.goodput
    slices = programme.slice_hours
    out = [f"**Programme: {h.get('total_h', 0.0):.2f} pod-hours all in, goodput "
           f"{_cell(None if g is None else 100 * g, '.1f')}%, {programme.wall_days:.2f} days on {programme.slices} "
           f"slice{'s' if programme.slices > 1 else ''}** (busiest slice {max(slices, default=0.0):.2f} h; "
           f"{everything.counted} variants priced).", "",
           "| where the pod-hours go | hours | share |", "|---|---|---|"]
    total = h.get("total_h", 0.0) or 1.0
    for c in bill.CATEGORIES:
        if h.get(c):
            out.append(f"| {c}{' (productive)' if c in (bill.TRAIN, bill.EVAL) else ''} | {h[c]:.2f} | "
                       f"{100 * h[c] / total:.1f}% |")
    priced = [r for r in programme.rows if r.bill is not None]
    if priced and programme.mtbf_s:
        young = priced[0].bill.young_interval_s
        intervals = sorted(r.bill.checkpoint_interval_s for r in priced)
        out += ["", f"Checkpoint cadence: Young's rule, sqrt(2 x blocking save x MTBF) = sqrt(2 x "
                    f"{programme.figures['save'].seconds:g} s x {programme.mtbf_s / 3600:g} h), gives "
                    f"{_duration(young)} between saves; the variants save every {_duration(intervals[0])} to "
                    f"{_duration(intervals[-1])} (median {_duration(intervals[len(intervals) // 2])}; "
                    "`train.checkpoint_every_minutes` sets it)."]
    out += ["", "| figure | seconds | paid | source |", "|---|---|---|---|"]
    for name, f in programme.figures.items():
        out.append(f"| {name} | {f.seconds:g} | {f.paid} | {f.source} |")
    ledger = "the ledger's median program start-up where a variant ran, else " if programme.calibrated else ""
    out.append("| compiles | per variant (the CSV's compile_s, eval_compile_s) | every launch that misses the "
               f"compilation cache | {ledger}this plan's own compiles for the topology: each one's CPU seconds on "
               "this machine, or its wall seconds where less |")
    return "\n".join(out)


CSV_FIELDS = ("group", "variant", "fits", "total_gib", "hbm_gib", "compute_s", "kernel_s", "collective_s", "step_s",
              "mfu", "steps", "eval_step_s", "eval_gib", "eval_batch", "evaluations", "eval_batches",
              "final_eval_batches", "eval_examples", "eval_subset", "compile_s", "eval_compile_s",
              *COLUMNS, "pod_hours", "goodput", "whole_set_eval_h", *(f"{c}_h" for c in bill.CATEGORIES),
              "preemptions", "saves",
              "checkpoint_interval_s", "young_interval_s", "change", "note", "key", "executables")


def write_csv(rows: list[Row], path: Path) -> None:
    """One line per variant, then one per group (variant TOTAL) and the programme (group ALL).
    pod_hours = total_h, the all-in figure (the queue's budget and ETA read it); whole_set_eval_h
    = the evaluations on the whole set every time (the reference's protocol), for comparison."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        out = csv.DictWriter(f, CSV_FIELDS)
        out.writeheader()
        for row in rows:
            est, p, b = row.estimate, row.lowered.protocol, row.bill
            line = {"group": row.group, "variant": row.variant, "fits": "" if row.fits is None else row.fits,
                    "total_gib": _g(row.total_gib), "hbm_gib": _g(row.hbm_gib),
                    "compute_s": _g(getattr(est, "compute_s", None)), "kernel_s": _g(getattr(est, "kernel_s", None)),
                    "collective_s": _g(getattr(est, "collective_s", None)), "step_s": _g(getattr(est, "total_s", None)),
                    "mfu": _g(getattr(est, "mfu", None)), "steps": row.steps or "",
                    "eval_step_s": _g(getattr(row.eval_estimate, "total_s", None)), "eval_gib": _g(row.eval_gib),
                    "eval_batch": p.eval_batch or "", "evaluations": p.evaluations if row.steps else "",
                    "eval_batches": p.batches or "", "final_eval_batches": p.final_batches or "",
                    "eval_examples": "" if p.examples is None else p.examples,
                    "eval_subset": "" if p.subset is None else p.subset,
                    "compile_s": _g(row.compile_s or None), "eval_compile_s": _g(row.eval_compile_s or None),
                    "change": row.change, "note": "; ".join(n for n in (row.note, row.eval_note) if n), "key": row.key,
                    "executables": row.executables}
            if b is not None:
                hours = row_hours(b)
                line |= {c: _g(hours[c]) for c in COLUMNS} | {f"{c}_h": _g(hours[c]) for c in bill.CATEGORIES}
                if not b.eval_known:
                    line["eval_h"] = ""  # not priced (see the note), not zero
                eval_step = getattr(row.eval_estimate, "total_s", None)
                line["whole_set_eval_h"] = _g(None if eval_step is None or p.examples is None
                                              else eval_step * p.evaluations * p.final_batches / 3600)
                line |= {"pod_hours": _g(hours["total_h"]), "goodput": _g(b.goodput), "preemptions": _g(b.preemptions),
                         "saves": b.saves, "checkpoint_interval_s": _g(b.checkpoint_interval_s),
                         "young_interval_s": _g(b.young_interval_s)}
            out.writerow(line)
        sums = totals(rows)
        for name in [g for g in sums if g != "all"] + ["all"]:
            t = sums[name]
            line = {"group": "ALL" if name == "all" else name, "variant": "TOTAL",
                    "note": f"{t.counted} variants, {t.missing} without a figure", "goodput": _g(t.goodput),
                    "pod_hours": _g(t.hours.get("total_h", 0.0))}
            line |= {c: _g(t.hours.get(c, 0.0)) for c in COLUMNS} | {f"{c}_h": _g(t.hours.get(c, 0.0))
                                                                       for c in bill.CATEGORIES}
            out.writerow(line)


def _g(value: float | None) -> str:
    return "" if value is None else repr(float(value))
