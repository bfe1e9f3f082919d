"""Orbax checkpoints of the whole train state, local or gs://, written by every process.

Each step directory holds two items: `state` (params, optimizer state, EMA, step, RNG, as
sharded arrays) and `meta` (JSON: data position, W&B run id, config snapshot, last metrics).
Saves are asynchronous: the train loop goes on while the arrays are written. Orbax writes
a step to a temporary name and only then marks it complete (a rename locally, a
commit_success file on GCS), and `latest_step` only ever sees complete steps, so a save cut
off by a crash or an outage is never chosen for resume.

A complete step can still be unreadable (a truncated or overwritten file, a missing item).
`first_readable` finds the newest step every process can read, trying steps newest first without
moving anything; once one reads, the newer ones whose files showed damage are moved aside to
`<dir>/quarantined-<step>-<UTC time>` (never deleted; a name Orbax does not list). A failure with
no sign of damage (a code bug, a library that cannot read the format), no readable step at all, or
two steps in a row failing the same way, moves nothing and stops with one error.

`SaveClock` is the time-based cadence (train.checkpoint_every_minutes): the processes' clocks
differ, so process 0's decides and the others take its answer, asked at the same steps (the log
rows) by every process.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import zlib
from typing import Any, Callable, Optional, TypeVar, cast

import fsspec
import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from runtime.errors import StorageError, UserError, one_line, storage_fault, storage_fix
from runtime.preflight import is_project_step
from runtime.run_log import drop_unraisable

log = logging.getLogger(__name__)
T = TypeVar("T")

QUARANTINE_PREFIX = "quarantined-"
# Errors that say the storage could not be reached or read, not that the bytes are bad: such a
# step is never quarantined (GCS / tensorstore status names; plain Python exception types below).
_ACCESS_STATUS = re.compile(r"PERMISSION_DENIED|UNAUTHENTICATED|UNAVAILABLE|DEADLINE_EXCEEDED|RESOURCE_EXHAUSTED")
# Signs that a step's files are damaged or missing: tensorstore's status for a truncated, garbled or
# absent chunk, Python's for a missing file or bad JSON. Any other failure to read (a TypeError from
# a code bug, a format this Orbax does not know) is no sign, and such a step is never moved.
_DAMAGE_STATUS = re.compile(r"\b(DATA_LOSS|OUT_OF_RANGE|NOT_FOUND)\b|\bError (reading|decoding|opening)\b")
_DAMAGE_TYPES = (FileNotFoundError, EOFError, json.JSONDecodeError, UnicodeDecodeError)


class CorruptStep(UserError):
    """A complete step whose files cannot be read back (truncated, overwritten, missing).

    kind: what failed, without the step's own details ("state: OUT_OF_RANGE"): two steps in a row
    failing with the same kind point to a common cause rather than damage (Checkpoints.first_readable)."""

    def __init__(self, directory: str, step: int, problem: str, kind: str | None = None):
        self.step, self.problem, self.kind = step, problem, kind or problem
        super().__init__(f"checkpoint step {step} in {directory} is unreadable ({problem}); resume from an earlier "
                         "step, or restore this one from a backup")


def is_access_error(e: BaseException | None) -> bool:
    """True when `e` (or its cause) is a failure to reach or read the storage, not bad content."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        code = getattr(e, "code", None)
        if (isinstance(e, (PermissionError, ConnectionError, TimeoutError)) or _ACCESS_STATUS.search(str(e))
                or (isinstance(code, int) and (code in (401, 403, 429) or 500 <= code < 600))):
            return True
        e = e.__cause__ or e.__context__
    return False


