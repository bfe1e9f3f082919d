"""Plan the programme before spending pod time: `launch.py plan <group|all> --topology v4-64`.

For every variant of the chosen groups, at full pod scale on the topology's compile-only devices
(runtime/compile_only.py): does its train step fit the chips' HBM, its estimated step time
(`compile_only.StepEstimate`), its number of steps, and its estimated pod-hours = steps x step
time / 3600 (training steps only; the whole slice is held, so pod-hours are wall-clock hours);
then each group's and the programme's totals. A variant that does not fit names the first of
remat, a smaller batch per chip, or FSDP that a compile shows to fit.

Compiles are cached by what is compiled, not by the config: the key is the train step's lowered
StableHLO with every literal that cannot change the compiled program's cost blanked out
(`hlo_key`), plus the topology. Variants that differ only in a learning rate, betas, an EMA
rate, a seed, names, step counts or cadences lower to the same key and share one compile;
anything that changes a shape, a dtype, a sharding or an op lowers differently. Results are kept
on disk (`CACHE_DIR/<jax and libtpu versions>_<recorder>/<key>.json`, `cache_dir`), so a second
run compiles nothing.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import hashlib
import json
import math
import os
import re
import sys
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

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
class Lowered:
    """A job lowered for the topology: its cache key and what the table needs beside the compile."""

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

    @property
    def pod_hours(self) -> float | None:
        total = getattr(self.estimate, "total_s", None)
        return None if total is None or not self.steps else self.steps * total / 3600


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
    from runtime.compile_only import topology_devices

    gen, shape, devices = topology_devices(name)
    return gen, devices, len({d.process_index for d in devices})


def _build(job: Job, topology: str):
    """(config, plan, steps, abstract batch, data shape) of the job on the topology's devices."""
    from experiments.compose import compose
    from runtime.builder import plan_and_build
    from runtime.config import resolve_compute_dtype, validate
    from runtime.registry import dataset_kind
    from runtime.train_step import abstract_batch

    gen, devices, hosts = _topology(topology)
    config = validate(compose(job.experiment, job.overrides), job.experiment)
    config = resolve_compute_dtype(config, devices[0].platform)  # "auto": the TPU's dtype, not this host's
    data = dataset_kind(config.data.name).planned_shape(config.data, config)
    plan, mesh, steps = plan_and_build(config, devices=devices, num_processes=hosts, shape=data)
    batch = abstract_batch(mesh, plan.global_batch_size, data.seq_len, steps.batch_fields, steps.batch_shapes)
    return config, plan, steps, batch, data


def lower(job: Job, topology: str) -> Lowered:
    """The job's cache key and plan figures; a UserError (e.g. a batch that does not divide over
    the topology) is the row's note, not a failure of the whole plan."""
    from runtime.errors import UserError
    from runtime.perf import formula_flops_per_step

    try:
        config, plan, steps, batch, data = _build(job, topology)
    except UserError as e:
        return Lowered(error=f"not planned on {topology}: {e}")
    key = hlo_key(steps.train.lower(steps.abstract_state, batch).as_text(), topology)
    devices = plan.num_devices
    flops = formula_flops_per_step(steps.task, data.seq_len, plan.global_batch_size, devices)
    scale, note = _curriculum_scale(config, plan.total_steps, steps, data.seq_len)
    remat = getattr(config.arch, "remat", None)
    counted = config.train.steps is not None or data.examples_exact
    if not counted:
        note = "; ".join(n for n in (note, f"steps unknown: train.epochs of a set not on this machine ({data.source}); "
                                           "plan with data.path at the built set") if n)
    return Lowered(key=key, steps=plan.total_steps if counted else 0, model_flops=flops, compute_scale=scale,
                   global_batch=plan.global_batch_size, per_device_batch=plan.per_device_batch_size,
                   remat=remat if isinstance(remat, bool) else None,
                   fsdp_over_all=plan.mesh_shape["fsdp"] == devices, note=note)


