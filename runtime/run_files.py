"""A run's own files beside its checkpoints: metrics.jsonl, events.jsonl and W&B's offline files.

Process 0 writes them into the output directory, on the worker's disk, which a preempted TPU VM
takes with it. So at every committed checkpoint (and when the run ends) they are copied to
`<checkpoint dir>/run_files/`, on gs:// for pod runs; a relaunch that finds no metrics.jsonl of
its own (a re-created VM's fresh disk) first copies them back, cut at the step it resumes from
(rows after it are logged again). Nothing here stops or holds up a run: the copies are made on a
thread of their own (a storage outage stalls them, not the steps), the last one is waited for
at most FINAL_WAIT_S (a preempted run must be gone within GCE's 30 s), and a copy that fails is
one warning.
"""

from __future__ import annotations

import json
import logging
import os
import threading

import fsspec

from runtime.errors import one_line, storage_fault
from runtime.events import FILE as EVENTS_FILE
from runtime.metrics_sinks import JSONL_NAME

log = logging.getLogger("runtime")

SYNCED = "run_files"
FINAL_WAIT_S = 10.0
FILES = (JSONL_NAME, EVENTS_FILE)
WANDB_DIR = "wandb"


def synced_dir(checkpoint_dir: str) -> str:
    return f"{checkpoint_dir.rstrip('/')}/{SYNCED}"


def _same(output_dir: str, checkpoint_dir: str) -> bool:
    return "://" not in output_dir + checkpoint_dir and os.path.realpath(synced_dir(checkpoint_dir)).startswith(
        os.path.realpath(output_dir) + os.sep)


class RunFiles:
    """Copies the output directory's run files beside the checkpoints (process 0's job)."""

    def __init__(self, output_dir: str, checkpoint_dir: str):
        self.output_dir, self.target = output_dir, synced_dir(checkpoint_dir)
        self.fs, self.root = fsspec.core.url_to_fs(self.target)
        self.off = _same(output_dir, checkpoint_dir)  # checkpoints inside the output directory: nothing to gain
        self.warned = False
        self.copied: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime_ns) when last copied
        self._wanted = False  # a copy was asked for since the copier last looked
        self._copier: threading.Thread | None = None  # running while copies are wanted
        self._lock = threading.Lock()

    def local_files(self) -> list[str]:
        """metrics.jsonl, events.jsonl and every file under wandb/, relative to the output directory."""
        found = [name for name in FILES if os.path.isfile(os.path.join(self.output_dir, name))]
        for folder, _, names in os.walk(os.path.join(self.output_dir, WANDB_DIR)):
            found += [os.path.relpath(os.path.join(folder, n), self.output_dir) for n in sorted(names)]
        return found

    def sync(self) -> None:
        """Copy what changed since the last copy, on the copier thread (started on first use)."""
        if self.off:
            return
        with self._lock:
            self._wanted = True
            if self._copier is None:
                self._copier = threading.Thread(target=self._copy_while_wanted, name="run-files-copier", daemon=True)
                self._copier.start()

    def flush(self, timeout: float = FINAL_WAIT_S) -> None:
        """Copy what changed, and wait for it up to `timeout` seconds (the run is ending)."""
        self.sync()
        copier = self._copier
        if copier is not None:
            copier.join(timeout)
            if copier.is_alive():
                log.warning("copying metrics and W&B files to %s did not finish within %gs; they are copied up "
                            "to the last checkpoint before", self.target, timeout)

    def _copy_while_wanted(self) -> None:
        while True:
            with self._lock:
                if not self._wanted:
                    self._copier = None
                    return
                self._wanted = False
            self._copy()

    def _copy(self) -> None:
        try:
            for rel in self.local_files():
                st = os.stat(os.path.join(self.output_dir, rel))
                if self.copied.get(rel) == (st.st_size, st.st_mtime_ns):
                    continue
                target = f"{self.root}/{rel.replace(os.sep, '/')}"
                self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
                self.fs.put_file(os.path.join(self.output_dir, rel), target)
                self.copied[rel] = (st.st_size, st.st_mtime_ns)
        except Exception as e:  # noqa: BLE001 - the checkpoints are what resumes; these follow at the next one
            if not self.warned:
                self.warned = True
                log.warning("copying metrics and W&B files to %s failed (%s); trying again at the next checkpoint",
                            self.target, storage_fault(e) or one_line(e)[:200])

    def restore(self, resumed_step: int | None) -> None:
        """On a disk without metrics.jsonl: copy the synced files back (metrics cut at `resumed_step`)."""
        if self.off or resumed_step is None or os.path.exists(os.path.join(self.output_dir, JSONL_NAME)):
            return
        try:
            if not self.fs.exists(f"{self.root}/{JSONL_NAME}"):
                return
            os.makedirs(self.output_dir, exist_ok=True)
            with self.fs.open(f"{self.root}/{JSONL_NAME}", "r") as f:
                rows = [line for line in f.read().splitlines() if (row_step := _step(line)) is not None and row_step <= resumed_step]
            if self.fs.exists(f"{self.root}/{EVENTS_FILE}"):
                self.fs.get_file(f"{self.root}/{EVENTS_FILE}", os.path.join(self.output_dir, EVENTS_FILE))
            for remote in self.fs.find(f"{self.root}/{WANDB_DIR}"):
                local = os.path.join(self.output_dir, *remote[len(self.root) + 1:].split("/"))
                os.makedirs(os.path.dirname(local), exist_ok=True)
                self.fs.get_file(remote, local)
            with open(os.path.join(self.output_dir, JSONL_NAME), "w", encoding="utf-8") as f:
                f.write("".join(line + "\n" for line in rows))
            log.info("restored metrics.jsonl (%d rows, up to step %d) and W&B files from %s", len(rows), resumed_step,
                     self.target)
        except Exception as e:  # noqa: BLE001 - the run goes on; its metrics start at the resumed step
            log.warning("could not restore metrics and W&B files from %s (%s)", self.target,
                        storage_fault(e) or one_line(e)[:200])


def _step(line: str) -> int | None:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    step = row.get("step") if isinstance(row, dict) else None
    return step if isinstance(step, int) else None
