"""The programme priced: each planned row's bill, in plan order (the queue's), on the slices it runs on."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping

from experiments.plan.bill import FIGURES, Figure, Program, Start, Variant, price
from experiments.plan.planner import Row


def variant_costs(row: Row, compiles: Mapping[str, float] | None = None) -> Variant | None:
    """What `bill.price` needs of a row with a step time (None without one); `compiles`: a ledger's."""
    total = getattr(row.estimate, "total_s", None)
    if total is None or not row.steps:
        return None
    p = row.lowered.protocol
    eval_s = getattr(row.eval_estimate, "total_s", None) if p.examples is not None else None
    train_compile, eval_compile = row.compile_s, row.eval_compile_s
    measured = (compiles or {}).get(f"{row.group}/{row.variant}")
    if measured is not None:  # the ledger's program start-up of one launch: both steps together
        share = train_compile / (train_compile + eval_compile) if train_compile + eval_compile else 1.0
        train_compile, eval_compile = measured * share, measured * (1 - share)
    return Variant(steps=row.steps, step_s=total, evaluations=p.evaluations, eval_step_s=eval_s,
                   eval_batches=p.batches, final_eval_batches=p.final_batches, checkpoint_every=p.checkpoint_every,
                   checkpoint_minutes=p.checkpoint_minutes, compile_train_s=train_compile,
                   compile_eval_s=eval_compile, compile_cache=p.compile_cache)


@dataclass
class Programme:
    """The rows and how they are priced; `priced` sets each row's bill and the slices' hours."""

    rows: list[Row]
    figures: dict[str, Figure] = field(default_factory=lambda: dict(FIGURES))
    mtbf_s: float | None = None
    slices: int = 1
    ahead: frozenset[str] = frozenset()  # exact keys of the programs kept ahead (plan --executables)
    compiles: Mapping[str, float] = field(default_factory=dict)  # a ledger's program start-up per variant
    slice_hours: list[float] = field(default_factory=list)

    def priced(self) -> Programme:
        """One pass in plan order: each variant takes the slice that frees first (as the controller
        does); a step is cached when an earlier variant ran its program with run.compile_cache."""
        free, started, seen = [0.0] * self.slices, set(), set()
        for row in self.rows:
            row.bill = None
            costs = variant_costs(row, self.compiles)
            if costs is None:
                continue
            where = free.index(min(free))
            low = row.lowered
            start = Start.COLD if where in started else Start.FRESH_SLICE

            def source(exact: str) -> Program:
                return Program.AHEAD if exact in self.ahead else \
                    Program.CACHED if costs.compile_cache and exact in seen else Program.COMPILED

            train, evals = source(low.exact), source(low.eval_exact)
            row.bill = price(dataclasses.replace(costs, start=start, train=train, eval=evals), self.figures,
                             self.mtbf_s)
            if costs.compile_cache:
                seen |= {low.exact, low.eval_exact}
            started.add(where)
            free[where] += row.bill.total_s / 3600
        self.slice_hours = free
        return self

    def again(self, **changes) -> Programme:
        """The same rows priced with `changes` (figures, ahead...), these rows' bills left as they are."""
        return dataclasses.replace(self, rows=[dataclasses.replace(r) for r in self.rows], **changes).priced()

    @property
    def total_h(self) -> float:
        return sum(r.bill.total_s for r in self.rows if r.bill) / 3600

    @property
    def goodput(self) -> float | None:
        total = self.total_h
        return sum(r.bill.train_s + r.bill.eval_s for r in self.rows if r.bill) / 3600 / total if total else None

    @property
    def wall_days(self) -> float:
        return max(self.slice_hours, default=0.0) / 24


def price_programme(rows: list[Row], figures: Mapping[str, Figure] = FIGURES, **how) -> Programme:
    """Each row's bill (`Programme.priced`); `how`: Programme's other fields."""
    return Programme(rows, dict(figures), **how).priced()
