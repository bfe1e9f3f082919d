"""`launch.py pod / setup / stop / status` against a fake gcloud (tests/fake_gcloud/gcloud).

The fake runs the --command of `gcloud compute tpus tpu-vm ssh --worker=all` with bash on this
machine once per simulated worker, each with its own HOME under tmp_path, so every `~` path of
the remote command lands in that worker's directory. The "repo" on each worker is a stand-in:
a `.venv/bin/activate` stub and a `pretrain_jax.py` that dumps its argv and environment.
Processes are scoped by HOME, so nothing outside tmp_path is ever touched.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.pod import PodError, remote_path, resolve_run_id

REPO_ROOT = Path(__file__).resolve().parent.parent
LAUNCH = REPO_ROOT / "experiments" / "launch.py"
FAKE_GCLOUD_DIR = Path(__file__).resolve().parent / "fake_gcloud"
SECRET = "wandb-secret-7f3a9c"
WORKERS = 2
TRICKY = ['run.name="a b \'c\'"', "data.path=/x y/$HOME/`id`", "train.steps=5"]

STUB = """\
import json, os, sys, time
keys = ("WANDB_API_KEY", "PODRUNNER_RUN_ID", "TPU_WORKER_ID", "STUB_VENV", "PYTHONUNBUFFERED", "EXTRA")
info = {"argv": sys.argv[1:], "pid": os.getpid(), "cwd": os.getcwd(), "env": {k: os.environ.get(k) for k in keys}}
with open(os.path.join(os.environ["HOME"], "stub_run.json"), "w") as f:
    json.dump(info, f)
worker = os.environ["TPU_WORKER_ID"]
print(f"stub worker {worker} argv={json.dumps(sys.argv[1:])}", flush=True)
for step in (1, 2, 3):
    print(f"step {step}", flush=True)
time.sleep(float(os.environ.get("STUB_SLEEP", "0")))
sys.exit(3 if os.environ.get("STUB_FAIL_WORKER") == worker else 0)
"""


@pytest.fixture
def pod(tmp_path: Path):
    """Fake workers with a stand-in repo at ~/repo, and the environment to launch with."""
    root = tmp_path / "workers"
    homes = [root / f"worker-{i}" for i in range(WORKERS)]
    for home in homes:
        venv_bin = home / "repo" / ".venv" / "bin"
        venv_bin.mkdir(parents=True)
        # Like a real activate: our python first on PATH.
        (venv_bin / "activate").write_text(f"export STUB_VENV=1 PATH={Path(sys.executable).parent}:$PATH\n")
        (venv_bin / "python").symlink_to(sys.executable)
        (home / "repo" / "pretrain_jax.py").write_text(STUB)
        (home / "repo" / "setup_tpu.sh").write_text("echo setup_tpu.sh: ok on $(hostname)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "PODRUNNER_", "FAKE_GCLOUD_"))}
    env.update(PATH=f"{FAKE_GCLOUD_DIR}{os.pathsep}{env.get('PATH', '')}", FAKE_GCLOUD_ROOT=str(root),
               FAKE_GCLOUD_LOG=str(tmp_path / "gcloud.jsonl"), FAKE_GCLOUD_WORKERS=str(WORKERS),
               WANDB_API_KEY=SECRET, PYTHONUNBUFFERED="1",
               PODRUNNER_LIBTPU_LOCKFILE="~/libtpu_lockfile", PODRUNNER_TPU_DEVICES="~/fake-accel*")
    started: list[subprocess.Popen] = []

    class Pod:
        def __init__(self) -> None:
            self.root, self.homes, self.env, self.tmp = root, homes, env, tmp_path

        def launch(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, str(LAUNCH), *args], cwd=tmp_path, env=env,
                                  capture_output=True, text=True, timeout=timeout)

        def gcloud_calls(self) -> list[list[str]]:
            log = tmp_path / "gcloud.jsonl"
            return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

        def spawn(self, home: Path, script: str) -> subprocess.Popen:
            """A process "on" a worker: HOME is that worker's (that is how stop/status scope it)."""
            proc = subprocess.Popen(["bash", "-c", script], cwd=home, env=dict(env, HOME=str(home)),
                                    start_new_session=True)
            started.append(proc)
            return proc

    yield Pod()
    for proc in started:  # whatever a failing test left behind
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def target(*extra: str) -> list[str]:
    return ["--tpu", "my-tpu", "--zone", "us-central2-b", *extra]