def damage_sign(e: BaseException | None) -> str | None:
    """What in `e` (or its causes) says the files are damaged or missing ("OUT_OF_RANGE",
    "JSONDecodeError"); None when nothing does."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, _DAMAGE_TYPES):
            return type(e).__name__
        if found := _DAMAGE_STATUS.search(str(e)):
            return found.group(0)
        e = e.__cause__ or e.__context__
    return None


def innermost(e: BaseException) -> str:
    """The root cause's message, on one line (Orbax wraps tensorstore's precise one in pages of spec)."""
    seen: set[int] = set()
    while (inner := e.__cause__ or e.__context__) is not None and id(e) not in seen:
        seen.add(id(e))
        e = inner
    return " ".join(str(e).split()) or type(e).__name__


def _abandoned_read(unraisable) -> bool:
    """After a failed restore, Orbax's other reads of it are abandoned: tensorstore completes them
    later on its threads (their asyncio loop already closed) and the ones not started are collected
    as coroutines never awaited. Python reports each as "Exception ignored in ...": pages of
    tracebacks after the one warning, dropped (runtime/run_log.drop_unraisable)."""
    code = getattr(unraisable.object, "cr_code", None)
    closed_loop = isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"
    return closed_loop or (code is not None and "orbax" in code.co_filename)


def move_step(source: str, target: str) -> None:
    """Rename a step directory. Locally one atomic rename; on object stores (gs://) a copy of
    every object, checked complete, before anything is deleted."""
    if "://" not in source:
        os.rename(source, target)
        return
    fs, _, (src,) = fsspec.get_fs_token_paths(source)
    _, _, (dst,) = fsspec.get_fs_token_paths(target)
    objects = fs.find(src, detail=True)
    fs.copy(list(objects), [dst + path[len(src):] for path in objects])  # server-side copies, concurrent
    fs.invalidate_cache()
    copied = {path[len(dst):]: info["size"] for path, info in fs.find(dst, detail=True).items()}
    if copied != {path[len(src):]: info["size"] for path, info in objects.items()}:
        raise OSError(f"the copy to {target} is incomplete; {source} was left as it was")
    # Orbax lists a GCS step by its commit_success.txt: deleted first, the step leaves the listing
    # even if the rest of the deletion is cut off.
    marker = f"{src}/commit_success.txt"
    if marker in objects:
        fs.rm(marker)
    fs.rm(src, recursive=True)
    fs.invalidate_cache()


class Checkpoints:
    def __init__(self, directory: str, *, keep: int, async_save: bool,
                 on_commit: Callable[[int], None] | None = None):
        # Orbax wants absolute paths; a local relative path is taken from the working directory.
        self.directory = directory if "://" in directory else os.path.abspath(directory)
        try:
            self.manager = ocp.CheckpointManager(
                self.directory,
                options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True),
                item_names=("state", "meta"),
            )
        except Exception as e:
            raise UserError(f"cannot open checkpoint directory {directory}: {one_line(e)[:300]}; check the path "
                            "(and for gs:// the bucket and your access to it)") from e

        self.save_failed = False  # a save failed: this storage is not worth more writes in this run
        self._pending: int | None = None  # saved asynchronously, not yet known to be committed
        self._confirmed: int | None = self.manager.latest_step()  # the newest step known to be committed
        self.quarantined: list[tuple[int, str | None]] = []  # (step, where it was moved; None on processes > 0)
        self.on_commit = on_commit  # told each step this run's saves commit

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Start an async save of `step` once the previous one is committed (Orbax waits
        there anyway; waiting here tells which step a failure belongs to)."""
        self.wait()
        if jax.process_index() == 0:  # where Orbax clears the step's place
            self._check_place(step)
        self._pending = step
        try:
            self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                           meta=ocp.args.JsonSave(meta)))
        except Exception as e:
            raise self._failed(e) from e

    def _check_place(self, step: int) -> None:
        """Orbax deletes whatever stands at `<dir>/<step>` before it writes the step there: a
        file or folder someone put there mid-run (the preflight refuses them before the run) stops
        the run (exit 6) instead. A folder holding a step's items is this project's (on GCS, a
        save an outage cut off), which Orbax replaces as it should. The directory is listed (one
        request on GCS, none into the step's own place unless something stands there)."""
        fs, root = fsspec.core.url_to_fs(self.directory)

        def entries(path: str) -> dict[str, bool]:  # name -> is a folder
            try:
                listed = fs.ls(path, detail=True, refresh=True)
            except FileNotFoundError:  # on GCS, a prefix with no object under it yet
                return {}
            return {e["name"].rstrip("/").rsplit("/", 1)[-1]: e["type"] == "directory" for e in listed}

        place = f"{self.directory}/{step}"
        try:
            is_dir = entries(root).get(str(step))
            if is_dir is None or is_project_step(root, str(step), is_dir, entries):
                return
        except Exception as e:  # the storage does not answer (an outage): the save would fail the same way
            self._pending = step
            raise self._failed(e) from e
        last = f"step {self._confirmed}" if self._confirmed is not None else "none yet"
        what = "folder" if is_dir else "file"
        raise StorageError(f"checkpoint save of step {step} to {self.directory} failed: {place} is a {what} that is no "
                           "checkpoint step of this project, and saving the step would delete it; the last complete "
                           f"checkpoint: {last}. Move it out of {self.directory} and relaunch the same command to resume")

    @property
    def last_complete(self) -> int | None:
        """The newest step known to be committed (a save in flight is not)."""
        return self._confirmed

    def _failed(self, e: BaseException) -> StorageError:
        self.save_failed = True
        last = f"step {self._confirmed}" if self._confirmed is not None else "none yet"
        fault = storage_fault(e)  # "no space left on device" rather than a tensorstore status dump
        return StorageError(f"checkpoint save of step {self._pending} to {self.directory} failed ({fault or one_line(e)[:200]}); "
                            f"the last complete checkpoint: {last}. Incomplete steps are never resumed from: "
                            f"{storage_fix(fault, self.directory)} and relaunch the same command to resume")

    def _item(self, step: int, item: str) -> epath.Path:
        return epath.Path(self.directory) / str(step) / item

    def _unreadable(self, step: int, item: str, e: BaseException) -> UserError:
        if is_access_error(e):
            return UserError(f"cannot read checkpoint step {step} in {self.directory} ({one_line(e)[:300]}); check "
                             "access to the storage and relaunch (nothing was changed)")
        problem, sign = f"{item}: {innermost(e)[:300]}", damage_sign(e)
        if sign is None:
            return UserError(f"cannot read checkpoint step {step} in {self.directory} ({problem}), and nothing says its "
                             "files are damaged (more likely the code or a library version), so nothing was moved: fix "
                             "that and relaunch, or if the step is damaged move it out of the way by hand")
        return CorruptStep(self.directory, step, problem, kind=f"{item}: {sign}")

    def read_meta(self, step: int) -> dict[str, Any]:
        """The step's metadata; CorruptStep if it cannot be read back.

        Items are read with Orbax's handlers rather than through the manager, whose restore
        ends in a barrier that a process that failed to read would never reach."""
        try:
            meta = ocp.JsonCheckpointHandler().restore(self._item(step, "meta"))
        except Exception as e:
            raise self._unreadable(step, "meta", e) from e
        if not isinstance(meta, dict):
            raise CorruptStep(self.directory, step, f"meta: expected a JSON object, found {type(meta).__name__}")
        return meta

    def restore_state(self, step: int, abstract_state: Any) -> Any:
        """Restore straight into the shardings carried by `abstract_state` (no gather on one host).

        A state saved with another structure or other shapes is a UserError naming the config
        (nothing is moved); one whose files cannot be read back is a CorruptStep."""
        path, handler = self._item(step, "state"), ocp.StandardCheckpointHandler()
        try:
            try:
                saved = handler.metadata(path).tree
            except Exception as e:
                raise self._unreadable(step, "state", e) from e
            mismatch = tree_mismatch(saved, abstract_state)
            if mismatch:
                raise UserError(f"checkpoint step {step} in {self.directory} does not fit this run's state ({mismatch}); "
                                "resume with the config (and code) that wrote it, or use a new run.name to start fresh")
            return self._restore(step, handler, path, abstract_state)
        finally:
            handler.close()

    def _restore(self, step: int, handler, path: epath.Path, abstract_state: Any) -> Any:
        try:
            return handler.restore(path, args=ocp.args.StandardRestore(abstract_state))
        except Exception as e:
            drop_unraisable(_abandoned_read)
            raise self._unreadable(step, "state", e) from e

    def first_readable(self, read: Callable[[int], T]) -> tuple[int, T]:
        """(step, read(step)) for the newest complete step that `read` succeeds on in every process.

        Steps are tried newest first and nothing is moved while trying: once one reads, the newer
        ones (each corrupt on some process: CorruptStep) are quarantined. When none reads, or two
        in a row fail the same way (a common cause, such as the code or a library version, is
        likelier than the same damage twice), nothing is moved and one error names the steps.
        Any other error stops the search at once, on every process."""
        failed: list[CorruptStep] = []
        steps = sorted(self.all_steps(), reverse=True)
        for step in steps:
            try:
                value, error = read(step), None
            except UserError as e:
                value, error = None, e
            error = self._agree(step, error)
            if error is None:  # only when this process's read succeeded: value is read(step)'s
                for corrupt in failed:
                    self.quarantine(corrupt.step, corrupt.problem)
                return step, cast(T, value)
            if not isinstance(error, CorruptStep):
                raise error
            failed.append(error)
            if len(failed) > 1 and failed[-1].kind == failed[-2].kind:
                raise self._none_readable(failed, same_way=True)
            if step != steps[-1]:
                log.warning("checkpoint step %d in %s cannot be read (%s); trying the step before it (nothing moved "
                            "yet)", step, self.directory, error.problem)
        raise self._none_readable(failed) if failed else self.nothing_left()

    def _none_readable(self, failed: list[CorruptStep], *, same_way: bool = False) -> UserError:
        steps, first = ", ".join(str(e.step) for e in failed), f"step {failed[0].step}: {failed[0].problem}"
        if same_way:
            return UserError(f"checkpoint steps {steps} in {self.directory} fail to read in the same way ({first}); a cause "
                             "common to them (the code, or a library version that cannot read them) is likelier than the "
                             "same damage twice, so nothing was moved: fix that and relaunch, or if the files are damaged "
                             "move those steps out of the way by hand (or restore them from a backup)")
        return UserError(f"no checkpoint step in {self.directory} can be read: steps {steps} ({first}; the others in the "
                         "log); nothing was moved: restore them from a backup, or move them out of the way by hand, or "
                         "start fresh with a new run.name (or run.checkpoint.dir)")

    def _agree(self, step: int, error: UserError | None) -> UserError | None:
        """Every process's outcome of reading `step` -> one decision for all: ok, corrupt (any
        process could not read it; its kind is then every process's, so all compare kinds alike)
        or an error to raise (anything else, on any process)."""
        if jax.process_count() == 1:
            return error
        mine = 0 if error is None else 1 if isinstance(error, CorruptStep) else 2
        kind = zlib.crc32(error.kind.encode()) & 0x7FFFFFFF if isinstance(error, CorruptStep) else 0
        gathered = np.asarray(multihost_utils.process_allgather(np.array([mine, kind], np.int32))).reshape(-1, 2)
        outcomes, kinds = gathered[:, 0], ",".join(str(k) for k in gathered[:, 1])
        worst, where = int(outcomes.max()), int(outcomes.argmax())
        if error is not None and jax.process_index() > 0:
            log.warning("process %d: %s", jax.process_index(), error)
        if worst == 1:
            problem = error.problem if isinstance(error, CorruptStep) else f"unreadable on process {where}, see its log"
            return CorruptStep(self.directory, step, problem, kind=kinds)
        if worst == mine:
            return error
        return UserError(f"process {where} cannot use checkpoint step {step} in {self.directory} (its log says why); "
                         "fix that and relaunch")

    def quarantine(self, step: int, problem: str) -> None:
        """Move `step` aside (process 0 only; every process then relists the steps)."""
        source, target, failure = f"{self.directory}/{step}", None, ""
        if jax.process_index() == 0:
            target = self._quarantine_name(step)
            try:
                move_step(source, target)
                log.warning("checkpoint step %d in %s is unreadable (%s); moved it to %s", step, self.directory,
                            problem, target)
            except Exception as e:  # noqa: BLE001 - any failure to move it is said, then the barrier
                failure = one_line(e)[:300] or type(e).__name__
        if jax.process_count() > 1:  # also the barrier: nobody relists before the move is done
            failed_on_0 = int(multihost_utils.broadcast_one_to_all(np.int32(bool(failure))))
            failure = failure or ("it failed on process 0, see its log" if failed_on_0 else "")
        if failure:
            raise UserError(f"checkpoint step {step} in {self.directory} is unreadable ({problem}) and could not be moved "
                            f"aside ({failure}); move {source} out of the way by hand and relaunch")
        self.manager.reload()
        self._confirmed = self.manager.latest_step()
        self.quarantined.append((step, target))

    def _quarantine_name(self, step: int) -> str:
        base = f"{self.directory}/{QUARANTINE_PREFIX}{step}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
        target, n = base, 1
        while epath.Path(target).exists():
            target, n = f"{base}-{n}", n + 1
        return target

    def quarantined_names(self) -> list[str]:
        """Names of the steps moved aside in this directory, by this run or an earlier one."""
        root = epath.Path(self.directory)
        return sorted(p.name for p in root.iterdir() if p.name.startswith(QUARANTINE_PREFIX)) if root.exists() else []

    def nothing_left(self) -> UserError:
        moved = [f"step {s} -> {t}" for s, t in self.quarantined if t] or self.quarantined_names()
        return UserError(f"no readable checkpoint is left in {self.directory}: every complete step was unreadable and "
                         f"was quarantined ({', '.join(moved) or 'on process 0'}); start fresh with a new run.name (or "
                         "run.checkpoint.dir), or restore the steps from a backup (or rename one back to its step "
                         "number) and relaunch")

    def wait(self) -> None:
        """Block until the in-flight async save is committed (StorageError if it failed)."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            raise self._failed(e) from e
        if self._pending is not None:
            self._confirmed, self._pending = self._pending, None
            if self.on_commit:
                self.on_commit(self._confirmed)

    def poll(self) -> None:
        """Take note of an async save that has finished meanwhile (cheap: call it every step)."""
        if self._pending is not None and not self.manager.is_saving_in_progress():
            self.wait()

    def close(self) -> None:
        self.manager.close()


def process_0_decides(mine: bool) -> bool:
    """Process 0's `mine`, on every process (a collective: every process calls it at the same point)."""
    if jax.process_count() == 1:
        return mine
    return bool(multihost_utils.broadcast_one_to_all(np.int32(mine)))


