"""Compile the real sharded train step for a TPU topology on any machine, without TPUs.

`python pretrain_jax.py ... compile_only=v5e-8` asks libtpu (installed with `jax[tpu]`) for
compile-only devices of that slice (`jax.experimental.topologies`), plans the run for their
device and host counts (so mesh and batch errors are the usual one line), lowers and compiles
the train step with abstract state and batch, and prints per-chip memory, FLOPs, collective
traffic and an estimated step time. FLOPs: the model's by formula (`Task.flops_per_example`,
what the run's MFU uses), XLA's count of the compiled step (which counts a loop body once:
TRM/HRM recursion, Gemma's layer scan), and, when the step has loops, XLA's count of an
analysis compile with them unrolled. Step time: see `estimate_step`. Exit 0 if it fits in HBM,
`EXIT_DOES_NOT_FIT` if not. No dataset arrays are read.

libtpu is loaded as a PJRT plugin only to describe the topology and compile; no TPU backend is
initialised, so this works under JAX_PLATFORMS=cpu (as in the tests) and on a machine with none.
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import cast

import jax

from runtime import events, libtpu_flags
from runtime.hlo_cost import collective_bytes, hidden_collective_seconds, kernels, loop_weight, optimal_seconds, wire_bytes
from runtime.config import Config, compute_dtype, resolve_compute_dtype
from runtime.errors import EXIT_DOES_NOT_FIT, UserError
from runtime.perf import analysis_compile, formula_flops_per_step, peak_flops_for_kind
from runtime.registry import dataset_kind
from runtime.train_step import abstract_batch

log = logging.getLogger("runtime")

GiB = 1 << 30


@dataclass(frozen=True)
class TpuGeneration:
    name: str  # as in slice names: v4-64, v5e-8
    device_kind: str
    hbm_gib: float  # usable HBM per chip as XLA reports it (nominal: v4 32, v5e 16, v5p 96, v6e 32 GiB)
    cores_per_name_unit: int  # v4/v5p slices are named by TensorCores (2 per chip), v5e/v6e by chips
    dims: int  # 3-D torus (v4, v5p) or 2-D (v5e, v6e)
    max_chips: int
    single_host_chips: int  # slices up to this size are one host; larger ones have 4 chips (2x2) per host
    ici_gbytes_s: float  # ICI bandwidth per chip, one direction, GB/s (sources at TOPOLOGIES)
    hbm_gbytes_s: float  # HBM bandwidth per chip, GB/s (a kernel's declared bytes move at this rate)
    chip_config: str | None = None  # v4: "megacore" = one JAX device per chip (libtpu's default is per core)

    def chip_counts(self) -> list[int]:  # powers of two from 4 (3-D) or 1 (2-D; no 2-chip slice)
        return [2**k for k in range(int(math.log2(self.max_chips)) + 1) if 2**k >= (4 if self.dims == 3 else 1) and k != 1]

    @property
    def peak_flops(self) -> float:
        """Peak dense bf16 FLOP/s per chip (runtime.perf's table, the one the run's MFU uses)."""
        return cast(float, peak_flops_for_kind(self.device_kind))  # every TPU in TOPOLOGIES is in its table


# ICI bandwidth, from the Cloud TPU system-architecture pages (docs.cloud.google.com/tpu/docs/<v>):
# v4 "all-reduce bandwidth per Pod 1.1 PB/s" over 4096 chips = 269 GB/s per chip; v5p, v5e, v6e
# "bidirectional inter-chip interconnect bandwidth per chip" 1200, 400, 800 GB/s, halved for one
# direction (v5e/v6e: the same 200/400 GB/s per chip as their "all-reduce bandwidth per Pod",
# 51.2 and 102.4 TB/s over 256 chips). HBM bandwidth per chip, the same pages: v4 1200, v5p 2765,
# v5e 819, v6e 1640 GB/s. Peak FLOP/s: runtime.perf.PEAK_BF16_FLOPS.
TOPOLOGIES = {g.name: g for g in (
    TpuGeneration("v4", "TPU v4", 30.75, 2, 3, 2048, 4, ici_gbytes_s=1.1e6 / 4096, hbm_gbytes_s=1200,
                  chip_config="megacore"),
    TpuGeneration("v5p", "TPU v5p", 95.74, 2, 3, 4096, 4, ici_gbytes_s=1200 / 2, hbm_gbytes_s=2765),
    TpuGeneration("v5e", "TPU v5e", 15.75, 1, 2, 256, 8, ici_gbytes_s=400 / 2, hbm_gbytes_s=819),
    TpuGeneration("v6e", "TPU v6e", 31.25, 1, 2, 256, 8, ici_gbytes_s=800 / 2, hbm_gbytes_s=1640),
)}
KNOWN = ", ".join(f"{g.name}-{{{','.join(str(c * g.cores_per_name_unit) for c in g.chip_counts())}}}"
                  for g in TOPOLOGIES.values())


def slice_shape(gen: TpuGeneration, chips: int) -> list[int]:
    """Cloud TPU's standard shapes: 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4 ... / 1x1, 2x2, 2x4, 4x4, 4x8 ..."""
    shape = [2, 2, 1] if gen.dims == 3 else [1, 1]
    while math.prod(shape) < chips:
        i = max(j for j, s in enumerate(shape) if s == min(shape))  # double the smallest, last on ties
        shape[i] *= 2
    return shape


