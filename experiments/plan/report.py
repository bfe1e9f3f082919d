"""The plan's table (markdown on stdout) and CSV (what `programme --plan` reads)."""

from __future__ import annotations

import csv
import datetime
from dataclasses import dataclass
from pathlib import Path

from experiments.plan.bill import Bill, ends
from experiments.plan.planner import Row, programs_to_keep
from experiments.plan.price import Programme
from runtime.atomic import replacing
from runtime.compile_only import parse_topology
from runtime.goodput import PRODUCTIVE, Category

COLUMNS = ("train_h", "eval_h", "startup_h", "checkpoint_h", "recovery_h", "total_h")


def _cell(value: float | None, fmt: str, unit: str = "") -> str:
    return "-" if value is None else format(value, fmt) + unit


def _seconds(t: float | None) -> str:
    return "-" if t is None else f"{t:.3g} s" if t >= 1 else f"{t * 1e3:.3g} ms"


def _duration(t: float) -> str:
    return f"{t / 60:.1f} min" if t < 3600 else f"{t / 3600:.2f} h"


def _percent(share: float | None) -> str:
    return _cell(None if share is None else 100 * share, ".1f", "%")


@dataclass
class Total:
    """A group's or the programme's sums."""

    hours: dict[str, float]  # COLUMNS and each category -> hours
    counted: int = 0
    missing: int = 0  # variants without a figure

    @property
    def goodput(self) -> float | None:
        total = self.hours.get("total_h", 0.0)
        return (self.hours.get("train_h", 0.0) + self.hours.get("eval_h", 0.0)) / total if total else None


def row_hours(b: Bill) -> dict[str, float]:
    return {"train_h": b.train_s / 3600, "eval_h": b.eval_s / 3600, "startup_h": b.startup_s / 3600,
            "checkpoint_h": b.checkpoint_s / 3600, "recovery_h": b.recovery_s / 3600, "total_h": b.total_s / 3600,
            **{c: b.seconds.get(c, 0.0) / 3600 for c in Category}}


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


def _total_line(label: str, t: Total) -> str:
    return (f"| **{label}** | | | | | | | " + " | ".join(f"**{t.hours.get(c, 0.0):.3f}**" for c in COLUMNS)
            + f" | **{_percent(t.goodput)}** | {t.counted} variants"
            + (f", {t.missing} without a figure" if t.missing else "") + " |")


def both_ends(programme: Programme) -> str:
    """The line above the table: the programme at the figures' low and high ends, and what each
    start-up lever buys at the low end (as a share of the paid time without it)."""
    low, high = ends(programme.figures)
    top = programme.again(figures=high)
    spread = ", ".join(f"{k} {f.seconds:g}-{f.high:g} s" for k, f in programme.figures.items() if f.high is not None)

    def buys(without: Programme, with_: Programme) -> str:
        saved = without.total_h - with_.total_h
        return f"{saved:.2f} pod-hours, {100 * saved / without.total_h if without.total_h else 0:.2f}% of the paid time"

    kept = frozenset(programs_to_keep(programme.rows))
    plain = programme.again(figures=low, ahead=frozenset())
    return (f"**Programme: {programme.total_h:.2f} pod-hours all in, goodput {_percent(programme.goodput)} at the "
            f"figures' low end; {top.total_h:.2f} pod-hours, {_percent(top.goodput)} at the high end** "
            f"({spread or 'one value'})."
            f" At the low end, the {len(kept)} programs kept ahead (`--executables`) would buy "
            f"{buys(plain, plain.again(ahead=kept))}.")