class SaveClock:
    """Whether `minutes` have passed since the last save (train.checkpoint_every_minutes; None:
    never). `due` is a collective when `agree` is: every process asks at the same steps and gets
    process 0's answer, so all save at the same step whatever their own clocks say."""

    def __init__(self, minutes: Optional[float], clock: Callable[[], float] = time.monotonic,
                 agree: Callable[[bool], bool] = process_0_decides):
        self.interval = None if minutes is None else 60.0 * minutes
        self.clock, self.agree = clock, agree
        self.last = clock()

    def due(self) -> bool:
        if self.interval is None:
            return False
        return self.agree(self.clock() - self.last >= self.interval)

    def saved(self) -> None:
        """A save was started now (by any cadence): the interval starts again."""
        self.last = self.clock()


def newest_committed(directory: str) -> tuple[int, dict[str, Any]] | None:
    """(step, meta) of the newest committed step under `directory`, read without a manager, so
    nothing is created or moved (a launcher looking in on a run); None when it holds no step."""
    path = epath.Path(directory if "://" in directory else os.path.abspath(directory))
    steps = ocp.utils.checkpoint_steps(path)  # committed steps only (a rename locally, commit_success on GCS)
    if not steps:
        return None
    meta = ocp.JsonCheckpointHandler().restore(path / str(max(steps)) / "meta")
    return max(steps), meta if isinstance(meta, dict) else {}


def tree_mismatch(saved: Any, abstract: Any) -> str | None:
    """The first difference between a saved state's tree (Orbax metadata) and this run's
    abstract state, in arrays or shapes; None when they fit (dtypes are cast on restore)."""
    saved_flat = ocp.tree.to_flat_dict(saved, sep=".")
    wanted = ocp.tree.to_flat_dict(ocp.tree.serialize_tree(abstract, keep_empty_nodes=True), sep=".")
    for name in sorted(set(saved_flat) | set(wanted)):
        if name not in saved_flat:
            return f"{name} is not in the checkpoint"
        if name not in wanted:
            return f"the checkpoint has {name}, this run does not"
        old, new = getattr(saved_flat[name], "shape", None), getattr(wanted[name], "shape", None)
        if old is not None and new is not None and tuple(old) != tuple(new):
            return f"{name} has shape {tuple(old)} in the checkpoint, {tuple(new)} in this run"
    return None
