"""`launch.py programme status`: the programme at a glance, from its ledger (experiments/launcher/
queue_state.py): a table, one row per variant, with totals per group and for the programme, each
slice's idle time, the controller, an ETA and the failed variants' lines (docs/RUNNING.md,
"Status", says each column); the same in a static page (`status.html`) with two pictures: where
each variant's paid time went, and pod-hours spent against planned with each variant's primary
metric.
"""

from __future__ import annotations

import base64
import html
import io
import itertools
import time
from dataclasses import dataclass

from experiments.launcher.account import Account, Programme, badput_text, goodput_text, programme_account
from experiments.launcher.ledger import Ledger, VariantState
from experiments.launcher.queue_state import BUDGET, Submission
from experiments.programme import GROUPS, PRIMARY
from runtime.goodput import Category
from runtime.ranges import range_problem

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
    account: Account  # where its paid time went


def primary_of(group: str) -> str:
    return GROUPS[group].primary if group in GROUPS else PRIMARY


def rows(sub: Submission, ledger: Ledger, accounts: Programme) -> list[Row]:
    out = []
    for variant, r in sorted(ledger.variants.items(), key=lambda item: item[1].order):
        sup = r.supervision
        name = primary_of(variant.split("/", 1)[0])
        value = (r.metrics or {}).get(name)
        account = accounts.variants[variant]
        out.append(Row(variant, r.state, r.attempts, sup.preemptions, sup.restarts, account.paid / 3600,
                       sub.planned_hours(variant), r.said("last_step"),
                       r.said("total") or (sub.planned.get(variant) or {}).get("steps"), name,
                       value if isinstance(value, (int, float)) else None, r.said("wandb_run_id"), r.verdict(),
                       account))
    return out


def eta_hours(sub: Submission, table: list[Row]) -> float | None:
    """Hours until every unfinished variant is done: its remaining steps at its own measured pace (READY
    seconds per step so far), or, not yet measured, its planned pod-hours scaled by how the measured
    variants compare with their plans; summed and shared out over the slices. None: nothing to go on."""
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


def columns(r: Row, links: dict | None = None) -> list[str]:
    """A row's cells; `links` (experiments/dashboard.py `links`): its W&B run as the run page's URL."""
    run = f"{links['runs']}{r.wandb}" if links and r.wandb else r.wandb or "-"
    return [r.variant, r.state, str(r.attempts), str(r.preemptions), str(r.restarts),
            f"{r.spent:.3f}/{_cell(r.planned, '.3f')}", f"{_cell(r.step)}/{_cell(r.total)}",
            goodput_text(r.account), badput_text(r.account), f"{r.metric_name}={_cell(r.metric, '.4g')}",
            run]


HEADER = ["variant", "state", "attempts", "preempted", "restarts", "pod-hours/planned", "step/total", "goodput",
          "badput (top 3)", "primary", "W&B run"]


def totals(table: list[Row], accounts: Programme, links: dict | None = None) -> list[list[str]]:
    """One line per group and one for the programme: states, pod-hours spent/planned, goodput and
    badput (the programme's paid time is every slice's READY time: its idle time too), and the
    group's W&B workspace when `links` has it."""
    groups: dict[str, list[Row]] = {}
    for r in table:
        groups.setdefault(r.variant.split("/", 1)[0], []).append(r)
    out = []
    for name, members in [*groups.items(), ("programme", table)]:
        counts = ", ".join(f"{sum(r.state == s for r in members)} {s}" for s in STATES_SHOWN
                           if any(r.state == s for r in members))
        planned = sum(r.planned or 0.0 for r in members)
        account = accounts.total if name == "programme" else sum((r.account for r in members), Account())
        out.append([f"{name} total", counts, "", "", "", f"{account.paid / 3600:.3f}/{planned:.3f}", "",
                    goodput_text(account), badput_text(account), "", ((links or {}).get("groups") or {}).get(name, "")])
    return out


