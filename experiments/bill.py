"""The whole bill of a variant and of the programme, as `launch.py plan` prices it.

Pod time is paid for every second a slice is READY (the ledger's pod-hours). The plan prices each
variant's share of it in the vocabulary of Google's ml-goodput-measurement:

  train_h     the train steps: steps x the estimated step time (experiments/plan.py)
  eval_h      the evaluations the variant's protocol asks for: the eval step's estimated time x
              batches per evaluation x evaluations (intermediate ones on `train.eval_subset`, the
              last on the whole set, at `train.eval_batch_size`)
  startup_h   what each start pays before and around its steps: the workers' setup check,
              runtime start-up (TPU, jax.distributed; a variant that starts in the resident
              trainers of the one before it on its slice, only their hand-over), data loading,
              program start-up (the train and eval steps' compiles, or a compilation-cache hit),
              the first save's blocking part, the final save, and the idle READY time while the
              controller starts the next variant
  checkpoint_h  the blocking part of every other save
  recovery_h  at one preemption every `mtbf` paid seconds: the steps replayed since the last
              checkpoint (half the interval between saves, on average) plus one restart (a
              fresh slice's setup, runtime start-up, data loading, compiles, restore)
  total_h     their sum: what the variant costs (`pod_hours` in the CSV: the budget and the
              ETA of `programme` read it)
  goodput     (train_h + eval_h) / total_h: the share of the paid time that is kept steps or
              evaluation the protocol asks for

The per-phase figures (`FIGURES`) each carry their source: a measurement with its command, or a
public figure with its address. `calibrate` replaces them with the medians a programme's ledger
measured (`plan --calibrate-from <programme state dir>`), read through the controller's own records
(experiments/launcher/ledger.py).

Arithmetic, no JAX: tests/test_plan.py checks every formula on small made-up inputs and the
calibration on ledgers the launcher's records write.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from experiments.launcher.ledger import LaunchTiming, Ledger, RecordError, load_ledger, read_state
from runtime.errors import UserError
from runtime.goodput import (CHECKPOINT_RESTORE, CHECKPOINT_SAVE, DATA_LOADING, EVAL, OTHER, PROGRAM_STARTUP,
                             RUNTIME_STARTUP, TRAIN)

# Where paid time goes, in ml-goodput-measurement's vocabulary (runtime/goodput.py: the trainer's
# own categories, which its `timing` events report) and the controller's (setup while READY,
# idle READY time, steps replayed after a preemption), which the ledger adds.
SETUP = "setup"  # provisioning and setup while READY: the workers' setup (check), a launch's ssh
WASTED_PROGRESS = "wasted_progress"  # steps replayed after a disruption (WASTED_PROGRESS_FROM_DISRUPTION)
IDLE = "idle"  # a slice READY with nothing running (between variants)
CATEGORIES = (TRAIN, EVAL, SETUP, RUNTIME_STARTUP, DATA_LOADING, PROGRAM_STARTUP, CHECKPOINT_SAVE,
              CHECKPOINT_RESTORE, WASTED_PROGRESS, IDLE, OTHER)


@dataclass(frozen=True)
class Figure:
    """Seconds one phase takes, when it is paid, and where the number comes from."""

    seconds: float
    category: str
    paid: str  # when, in words
    source: str  # "measured: <command>" or "public: <address> ..." or "ledger: ..."


# Every start-up figure the plan uses that is not its own compile, each with its source. "bench"
# is `python bench/startup_figures.py` (its --setup for setup_fresh), run on this repo's 2-core
# machine on 2026-11-28: CPU figures of the real trainer and tools, so what only a TPU VM and GCS
# add is named where it is missing. `plan --calibrate-from` replaces them with a ledger's medians.
_BENCH = "measured: `python bench/startup_figures.py` (2026-11-28, this repo's 2-core machine)"
FIGURES: dict[str, Figure] = {
    "setup_check": Figure(
        1.2, SETUP, "every launch on a slice that is set up: the supervisor asks every worker for its versions",
        f"{_BENCH}: `gcloud version` (the CLI's start) + the workers' versions command; the ssh round trips to "
        "the workers not included"),
    "setup_fresh": Figure(
        198.0, SETUP, "every launch on a fresh slice (its first, and after each preemption: a re-created slice has "
                      "fresh disks): setup_tpu.sh",
        "measured: `python bench/startup_figures.py --setup` (2026-11-28): a fresh virtualenv with the project's "
        "TPU stack, `python3 -m venv V && V/bin/python -m pip install -e .[tpu]`, from PyPI over this machine's "
        "network; the clone and the TPU check not included"),
    "launch": Figure(1.0, SETUP, "every launch: the ssh that starts the trainer on every worker",
                     f"{_BENCH}: `gcloud version` (the CLI's start); the ssh round trips not included"),
    "runtime_init": Figure(
        64.5, RUNTIME_STARTUP, "every launch: the process's start (Python's and jax's imports) to the TPU backend, "
                               "jax.distributed and the start-up barrier",
        f"4.5 s {_BENCH} (the trainer's runtime_startup on CPU: imports and the backend) + 60 s for the TPU backend "
        "and jax.distributed, an upper bound: JAX warns when TPU backend initialization takes longer "
        "(jax/_src/xla_bridge.py, tpu_client_timer_callback(timer_secs=60.0): "
        "https://github.com/jax-ml/jax/blob/main/jax/_src/xla_bridge.py)"),
    "resident_start": Figure(
        0.005, RUNTIME_STARTUP, "every warm launch (a programme's variant after another on its slice, "
                               "experiments/launcher/worker/resident.py): the job handed to the slice's resident "
                               "trainers, their vote, jax.distributed already joined",
        "measured: `python bench/startup_figures.py` (2026-11-29, this repo's 2-core machine): the warm launch's "
        "runtime_startup, 0.00 s in its table (under 0.005 s: a job handed to a resident trainer on this CPU); the "
        "workers' vote over the pod's network not included"),
    "other": Figure(0.3, OTHER, "every launch: preflight, the run directory's lease, plan and build, the manifest",
                    f"{_BENCH}: the trainer's `other` (on CPU, the run directory local)"),
    "data_load": Figure(
        0.3, DATA_LOADING, "every launch: the train and eval splits read",
        f"{_BENCH}: 244 MB of arrays of the baseline set's shapes (1,001,000 training rows, 423,168 test puzzles) "
        "read whole and parsed as a gs:// dataset is; the transfer from GCS not included"),
    "compile_cache_hit": Figure(
        2.0, PROGRAM_STARTUP, "each step a launch finds in the persistent compilation cache (run.compile_cache) "
                              "or reads compiled ahead (run.executables)",
        f"{_BENCH}: the relaunched baseline run's program_startup / its 2 cache hits (a local cache, CPU programs)"),
    "restore": Figure(0.5, CHECKPOINT_RESTORE, "every launch that resumes: the checkpoint read back",
                      f"{_BENCH}: the relaunched baseline run's checkpoint_restore (local disk)"),
    "save": Figure(0.4, CHECKPOINT_SAVE, "every save but the last: its blocking part (async: the state copied off "
                                         "the chips)",
                   f"{_BENCH}: the baseline run's checkpoint_save / its saves (local disk)"),
    "final_save": Figure(0.4, CHECKPOINT_SAVE, "the last save of a variant, waited for until it is committed",
                         f"{_BENCH}: as save (its saves include the last, waited for; the GCS commit not included)"),
    "between_variants": Figure(
        1.0, IDLE, "every variant: the slice READY while the controller describes it before the next launch",
        f"{_BENCH}: `gcloud version` (the CLI's start); the API round trip not included"),
}


@dataclass(frozen=True)
class Variant:
    """What the compiles and the config say about one variant (seconds; counts)."""

    steps: int
    step_s: float
    evaluations: int  # the loop's: at every eval_every steps and at the last
    eval_step_s: float | None = None  # one eval batch; None: not known (eval_h unknown)
    eval_batches: int = 0  # of an intermediate evaluation (on train.eval_subset, or the whole set)
    final_eval_batches: int = 0  # of the last evaluation (the whole set)
    checkpoint_every: int = 0  # steps between saves (plan.checkpoint_every); 0 = only at the end
    checkpoint_minutes: float | None = None  # train.checkpoint_every_minutes
    compile_train_s: float = 0.0  # the plan's own compile of the train step
    compile_eval_s: float = 0.0
    compile_cache: bool = False  # run.compile_cache: a restart (and a same-program variant) loads, not compiles
    train_cached: bool = False  # its train step's program ran before in the programme (a cache hit at its start)
    eval_cached: bool = False
    # Compiled ahead by the plan (`plan --executables`, run.executables): read at every start, like a cache hit.
    train_ahead: bool = False
    eval_ahead: bool = False
    first_on_slice: bool = True  # the first variant of its slice: it pays the fresh slice's setup
    # It starts in the resident trainers the variant before it on its slice left (what `programme`
    # does: experiments/launcher/worker/resident.py): no runtime start-up, the rest as a cold start.
    resident: bool = False
    # What-if (`plan --what-if long-lived-trainer`): it starts in the process that ran the variant
    # before it on its slice: no setup check, launch, runtime start-up or idle time; its dataset
    # already loaded when the same; a step that process already compiled costs nothing.
    warm: bool = False
    data_loaded: bool = False
    train_in_process: bool = False
    eval_in_process: bool = False

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


@dataclass(frozen=True)
class Bill:
    """One variant's priced seconds by category (`seconds`, summing to `total_s`) and by column."""

    seconds: dict[str, float]  # category -> seconds
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
        return self.seconds.get(TRAIN, 0.0)

    @property
    def eval_s(self) -> float:
        return self.seconds.get(EVAL, 0.0)

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