def parse_topology(name: str, what: str = "compile_only=") -> tuple[TpuGeneration, int]:
    """(generation, chips) of a slice name such as v4-64; UserError naming `what` for any other."""
    gen_name, _, size = name.partition("-")
    gen = TOPOLOGIES.get(gen_name)
    units = int(size) if size.isdigit() else 0
    chips = units // gen.cores_per_name_unit if gen else 0
    if gen is None or chips not in gen.chip_counts() or units % gen.cores_per_name_unit:
        raise UserError(f"{what}{name} is not a known TPU topology; use one of {KNOWN}")
    return gen, chips


def topology_devices(name: str) -> tuple[TpuGeneration, list[int], list]:
    gen, chips = parse_topology(name)
    shape = slice_shape(gen, chips)
    per_host = shape + [1] * (3 - gen.dims) if chips <= gen.single_host_chips else [2, 2, 1]
    # Without these libtpu looks for a TPU VM's metadata and prints warnings; a real TPU VM keeps its own.
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", name.replace("v5e-", "v5litepod-"))
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # Compile-only touches no TPU: skip libtpu's one-process lockfile, so planning works beside
    # a running job (or another plan) on the same machine.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    libtpu_flags.apply()  # the options a run's libtpu starts with (runtime/libtpu_flags.py)
    from jax.experimental import topologies

    kwargs = {"chips_per_host_bounds": per_host} | ({"chip_config_name": gen.chip_config} if gen.chip_config else {})
    devices = topologies.get_topology_desc(f"{gen.name}:{'x'.join(map(str, shape))}", "tpu", **kwargs).devices
    if len(devices) != chips:
        raise RuntimeError(f"libtpu gave {len(devices)} devices for {name}, expected one per chip ({chips})")
    return gen, shape, list(devices)


def expected_local_devices(accelerator_type: str) -> int:
    """JAX devices one worker of this slice should see, e.g. v4-64 -> 4, v5litepod-8 -> 8 (setup_tpu.sh)."""
    name = accelerator_type.replace("v5litepod-", "v5e-")
    gen_name, _, size = name.partition("-")
    gen = TOPOLOGIES.get(gen_name)
    if gen is None or not size.isdigit():
        raise ValueError(f"unknown accelerator type {accelerator_type!r}")
    chips = int(size) // gen.cores_per_name_unit
    return chips if chips <= gen.single_host_chips else 4


def _xla_oom(message: str) -> tuple[float, float] | None:
    """(needed, available) GiB from XLA's early ("(32.27G) exceeds available HBM (15.75G)") or final
    ("Used 16.2G of 15.75G hbm") out-of-HBM compile error; None for any other error."""
    m = (re.search(r"\(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)", message)
         or re.search(r"Used ([\d.]+)([KMGT]) of ([\d.]+)([KMGT]) hbm", message))
    if "RESOURCE_EXHAUSTED" not in message or not m:
        return None
    gib = lambda value, unit: float(value) * 1024.0 ** ("KMGT".index(unit) - 2)  # noqa: E731
    return gib(m.group(1), m.group(2)), gib(m.group(3), m.group(4))


def _seconds(t: float) -> str:
    return f"{t:.4g} s" if t >= 1 else f"{t * 1e3:.4g} ms"


