"""The run directory lease (runtime/lease.py): one writer per run directory, local and gs://."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from helpers import (REPO, assert_user_error, base_overrides, error_line, fill, finish, launch_pretrain, read_jsonl,
                     resumed_step, saved_steps, small_disk, start_pod, train, wait_for, wait_for_step)
from runtime import lease as lease_module
from runtime.errors import EXIT_PREEMPTED, StorageError
from runtime.lease import LEASE_FILE, Lease, LeaseHeld, LocalStore

OTHER_HOST = "another-host"


def lease(directory, **kw) -> Lease:
    return Lease([(str(directory), "output directory", "run.name")], run="test/t", **kw)


def record(directory) -> dict:
    return json.loads((directory / LEASE_FILE).read_text())


def write_record(directory, *, host=OTHER_HOST, pid=4242, heartbeat_age=0.0, run="test/old", token="old") -> None:
    (directory / LEASE_FILE).write_text(json.dumps({
        "host": host, "pid": pid, "run": run, "run_id": "old-1234", "heartbeat": time.time() - heartbeat_age,
        "stale_after_s": 90.0, "token": token}))


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ---------------------------------------------------------------------------------- local


def test_acquire_renew_release(tmp_path, monkeypatch):
    wall = iter(range(1_000_000, 1_000_100))  # the heartbeat's wall clock, stepped by hand (a gate, no sleep)
    monkeypatch.setattr(lease_module, "_now", lambda: float(next(wall)))
    held = lease(tmp_path, run_id="r-1").acquire()
    try:
        first = record(tmp_path)
        assert (first["host"], first["pid"], first["run"], first["run_id"]) == (socket.gethostname(), os.getpid(),
                                                                                 "test/t", "r-1")
        held.set_run_id("r-2")  # a renewal: new heartbeat, same token
        second = record(tmp_path)
        assert second["run_id"] == "r-2" and second["heartbeat"] > first["heartbeat"]
        assert second["token"] == first["token"]
    finally:
        held.release()
    assert not (tmp_path / LEASE_FILE).exists()
    lease(tmp_path).acquire().release()  # free again


def test_second_writer_is_refused_with_one_line_naming_the_holder(tmp_path):
    write_record(tmp_path, heartbeat_age=5)
    with pytest.raises(LeaseHeld) as refused:
        lease(tmp_path).acquire()
    line = str(refused.value)
    assert "\n" not in line and refused.value.exit_code == 2
    for needle in ("in use by another run", OTHER_HOST, "pid 4242", "run test/old", "old-1234",
                   "last heartbeat 5s ago", "wait for it to finish", "stop it", "another run.name", "stale (90s"):
        assert needle in line, line
    assert record(tmp_path)["token"] == "old"  # untouched

    (tmp_path / "b").mkdir()
    held = lease(tmp_path / "b").acquire()
    try:  # a live lease of this very process refuses a second one too
        with pytest.raises(LeaseHeld, match=f"pid {os.getpid()}"):
            lease(tmp_path / "b").acquire()
    finally:
        held.release()


def test_lease_of_every_target_or_none(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "ckpt").mkdir()
    write_record(tmp_path / "ckpt")
    both = Lease([(str(tmp_path / "out"), "output directory", "run.name"),
                  (str(tmp_path / "ckpt"), "checkpoint directory", "run.checkpoint.dir")], run="test/t")
    with pytest.raises(LeaseHeld, match="checkpoint directory .*ckpt is in use.*another run.checkpoint.dir"):
        both.acquire()
    assert not (tmp_path / "out" / LEASE_FILE).exists()  # the one it had taken is given back


@pytest.mark.parametrize("case", ["old heartbeat", "dead pid", "left in this process"])
def test_stale_lease_is_taken_over_with_a_log_line(tmp_path, caplog, case):
    here = socket.gethostname()
    old = {"old heartbeat": dict(heartbeat_age=1000), "dead pid": dict(host=here, pid=dead_pid()),
           "left in this process": dict(host=here, pid=os.getpid())}[case]
    write_record(tmp_path, **old)
    with caplog.at_level(logging.WARNING, logger="runtime.lease"):
        held = lease(tmp_path).acquire()
    try:
        assert record(tmp_path)["token"] == held.record["token"]
        took = [r.getMessage() for r in caplog.records if "took over the lease" in r.getMessage()]
        assert len(took) == 1 and "run test/old" in took[0] and f"pid {old.get('pid', 4242)}" in took[0], took
        reason = {"old heartbeat": "last heartbeat is 1000s old", "dead pid": "is gone",
                  "left in this process": "earlier run in this process"}[case]
        assert reason in took[0], took
    finally:
        held.release()


def test_a_damaged_record_is_judged_by_its_age(tmp_path):
    (tmp_path / LEASE_FILE).write_text("")
    with pytest.raises(LeaseHeld):
        lease(tmp_path).acquire()
    os.utime(tmp_path / LEASE_FILE, (time.time() - 1000,) * 2)
    lease(tmp_path).acquire().release()


def test_heartbeat_notices_a_take_over(tmp_path):
    lost: list[StorageError] = []
    done = threading.Event()
    held = lease(tmp_path, renew_every_s=0.05, stale_after_s=0.5,
                 on_lost=lambda e: (lost.append(e), done.set())).acquire()
    try:
        first = record(tmp_path)["heartbeat"]
        wait_for(lambda: record(tmp_path)["heartbeat"] > first, timeout=30, what="a renewal")
        assert not lost and record(tmp_path)["token"] == held.record["token"]  # renewed, still ours
        # Another run takes it over, as runtime/lease.py does (a plain write could land between a
        # renewal's read and its write, and be overwritten): again if a renewal came first.
        store, thief = LocalStore(str(tmp_path)), json.dumps(dict(record(tmp_path), run="test/thief", token="thief"))
        wait_for(lambda: store.take_over(thief.encode(), store.read()[1]) is not None, timeout=30, what="the take-over")
        assert done.wait(30)
        assert "lost the lease" in str(lost[0]) and "run test/thief" in str(lost[0]) and lost[0].exit_code == 6
    finally:
        held.release()
    assert record(tmp_path)["token"] == "thief"  # release never removes another run's record


def test_failing_renewals_give_up_before_the_lease_could_go_stale(tmp_path):
    """Renewals fail on schedule, each a renewal period after the last by the lease's own clock
    (stepped by the test, so a busy machine changes nothing): the lease gives up at the last
    attempt it can make before its record is stale_after_s old, never after another run could
    take the lease over."""
    lost: list[StorageError] = []
    done = threading.Event()
    now = [0.0]
    period, stale = 1 / 16, 1 / 2  # exact in binary: the arithmetic below is exact
    held = lease(tmp_path, renew_every_s=period, stale_after_s=stale, clock=lambda: now[0],
                 on_lost=lambda e: (lost.append(e), done.set())).acquire()
    attempts: list[float] = []
    try:
        def broken(raw, version):
            now[0] += period  # this attempt comes one renewal period after the previous one
            attempts.append(now[0])
            raise OSError(errno.EIO, "Input/output error")

        held.targets[0][0].renew = broken  # the disk under the run directory fails
        assert done.wait(30)
        # Attempt k comes k periods after the last renewal; it gives up when the next one would be
        # due at or after `stale`: k = stale / period - 1 = 7, at 7/16 s, before the 8/16 s mark.
        assert attempts == [k * period for k in range(1, 8)], attempts
        assert re.search(r"lost the lease on .*: it could not be renewed for \d+s \(.*Input/output error\).* Restore "
                         "access to .* and relaunch the same command", str(lost[0])), lost[0]
    finally:
        held.release()


def test_renewal_on_a_full_disk_rewrites_the_record_in_place(tmp_path):
    with small_disk(tmp_path / "disk", "64k") as disk:
        held = lease(disk).acquire()
        try:
            fill(disk, leave=0)
            with open(disk / "more", "wb") as f, pytest.raises(OSError):  # not a byte more fits
                f.write(b"x" * 8192)
                f.flush()
            before = record(disk)["heartbeat"]
            held.set_run_id("r-9")
            assert record(disk)["run_id"] == "r-9" and record(disk)["heartbeat"] > before
        finally:
            held.release()


def test_lost_lease_ends_the_process_with_one_line(tmp_path):
    """The default reaction: one `error:` line and exit 6 at once, whatever the main thread is doing."""
    script = (f"import sys, time; sys.path.insert(0, {str(REPO)!r})\n"
              "from runtime.lease import Lease\n"
              f"Lease([({str(tmp_path)!r}, 'output directory', 'run.name')], run='test/t', renew_every_s=0.05,"
              " stale_after_s=1).acquire()\n"
              "print('held', flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    write_record(tmp_path, token="thief")
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 6, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: lost the lease on") and "relaunch" in lines[0], stderr


# ------------------------------------------------------------------------------------ gs://


@pytest.fixture
def bucket(tmp_path):
    from gcs_emulator import start_gcs_emulator

    with start_gcs_emulator(tmp_path) as emu:
        emu.apply_env()
        emu.create_bucket("lease-bucket")
        from google.cloud import storage

        yield storage.Client().bucket("lease-bucket")


def test_gcs_emulator_honours_generation_preconditions(bucket):
    from google.api_core.exceptions import PreconditionFailed

    blob = bucket.blob("x")
    blob.upload_from_string(b"1", if_generation_match=0)
    generation = blob.generation
    with pytest.raises(PreconditionFailed):
        bucket.blob("x").upload_from_string(b"2", if_generation_match=0)
    with pytest.raises(PreconditionFailed):
        bucket.blob("x").upload_from_string(b"2", if_generation_match=int(generation) + 1)
    with pytest.raises(PreconditionFailed):
        bucket.blob("x").delete(if_generation_match=int(generation) + 1)
    bucket.blob("x").upload_from_string(b"3", if_generation_match=generation)
    assert bucket.blob("x").download_as_bytes() == b"3"


def test_gcs_lease_refuse_take_over_and_loss(bucket):
    url = "gs://lease-bucket/exp/t"
    targets = [(url, "checkpoint directory", "run.checkpoint.dir")]
    first = Lease(targets, run="test/first", on_lost=lambda e: None).acquire()
    record_blob = bucket.blob(f"exp/t/{LEASE_FILE}")
    assert json.loads(record_blob.download_as_bytes())["run"] == "test/first"
    first.set_run_id("r-2")  # a renewal, conditional on the generation it wrote
    assert json.loads(record_blob.download_as_bytes())["run_id"] == "r-2"
    with pytest.raises(LeaseHeld, match="checkpoint directory gs://lease-bucket/exp/t is in use.*run test/first"):
        Lease(targets, run="test/second").acquire()

    stale = json.loads(record_blob.download_as_bytes()) | {"heartbeat": time.time() - 1000, "host": OTHER_HOST}
    record_blob.upload_from_string(json.dumps(stale))  # as if the first run had stopped renewing long ago
    second = Lease(targets, run="test/second").acquire()
    try:
        assert json.loads(record_blob.download_as_bytes())["run"] == "test/second"
        with pytest.raises(StorageError, match="lost the lease on gs://lease-bucket/exp/t.*run test/second"):
            first.renew()
    finally:
        first.release()
        second.release()
    assert not record_blob.exists()


# ------------------------------------------------------------------------------ the trainer


@pytest.mark.slow
def test_second_run_on_a_run_directory_is_refused_and_a_stale_lease_taken_over(sudoku_dir, tmp_path):
    """Two launches on one run directory: the second is refused with one line before it compiles
    or writes anything; the first goes on untouched. A lease left by a crash is taken over."""
    extra = ["train.checkpoint_every=25", "run.checkpoint.keep=2"]
    overrides = base_overrides(sudoku_dir, tmp_path, steps=100_000) + extra  # runs until the test stops it
    out = tmp_path / "test" / "t"
    first = launch_pretrain(overrides)
    wait_for_step(out / "metrics.jsonl", 1, [first])
    second = train(overrides, check=False)
    assert_user_error(second, f"output directory {out} is in use by another run", f"pid {first.pid}",
                      f"on host {socket.gethostname()}", "last heartbeat", "run test/t (id t-")
    os.kill(first.pid, signal.SIGTERM)  # the first run ends as a preempted one: a checkpoint, exit 8
    output = first.communicate(timeout=240)[0]
    assert first.returncode == EXIT_PREEMPTED and "took over" not in output, output[-3000:]
    last = int(output.split("preempted (SIGTERM): checkpoint saved at step ")[1].split()[0])
    rows = [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "train/loss" in r]
    assert rows == list(range(1, last + 1))  # one writer: no interleaved or repeated steps
    assert saved_steps(out / "checkpoints")[-1] == last
    assert not (out / LEASE_FILE).exists() and not (out / "checkpoints" / LEASE_FILE).exists()  # released

    # A crashed run's leases: its process is gone (this host), or its heartbeat is old (another host).
    write_record(out, host=socket.gethostname(), pid=dead_pid())
    write_record(out / "checkpoints", heartbeat_age=1000)
    resumed = train(base_overrides(sudoku_dir, tmp_path, steps=last + 2) + extra)
    took = [line for line in resumed.log.splitlines() if line.startswith("took over the lease")]
    # the record said 1000 s; a second or two may pass on a busy machine before the run reads it
    assert len(took) == 2 and "is gone" in took[0] and re.search(r"is 10\d\ds old", took[1]), resumed.log[-3000:]
    assert resumed_step(resumed.log) == last  # the first run's checkpoint, intact


@pytest.mark.slow
def test_every_process_of_a_pod_stops_with_the_refusal(sudoku_dir, tmp_path):
    out = tmp_path / "test" / "t"
    out.mkdir(parents=True)
    write_record(out, heartbeat_age=3)  # a live run elsewhere holds the output directory
    procs = start_pod(2, 1, base_overrides(sudoku_dir, tmp_path, steps=4))  # refused before any compile
    results = finish(procs, 180)
    lines = []
    for code, output, _ in results:
        assert code == 2 and "compiled train step" not in output, output[-3000:]
        lines.append(error_line(output))
    assert lines[0] == lines[1] and "is in use by another run: run test/old" in lines[0], lines
    assert record(out)["token"] == "old"