def markdown(programme: Programme, topology: str, command: str, calibrated: str = "") -> str:
    rows = programme.rows
    gen, chips = parse_topology(topology)
    mtbf = (f"one preemption per {programme.mtbf_s / 3600:g} paid hours (--mtbf)" if programme.mtbf_s
            else "no preemptions (give --mtbf to price them)")
    lines = [
        f"Plan for {topology} ({chips} chips, {gen.hbm_gib} GiB HBM each), {datetime.date.today().isoformat()}: "
        f"`{command}`", "",
        "Estimates, not measurements (how to read them: docs/BILL.md). Step time = XLA's "
        "compute of the compiled step + its collectives at the chip's ICI bandwidth less what its schedule overlaps "
        "with compute; against MaxText's published measured runs (MaxText/configs/v5e/README.md: 16B-128B on v5e-256 "
        "slices; MaxText/configs/v4/README.md: 22B and 52B on v4), 15% slower to 6% faster before the overlap rule "
        "(their configs and figures: docs/ARCHITECTURE.md). Hours are pod-hours; startup_h = each first start's fixed costs; recovery_h = replayed steps "
        f"and restarts at {mtbf}; total_h = their sum (the CSV's pod_hours); goodput = (train_h + eval_h) / total_h. "
        "* = with the change that makes it fit. Every variant starts in fresh trainer processes."
        + (f" Steps kept ahead: {len(programme.ahead)} programs, read instead of compiled." if programme.ahead else ""),
        "", both_ends(programme), "",
        f"| variant | fits (GiB per chip of {gen.hbm_gib}) | step time | MFU | steps | eval step | evals | "
        + " | ".join(COLUMNS) + " | goodput | to fit / note |",
        "|---|---|---|---|---|---|---|" + "---|" * len(COLUMNS) + "---|---|",
    ]
    sums = totals(rows)
    for i, row in enumerate(rows):
        star = "*" if row.change else ""
        fits = "-" if row.fits is None else f"{'yes' if row.fits else 'no'} {row.total_gib:.2f}"
        mfu = getattr(row.estimate, "mfu", None)
        note = "; ".join(n for n in (f"`{row.change}`" if row.change else "", row.note, row.eval_note) if n)
        hours = row_hours(row.bill) if row.bill else {}
        if row.bill is not None and not row.bill.eval_known:
            hours["eval_h"] = None  # not priced (see the note), not zero
        cells = " | ".join(_cell(hours.get(c), ".3f") + (star if c == "train_h" and hours else "") for c in COLUMNS)
        goodput = None if row.bill is None or not row.bill.total_s else row.bill.goodput
        lines.append(f"| {row.group}/{row.variant} | {fits} | {_seconds(getattr(row.estimate, 'total_s', None))}{star} | "
                     f"{_cell(None if mfu is None else 100 * mfu, '.0f', '%')} | {_cell(row.steps, ',')}{star} | "
                     f"{_seconds(getattr(row.eval_estimate, 'total_s', None))} | {_evals(row)} | {cells} | "
                     f"{_percent(goodput)} | {note} |")
        if i + 1 == len(rows) or rows[i + 1].group != row.group:  # the group's last row
            lines.append(_total_line(f"{row.group} total", sums[row.group]))
    lines += [_total_line("programme total", sums.get("all", Total({}))), "", summary(programme, calibrated)]
    return "\n".join(lines) + "\n"


def summary(programme: Programme, calibrated: str = "") -> str:
    """Under the table: wall-clock, where the pod-hours go, checkpoint cadence, every figure's source."""
    h = totals(programme.rows).get("all", Total({}))
    slices = programme.slice_hours
    out = [f"**{programme.wall_days:.2f} days on {programme.slices} slice{'s' if programme.slices > 1 else ''}** "
           f"(busiest slice {max(slices, default=0.0):.2f} h; {h.counted} variants priced).", "",
           "| where the pod-hours go | hours | share |", "|---|---|---|"]
    total = h.hours.get("total_h", 0.0) or 1.0
    out += [f"| {c}{' (productive)' if c in PRODUCTIVE else ''} | {h.hours[c]:.2f} | {100 * h.hours[c] / total:.1f}% |"
            for c in Category if h.hours.get(c)]
    priced = [r.bill for r in programme.rows if r.bill is not None]
    if priced and programme.mtbf_s:
        intervals = sorted(b.checkpoint_interval_s for b in priced)
        out += ["", f"Checkpoint cadence: Young's rule, sqrt(2 x blocking save x MTBF) = sqrt(2 x "
                    f"{programme.figures['save'].seconds:g} s x {programme.mtbf_s / 3600:g} h), gives "
                    f"{_duration(priced[0].young_interval_s)} between saves; the variants save every "
                    f"{_duration(intervals[0])} to {_duration(intervals[-1])} (median "
                    f"{_duration(intervals[len(intervals) // 2])}; `train.checkpoint_every_minutes` sets it)."]
    out += ["", "| figure | seconds (low-high) | paid | source |", "|---|---|---|---|"]
    for name, f in programme.figures.items():
        span = f"{f.seconds:g}" + (f"-{f.high:g}" if f.high is not None else "")
        out.append(f"| {name} | {span} | {f.paid} | {f.source}" + (f"; high: {f.high_source}" if f.high_source else "")
                   + " |")
    ledger = "the ledger's median program start-up where a variant ran, else " if calibrated else ""
    out.append("| compiles | per variant (the CSV's compile_s, eval_compile_s) | every launch that compiles | "
               f"{ledger}this plan's own compiles for the topology: each one's CPU seconds on this machine, or its "
               "wall seconds where less |")
    return "\n".join(out)