def _size(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


MEMORY_FIELDS = (("arguments", "argument"), ("outputs", "output"), ("aliased", "alias"),
                 ("temporaries", "temp"), ("generated_code", "generated_code"))


@dataclass(frozen=True)
class CompiledStep:
    """What one TPU compile of a train step says, per chip. Plain data: `launch.py plan` caches
    it by the step's HLO (nothing here depends on names or on values that are not shapes)."""

    hbm_bytes: float  # usable HBM per chip
    total_bytes: float  # XLA's peak; its own estimate when it stopped at the memory check
    memory: dict[str, float] = field(default_factory=dict)  # MEMORY_FIELDS and "upper" (their sum)
    stopped: bool = False  # XLA stopped at its memory check: does not fit, no counts
    xla_flops: float = 0.0  # XLA's count of the compiled step (a loop body once)
    optimal_s: float | None = None  # `optimal_seconds`, the same way
    has_loops: bool = False
    loop_weight: float | None = 1.0  # `loop_weight`: the cost of every loop iteration over each body once
    collectives: dict[str, tuple[int, int]] = field(default_factory=dict)  # kind -> (ops run, bytes) per step
    wire_bytes: float = 0.0  # `wire_bytes`: sent per chip per step by the ring algorithm, every loop run counted
    hidden_collective_s: float = 0.0  # `hidden_collective_seconds`: of their time, what the schedule overlaps with compute
    # Custom kernels (Pallas): the compiler has no model of them, so their time is their declared
    # cost at the roofline (`hlo_cost.Kernel.seconds`): each call once (as optimal_s counts them),
    # and every run of their loops; kernels that declare no cost count as 0.
    kernel_once_s: float = 0.0
    kernel_s: float = 0.0
    undeclared_kernels: int = 0
    compile_s: float = 0.0  # wall seconds
    compile_cpu_s: float = 0.0  # CPU seconds of this process (every thread): what other work on the machine does not stretch

    @property
    def fits(self) -> bool:
        return not self.stopped and self.total_bytes <= self.hbm_bytes


def compile_train_step(steps, batch, gen: TpuGeneration) -> CompiledStep:
    """Compile `steps.train` for the topology its mesh is on; out of HBM is a result, not an error."""
    return compile_step(steps.train, (steps.abstract_state, batch), gen)


def compile_step(step, args: tuple, gen: TpuGeneration) -> CompiledStep:
    """Compile the jitted `step` for abstract `args` (sharded on the topology's devices); out of
    HBM is a result (`CompiledStep.stopped`), not an error."""
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        compiled = step.lower(*args).compile()
    except jax.errors.JaxRuntimeError as e:
        oom = _xla_oom(str(e))
        if oom is None:
            raise
        size = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(args))
        return CompiledStep(oom[1] * GiB, oom[0] * GiB, {"arguments": float(size)}, stopped=True,
                            compile_s=time.perf_counter() - t0, compile_cpu_s=time.process_time() - c0)
    compile_s, compile_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    mem = compiled.memory_analysis()
    memory = {key: float(getattr(mem, f"{name}_size_in_bytes")) for key, name in MEMORY_FIELDS}
    # The donated state aliases the new state, so buffers = arguments + outputs - aliased + temporaries.
    # That sum is an upper bound: XLA's peak (its simulation of live ranges) can be lower, and it is
    # what XLA checks against HBM (e.g. 14.67 GiB peak for a 16.37 GiB sum that compiled on v5e).
    memory["upper"] = memory["arguments"] + memory["outputs"] - memory["aliased"] + memory["temporaries"]
    devices = len(next(x for x in jax.tree.leaves(args) if hasattr(x, "sharding")).sharding.mesh.devices.flat)
    return CompiledStep(
        hbm_bytes=gen.hbm_gib * GiB, total_bytes=float(getattr(mem, "peak_memory_in_bytes", 0) or memory["upper"]),
        memory=memory, compile_s=compile_s, compile_cpu_s=compile_cpu_s, **cost_figures(compiled.as_text(), compiled.cost_analysis() or {}, gen, devices))


