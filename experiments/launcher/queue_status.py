"""`launch.py programme status`: the programme at a glance, from its ledger (experiments/launcher/run_queue.py).

A table, one row per variant: state, attempts, preemptions, restarts, pod-hours spent against the
plan's estimate, last step of the total, the group's primary metric (its group.yaml), the W&B run
id; then totals per group and for the programme, and an ETA. The same table goes into a static
HTML page (`status.html` in the programme's directory) with one picture: pod-hours spent against
planned over time, and the primary metric of each variant, group by group.

ETA: each unfinished variant's remaining steps at its own measured pace (READY seconds per step
so far), or, not yet measured, its planned pod-hours scaled by how the measured variants compare
with their plans; summed and shared out over the slices.
"""

from __future__ import annotations

import base64
import html
import io
import time
from dataclasses import dataclass

from experiments.launcher.ledger import Ledger, Progress, VariantState
from experiments.launcher.run_queue import Submission, live_ready_seconds
from experiments.programme import GROUPS, PRIMARY

UNFINISHED = (VariantState.QUEUED, VariantState.RUNNING)
STATES_SHOWN = (VariantState.COMPLETED, VariantState.RUNNING, VariantState.QUEUED, VariantState.FAILED,
                VariantState.SKIPPED)  # the order of the totals' counts


@dataclass
class Row:
    variant: str
    state: str
    attempts: int
    preemptions: int
    restarts: int
    spent: float  # pod-hours
    planned: float | None
    step: int | None
    total: int | None
    metric_name: str
    metric: float | None
    wandb: str | None
    line: str | None


def primary_of(group: str) -> str:
    try:
        return GROUPS[group].primary
    except KeyError:
        return PRIMARY


def rows(sub: Submission, ledger: Ledger, now: float | None = None) -> list[Row]:
    out = []
    for variant, r in sorted(ledger.variants.items(), key=lambda item: item[1].order):
        sup = r.supervision
        # what the running launch said last
        live = (sup.progress if r.state == VariantState.RUNNING else None) or Progress()
        steps = [s for s in (r.last_step, live.step) if isinstance(s, int)]
        name = primary_of(variant.split("/", 1)[0])
        value = (r.metrics or {}).get(name)
        out.append(Row(variant, r.state, r.attempts, sup.preemptions, sup.restarts,
                       live_ready_seconds(ledger, r, now) / 3600, sub.planned_hours(variant), max(steps, default=None),
                       r.total or live.total or (sub.planned.get(variant) or {}).get("steps"), name,
                       value if isinstance(value, (int, float)) else None, r.wandb_run_id or live.wandb_run_id, r.line))
    return out


def eta_hours(sub: Submission, table: list[Row]) -> float | None:
    """Hours until every unfinished variant is done (see the module docstring); None: nothing to go on."""
    measured = [(r.spent, r.planned * (r.step / r.total)) for r in table
                if r.planned and r.step and r.total and r.spent > 0]
    ratio = sum(m for m, _ in measured) / sum(p for _, p in measured) if measured else 1.0
    remaining = 0.0
    for r in table:
        if r.state not in UNFINISHED:
            continue
        if r.step and r.total and r.spent > 0:
            remaining += r.spent / r.step * max(0, r.total - r.step)
        elif r.planned is not None:
            remaining += r.planned * ratio
        else:
            return None
    return remaining / max(1, len(sub.slices))


def _cell(value, fmt: str = "") -> str:
    return "-" if value is None else format(value, fmt)


def columns(r: Row) -> list[str]:
    return [r.variant, r.state, str(r.attempts), str(r.preemptions), str(r.restarts),
            f"{r.spent:.3f}/{_cell(r.planned, '.3f')}", f"{_cell(r.step)}/{_cell(r.total)}",
            f"{r.metric_name}={_cell(r.metric, '.4g')}", r.wandb or "-"]


HEADER = ["variant", "state", "attempts", "preempted", "restarts", "pod-hours/planned", "step/total", "primary",
          "W&B run"]


