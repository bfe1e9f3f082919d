"""Faults on a local pod: preemption (SIGTERM) with exact resume, a dead worker, and workers that
never all join."""

from __future__ import annotations

import json
import os
import signal

import pytest

from helpers import (REFERENCE_EXTRA, REFERENCE_STEPS, base_overrides, error_line, finish, saved_steps, start_pod,
                     train_losses, wait_for_step)
from runtime.errors import EXIT_PEER_LOST, EXIT_PREEMPTED, EXIT_USER_ERROR

pytestmark = pytest.mark.slow


def test_sigterm_saves_and_resumes_exactly(sudoku_dir, tmp_path, reference_losses):
    steps, reference = REFERENCE_STEPS, reference_losses  # the reference: one process x 8 devices
    # A pod of 2 processes x 1 device: its steps' collectives cost ~8x less than with 4 devices each.
    overrides = base_overrides(sudoku_dir, tmp_path, steps=steps) + REFERENCE_EXTRA + [
        "mesh=fsdp", "train.checkpoint_every=0"]  # saved at the end only: any earlier step is the preemption's
    out = tmp_path / "test" / "t"
    procs = start_pod(2, 1, overrides)
    wait_for_step(out / "metrics.jsonl", 2, procs)
    for p in procs:
        os.kill(p.pid, signal.SIGTERM)  # like a TPU maintenance event: every worker gets it
    results = finish(procs, 120)
    assert [r[0] for r in results] == [EXIT_PREEMPTED] * 2, results[0][1][-3000:] + results[1][1][-3000:]
    saved = saved_steps(out / "checkpoints")
    assert len(saved) == 1 and 2 <= saved[0] < steps  # the preemption checkpoint, not the final one
    assert f"checkpoint saved at step {saved[0]}" in results[0][1]

    procs = start_pod(2, 1, overrides)
    results = finish(procs, 240)
    assert [r[0] for r in results] == [0, 0], results[0][1][-3000:]
    assert f"resumed from step {saved[0]}" in results[0][1]
    assert train_losses(out) == pytest.approx(reference, rel=1e-5, abs=1e-6)  # every step, before and after


def test_dead_worker_brings_the_pod_down(sudoku_dir, tmp_path):
    overrides = base_overrides(sudoku_dir, tmp_path, steps=100000) + [
        "train.global_batch_size=12", "train.checkpoint_every=5", "train.eval_every=0"]
    out = tmp_path / "test" / "t"
    procs = start_pod(3, 2, overrides)
    wait_for_step(out / "metrics.jsonl", 5, procs)
    os.kill(procs[2].pid, signal.SIGKILL)
    results = finish(procs[:2], 90)
    for code, log, _ in results:
        # The event, not a clock: each survivor exits with its own code (finish() would SIGKILL one
        # still running) and names the cause, the closed connection of the liveness channel (not a
        # heartbeat timeout, and not a collective that hangs until its own deadline).
        assert code == EXIT_PEER_LOST, (code, log[-3000:])
        error_line(log, "error: process 2 (host ", ") stopped answering at step ", "connection closed")
    manifest = json.loads((out / "run_manifest.json").read_text())  # process 0 recorded how it ended
    assert (manifest["status"], manifest["exit_code"]) == ("failed", EXIT_PEER_LOST), manifest
    # Cut short mid-run (an async save may have been in flight): every step Orbax lists is complete.
    from runtime.checkpointing import Checkpoints

    ckpt = Checkpoints(str(out / "checkpoints"), keep=3, async_save=False)
    assert all(ckpt.read_meta(step)["step"] == step for step in ckpt.all_steps())


def test_workers_that_never_join_are_named(sudoku_dir, tmp_path):
    """JAX_NUM_PROCESSES=3 but only processes 0 and 1 start: both say that process 2 is missing, in
    one line, once initialization_timeout_s has passed, instead of JAX's abort minutes later."""
    procs = start_pod(3, 2, base_overrides(sudoku_dir, tmp_path) + ["distributed.initialization_timeout_s=8"],
                      ids=[0, 1])
    for i, p in enumerate(procs):
        log = p.communicate(timeout=180)[0]
        assert p.returncode == EXIT_USER_ERROR, (p.returncode, log[-3000:])
        assert i or "waiting up to 8s for all to join" in log, log[-3000:]  # process 0 says what it waits for
        # The event: our 8 s join deadline fired (its own line); JAX's own wait would say nothing for minutes.
        error_line(log, "process 2 did not join within 8s (2 of 3 joined: 0, 1)")


def test_preemption_watcher_restores_the_previous_sigterm_handler():
    """A run in a process that handles SIGTERM itself (a test runner, a notebook) leaves that handler in place."""
    from runtime.preemption import PreemptionWatcher

    def mine(signum, frame):
        pass

    before = signal.signal(signal.SIGTERM, mine)
    try:
        watcher = PreemptionWatcher()
        assert signal.getsignal(signal.SIGTERM) == watcher._on_signal
        watcher.close()
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)
