"""`plan --calibrate-from <programme state dir>`: the figures replaced by the medians a programme's
ledger measured, read through the controller's own records (experiments/launcher/ledger.py).
`plan --calibrate-from <doctor file>`: experiments/doctor.py reads it into a `Calibration` (`read_calibration`,
`scale_steps`)."""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from experiments.launcher.ledger import LaunchTiming, RecordError, load_ledger, read_state
from experiments.plan.bill import FIGURES, Figure
from runtime.errors import UserError
from runtime.goodput import Category


@dataclass
class Calibration:
    """What a ledger measured: figures replaced by medians, and each variant's own compiles."""

    figures: dict[str, Figure]
    program_startup: dict[str, float] = field(default_factory=dict)  # variant -> median compile seconds a start
    launches: int = 0
    steps: dict[str, float] = field(default_factory=dict)  # a doctor file's: variant -> measured step seconds
    evals: dict[str, float] = field(default_factory=dict)  # a doctor file's: variant -> measured eval-step seconds
    accelerator: str | None = None  # the doctor's slice (None: a ledger, or CPU workers)
    platform: str | None = None  # the doctor's workers' devices: tpu or cpu


def calibrate(state_dir: Path, figures: Mapping[str, Figure] = FIGURES) -> Calibration:
    """The figures with the medians of a programme's ledger, each over the launches (or idle
    stretches) where it was above zero: `setup_check` and `setup_fresh` from the supervisor's
    `setup`, split by `setup_ran`; `data_load`, `restore`, `other` from the trainer's categories;
    `runtime_init` from the launches; `save` per
    save; `compile_cache_hit` per hit of a launch that only hit; `between_variants` from the
    slices' idle stretches; and each variant's median program start-up of the launches that
    compiled. The rest keep their figures. UserError for a directory without a readable ledger."""
    path = Path(state_dir) / "ledger.json"
    try:  # read as the controller reads it
        book = load_ledger(read_state(path, "ledger"), path)
    except FileNotFoundError:
        raise UserError(f"--calibrate-from {state_dir}: no ledger.json there; give a programme's state directory "
                        "(outputs/programmes/<name>)") from None
    except RecordError as e:
        raise UserError(f"--calibrate-from {state_dir}: {e}") from None
    # {variant: the `timing` of each launch that ended with one (the trainer's last `timing` event, with the
    # supervisor's `setup` and `setup_ran` beside it)}: a launch without one, or under way, is left out
    runs = {name: timings for name, record in book.variants.items()
            if (timings := [launch.timing for launch in record.supervision.launches if launch.timing is not None])}
    every = [t for timings in runs.values() for t in timings]
    out = dict(figures)

    def seconds(t: LaunchTiming, category: Category) -> float:
        return t.seconds.get(category, 0.0)

    measured = {
        "setup_check": ([t.setup for t in every if t.setup > 0 and not t.setup_ran],
                        "launches' setup (the workers checked)"),
        "setup_fresh": ([t.setup for t in every if t.setup > 0 and t.setup_ran],
                        "launches' setup (the workers set up)"),
        **{name: ([seconds(t, c) for t in every if seconds(t, c) > 0], f"launches' {c}") for name, c in (
            ("data_load", Category.DATA_LOADING), ("restore", Category.CHECKPOINT_RESTORE), ("other", Category.OTHER),
            ("runtime_init", Category.RUNTIME_STARTUP))},
        "save": ([seconds(t, Category.CHECKPOINT_SAVE) / t.saves for t in every
                  if t.saves > 0 and Category.CHECKPOINT_SAVE in t.seconds], "launches' checkpoint_save per save"),
        "compile_cache_hit": ([seconds(t, Category.PROGRAM_STARTUP) / t.hits for t in every
                               if t.hits > 0 and t.misses == 0 and Category.PROGRAM_STARTUP in t.seconds],
                              "launches' program_startup per cache hit (launches that only hit the cache)"),
        "between_variants": ([gap for s in book.slices.values() for gap in s.gaps if gap > 0],
                             "idle stretches of a slice before its next variant"),
    }
    for name, (values, what) in measured.items():
        if values:
            out[name] = dataclasses.replace(figures[name], seconds=statistics.median(values), high=None,
                                            source=f"ledger: median of {len(values)} {what} ({path})")
    compiles = {v: statistics.median(x) for v, timings in runs.items()
                if (x := [seconds(t, Category.PROGRAM_STARTUP) for t in timings
                          if seconds(t, Category.PROGRAM_STARTUP) > 0 and not (t.hits > 0 and t.misses == 0)])}
    return Calibration(out, compiles, len(every))


def moved(before: Mapping[str, Figure], after: Mapping[str, Figure]) -> list[str]:
    """One line per figure that changed: its name, from, to, by how much, and where it came from."""
    lines = []
    for name, new in after.items():
        old = before.get(name)
        if old is not None and new.seconds != old.seconds:
            change = (new.seconds - old.seconds) / old.seconds * 100 if old.seconds else float("inf")
            lines.append(f"calibrated: {name} {old.seconds:.3g} s -> {new.seconds:.3g} s ({change:+.0f}%), "
                         f"from {new.source}")
    return lines