def running(proc: subprocess.Popen, wait: float = 5.0) -> bool:
    """Whether `proc` is still running after up to `wait` seconds for it to die."""
    try:
        proc.wait(wait)
        return False
    except subprocess.TimeoutExpired:
        return True


def pid_alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except (FileNotFoundError, IndexError):
        return False


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# --- pod --------------------------------------------------------------------------------------

def test_dry_run_prints_the_exact_command_and_runs_nothing(pod):
    r = pod.launch("pod", *target("--project", "proj", "--run-id", "r1", "--dry-run", "--", *TRICKY))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 1
    argv = shlex.split(lines[0])
    assert argv[:11] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-tpu", "--zone", "us-central2-b",
                         "--project", "proj", "--worker=all"]
    assert argv[11] == "--command" and len(argv) == 13
    command = argv[12]
    assert "cd \"$HOME\"/podrunner || " in command  # the default repo dir, ~ still expanding remotely
    assert "export PYTHONUNBUFFERED=1 PODRUNNER_RUN_ID=r1 WANDB_API_KEY=***;" in command
    assert ("python pretrain_jax.py 'run.name=\"a b '\"'\"'c'\"'\"'\"' 'data.path=/x y/$HOME/`id`' "
            "train.steps=5 run.id=r1; } 2>&1 | tee -a \"$LOG\"") in command
    assert 'LOG="$HOME"/podrunner-logs/r1/worker-"$(hostname)".log' in command
    assert SECRET not in r.stdout + r.stderr
    assert pod.gcloud_calls() == []  # nothing ran


def test_pod_runs_every_worker_with_one_run_id_and_intact_overrides(pod):
    r = pod.launch("pod", *target("--repo-dir", "~/repo", "--log-dir", "logs", "--env", "EXTRA=x y",
                                  "--", *TRICKY))
    assert r.returncode == 0, r.stdout + r.stderr
    calls = pod.gcloud_calls()
    assert len(calls) == 1 and calls[0].count("--worker=all") == 1  # ONE ssh for all workers
    assert f"WANDB_API_KEY={SECRET}" in calls[0][-1]  # sent, only in gcloud's argv

    runs = [json.loads((home / "stub_run.json").read_text()) for home in pod.homes]
    run_id = runs[0]["env"]["PODRUNNER_RUN_ID"]
    assert re.fullmatch(r"\d{8}-\d{6}-[a-z0-9]{4}", run_id)
    for i, (home, run) in enumerate(zip(pod.homes, runs)):
        assert run["argv"] == [*TRICKY, f"run.id={run_id}"]  # intact, same id everywhere
        assert run["env"] == {"WANDB_API_KEY": SECRET, "PODRUNNER_RUN_ID": run_id, "TPU_WORKER_ID": str(i),
                              "STUB_VENV": "1", "PYTHONUNBUFFERED": "1", "EXTRA": "x y"}
        assert run["cwd"] == str(home / "repo")
        log = home / "podrunner-logs" / run_id / f"worker-t1v-n-my-tpu-w-{i}.log"
        text = log.read_text()
        assert f"stub worker {i} argv=" in text and "step 3" in text
        assert f"podrunner-start host=t1v-n-my-tpu-w-{i} commit=unknown run_id={run_id}" in text
        assert SECRET not in text

    launch_log = (pod.tmp / "logs" / run_id / "launch.log").read_text()
    for i in range(WORKERS):
        assert f"stub worker {i} argv=" in launch_log and f"stub worker {i} argv=" in r.stdout
    command_txt = (pod.tmp / "logs" / run_id / "command.txt").read_text()
    assert "WANDB_API_KEY=***" in command_txt
    for text in (r.stdout, r.stderr, launch_log, command_txt):
        assert SECRET not in text


def test_pod_exit_code_is_gclouds(pod):
    pod.env["STUB_FAIL_WORKER"] = "1"
    r = pod.launch("pod", *target("--repo-dir", "~/repo", "--run-id", "fail1", "--log-dir", "logs",
                                  "--", "train.steps=1"))
    assert r.returncode == 3, r.stdout + r.stderr
    assert "gcloud exited with code 3" in r.stdout