def _add(into: dict[str, float], category: str, seconds: float) -> None:
    into[category] = into.get(category, 0.0) + seconds


def save_count(v: Variant, figures: Mapping[str, Figure]) -> tuple[int, float]:
    """(saves, wall seconds between saves) of the variant's uninterrupted run: a save every
    `checkpoint_every` steps or `checkpoint_minutes`, whichever comes first, and one at the end."""
    work = v.train_s + (v.eval_s or 0.0)
    intervals = []
    if v.checkpoint_every and v.checkpoint_every < v.steps:
        intervals.append(work * v.checkpoint_every / v.steps)
    if v.checkpoint_minutes:
        intervals.append(60.0 * v.checkpoint_minutes)
    interval = min(intervals) if intervals else work
    interval = min(interval, work) if work else 0.0
    saves = max(1, math.ceil(work / interval - 1e-9)) if interval else 1
    return saves, interval


def price(v: Variant, figures: Mapping[str, Figure] = FIGURES, mtbf_s: float | None = None) -> Bill:
    """The variant's bill (see the module docstring). A preemption costs one restart plus half the
    interval between saves replayed; the expected number is the paid time / `mtbf_s`, the paid
    time including the recoveries themselves: total = base / (1 - cost per preemption / mtbf)."""
    f = {k: fig.seconds for k, fig in figures.items()}
    s: dict[str, float] = {}
    _add(s, TRAIN, v.train_s)
    eval_s = v.eval_s
    _add(s, EVAL, eval_s or 0.0)
    # the first start
    cold = not v.warm
    _add(s, SETUP, ((f["setup_fresh"] if v.first_on_slice else f["setup_check"]) + f["launch"]) * cold)
    _add(s, RUNTIME_STARTUP, 0.0 if v.warm else f["resident_start"] if v.resident else f["runtime_init"])
    _add(s, DATA_LOADING, 0.0 if v.warm and v.data_loaded else f["data_load"])
    _add(s, OTHER, f["other"])
    hit = f["compile_cache_hit"]
    train = 0.0 if v.warm and v.train_in_process else \
        hit if (v.compile_cache and v.train_cached) or v.train_ahead else v.compile_train_s
    evals = 0.0 if v.evaluations == 0 or (v.warm and v.eval_in_process) else \
        hit if (v.compile_cache and v.eval_cached) or v.eval_ahead else v.compile_eval_s
    _add(s, PROGRAM_STARTUP, train + evals)
    saves, interval = save_count(v, figures)
    _add(s, CHECKPOINT_SAVE, f["final_save"])
    _add(s, IDLE, f["between_variants"] * cold)
    periodic = (saves - 1) * f["save"]
    _add(s, CHECKPOINT_SAVE, periodic)
    # a restart after a preemption: a fresh slice, the cache (or not), the checkpoint read back
    fixed = {SETUP: f["setup_fresh"] + f["launch"], RUNTIME_STARTUP: f["runtime_init"], DATA_LOADING: f["data_load"],
             OTHER: f["other"], CHECKPOINT_RESTORE: f["restore"],
             PROGRAM_STARTUP: (hit if v.compile_cache or v.train_ahead else v.compile_train_s)
             + (0.0 if v.evaluations == 0 else hit if v.compile_cache or v.eval_ahead else v.compile_eval_s)}
    restart = sum(fixed.values())
    young = math.sqrt(2 * f["save"] * mtbf_s) if mtbf_s else None
    preemptions = recovery = 0.0
    if mtbf_s:
        cost = restart + interval / 2
        if cost >= mtbf_s:
            raise UserError(f"one preemption costs {cost / 3600:.2f} h (a restart and half a checkpoint interval), "
                            f"more than --mtbf {mtbf_s / 3600:g}h: no run would finish; save more often "
                            "(train.checkpoint_every_minutes) or plan for a longer MTBF")
        base = sum(s.values())
        total = base / (1 - cost / mtbf_s)
        preemptions = total / mtbf_s
        for category, seconds in (fixed | {WASTED_PROGRESS: interval / 2}).items():
            _add(s, category, preemptions * seconds)
        recovery = preemptions * cost
    return Bill(seconds=s, checkpoint_s=periodic, recovery_s=recovery, preemptions=preemptions, saves=saves,
                checkpoint_interval_s=interval,
                young_interval_s=young, restart_s=restart, eval_known=eval_s is not None)