CSV_FIELDS = ("group", "variant", "fits", "total_gib", "hbm_gib", "compute_s", "kernel_s", "collective_s", "step_s",
              "mfu", "steps", "eval_step_s", "eval_gib", "eval_batch", "evaluations", "eval_batches",
              "final_eval_batches", "eval_examples", "eval_subset", "compile_s", "eval_compile_s",
              *COLUMNS, "pod_hours", "goodput", *(f"{c}_h" for c in Category),
              "preemptions", "saves", "checkpoint_interval_s", "young_interval_s", "change", "note", "key",
              "executables", "executables_digest")


def _g(value: float | None) -> str:
    return "" if value is None else repr(float(value))


def write_csv(rows: list[Row], path: Path) -> None:
    """One line per variant, then one per group (variant TOTAL) and the programme (group ALL)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp, open(tmp, "w", newline="") as f:  # whole or not at all: the budget reads it
        out = csv.DictWriter(f, CSV_FIELDS)
        out.writeheader()
        for row in rows:
            est, p, b = row.estimate, row.lowered.protocol, row.bill
            line = {"group": row.group, "variant": row.variant, "fits": "" if row.fits is None else row.fits,
                    "total_gib": _g(row.total_gib), "hbm_gib": _g(row.hbm_gib), "steps": row.steps or "",
                    **{k: _g(getattr(est, k, None)) for k in ("compute_s", "kernel_s", "collective_s", "mfu")},
                    "step_s": _g(getattr(est, "total_s", None)),
                    "eval_step_s": _g(getattr(row.eval_estimate, "total_s", None)), "eval_gib": _g(row.eval_gib),
                    "eval_batch": p.eval_batch or "", "evaluations": p.evaluations if row.steps else "",
                    "eval_batches": p.batches or "", "final_eval_batches": p.final_batches or "",
                    "eval_examples": "" if p.examples is None else p.examples,
                    "eval_subset": "" if p.subset is None else p.subset,
                    "compile_s": _g(row.compile_s or None), "eval_compile_s": _g(row.eval_compile_s or None),
                    "change": row.change, "note": "; ".join(n for n in (row.note, row.eval_note) if n), "key": row.key,
                    "executables": row.executables, "executables_digest": row.executables_digest}
            if b is not None:
                hours = row_hours(b)
                line |= {c: _g(hours[c]) for c in COLUMNS} | {f"{c}_h": _g(hours[c]) for c in Category}
                if not b.eval_known:
                    line["eval_h"] = ""  # not priced (see the note), not zero
                line |= {"pod_hours": _g(hours["total_h"]), "goodput": _g(b.goodput), "preemptions": _g(b.preemptions),
                         "saves": b.saves, "checkpoint_interval_s": _g(b.checkpoint_interval_s),
                         "young_interval_s": _g(b.young_interval_s)}
            out.writerow(line)
        sums = totals(rows)
        for name in [g for g in sums if g != "all"] + ["all"]:
            t = sums[name]
            line = {"group": "ALL" if name == "all" else name, "variant": "TOTAL", "goodput": _g(t.goodput),
                    "note": f"{t.counted} variants, {t.missing} without a figure",
                    "pod_hours": _g(t.hours.get("total_h", 0.0))}
            line |= {c: _g(t.hours.get(c, 0.0)) for c in COLUMNS}
            line |= {f"{c}_h": _g(t.hours.get(c, 0.0)) for c in Category}
            out.writerow(line)
