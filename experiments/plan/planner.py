"""Fits and step times: every variant lowered and compiled for a topology without one
(runtime/compile_only.py), cached on disk by what is compiled, not by the config.

The cache key (`hlo_key`) is the lowered StableHLO with the literals that cannot change the
program's cost blanked, plus the topology: variants that differ only in a learning rate, a seed or
a cadence share one compile. A run's persistent compilation cache keys on the exact program
(`exact_key`), which the pricing uses to tell which starts find their steps there.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import inspect
import json
import math
import multiprocessing
import os
import re
import signal
import sys
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, as_completed, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import jax

from data_pipeline.kinds.multitask import task_data_configs
from data_pipeline.kinds.puzzle import PuzzleKind, stored_rows
from data_pipeline.puzzle_format import DatasetError
from data_pipeline.sft_format import load_sft_metadata
from experiments.compose import compose
from experiments.plan.bill import Bill
from runtime import compile_cache, compile_only, executables, hlo_cost, libtpu_flags
from runtime.builder import eval_step_args, planned_steps
from runtime.compile_only import GiB, CompiledStep, compile_step, compile_train_step, estimate_step, topology_devices
from runtime.config import cycles_at, validate
from runtime.errors import UserError
from runtime.perf import formula_flops_per_step
from runtime.registry import dataset_kind
from runtime.task import sub_batches

REPO = Path(__file__).resolve().parents[2]
CACHE_DIR = REPO / "outputs" / "plan" / "cache"
CSV_DIR = REPO / "outputs" / "plan"
# A compiling process only grows (5-7 GB after some 25 steps at v4-64): its pool is replaced after this
# many compiles per process (the Planner; `in_fresh_pools`, whose docstring says why not max_tasks_per_child).
COMPILES_PER_PROCESS = 8
T = TypeVar("T")

# Literals kept in the key: those XLA's simplifier treats specially (x*1, x+0, x**2, x**0.5).
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
    per_device_batch: float = 0.0
    remat: bool | None = None  # the family's remat knob (None: it has none)
    fsdp_over_all: bool = False  # the mesh already shards over every device
    note: str = ""
    exact: str = ""  # `exact_key` of the train step: same program, same persistent-cache entry
    stages: int = 1  # train steps a run compiles (a curriculum's (H_cycles, L_cycles) stages)
    eval_key: str = ""  # the eval step's `hlo_key` ("": not lowered)
    eval_exact: str = ""
    protocol: Protocol = Protocol()


@dataclass
class Row:
    """One variant's line of the plan. `estimate` and `steps` are the variant's own, or, when it
    does not fit, those of its `change` (the overrides a compile showed to fit)."""
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
    bill: Bill | None = None
    executables: str = ""  # the folder its steps compiled ahead are in (plan --executables; "" none)
    executables_digest: str = ""  # the sha256 of that plan's manifest of the folder (run.executables_digest)

    @property
    def train_h(self) -> float | None:
        """The train steps alone: steps x estimated step time."""
        total = getattr(self.estimate, "total_s", None)
        return None if total is None or not self.steps else self.steps * total / 3600


def ctrl_c_to_the_parent() -> None:
    """A compiling process ignores Ctrl-C: the plan says it once (launch.py), not each process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def exact_key(stablehlo: str, topology: str) -> str:
    """The program itself, literals included: what a run's persistent compilation cache keys on."""
    return hashlib.sha256((stablehlo + "\n" + topology).encode()).hexdigest()[:24]


def hlo_key(stablehlo: str, topology: str) -> str:
    """The plan's cache key of a lowered step: literals blanked except in a while loop's `cond`
    (trip counts) and those `_kept` keeps; shapes, dtypes, shardings and ops untouched."""
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
    return exact_key("\n".join(lines), topology)


def _kept(value: str, element: str) -> bool:
    """Anything but a plain number or float array data stays (XLA may turn a gather with constant
    integer indices into slices)."""
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
    _, devices, hosts = _topology(topology)
    config = validate(compose(job.experiment, job.overrides), job.experiment)
    return planned_steps(config, devices=devices, num_processes=hosts)  # "auto" dtype: the TPU's, not this host's


def eval_set_size(data) -> tuple[int | None, str]:
    """(examples, source) of the eval split: the built split's rows where it is on this machine,
    else the size its data config states (data.generate_test_puzzles)."""
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
    """The job's cache keys and plan figures; a UserError is the row's note, not the plan's failure."""
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
                   per_device_batch=plan.per_device_batch_size,
                   remat=remat if isinstance(remat, bool) else None,
                   fsdp_over_all=plan.mesh_shape["fsdp"] == devices, note=note, exact=exact, stages=stages,
                   eval_key=eval_key, eval_exact=eval_exact, protocol=protocol(config, plan))


