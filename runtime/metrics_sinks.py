"""Where training metrics go: a JSONL file, Weights & Biases and the console (one human line per row).

Only the primary process (JAX process 0) writes anything. Every other process builds
the same object with ``is_primary=False`` so call sites need no ``if`` around them; on
those processes every method returns at once, touching no file, W&B or the console.

Non-finite values: W&B gets the raw float (it stores NaN/Infinity itself). The JSONL
file must stay strict JSON, so there NaN, +inf and -inf are written as the strings
``"nan"``, ``"inf"`` and ``"-inf"``; ``float(value)`` turns them back into floats.
A string (not null) is used so that NaN and +/-inf stay distinguishable.

The JSONL file only ever holds whole lines: each row is one write of a complete line, a
failed write (a full disk) is cut back to the last complete line, and a torn last line left
by an older writer is dropped when the file is opened. A failed write is one line, exit 6
(`OutputDirError`), naming the file and the fix.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from runtime.errors import EXIT_FAILURE, OutputDirError, UserError, one_line, storage_fault, storage_fix

JSONL_NAME = "metrics.jsonl"
log = logging.getLogger(__name__)


class WandbMode(StrEnum):
    """run.wandb.mode (the config schema's type for it, and what MetricsSinks accepts)."""

    online = "online"  # stream to the W&B server (needs credentials on the primary worker)
    offline = "offline"  # W&B files under the run directory; `wandb sync` them later
    disabled = "disabled"  # no W&B at all (wandb.init is not called); metrics.jsonl only

# The held-out metric a row's line shows, the first of these a run has logged (the programme's
# primary metric first: experiments/programme.py PRIMARY).
EVAL_HEADLINES = ("eval/exact_accuracy", "eval/accuracy", "eval/token_accuracy", "eval/loss")


def _duration(seconds: float) -> str:
    """M:SS, H:MM:SS, or days and hours past a day."""
    s = int(round(seconds))
    if s >= 86400:
        return f"{s // 86400}d{s // 3600 % 24:02d}h"
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def human_line(step: int, total: int, values: Mapping[str, Any], held_out: tuple[str, float] | None) -> str:
    """One line a person reads for a logged row (MaxText's style; under 100 columns):
    `step 120/200  loss 1.2345  exact_accuracy 0.512  0.041 s/step  390 ex/s  MFU 12.3%  ETA 0:03`.
    A field the row does not have is left out; `held_out` is the latest held-out metric."""
    parts = [f"step {step}/{total}"]
    loss = values.get("train/loss")
    if isinstance(loss, (int, float)) and not isinstance(loss, bool):
        parts.append(f"loss {loss:.5g}")
    if held_out is not None:
        parts.append(f"{held_out[0].rpartition('/')[2]} {held_out[1]:.4g}")
    rate = values.get("perf/steps_per_sec")
    if isinstance(rate, (int, float)) and rate > 0:
        parts.append(f"{1 / rate:.3g} s/step")
        if isinstance(values.get("perf/examples_per_sec"), (int, float)):
            parts.append(f"{values['perf/examples_per_sec']:.4g} ex/s")
        if isinstance(values.get("perf/mfu"), (int, float)):
            parts.append(f"MFU {100 * values['perf/mfu']:.1f}%")
        if total > step:
            parts.append(f"ETA {_duration((total - step) / rate)}")
    return "  ".join(parts)


class WandbConsole(StrEnum):
    """run.wandb.console: what W&B records of process 0's stdout/stderr (the run's Logs tab, output.log)."""

    # sys.stdout/sys.stderr's write() is wrapped; the text still reaches the terminal unchanged.
    # Not "redirect": that dup2()s fds 1 and 2 onto a pipe read by a W&B thread, which would catch
    # XLA's C++ logs too but puts every byte of the process (and its children) behind that thread.
    wrap = "wrap"
    off = "off"


def wandb_settings(*, system_metrics: bool, console: str, git_commit: str | None) -> dict[str, Any]:
    """wandb.Settings for process 0's run.

    system_metrics: W&B's system monitor (host CPU/memory/disk/network and accelerator utilisation
    charts) and the machine description; wandb-core samples only with both x_disable_* flags off.
    No start-up cost we could measure (offline wandb.init in 5 fresh processes, with and without).

    console: the progress bar (_progress_bar) writes to stderr too. Each redraw starts with a
    carriage return, which W&B's console emulator folds, so output.log (the Logs tab) holds one bar
    line per stretch between log lines, not one per refresh; the .wandb transaction log keeps a
    record per redraw, at most one a minute off a TTY. The bar is closed (ending its line) before
    the run finishes, and our `error:` line is printed after that: wrapping only adds a callback to
    write(), so the line reaches stderr as before (not output.log: the run has finished by then).

    git_commit: the commit the code came from (runtime.manifest.source_commit), given rather than
    probed: a tree shipped with `launch.py pod --ship` has no .git, and the working directory may
    be another repository. W&B's own git probing stays off.

    quiet keeps the banner to a few lines (warnings, errors and the run URL still print); the run
    manifest saved with save_file() is the full record of what ran, so no code snapshot.
    """
    return dict(
        console=WandbConsole(console).value,
        quiet=True,
        x_disable_stats=not system_metrics,
        x_disable_machine_info=not system_metrics,
        disable_git=True,
        git_commit=git_commit,
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
        system_metrics: bool = True,
        console: str = WandbConsole.wrap,
        git_commit: str | None = None,
    ) -> None:
        if wandb_mode not in set(WandbMode):
            raise ValueError(f"wandb_mode must be one of {[m.value for m in WandbMode]}, got {wandb_mode!r}")
        wandb_mode = WandbMode(wandb_mode)
        self.is_primary = is_primary
        self.output_dir = Path(output_dir)
        self._closed = False
        self._jsonl: LineFile | None = None
        self._bar: tqdm | None = None
        self._run: Any = None  # wandb Run; imported lazily so non-primary never loads wandb
        self._total = total_steps
        self._held_out: tuple[str, float] | None = None  # the latest held-out metric, for the lines
        if not is_primary:
            return

        # Append: a resumed run continues the same file instead of losing earlier rows.
        self._jsonl = LineFile(self.output_dir / JSONL_NAME)

        if wandb_mode != WandbMode.disabled:  # do not even call wandb.init (writes nothing)
            self._start_wandb(dict(mode=wandb_mode.value, project=wandb_project, entity=wandb_entity, group=group,
                                   name=name, id=run_id, config=config, tags=list(tags) or None),
                             wandb_settings(system_metrics=system_metrics, console=console, git_commit=git_commit))

        if progress_bar:
            self._bar = _progress_bar(total_steps, start_step)

    def _start_wandb(self, init: dict[str, Any], settings: dict[str, Any]) -> None:
        import wandb  # optional heavy (over 1 s to import): only runs that log to W&B load it

        try:
            with _output_faults(f"W&B files under {self.output_dir / 'wandb'}"):
                self._run = wandb.init(
                    **init,  # id: chosen by the caller, identical on all workers and on resume
                    resume="allow",
                    dir=str(self.output_dir),
                    # A run left open (e.g. by a crashed caller in the same process) is finished
                    # rather than silently returned with the wrong config ("return_previous").
                    reinit="finish_previous",
                    settings=wandb.Settings(**settings),
                )
        except wandb.errors.Error as e:  # a key the server rejects, an unknown entity: one line
            if self._jsonl is not None:
                self._jsonl.close()
            raise UserError(f"W&B did not start the run ({one_line(e)[:200]}); check WANDB_API_KEY and "
                            "run.wandb.entity / run.wandb.project, or use run.wandb.mode=offline") from e

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record metrics (keys already prefixed, e.g. "train/loss") for global `step`."""
        if not self.is_primary or self._closed:
            return
        if "step" in metrics or "time" in metrics:  # would silently overwrite the row's own fields
            raise ValueError("metric keys 'step' and 'time' are reserved; prefix them (train/...)")
        values = {key: to_python_scalar(v) for key, v in metrics.items()}
        row: dict[str, Any] = {"step": int(step), "time": time.time()}
        row.update({key: json_safe(v) for key, v in values.items()})
        assert self._jsonl is not None
        self._jsonl.append(json.dumps(row, allow_nan=False) + "\n", f"at step {int(step)}")

        if self._run is not None:
            with self._wandb(f"at step {int(step)}"), _output_faults(f"W&B files under {self.output_dir / 'wandb'} "
                                                                     f"at step {int(step)}"):
                self._check_wandb_dir(f"at step {int(step)}")
                self._run.log(values, step=int(step))
        self._console(int(step), values)

    def set_summary(self, metrics: Mapping[str, Any]) -> None:
        """Final metrics -> W&B run summary (JSONL/bar untouched)."""
        if not self.is_primary or self._closed or self._run is None:
            return
        with self._wandb("setting the run summary"):
            self._run.summary.update({key: _summary_value(v) for key, v in metrics.items()})

    def save_file(self, path: str | Path) -> None:
        """Upload a file (e.g. the run manifest) to W&B as it is now."""
        if not self.is_primary or self._closed or self._run is None:
            return
        self._check_wandb_dir(f"saving {Path(path).name}")
        src = Path(path).resolve()
        files_dir = Path(self._run.dir).resolve()
        # Copy into the run's files/ dir ourselves and save it in place: a snapshot matches
        # policy "now", and W&B would otherwise symlink to the original (and warn about it).
        dst = files_dir / src.name
        if src != dst:
            with _output_faults(f"W&B files under {self.output_dir / 'wandb'}"):
                shutil.copyfile(src, dst)
        with self._wandb(f"saving {src.name}"):
            self._run.save(str(dst), base_path=str(files_dir), policy="now", glob=False)

    def close(self, exit_code: int = 0) -> None:
        """Finish W&B with `exit_code`, close the JSONL file and the bar. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._run is not None:
                with self._wandb("finishing the run"):
                    self._run.finish(exit_code=exit_code)
        finally:
            self._run = None
            if self._bar is not None:
                self._bar.close()
            if self._jsonl is not None:
                self._jsonl.close()

    @contextlib.contextmanager
    def _wandb(self, when: str) -> Iterator[None]:
        """A W&B call that fails for any reason but our disk (its service process was killed: on a VM
        shutdown every process gets SIGTERM, wandb-core too) never fails the run: one warning, W&B off
        for the rest of it, metrics.jsonl goes on."""
        try:
            yield
        except OutputDirError:
            raise
        except Exception as e:
            if storage_fault(e) is not None:
                raise
            run, self._run = self._run, None
            log.warning("W&B stopped working %s (%s: %s); metrics.jsonl goes on, W&B is off for the rest of this run "
                        "(its offline files so far: %s)", when, type(e).__name__, one_line(e)[:200],
                        getattr(run, "dir", None) or self.output_dir / "wandb")
            _forget_wandb()

    def _check_wandb_dir(self, when: str) -> None:
        """W&B's service process writes the run's files and reports no failure to write them: a
        file put where their folder was (or the folder deleted) is found here, at the next row,
        rather than as a crash when the run ends (saving the manifest there)."""
        run_dir = Path(self._run.dir)
        if run_dir.is_dir():
            return
        top = self.output_dir / "wandb"
        blocked = next((p for p in (run_dir, *run_dir.parents) if p.exists() and not p.is_dir()), None)
        if blocked is not None:
            raise OutputDirError(f"cannot write W&B files under {top} {when} (a file stands where a folder goes: "
                                 f"{blocked}); move it out of the output directory and relaunch the same command to "
                                 "resume")
        raise OutputDirError(f"cannot write W&B files under {top} {when} (the folder {run_dir} is gone); put it back, "
                             "or relaunch the same command to resume with a new W&B folder")

    def __enter__(self) -> MetricsSinks:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(exit_code=0 if exc_type is None else EXIT_FAILURE)

    def _console(self, step: int, values: Mapping[str, bool | int | float]) -> None:
        """One human line per row with the loss or a held-out metric; on a terminal, a progress bar
        below the lines too (off a terminal the lines are the progress: a bar would only add noise)."""
        held_out = next(((k, float(values[k])) for k in EVAL_HEADLINES if isinstance(values.get(k), (int, float))),
                        None)
        if held_out is not None:
            self._held_out = held_out
        if "train/loss" in values or held_out is not None:
            line = human_line(step, self._total, values, self._held_out)
            if self._bar is not None:
                self._bar.write(line, file=sys.stdout)
            else:
                print(line, flush=True)
        if self._bar is not None and step > self._bar.n:  # `step` counts completed steps: never backwards
            self._bar.update(step - self._bar.n)


def _progress_bar(total_steps: int, start_step: int) -> tqdm | None:
    """A bar on a terminal only: off one (CI, pod logs) every refresh would be a line of its own."""
    if not sys.stderr.isatty():
        return None
    return tqdm(total=total_steps, initial=start_step, file=sys.stderr, dynamic_ncols=True, mininterval=0.5,
                unit="step")


class LineFile:
    """An append-only text file that only ever holds whole lines (one writer: the run's lease)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with _output_faults(str(self.path)):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._drop_torn_tail()

    def _drop_torn_tail(self) -> None:
        """Cut a last line without its newline (an old writer's crash) back to the line before."""
        size = end = os.fstat(self._fd).st_size
        with open(self.path, "rb") as f:
            f.seek(max(0, size - 1))
            if f.read(1) in (b"", b"\n"):
                return
            while end > 0:  # back to the last newline
                start = max(0, end - 65536)
                f.seek(start)
                newline = f.read(end - start).rfind(b"\n")
                end = start + newline + 1 if newline >= 0 else start
                if newline >= 0:
                    break
        os.ftruncate(self._fd, end)
        log.warning("dropped a torn last line of %s (%d bytes)", self.path, size - end)

    def append(self, line: str, when: str) -> None:
        """Write `line` (ending in a newline) whole, or not at all (OutputDirError)."""
        data = memoryview(line.encode("utf-8"))
        try:
            self._follow_path()
        except OSError as e:
            raise self._cannot_write(e, when) from e
        size = os.fstat(self._fd).st_size
        try:
            while data:
                data = data[os.write(self._fd, data):]  # a short write (disk filling up) goes on
        except OSError as e:
            try:
                os.ftruncate(self._fd, size)  # no torn line stays behind
            except OSError:
                pass
            raise self._cannot_write(e, when) from e

    def _follow_path(self) -> None:
        """Write to what the path names now. The file moved, deleted or replaced since it was opened
        (by hand, or a folder put in its place) would take every later row into a file nobody reads,
        and the run would end "completed" without them; a folder there now fails the open (EISDIR)."""
        try:
            if os.path.samestat(os.stat(self.path), os.fstat(self._fd)):
                return
        except FileNotFoundError:
            pass
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.close(self._fd)
        self._fd = fd

    def _cannot_write(self, e: OSError, when: str) -> OutputDirError:
        fault = storage_fault(e)
        return OutputDirError(f"cannot write {self.path} {when} ({fault or one_line(e)[:200]}); "
                              f"{storage_fix(fault, 'the output directory ' + str(self.path.parent))} and relaunch "
                              "the same command to resume")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@contextlib.contextmanager
def _output_faults(what: str) -> Iterator[None]:
    """A write failure of the output directory (full, read-only, no permission) as one line."""
    try:
        yield
    except OutputDirError:
        raise
    except Exception as e:
        fault = storage_fault(e)
        if fault is None:
            raise
        raise OutputDirError(f"cannot write {what} ({fault}); {storage_fix(fault, 'the output directory')} and "
                             "relaunch the same command to resume") from e


def _forget_wandb(wait_s: float = 5.0) -> None:
    """Drop W&B's connection to its dead service (and its exit hook, which would print a traceback),
    in a thread that is not waited for beyond `wait_s`: a service that hangs must not hold the run."""
    import wandb  # optional heavy, as in `_start_wandb`

    def teardown() -> None:
        try:
            wandb.teardown()
        except Exception:  # noqa: BLE001 - the service is gone; so is what it would say
            pass

    worker = threading.Thread(target=teardown, name="wandb-teardown", daemon=True)
    worker.start()
    worker.join(wait_s)


def _summary_value(value: Any) -> Any:
    """Scalars are converted like log(); anything else (str, dict) goes to W&B as is."""
    try:
        return to_python_scalar(value)
    except (TypeError, ValueError):
        return value
