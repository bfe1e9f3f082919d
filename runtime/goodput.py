"""Where a trainer process's wall time goes, by category: the `timing` event.

The categories use the vocabulary of Google's ml-goodput-measurement (MaxText's goodput
library, its `BadputType`) where one fits, and the names `launch.py plan` prices by
(experiments/plan/bill.py), so the plan's columns and a run's measurements line up:

  runtime_startup     the process's start (its /proc/self/stat start time, so Python's and jax's
                      imports count) to the TPU backend and jax.distributed being up (TPU_INITIALIZATION)
  data_loading        building or opening the dataset's splits, the first batch, and every train
                      batch the loop waited for (DATA_LOADING_SYNC)
  program_startup     every compile, wherever it happens: tracing, lowering and XLA, or the read of
                      a persistent-cache hit (PROGRAM_STARTUP); the train step, the eval step on its
                      first evaluation, each curriculum stage, the init and the small helpers
  checkpoint_save     the blocking part of saves: starting one (Orbax copies the state off the
                      chips), waiting for the one before, the final and the preemption save waited
                      for, and copying the run's files beside a committed step (UNPRODUCTIVE_CHECKPOINT_SAVE_TIME)
  checkpoint_restore  reading a checkpoint back: its metadata and state (UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME)
  eval                evaluations, intermediate and final, their compiles excepted (the library's
                      custom badput EVAL_STEP; productive when the variant's protocol asks for them)
  train               train steps run (the library's productive time)
  other               the remainder: wall time minus all of the above (preflight, the lease, plan
                      and build, W&B, the manifest, log rows; OTHER)

Steps replayed after a disruption (WASTED_PROGRESS_FROM_DISRUPTION) cannot be known by the process
that runs them; the ledger counts them from the `started` events and `steps_run`.

`Timing` keeps the account with an injectable clock: `measure(category)` blocks nest (an inner
block's time is its own, not its parent's), compile spans arrive from jax's monitoring events
(runtime/compile_cache.py) and are taken out of whatever block they happened in, and a snapshot
counts the open blocks up to now, so the categories always add up to the wall time. Standard
library only: the tests drive it with a fake clock.
"""

from __future__ import annotations

import contextlib
import enum
import os
import time
from typing import Any, Callable, Iterator

from runtime import events


class Category(enum.StrEnum):
    """Where paid time goes (the values are in events and ledgers on disk: never rename one). The
    trainer's own, then the controller's: setup while READY (the workers' setup or check, a
    launch's ssh), steps replayed after a disruption (WASTED_PROGRESS_FROM_DISRUPTION), a slice
    READY with nothing running. In this order in the plan's CSV and a programme's account."""

    TRAIN = "train"
    EVAL = "eval"
    SETUP = "setup"
    RUNTIME_STARTUP = "runtime_startup"
    DATA_LOADING = "data_loading"
    PROGRAM_STARTUP = "program_startup"
    CHECKPOINT_SAVE = "checkpoint_save"
    CHECKPOINT_RESTORE = "checkpoint_restore"
    WASTED_PROGRESS = "wasted_progress"
    IDLE = "idle"
    OTHER = "other"


# the trainer's own (its `timing` event's), in that event's order
CATEGORIES = (Category.RUNTIME_STARTUP, Category.DATA_LOADING, Category.PROGRAM_STARTUP, Category.CHECKPOINT_SAVE,
              Category.CHECKPOINT_RESTORE, Category.EVAL, Category.TRAIN, Category.OTHER)
PRODUCTIVE = (Category.TRAIN, Category.EVAL)  # train steps and the evaluations the protocol asks for
_KEEP_SPANS = 256  # compile spans kept to merge nested ones (a trace's inner jits end before it does)


