"""What a compiled TPU program costs, read from its HLO text: how many times each computation runs
per step (every while loop's trip count), the collectives' bytes, the TPU compiler's per-op cycle
estimates, and the declared cost of custom kernels (Pallas/Mosaic `tpu_custom_call`), which the
compiler has no model of its own for.

XLA's `cost_analysis()` counts a loop body once, whatever its trip count; these functions count
every iteration. A trip count is read from the loop's `known_trip_count` when XLA annotated one,
else from its induction variable: a counter of any integer type, compared with a constant in the
condition, stepped by a constant in the body, from a constant start.
"""

from __future__ import annotations

import functools
import math
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterator

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
KERNEL_CALLS = ("tpu_custom_call",)  # Mosaic kernels (Pallas on TPU): cost only as declared

_ARRAY = re.compile(r"\b(pred|[a-z]+?(\d+)[a-z0-9]*)\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][a-z\-]*)\(([^)]*)\)(.*)$")
_WHILE = re.compile(r" while\(%?([\w.\-]+)\).*condition=%?([\w.\-]+), body=%?([\w.\-]+)")
_CALLEE = re.compile(r"\b(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_CALLEE_LIST = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_PASS_THROUGH = ("copy", "bitcast", "convert", "reshape", "copy-done")  # the same integer, moved or retyped


def _bytes(types: str) -> int:
    return sum(math.prod(int(d) for d in dims.split(",") if d) * (int(bits) // 8 if bits else 1)
               for _, bits, dims in _ARRAY.findall(types))


def _group_size(attrs: str) -> int | None:
    """Devices in each replica group of a collective: {{0,1,..},..}, iota [groups,size]<=[n], or
    mesh[axes] {'axis',..} (the product of the named axes); None when not stated ({} = all)."""
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", attrs)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=\[\d+,(\d+)\]<=", attrs)
    if m:
        return int(m.group(1))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", attrs)
    if m:
        sizes = dict(re.findall(r"'([\w.]+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes.get(a, 1)) for a in re.findall(r"'([\w.]+)'", m.group(2)))
    return None


_HEADER = re.compile(r"^(ENTRY )?%?[\w.\-]+ \(.*\{\s*$")


def computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """({computation name: its instruction lines}, the entry computation's name) of HLO text.
    An instruction whose attributes hold line breaks (a Pallas kernel's metadata) is one line."""
    comps: dict[str, list[str]] = {}
    current, entry = None, ""
    for line in hlo.splitlines():
        if _HEADER.match(line):
            words = line.split()
            name = words[1 if words[0] == "ENTRY" else 0].lstrip("%")
            entry = name if words[0] == "ENTRY" else entry
            current = comps.setdefault(name, [])
        elif line.strip() == "}":
            current = None
        elif current is not None and line and not line[0].isspace() and current:
            current[-1] += " " + line  # the rest of the instruction above
        elif current is not None and " = " in line:
            current.append(line)
    return comps, entry


def _instructions(lines: list[str]) -> dict[str, tuple[str, list[str], str]]:
    """{name: (opcode, operand names, attributes)} of a computation's lines."""
    out = {}
    for line in lines:
        m = _INSTR.match(line)
        if m:
            name, _, op, operands, attrs = m.groups()
            names = [o.split()[-1].lstrip("%") for o in re.sub(r"/\*.*?\*/", "", operands).split(",") if o.strip()]
            out[name] = (op, names, attrs)
    return out


def _root(lines: list[str]) -> str | None:
    m = next((_INSTR.match(line) for line in lines if line.lstrip().startswith("ROOT ")), None)
    return m.group(1) if m else None


def _source(name: str, ins: dict) -> str:
    while name in ins and ins[name][0] in _PASS_THROUGH and ins[name][1]:
        name = ins[name][1][0]
    return name


def _constant(name: str, ins: dict) -> int | None:
    op, operands, _ = ins.get(_source(name, ins), ("", [], ""))
    return int(operands[0]) if op == "constant" and operands and re.fullmatch(r"-?\d+", operands[0]) else None


def _element(name: str, ins: dict) -> int | None:
    """k when `name` is element k of the computation's tuple parameter (through copies and casts)."""
    op, _, attrs = ins.get(_source(name, ins), ("", [], ""))
    m = re.search(r"\bindex=(\d+)", attrs) if op == "get-tuple-element" else None
    return int(m.group(1)) if m else None


_MIRROR = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE", "NE": "NE"}


def trip_count(while_line: str, cond: list[str], body: list[str], caller: dict) -> int | None:
    """Iterations of the while loop on `while_line` (in the computation whose `_instructions` are
    `caller`); None when neither XLA's annotation nor a constant-bounded counter gives it."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', while_line)
    if m:
        return int(m.group(1))
    c = _instructions(cond)
    root = c.get(_root(cond) or "")
    direction = re.search(r"direction=(\w+)", root[2]) if root and root[0] == "compare" else None
    if not direction or len(root[1]) != 2:
        return None
    (a, b), d = root[1], direction.group(1)
    if _element(a, c) is not None and _constant(b, c) is not None:
        k, limit = _element(a, c), _constant(b, c)
    elif _element(b, c) is not None and _constant(a, c) is not None:
        k, limit, d = _element(b, c), _constant(a, c), _MIRROR.get(d, "")
    else:
        return None
    b_ins = _instructions(body)
    result = b_ins.get(_root(body) or "")
    if not result or result[0] != "tuple" or k >= len(result[1]):
        return None
    op, operands, _ = b_ins.get(_source(result[1][k], b_ins), ("", [], ""))
    if op not in ("add", "subtract") or len(operands) != 2:
        return None
    x, y = operands
    if _element(x, b_ins) == k and _constant(y, b_ins) is not None:
        step = _constant(y, b_ins) * (1 if op == "add" else -1)
    elif op == "add" and _element(y, b_ins) == k and _constant(x, b_ins) is not None:
        step = _constant(x, b_ins)
    else:
        return None
    loop = _WHILE.search(while_line)
    init_tuple = caller.get(_source(loop.group(1), caller)) if loop else None
    if not init_tuple or init_tuple[0] != "tuple" or k >= len(init_tuple[1]):
        return None
    start = _constant(init_tuple[1][k], caller)
    if start is None or step == 0:
        return None
    if step > 0 and d in ("LT", "LE"):
        return max(0, -(-(limit - start + (d == "LE")) // step))
    if step < 0 and d in ("GT", "GE"):
        return max(0, -(-(start - limit + (d == "GE")) // -step))
    if d == "NE" and (limit - start) % step == 0 and (limit - start) // step >= 0:
        return (limit - start) // step
    return None


def executions(comps: dict[str, list[str]], entry: str, *, unroll: bool = True,
               loops_and_calls_only: bool = False) -> tuple[dict[str, float], list[str]]:
    """({computation: times it runs per step}, the conditions of loops whose trip count is
    unreadable, each counted once). unroll=False counts every loop body once (as XLA's
    cost_analysis does). loops_and_calls_only: follow while bodies, `call`s and conditionals'
    branches only (the computations whose ops carry the TPU compiler's per-op estimates), not
    fusions, reducers or async computations. Each of a conditional's n branches counts 1/n of
    its runs (Gemma's local and global layers share a scanned body and pick their attention
    kernel by `lax.cond`; models/attention.py prices both kernels at the layers' mean)."""
    counts: dict[str, float] = defaultdict(float)
    unreadable: list[str] = []

    def visit(name: str, times: float, path: tuple[str, ...]) -> None:
        counts[name] += times
        lines = comps.get(name, ())
        caller = None
        for line in lines:
            loop = _WHILE.search(line)
            if loop:
                cond, body = loop.group(2), loop.group(3)
                trips = 1
                if unroll:
                    caller = caller if caller is not None else _instructions(lines)
                    trips = trip_count(line, comps.get(cond, []), comps.get(body, []), caller)
                    if trips is None:
                        unreadable.append(cond)
                        trips = 1
                if body not in path:
                    visit(body, times * trips, path + (body,))
                if cond not in path and not loops_and_calls_only:
                    visit(cond, times * (trips + 1), path + (cond,))
                continue
            branching = " conditional(" in line
            if loops_and_calls_only and " call(" not in line and not branching:
                continue
            callees = _CALLEE.findall(line) + [c.strip().lstrip("%") for group in _CALLEE_LIST.findall(line)
                                              for c in group.split(",") if c.strip()]
            callees = list(dict.fromkeys(callees))
            share = 1 / len(callees) if branching and callees else 1  # which branch runs is not in the HLO
            for callee in callees:
                if callee in comps and callee not in path:
                    visit(callee, times * share, path + (callee,))

    visit(entry, 1.0, (entry,))
    return dict(counts), unreadable


@functools.lru_cache(maxsize=2)  # one compile's HLO is read by several of the functions below
def _runs(hlo: str) -> tuple[dict[str, list[str]], dict[str, float]]:
    """(computations, times each runs per step) of HLO text; shared, never to be modified."""
    comps, entry = computations(hlo)
    return comps, executions(comps, entry)[0]


def loop_weight(hlo: str) -> float | None:
    """How much more a step with loops costs than XLA's cost analysis says: the TPU compiler's own
    per-op estimates (`estimated_cycles` of each fusion) summed with every while body times its trip
    count, over the same sum with each body once (as `cost_analysis()` counts). 1.0 without loops;
    None when a trip count or the estimates cannot be read."""
    comps, entry = computations(hlo)
    own = {name: sum(int(m) for line in lines for m in re.findall(r'"estimated_cycles":"(\d+)"', line))
           for name, lines in comps.items()}
    once, _ = executions(comps, entry, unroll=False, loops_and_calls_only=True)
    every, unreadable = executions(comps, entry, loops_and_calls_only=True)
    base = sum(times * own[name] for name, times in once.items())
    return sum(times * own[name] for name, times in every.items()) / base if base > 0 and not unreadable else None


def collective_ops(hlo: str) -> Iterator[tuple[str, int, int | None, float]]:
    """(kind, bytes, devices per group, times per step) of each collective of the compiled HLO,
    once per channel; times: the trip counts of the loops it runs in (1 where unreadable).

    Bytes of one op = the larger of its operands and results (the whole buffer: the gathered
    result of an all-gather, the unreduced operand of a reduce-scatter). TPU's async collective
    fusions repeat an op in several computations under one channel_id, so each channel counts
    once (at the most times any of them runs); an all-reduce inside an `all-reduce-scatter`
    fusion counts as a reduce-scatter. Within one computation every op counts (XLA may give
    several the same channel_id: the n-th of a channel and size is matched across computations).
    """
    for kind, nbytes, group, runs, _ in _collective_table(hlo).values():
        yield kind, nbytes, group, runs


@functools.lru_cache(maxsize=2)
def _collective_table(hlo: str) -> dict[tuple, list]:
    """`collective_ops`' ops by key: [kind, bytes, group, runs, channel id or None]."""
    comps, times = _runs(hlo)
    ops: dict[tuple, list] = {}
    for computation, lines in comps.items():
        sizes: dict[str, int] = {}
        channels: dict[str, re.Match | None] = {}
        nth: dict[tuple, int] = defaultdict(int)
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            name, result, op, operands, attrs = m.groups()
            sizes[name] = _bytes(result)
            channels[name] = channel = re.search(r"channel_id=(\d+)", attrs)
            kind = op.removesuffix("-done")
            if kind not in COLLECTIVES or op.endswith("-start"):  # -start/-done pairs: the done holds the result
                continue
            if kind == "all-reduce" and computation.startswith("all-reduce-scatter"):
                kind = "reduce-scatter"
            if channel is None and op.endswith("-done"):  # its start's
                channel = channels.get(operands.split(",")[0].split()[-1].lstrip("%"))
            operand_bytes = sum(sizes.get(o.strip().lstrip("%"), 0) for o in re.sub(r"/\*.*?\*/", "", operands).split(","))
            nbytes = sizes[name] if op.endswith("-done") else max(sizes[name], operand_bytes)
            key = (kind, channel.group(1), nbytes) if channel else (kind, f"{computation}/{name}", nbytes)
            nth[key] += 1
            key += (nth[key],)
            runs = times.get(computation, 1.0) or 1.0
            if key not in ops:
                ops[key] = [kind, nbytes, _group_size(attrs), runs, channel.group(1) if channel else None]
            else:
                ops[key][3] = max(ops[key][3], runs)
    return ops


def collective_bytes(hlo: str) -> dict[str, tuple[int, int]]:
    """Per kind: (ops run, bytes per chip) per step in the compiled HLO (`collective_ops`)."""
    out: dict[str, list[float]] = defaultdict(lambda: [0, 0])
    for kind, nbytes, _, runs in collective_ops(hlo):
        out[kind][0] += runs
        out[kind][1] += nbytes * runs
    return {k: (int(out[k][0]), int(out[k][1])) for k in COLLECTIVES}


def _wire_share(kind: str, n: int) -> float:
    """The share of a collective's buffer each chip sends, by the ring algorithm over a group of n."""
    return 1.0 if kind == "collective-permute" else (n - 1) / n * (2 if kind == "all-reduce" else 1)


def wire_bytes(hlo: str, devices: int) -> float:
    """Bytes each chip sends per step for the HLO's collectives, by the ring algorithm over a group
    of n: all-reduce 2(n-1)/n of the buffer, all-gather / reduce-scatter / all-to-all (n-1)/n,
    collective-permute all of it; a group not stated spans all `devices`. Every run of a loop counts."""
    return sum(_wire_share(kind, n or devices) * nbytes * runs for kind, nbytes, n, runs in collective_ops(hlo))


_ASYNC_CALLS = {"AsyncCollectiveStart": 1, "AsyncCollectiveDone": -1}  # TPU's async collective fusions
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')


def _async_edge(op: str, attrs: str, comps: dict[str, list[str]]) -> tuple[int, str | None]:
    """(+1 an async collective starts, -1 one is done, 0 neither; the computation holding the
    collective it starts): `<collective>-start` / `-done` and `async-start` / `-done` ops, or TPU's
    fusions whose root is an AsyncCollectiveStart / AsyncCollectiveDone custom call."""
    base = op.removesuffix("-start").removesuffix("-done")
    callee = re.search(r"\bcalls=%?([\w.\-]+)", attrs)
    if base in COLLECTIVES or base == "async":
        if op.endswith("-start"):
            return 1, callee.group(1) if callee else None
        return (-1 if op.endswith("-done") else 0), None
    if op in ("fusion", "custom-call"):
        target = re.search(r'custom_call_target="(\w+)"', attrs) if op == "custom-call" else None
        if target is None and callee:
            root = next((line for line in comps.get(callee.group(1), ()) if line.lstrip().startswith("ROOT ")), "")
            target = re.search(r'custom_call_target="(\w+)"', root)
        edge = _ASYNC_CALLS.get(target.group(1), 0) if target else 0
        return edge, callee.group(1) if edge == 1 and callee else None
    return 0, None


def overlapped_collectives(hlo: str, devices: int) -> list[tuple[float, float, float]]:
    """For each computation that starts collectives asynchronously: (bytes each chip sends for
    them per run, the share of the step's estimated cycles, every loop iteration counted, of the
    ops scheduled while any of them is in flight, times it runs per step). The compiled schedule
    is the order of a computation's instructions; what runs between a start and its done is
    compute that the transfer can hide behind (`hidden_collective_seconds`)."""
    comps, entry = computations(hlo)
    every, unreadable = executions(comps, entry, loops_and_calls_only=True)
    total = sum(times * sum(int(c) for line in comps[name] for c in _CYCLES.findall(line)) for name, times in every.items())
    if unreadable or total <= 0:
        return []
    by_channel = defaultdict(float)
    for kind, nbytes, n, _, channel in _collective_table(hlo).values():
        if channel is not None:
            by_channel[channel] += _wire_share(kind, n or devices) * nbytes
    out = []
    for name, times in every.items():
        in_flight, covered, launched = 0, 0, set()
        for line in comps[name]:
            m = _INSTR.match(line)
            if not m:
                continue
            edge, holder = _async_edge(m.group(3), m.group(5), comps)
            if edge == 1:
                in_flight += 1
                lines = comps.get(holder, []) if holder else [line]
                launched |= {c for held in lines for c in re.findall(r"channel_id=(\d+)", held)}
            elif edge == -1:
                in_flight = max(0, in_flight - 1)
            elif in_flight:
                covered += sum(int(c) for c in _CYCLES.findall(line))
        if launched:
            out.append((sum(by_channel[c] for c in launched), covered / total, times))
    return out


def hidden_collective_seconds(hlo: str, devices: int, compute_s: float, ici_bytes_s: float) -> float:
    """Collective time per step that the schedule overlaps with compute: in each computation that
    starts collectives asynchronously, per run, min(their wire time, the compute scheduled while
    they are in flight), the compute read as its share of the step's cycles times `compute_s`.
    Collectives that are not asynchronous, and kernels (no cycle estimate), hide nothing."""
    return sum(runs * min(nbytes / ici_bytes_s, share * compute_s)
               for nbytes, share, runs in overlapped_collectives(hlo, devices))


@dataclass(frozen=True)
class Kernel:
    """A custom kernel call of the step: its declared cost (Pallas `CostEstimate`, None if it has
    none) and how many times it runs per step."""

    target: str
    flops: float | None
    bytes_accessed: float | None
    runs: float

    def seconds(self, peak_flops: float, hbm_bytes_s: float) -> float:
        """One run at its roofline: max(FLOPs at peak, bytes at HBM bandwidth); 0 without a declared cost."""
        return max((self.flops or 0.0) / peak_flops, (self.bytes_accessed or 0.0) / hbm_bytes_s)


def _float(text: str | None) -> float | None:
    return None if text is None else float(text)


# Kernels that declare no cost of their own (jax's splash attention) priced by the code that calls
# them: an HLO instruction-name prefix -> a function of (instruction name, output types) giving
# (FLOPs, bytes accessed) per run, or None when it does not know the call (models/attention.py).
PRICED_KERNELS: dict[str, Callable[[str, str], tuple[float, float] | None]] = {}


def kernels(hlo: str) -> list[Kernel]:
    """The step's custom kernel calls (`KERNEL_CALLS`, or any custom call that declares a cost)."""
    comps, times = _runs(hlo)
    out = []
    for computation, lines in comps.items():
        for line in lines:
            target = re.search(r' custom-call\(.*custom_call_target="([^"]*)"', line)
            if not target:
                continue
            cost = re.search(r'"cost_estimate":\{([^}]*)\}', line)
            if target.group(1) not in KERNEL_CALLS and not cost:
                continue
            declared = dict(re.findall(r'"(\w+)":"?([\d.eE+\-]+)"?', cost.group(1))) if cost else {}
            flops, nbytes = _float(declared.get("flops")), _float(declared.get("bytes_accessed"))
            instr = _INSTR.match(line)
            if not cost and instr:
                priced = next((fn(instr.group(1), instr.group(2)) for prefix, fn in PRICED_KERNELS.items()
                               if instr.group(1).startswith(prefix)), None)
                flops, nbytes = priced or (None, None)
            out.append(Kernel(target.group(1), flops, nbytes, times.get(computation, 1.0) or 1.0))
    return out


# Custom calls that libtpu's cost model counts as -1 s each (seen: a baseline TRM step with 57
# ConcatBitcast reports -56.97, the same step in float16 with one ZeroCrop more -57.97).
UNMODELLED_CALLS = ("ConcatBitcast", "ZeroCrop")


def _custom_calls(hlo: str) -> tuple[int, int]:
    """(UNMODELLED_CALLS, all custom calls) as cost_analysis() meets them: each call once, one in
    a conditional's branch 1/n of a call (the step's cost counts one branch of n, not each:
    `optimal_seconds`). Rounded down; HLO text without computations: every call once."""
    comps, entry = computations(hlo)
    lines = comps or {"": hlo.splitlines()}
    share = executions(comps, entry, unroll=False)[0] if comps else {}
    known = total = 0.0
    for name, body in lines.items():
        weight = min(1.0, share.get(name, 1.0))  # a branch's share; a call site reached twice still once
        targets = [m.group(1) for line in body for m in [re.search(r'custom_call_target="([^"]*)"', line)] if m]
        known += weight * sum(t in UNMODELLED_CALLS for t in targets)
        total += weight * len(targets)
    return math.floor(known + 1e-9), math.floor(total + 1e-9)


def optimal_seconds(cost: dict, hlo: str, peak_flops: float) -> float | None:
    """XLA's cost-model time of one step on one chip: `optimal_seconds` of `cost_analysis()`,
    the TPU compiler's ideal time of each op (at peak FLOP/s or HBM bandwidth) summed, a loop
    body once. libtpu counts -1 for each op it has no model for: the UNMODELLED_CALLS are added
    back, and where that leaves less than the step's FLOPs at peak, as many of its other custom
    calls as it takes (one by one). None when the key is missing or no such count gives a time.
    A conditional's branches count as one (`_custom_calls`): gemma2_2b_full on v5e-8 at 1024
    with a 512-token window (its local and global kernels under `lax.cond`) gave -16.92 with 18
    ConcatBitcast in the text, one in each of a conditional's two branches; adding back 18 read
    1.078 s (4.76 s of compute after the loop weight), 17 reads 78 ms, the step without the
    conditional 77 ms (docs/ARCHITECTURE.md, Gemma's attention)."""
    raw = cost.get("optimal_seconds")
    if raw is None:
        return None
    floor = 0.99 * float(cost.get("flops", 0.0)) / peak_flops
    known, calls = _custom_calls(hlo)
    for unmodelled in range(known, calls + 1):
        value = float(raw) + unmodelled
        if value > 0 and value >= floor:
            return value
    return None