def totals(table: list[Row]) -> list[list[str]]:
    """One line per group and one for the programme: states, pod-hours spent/planned."""
    groups: dict[str, list[Row]] = {}
    for r in table:
        groups.setdefault(r.variant.split("/", 1)[0], []).append(r)
    out = []
    for name, members in [*groups.items(), ("programme", table)]:
        counts = ", ".join(f"{sum(r.state == s for r in members)} {s}" for s in STATES_SHOWN
                           if any(r.state == s for r in members))
        planned = sum(r.planned or 0.0 for r in members)
        out.append([f"{name} total", counts, "", "", "", f"{sum(r.spent for r in members):.3f}/{planned:.3f}", "", "",
                    ""])
    return out


def text(sub: Submission, ledger: Ledger, now: float | None = None) -> str:
    table = rows(sub, ledger, now)
    lines = [HEADER, *(columns(r) for r in table), *totals(table)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEADER))]
    out = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    controller = ledger.controller
    eta = eta_hours(sub, table)
    out.append(f"controller: {controller.status}" + (f" ({controller.line})" if controller.line else "")
               + f"; ETA {'unknown' if eta is None else f'{eta:.2f} h'}"
               + (f"; budget {sub.budget:g} pod-hours" if sub.budget is not None else ""))
    for r in table:
        if r.state == VariantState.FAILED and r.line:
            out.append(f"{r.variant}: {r.line}")
    return "\n".join(out) + "\n"


def picture(sub: Submission, ledger: Ledger) -> bytes:
    """PNG: pod-hours spent and planned over time; each variant's primary metric, group by group."""
    import matplotlib  # heavy: only for the page

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = rows(sub, ledger)
    fig, (spent_ax, metric_ax) = plt.subplots(1, 2, figsize=(12, 4))
    history = ledger.history
    if history:
        t0 = history[0][0]
        spent_ax.plot([(t - t0) / 3600 for t, _ in history], [h for _, h in history], label="spent (READY)")
        ended = sorted((r.ended, v) for v, r in ledger.variants.items()
                       if r.state == VariantState.COMPLETED and r.ended)
        planned, acc = [], 0.0
        for when, variant in ended:
            acc += sub.planned_hours(variant) or 0.0
            planned.append(((when - t0) / 3600, acc))
        if planned:
            spent_ax.step([t for t, _ in planned], [h for _, h in planned], where="post",
                          label="planned for the variants completed")
    if sub.budget is not None:
        spent_ax.axhline(sub.budget, color="red", linestyle="--", label="budget")
    spent_ax.set(xlabel="hours since the first record", ylabel="pod-hours", title="pod-hours: spent vs planned")
    if spent_ax.get_legend_handles_labels()[0]:  # nothing recorded yet: no lines to name
        spent_ax.legend(loc="upper left")
    scored = [r for r in table if r.metric is not None]
    metric_ax.bar(range(len(scored)), [r.metric for r in scored],
                  color=[f"C{sorted({x.variant.split('/')[0] for x in scored}).index(r.variant.split('/')[0])}"
                         for r in scored])
    metric_ax.set_xticks(range(len(scored)), [r.variant for r in scored], rotation=45, ha="right", fontsize=7)
    metric_ax.set(title="primary metric per variant (colour: group)")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def page(sub: Submission, ledger: Ledger) -> str:
    """The static HTML page: the table, then the picture."""
    table = rows(sub, ledger)
    cells = lambda line, tag: "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in line)  # noqa: E731
    body = "".join(f"<tr class='{html.escape(r.state)}'>{cells(columns(r), 'td')}</tr>" for r in table)
    body += "".join(f"<tr class='total'>{cells(line, 'td')}</tr>" for line in totals(table))
    image = base64.b64encode(picture(sub, ledger)).decode()
    summary = html.escape(text(sub, ledger).splitlines()[len(table) + len(totals(table)) + 1])
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>programme {html.escape(sub.name)}</title>"
            "<style>body{font-family:sans-serif}td,th{padding:2px 8px;text-align:left}.failed{color:#b00}"
            ".completed{color:#070}.total{font-weight:bold}</style></head><body>"
            f"<h1>programme {html.escape(sub.name)}</h1><p>{summary}</p><p>as of "
            f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}</p>"
            f"<table><tr>{cells(HEADER, 'th')}</tr>{body}</table>"
            f"<img alt='pod-hours and primary metrics' src='data:image/png;base64,{image}'></body></html>\n")
