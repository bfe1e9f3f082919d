"""Runs that checkpoint to gs:// against gcp-storage-emulator on loopback (a real GCS endpoint:
google-cloud-storage, gcsfs and tensorstore all talk HTTP to it)."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
from google.cloud import storage

from helpers import (REFERENCE_EXTRA, REFERENCE_STEPS, REPO, assert_user_error, base_overrides, child_env,
                     kill_after_step, resumed_step, train, train_losses)
from gcs_emulator import start_gcs_emulator

pytestmark = pytest.mark.slow


@pytest.fixture
def emulator(tmp_path):
    with start_gcs_emulator(tmp_path) as emu:
        emu.apply_env()  # this process too: the test reads the bucket with google-cloud-storage
        emu.create_bucket("pod-runs")
        yield emu


def test_gcs_checkpoint_kill_and_resume(sudoku_dir, tmp_path, emulator, reference_losses):
    steps, reference = REFERENCE_STEPS, reference_losses  # the same run, checkpointing locally
    gcs = base_overrides(sudoku_dir, tmp_path / "gcs", steps=steps) + REFERENCE_EXTRA + [
        "train.checkpoint_every=10", "run.checkpoint.keep=2", "run.checkpoint.dir=gs://pod-runs/exp/t"]
    env = emulator.child_env(child_env(8))
    proc = subprocess.Popen([sys.executable, str(REPO / "pretrain_jax.py"), *gcs], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = tmp_path / "gcs" / "test" / "t"
    kill_after_step(proc, out / "metrics.jsonl", 22)  # the save at 20 started, so the one at 10 is committed

    from google.cloud import storage

    client = storage.Client()
    names = {b.name for b in client.list_blobs("pod-runs", prefix="exp/t/")}
    complete = sorted({int(n.split("/")[2]) for n in names if n.split("/")[2].isdigit()})
    assert complete and "exp/t/run_manifest.json" in names

    start = resumed_step(train(gcs).log)  # in this process, pointed at the emulator by apply_env()
    assert start in complete and start < steps
    losses = {s: v for s, v in train_losses(out).items() if s > start}
    assert sorted(losses) == list(range(start + 1, steps + 1))
    assert losses == pytest.approx({s: reference[s] for s in losses}, rel=1e-6, abs=1e-7)
    manifest = client.bucket("pod-runs").blob("exp/t/run_manifest.json").download_as_text()
    assert '"status": "completed"' in manifest and f'"resumed_from_step": {start}' in manifest


def test_missing_bucket_is_one_line(sudoku_dir, tmp_path, emulator):
    result = train(base_overrides(sudoku_dir, tmp_path) + ["run.checkpoint.dir=gs://no-such-bucket/x"], check=False)
    assert_user_error(result, "gs://no-such-bucket does not exist", "gcloud storage buckets create")


def test_storage_outage_during_async_save(sudoku_dir, tmp_path, emulator, reference_losses):
    """Kill the storage endpoint while saves are in flight: the run fails with one clear line,
    the cut-off step is never resumed from, and once storage is back the run resumes from the
    last complete step with the same losses as an uninterrupted run."""
    steps, reference = REFERENCE_STEPS, reference_losses  # the same run, checkpointing locally
    gcs = base_overrides(sudoku_dir, tmp_path / "gcs", steps=steps) + REFERENCE_EXTRA + [
        "train.checkpoint_every=20", "run.checkpoint.keep=10", "run.checkpoint.dir=gs://pod-runs/o/t"]
    # Few saves (each is many requests to the emulator): one committed, the next cut off, two after resuming.
    env = emulator.child_env(child_env(8))
    proc = subprocess.Popen([sys.executable, str(REPO / "pretrain_jax.py"), *gcs], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    def committed() -> list[int]:
        """Steps with a commit marker, as the emulator lists them (its object files can reach the disk
        before its index does: a step seen only on disk may be unknown to it after a restart)."""
        names = (b.name for b in storage.Client().list_blobs("pod-runs", prefix="o/t/"))
        return sorted(int(n.split("/")[2]) for n in names if n.endswith("/commit_success.txt"))

    deadline = time.monotonic() + 240
    while not committed():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.25)  # the emulator serves one request at a time: do not slow the saves down
    emulator.stop()  # outage, with the next async save about to start or under way
    outage = time.monotonic()
    _, stderr = proc.communicate(timeout=300)
    print(f"outage to exit: {time.monotonic() - outage:.0f} s")  # the figure docs/OPERATIONS.md quotes
    assert proc.returncode == 6, stderr[-3000:]
    error = [line for line in stderr.splitlines() if line.startswith("error:")]
    # The outage is noticed by a checkpoint save or by the lease's heartbeat, whichever comes first.
    assert len(error) == 1 and "last complete checkpoint" in error[0], stderr[-3000:]
    assert "checkpoint save of step" in error[0] or "lost the lease" in error[0], error

    emulator.start()  # storage is back: resume from the newest complete step, never the cut-off one
    complete = committed()
    named = re.search(r"the last complete checkpoint: step (\d+)", error[0])
    # The step the run knew to be complete ("none yet" when the outage hit the first save); a commit
    # racing the outage may have completed one more than the run knew of.
    assert named or "last complete checkpoint: none yet" in error[0] or "lost the lease" in error[0], error
    assert complete and (named is None or int(named.group(1)) in complete), (complete, error)
    log = train(gcs).log
    if "resumed from step " in log:
        start = resumed_step(log)
        assert start == complete[-1]
    else:  # the outage cut off the first save's commit: the run had named no complete checkpoint, and
        # Orbax lists the step it left (a commit marker, its metadata not committed) as no checkpoint
        # (or the lease's heartbeat noticed the outage first and named none)
        assert ("last complete checkpoint: none yet" in error[0] or "lost the lease" in error[0]) and \
            "(a fresh run)" in log, (error, log[-2000:])
        start = 0
    out = tmp_path / "gcs" / "test" / "t"
    losses = {s: v for s, v in train_losses(out).items() if s > start}
    assert sorted(losses) == list(range(start + 1, steps + 1))
    assert losses == pytest.approx({s: reference[s] for s in losses}, rel=1e-6, abs=1e-7)
