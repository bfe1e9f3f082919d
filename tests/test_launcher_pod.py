"""`launch.py pod / setup / stop / status` against a fake gcloud (tests/fake_gcloud/gcloud).

The fake runs the --command of `gcloud compute tpus tpu-vm ssh --worker=all` with bash on this
machine once per simulated worker, each with its own HOME under tmp_path, so every `~` path of
the remote command lands in that worker's directory. The "repo" on each worker is a stand-in:
a `.venv/bin/activate` stub and a `pretrain_jax.py` that dumps its argv and environment (the
secrets as hashes, so that no file holds their values). The secrets are set only on "this
machine" (FAKE_GCLOUD_LOCAL_ONLY): a worker has them only if the launcher sent them.
Processes are scoped by HOME, so nothing outside tmp_path is ever touched.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import pytest

from experiments.launcher.pod import PodError, Target, remote_path, resolve_run_id, send_secrets
from runtime import wire
from helpers import LAUNCH, POD_SECRET as SECRET, REPO, POD_WORKERS as WORKERS, pid_alive, target, wait_for

HF_SECRET = "hf-secret-2b8d $(touch pwned) `touch pwned2` 'q' \"d\" $HOME"  # also a quoting test
TRICKY = ['run.name="a b \'c\'"', "data.path=/x y/$HOME/`id`", "train.steps=5"]


def hashed(value: str) -> str:
    return "sha256:" + hashlib.sha256(value.encode()).hexdigest()


def running(proc: subprocess.Popen, wait: float = 5.0) -> bool:
    """Whether `proc` is still running after up to `wait` seconds for it to die."""
    try:
        proc.wait(wait)
        return False
    except subprocess.TimeoutExpired:
        return True


# --- pod --------------------------------------------------------------------------------------

def test_dry_run_prints_the_exact_commands_and_runs_nothing(pod):
    pod.env["HF_TOKEN"] = HF_SECRET
    r = pod.launch("pod", *target("--project", "proj", "--run-id", "r1", "--forward-env", "HF_TOKEN", "--dry-run",
                                  "--", *TRICKY))
    assert r.returncode == 0, r.stderr
    note, scp, ssh = r.stdout.splitlines()
    assert note.startswith("# secrets WANDB_API_KEY, HF_TOKEN: ")
    secrets_file = shlex.split(scp)[6].split(":", 1)[1]
    assert re.fullmatch(r"\.podrunner-secrets-[0-9a-f]{16}", secrets_file)
    assert shlex.split(scp) == ["gcloud", "compute", "tpus", "tpu-vm", "scp", "SECRETS-FILE", f"my-tpu:{secrets_file}",
                                "--zone", "us-central2-b", "--project", "proj", "--worker=all"]
    argv = shlex.split(ssh)
    assert argv[:11] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-tpu", "--zone", "us-central2-b",
                         "--project", "proj", "--worker=all"]
    assert argv[11] == "--command" and len(argv) == 13
    command = argv[12]
    assert command.startswith(f"trap 'rm -f \"$HOME\"/{secrets_file}' EXIT; ")  # should it end before the guard
    assert "cd \"$HOME\"/podrunner || " in command  # the default repo dir, ~ still expanding remotely
    assert " --env PODRUNNER_RUN_ID=r1 " in command
    guard = shlex.split(command.rsplit("; ", 1)[1])  # the launch guard reads the secrets, starts the trainer once
    assert guard[:4] == ["exec", "python", "-m", "experiments.launcher.worker.once"] and "--secrets" in guard
    assert guard[guard.index("--") + 1:] == ["python", "pretrain_jax.py", 'run.name="a b \'c\'"',
                                             "data.path=/x y/$HOME/`id`", "train.steps=5", "run.id=r1"]
    assert ' --log "$HOME"/podrunner-logs/r1/worker-"$(hostname)".log ' in command
    for secret in (SECRET, HF_SECRET):
        assert secret not in r.stdout + r.stderr
    assert pod.gcloud_calls() == []  # nothing ran

    del pod.env["WANDB_API_KEY"], pod.env["HF_TOKEN"]  # no secrets: no copy, nothing read on the workers
    r = pod.launch("pod", *target("--run-id", "r1", "--dry-run"))
    assert len(r.stdout.splitlines()) == 1 and "SECRETS" not in r.stdout
    assert r.stdout.rstrip().endswith("-- python pretrain_jax.py run.id=r1'")


def test_pod_runs_every_worker_with_one_run_id_and_intact_overrides(pod):
    r = pod.launch("pod", *target("--repo-dir", "~/repo", "--log-dir", "logs", "--env", "EXTRA=x y",
                                  "--", *TRICKY))
    assert r.returncode == 0, r.stdout + r.stderr
    calls = pod.gcloud_calls()
    assert [c[4] for c in calls] == ["scp", "ssh"]  # the secrets first, then ONE ssh for all workers
    assert calls[1].count("--worker=all") == 1

    runs = [json.loads((home / "stub_run.json").read_text()) for home in pod.homes]
    run_id = runs[0]["env"]["PODRUNNER_RUN_ID"]
    assert re.fullmatch(r"\d{8}-\d{6}-[a-z0-9]{4}", run_id)
    assert f"[launch] run id {run_id} (proposed: a fresh run takes it" in r.stdout
    for i, (home, run) in enumerate(zip(pod.homes, runs)):
        assert run["argv"] == TRICKY  # intact; a generated id is only proposed, never run.id=
        assert run["env"] == {"WANDB_API_KEY": hashed(SECRET), "HF_TOKEN": None, "PODRUNNER_RUN_ID": run_id,
                              "TPU_WORKER_ID": str(i), "STUB_VENV": "1", "PYTHONUNBUFFERED": "1", "EXTRA": "x y"}
        assert run["cwd"] == str(home / "repo")
        log = home / "podrunner-logs" / run_id / f"worker-t1v-n-my-tpu-w-{i}.log"
        text = log.read_text()
        assert f"stub worker {i} argv=" in text and "step 3" in text
        assert f"podrunner-start host=t1v-n-my-tpu-w-{i} commit=unknown launch_id={run_id}" in text
        assert not list(home.glob(".podrunner-secrets-*"))

    launch_log = (pod.tmp / "logs" / run_id / "launch.log").read_text()
    for i in range(WORKERS):
        assert f"stub worker {i} argv=" in launch_log and f"stub worker {i} argv=" in r.stdout
    command_txt = (pod.tmp / "logs" / run_id / "command.txt").read_text()
    assert command_txt.startswith("# secrets WANDB_API_KEY: ") and "tpu-vm scp SECRETS-FILE" in command_txt
    assert "[launch] secrets WANDB_API_KEY: sent as a 0600 file" in r.stdout
    for text in (r.stdout, r.stderr, launch_log, command_txt):
        assert SECRET not in text


def test_pod_exit_code_is_gclouds(pod):
    pod.env["STUB_FAIL_WORKER"] = "1"
    r = pod.launch("pod", *target("--repo-dir", "~/repo", "--run-id", "fail1", "--log-dir", "logs",
                                  "--", "train.steps=1"))
    assert r.returncode == 3, r.stdout + r.stderr
    assert "gcloud exited with code 3" in r.stdout
    assert json.loads((pod.homes[0] / "stub_run.json").read_text())["argv"] == ["train.steps=1", "run.id=fail1"]
    secrets_file = pod.gcloud_calls()[0][6].split(":", 1)[1]
    assert pod.gcloud_calls()[-1][-1] == f'rm -f "$HOME"/{secrets_file}'  # for a worker that never started


def start_pod_launch(pod, *args: str) -> subprocess.Popen:
    """`launch.py pod` in the background, in its own session (the test signals its group)."""
    return subprocess.Popen([sys.executable, str(LAUNCH), "pod", *target("--repo-dir", "~/repo", "--log-dir", "logs", *args)],
                            cwd=pod.tmp, env=pod.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def test_secrets_never_on_a_command_line_nor_in_a_file(pod):
    """The values reach python's environment on every worker and nothing else: no argv (gcloud's,
    the workers' shells', python's), no file (logs, gcloud's state, the workers' homes, the
    temporary directory), no environment on a worker but python's."""
    pod.env.update(HF_TOKEN=HF_SECRET, STUB_WAIT="1")
    launcher = start_pod_launch(pod, "--run-id", "s1", "--forward-env", "HF_TOKEN")
    try:
        dumps = [home / "stub_run.json" for home in pod.homes]
        wait_for(lambda: all(d.exists() for d in dumps), timeout=60, what="the stub trainers to start")
        stubs = {json.loads(d.read_text())["pid"] for d in dumps}
        for secret in (SECRET, HF_SECRET):  # while the pod runs
            assert command_lines_holding(secret.encode()) == []
            assert worker_environments_holding(secret.encode(), pod.homes) == stubs
        for home in pod.homes:
            assert not list(home.glob(".podrunner-secrets-*"))  # read and removed before python started
        assert not any((pod.tmp / "tmp").iterdir())  # the local copy too
        for home in pod.homes:
            (home / "go").touch()
        out, _ = launcher.communicate(timeout=60)
    finally:
        for home in pod.homes:  # the workers run in sessions of their own: let them end whatever happened
            (home / "go").touch()
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 0, out
    assert "[launch] secrets WANDB_API_KEY, HF_TOKEN: sent as a 0600 file" in out
    for home in pod.homes:
        env = json.loads((home / "stub_run.json").read_text())["env"]
        assert (env["WANDB_API_KEY"], env["HF_TOKEN"]) == (hashed(SECRET), hashed(HF_SECRET))  # intact
    calls = pod.gcloud_calls()
    assert [c[4] for c in calls] == ["scp", "ssh"]
    for secret in (SECRET, HF_SECRET):
        assert secret not in out and not any(secret in arg for call in calls for arg in call)
        assert files_holding(secret.encode(), pod.tmp) == []
    assert not list(pod.tmp.rglob("pwned*"))  # the value was never run as shell code