def summary(sub: Submission, ledger: Ledger, table: list[Row], accounts: Programme) -> list[str]:
    """The lines under the table: each slice's idle time, the controller, the ETA and the budget."""
    controller = ledger.controller
    eta = eta_hours(sub, table)
    idle = ", ".join(f"{name} {seconds / 3600:.3f}" for name, seconds in accounts.idle.items())
    kept = [name for name, s in ledger.slices.items() if s.clock.ready_since is not None and not s.variant]
    return [f"idle READY time (pod-hours): {idle or '-'}"
            + (f"; READY with nothing running, billing {len(kept)} pod-hour{'s' * (len(kept) != 1)} an hour: "
               f"{', '.join(kept)}" if kept and controller.status != "running" else ""),
            f"controller: {controller.status}" + (f" ({controller.line})" if controller.line else "")
            + f"; ETA {'unknown' if eta is None else f'{eta:.2f} h'}"
            + (f"; budget {sub.budget:g} pod-hours" if sub.budget is not None else "")]


def failures(table: list[Row]) -> list[str]:
    return [f"{r.variant}: {r.line}" for r in table if r.state == VariantState.FAILED and r.line]


def text(sub: Submission, ledger: Ledger, now: float | None = None, links: dict | None = None) -> str:
    accounts = programme_account(ledger, now)
    table = rows(sub, ledger, accounts)
    lines = [HEADER, *(columns(r, links) for r in table), *totals(table, accounts, links)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEADER))]
    out = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    out += summary(sub, ledger, table, accounts)
    out += failures(table)
    return "\n".join(out) + "\n"


# The categories' colours: productive in greens, the rest apart (greys: idle and the remainder).
COLOURS = {"train": "#2ca02c", "eval": "#98df8a", "setup": "#1f77b4", "runtime_startup": "#aec7e8",
           "data_loading": "#9467bd", "program_startup": "#ff7f0e", "checkpoint_save": "#8c564b",
           "checkpoint_restore": "#c49c94", "wasted_progress": "#d62728", "idle": "#7f7f7f", "other": "#c7c7c7"}


def _pyplot():
    import matplotlib  # heavy and optional: only for the page

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    fig.clf()
    _pyplot().close(fig)
    return buf.getvalue()


def goodput_picture(table: list[Row], accounts: Programme) -> bytes:
    """PNG: a stacked bar per variant that was paid for (its paid time by category, its goodput at the
    end), and one for the slices' idle time (with what the ledger did not attribute, as `other`)."""
    plt = _pyplot()
    bars = [(r.variant, r.account.seconds, r.account) for r in table if r.account.paid > 0]
    idle = sum(accounts.idle.values())
    if idle > 0 or accounts.unattributed > 0:
        bars.append(("idle READY time (slices)", {Category.IDLE: idle, "other": max(0.0, accounts.unattributed)}, None))
    hours = max((sum(max(0.0, v) for v in seconds.values()) for _, seconds, _ in bars), default=0.0) >= 3600
    unit, scale = ("pod-hours", 3600) if hours else ("pod-minutes", 60)
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.45 * max(1, len(bars))))
    shown = set()
    for y, (_, seconds, account) in enumerate(bars):
        left = 0.0
        for name in Category:
            width = max(0.0, seconds.get(name, 0.0)) / scale
            if width <= 0:
                continue
            ax.barh(y, width, left=left, color=COLOURS[name], label=None if name in shown else name, height=0.7)
            shown.add(name)
            left += width
        note = "" if account is None else (f" goodput {goodput_text(account)}" if account.measured else " not measured")
        ax.text(left, y, note, va="center", fontsize=8)  # at the bar's end
    ax.set_yticks(range(len(bars)), [name for name, _, _ in bars], fontsize=8)
    ax.invert_yaxis()  # the table's order, top down
    ax.set_xlim(right=ax.get_xlim()[1] * 1.15)  # room for the goodput notes
    total = accounts.total
    ax.set(xlabel=f"paid time ({unit}: READY time of the slice)",
           title=f"the programme: goodput {goodput_text(total)} of {total.paid / 3600:.3f} pod-hours paid")
    if shown:
        handles, labels = ax.get_legend_handles_labels()
        order = sorted(range(len(labels)), key=lambda i: tuple(Category).index(labels[i]))
        ax.legend([handles[i] for i in order], [labels[i] for i in order], loc="upper left",
                  bbox_to_anchor=(1.01, 1.0), fontsize=8, title="category")
    else:
        ax.text(0.5, 0.5, "nothing paid for yet", transform=ax.transAxes, ha="center", va="center")
    return _png(fig)


