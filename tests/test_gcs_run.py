"""Runs that checkpoint to gs:// against gcp-storage-emulator on loopback (a real GCS endpoint:
google-cloud-storage, gcsfs and tensorstore all talk HTTP to it)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from google.cloud import storage

from helpers import (REFERENCE_EXTRA, REFERENCE_STEPS, assert_user_error, base_overrides, child_env, error_line,
                     kill_after_step, launch_pretrain, resumed_step, train, train_losses)
from gcs_emulator import start_gcs_emulator

SHORT_RETRIES = Path(__file__).parent / "short_gcs_retries"  # its sitecustomize shortens a child's retries

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
    proc = launch_pretrain(gcs, env=emulator.child_env(child_env()))
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
    """The storage endpoint dies as the last save starts writing: the run fails with one clear
    line naming the last complete step, the cut-off step is never resumed from, and once storage
    is back the run resumes from that step with the same losses as an uninterrupted run."""
    steps, reference = REFERENCE_STEPS, reference_losses  # the same run, checkpointing locally
    every = steps // 2  # two saves (each is many requests to the emulator): one committed, one cut off
    gcs = base_overrides(sudoku_dir, tmp_path / "gcs", steps=steps) + REFERENCE_EXTRA + [
        f"train.checkpoint_every={every}", "run.checkpoint.keep=10", "run.checkpoint.dir=gs://pod-runs/o/t",
        # no lease renewal while the run lasts: the save, not the heartbeat, is what meets the outage
        "run.lease.renew_every_s=600", "run.lease.stale_after_s=1800"]
    # The save of the last step waits for the previous one to be committed before its first request,
    # so the outage starts with step `every` complete and the save of step `steps` under way.
    emulator.arm_kill(f"o/t/{steps}/")
    # The trainer with the clients' retry budgets shortened (tests/short_gcs_retries): the outage
    # fails its save in seconds, not after gcsfs's ~35 s of backoff; what it then says and does is
    # the same.
    env = emulator.child_env(child_env())
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SHORT_RETRIES), env.get("PYTHONPATH")) if p)
    proc = launch_pretrain(gcs, env=env, merge_stderr=False)
    died: list[tuple[int, float]] = []
    watch = threading.Thread(target=lambda: died.append((emulator.wait_exit(timeout=300), time.monotonic())))
    watch.start()
    _, stderr = proc.communicate(timeout=300)
    ended = time.monotonic()
    watch.join()
    assert died and died[0][0] == -9, "the outage never came"
    print(f"outage to exit: {ended - died[0][1]:.0f} s")
    assert proc.returncode == 6, stderr[-3000:]
    error_line(stderr, f"checkpoint save of step {steps} to gs://pod-runs/o/t failed",
               f"the last complete checkpoint: step {every}.", last=True)

    emulator.start()  # storage is back: resume from the newest complete step, never the cut-off one
    names = {b.name for b in storage.Client().list_blobs("pod-runs", prefix="o/t/")}
    assert f"o/t/{every}/commit_success.txt" in names and f"o/t/{steps}/commit_success.txt" not in names
    assert resumed_step(train(gcs).log) == every
    out = tmp_path / "gcs" / "test" / "t"
    losses = {s: v for s, v in train_losses(out).items() if s > every}
    assert sorted(losses) == list(range(every + 1, steps + 1))
    assert losses == pytest.approx({s: reference[s] for s in losses}, rel=1e-6, abs=1e-7)