def _curriculum_scale(config, total_steps: int, steps, seq_len: int) -> tuple[float, str]:
    """A curriculum compiles one step per (H_cycles, L_cycles) stage; only the arch's own is
    compiled here. The others' compute is taken in proportion to their formula FLOPs."""
    from runtime.config import cycles_at

    c = config.curriculum
    if not (c.H_cycles.on or c.L_cycles.on):
        return 1.0, ""
    first_step, counts = {}, Counter()
    for step in range(total_steps):
        stage = cycles_at(config, step, total_steps)
        first_step.setdefault(stage, step)
        counts[stage] += 1
    base = steps.task.flops_per_example(seq_len)
    if not base:
        return 1.0, "curriculum: every stage taken at the compiled stage's time"
    ratios = {s: steps.at_step(first_step[s]).task.flops_per_example(seq_len) / base for s in counts}
    scale = sum(counts[s] * ratios[s] for s in counts) / total_steps
    note = (f"curriculum: {len(counts)} stages; the arch's (H_cycles, L_cycles) compiled, the others' compute scaled "
            f"by their formula FLOPs (mean {scale:.3f} of it)")
    if max(ratios.values()) > 1 + 1e-9:
        note += "; a stage larger than the compiled one was not checked for memory"
    return scale, note


# ----------------------------------------------------------------------------- compile cache


def cache_dir(root: Path) -> Path:
    """`root/<jax and libtpu versions>_<recorder>`: a compiler update, or a change to the code that
    turns a compile into a `CompiledStep`, starts a fresh cache."""
    import importlib.metadata
    import inspect

    import jax

    from runtime import compile_only as c
    from runtime import hlo_cost, libtpu_flags

    try:
        libtpu = importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        libtpu = "none"
    recorder = [c.CompiledStep, c.compile_train_step, c.cost_figures, c._xla_oom, hlo_cost]  # hlo_cost: the whole module
    flags = libtpu_flags.with_defaults(os.environ.get("LIBTPU_INIT_ARGS", ""))  # what the compiles start libtpu with
    digest = hashlib.sha256(("".join(inspect.getsource(f) for f in recorder) + flags).encode()).hexdigest()[:8]
    return root / f"jax-{jax.__version__}_libtpu-{libtpu}_{digest}"


def cached(directory: Path, key: str):
    from runtime.compile_only import CompiledStep

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


def compile_job(job: Job, topology: str):
    """The job's train step compiled for the topology (a worker process's task)."""
    from runtime.compile_only import compile_train_step

    _, _, steps, batch, _ = _build(job, topology)
    return compile_train_step(steps, batch, _topology(topology)[0])


# ----------------------------------------------------------------------------- the plan