# ----------------------------------------------------------------------------- calibration


def ledger_timings(book: Ledger, warm: bool | None = None) -> dict[str, list[LaunchTiming]]:
    """{variant: the `timing` of each of its launches that ended with one} of a programme's ledger
    (experiments/launcher/ledger.py: the trainer's last `timing` event, with the supervisor's `setup`
    and `setup_ran` beside it). A launch without one (older code, or the trainer said nothing) is
    left out, and so is a launch under way: it counts once it has ended. `warm`: only the launches
    that ran in resident trainers (True) or only the others (False)."""
    out = {}
    for name, record in book.variants.items():
        timings = [launch.timing for launch in record.supervision.launches if launch.timing is not None
                   and (warm is None or warm == (launch.resident or "").startswith("warm:"))]
        if timings:
            out[name] = timings
    return out


# figure -> the trainer's category (runtime/goodput.py) whose per-launch median replaces it (launches
# where it was > 0)
CALIBRATED = {"data_load": DATA_LOADING, "restore": CHECKPOINT_RESTORE, "other": OTHER}  # runtime_init: cold launches


@dataclass
class Calibration:
    """What a ledger measured: figures replaced by medians, and each variant's own compiles."""

    figures: dict[str, Figure]
    program_startup: dict[str, float] = field(default_factory=dict)  # variant -> median compile seconds a start
    launches: int = 0