def picture(sub: Submission, ledger: Ledger, table: list[Row]) -> bytes:
    """PNG: pod-hours spent and planned over time; each variant's primary metric, group by group."""
    plt = _pyplot()
    fig, (spent_ax, metric_ax) = plt.subplots(1, 2, figsize=(12, 4))
    history = ledger.history
    if history:
        t0 = history[0][0]
        spent_ax.plot([(t - t0) / 3600 for t, _ in history], [h for _, h in history], label="spent (READY)")
        ended = sorted((r.ended, v) for v, r in ledger.variants.items()
                       if r.state == VariantState.COMPLETED and r.ended)
        if ended:
            spent_ax.step([(when - t0) / 3600 for when, _ in ended],
                          list(itertools.accumulate(sub.planned_hours(v) or 0.0 for _, v in ended)), where="post",
                          label="planned for the variants completed")
    if sub.budget is not None and range_problem(sub.budget, BUDGET) is None:  # a ledger's older budget may not draw
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
    return _png(fig)


def page(sub: Submission, ledger: Ledger, now: float | None = None, links: dict | None = None) -> str:
    """The static HTML page: the summary, the table (each run and group linked to W&B when `links`
    has them), the failed variants' lines, then the pictures."""
    accounts = programme_account(ledger, now)
    table = rows(sub, ledger, accounts)
    listed = HEADER.index("badput (top 3)")  # its items wrap between them, never inside one

    def cells(line: list[str], tag: str) -> str:
        def cell(i: int, c: str) -> str:
            if i == len(HEADER) - 1 and c.startswith(("http://", "https://")):  # a W&B run page or workspace
                label = c.rsplit("/", 1)[-1] if "/runs/" in c else "workspace"
                return f"<a href='{html.escape(c, quote=True)}'>{html.escape(label)}</a>"
            if i != listed or tag != "td":
                return html.escape(c)
            return ", ".join(f"<span class='item'>{html.escape(item)}</span>" for item in c.split(", "))
        return "".join(f"<{tag}>{cell(i, c)}</{tag}>" for i, c in enumerate(line))

    body = "".join(f"<tr class='{html.escape(r.state)}'>{cells(columns(r, links), 'td')}</tr>" for r in table)
    body += "".join(f"<tr class='total'>{cells(line, 'td')}</tr>" for line in totals(table, accounts, links))
    said = "".join(f"<p>{html.escape(line)}</p>" for line in summary(sub, ledger, table, accounts))
    failed = failures(table)
    items = "".join(f"<li>{html.escape(line)}</li>" for line in failed)
    failed_html = f"<h2>failed variants</h2><ul class='failed'>{items}</ul>" if failed else ""
    bars = base64.b64encode(goodput_picture(table, accounts)).decode()
    image = base64.b64encode(picture(sub, ledger, table)).decode()
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>programme {html.escape(sub.name)}</title>"
            "<style>body{font-family:sans-serif}td,th{padding:2px 8px;text-align:left}.item{white-space:nowrap}"
            ".failed{color:#b00}"
            ".completed{color:#070}.total{font-weight:bold}img{display:block;max-width:100%}</style></head><body>"
            f"<h1>programme {html.escape(sub.name)}</h1>{said}<p>as of "
            f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(now))}; goodput: kept train steps and the "
            "evaluations the protocol asks for, over the paid (READY) time; badput: the largest other categories, "
            "in shares of it (docs/BILL.md)</p>"
            f"<table><tr>{cells(HEADER, 'th')}</tr>{body}</table>{failed_html}"
            f"<h2>where the paid time went</h2><img alt='paid time by category, per variant' "
            f"src='data:image/png;base64,{bars}'>"
            f"<h2>spent and results</h2><img alt='pod-hours and primary metrics' src='data:image/png;base64,{image}'>"
            "</body></html>\n")
