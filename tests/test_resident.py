"""Resident trainers (experiments/launcher/worker/resident.py): a slice's variants run back to back
in one trainer process per worker, started by a cold launch and handed each next job by the launch
guard of a warm one; all workers or none.

The pod is real: two launch guards (experiments/launcher/worker/once.py) per launch, each a worker
with a home of its own, their trainers joined by jax.distributed on loopback."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.launcher import pod
from experiments.launcher.worker import resident
from helpers import REPO, base_overrides, child_env, finish, free_port, kill, pid_alive, read_jsonl, wait_for
from runtime import wire
from runtime.errors import EXIT_FAILURE, EXIT_RESIDENT_LOST, EXIT_USER_ERROR

WORKERS = 2


def state_of(home: Path) -> dict | None:
    """A worker's resident, as its state file names it, when that process is alive."""
    try:
        state = json.loads((home / ".podrunner-resident" / "state.json").read_text())
    except (OSError, ValueError):
        return None
    return state if pid_alive(state["pid"]) else None


def launch(tmp_path: Path, homes: list[Path], env: dict, key: str, mode: str, overrides: list[str],
           changed: dict[int, dict] | None = None, next_job: list[str] | None = None) -> list[subprocess.Popen]:
    """One launch on every worker, the guard as pod.pod_command runs it; `changed`: worker -> more
    variables of its environment; `next_job`: the overrides of the job the next launch hands over."""
    procs = []
    for i in range(len(homes)):
        argv = [sys.executable, "-m", "experiments.launcher.worker.once", "--key", key, "--host", f"w{i}",
                "--log", str(homes[i] / "logs" / f"{key}.log"), "--start", "launch_id=t", "--resident", mode,
                *(["--next", json.dumps(next_job)] if next_job else []),
                "--", sys.executable, "pretrain_jax.py", *overrides]
        procs.append(subprocess.Popen(argv, cwd=REPO, env=dict(env, HOME=str(homes[i]), JAX_PROCESS_ID=str(i),
                                                               **(changed or {}).get(i, {})),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def failures(output: str) -> list[str]:
    return [e["failure"] for e in map(wire.event, output.splitlines()) if e and e["event"] == "failed"]


def failed_line(output: str) -> str:
    return next(e["line"] for e in map(wire.event, output.splitlines()) if e and e["event"] == "failed")


def timings(output: str) -> list[dict]:
    return [e for e in map(wire.event, output.splitlines()) if e and e["event"] == "timing"]


@pytest.mark.slow
def test_a_resident_pod_runs_the_next_variant_warm_and_goes_cold_together(tmp_path, sudoku_dir):
    homes = [tmp_path / f"worker-{i}" for i in range(WORKERS)]
    for home in homes:
        home.mkdir()
    env = child_env(2, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}", JAX_NUM_PROCESSES=str(WORKERS),
                    PODRUNNER_RESIDENT_VOTE_S="30")
    runs, procs = tmp_path / "runs", []

    def job(name: str, *more: str) -> list[str]:  # a cache of this test's own: every compile is counted
        return [*base_overrides(sudoku_dir, runs, steps=4, name=name), f"run.compile_cache={tmp_path / 'cache'}", *more]

    try:
        # 1. cold: each guard starts a resident with the first job; they stay when it completes. The
        # controller names the job it hands over next (another program: another weight decay),
        # whose steps the residents compile while this one trains
        procs = launch(tmp_path, homes, env, "k1", "cold", job("a"), next_job=job("b", "optim.weight_decay=0.25"))
        first = finish(procs, timeout=300)
        assert [code for code, _, _ in first] == [0, 0], first[0][1][-3000:] + first[1][1][-3000:]
        assert all("the next job's steps compiled ahead" in out for _, out, _ in first), first[0][1][-3000:]
        residents = [state_of(h) for h in homes]
        assert all(r and r["session"] == "k1" for r in residents), residents
        assert pod.resident_mode([{"resident": r} for r in residents], WORKERS).arg() == "warm:k1"

        # 2. warm: the next variant runs in the same processes, without their start-up; its steps,
        # compiled ahead, come from the compilation cache (without that: 2 misses)
        procs = launch(tmp_path, homes, env, "k2", "warm:k1", job("b", "optim.weight_decay=0.25"))
        second = finish(procs, timeout=300)
        assert [code for code, _, _ in second] == [0, 0], second[0][1][-3000:] + second[1][1][-3000:]
        # The event that there was no start-up: the same processes ran it (not a clock's reading).
        assert [state_of(h)["pid"] for h in homes] == [r["pid"] for r in residents]
        cold, warm = timings(first[0][1])[-1], timings(second[0][1])[-1]
        assert cold["misses"] >= 2 and warm["hits"] >= 2 and warm["misses"] == 0, (cold, warm)
        b = read_jsonl(runs / "test" / "b" / "metrics.jsonl")
        assert max(r["step"] for r in b) == 4  # its own run, complete

        # 3. worker 1's job would need another start-up environment (a flag JAX reads at its start):
        # its resident votes no, worker 0's hears why; both say it, exit resident-lost and leave
        procs = launch(tmp_path, homes, env, "k3", "warm:k1", job("c"),
                       changed={1: {"TPU_NAME": "another"}})
        third = finish(procs, timeout=300)
        assert [code for code, _, _ in third] == [EXIT_RESIDENT_LOST] * 2, third[0][1][-3000:] + third[1][1][-3000:]
        for _, out, _ in third:
            assert failures(out) == ["resident-lost"], out[-3000:]
            assert "the job's environment differs from the resident's (TPU_NAME)" in failed_line(out), out[-3000:]
        for r in residents:
            wait_for(lambda: not pid_alive(r["pid"]), timeout=60, what=f"resident {r['pid']} gone")
        assert not (runs / "test" / "c").exists()  # nothing ran
        assert pod.resident_mode([{"resident": resident_row(h)} for h in homes], WORKERS).arg() == "cold"

        # 4. cold again; then worker 1's resident is killed: worker 0's leaves too (its peer is lost:
        # runtime/liveness.py), so the versions check finds none; a warm launch sent before it
        # knew finds no resident on either worker and runs nothing
        procs = launch(tmp_path, homes, env, "k4", "cold", job("d"))
        fourth = finish(procs, timeout=300)
        assert [code for code, _, _ in fourth] == [0, 0], fourth[0][1][-3000:] + fourth[1][1][-3000:]
        residents = [state_of(h) for h in homes]
        os.kill(residents[1]["pid"], signal.SIGKILL)
        wait_for(lambda: not pid_alive(residents[0]["pid"]), timeout=120, what="worker 0's resident gone")
        assert pod.resident_mode([{"resident": resident_row(h)} for h in homes], WORKERS).arg() == "cold"
        procs = launch(tmp_path, homes, env, "k5", "warm:k4", job("e"))
        fifth = finish(procs, timeout=120)
        assert [code for code, _, _ in fifth] == [EXIT_RESIDENT_LOST] * 2
        assert all("no resident trainer of session k4" in failed_line(out) for _, out, _ in fifth)
    finally:
        kill(procs)
        for home in homes:
            if (r := state_of(home)) is not None:
                os.kill(r["pid"], signal.SIGKILL)


def resident_row(home: Path) -> dict | None:
    """What the versions check reports of a worker's resident (resident.describe, in that home)."""
    out = subprocess.run([sys.executable, "-m", "experiments.launcher.worker.versions", "w"], cwd=REPO,
                         env=dict(os.environ, HOME=str(home)), capture_output=True, text=True)
    return wire.versions(out.stdout)["resident"]


def test_a_resident_refuses_a_job_of_another_session_code_or_environment(monkeypatch, tmp_path):
    """A job runs in the resident's environment: one that needs other values (what JAX read at the
    start, a launch's variable or secret) needs a fresh process; only the proposed run id is the job's own."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XLA_FLAGS", "--a")
    monkeypatch.setenv("WANDB_API_KEY", "one")
    monkeypatch.setenv("PODRUNNER_RUN_ID", "first")
    here = resident.Resident("k1", "w0", 60.0)
    launched = resident.job_environment(dict(os.environ, PODRUNNER_RUN_ID="second", SSH_CONNECTION="another session"),
                                        ["PODRUNNER_RUN_ID", "WANDB_API_KEY"])
    assert "SSH_CONNECTION" not in launched and launched["PODRUNNER_RUN_ID"] == "second"
    job = {"session": "k1", "cwd": str(tmp_path), "env": launched}
    assert here.verdict(job) == "go"  # run ids change from job to job
    assert "session k1, not k2" in here.verdict(dict(job, session="k2"))
    assert "other code" in here.verdict(dict(job, cwd="/elsewhere"))
    assert "(XLA_FLAGS)" in here.verdict(dict(job, env=dict(launched, XLA_FLAGS="--b")))
    assert "(JAX_PLATFORMS)" in here.verdict(dict(job, env=dict(launched, JAX_PLATFORMS="tpu")))
    assert "(WANDB_API_KEY)" in here.verdict(dict(job, env=dict(launched, WANDB_API_KEY="two")))
    assert "(PODRUNNER_DATA)" in here.verdict(dict(job, env=dict(launched, PODRUNNER_DATA="gs://b")))


def test_the_supervisor_launches_warm_only_when_every_worker_has_a_resident_of_one_session():
    row = lambda session: {"host": "h", "ok": True, "resident": session and {"session": session, "pid": 1}}  # noqa: E731
    assert pod.resident_mode([row("k1"), row("k1")], 2).arg() == "warm:k1"
    assert pod.resident_mode([row("k1"), row(None)], 2).arg() == "cold"
    assert pod.resident_mode([row("k1"), row("k2")], 2).arg() == "cold"
    assert pod.resident_mode([row("k1")], 2).arg() == "cold"  # a worker that did not answer
    # the resident's pid is no version: workers with residents still agree
    assert pod.versions_agree([row("k1") | {"commit": "c"}, {**row("k1"), "resident": {"session": "k1", "pid": 2},
                                                             "commit": "c"}], 2)
    command = pod.pod_command("~/repo", "r", ["train.steps=1"], {}, key="k2", resident=wire.ResidentLaunch.parse("warm:k1"))
    assert "--resident warm:k1 -- python pretrain_jax.py" in command
    # the variant handed over next, for the residents to compile ahead: one quoted JSON word
    following = ["+experiment=exp01/a", "run.checkpoint.dir=gs://b/${hydra:runtime.choices.experiment}"]
    command = pod.pod_command("~/repo", "r", ["train.steps=1"], {}, key="k2", resident=wire.ResidentLaunch.parse("cold"),
                              next_overrides=following)
    words = shlex.split(command.split("; ")[-1])
    assert json.loads(words[words.index("--next") + 1]) == following


def test_a_guard_without_a_resident_mode_ends_the_workers_resident_first(tmp_path, monkeypatch):
    """A plain launch (launch.py pod) on a worker a programme left a resident on: the resident holds
    the TPU, so the guard ends it before it starts its own trainer."""
    home = tmp_path / "home"
    (home / ".podrunner-resident").mkdir(parents=True)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", resident.MODULE])
    try:
        (home / ".podrunner-resident" / "state.json").write_text(json.dumps({"session": "k1", "pid": sleeper.pid}))
        out = subprocess.run([sys.executable, "-m", "experiments.launcher.worker.once", "--key", "k", "--host", "w0",
                              "--log", str(tmp_path / "w.log"), "--start", "x", "--", sys.executable, "-c", "print(1)"],
                             cwd=REPO, env=dict(os.environ, HOME=str(home)), capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        assert sleeper.wait(timeout=60) == -signal.SIGKILL
        assert not (home / ".podrunner-resident" / "state.json").exists()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_code_from_before_resident_trainers_runs_its_trainer_in_a_process_of_its_own(tmp_path):
    """A programme's cold launch of a tree that has no resident.py (shipped from an older commit):
    the guard says so and starts the trainer itself, rather than a module that is not there."""
    tree = tmp_path / "old-tree"
    tree.mkdir()
    out = subprocess.run([sys.executable, "-m", "experiments.launcher.worker.once", "--key", "k1", "--host", "w0",
                          "--log", str(tmp_path / "w.log"), "--start", "x", "--resident", "cold", "--",
                          sys.executable, "-c", "print('the old trainer ran')"], cwd=tree,
                         env=dict(os.environ, HOME=str(tmp_path), PYTHONPATH=str(REPO)), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "has no resident trainer" in out.stdout and "the old trainer ran" in out.stdout
    assert state_of(tmp_path) is None


def test_a_resident_that_dies_under_a_job_is_a_crash_not_an_exit_zero(tmp_path):
    """The guard of a warm launch cannot wait for a process it did not start: when the resident's
    connection closes without an exit code, the launch failed (EXIT_FAILURE), said in one line."""
    home = tmp_path / "home"
    state = home / ".podrunner-resident"
    state.mkdir(parents=True)
    server = subprocess.Popen([sys.executable, "-c", DIES_UNDER_A_JOB, resident.MODULE], env=dict(os.environ, HOME=str(home)),
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "listening"
        out = subprocess.run([sys.executable, "-m", "experiments.launcher.worker.once", "--key", "k2", "--host", "w0",
                              "--log", str(tmp_path / "w.log"), "--start", "x", "--resident", "warm:k1", "--",
                              sys.executable, "pretrain_jax.py"], cwd=REPO, env=dict(os.environ, HOME=str(home)),
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == EXIT_FAILURE, out.stdout + out.stderr
        assert "ended during the job without an exit code" in out.stdout
    finally:
        server.kill()
        server.wait()


def test_run_job_runs_a_job_in_a_process_that_outlives_it(sudoku_dir, tmp_path):
    """runtime/job.py `run_job`, the API a resident runs each job through: the job's own environment
    (its proposed run id, not the process's), the first-step hook, and an exit code for a job that
    fails, the process going on."""
    runs = tmp_path / "runs"
    script = RUNS_JOBS.format(good=base_overrides(sudoku_dir, runs, steps=2, name="a"),
                              bad=base_overrides(sudoku_dir, runs, steps=2, name="b") + ["train.steps=-5"])
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PODRUNNER_RUN_ID="the-process-s"))
    assert out.stdout.splitlines()[-1] == f"codes 0 {EXIT_USER_ERROR} hooked 1", out.stdout[-2000:] + out.stderr[-2000:]
    assert json.loads((runs / "test" / "a" / "run_manifest.json").read_text())["run_id"] == "the-job-s"
    assert "error: train.steps=-5 is out of range" in out.stderr


RUNS_JOBS = """
from runtime.hydra_compose import composed
from runtime.job import run_job
hooked = []
good = run_job(lambda: composed({good!r}), environ={{"PODRUNNER_RUN_ID": "the-job-s"}},
               on_first_step=lambda: hooked.append(1))
bad = run_job(lambda: composed({bad!r}))
print("codes", good, bad, "hooked", len(hooked), flush=True)
"""


# A stand-in resident: listens where a resident does, takes one job and dies without answering.
DIES_UNDER_A_JOB = """
import os, sys
from experiments.launcher.worker import resident
r = resident.Resident("k1", "w0", 60.0)
server = r.listen()
print("listening", flush=True)
conn, _ = server.accept()
resident.read_request(conn)
os._exit(9)
"""
