"""A worker where a trainer of another run runs is busy (experiments/launcher/worker/once.py): a second
launch there is refused in one `tpu-busy` line and the running trainer goes on; and a
supervisor freeing the TPU for its own relaunch (worker/stop.py with RUN) ends only its own
run's processes. Real processes, scoped by a HOME of their own under tmp_path (worker/procs.py
calls the processes started with this HOME ours), so nothing else on the machine is touched."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import wire
from runtime.errors import EXIT_USER_ERROR

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def worker(tmp_path):
    """(HOME, start(run)): a stand-in trainer, `python .../pretrain_jax.py`, of `run`, that waits
    on its stdin (the test's gate) until the test ends; killed by its pid afterwards."""
    home = tmp_path / "home"
    home.mkdir()
    script = tmp_path / "fake" / "pretrain_jax.py"
    script.parent.mkdir()
    script.write_text("import sys\nprint('ready', flush=True)\nsys.stdin.read()\n")
    started = []

    def start(run: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "HOME": str(home), "PODRUNNER_RUN_ID": run})
        started.append(proc)
        assert proc.stdout.readline() == "ready\n"  # running (the gate: it says so itself)
        return proc

    yield home, start
    for proc in started:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def guard(home: Path, tmp_path: Path, run: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments.launcher.worker.once", "--key", "k1", "--host", "w0",
                           "--log", str(tmp_path / "logs" / "w0.log"), "--start", f"launch_id={run}", "--",
                           sys.executable, "-c", f"open({str(tmp_path / 'started')!r}, 'w')"],
                          cwd=REPO, env={**os.environ, "HOME": str(home)}, capture_output=True, text=True,
                          timeout=120)


def test_a_launch_on_a_busy_worker_is_refused_and_the_running_trainer_goes_on(worker, tmp_path):
    home, start = worker
    running = start("programme-a-exp08-x")
    out = guard(home, tmp_path, "programme-b-exp08-y")
    assert out.returncode == EXIT_USER_ERROR, out.stdout + out.stderr
    said = [line for line in out.stdout.splitlines() if not wire.event(line) and line.strip()]
    assert said == [f"podrunner: w0: the TPU is busy: pid {running.pid} trains run programme-a-exp08-x here "
                    f"({sys.executable} {tmp_path / 'fake' / 'pretrain_jax.py'}); wait for it to end, or end it: "
                    "`python experiments/launch.py stop --tpu NAME --zone ZONE`"], out.stdout
    failed = [e for e in map(wire.event, out.stdout.splitlines()) if e and e["event"] == "failed"]
    assert [e["failure"] for e in failed] == ["tpu-busy"]  # a class the supervisor knows: restart, not permanent
    assert "Traceback" not in out.stdout + out.stderr
    assert running.poll() is None and not (tmp_path / "started").exists()  # it goes on; nothing else started


def test_a_launch_beside_its_own_runs_stale_trainer_or_none_starts_its_trainer(worker, tmp_path):
    """The run's own earlier trainer (a re-created slice's, saving still) is not another job: the
    run's lease decides there (runtime/lease.py)."""
    home, start = worker
    start("programme-b-exp08-y")
    out = guard(home, tmp_path, "programme-b-exp08-y")
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "started").exists() and "busy" not in out.stdout


def test_a_supervisors_stop_ends_its_own_run_and_leaves_another_runs_trainer(worker):
    home, start = worker
    other, own = start("programme-a-exp08-x"), start("programme-b-exp08-y")
    out = subprocess.run([sys.executable, "-m", "experiments.launcher.worker.stop", "w0", "0", "programme-b-exp08-y"],
                         cwd=REPO, env={**os.environ, "HOME": str(home), "PODRUNNER_LIBTPU_LOCKFILE": str(home / "lock")},
                         capture_output=True, text=True, timeout=120)
    assert own.wait(timeout=60) == -signal.SIGKILL  # its own stale trainer: ended
    assert other.poll() is None  # another run's: left running, and said
    assert f"[w0] not killed: pid {other.pid} runs another run than programme-b-exp08-y" in out.stdout
    assert f"[w0] killed pid {own.pid}" in out.stdout