def test_secrets_copy_failure_starts_nothing(pod):
    pod.env["FAKE_GCLOUD_UNREACHABLE"] = "1"
    r = pod.launch("pod", *target("--repo-dir", "~/repo", "--log-dir", "logs", "--", "train.steps=1"))
    assert r.returncode == 255, r.stdout + r.stderr
    assert "copying the secrets to the workers failed (gcloud exit code 255); nothing was started" in r.stdout
    calls = pod.gcloud_calls()
    assert [c[4] for c in calls] == ["scp", "ssh"] and calls[1][-1].startswith("rm -f ")
    for home in pod.homes:
        assert not (home / "stub_run.json").exists()
        assert not list(home.glob(".podrunner-secrets-*"))  # worker 0 got it; the launcher removed it


def test_secrets_file_is_private_and_sourced_intact(pod, monkeypatch):
    for key, value in pod.env.items():  # the fake gcloud on PATH
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(tempfile, "tempdir", str(pod.tmp / "tmp"))
    values = {"WANDB_API_KEY": SECRET, "HF_TOKEN": HF_SECRET}
    assert send_secrets(Target("my-tpu", "z"), values, ".podrunner-secrets-t1", stream=io.StringIO()) == 0
    read = "import json, os; print(json.dumps([os.environ['WANDB_API_KEY'], os.environ['HF_TOKEN']]))"
    for home in pod.homes:
        path = home / ".podrunner-secrets-t1"
        assert path.stat().st_mode & 0o777 == 0o600
        out = subprocess.run(["bash", "-c", f'set -a; . "$1"; {shlex.quote(sys.executable)} -c "$2"', "-", path, read],
                             cwd=home, env={"PATH": os.environ["PATH"]}, capture_output=True, text=True, check=True)
        assert json.loads(out.stdout) == [SECRET, HF_SECRET]
    assert not any((pod.tmp / "tmp").iterdir())
    assert not list(pod.tmp.rglob("pwned*"))