def _curriculum_scale(config, total_steps: int, steps, seq_len: int) -> tuple[float, int, str]:
    """(scale, stages, note): a curriculum compiles one step per (H_cycles, L_cycles) stage; the
    plan compiles the arch's own and scales the others' compute by their formula FLOPs."""
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
    """`root/<jax and libtpu versions>_<recorder digest>`: a new compiler or recorder starts afresh."""
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
    """Its wall time, or its CPU time where less (other work here stretches the wall time only)."""
    return min(compiled.compile_s, compiled.compile_cpu_s) if compiled.compile_cpu_s else compiled.compile_s


def compile_job(job: Job, topology: str, kind: str = TRAIN) -> CompiledStep:
    """The job's train or eval step compiled for the topology (a worker process's task)."""
    config, plan, mesh, steps, batch, data = _build(job, topology)
    gen = _topology(topology)[0]
    if kind == EVAL:
        return compile_step(*eval_step_args(plan, mesh, steps, data.seq_len), gen)
    return compile_train_step(steps, batch, gen)


def keep_job(job: Job, topology: str, folder: str, kind: str = TRAIN,
             cache_root: Path = CACHE_DIR) -> tuple[str, str] | None:
    """The job's train or eval step compiled and kept in `folder` for its runs (runtime/executables.py),
    unless this machine wrote it there already: (its key, the file's sha256); None: not kept."""
    config, plan, mesh, steps, batch, data = _build(job, topology)
    step, args = eval_step_args(plan, mesh, steps, data.seq_len) if kind == EVAL else (
        steps.train, (steps.abstract_state, batch))
    lowered = step.lower(*args)
    key, written = executables.key_of(lowered, mesh), cache_root / "kept"
    digest = executables.kept_already(folder, key, written)
    if not digest:
        with compile_cache.off():  # a fresh compile: one read back from JAX's cache may not serialize whole
            compiled = lowered.compile()
        digest = executables.save(compiled, folder, key, written)
    return (key, digest) if digest else None


def programs_to_keep(rows: list[Row]) -> dict[str, tuple[int, str]]:
    """{exact_key: (the first row that runs it, TRAIN or EVAL)} of the variants that fit as they are;
    not a curriculum's train steps (one program a stage; the plan lowers the first)."""
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


def in_fresh_pools(calls: list[tuple[tuple, T]], workers: int) -> Iterator[tuple[Future, T]]:
    """Each `((function, *args), tag)` run in a compiling process; (its future, tag) as each ends. A
    pool runs `workers * COMPILES_PER_PROCESS` calls, then a fresh one the next: its processes only
    grow. (Not `max_tasks_per_child`: on Python 3.11 the pool then stops starting the calls queued
    once a process has been replaced, and waits forever: cpython issue gh-115634.)"""
    share = workers * COMPILES_PER_PROCESS
    for start in range(0, len(calls), share):
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=ctrl_c_to_the_parent) as pool:
            futures = {pool.submit(*call): tag for call, tag in calls[start:start + share]}
            for future in as_completed(futures):
                yield future, futures[future]


def keep_ahead(jobs: list[Job], rows: list[Row], topology: str, folder: str, workers: int = 1,
               progress: Callable[[str], None] = lambda line: None, cache_root: Path = CACHE_DIR) -> frozenset[str]:
    """`programs_to_keep` compiled into `folder` with its manifest (`plan --executables`): the exact
    keys kept; each row that has one names the folder and the manifest's digest, for the CSV."""
    todo = {exact: (jobs[i], kind) for exact, (i, kind) in programs_to_keep(rows).items()}
    kept: set[str] = set()
    manifest: dict[str, str] = {}
    if not todo:
        return frozenset()
    progress(f"keeping {len(todo)} programs compiled for {topology} in {folder} ({workers} process"
             f"{'es' if workers > 1 else ''})")
    calls = [((keep_job, job, topology, folder, kind, cache_root), (exact, job, kind))
             for exact, (job, kind) in todo.items()]
    for future, (exact, job, kind) in in_fresh_pools(calls, workers):
        try:
            if result := future.result():
                manifest.setdefault(*result)
                kept.add(exact)
                progress(f"kept [{len(kept)}/{len(todo)}] {kind} {job.experiment}")
            else:
                progress(f"not kept: {kind} {job.experiment} (its runs compile it)")
        except Exception as e:  # noqa: BLE001 - one program its runs compile; the plan goes on
            progress(f"not kept: {kind} {job.experiment} ({str(e).splitlines()[0][:200]})")
    digest = executables.write_manifest(folder, manifest) if manifest else ""
    if digest:
        progress(f"kept {len(kept)} programs: the runs read them with run.executables={folder} "
                 f"run.executables_digest={digest} (the CSV holds both)")
    for row in rows:
        row.executables, row.executables_digest = (folder, digest) if kept & {row.lowered.exact,
                                                                              row.lowered.eval_exact} else ("", "")
    return frozenset(kept)