def cost_figures(hlo: str, cost: dict, gen: TpuGeneration, devices: int) -> dict:
    """The `CompiledStep` fields that come from a compiled program's HLO text and cost analysis."""
    calls = kernels(hlo)
    hbm_rate = gen.hbm_gbytes_s * 1e9
    optimal_s, weight = optimal_seconds(cost, hlo, gen.peak_flops), loop_weight(hlo)
    kernel_once_s = sum(k.seconds(gen.peak_flops, hbm_rate) for k in calls)
    own_s = max(0.0, optimal_s - kernel_once_s) * weight if optimal_s is not None and weight else 0.0  # as estimate_step
    return dict(xla_flops=float(cost.get("flops", 0.0)), optimal_s=optimal_s,
                has_loops=re.search(r"\bwhile\(", hlo) is not None, loop_weight=weight,
                collectives=collective_bytes(hlo), wire_bytes=wire_bytes(hlo, devices),
                hidden_collective_s=hidden_collective_seconds(hlo, devices, own_s, gen.ici_gbytes_s * 1e9),
                kernel_once_s=kernel_once_s,
                kernel_s=sum(k.runs * k.seconds(gen.peak_flops, hbm_rate) for k in calls),
                undeclared_kernels=sum(k.flops is None and k.bytes_accessed is None for k in calls))


