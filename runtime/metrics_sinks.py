"""Where training metrics go: a JSONL file, Weights & Biases and a console progress bar.

Only the primary process (JAX process 0) writes anything. Every other process builds
the same object with ``is_primary=False`` so call sites need no ``if`` around them; on
those processes every method returns at once, touching no file, W&B or the console.

Non-finite values: W&B gets the raw float (it stores NaN/Infinity itself). The JSONL
file must stay strict JSON, so there NaN, +inf and -inf are written as the strings
``"nan"``, ``"inf"`` and ``"-inf"``; ``float(value)`` turns them back into floats.
A string (not null) is used so that NaN and +/-inf stay distinguishable.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Iterable, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any, TextIO

import numpy as np
from tqdm import tqdm

from runtime.errors import UserError, one_line

JSONL_NAME = "metrics.jsonl"


class WandbMode(StrEnum):
    """run.wandb.mode (the config schema's type for it, and what MetricsSinks accepts)."""

    online = "online"  # stream to the W&B server (needs credentials on the primary worker)
    offline = "offline"  # W&B files under the run directory; `wandb sync` them later
    disabled = "disabled"  # no W&B at all (wandb.init is not called); metrics.jsonl only

# Metrics shown in the progress bar postfix, matched on the last "/" segment of the key;
# "train/" keys are shown without their prefix, others keep it ("eval/loss").
HEADLINE_NAMES = {
    "loss": "loss",
    "lr": "lr",
    "learning_rate": "lr",
    "examples_per_sec": "ex/s",
    "examples_per_second": "ex/s",
    "examples_per_s": "ex/s",
}

# W&B settings: we run our own progress bar and JSONL, so W&B must not capture the
# console (it would record every bar refresh and, in "redirect" mode, dup the stderr
# fd). No system-metrics subprocess (wandb-symon) and no cloud-metadata/git probing:
# they cost start-up time on every run and in CPU tests, and the run manifest saved
# with save_file() is the record of what ran. quiet keeps the banner to a few lines
# (warnings, errors and the run URL still print).
_WANDB_SETTINGS = dict(
    console="off",
    quiet=True,
    x_disable_stats=True,
    x_disable_machine_info=True,
    disable_git=True,
    save_code=False,
)


def to_python_scalar(value: Any) -> bool | int | float:
    """jax/numpy 0-d arrays and scalars -> Python bool/int/float (forces a device read)."""
    if isinstance(value, (bool, int, float)):
        return value
    arr = np.asarray(value)
    if arr.size != 1:
        raise ValueError(f"metric must be a scalar, got shape {arr.shape}")
    item = arr.reshape(()).item()
    if isinstance(item, (bool, int)):
        return item
    if isinstance(item, complex):
        raise ValueError(f"metric must be real, got {item!r}")
    return float(item)


def json_safe(value: bool | int | float) -> bool | int | float | str:
    """Strict-JSON form of a scalar: non-finite floats become "nan" / "inf" / "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


class MetricsSinks:
    def __init__(
        self,
        *,
        is_primary: bool,
        output_dir: str | Path,
        wandb_mode: str,
        wandb_project: str,
        wandb_entity: str | None,
        group: str,
        name: str,
        run_id: str,
        config: dict,
        total_steps: int,
        start_step: int = 0,
        tags: Iterable[str] = (),
        progress_bar: bool = True,
    ) -> None:
        if wandb_mode not in set(WandbMode):
            raise ValueError(f"wandb_mode must be one of {[m.value for m in WandbMode]}, got {wandb_mode!r}")
        wandb_mode = WandbMode(wandb_mode)
        self.is_primary = is_primary
        self.output_dir = Path(output_dir)
        self._closed = False
        self._jsonl: TextIO | None = None
        self._bar: tqdm | None = None
        self._run: Any = None  # wandb Run; imported lazily so non-primary never loads wandb
        self._postfix: dict[str, str] = {}
        if not is_primary:
            return

        self.output_dir.mkdir(parents=True, exist_ok=True)
        # Append: a resumed run continues the same file instead of losing earlier rows.
        self._jsonl = open(self.output_dir / JSONL_NAME, "a", encoding="utf-8")

        if wandb_mode != WandbMode.disabled:  # do not even call wandb.init (writes nothing)
            import wandb

            try:
                self._run = wandb.init(
                    mode=wandb_mode.value,
                    project=wandb_project,
                    entity=wandb_entity,
                    group=group,
                    name=name,
                    id=run_id,  # chosen by the caller, identical on all workers and on resume
                    resume="allow",
                    dir=str(self.output_dir),
                    config=config,
                    tags=list(tags) or None,
                    # A run left open (e.g. by a crashed caller in the same process) is finished
                    # rather than silently returned with the wrong config ("return_previous").
                    reinit="finish_previous",
                    settings=wandb.Settings(**_WANDB_SETTINGS),
                )
            except wandb.errors.Error as e:  # a key the server rejects, an unknown entity: one line
                self._jsonl.close()
                raise UserError(f"W&B did not start the run ({one_line(e)[:200]}); check WANDB_API_KEY and "
                                "run.wandb.entity / run.wandb.project, or use run.wandb.mode=offline") from e

        if not progress_bar:
            return
        # Off a TTY (CI, pod logs) every refresh would be a new log line: refresh rarely.
        tty = sys.stderr.isatty()
        self._bar = tqdm(
            total=total_steps,
            initial=start_step,
            file=sys.stderr,
            dynamic_ncols=tty,
            mininterval=0.5 if tty else 60.0,
            unit="step",
        )

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record metrics (keys already prefixed, e.g. "train/loss") for global `step`."""
        if not self.is_primary or self._closed:
            return
        if "step" in metrics or "time" in metrics:  # would silently overwrite the row's own fields
            raise ValueError("metric keys 'step' and 'time' are reserved; prefix them (train/...)")
        values = {key: to_python_scalar(v) for key, v in metrics.items()}
        row = {"step": int(step), "time": time.time()}
        row.update({key: json_safe(v) for key, v in values.items()})
        assert self._jsonl is not None
        self._jsonl.write(json.dumps(row, allow_nan=False) + "\n")
        self._jsonl.flush()  # a crash or preemption loses at most the current row

        if self._run is not None:
            self._run.log(values, step=int(step))
        if self._bar is not None:
            self._update_bar(int(step), values)

    def set_summary(self, metrics: Mapping[str, Any]) -> None:
        """Final metrics -> W&B run summary (JSONL/bar untouched)."""
        if not self.is_primary or self._closed or self._run is None:
            return
        self._run.summary.update({key: _summary_value(v) for key, v in metrics.items()})

    def save_file(self, path: str | Path) -> None:
        """Upload a file (e.g. the run manifest) to W&B as it is now."""
        if not self.is_primary or self._closed or self._run is None:
            return
        import shutil

        src = Path(path).resolve()
        files_dir = Path(self._run.dir).resolve()
        # Copy into the run's files/ dir ourselves and save it in place: a snapshot matches
        # policy "now", and W&B would otherwise symlink to the original (and warn about it).
        dst = files_dir / src.name
        if src != dst:
            shutil.copyfile(src, dst)
        self._run.save(str(dst), base_path=str(files_dir), policy="now", glob=False)

    def close(self, exit_code: int = 0) -> None:
        """Finish W&B with `exit_code`, close the JSONL file and the bar. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._run is not None:
                self._run.finish(exit_code=exit_code)
        finally:
            self._run = None
            if self._bar is not None:
                self._bar.close()
            if self._jsonl is not None:
                self._jsonl.close()

    def __enter__(self) -> MetricsSinks:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(exit_code=0 if exc_type is None else 1)

    def _update_bar(self, step: int, values: Mapping[str, bool | int | float]) -> None:
        assert self._bar is not None
        for key, value in values.items():
            prefix, _, last = key.rpartition("/")
            short = HEADLINE_NAMES.get(last)
            if short is None or isinstance(value, bool):
                continue
            label = short if prefix in ("", "train") else f"{prefix}/{short}"
            self._postfix[label] = f"{value:.4g}"
        self._bar.set_postfix(self._postfix, refresh=False)
        # `step` counts completed steps; never move the bar backwards.
        if step > self._bar.n:
            self._bar.update(step - self._bar.n)


def _summary_value(value: Any) -> Any:
    """Scalars are converted like log(); anything else (str, dict) goes to W&B as is."""
    try:
        return to_python_scalar(value)
    except (TypeError, ValueError):
        return value
