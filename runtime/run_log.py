"""The run's log file: everything logged during the run, and the only place where the storage
libraries' own reports go.

Orbax and tensorstore report a failed save with a traceback from each of their threads (a
full checkpoint disk printed ~600 lines), tensorstore's late callbacks add "Event loop is
closed" tracebacks (as unraisable exceptions, or through sys.excepthook), and gcsfs logs one per
request whose retries ran out in a GCS outage; the run's one `error:` line already names the
fault, the step and the fix. So while the run lives, their loggers (and `sys.unraisablehook`,
and those tracebacks of `sys.excepthook`) write to `<output dir>/run.log`
(process k > 0: `run.process<k>.log`) instead of the console; the run's own progress lines
go to both. When the output directory itself is the one that failed (full, read-only), the
file cannot take those lines either and they are dropped silently: the `error:` line still
says what failed.
"""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import os
import sys
from typing import Callable, Iterator

from runtime.errors import OutputDirError

# Loggers of the libraries that write checkpoints and manifests (absl carries Orbax's
# messages; asyncio reports Orbax's failed write tasks; gcsfs logs a traceback when its
# retries run out; google-cloud-storage and urllib3 log retries).
LIBRARY_LOGGERS = ("absl", "orbax", "tensorstore", "etils", "asyncio", "gcsfs", "fsspec", "google", "urllib3")
UNRAISABLE_LOGGER = "runtime.unraisable"  # exceptions Python can only print (sys.unraisablehook)
# On the console, these libraries' records are one line each, without their tracebacks: a failure
# they report is one the command handles and says in its own `error:` line (gcsfs's "_request out
# of retries" carries aiohttp's traceback, an export to an unreachable bucket printed both). Those
# that log progress at INFO are held at WARNING. A run's log file keeps everything (library_logs_to).
CONSOLE_QUIET = (*LIBRARY_LOGGERS, "aiohttp", "jax._src")
_HELD_AT_WARNING = ("absl", "jax._src", "orbax", "etils")


def console_logging(level: int, fmt: str, datefmt: str | None = None) -> None:
    """The console log of an entry point (the trainer and compile_only, export, import_reference,
    launch.py): records at `level` and above in `fmt`, the libraries' (CONSOLE_QUIET) one line each.
    It replaces the root logger's handlers: command lines call it as their process starts."""
    logging.basicConfig(format=fmt, datefmt=datefmt, force=True)
    root = logging.getLogger()
    root.setLevel(level)
    for handler in root.handlers:
        handler.setFormatter(_OneLineForLibraries(fmt, datefmt))
    for name in _HELD_AT_WARNING:
        logging.getLogger(name).setLevel(logging.WARNING)


def _of_library(name: str) -> bool:
    return any(name == lib or name.startswith(lib + ".") for lib in CONSOLE_QUIET)


class _OneLineForLibraries(logging.Formatter):
    """A library's record as one line, without its traceback; every other record as it is."""

    def format(self, record: logging.LogRecord) -> str:
        if not _of_library(record.name):
            return super().format(record)
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info = record.exc_text = record.stack_info = None  # the record is shared with other handlers
        try:
            return " ".join(super().format(record).split())[:500]
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved


def run_log_path(output_dir: str, process_index: int) -> str:
    name = "run.log" if process_index == 0 else f"run.process{process_index}.log"
    return os.path.join(output_dir, name)


class _QuietFileHandler(logging.handlers.WatchedFileHandler):
    """A file handler that never complains on the console: a log line that cannot be written
    (the disk it is on is full) is dropped rather than printed as a 'Logging error' traceback.
    Watched: a log file moved or deleted mid-run is opened again at its path (the lines would
    otherwise go to a file nobody reads); a folder put there is the run's to report (`check`)."""

    def _open(self):
        os.makedirs(os.path.dirname(self.baseFilename), exist_ok=True)  # other workers of a pod: their own disk
        return super()._open()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            super().emit(record)
        except OSError:  # opening the file failed (its disk is gone, a folder in its place): dropped
            pass

    def handleError(self, record: logging.LogRecord) -> None:
        pass

    def close(self) -> None:
        try:
            super().close()
        except OSError:  # its last lines could not be flushed (a full disk): dropped, as `emit` drops them
            pass

    def check(self, when: str) -> None:
        """OutputDirError when something other than a file stands at the log's path now (put there
        mid-run: the log's lines are dropped, and the next launch would be refused for it)."""
        _in_the_way(self.baseFilename, when)