def test_ctrl_c_stops_the_run_on_every_worker(pod):
    pod.env["STUB_SLEEP"] = "60"
    launcher = subprocess.Popen([sys.executable, str(LAUNCH), "pod", *target(
        "--repo-dir", "~/repo", "--run-id", "int1", "--log-dir", "logs", "--interrupt-grace", "5")],
        cwd=pod.tmp, env=pod.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        dumps = [home / "stub_run.json" for home in pod.homes]
        wait_for(lambda: all(d.exists() for d in dumps))
        pids = [json.loads(d.read_text())["pid"] for d in dumps]
        os.killpg(launcher.pid, signal.SIGINT)  # like Ctrl-C in a terminal: launcher and gcloud
        out, _ = launcher.communicate(timeout=30)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 130, out
    assert "stopping the run on all workers" in out
    for pid in pids:
        assert f"killed pid {pid}" in out
        wait_for(lambda: not pid_alive(pid), 5)


# --- stop -------------------------------------------------------------------------------------

def test_stop_kills_stale_processes_and_removes_the_lockfile(pod):
    stale, holders = [], []
    for home in pod.homes:
        stale.append(pod.spawn(home, 'exec -a "python pretrain_jax.py" sleep 300'))
        (home / "fake-accel0").touch()
        holders.append(pod.spawn(home, "exec sleep 301 < ~/fake-accel0"))  # holds the "TPU"
        (home / "libtpu_lockfile").touch()
    innocent = pod.spawn(pod.homes[0], "exec sleep 302")
    elsewhere = pod.tmp / "someone-else"
    elsewhere.mkdir()
    foreign = pod.spawn(elsewhere, 'exec -a "python pretrain_jax.py" sleep 303')  # another login
    wait_for(lambda: all(Path(f"/proc/{p.pid}/cmdline").read_bytes().startswith((b"python", b"sleep"))
                         for p in [*stale, *holders, foreign]))

    r = pod.launch("stop", *target())
    assert r.returncode == 0, r.stdout + r.stderr
    for proc in [*stale, *holders]:
        assert not running(proc), r.stdout
        assert f"killed pid {proc.pid}" in r.stdout
    for i, holder in enumerate(holders):
        assert f"[t1v-n-my-tpu-w-{i}] killed pid {holder.pid} (held the TPU)" in r.stdout
    assert running(innocent, 0.2) and running(foreign, 0.2)
    assert f"killed pid {foreign.pid}" not in r.stdout
    for i, home in enumerate(pod.homes):
        assert not (home / "libtpu_lockfile").exists()
        assert f"[t1v-n-my-tpu-w-{i}] killed 2 process(es); removed {home / 'libtpu_lockfile'}" in r.stdout


def test_stop_keeps_a_lockfile_another_login_still_holds(pod):
    w0, w1 = pod.homes
    for home in pod.homes:
        (home / "libtpu_lockfile").touch()
    elsewhere = pod.tmp / "someone-else"
    elsewhere.mkdir()
    holder = pod.spawn(elsewhere, f"exec sleep 304 < {shlex.quote(str(w0 / 'libtpu_lockfile'))}")
    wait_for(lambda: Path(f"/proc/{holder.pid}/cmdline").read_bytes().startswith(b"sleep"))
    r = pod.launch("stop", *target())
    assert r.returncode == 1, r.stdout + r.stderr  # the TPU of worker 0 is not free
    assert f"kept {w0 / 'libtpu_lockfile'}: still open by pid [{holder.pid}]" in r.stdout
    assert (w0 / "libtpu_lockfile").exists() and not (w1 / "libtpu_lockfile").exists()
    assert running(holder, 0.1)


def test_stop_with_nothing_running_exits_0(pod):
    r = pod.launch("stop", *target())
    assert r.returncode == 0, r.stdout + r.stderr
    for i, home in enumerate(pod.homes):
        assert f"[t1v-n-my-tpu-w-{i}] nothing running; no {home / 'libtpu_lockfile'}" in r.stdout


# --- status -----------------------------------------------------------------------------------

def test_status_reports_alive_and_last_step(pod):
    w0, w1 = pod.homes
    stale = pod.spawn(w0, 'exec -a "python pretrain_jax.py" sleep 300')
    metrics = w0 / "repo" / "outputs" / "exp01" / "hidden256" / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    metrics.write_text("".join(json.dumps({"step": s, "time": 0.0, "train/loss": 1.0}) + "\n" for s in (10, 20)))
    log = w1 / "podrunner-logs" / "r7" / "worker-t1v-n-my-tpu-w-1.log"
    log.parent.mkdir(parents=True)
    log.write_text("process 1/2, local devices 4\n  6%|#  | 6/100 [00:01<00:10]\r  7%|#  | 7/100 [00:02<00:10]\r")
    wait_for(lambda: Path(f"/proc/{stale.pid}/cmdline").read_bytes().startswith(b"python"))

    r = pod.launch("status", *target("--repo-dir", "~/repo"))
    assert r.returncode == 0, r.stdout + r.stderr
    header, row0, row1 = r.stdout.splitlines()
    assert header.split() == ["worker", "host", "alive", "pid", "elapsed", "last", "step", "log", "file"]
    assert row0.split()[:7] == ["0", "t1v-n-my-tpu-w-0", "yes", str(stale.pid), row0.split()[4], "20", "(metrics)"]
    assert re.fullmatch(r"\d+:\d\d:\d\d", row0.split()[4])
    assert row1.split() == ["1", "t1v-n-my-tpu-w-1", "no", "-", "-", "7", "(log)", str(log)]


# --- setup ------------------------------------------------------------------------------------

def test_setup_runs_setup_tpu_and_checks_versions_match(pod):
    r = pod.launch("setup", *target("--repo-dir", "~/repo"))
    assert r.returncode == 0, r.stdout + r.stderr
    for i in range(WORKERS):
        assert f"setup_tpu.sh: ok on t1v-n-my-tpu-w-{i}" in r.stdout
    assert "2 workers set up, all identical: commit=None" in r.stdout


def test_setup_fails_when_workers_run_different_commits(pod):
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    repo0 = pod.homes[0] / "repo"
    subprocess.run([*git, "init", "-q", str(repo0)], check=True)
    subprocess.run([*git, "-C", str(repo0), "commit", "-q", "--allow-empty", "-m", "x"], check=True)
    r = pod.launch("setup", *target("--repo-dir", "~/repo"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "MISMATCH across workers in commit" in r.stdout


def test_setup_git_ref_dry_run(pod):
    r = pod.launch("setup", *target("--git-ref", "my branch", "--dry-run"))
    command = shlex.split(r.stdout)[-1]
    assert "git checkout --quiet --detach 'origin/my branch' 2>/dev/null || " \
           "git checkout --quiet --detach 'my branch'" in command
    assert command.index("git fetch") < command.index("bash setup_tpu.sh")


# --- pieces -----------------------------------------------------------------------------------

def test_run_id_resolution():
    assert resolve_run_id("a1", ["x=1"]) == ("a1", ["x=1", "run.id=a1"])
    assert resolve_run_id(None, ["run.id=b2"]) == ("b2", ["run.id=b2"])  # given as an override
    assert resolve_run_id("b2", ["+run.id=b2"]) == ("b2", ["+run.id=b2"])
    with pytest.raises(PodError, match="conflicts"):
        resolve_run_id("a1", ["run.id=b2"])
    with pytest.raises(PodError, match="run id"):
        resolve_run_id("../x", [])


def test_remote_path_keeps_home_expanding_and_quotes_the_rest():
    assert remote_path("~/podrunner") == '"$HOME"/podrunner'
    assert remote_path("~/my repo") == "\"$HOME\"/'my repo'"
    assert remote_path("/opt/x;rm") == "'/opt/x;rm'"


def test_fake_gcloud_rejects_other_commands(pod):
    r = subprocess.run(["gcloud", "compute", "instances", "list"], env=pod.env, capture_output=True, text=True)
    assert r.returncode == 2 and "unsupported command" in r.stderr
    r = subprocess.run(["gcloud", "compute", "tpus", "tpu-vm", "ssh", "x", "--zone", "z", "--worker=0",
                        "--command", "true"], env=pod.env, capture_output=True, text=True)
    assert r.returncode == 2 and "--worker=all" in r.stderr
