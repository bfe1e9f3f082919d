"""Where the paid time went, from the ledger (experiments/launcher/ledger.py): each variant's READY
time and the programme's, by runtime/goodput.py's `Category` (the plan's bill uses the same),
adding up to what was paid; and the goodput, (train + eval) / paid. What each category holds and
who measures it: docs/BILL.md, "What a programme paid for". A variant none of whose launches
reported an account is not measured (its goodput "-", its paid time all `other`). The controller
keeps the marks this reads (`charge`, `idle_from`, `idle_until`), changed under the ledger's lock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from experiments.launcher.ledger import (InFlight, LaunchRecord, LaunchTiming, Ledger, Mark, ReadyClock, SliceRecord,
                                         VariantRecord, VariantState)
from runtime import goodput
from runtime.goodput import PRODUCTIVE, Category

TRAINER = tuple(c for c in goodput.CATEGORIES if c != Category.OTHER)  # the trainer's (its `other`: in the remainder)


# --- one launch ------------------------------------------------------------------------------------

def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _seconds(event: Mapping[str, Any] | None) -> dict[str, float]:
    """The trainer's seconds by category of a `timing` event (unknown names and non-numbers dropped)."""
    seconds = (event or {}).get("seconds")
    if not isinstance(seconds, Mapping):
        return {}
    return {k: v for k in goodput.CATEGORIES if (v := _number(seconds.get(k))) is not None}


def unpaid_part(timings: list[Mapping[str, Any]], billed_until: float | None) -> dict[str, float]:
    """The part of the last `timing` event's seconds spent after `billed_until` (when the slice stopped
    being billed: a preemption), by category: what the trainer spent between its last event said by
    then and its last one, in the share of that interval that came after it. {} when nothing was unpaid."""
    timed = [t for t in timings if _number(t.get("time")) is not None and _seconds(t)]
    if billed_until is None or not timed or timed[-1]["time"] <= billed_until:
        return {}
    last = timed[-1]
    before = [t for t in timed if t["time"] <= billed_until]
    if before:
        base, since = _seconds(before[-1]), before[-1]["time"]
    else:  # nothing said before: from the process's start
        base, since = {}, last["time"] - (_number(last.get("wall")) or 0.0)
    span = last["time"] - since
    share = 1.0 if span <= 0 else min(1.0, (last["time"] - billed_until) / span)
    out = {k: round(max(0.0, v - base.get(k, 0.0)) * share, 3) for k, v in _seconds(last).items()}
    return {k: v for k, v in out.items() if v > 0}


def launch_timing(timings: list[Mapping[str, Any]], *, setup: float = 0.0, setup_ran: bool = False,
                  billed_until: float | None = None) -> LaunchTiming:
    """A launch's account: its last `timing` event (of `timings`, in order; none: the trainer said
    nothing), the setup before it (`setup_ran`: setup ran, not only the versions check), and the
    part after `billed_until` (see `unpaid_part`)."""
    last = next((t for t in reversed(timings) if _seconds(t)), {})
    count = lambda key: int(v) if (v := _number(last.get(key))) is not None else 0  # noqa: E731
    step = _number(last.get("step"))
    return LaunchTiming(setup=round(max(0.0, setup), 3), setup_ran=setup_ran, seconds=_seconds(last),
                        step=int(step) if step is not None else None, steps_run=count("steps_run"),
                        saves=count("saves"), hits=count("hits"), misses=count("misses"),
                        wall=_number(last.get("wall")) or 0.0, time=_number(last.get("time")),
                        unpaid=unpaid_part(timings, billed_until))


def replayed_steps(launches: Iterable[LaunchRecord | InFlight]) -> list[int]:
    """Per launch, the steps it ran that an earlier launch had run: past the step it started from, up
    to the furthest step any launch before it reached (at most the steps it ran)."""
    out, reached = [], None
    for launch in launches:
        ran = launch.timing.steps_run if launch.timing else 0
        start = launch.first_step
        out.append(max(0, min(ran, reached - start)) if reached is not None and start is not None else 0)
        if launch.last_step is not None:
            reached = launch.last_step if reached is None else max(reached, launch.last_step)
    return out


# --- accounts --------------------------------------------------------------------------------------

@dataclass
class Account:
    """Seconds by category (every `Category`) that add up to `paid`."""
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(Category, 0.0))
    paid: float = 0.0
    measured: bool = False  # a launch reported the trainer's account
    replayed: int = 0  # steps run again

    @property
    def productive(self) -> float:
        return sum(self.seconds[c] for c in PRODUCTIVE)

    @property
    def goodput(self) -> float | None:
        """productive / paid; None when nothing was measured or paid."""
        return self.productive / self.paid if self.measured and self.paid > 0 else None

    def badput(self, n: int = 3) -> list[tuple[str, float]]:
        """The `n` largest categories that are not productive (above zero), largest first."""
        bad = sorted(((c, s) for c, s in self.seconds.items() if c not in PRODUCTIVE and s > 0),
                     key=lambda item: (-item[1], tuple(Category).index(item[0])))
        return bad[:n]

    def __add__(self, other: "Account") -> "Account":
        return Account({c: self.seconds[c] + other.seconds[c] for c in Category}, self.paid + other.paid,
                       self.measured or other.measured, self.replayed + other.replayed)