def grad_accum_in_schema() -> bool:
    """Whether TrainConfig has `grad_accum_steps` (micro-batches per optimizer step)."""
    from runtime.config import TrainConfig

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
    compile starts as soon as lowering finds a new key, and a step that does not fit starts its
    search for a change (`fix_candidates`, one compile each) as soon as its result is in."""

    def __init__(self, topology: str, cache_root: Path = CACHE_DIR, workers: int = 1,
                 progress: Callable[[str], None] | None = None):
        self.topology, self.workers = topology, workers
        self.directory = cache_dir(cache_root)
        self.progress = progress or (lambda line: print(line, file=sys.stderr, flush=True))
        self.lowered: dict[Job, Lowered] = {}
        self.errors: dict[str, str] = {}  # key -> why its compile failed (not for lack of memory)
        self.fixes: dict[Job, Job | None] = {}  # a job that does not fit -> the first candidate that does
        self._candidates: dict[Job, list[tuple[str, ...]]] = {}
        self._waiting: dict[str, list[tuple[Job, Job | None]]] = {}  # key -> (job, its trial or None)
        self._running: dict[Future, tuple[str, Job]] = {}  # at most `workers` compiles in the pool at once
        self._queued: list[tuple[str, Job]] = []  # compiles waiting for a free process
        self._pool: ProcessPoolExecutor | None = None
        self._pool_compiles, self._pool_broken = 0, False  # submitted to the current pool; a process of it died
        self._t0, self._compiled = time.perf_counter(), 0

    def plan(self, jobs: list[Job]) -> list[Row]:
        self.progress(f"plan for {self.topology}: lowering {len(jobs)} variants, compiling each train step not in "
                      f"{self.directory} ({self.workers} process{'es' if self.workers > 1 else ''})")
        try:
            for job in jobs:
                self._want(job, None)
                self._collect(timeout=0)
            keys = {self.lowered[j].key for j in jobs if self.lowered[j].key}
            self.progress(f"lowered: {len(keys)} distinct train steps ({time.perf_counter() - self._t0:.0f} s)")
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
            key, job = self._running.pop(future)
            self._compiled_key(key, job, future)
        self._start_queued()

    def _start_queued(self) -> None:
        """Submit queued compiles while a process is free. A pool that has had its share of
        compiles takes no more: once its last one is in, it is shut down and a fresh one started.
        A pool whose process died (BrokenProcessPool, e.g. killed for memory) is replaced too."""
        import multiprocessing

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
            key, job = self._queued.pop(0)
            self._running[self._pool.submit(compile_job, job, self.topology)] = (key, job)
            self._pool_compiles += 1

    def compiled(self, job: Job):
        return cached(self.directory, self.lowered[job].key)

    def _want(self, job: Job, origin: Job | None) -> None:
        """Lower `job` and see its compile through; `origin`: the job whose change it tries."""
        if job not in self.lowered:
            self.lowered[job] = lower(job, self.topology)
        key = self.lowered[job].key
        if not key:
            return
        if key in self.errors or cached(self.directory, key) is not None:
            self._known(job, origin)
            return
        first = key not in self._waiting
        self._waiting.setdefault(key, []).append((job, origin))
        if not first:
            return
        if self.workers <= 1:
            self._compiled_key(key, job, None)
            return
        self._queued.append((key, job))
        self._start_queued()

    def _compiled_key(self, key: str, job: Job, future: Future | None) -> None:
        """Cache the key's result (or note why its compile failed); tell the jobs waiting for it."""
        import jax

        self._compiled += 1
        try:
            result = compile_job(job, self.topology) if future is None else future.result()
            store(self.directory, key, result)
            gib = result.total_bytes / 2**30
            status = f"fits, {gib:.2f} GiB" if result.fits else f"does not fit, {gib:.2f} GiB"
        except BrokenProcessPool:
            self._pool_broken = True
            status = self.errors[key] = ("compile failed: its process died (out of host memory?); "
                                         "plan this group alone, or with --jobs 1")
        except Exception as e:  # XLA's or a kernel's (Mosaic's) compile error: this row's note, the plan goes on
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            name = "" if isinstance(e, jax.errors.JaxRuntimeError) else f"{type(e).__name__}: "
            status = self.errors[key] = f"compile failed: {name}{first}"
        self.progress(f"  compiled [{self._compiled}] {job.experiment} {' '.join(job.overrides)}: {status} "
                      f"({time.perf_counter() - self._t0:.0f} s)")
        for waiter, origin in self._waiting.pop(key, []):
            self._known(waiter, origin)

    def _known(self, job: Job, origin: Job | None) -> None:
        """The job's compile is known: a variant that does not fit starts its search for a change;
        a tried change that fits ends its origin's search, one that does not tries the next."""
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
        from runtime.compile_only import GiB, estimate_step

        low, fix = self.lowered[job], self.fixes.get(job)
        row = Row(job.group, job.variant, key=low.key, note=low.error or self.errors.get(low.key, ""))
        if row.note:
            return row
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
        estimate = estimate_step(used_compiled, _topology(self.topology)[0], used.model_flops)
        if estimate.compute_s is not None and used.compute_scale != 1.0:
            estimate = dataclasses.replace(estimate, compute_s=estimate.compute_s * used.compute_scale)
        row.estimate, row.steps = estimate, used.steps or None
        notes = [row.note, used.note] + ([f"no step time: {estimate.compute_from}"] if estimate.total_s is None else [])
        if estimate.kernel_s or estimate.undeclared_kernels:  # the part the compiler did not model
            notes.append(f"{100 * estimate.kernel_share:.0f}% of the step from kernels' declared cost"
                         + (f", {estimate.undeclared_kernels} kernel calls with none (0 s)" if estimate.undeclared_kernels else ""))
        row.note = "; ".join(n for n in notes if n)
        return row


# ----------------------------------------------------------------------------- output


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _seconds(t: float | None) -> str:
    if t is None:
        return "-"
    return f"{t:.3g} s" if t >= 1 else f"{t * 1e3:.3g} ms"