def _in_the_way(path: str, when: str = "") -> None:
    if os.path.lexists(path) and not os.path.isfile(path):  # a folder (or dangling link) of that name: not ours
        raise OutputDirError(f"cannot write {path}{' ' + when if when else ''} (a folder stands where a file goes); "
                             "move what is in the way out of the output directory and relaunch the same command to "
                             "resume")


@contextlib.contextmanager
def library_logs_to(path: str) -> Iterator[Callable[[str], None]]:
    """Log to `path`; the storage libraries' loggers and unraisable exceptions only there.
    Restored afterwards. Yields the check that the log's path still takes a file (see
    _QuietFileHandler.check), for the run to call as it goes."""
    _in_the_way(path)
    handler = _QuietFileHandler(path, delay=True, encoding="utf-8")  # no file until something is logged
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    quiet = [logging.getLogger(name) for name in (*LIBRARY_LOGGERS, UNRAISABLE_LOGGER)]
    saved = [(lg, lg.propagate) for lg in quiet]
    root.addHandler(handler)
    for lg in quiet:
        lg.addHandler(handler)
        lg.propagate = False
    unraisable_hook, sys.unraisablehook = sys.unraisablehook, _Filtered.of(_log_unraisable)
    sys.excepthook = _LateLoopCallbacks(sys.excepthook, log=True)
    try:
        yield handler.check
    finally:
        sys.unraisablehook = _Filtered.of(unraisable_hook) if _DROPPED else unraisable_hook
        sys.excepthook = _LateLoopCallbacks(sys.excepthook, log=False)  # after the run: dropped
        for lg, propagate in saved:
            lg.removeHandler(handler)
            lg.propagate = propagate
        root.removeHandler(handler)
        handler.close()


def _log_unraisable(unraisable) -> None:
    """After a failed save, tensorstore's last write callbacks land on Orbax's closed event loop
    ("Event loop is closed", printed by Python as unraisable, dozens of tracebacks)."""
    where = f" in {unraisable.object!r}" if unraisable.object is not None else ""
    logging.getLogger(UNRAISABLE_LOGGER).warning("%s%s", unraisable.err_msg or "Exception ignored", where,
                                                 exc_info=(unraisable.exc_type, unraisable.exc_value,
                                                           unraisable.exc_traceback))


def _late_loop_callback(exc_type, exc_value, tb) -> bool:
    """A callback that tensorstore's C++ threads run after a failed save, on Orbax's event loop
    that is already closed: Python prints it as an uncaught exception (sys.excepthook, no
    "Exception ignored" header) whose every frame is asyncio's: nothing of ours called it."""
    if exc_type is not RuntimeError or str(exc_value) != "Event loop is closed" or tb is None:
        return False
    return os.sep + "asyncio" + os.sep in tb.tb_frame.f_code.co_filename


class _LateLoopCallbacks:
    """sys.excepthook for a run's process: late loop callbacks (`_late_loop_callback`) go to the
    run log while the run lives (log=True) and are dropped after it; every other exception goes
    to the hook that was there before."""

    def __init__(self, hook: Callable, log: bool) -> None:
        self.hook: Callable = hook.hook if isinstance(hook, _LateLoopCallbacks) else hook
        self.log = log

    def __call__(self, exc_type, exc_value, tb) -> None:
        if not _late_loop_callback(exc_type, exc_value, tb):
            self.hook(exc_type, exc_value, tb)
        elif self.log:
            logging.getLogger(UNRAISABLE_LOGGER).warning("a late callback on a closed event loop",
                                                         exc_info=(exc_type, exc_value, tb))


_DROPPED: list[Callable] = []  # unraisable reports nobody needs, dropped for the rest of the process


def drop_unraisable(predicate: Callable) -> None:
    """From now on, drop the unraisable reports `predicate` matches, during a run and after it
    (e.g. runtime/checkpointing.py: the reads Orbax abandons after a failed restore)."""
    if predicate not in _DROPPED:
        _DROPPED.append(predicate)
    sys.unraisablehook = _Filtered.of(sys.unraisablehook)


class _Filtered:
    """An unraisable hook that first drops what `_DROPPED` matches, then calls `hook`."""

    def __init__(self, hook: Callable) -> None:
        self.hook = hook

    @classmethod
    def of(cls, hook: Callable) -> "_Filtered":
        return hook if isinstance(hook, cls) else cls(hook)

    def __call__(self, unraisable) -> None:
        if not any(drop(unraisable) for drop in _DROPPED):
            self.hook(unraisable)
