"""Compile the real sharded train step for a TPU topology on any machine, without TPUs.

`python pretrain_jax.py ... compile_only=v5e-8` asks libtpu (installed with `jax[tpu]`) for
compile-only devices of that slice (`jax.experimental.topologies`), plans the run for their
device and host counts (so mesh and batch errors are the usual one line), lowers and compiles
the train step with abstract state and batch, and prints per-chip memory, FLOPs and collective
traffic. FLOPs: the model's by formula (`Task.flops_per_example`, what the run's MFU uses), XLA's
count of the compiled step (which counts a loop body once: TRM/HRM recursion, Gemma's layer
scan), and, when the step has loops, XLA's count of an analysis compile with them unrolled.
Exit 0 if it fits in HBM, `EXIT_DOES_NOT_FIT` if not. No dataset arrays are read.

libtpu is loaded as a PJRT plugin only to describe the topology and compile; no TPU backend is
initialised, so this works under JAX_PLATFORMS=cpu (as in the tests) and on a machine with none.
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from collections import defaultdict
from dataclasses import dataclass

import jax

from runtime.config import Config, compute_dtype, resolve_compute_dtype
from runtime.errors import EXIT_DOES_NOT_FIT, UserError

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
    chip_config: str | None = None  # v4: "megacore" = one JAX device per chip (libtpu's default is per core)

    def chip_counts(self) -> list[int]:  # powers of two from 4 (3-D) or 1 (2-D; no 2-chip slice)
        return [2**k for k in range(int(math.log2(self.max_chips)) + 1) if 2**k >= (4 if self.dims == 3 else 1) and k != 1]


TOPOLOGIES = {g.name: g for g in (
    TpuGeneration("v4", "TPU v4", 30.75, 2, 3, 2048, 4, chip_config="megacore"),
    TpuGeneration("v5p", "TPU v5p", 95.74, 2, 3, 4096, 4),
    TpuGeneration("v5e", "TPU v5e", 15.75, 1, 2, 256, 8),
    TpuGeneration("v6e", "TPU v6e", 31.25, 1, 2, 256, 8),
)}
KNOWN = ", ".join(f"{g.name}-{{{','.join(str(c * g.cores_per_name_unit) for c in g.chip_counts())}}}"
                  for g in TOPOLOGIES.values())
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def slice_shape(gen: TpuGeneration, chips: int) -> list[int]:
    """Cloud TPU's standard shapes: 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4 ... / 1x1, 2x2, 2x4, 4x4, 4x8 ..."""
    shape = [2, 2, 1] if gen.dims == 3 else [1, 1]
    while math.prod(shape) < chips:
        i = max(j for j, s in enumerate(shape) if s == min(shape))  # double the smallest, last on ties
        shape[i] *= 2
    return shape


def topology_devices(name: str) -> tuple[TpuGeneration, list[int], list]:
    gen_name, _, size = name.partition("-")
    gen = TOPOLOGIES.get(gen_name)
    units = int(size) if size.isdigit() else 0
    chips = units // gen.cores_per_name_unit if gen else 0
    if gen is None or chips not in gen.chip_counts() or units % gen.cores_per_name_unit:
        raise UserError(f"compile_only={name} is not a known TPU topology; use one of {KNOWN}")
    shape = slice_shape(gen, chips)
    per_host = shape + [1] * (3 - gen.dims) if chips <= gen.single_host_chips else [2, 2, 1]
    # Without these libtpu looks for a TPU VM's metadata and prints warnings; a real TPU VM keeps its own.
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", name.replace("v5e-", "v5litepod-"))
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # Compile-only touches no TPU: skip libtpu's one-process lockfile, so planning works beside
    # a running job (or another plan) on the same machine.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
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


_ARRAY = re.compile(r"\b(pred|[a-z]+?(\d+)[a-z0-9]*)\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][a-z\-]*)\(([^)]*)\)(.*)$")