def totals(rows: list[Row]) -> dict[str, tuple[float, int, int]]:
    """{group: (pod-hours, variants counted, variants without a figure)}, and "all" for the programme."""
    out: dict[str, list] = {}
    for row in rows:
        for name in (row.group, "all"):
            entry = out.setdefault(name, [0.0, 0, 0])
            if row.pod_hours is None:
                entry[2] += 1
            else:
                entry[0] += row.pod_hours
                entry[1] += 1
    return {k: (v[0], v[1], v[2]) for k, v in out.items()}


def markdown(rows: list[Row], topology: str, command: str) -> str:
    from runtime.compile_only import parse_topology

    gen, chips = parse_topology(topology)
    lines = [
        f"Plan for {topology} ({chips} chips, {gen.hbm_gib} GiB HBM each), {datetime.date.today().isoformat()}: "
        f"`{command}`",
        "",
        "Estimates, not measurements. Step time = compute (XLA's `optimal_seconds` of the compiled step, every loop "
        "iteration counted; custom kernels at their declared cost's roofline) + collectives (ring bytes at the chip's "
        "ICI bandwidth, every loop iteration counted), not overlapped; a floor on the "
        "real step time, so MFU is a ceiling (runtime/compile_only.py `StepEstimate`). "
        "Pod-hours = steps x step time / 3600: training steps only (no evaluation, checkpoints, input or compile); "
        "the whole slice is held, so they are wall-clock hours. * = with the change that makes it fit.",
        "",
        f"| variant | fits (GiB per chip of {gen.hbm_gib}) | step time | MFU | steps | pod-hours | to fit / note |",
        "|---|---|---|---|---|---|---|",
    ]
    sums, group = totals(rows), None
    for row in rows + [None]:
        if group is not None and (row is None or row.group != group):
            hours, counted, missing = sums[group]
            lines.append(f"| **{group} total** | | | | | **{hours:.2f}** | {counted} variants"
                         + (f", {missing} without a figure" if missing else "") + " |")
        if row is None:
            break
        group = row.group
        star = "*" if row.change else ""
        fits = "-" if row.fits is None else f"{'yes' if row.fits else 'no'} {row.total_gib:.2f}"
        mfu = getattr(row.estimate, "mfu", None)
        note = f"`{row.change}`; {row.note}" if row.change else row.note
        lines.append(f"| {row.group}/{row.variant} | {fits} | {_seconds(getattr(row.estimate, 'total_s', None))}{star} | "
                     f"{_cell(None if mfu is None else 100 * mfu, '.0f')}{'%' if mfu is not None else ''} | "
                     f"{_cell(row.steps, ',')}{star} | {_cell(row.pod_hours, '.2f')}{star} | {note} |")
    hours, counted, missing = sums.get("all", (0.0, 0, 0))
    lines.append(f"| **programme total** | | | | | **{hours:.2f}** | {counted} variants"
                 + (f", {missing} without a figure" if missing else "") + " |")
    return "\n".join(lines) + "\n"


CSV_FIELDS = ("group", "variant", "fits", "total_gib", "hbm_gib", "compute_s", "kernel_s", "collective_s", "step_s",
              "mfu", "steps", "pod_hours", "change", "note", "key")


def write_csv(rows: list[Row], path: Path) -> None:
    """One line per variant, then one per group (variant TOTAL) and the programme (group ALL)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(CSV_FIELDS)
        for row in rows:
            est = row.estimate
            out.writerow([row.group, row.variant, "" if row.fits is None else row.fits, _g(row.total_gib),
                          _g(row.hbm_gib), _g(getattr(est, "compute_s", None)), _g(getattr(est, "kernel_s", None)),
                          _g(getattr(est, "collective_s", None)),
                          _g(getattr(est, "total_s", None)), _g(getattr(est, "mfu", None)), row.steps or "",
                          _g(row.pod_hours), row.change, row.note, row.key])
        sums = totals(rows)
        for name in [g for g in sums if g != "all"] + ["all"]:
            hours, counted, missing = sums[name]
            out.writerow(["ALL" if name == "all" else name, "TOTAL", "", "", "", "", "", "", "", "", "", _g(hours), "",
                          f"{counted} variants, {missing} without a figure", ""])


def _g(value: float | None) -> str:
    return "" if value is None else repr(float(value))
