"""The whole bill of a variant, as `launch.py plan` prices it: arithmetic, no JAX.

Pod time is paid for every second a slice is READY: a variant's share of it by category
(runtime/goodput.py) and by column (docs/BILL.md). Each of `FIGURES` is a measurement (its command
and date) or a public figure (its address and the number it quotes); an uncertain one carries a
`high` with its own source, and the plan prices the programme at both ends (`ends`).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import Mapping

from runtime.errors import UserError
from runtime.goodput import Category


@dataclass(frozen=True)
class Figure:
    """Seconds one phase takes (the low end where `high` is set), when it is paid, and the source."""

    seconds: float
    category: Category
    paid: str  # when, in words
    source: str  # "measured: `<command>` (<date>...)", "public: <address> ...", or "ledger: ..."
    high: float | None = None  # the high end of what it may be, from `high_source`
    high_source: str = ""


# `python bench/startup_figures.py` (its --setup for setup_fresh) on this repo's 2-core machine: CPU
# figures of the real trainer and tools, so what only a TPU VM and GCS add is named where missing.
_BENCH = "measured: `python bench/startup_figures.py` (2026-11-28, this repo's 2-core machine)"
FIGURES: dict[str, Figure] = {
    "setup_check": Figure(
        1.2, Category.SETUP, "every launch on a slice that is set up: the supervisor asks every worker for its "
                             "versions",
        f"{_BENCH}: `gcloud version` (the CLI's start) + the workers' versions command; the ssh round trips to "
        "the workers not included"),
    "setup_fresh": Figure(
        198.0, Category.SETUP, "every launch on a fresh slice (its first, and after each preemption): setup_tpu.sh",
        "measured: `python bench/startup_figures.py --setup` (2026-11-28): a fresh virtualenv with the project's "
        "TPU stack, `python3 -m venv V && V/bin/python -m pip install -e .[tpu]`, from PyPI over this machine's "
        "network; the clone and the TPU check not included"),
    "launch": Figure(1.0, Category.SETUP, "every launch: the ssh that starts the trainer on every worker",
                     f"{_BENCH}: `gcloud version` (the CLI's start); the ssh round trips not included"),
    "runtime_init": Figure(
        7.3, Category.RUNTIME_STARTUP, "every cold launch: the process's start (Python's and jax's imports) to "
                                       "the TPU backend, jax.distributed and the start-up barrier",
        f"{_BENCH}: 4.5 s, the trainer's runtime_startup on CPU (imports and the backend) + public: "
        "https://github.com/AI-Hypercomputer/jetstream-pytorch/issues/82, a v4-8 with JAX's debug log: "
        "`Initializing backend 'tpu'` at 23:10:04.538, `Backend 'tpu' initialized` at 23:10:07.296, 2.8 s. "
        "One host: no multi-host figure (v4-32 and up, jax.distributed) was found in public logs",
        high=14.5, high_source=(
            f"{_BENCH}: 4.5 s as above + public: https://github.com/pytorch/xla/issues/811, \"Each worker's topology "
            "initialization takes ~10 second\" (TPU v3 pods, the runtime before PJRT): 10 s for the backend")),
    "other": Figure(0.3, Category.OTHER, "every launch: preflight, the run directory's lease, plan and build, the "
                                         "manifest", f"{_BENCH}: the trainer's `other` (the run directory local)"),
    "data_load": Figure(
        0.3, Category.DATA_LOADING, "every launch: the train and eval splits read",
        f"{_BENCH}: 244 MB of arrays of the baseline set's shapes (1,001,000 training rows, 423,168 test puzzles) "
        "read whole and parsed as a gs:// dataset is; the transfer from GCS not included"),
    "compile_cache_hit": Figure(
        2.0, Category.PROGRAM_STARTUP, "each step a start reads from the persistent compilation cache "
                                       "(run.compile_cache) or kept ahead (run.executables)",
        f"{_BENCH}: the relaunched baseline run's program_startup / its 2 cache hits (a local cache, CPU programs)"),
    "restore": Figure(0.5, Category.CHECKPOINT_RESTORE, "every launch that resumes: the checkpoint read back",
                      f"{_BENCH}: the relaunched baseline run's checkpoint_restore (local disk)"),
    "save": Figure(0.4, Category.CHECKPOINT_SAVE, "every save but the last: its blocking part (the state copied "
                                                  "off the chips)",
                   f"{_BENCH}: the baseline run's checkpoint_save / its saves (local disk)"),
    "final_save": Figure(0.4, Category.CHECKPOINT_SAVE, "the last save of a variant, waited for until committed",
                         f"{_BENCH}: as save (its saves include the last, waited for; the GCS commit not included)"),
    "between_variants": Figure(
        1.0, Category.IDLE, "every variant: the slice READY while the controller describes it before the next launch",
        f"{_BENCH}: `gcloud version` (the CLI's start); the API round trip not included"),
}


def ends(figures: Mapping[str, Figure]) -> tuple[dict[str, Figure], dict[str, Figure]]:
    """(the low end, the high end) of the figures: each at its `seconds`, or at its `high`."""
    high = {k: dataclasses.replace(f, seconds=f.high, source=f.high_source) if f.high is not None else f
            for k, f in figures.items()}
    return dict(figures), high


class Start(enum.Enum):
    """How a variant's first start begins."""

    FRESH_SLICE = "a fresh slice"  # the first on its slice: setup_tpu.sh, then a cold launch
    COLD = "a cold launch"  # a slice set up: the versions check, new trainer processes