def test_a_resumed_run_keeps_its_checkpoint_id_and_the_launcher_records_it(pod):
    del pod.env["WANDB_API_KEY"]  # and no secrets: no copy
    pod.env["STUB_RUN_ID"] = "t-0badc0de"
    r = pod.launch("pod", *target("--repo-dir", "~/repo", "--log-dir", "logs", "--", "train.steps=5"))
    assert r.returncode == 0, r.stdout + r.stderr
    calls = pod.gcloud_calls()
    assert [c[4] for c in calls] == ["ssh"] and "SECRETS" not in calls[0][-1]
    launch_id = json.loads((pod.homes[0] / "stub_run.json").read_text())["env"]["PODRUNNER_RUN_ID"]
    assert (f"[launch] the run's id is t-0badc0de (resumed from the checkpoint); this launch's logs stay under "
            f"{launch_id}") in r.stdout
    assert (pod.tmp / "logs" / launch_id / "run_id").read_text() == "t-0badc0de\n"


def command_lines_holding(secret: bytes) -> list[int]:
    return [pid for pid, cmdline, _ in proc_table() if secret in cmdline]


def worker_environments_holding(secret: bytes, homes: list[Path]) -> set[int]:
    """Pids of the processes "on a worker" (HOME is a worker's) whose environment holds `secret`."""
    homes_b = {b"HOME=" + str(h).encode() for h in homes}
    return {pid for pid, _, environ in proc_table() if secret in environ and homes_b & set(environ.split(b"\0"))}