def fix_candidates(lowered: Lowered, compiled) -> list[tuple[str, ...]]:
    """Changes to try, in order, for a step that does not fit: remat, gradient accumulation by the
    power of two that covers the overshoot (then doubled), FSDP over every device."""
    out: list[tuple[str, ...]] = []
    if lowered.remat is False:
        out.append(("arch.remat=true",))
    k = 2 ** max(1, math.ceil(math.log2(max(compiled.total_bytes / compiled.hbm_bytes, 1.0))))
    for factor in (k, 2 * k):
        if lowered.per_device_batch % factor or lowered.per_device_batch < factor:
            break
        out.append((f"train.grad_accum_steps={factor}",))
    if not lowered.fsdp_over_all:
        out.append(("mesh.data=1", "mesh.fsdp=-1"))
    return out


class Planner:
    """Lowers, compiles (cached on disk) and tabulates jobs for one topology. Event-driven, so the
    compile processes never wait: a compile starts as soon as lowering finds a new key, and a step
    that does not fit starts its search for a change (`fix_candidates`) as soon as its result is in."""

    def __init__(self, topology: str, cache_root: Path = CACHE_DIR, workers: int = 1,
                 progress: Callable[[str], None] | None = None):
        self.topology, self.workers = topology, workers
        self.directory = cache_dir(cache_root)
        self.progress = progress or (lambda line: print(line, file=sys.stderr, flush=True))
        self.lowered: dict[Job, Lowered] = {}
        self.errors: dict[str, str] = {}  # key -> why its compile failed (not for lack of memory)
        self.fixes: dict[Job, Job] = {}  # a job that does not fit -> the first candidate that does
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
        """Take in finished compiles (waiting up to `timeout`), then start queued ones."""
        done, _ = wait(self._running, timeout=timeout, return_when=FIRST_COMPLETED)
        for future in done:
            key, job, kind = self._running.pop(future)
            self._compiled_key(key, job, kind, future)
        self._start_queued()

    def _start_queued(self) -> None:
        """Submit queued compiles while a process is free. A pool that had its share of compiles, or
        whose process died (e.g. killed for memory), is drained and replaced by a fresh one."""
        while self._queued and len(self._running) < self.workers:
            spent = self._pool_compiles >= self.workers * COMPILES_PER_PROCESS
            if self._pool is not None and (spent or self._pool_broken):
                if self._running and not self._pool_broken:
                    return  # drain the old pool first: never more than `workers` compiling processes
                self._pool.shutdown(cancel_futures=True)
                self._pool = None
            if self._pool is None:
                self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=ctrl_c_to_the_parent)
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
        except Exception as e:  # noqa: BLE001 - XLA's or a kernel's (Mosaic's) compile error: the row's note
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            name = "" if isinstance(e, jax.errors.JaxRuntimeError) else f"{type(e).__name__}: "
            status = self.errors[key] = f"compile failed: {name}{first}"
        self.progress(f"  compiled [{self._compiled}] {kind} {job.experiment} {' '.join(job.overrides)}: {status} "
                      f"({time.perf_counter() - self._t0:.0f} s)")
        for waiter, origin, waiter_kind in self._waiting.pop(key, []):
            self._known(waiter, origin, waiter_kind)

    def _known(self, job: Job, origin: Job | None, kind: str = TRAIN) -> None:
        """A train step that does not fit starts its search for a change; a tried change that fits
        ends its origin's search, one that does not tries the next."""
        if kind == EVAL:
            return  # an eval step that does not fit is its row's note (a smaller train.eval_batch_size)
        failed = self.lowered[job].key in self.errors  # its row's note: no change is searched for
        fits = not failed and self.compiled(job).fits
        if origin is None and not failed and not fits and job not in self._candidates:
            self._candidates[job] = fix_candidates(self.lowered[job], self.compiled(job))
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
