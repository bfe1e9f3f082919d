"""A full disk mid-run: one `error:` line, exit 6, no traceback on the console, metrics.jsonl
holding whole lines only, and the last complete checkpoint intact and resumable.

The disks are small tmpfs mounts (root or CAP_SYS_ADMIN, as in CI), filled from the
test once the run has a complete checkpoint."""

from __future__ import annotations

import logging
import errno
import json
import re
import shutil
import subprocess

import pytest

from helpers import (base_overrides, error_line, fill, launch_pretrain, read_jsonl, resumed_step, small_disk, train,
                     wait_for)
from runtime.errors import storage_fault


def console_of(proc: subprocess.Popen, timeout: float = 240) -> str:
    out, err = proc.communicate(timeout=timeout)
    return out + err


def test_storage_fault_names_the_fault():
    assert storage_fault(OSError(errno.ENOSPC, "No space left on device")) == "no space left on device"
    assert storage_fault(OSError(errno.EROFS, "Read-only file system")) == "read-only file system"
    tensorstore = ValueError('RESOURCE_EXHAUSTED: Error writing "x": Failed to write 33344 bytes to file 9: No space '
                             "left on device [os_error_code='28']")
    assert storage_fault(tensorstore) == "no space left on device"
    try:
        try:
            raise PermissionError(errno.EACCES, "Permission denied")
        except OSError as e:
            raise RuntimeError("wrapped") from e
    except RuntimeError as wrapped:
        assert storage_fault(wrapped) == "permission denied"
    assert storage_fault(ConnectionRefusedError("refused")) is None


@pytest.mark.slow
@pytest.mark.devices(1)  # storage faults, not the mesh
def test_full_checkpoint_disk_is_one_line_and_the_last_checkpoint_resumes(sudoku_dir, tmp_path):
    disk = tmp_path / "disk"
    overrides = base_overrides(sudoku_dir, tmp_path, steps=2000) + [
        "train.checkpoint_every=10", "run.checkpoint.keep=100", f"run.checkpoint.dir={disk / 'ckpt'}"]
    with small_disk(disk, "16M"):
        proc = launch_pretrain(overrides, merge_stderr=False)
        wait_for((disk / "ckpt" / "10").is_dir, timeout=240, what="step 10 committed (renamed into place)",
                 procs=[proc])
        fill(disk, leave=64 * 1024)  # a checkpoint (~600 KB) no longer fits
        console = console_of(proc)
        assert proc.returncode == 6, console[-3000:]
        error = error_line(console, last=True)
        assert re.search(r"checkpoint save of step \d+ to .*ckpt failed \(no space left on device\); the last complete "
                         r"checkpoint: step \d+\. .*free space on", error), error
        assert "orbax" not in console.lower(), console[-3000:]
        # Besides a human line per logged step: the plan and parameter table, then the one line.
        prose = [line for line in console.splitlines() if not re.match(r"step \d+/\d+  ", line)]
        assert len(prose) < 60, console
        last = int(re.search(r"last complete checkpoint: step (\d+)", error).group(1))
        shutil.copytree(disk / "ckpt", tmp_path / "ckpt")  # what an operator does: move to a bigger disk
    detail = (tmp_path / "test" / "t" / "run.log").read_text()  # the libraries' reports, in the log file
    assert "Traceback" in detail and "No space left on device" in detail

    moved = [o for o in overrides if not o.startswith(("run.checkpoint.dir", "train.steps"))]
    resumed = train(moved + [f"run.checkpoint.dir={tmp_path / 'ckpt'}", f"train.steps={last + 2}"])
    assert resumed_step(resumed.log) == last


@pytest.mark.slow
@pytest.mark.devices(1)  # storage faults, not the mesh
def test_full_output_directory_is_one_line_and_metrics_keep_whole_lines(sudoku_dir, tmp_path):
    disk = tmp_path / "disk"
    with small_disk(disk, "32k"):
        overrides = base_overrides(sudoku_dir, disk, steps=1000) + [
            "train.checkpoint_every=10", f"run.checkpoint.dir={tmp_path / 'ckpt'}"]
        result = train(overrides, check=False)
        out = disk / "test" / "t"
        assert result.code == 6 and "\n" not in result.error, (result.code, result.error, result.log[-3000:])
        match = re.search(rf"cannot write {out / 'metrics.jsonl'} at step (\d+) \(no space left on device\); free "
                          rf"space on the output directory {out} and relaunch .*the last complete checkpoint: step (\d+)$",
                          result.error)
        assert match, result.error
        failed, last = int(match.group(1)), int(match.group(2))
        text = (out / "metrics.jsonl").read_text()
        assert text.endswith("\n")  # the failed row was cut back: whole lines only
        steps = [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "train/loss" in r]
        assert steps == list(range(1, failed))
        assert last == max(s for s in range(10, failed, 10))
        # The manifest is replaced whole (temporary file, then rename), so it parses either way. Its status
        # depends on where the cut-back metrics row ended on the tmpfs's pages: "failed" when that freed a
        # page for the rewrite, "running" (the last one written) when the full disk refused it too.
        status = json.loads((out / "run_manifest.json").read_text())["status"]
        print(f"manifest status after the failure: {status}")
        assert status in ("running", "failed"), status


def test_the_run_logs_handler_closes_quietly_when_its_last_lines_cannot_be_flushed(tmp_path):
    """A full disk: the lines `emit` could not flush stay buffered, and closing the file flushes
    them again. The close drops them as `emit` does, rather than raising over the run's own
    one-line failure (runtime/run_log.py)."""
    import errno

    from runtime.run_log import _QuietFileHandler

    class FullDisk:
        def write(self, text):
            return len(text)

        def flush(self):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            self.flush()

    handler = _QuietFileHandler(str(tmp_path / "run.log"))
    handler.stream.close()
    handler.stream = FullDisk()
    handler.emit(logging.makeLogRecord({"msg": "a line that cannot be written"}))  # dropped, not printed
    handler.close()  # raised ENOSPC before
    assert handler.stream is None