def proc_table() -> list[tuple[int, bytes, bytes]]:
    rows = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                rows.append((int(entry.name), (entry / "cmdline").read_bytes(), (entry / "environ").read_bytes()))
            except OSError:  # gone, or not ours to read
                pass
    return rows


def files_holding(secret: bytes, root: Path) -> list[Path]:
    found = []
    for folder, _, names in os.walk(root):
        for name in names:
            path = Path(folder) / name
            if path.is_file() and not path.is_symlink() and secret in path.read_bytes():
                found.append(path)
    return found


def child_pids(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.mark.parametrize("who", ["terminal", "gcloud"])
def test_ctrl_c_stops_the_run_on_every_worker(pod, who):
    """Ctrl-C in a terminal (the launcher and gcloud get SIGINT), or SIGINT to gcloud alone
    (`kill -INT`, or a launcher started with SIGINT ignored): either way the workers are stopped."""
    pod.env["STUB_SLEEP"] = "60"
    launcher = start_pod_launch(pod, "--run-id", "int1", "--interrupt-grace", "5")
    try:
        dumps = [home / "stub_run.json" for home in pod.homes]
        wait_for(lambda: all(d.exists() for d in dumps), timeout=60, what="the stub trainers to start")
        pids = [json.loads(d.read_text())["pid"] for d in dumps]
        if who == "terminal":
            os.killpg(launcher.pid, signal.SIGINT)
        else:
            (gcloud,) = child_pids(launcher.pid)
            os.kill(gcloud, signal.SIGINT)
        out, _ = launcher.communicate(timeout=30)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 130, out
    assert "stopping the run on all workers" in out
    for pid in pids:
        assert f"killed pid {pid}" in out
        wait_for(lambda: not pid_alive(pid), timeout=30, what=f"pid {pid} to be gone")


# --- stop -------------------------------------------------------------------------------------

def test_stop_kills_stale_processes_and_removes_the_lockfile(pod):
    stale, holders = [], []
    for home in pod.homes:
        stale.append(pod.spawn(home, 'exec -a "python pretrain_jax.py" sleep 300'))
        (home / "fake-accel0").touch()
        holders.append(pod.spawn(home, "exec sleep 301 < ~/fake-accel0"))  # holds the "TPU"
        (home / "libtpu_lockfile").touch()
    for home in pod.homes:
        (home / ".podrunner-secrets-0123").write_text("WANDB_API_KEY=x\n")  # a launch that never started
    innocent = pod.spawn(pod.homes[0], "exec sleep 302")
    elsewhere = pod.tmp / "someone-else"
    elsewhere.mkdir()
    foreign = pod.spawn(elsewhere, 'exec -a "python pretrain_jax.py" sleep 303')  # another login
    wait_for(lambda: all(Path(f"/proc/{p.pid}/cmdline").read_bytes().startswith((b"python", b"sleep"))
                         for p in [*stale, *holders, foreign]), timeout=30, what="the stand-ins to exec")

    r = pod.launch("stop", *target("--repo-dir", "~/repo"))
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
        assert (f"[t1v-n-my-tpu-w-{i}] killed 2 process(es); removed {home / 'libtpu_lockfile'}; "
                "removed 1 leftover secrets file(s)") in r.stdout
        assert not (home / ".podrunner-secrets-0123").exists()


def test_stop_keeps_a_lockfile_another_login_still_holds(pod):
    w0, w1 = pod.homes
    for home in pod.homes:
        (home / "libtpu_lockfile").touch()
    elsewhere = pod.tmp / "someone-else"
    elsewhere.mkdir()
    holder = pod.spawn(elsewhere, f"exec sleep 304 < {shlex.quote(str(w0 / 'libtpu_lockfile'))}")
    wait_for(lambda: Path(f"/proc/{holder.pid}/cmdline").read_bytes().startswith(b"sleep"), timeout=30,
             what="the holder to exec")
    r = pod.launch("stop", *target("--repo-dir", "~/repo"))
    assert r.returncode == 1, r.stdout + r.stderr  # the TPU of worker 0 is not free
    assert f"kept {w0 / 'libtpu_lockfile'}: still open by pid [{holder.pid}]" in r.stdout
    assert (w0 / "libtpu_lockfile").exists() and not (w1 / "libtpu_lockfile").exists()
    assert running(holder, 0.1)


def test_stop_with_nothing_running_exits_0(pod):
    r = pod.launch("stop", *target("--repo-dir", "~/repo"))
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
    log.write_text("process 1/2, local devices 4\n" + "".join(  # the trainer's events (runtime/events.py), not its prose
        wire.event_line({"event": "checkpoint", "step": s}) + "\n" for s in (6, 7)) + "step 99 of some line\n")
    wait_for(lambda: Path(f"/proc/{stale.pid}/cmdline").read_bytes().startswith(b"python"), timeout=30,
             what="the stand-in to exec")

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


def test_setup_brings_a_python_that_fits_where_the_image_has_3_10(tmp_path):
    """setup_tpu.sh's interpreter (scripts/find_python.sh): the TPU image's python3 is 3.10, so uv's
    managed CPython 3.11 is installed and used; a python3.1x on PATH that fits is used as it is."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text("#!/bin/sh\ncase \"$*\" in *version_info*) exit 1;; esac\n")  # 3.10
    (bin_dir / "uv").write_text(f'#!/bin/sh\necho "uv $*" >> {log}\n'
                                f'[ "$1 $2" = "python find" ] && echo /opt/uv/cpython-3.11/bin/python3.11\nexit 0\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    find = f". {shlex.quote(str(REPO / 'scripts' / 'find_python.sh'))}; find_python"
    run = lambda: subprocess.run(["/bin/bash", "-c", find], env={"PATH": str(bin_dir), "HOME": str(tmp_path)},  # noqa: E731
                                 capture_output=True, text=True)
    r = run()
    assert r.returncode == 0 and r.stdout.strip() == "/opt/uv/cpython-3.11/bin/python3.11", r.stderr
    assert log.read_text().splitlines() == ["uv python install 3.11", "uv python find 3.11"]
    log.unlink()
    (bin_dir / "python3.12").symlink_to(sys.executable)  # one that fits
    r = run()
    assert r.stdout.strip() == str(bin_dir / "python3.12") and not log.exists(), r.stderr


def test_setup_verifies_imports_against_the_pins(tmp_path):
    """What setup_tpu.sh ends with: every pinned distribution at its pin and importable, else exit 1."""
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nrequires-python = ">=3.11"\ndependencies = ["tqdm==%s", "numpy==0.0.1", "no-such-dist==1.0"]\n'
        % metadata.version("tqdm"))
    r = subprocess.run([sys.executable, "-m", "experiments.launcher.worker.versions", "h1", "--imports"], cwd=tmp_path,
                       env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True)
    assert r.returncode == 1, r.stdout + r.stderr
    row = wire.versions(r.stdout)
    assert row["ok"] is False and "numpy" in row["problem"] and "no-such-dist not installed" in row["problem"]
    assert "tqdm" not in row["problem"]


def test_setup_git_ref_dry_run(pod):
    r = pod.launch("setup", *target("--git-ref", "my branch", "--dry-run"))
    command = shlex.split(r.stdout)[-1]
    assert ("python3 -m experiments.launcher.worker.checkout \"$(hostname)\" 'my branch' && bash setup_tpu.sh && "
            ".venv/bin/python -m experiments.launcher.worker.versions") in command


def test_setup_git_ref_checks_out_the_fetched_branch_or_a_tag(pod, tmp_path):
    """A branch name means origin's branch as just fetched, not the worker's stale local branch of
    that name; a tag is checked out as it is; a ref that is neither fails naming the worker."""
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "advice.detachedHead=false"]
    run = lambda repo, *args: subprocess.run([*git, "-C", str(repo), *args], check=True, capture_output=True,  # noqa: E731
                                             text=True).stdout.strip()
    origin = tmp_path / "origin"
    origin.mkdir()
    run(origin, "init", "-q", "-b", "main")
    (origin / "notes.txt").write_text("one\n")
    run(origin, "add", "notes.txt")
    run(origin, "commit", "-q", "-m", "one")
    run(origin, "tag", "v1")
    run(origin, "branch", "feature")
    for home in pod.homes:  # each worker's repo: a clone whose local `feature` is about to be stale
        repo = home / "repo"
        run(repo, "init", "-q", "-b", "main")
        run(repo, "remote", "add", "origin", str(origin))
        run(repo, "fetch", "-q", "origin")
        run(repo, "checkout", "-q", "-b", "feature", "origin/feature")
    run(origin, "checkout", "-q", "feature")
    (origin / "notes.txt").write_text("two\n")
    run(origin, "commit", "-q", "-am", "two")
    fresh, tagged = run(origin, "rev-parse", "feature"), run(origin, "rev-parse", "v1")

    r = pod.launch("setup", *target("--repo-dir", "~/repo", "--git-ref", "feature"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"2 workers set up, all identical: commit={fresh}" in r.stdout
    r = pod.launch("setup", *target("--repo-dir", "~/repo", "--git-ref", "v1"))
    assert r.returncode == 0 and f"all identical: commit={tagged}" in r.stdout, r.stdout + r.stderr
    r = pod.launch("setup", *target("--repo-dir", "~/repo", "--git-ref", "no-such-ref"))
    assert r.returncode == 2, r.stdout + r.stderr
    for i in range(WORKERS):
        assert f"podrunner: t1v-n-my-tpu-w-{i}: cannot check out --git-ref" in r.stdout
    assert "setup_tpu.sh: ok" not in r.stdout  # nothing is set up on a checkout that failed


# --- pieces -----------------------------------------------------------------------------------

def test_run_id_resolution():
    assert resolve_run_id("a1", ["x=1"]) == ("a1", ["x=1", "run.id=a1"], True)  # fixed
    assert resolve_run_id(None, ["run.id=b2"]) == ("b2", ["run.id=b2"], True)  # given as an override
    assert resolve_run_id("b2", ["+run.id=b2"]) == ("b2", ["+run.id=b2"], True)
    proposed, overrides, fixed = resolve_run_id(None, ["x=1"])
    assert re.fullmatch(r"\d{8}-\d{6}-[a-z0-9]{4}", proposed) and overrides == ["x=1"] and not fixed
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


def test_fake_gcloud_starts_many_workers_at_once_without_text_file_busy(pod):
    """Each worker's `hostname` shim is written while other workers start: a fork that inherits a
    shim's write descriptor made it fail with "Text file busy" (seen in CI; 8 of 30 such ssh calls
    failed before the shims were written under the spawn lock)."""
    env = dict(pod.env, FAKE_GCLOUD_WORKERS="16")
    for _ in range(15):
        r = subprocess.run(["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-tpu", "--zone", "z", "--worker=all",
                            "--command", "hostname"], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        assert sorted(r.stdout.splitlines()) == sorted(f"[worker {i}] t1v-n-my-tpu-w-{i}" for i in range(16))