def process_start() -> float | None:
    """This process's start as Unix time: its start time in /proc/self/stat (clock ticks since
    boot) set against the boot clock now. None where there is no /proc (not Linux)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name in (...) may hold spaces
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22
    except (OSError, IndexError, ValueError, AttributeError):
        return None
    return time.time() - max(0.0, age)


class Timing:
    """One process's account of its wall time by category (see the module docstring).

    clock: seconds on the scale of `started` and of the compile spans (`time.time` for a run:
    jax reports compile spans in Unix time). started: when the process began (`process_start`);
    None: now (a run inside a longer process, such as a test). cache_counts: () -> (hits, misses)
    of the persistent compilation cache so far in this process; reported from this run's start."""

    def __init__(self, *, clock: Callable[[], float] = time.time, started: float | None = None,
                 cache_counts: Callable[[], tuple[int, int]] = lambda: (0, 0)):
        self.clock = clock
        self.started = clock() if started is None else started
        self._seconds: dict[str, float] = dict.fromkeys(CATEGORIES, 0.0)
        self._open: list[list[Any]] = []  # [category, start, seconds taken out] of each open block, outermost first
        self._spans: list[tuple[float, float]] = []  # compile spans counted: disjoint, in order
        self.step = 0  # the last step completed
        self.steps_run = 0  # train steps this process ran
        self.saves = 0  # checkpoint saves this process started
        self.live = False  # the run's event stream is attached: `emit` and `finish` say something
        self._finished = False
        self.set_cache_counts(cache_counts)

    def set_cache_counts(self, counts: Callable[[], tuple[int, int]]) -> None:
        """Report the cache's hits and misses counted by `counts` from now on."""
        self._cache_counts, self._cache_base = counts, counts()

    @contextlib.contextmanager
    def measure(self, category: str, since: float | None = None) -> Iterator[None]:
        """Time the block as `category` (from `since` when given, a moment already past); blocks
        nest, each second counted once, in the innermost block; `other` blocks count in the remainder."""
        if category not in CATEGORIES:
            raise ValueError(f"unknown timing category {category!r}; one of {CATEGORIES}")
        entry: list[Any] = [category, self.clock() if since is None else since, 0.0]
        self._open.append(entry)
        try:
            yield
        finally:
            del self._open[next(i for i, e in enumerate(self._open) if e is entry)]
            elapsed = self.clock() - entry[1]
            if category != Category.OTHER:
                self._seconds[category] += max(0.0, elapsed - entry[2])
            if self._open:
                self._open[-1][2] += elapsed

    def compiled(self, start: float, end: float) -> None:
        """A compile ran from `start` to `end` (this clock) in this process's main thread. Nested
        spans (a jit traced inside another's trace ends first) count once."""
        covered, lo, hi = 0.0, start, end
        while self._spans and self._spans[-1][1] > start:
            s, e = self._spans.pop()
            covered += max(0.0, min(e, end) - max(s, start))
            lo, hi = min(lo, s), max(hi, e)
        self._spans.append((lo, hi))
        del self._spans[:-_KEEP_SPANS]
        new = max(0.0, end - start - covered)
        self._seconds[Category.PROGRAM_STARTUP] += new
        if self._open:  # the block it happened in does not count it
            self._open[-1][2] += new

    def step_done(self, step: int) -> None:
        """A train step ran; `step` steps are now completed."""
        self.step, self.steps_run = step, self.steps_run + 1

    def snapshot(self) -> dict[str, float]:
        """Seconds per category since the process started, open blocks counted up to now; they add
        up to the wall time (`other` is the remainder). Rounded to milliseconds."""
        now = self.clock()
        seconds = dict(self._seconds)
        inner = 0.0  # the open block inside this one: its time is its own
        for category, start, taken in reversed(self._open):
            elapsed = now - start
            if category != Category.OTHER:
                seconds[category] += max(0.0, elapsed - taken - inner)
            inner = elapsed
        out = {k: round(v, 3) for k, v in seconds.items() if k != Category.OTHER}
        out[Category.OTHER] = round(round(now - self.started, 3) - sum(out.values()), 3)
        return {k: out[k] for k in CATEGORIES}

    def cache_counts(self) -> tuple[int, int]:
        """(hits, misses) of the persistent compilation cache in this run."""
        hits, misses = self._cache_counts()
        return hits - self._cache_base[0], misses - self._cache_base[1]

    def record(self) -> dict:
        """The `timing` event's fields (see `emit`)."""
        seconds = self.snapshot()
        hits, misses = self.cache_counts()
        return {"step": self.step, "steps_run": self.steps_run, "saves": self.saves, "seconds": seconds,
                "wall": round(sum(seconds.values()), 3), "hits": hits, "misses": misses}

    def emit(self) -> None:
        """The `timing` event (process 0 writes it; runtime/events.py): cumulative, so the last one
        seen is the process's account."""
        if self.live:
            events.emit("timing", **self.record())

    def finish(self) -> None:
        """The last `timing` event of the process (once): just before its `completed`, `preempted` or
        `failed` event, so that one stays the last word."""
        if self.live and not self._finished:
            self._finished = True
            self.emit()

    def totals(self) -> dict[str, float]:
        """The account as run-summary metrics: `time/<category>_s`, `time/wall_s`, `time/goodput`
        (train and eval seconds / wall seconds), steps run and the cache's hits and misses."""
        record = self.record()
        wall = record["wall"]
        out = {f"time/{k}_s": v for k, v in record["seconds"].items()}
        out |= {"time/wall_s": wall, "time/goodput": sum(record["seconds"][k] for k in PRODUCTIVE) / wall if wall else 0.0,
                "time/steps_run": record["steps_run"], "time/compile_cache_hits": record["hits"],
                "time/compile_cache_misses": record["misses"]}
        return out