class Program(enum.Enum):
    """Where a start's train or eval step comes from."""

    COMPILED = "compiled"
    CACHED = "the persistent cache"  # run.compile_cache, and an earlier start ran the same program
    AHEAD = "kept ahead"  # `plan --executables`, read from run.executables


@dataclass(frozen=True)
class Variant:
    """What the compiles and the config say about one variant (seconds; counts), and how it starts."""

    steps: int
    step_s: float
    evaluations: int  # the loop's: at every eval_every steps and at the last
    eval_step_s: float | None = None  # one eval batch; None: not known (eval_h unknown)
    eval_batches: int = 0  # of an intermediate evaluation (on train.eval_subset, or the whole set)
    final_eval_batches: int = 0  # of the last evaluation (the whole set)
    checkpoint_every: int = 0  # steps between saves; 0 = only at the end
    checkpoint_minutes: float | None = None  # train.checkpoint_every_minutes
    compile_train_s: float = 0.0
    compile_eval_s: float = 0.0
    compile_cache: bool = False  # run.compile_cache: a restart reads its own programs back
    start: Start = Start.FRESH_SLICE
    train: Program = Program.COMPILED  # at its first start
    eval: Program = Program.COMPILED

    @property
    def train_s(self) -> float:
        return self.steps * self.step_s

    @property
    def eval_s(self) -> float | None:
        if self.evaluations == 0:
            return 0.0
        if self.eval_step_s is None:
            return None
        return self.eval_step_s * ((self.evaluations - 1) * self.eval_batches + self.final_eval_batches)

    def program_s(self, train: Program, eval: Program, hit: float) -> float:
        """Program start-up of a start whose steps come from `train` and `eval`."""
        def one(source: Program, compile_s: float) -> float:
            return compile_s if source is Program.COMPILED else hit
        return one(train, self.compile_train_s) + (one(eval, self.compile_eval_s) if self.evaluations else 0.0)

    def restart_program(self, first: Program) -> Program:
        """Where a restart's step comes from: kept ahead stays so; else the cache has it if it is on."""
        return first if first is Program.AHEAD else Program.CACHED if self.compile_cache else Program.COMPILED


@dataclass(frozen=True)
class Bill:
    """One variant's priced seconds by category (`seconds`, summing to `total_s`) and by column."""

    seconds: dict[Category, float]
    checkpoint_s: float  # the blocking part of the saves before the last
    recovery_s: float  # what the expected preemptions add: replayed steps and restarts
    preemptions: float  # expected
    saves: int
    checkpoint_interval_s: float  # wall time between saves (what a preemption replays half of)
    young_interval_s: float | None  # Young's rule: sqrt(2 x blocking save x MTBF)
    restart_s: float  # one preemption's start-up (not its replay)
    eval_known: bool = True

    @property
    def train_s(self) -> float:
        return self.seconds.get(Category.TRAIN, 0.0)

    @property
    def eval_s(self) -> float:
        return self.seconds.get(Category.EVAL, 0.0)

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    @property
    def startup_s(self) -> float:
        """The first start's fixed costs, its final save and the idle time before the next variant."""
        return self.total_s - self.train_s - self.eval_s - self.checkpoint_s - self.recovery_s

    @property
    def goodput(self) -> float:
        return (self.train_s + self.eval_s) / self.total_s if self.total_s else 0.0