def launch_seconds(launch: LaunchRecord | InFlight, replayed: int) -> dict[str, float]:
    """One launch's measured seconds by category (no `other`: that is the variant's remainder)."""
    out = dict.fromkeys(Category, 0.0)
    timing = launch.timing
    if timing is None:
        return out
    out[Category.SETUP] = timing.setup
    for name in TRAINER:
        out[name] = max(0.0, timing.seconds.get(name, 0.0) - timing.unpaid.get(name, 0.0))
    if replayed and timing.steps_run:
        wasted = min(out[Category.TRAIN], replayed * timing.seconds.get(Category.TRAIN, 0.0) / timing.steps_run)
        out[Category.TRAIN] -= wasted
        out[Category.WASTED_PROGRESS] = wasted
    return out


def variant_account(record: VariantRecord, paid: float) -> Account:
    """The variant's paid seconds by category (the module docstring); a running variant's launch under
    way counts as far as its last checkpoint said."""
    sup = record.supervision
    launches = [*sup.launches, *([sup.launch] if record.state == VariantState.RUNNING and sup.launch else [])]
    account = Account(paid=paid)
    for launch, replayed in zip(launches, replayed_steps(launches)):
        measured = bool(launch.timing and launch.timing.seconds)
        account += Account(launch_seconds(launch, replayed), 0.0, measured, replayed)
    account.seconds[Category.OTHER] = paid - sum(account.seconds.values())
    return account


def live_ready_seconds(ledger: Ledger, record: VariantRecord, now: float | None = None) -> float:
    """A variant's READY seconds, with those of its stretch under way on its slice (a running
    variant's record is settled only when its run on the slice ends)."""
    seconds, mark = record.ready_seconds, record.mark
    if record.state == VariantState.RUNNING and mark and record.slice in ledger.slices:
        seconds += max(0.0, ledger.slices[record.slice].clock.ready_total(now) - mark.ready)
    return seconds


def idle_seconds(record: SliceRecord, now: float | None = None) -> float:
    """A slice's idle READY seconds, the stretch under way included."""
    open_ = max(0.0, record.clock.ready_total(now) - record.free.ready) if record.free else 0.0
    return record.idle_seconds + open_


@dataclass
class Programme:
    """The programme's account: each variant's, each slice's idle seconds, and the total (the slices'
    READY time: the variants', the idle time and what the ledger did not attribute)."""
    variants: dict[str, Account]
    idle: dict[str, float]
    total: Account
    unattributed: float  # slices' READY seconds no variant and no idle stretch holds (ledgers before schema 3)


def programme_account(ledger: Ledger, now: float | None = None) -> Programme:
    now = time.time() if now is None else now
    variants = {name: variant_account(r, live_ready_seconds(ledger, r, now)) for name, r in ledger.variants.items()}
    idle = {name: idle_seconds(s, now) for name, s in ledger.slices.items()}
    total = sum(variants.values(), Account())
    paid = sum(s.clock.ready_total(now) for s in ledger.slices.values())
    unattributed = paid - total.paid - sum(idle.values())
    total.seconds[Category.IDLE] += sum(idle.values())
    total.seconds[Category.OTHER] += unattributed
    total.paid = paid
    return Programme(variants, idle, total, unattributed)


# --- the controller's marks (under the ledger's lock) -------------------------------------------------

def mark(clock: ReadyClock) -> Mark:
    """Where the clock stands now."""
    return Mark(ready=clock.ready_total(), host=clock.host_total())


def charge(record: VariantRecord, slices: Mapping[str, SliceRecord]) -> None:
    """Charge the variant its slice's READY time since its mark, and clear the mark."""
    held, record.mark = record.mark, None
    if held is None or record.slice not in slices:
        return
    clock = slices[record.slice].clock
    record.ready_seconds += max(0.0, clock.ready_total() - held.ready)
    record.host_seconds += max(0.0, clock.host_total() - held.host)


def idle_from(record: SliceRecord) -> None:
    """The slice holds no variant from now: its idle time starts (if it has not)."""
    if record.free is None:
        record.free = mark(record.clock)


def idle_until(record: SliceRecord, *, taken: bool) -> None:
    """The slice's idle stretch ends (`taken`: a variant takes it; else it is gone)."""
    held, record.free = record.free, None
    if held is None:
        return
    seconds = max(0.0, record.clock.ready_total() - held.ready)
    record.idle_seconds += seconds
    record.idle_host_seconds += max(0.0, record.clock.host_total() - held.host)
    if taken and seconds > 0:
        record.gaps.append(round(seconds, 3))


# --- words -----------------------------------------------------------------------------------------

def percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole > 0 else "-"


def goodput_text(account: Account) -> str:
    return "-" if account.goodput is None else percent(account.productive, account.paid)


def badput_text(account: Account, n: int = 3) -> str:
    """"program_startup 22%, other 9%, setup 5%": the n largest badput categories, in shares of the paid time."""
    if not account.measured or account.paid <= 0:
        return "-"
    return ", ".join(f"{name} {percent(seconds, account.paid)}" for name, seconds in account.badput(n)) or "-"