def _bytes(types: str) -> int:
    return sum(math.prod(int(d) for d in dims.split(",") if d) * (int(bits) // 8 if bits else 1)
               for _, bits, dims in _ARRAY.findall(types))


def collective_bytes(hlo: str) -> dict[str, tuple[int, int]]:
    """Per kind: (ops, bytes per chip per step) in the compiled HLO.

    Bytes of one op = the larger of its operands and results (the whole buffer: the gathered
    result of an all-gather, the unreduced operand of a reduce-scatter). TPU's async collective
    fusions repeat an op in several computations under one channel_id, so each channel counts
    once; an all-reduce inside an `all-reduce-scatter` fusion counts as a reduce-scatter.
    """
    sizes: dict[str, int] = {}
    seen: set[tuple[str, str]] = set()
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    computation = ""
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            computation = line.split()[0].lstrip("%")
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, result, op, operands, attrs = m.groups()
        sizes[name] = _bytes(result)
        kind = op.removesuffix("-done")
        if kind not in COLLECTIVES or op.endswith("-start"):  # -start/-done pairs: the done holds the result
            continue
        if kind == "all-reduce" and computation.startswith("all-reduce-scatter"):
            kind = "reduce-scatter"
        channel = re.search(r"channel_id=(\d+)", attrs)
        if (kind, channel.group(1) if channel else name) in seen:
            continue
        seen.add((kind, channel.group(1) if channel else name))
        operand_bytes = sum(sizes.get(o.strip().lstrip("%"), 0) for o in re.sub(r"/\*.*?\*/", "", operands).split(","))
        out[kind][0] += 1
        out[kind][1] += sizes[name] if op.endswith("-done") else max(sizes[name], operand_bytes)
    return {k: (out[k][0], out[k][1]) for k in COLLECTIVES}


def _xla_oom(message: str) -> tuple[float, float] | None:
    """(needed, available) GiB from XLA's early ("(32.27G) exceeds available HBM (15.75G)") or final
    ("Used 16.2G of 15.75G hbm") out-of-HBM compile error; None for any other error."""
    m = (re.search(r"\(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)", message)
         or re.search(r"Used ([\d.]+)([KMGT]) of ([\d.]+)([KMGT]) hbm", message))
    if "RESOURCE_EXHAUSTED" not in message or not m:
        return None
    gib = lambda value, unit: float(value) * 1024.0 ** ("KMGT".index(unit) - 2)  # noqa: E731
    return gib(m.group(1), m.group(2)), gib(m.group(3), m.group(4))


def _size(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def report_flops(row, steps, global_batch: int, seq_len: int, compiled, batch) -> None:
    """Model FLOPs per chip by the task's formula (what MFU uses), and XLA's: of the compiled step
    (a loop body counts once) and, when the step has loops, of an analysis compile without them."""
    from runtime.perf import analysis_flops, formula_flops_per_step

    devices = len(steps.abstract_state.step.sharding.mesh.devices.flat)
    formula = formula_flops_per_step(steps.task, seq_len, global_batch, devices)
    if formula:
        row("flops_per_step", f"{formula:.4g} per chip, {formula * devices:.4g} all chips: model FLOPs by formula")
    else:
        row("flops_per_step", "unknown: this model family has no FLOP formula")
    xla = float((compiled.cost_analysis() or {}).get("flops", 0.0))
    has_loops = re.search(r"\bwhile\(", compiled.as_text()) is not None
    row("xla_flops", f"{xla:.4g} per chip: XLA's count of the compiled step"
                     + (" (each loop body once)" if has_loops else " (no loops)"))
    if has_loops:
        t0 = time.perf_counter()
        try:
            unrolled = analysis_flops(steps, steps.abstract_state, batch)
        except jax.errors.JaxRuntimeError as e:  # e.g. out of HBM without the loops' buffer reuse or remat
            row("xla_flops_unrolled", f"unavailable: the analysis compile failed ({str(e).splitlines()[0][:120]})")
            return
        ratio = f"; formula / XLA = {formula / unrolled:.3f}" if formula and unrolled else ""
        row("xla_flops_unrolled", f"{unrolled:.4g} per chip: XLA's count of an analysis compile with loops unrolled, "
                                  f"no remat ({time.perf_counter() - t0:.1f} s){ratio}")


def plan_for_topology(config: Config) -> int:
    """Plan and compile the train step for `config.compile_only`; print the report; return the exit code."""
    from runtime.builder import plan_and_build
    from runtime.registry import dataset_kind
    from runtime.train_step import abstract_batch
    from runtime.trainer import setup_logging

    setup_logging(is_primary=True)
    gen, shape, devices = topology_devices(config.compile_only)
    config = resolve_compute_dtype(config, devices[0].platform)  # "auto": the TPU's, not this host's
    hosts = len({d.process_index for d in devices})
    data = dataset_kind(config.data.name).planned_shape(config.data, config)
    examples, vocab, seq_len, source = data.examples, data.vocab_size, data.seq_len, data.source
    plan, mesh, steps = plan_and_build(config, devices=devices, num_processes=hosts, shape=data)

    row = lambda key, value: print(f"  {key:<18} {value}")  # noqa: E731
    print(f"compile_only {config.compile_only}: {gen.device_kind}, {'x'.join(map(str, shape))} chips, one JAX device per chip")
    row("devices", len(devices))
    row("hosts", f"{hosts} ({len(devices) // hosts} chips each)")
    row("mesh", " ".join(f"{k}={v}" for k, v in plan.mesh_shape.items()))
    row("batch", f"{plan.global_batch_size} global, {plan.per_device_batch_size:g} per device; seq_len {seq_len}, "
                 f"vocab {vocab}; {examples} train examples ({source})")
    if compute_dtype(config.arch) is not None:
        row("compute_dtype", compute_dtype(config.arch))
    t0, batch, hbm = time.perf_counter(), abstract_batch(mesh, plan.global_batch_size, seq_len, steps.batch_fields,
                                                                steps.batch_shapes), gen.hbm_gib * GiB
    try:
        compiled = steps.train.lower(steps.abstract_state, batch).compile()
    except jax.errors.JaxRuntimeError as e:
        oom = _xla_oom(str(e))
        if oom is None:
            raise
        row("compile_s", f"{time.perf_counter() - t0:.1f} (XLA stopped at its memory check)")
        args = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                   for x in jax.tree.leaves((steps.abstract_state, batch)))
        row("arguments", f"{_size(args)} per chip (state + batch shards)")
        row("total", f"{oom[0]:.2f} GiB per chip (XLA's estimate) of {oom[1]:.2f} GiB HBM")
        print(f"does not fit: {oom[0]:.2f} GiB per chip > {oom[1]:.2f} GiB HBM of {gen.device_kind}")
        return EXIT_DOES_NOT_FIT
    row("compile_s", f"{time.perf_counter() - t0:.1f}")
    mem = compiled.memory_analysis()
    # The donated state aliases the new state, so buffers = arguments + outputs - aliased + temporaries.
    # That sum is an upper bound: XLA's peak (its simulation of live ranges) can be lower, and it is
    # what XLA checks against HBM (e.g. 14.67 GiB peak for a 16.37 GiB sum that compiled on v5e).
    upper = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes
    total = getattr(mem, "peak_memory_in_bytes", 0) or upper
    for key, field in (("arguments", "argument"), ("outputs", "output"), ("aliased", "alias"),
                       ("temporaries", "temp"), ("generated_code", "generated_code")):
        row(key, f"{_size(getattr(mem, f'{field}_size_in_bytes'))} per chip")
    row("total", f"{_size(total)} per chip of {gen.hbm_gib} GiB HBM ({100 * total / hbm:.1f}%): XLA's peak; "
                 f"arguments + outputs - aliased + temporaries = {_size(upper)}")
    report_flops(row, steps, plan.global_batch_size, seq_len, compiled, batch)
    for kind, (ops, nbytes) in collective_bytes(compiled.as_text()).items():
        row(kind, f"{ops} ops, {_size(nbytes)} per chip per step")
    if total > hbm:
        print(f"does not fit: {total / GiB:.2f} GiB per chip > {gen.hbm_gib} GiB HBM of {gen.device_kind}")
        return EXIT_DOES_NOT_FIT
    print(f"fits: {_size(total)} per chip <= {gen.hbm_gib} GiB HBM of {gen.device_kind}")
    return 0