def save_count(v: Variant) -> tuple[int, float]:
    """(saves, wall seconds between saves) of an uninterrupted run: at whichever of `checkpoint_every`
    and `checkpoint_minutes` comes first, and one at the end."""
    work = v.train_s + (v.eval_s or 0.0)
    intervals = [work * v.checkpoint_every / v.steps] if v.checkpoint_every and v.checkpoint_every < v.steps else []
    if v.checkpoint_minutes:
        intervals.append(60.0 * v.checkpoint_minutes)
    interval = min(min(intervals, default=work), work) if work else 0.0
    return (max(1, math.ceil(work / interval - 1e-9)) if interval else 1), interval


def price(v: Variant, figures: Mapping[str, Figure] = FIGURES, mtbf_s: float | None = None) -> Bill:
    """The variant's bill (see the module docstring). A preemption costs one restart plus half the
    interval between saves replayed; the expected number is the paid time / `mtbf_s`, the paid
    time including the recoveries themselves: total = base / (1 - cost per preemption / mtbf)."""
    f = {k: fig.seconds for k, fig in figures.items()}
    hit = f["compile_cache_hit"]
    saves, interval = save_count(v)
    eval_s = v.eval_s
    periodic = (saves - 1) * f["save"]
    cold = {Category.RUNTIME_STARTUP: f["runtime_init"], Category.DATA_LOADING: f["data_load"],
            Category.OTHER: f["other"]}  # every cold launch's: the first start's and each restart's
    s = dict.fromkeys(Category, 0.0) | cold | {
        Category.TRAIN: v.train_s, Category.EVAL: eval_s or 0.0, Category.IDLE: f["between_variants"],
        Category.SETUP: f["setup_fresh" if v.start is Start.FRESH_SLICE else "setup_check"] + f["launch"],
        Category.PROGRAM_STARTUP: v.program_s(v.train, v.eval, hit),
        Category.CHECKPOINT_SAVE: f["final_save"] + periodic}
    # a restart after a preemption: a fresh slice, a cold launch, the checkpoint read back
    restart = {Category.SETUP: f["setup_fresh"] + f["launch"], **cold, Category.CHECKPOINT_RESTORE: f["restore"],
               Category.PROGRAM_STARTUP: v.program_s(v.restart_program(v.train), v.restart_program(v.eval), hit)}
    restart_s = sum(restart.values())
    preemptions = recovery = 0.0
    if mtbf_s:
        cost = restart_s + interval / 2
        if cost >= mtbf_s:
            raise UserError(f"one preemption costs {cost / 3600:.2f} h (a restart and half a checkpoint interval), "
                            f"more than --mtbf {mtbf_s / 3600:g}h: no run would finish; save more often "
                            "(train.checkpoint_every_minutes) or plan for a longer MTBF")
        preemptions = sum(s.values()) / (1 - cost / mtbf_s) / mtbf_s
        for category, seconds in (restart | {Category.WASTED_PROGRESS: interval / 2}).items():
            s[category] += preemptions * seconds
        recovery = preemptions * cost
    return Bill(seconds=s, checkpoint_s=periodic, recovery_s=recovery,
                preemptions=preemptions, saves=saves, checkpoint_interval_s=interval,
                young_interval_s=math.sqrt(2 * f["save"] * mtbf_s) if mtbf_s else None, restart_s=restart_s,
                eval_known=eval_s is not None)


def parse_hours(text: str) -> float:
    """Seconds of '8h', '30m', '2d' or a number of hours; UserError otherwise."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    value, unit = (text[:-1], text[-1]) if text and text[-1] in units else (text, "h")
    try:
        seconds = float(value) * units[unit]
    except ValueError:
        seconds = -1.0
    if not math.isfinite(seconds) or seconds <= 0:
        raise UserError(f"--mtbf {text} is not a duration; give e.g. 8h, 90m or 2d")
    return seconds