def _median(figure: Figure, values: list[float], what: str, path: Path) -> Figure:
    return dataclasses.replace(figure, seconds=statistics.median(values),
                               source=f"ledger: median of {len(values)} {what} ({path})")


def read_ledger(state_dir: Path) -> Ledger:
    """A programme's ledger.json, read as the controller reads it (any schema it reads); UserError
    naming the fix for a directory without one or a ledger this code cannot read."""
    path = Path(state_dir) / "ledger.json"
    try:
        return load_ledger(read_state(path, "ledger"), path)
    except FileNotFoundError:
        raise UserError(f"--calibrate-from {state_dir}: no ledger.json there; give a programme's state directory "
                        "(outputs/programmes/<name>)") from None
    except RecordError as e:
        raise UserError(f"--calibrate-from {state_dir}: {e}") from None


def calibrate(state_dir: Path, figures: Mapping[str, Figure] = FIGURES) -> Calibration:
    """The figures with the medians a programme's ledger measured, each over the launches (or idle
    stretches) where it was above zero: `setup_check` and `setup_fresh`, the supervisor's `setup`
    before a launch, split by `setup_ran` (the workers set up, not only checked); `CALIBRATED`, the
    trainer's own categories; `runtime_init` from the cold launches' runtime start-up and
    `resident_start` from the warm ones' (launches into resident trainers); `save`, the blocking
    seconds of a save (checkpoint_save / saves);
    `compile_cache_hit`, the program start-up of a launch that only hit the cache, per hit;
    `between_variants`, a slice's idle stretch before its next variant (the slices' `gaps`); and
    each variant's median program start-up of the launches that compiled. The rest keep their
    figures. UserError for a directory without a readable ledger."""
    path = Path(state_dir) / "ledger.json"
    book = read_ledger(state_dir)
    runs = ledger_timings(book)
    every = [t for timings in runs.values() for t in timings]
    out = dict(figures)

    def calibrated(name: str, values: list[float], what: str) -> None:
        if values:
            out[name] = _median(figures[name], values, what, path)

    calibrated("setup_check", [t.setup for t in every if t.setup > 0 and not t.setup_ran],
               "launches' setup (the workers checked)")
    calibrated("setup_fresh", [t.setup for t in every if t.setup > 0 and t.setup_ran],
               "launches' setup (the workers set up)")
    for name, category in CALIBRATED.items():
        calibrated(name, [t.seconds[category] for t in every if t.seconds.get(category, 0.0) > 0],
                   f"launches' {category}")
    cold = [t for timings in ledger_timings(book, warm=False).values() for t in timings]  # a process's own start
    calibrated("runtime_init", [t.seconds[RUNTIME_STARTUP] for t in cold if t.seconds.get(RUNTIME_STARTUP, 0.0) > 0],
               f"cold launches' {RUNTIME_STARTUP}")
    calibrated("resident_start", [t.seconds.get(RUNTIME_STARTUP, 0.0) for timings in
                                  ledger_timings(book, warm=True).values() for t in timings],
               f"warm launches' {RUNTIME_STARTUP} (in resident trainers)")
    calibrated("save", [t.seconds[CHECKPOINT_SAVE] / t.saves for t in every
                        if t.saves > 0 and CHECKPOINT_SAVE in t.seconds], "launches' checkpoint_save per save")
    calibrated("compile_cache_hit", [t.seconds[PROGRAM_STARTUP] / t.hits for t in every
                                     if t.hits > 0 and t.misses == 0 and PROGRAM_STARTUP in t.seconds],
               "launches' program_startup per cache hit (launches that only hit the cache)")
    calibrated("between_variants", [gap for s in book.slices.values() for gap in s.gaps if gap > 0],
               "idle stretches of a slice before its next variant")
    compiles = {v: statistics.median(x) for v, timings in runs.items()
                if (x := [t.seconds[PROGRAM_STARTUP] for t in timings
                          if t.seconds.get(PROGRAM_STARTUP, 0.0) > 0 and not (t.hits > 0 and t.misses == 0)])}
    return Calibration(out, compiles, len(every))


# ----------------------------------------------------------------------------- the programme


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


def schedule(hours: list[float], slices: int) -> list[int]:
    """The slice each variant runs on, in order: each takes the slice that frees first (what
    the programme's controller does, one thread per slice taking the next queued variant)."""
    free = [0.0] * slices
    out = []
    for h in hours:
        i = min(range(slices), key=lambda j: (free[j], j))
        out.append(i)
        free[i] += h
    return out
