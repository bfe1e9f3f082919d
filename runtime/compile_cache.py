"""A run's persistent compilation cache (`run.compile_cache`), and what jax's monitoring events
say about compiles: the cache's hits and misses, and each compile's span for the timing account
(runtime/goodput.py).

Where the cache is (docs/ARCHITECTURE.md says why):
  auto (default)  the cache this process's JAX already has (JAX_COMPILATION_CACHE_DIR, or set by
                  a caller in process: the test suite's one cache); else gs://<bucket>/compile_cache
                  when the checkpoints are on gs:// (every slice and every start of every variant
                  reads the same folder); else <run.root>/compile_cache
  a folder        that one, local or gs://bucket/prefix
  null            off for this run

JAX's cache key hashes the program, its compile options and devices, and the jax and jaxlib
versions: one folder serves every start of a variant and every variant whose step is the same
program, and never hands one the wrong program. JAX writes an entry from process 0 only, for
compiles of at least `jax_persistent_cache_min_compile_time_secs` (1 s by default); every process
reads. A run that sets its own folder puts the process's previous setting back when it ends.

Hits and misses are jax 0.10.2's monitoring events `/jax/compilation_cache/cache_hits` (a program
read from the cache) and `/jax/compilation_cache/cache_misses` (a compile long enough to cache that
was not found, then written), counted per process (jax/_src/compiler.py, compilation_cache.py).
Compile spans are jax's `/jax/core/compile/*` time-span events (jax/_src/dispatch.py): tracing,
lowering, and XLA's compile or the cache's read; only the main thread's count (a compile on a
background thread overlaps the run's work).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Any, Iterator

import jax
from jax.experimental.compilation_cache import compilation_cache

from runtime.errors import UserError, one_line
from runtime.goodput import Timing

log = logging.getLogger("runtime")

AUTO = "auto"
FOLDER = "compile_cache"  # under run.root, or at the top of the checkpoints' bucket
HITS, MISSES = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"
COMPILE_SPANS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                 "/jax/core/compile/backend_compile_duration")

_counts = {HITS: 0, MISSES: 0}
_watched: dict = {"timing": None, "thread": None}
_lock = threading.Lock()
_listening = False


def _on_event(event: str, **_: object) -> None:
    if event in _counts:
        with _lock:
            _counts[event] += 1


def _on_span(event: str, start_time: float, end_time: float, **_: str | int) -> None:
    timing = _watched["timing"]
    if timing is not None and event in COMPILE_SPANS and threading.get_ident() == _watched["thread"]:
        timing.compiled(start_time, end_time)


def _listen() -> None:
    """Register the listeners, once per process."""
    global _listening
    with _lock:
        if not _listening:
            jax.monitoring.register_event_listener(_on_event)
            jax.monitoring.register_event_time_span_listener(_on_span)
            _listening = True


def counts() -> tuple[int, int]:
    """(hits, misses) of the persistent cache in this process so far."""
    _listen()
    with _lock:
        return _counts[HITS], _counts[MISSES]


@contextlib.contextmanager
def watching(timing: Timing) -> Iterator[None]:
    """Compiles of this thread go to `timing` (program_startup) while inside."""
    _listen()
    previous = dict(_watched)
    _watched.update(timing=timing, thread=threading.get_ident())
    timing.set_cache_counts(counts)
    try:
        yield
    finally:
        _watched.update(previous)


def resolve(setting: str | None, checkpoint_dir: str, run_root: str) -> tuple[str | None, str]:
    """(the folder the run's cache is in, or None for none; why that one)."""
    if setting is None:
        return None, "run.compile_cache=null"
    if setting != AUTO:
        return setting if "://" in setting else os.path.abspath(setting), "run.compile_cache"
    current, enabled = _in_use()
    if current and enabled:
        return current, "run.compile_cache=auto: this process's JAX setting (JAX_COMPILATION_CACHE_DIR)"
    if checkpoint_dir.startswith("gs://"):
        bucket = checkpoint_dir[len("gs://"):].split("/", 1)[0]
        return f"gs://{bucket}/{FOLDER}", "run.compile_cache=auto: the checkpoints' bucket"
    return os.path.abspath(f"{run_root.rstrip('/')}/{FOLDER}"), "run.compile_cache=auto: under run.root"


@contextlib.contextmanager
def configured(setting: str | None, checkpoint_dir: str, run_root: str) -> Iterator[str | None]:
    """The run's cache in use while inside (see the module docstring); yields its folder (None: off).
    A local folder that cannot be created is one line (UserError), before anything compiles."""
    path, why = resolve(setting, checkpoint_dir, run_root)
    before = _in_use()
    after = (before[0], False) if path is None else (path, True)
    if path is not None and "://" not in path:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise UserError(f"run.compile_cache: cannot create the folder {path} ({one_line(e)[:200]}); choose a folder "
                            "this user can write, or run.compile_cache=null to compile from nothing at every start") from e
    changed = after != before and (path is not None or bool(before[0] and before[1]))
    if changed:
        _use(*after)
    log.info("compile cache: %s (%s)", path or "off", why)
    try:
        yield path
    finally:
        if changed:
            _use(*before)


@contextlib.contextmanager
def off() -> Iterator[None]:
    """No persistent cache while inside: every compile is a compile. (An executable that JAX read
    back from its cache does not serialize whole on every backend: on CPU the copy lacks its
    compiled functions, so runtime/executables.py keeps only fresh compiles.)"""
    before = _in_use()
    _use(before[0], False)
    try:
        yield
    finally:
        _use(*before)


def _in_use() -> tuple[str | None, bool]:
    """(folder, enabled): the process's cache setting now."""
    options: Any = jax.config  # its options are attributes it makes at run time: no types for them
    return options.jax_compilation_cache_dir, options.jax_enable_compilation_cache


def _use(path: str | None, enabled: bool) -> None:
    """The process's cache folder from the next compile on (jax opens its cache once, lazily)."""
    compilation_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_enable_compilation_cache", enabled)
