"""Orbax checkpoints of the whole train state, local or gs://, written by every process.

Each step directory holds two items: `state` (params, optimizer state, EMA, step, RNG, as
sharded arrays) and `meta` (JSON: data position, W&B run id, config snapshot, last metrics).
Saves are asynchronous: the train loop goes on while the arrays are written. Orbax writes
a step to a temporary name and only then marks it complete (a rename locally, a
commit_success file on GCS), and `latest_step` only ever sees complete steps, so a save cut
off by a crash or an outage is never chosen for resume.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import orbax.checkpoint as ocp

from runtime.errors import StorageError, UserError, one_line, storage_fault, storage_fix

log = logging.getLogger(__name__)


class Checkpoints:
    def __init__(self, directory: str, *, keep: int, async_save: bool):
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

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Start an async save of `step` once the previous one is committed (Orbax waits
        there anyway; waiting here tells which step a failure belongs to)."""
        self.wait()
        self._pending = step
        try:
            self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                           meta=ocp.args.JsonSave(meta)))
        except Exception as e:
            raise self._failed(e) from e

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

    def read_meta(self, step: int) -> dict[str, Any]:
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

    def restore_state(self, step: int, abstract_state: Any) -> Any:
        """Restore straight into the shardings carried by `abstract_state` (no gather on one host)."""
        try:
            return self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))).state
        except Exception as e:
            raise UserError(f"checkpoint step {step} in {self.directory} does not fit this run's state "
                            f"({one_line(e)[:300]}); resume with the config that wrote it, or use a new run.name") from e

    def wait(self) -> None:
        """Block until the in-flight async save is committed (StorageError if it failed)."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            raise self._failed(e) from e
        if self._pending is not None:
            self._confirmed, self._pending = self._pending, None

    def close(self) -> None:
        self.manager.close()