@dataclass(frozen=True)
class StepEstimate:
    """An ESTIMATED train-step time from the compiler's cost model, not a measurement:
    compute (XLA's ideal per-op times of the compiled step, `optimal_seconds`, every loop
    iteration counted) plus the collectives' time (`wire_bytes` at the chip's ICI bandwidth) that
    the compiled schedule does not overlap with compute (`hidden_collective_seconds`). Its error
    against measured runs: docs/ARCHITECTURE.md, "The step-time estimate overlaps what the
    compiled schedule overlaps". Evaluation, host work and input are not in it."""

    compute_s: float | None  # None: no usable figure (see compute_from)
    compute_from: str
    collective_s: float  # the part not hidden behind compute
    model_flops: float | None  # per chip per step, by the task's formula
    peak_flops: float  # per chip
    kernel_s: float = 0.0  # the part of compute_s that is custom kernels' declared cost (roofline)
    undeclared_kernels: int = 0  # custom kernels with no declared cost, counted as 0 s

    @property
    def kernel_share(self) -> float:
        """The share of the estimate that comes from declared kernel costs, not the compiler's model."""
        return self.kernel_s / self.total_s if self.total_s else 0.0

    @property
    def total_s(self) -> float | None:
        return None if self.compute_s is None else self.compute_s + self.collective_s

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilisation the estimate implies: formula FLOPs / (step time x peak)."""
        if not (self.total_s and self.model_flops):
            return None
        return self.model_flops / (self.total_s * self.peak_flops)


def estimate_step(compiled: CompiledStep, gen: TpuGeneration, model_flops: float | None) -> StepEstimate:
    """The step's estimated time. Compute: the compiled step's `optimal_seconds`, which counts a
    loop body once, times its `loop_weight`; where that cannot be read, times formula FLOPs /
    XLA's FLOPs of the same compile (the loops' share of time taken as their share of FLOPs).
    Custom kernels, which carry no per-op estimate, are taken out of `optimal_seconds` once and
    added back at their declared cost for every run (`CompiledStep.kernel_s`)."""
    kernel_s = compiled.kernel_s
    own_s = None if compiled.optimal_s is None else max(0.0, compiled.optimal_s - compiled.kernel_once_s)
    if compiled.stopped:
        compute, source = None, "none: the step does not fit"
    elif own_s is None:  # no optimal_s
        compute, source = None, "none: XLA's cost analysis gave no usable optimal_seconds"
    elif not compiled.has_loops:
        compute, source = own_s + kernel_s, "XLA optimal_seconds of the compiled step (no loops)"
    elif compiled.loop_weight is not None:
        compute = own_s * compiled.loop_weight + kernel_s
        source = (f"XLA optimal_seconds of the compiled step x {compiled.loop_weight:.3g} for its loops' "
                  "iterations, by the compiler's per-op cycle estimates")
    elif model_flops and compiled.xla_flops:
        compute = own_s * model_flops / compiled.xla_flops + kernel_s
        source = "XLA optimal_seconds of the compiled step x formula / XLA FLOPs (loop trip counts not readable)"
    else:
        compute, source = None, "none: the step's loop trip counts are not readable and it has no FLOP formula"
    exposed = max(0.0, compiled.wire_bytes / (gen.ici_gbytes_s * 1e9) - compiled.hidden_collective_s)
    return StepEstimate(compute, source, exposed, model_flops, gen.peak_flops,
                        kernel_s=kernel_s if compute is not None else 0.0, undeclared_kernels=compiled.undeclared_kernels)


@dataclass(frozen=True)
class TopologyReport:
    """Everything `compile_only` prints for one config on one topology."""

    topology: str
    generation: TpuGeneration
    devices: int
    hosts: int
    compiled: CompiledStep
    model_flops: float | None  # per chip per step, by formula
    unrolled_flops: float | None  # XLA's count of the analysis compile (steps with loops)
    unrolled_s: float | None  # its optimal_seconds
    estimate: StepEstimate


def _unrolled(row, steps, batch, gen: TpuGeneration) -> tuple[float | None, float | None]:
    """(XLA FLOPs, optimal_seconds) of the analysis compile with loops unrolled and no remat."""
    t0 = time.perf_counter()
    try:
        compiled = analysis_compile(steps, steps.abstract_state, batch)
    except jax.errors.JaxRuntimeError as e:  # e.g. out of HBM without the loops' buffer reuse or remat
        row("xla_flops_unrolled", f"unavailable: the analysis compile failed ({str(e).splitlines()[0][:120]})")
        return None, None
    cost = compiled.cost_analysis() or {}
    row("analysis_s", f"{time.perf_counter() - t0:.1f} (the analysis compile with loops unrolled, no remat)")
    return float(cost.get("flops", 0.0)), optimal_seconds(cost, compiled.as_text(), gen.peak_flops)


def _report_flops(row, compiled: CompiledStep, formula: float | None, unrolled: float | None, devices: int) -> None:
    if formula:
        row("flops_per_step", f"{formula:.4g} per chip, {formula * devices:.4g} all chips: model FLOPs by formula")
    else:
        row("flops_per_step", "unknown: this model family has no FLOP formula")
    row("xla_flops", f"{compiled.xla_flops:.4g} per chip: XLA's count of the compiled step"
                     + (" (each loop body once)" if compiled.has_loops else " (no loops)"))
    if unrolled:
        ratio = f"; formula / XLA = {formula / unrolled:.3f}" if formula else ""
        row("xla_flops_unrolled", f"{unrolled:.4g} per chip: XLA's count of the analysis compile with loops unrolled, "
                                  f"no remat{ratio}")


def _report_estimate(row, est: StepEstimate, compiled: CompiledStep, gen: TpuGeneration) -> None:
    if est.total_s is None or est.compute_s is None:  # both or neither
        row("step_time", f"no estimate ({est.compute_from})")
        return
    row("step_time", f"{_seconds(est.total_s)} per step (estimate) = compute {_seconds(est.compute_s)} "
                     f"({est.compute_from}) + collectives {_seconds(est.collective_s)} "
                     f"({_size(compiled.wire_bytes)} sent per chip at {gen.ici_gbytes_s:.0f} GB/s ICI, less "
                     f"{_seconds(compiled.hidden_collective_s)} the schedule overlaps with compute)")
    if compiled.kernel_s or compiled.undeclared_kernels:
        row("kernels", f"{_seconds(est.kernel_s)} of it ({100 * est.kernel_share:.1f}%) from custom kernels' declared "
                       f"cost at the roofline, max(FLOPs / peak, bytes / {gen.hbm_gbytes_s:.0f} GB/s HBM)"
            + (f"; {compiled.undeclared_kernels} kernel calls declare no cost (counted as 0)"
               if compiled.undeclared_kernels else ""))
    if est.mfu is not None:
        row("mfu_estimate", f"{100 * est.mfu:.1f}%: formula FLOPs / (estimated step time x {est.peak_flops / 1e12:.0f} "
                            f"TFLOP/s peak bf16 per chip); its error band: docs/ARCHITECTURE.md")


def topology_report(config: Config, row) -> TopologyReport:
    """Plan and compile the train step for `config.compile_only`, printing each figure through
    `row(key, value)` as it is known; the figures as a `TopologyReport`."""
    from runtime.builder import plan_and_build  # a cycle: runtime/builder.py imports this module

    topology = cast(str, config.compile_only)  # this runs for a config that names one
    gen, shape, devices = topology_devices(topology)
    config = resolve_compute_dtype(config, devices[0].platform)  # "auto": the TPU's, not this host's
    hosts = len({d.process_index for d in devices})
    data = dataset_kind(config.data.name).planned_shape(config.data, config)
    plan, mesh, steps = plan_and_build(config, devices=devices, num_processes=hosts, shape=data)
    print(f"compile_only {config.compile_only}: {gen.device_kind}, {'x'.join(map(str, shape))} chips, one JAX device per chip")
    row("devices", len(devices))
    row("hosts", f"{hosts} ({len(devices) // hosts} chips each)")
    row("mesh", " ".join(f"{k}={v}" for k, v in plan.mesh_shape.items()))
    row("batch", f"{plan.global_batch_size} global, {plan.per_device_batch_size:g} per device; seq_len {data.seq_len}, "
                 f"vocab {data.vocab_size}; {data.examples} train examples ({data.source})")
    if compute_dtype(config.arch) is not None:
        row("compute_dtype", compute_dtype(config.arch))
    k = config.train.grad_accum_steps
    if k > 1:
        row("grad_accum", f"{k} micro-batches of {plan.global_batch_size // k} ({plan.per_device_batch_size / k:g} "
                          "per device) per step, one at a time (train.grad_accum_steps)")
    batch = abstract_batch(mesh, plan.global_batch_size, data.seq_len, steps.batch_fields, steps.batch_shapes)
    compiled = compile_train_step(steps, batch, gen)
    formula = formula_flops_per_step(steps.task, data.seq_len, plan.global_batch_size, len(devices))
    if compiled.stopped:
        row("compile_s", f"{compiled.compile_s:.1f} (XLA stopped at its memory check)")
        row("arguments", f"{_size(compiled.memory['arguments'])} per chip (state + batch shards)")
        row("total", f"{compiled.total_bytes / GiB:.2f} GiB per chip (XLA's estimate) of {compiled.hbm_bytes / GiB:.2f} GiB HBM")
        return TopologyReport(topology, gen, len(devices), hosts, compiled, formula, None, None,
                              estimate_step(compiled, gen, formula))
    row("compile_s", f"{compiled.compile_s:.1f}")
    for key, _ in MEMORY_FIELDS:
        row(key, f"{_size(compiled.memory[key])} per chip")
    total, hbm = compiled.total_bytes, compiled.hbm_bytes
    row("total", f"{_size(total)} per chip of {gen.hbm_gib} GiB HBM ({100 * total / hbm:.1f}%): XLA's peak; "
                 f"arguments + outputs - aliased + temporaries = {_size(compiled.memory['upper'])}")
    estimate = estimate_step(compiled, gen, formula)
    _report_estimate(row, estimate, compiled, gen)
    unrolled_flops, unrolled_s = _unrolled(row, steps, batch, gen) if compiled.has_loops else (None, None)
    _report_flops(row, compiled, formula, unrolled_flops, len(devices))
    if unrolled_s is not None:
        row("xla_time_unrolled", f"{_seconds(unrolled_s)}: optimal_seconds of the analysis compile, a different program "
                                 "(no loops, no remat), for comparison with step_time's compute")
    for kind, (ops, nbytes) in compiled.collectives.items():
        row(kind, f"{ops} ops, {_size(nbytes)} per chip per step (every loop iteration counted)")
    return TopologyReport(topology, gen, len(devices), hosts, compiled, formula, unrolled_flops, unrolled_s,
                          estimate)


def plan_for_topology(config: Config) -> int:
    """Plan and compile the train step for `config.compile_only`; print the report; return the exit code."""
    from runtime.trainer import setup_logging  # a cycle: the trainer imports runtime/builder.py, which imports this

    setup_logging(is_primary=True)
    report = topology_report(config, lambda key, value: print(f"  {key:<18} {value}"))
    compiled, name = report.compiled, report.generation.device_kind
    if not compiled.fits:
        line = f"does not fit: {compiled.total_bytes / GiB:.2f} GiB per chip > {compiled.hbm_bytes / GiB:.2f} GiB HBM of {name}"
        print(line, flush=True)
        events.failed(EXIT_DOES_NOT_FIT, line)  # the event carries the line, not "the log above says why"
        return EXIT_DOES_NOT_FIT
    print(f"fits: {_size(compiled.total_bytes)} per chip <= {report.generation.hbm_gib} GiB HBM of {name}")
    return 0
