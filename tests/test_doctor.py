"""`launch.py doctor` (experiments/doctor.py, experiments/launcher/worker/doctor_checks.py) on the fake
control plane (tests/fake_gcloud): CPU workers standing in for a slice, running the real worker checks
through the fake `gcloud ... ssh --worker=all`. One test per failure, each a one-line verdict naming
the worker and the fix, exit EXIT_CHECK_FAILED, and no process of the doctor left; a healthy slice's
run writes the file with every figure, which `plan --calibrate-from` then takes (and refuses, for a
TPU topology, when it came from CPU workers unless told)."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from experiments.launcher.worker import SECRETS_PREFIX
from experiments import doctor
from experiments.plan import bill, calibrate, planner
from helpers import (FAKE_GCLOUD_DIR, MetadataServer, child_env, fill, launch_in_process, make_fake_workers,
                     small_disk)
from runtime.compile_only import StepEstimate
from runtime.errors import EXIT_CHECK_FAILED, EXIT_USER_ERROR

sys.path.insert(0, str(FAKE_GCLOUD_DIR))
import fake_tpu  # noqa: E402

TPU = ["--tpu", "my-tpu", "--zone", "us-central2-b", "--repo-dir", "~/repo"]


class Slice:
    """Two fake workers of TPU my-tpu (READY) with the real repository, and the launcher's environment."""

    def __init__(self, tmp: Path, homes_first=None) -> None:
        self.root, self.tmp = tmp / "workers", tmp
        if homes_first:
            homes_first(self.root)
        self.homes = make_fake_workers(self.root, 2, None)
        fake_tpu.enable(self.root, {"my-tpu": {"state": "READY"}}, workers=2)
        self.env = {k: v for k, v in child_env(1).items() if not k.startswith(("PODRUNNER_", "FAKE_GCLOUD_", "WANDB_"))}
        self.env.update(PATH=f"{FAKE_GCLOUD_DIR}{os.pathsep}{self.env['PATH']}", FAKE_GCLOUD_ROOT=str(self.root),
                        FAKE_GCLOUD_WORKERS="2", FAKE_GCLOUD_LOCAL_ONLY="WANDB_API_KEY",
                        PODRUNNER_LIBTPU_LOCKFILE="~/libtpu_lockfile", PODRUNNER_TPU_DEVICES="~/fake-accel*")
        self.out = tmp / "doctor.json"

    def doctor(self, *args: str, **env: str) -> subprocess.CompletedProcess:
        return launch_in_process(["doctor", *TPU, "--out", str(self.out), "--port-wait", "3", *args],
                                 env={**self.env, **env}, cwd=self.tmp)

    def left_running(self) -> list[str]:
        """The doctor's processes still alive on the workers (none may be)."""
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                cwd = os.readlink(f"/proc/{pid}/cwd")
            except OSError:
                continue
            if cwd.startswith(str(self.root)) and ("doctor_checks" in cmd or "pretrain_jax" in cmd):
                found.append(f"{pid}: {cmd}")
        return found


@pytest.fixture
def fake_slice(tmp_path):
    return Slice(tmp_path)


def failed_once(result: subprocess.CompletedProcess, fake: Slice, worker: str, check: str, *needles: str) -> str:
    """The one FAIL line of `check` on `worker`, naming the fix; exit 10; nothing left running."""
    lines = [line for line in result.stdout.splitlines() if line.startswith(f"worker {worker}: FAIL {check}:")]
    assert result.returncode == EXIT_CHECK_FAILED, result.stdout + result.stderr
    assert len(lines) == 1 and "; fix: " in lines[0] and all(n in lines[0] for n in needles), result.stdout
    assert fake.left_running() == []
    saved = json.loads(fake.out.read_text())
    assert not saved["ok"] and any(c["status"] == "fail" and c["name"] == check for c in saved["checks"])
    return lines[0]


def test_a_worker_with_another_jax_version(fake_slice):
    dist = fake_slice.homes[1] / "repo" / "jax-0.0.1.dist-info"  # what importlib.metadata finds first there
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: jax\nVersion: 0.0.1\n")
    result = fake_slice.doctor("--only", "software")
    failed_once(result, fake_slice, "1", "same-versions", "jax 0.0.1", "launch.py setup")
    failed_once(result, fake_slice, "1", "software", "jax 0.0.1 instead of")
    assert "worker 0: FAIL" not in result.stdout


def test_a_process_holding_the_tpu(fake_slice):
    home = fake_slice.homes[1]
    holder = subprocess.Popen([sys.executable, "-c", "import os, sys; f = open(os.path.expanduser('~/fake-accel0'), "
                               "'w'); print('holding', flush=True); sys.stdin.read()"],
                              env=dict(fake_slice.env, HOME=str(home)), cwd=home, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        result = fake_slice.doctor("--only", "tpu")
        failed_once(result, fake_slice, "1", "tpu-free", f"pid {holder.pid} holds the TPU", "fake-accel0",
                    "launch.py stop")
        assert holder.poll() is None  # named, never touched
    finally:
        holder.stdin.close()
        holder.wait()


def test_a_stale_lockfile(fake_slice):
    (fake_slice.homes[0] / "libtpu_lockfile").write_text("")
    failed_once(fake_slice.doctor("--only", "tpu"), fake_slice, "0", "lockfile", "stale libtpu lockfile",
                "launch.py stop")


def test_a_closed_coordinator_port(fake_slice):
    """Worker 0's coordinator port held by another listener: worker 0 names it, worker 1 cannot reach it."""
    with socket.create_server(("", 0)) as other:
        port = other.getsockname()[1]
        with fake_tpu.control(fake_slice.root) as state:
            state["tpus"]["my-tpu"]["coordinator_port"] = port  # the port the fake slice's worker 0 coordinates on
        result = fake_slice.doctor("--only", "ports")
    failed_once(result, fake_slice, "0", "coordinator-port", f"port {port} on worker 0", f"held by pid {os.getpid()}")
    failed_once(result, fake_slice, "1", "coordinator-port", "cannot reach worker 0", f"open TCP {port}")
    assert "worker 1: ok liveness-port" in result.stdout


def test_a_bucket_that_refuses_writes(fake_slice, tmp_path):
    from gcs_emulator import start_gcs_emulator

    with start_gcs_emulator(tmp_path / "gcs") as emu:  # no bucket made: every write is refused
        result = fake_slice.doctor("--only", "storage", "--bucket", "gs://not-writable/doctor",
                                   **emu.child_env(fake_slice.env))
    for worker in "01":
        failed_once(result, fake_slice, worker, "bucket", "gs://not-writable/doctor", "roles/storage.objectAdmin")


class WandbStub:
    """A local stand-in for W&B's API: /graphql answers `viewer` for `good_key`, 401 for any other."""

    def __init__(self, good_key: str) -> None:
        import base64

        good = "Basic " + base64.b64encode(f"api:{good_key}".encode()).decode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                ok = self.headers.get("Authorization") == good
                self.send_response(200 if ok else 401)
                self.end_headers()
                self.wfile.write(json.dumps({"data": {"viewer": {"id": "u1", "entity": "me"}}}).encode() if ok else b"")

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def test_a_wandb_key_the_server_refuses(fake_slice):
    stub = WandbStub("the-good-key")
    try:
        result = fake_slice.doctor("--only", "wandb", WANDB_API_KEY="a-bad-key", WANDB_BASE_URL=stub.url)
    finally:
        stub.close()
    failed_once(result, fake_slice, "0", "wandb", "refused the key", "HTTP 401", "export WANDB_API_KEY")
    assert "worker 1: skip wandb: checked from worker 0" in result.stdout
    assert not [p for h in fake_slice.homes for p in h.glob(SECRETS_PREFIX + "*")]  # the key sent, read and removed


def test_a_full_disk(tmp_path):
    with contextlib.ExitStack() as stack:  # worker 1's home on a small disk of its own, filled
        fake = Slice(tmp_path, lambda root: stack.enter_context(small_disk(root / "worker-1", "16m")))
        fill(fake.root / "worker-1", leave=1 << 20)
        failed_once(fake.doctor("--only", "disk"), fake, "1", "disk", "GB free", "free space on")


def test_a_worker_that_never_answers(fake_slice):
    result = fake_slice.doctor("--only", "disk", FAKE_GCLOUD_UNREACHABLE="1")
    failed_once(result, fake_slice, "1", "answered", "worker 1 did not answer", "--worker=1")
    assert "worker 0: ok disk" in result.stdout


def test_a_worker_that_answers_then_hangs(fake_slice):
    """Worker 1's disk check hangs in a child that never ends (PODRUNNER_DOCTOR_HANG, with a budget of
    0.5 s): one OVERRUN line for it, the checks before it and worker 0's stand, and the child is gone."""
    result = fake_slice.doctor("--only", "tpu,disk", PODRUNNER_DOCTOR_HANG="1:disk:0.5")
    assert result.returncode == EXIT_CHECK_FAILED, result.stdout + result.stderr
    assert [line for line in result.stdout.splitlines() if line.startswith("worker 1: OVERRUN")] == [
        "worker 1: OVERRUN disk: did not finish within its budget of 0.5 s; fix: run `launch.py doctor --only disk` "
        "again; if it overruns again, that is the finding"], result.stdout
    assert "worker 1: ok tpu-free" in result.stdout and "worker 0: ok disk" in result.stdout
    assert "OVERRUN" not in result.stdout.replace("worker 1: OVERRUN disk", "")
    assert fake_slice.left_running() == []  # the hung child ended with its process group
    saved = json.loads(fake_slice.out.read_text())
    assert not saved["ok"] and [(c["worker"], c["name"]) for c in saved["checks"] if c["status"] == "overrun"] == [
        ("1", "disk")]


def test_bad_options_are_one_line(fake_slice):
    for args, needle in ((["--only", "tpu,nothing"], "--only nothing: not a check"),
                         (["--bucket", "/local"], "give a gs://BUCKET"), (["exp02a/L6"], "+experiment=GROUP/VARIANT"),
                         (["--allreduce-mb", "0"], "--allreduce-mb 0")):
        result = fake_slice.doctor(*args)
        assert result.returncode == EXIT_USER_ERROR and result.stderr.count("\n") == 1 and needle in result.stderr


@pytest.mark.slow
def test_a_healthy_slice_writes_every_figure_and_the_plan_takes_them(fake_slice, tmp_path, sudoku_dir):
    from gcs_emulator import start_gcs_emulator

    meta, stub = MetadataServer({"accelerator-type": "cpu-stand-in", "maintenance-event": "NONE",
                                 "preempted": "FALSE"}), WandbStub("the-good-key")
    try:
        with start_gcs_emulator(tmp_path / "gcs") as emu:
            emu.create_bucket("bkt")
            env = dict(emu.child_env(fake_slice.env), GCE_METADATA_IP=meta.address, WANDB_API_KEY="the-good-key",
                       WANDB_BASE_URL=stub.url)
            result = fake_slice.doctor(
                "+experiment=exp02a/L6", "--bucket", "gs://bkt/scratch", "--checkpoint-mb", "1", "--allreduce-mb",
                "0.1,1", "--measure-steps", "1", "--measure-root", str(tmp_path / "runs"), "--",
                f"data.path={sudoku_dir}", "data.generate_if_missing=false", "train.global_batch_size=16",
                "arch.hidden=32", "arch.heads=2", "arch.L_layers=1", "arch.H_cycles=1", "arch.L_cycles=1",
                "arch.halt_max_steps=2", "optim.warmup_steps=2", **env)  # a small model: short compiles
            emu.apply_env()
            import fsspec

            left = fsspec.filesystem("gs").find("bkt")
            emu.restore_env()
    finally:
        meta.close()
        stub.close()
    assert result.returncode == 0, result.stdout + result.stderr
    assert fake_slice.left_running() == [] and left == [] and list((tmp_path / "runs").iterdir()) == []
    saved = json.loads(fake_slice.out.read_text())
    assert saved["ok"] and saved["platform"] == "cpu" and saved["workers"] == 2
    names = {c["name"] for c in saved["checks"]}
    assert {"software", "tpu-free", "lockfile", "disk", "metadata", "maintenance", "coordinator-port",
            "liveness-port", "join", "devices", "all-reduce", "bucket", "bucket-throughput", "wandb", "measure",
            "same-versions"} <= names
    assert all(f["platform"] == "cpu" and f["host"] and f["time"] for f in saved["figures"])
    summary = saved["summary"]
    assert {"launch", "setup_check", "runtime_init", "gcs_write", "gcs_read", "allreduce_1mb", "step_time:exp02a/L6",
            "eval_step:exp02a/L6", "compile_cold:exp02a/L6", "save:exp02a/L6", "restore:exp02a/L6"} <= set(summary)
    evals = summary["eval_step:exp02a/L6"]
    assert evals["seconds"] > 0 and evals["platform"] == "cpu" and evals["workers"] == 1  # process 0 says it

    # the plan: a CPU file is refused for a TPU topology, unless told; then runtime_init and the step time move
    with pytest.raises(Exception, match="measured on cpu devices.*--allow-platform-mismatch"):
        doctor.read_calibration(fake_slice.out)
    cal = doctor.read_calibration(fake_slice.out, allow_platform_mismatch=True)
    assert cal.figures["runtime_init"].seconds == summary["runtime_init"]["seconds"]
    assert cal.program_startup == {"exp02a/L6": summary["compile_cold:exp02a/L6"]["seconds"]}
    assert cal.evals == {"exp02a/L6": evals["seconds"]}
    moved = calibrate.moved(bill.FIGURES, cal.figures)
    assert any(line.startswith("calibrated: runtime_init 7.3 s -> ") for line in moved)
    rows = [planner.Row("exp02a", "L6", estimate=StepEstimate(0.01, "", 0.0, None, 1.0), steps=10,
                        eval_estimate=StepEstimate(0.004, "", 0.0, None, 1.0)),
            planner.Row("exp02a", "L2", estimate=StepEstimate(0.02, "", 0.0, None, 1.0), steps=10),
            planner.Row("gemma01", "a", estimate=StepEstimate(0.05, "", 0.0, None, 1.0), steps=10,
                        eval_estimate=StepEstimate(0.03, "", 0.0, None, 1.0))]
    said = doctor.scale_steps(rows, cal, "v4-8", lambda g: "gemma" if g.startswith("gemma") else "trm")
    ratio = summary["step_time:exp02a/L6"]["seconds"] / 0.01
    assert rows[0].estimate.total_s == pytest.approx(0.01 * ratio) and rows[1].estimate.total_s == pytest.approx(
        0.02 * ratio) and rows[2].estimate.total_s == 0.05
    # the eval-step time against the eval step's estimate: its ratio moves the family's eval estimates only
    assert rows[0].eval_estimate.total_s == pytest.approx(evals["seconds"]) and rows[1].eval_estimate is None
    assert rows[2].eval_estimate.total_s == 0.03
    assert len(said) == 2 and "step time of exp02a/L6" in said[0] and "2 trm variant(s)" in said[0]
    assert said[1].startswith(f"calibrated: eval-step time of exp02a/L6 measured {evals['seconds']:.4g} s on cpu "
                              f"workers (--allow-platform-mismatch) against the estimate 0.004 s: "
                              f"x{evals['seconds'] / 0.004:.3g} applied to the 1 trm variant(s)")


def test_the_plan_refuses_a_cpu_doctor_file_for_a_tpu_topology(tmp_path):
    file = tmp_path / "doctor.json"
    file.write_text(json.dumps({"platform": "cpu", "accelerator": None, "summary": {
        "runtime_init": {"name": "runtime_init", "variant": None, "seconds": 3.0, "workers": 2, "platform": "cpu",
                         "what": "w"},
        "eval_step:exp08/off": {"name": "eval_step", "variant": "exp08/off", "seconds": 0.0, "workers": 1,
                                "platform": "cpu", "what": "nothing evaluated"}}}))
    r = launch_in_process(["plan", "exp08", "--topology", "v4-64", "--calibrate-from", str(file)])
    assert r.returncode == EXIT_USER_ERROR and r.stdout == "" and r.stderr.count("\n") == 1
    assert "measured on cpu devices" in r.stderr and "--allow-platform-mismatch" in r.stderr
    cal = doctor.read_calibration(file, allow_platform_mismatch=True)
    assert cal.figures["runtime_init"].seconds == 3.0 and cal.figures["save"] == bill.FIGURES["save"]
    assert cal.evals == {}  # a 0 s eval step (no eval set) is no ratio to scale estimates by
    assert calibrate.moved(bill.FIGURES, cal.figures) == [
        f"calibrated: runtime_init 7.3 s -> 3 s (-59%), from {cal.figures['runtime_init'].source}"]


def test_the_doctor_line_reads_back_what_was_said_and_nothing_else():
    from runtime import wire

    report = wire.DoctorReport("h0", "0", "cpu", 1.5, [wire.Check("disk", "fail", "0.1 GB free", "free space")],
                               [wire.Measured("runtime_init", 4.2, "imports and join")], {"jax": "0.10.2"})
    line = "[worker 0] " + report.line()  # as gcloud prefixes it
    assert wire.doctor(line) == report and not wire.for_people(line)
    assert wire.doctor("podrunner-doctor {\"checks\": 3}") is None and wire.doctor("podrunner-doctor [") is None


def test_a_check_that_overruns_its_budget_is_one_verdict():
    from experiments.launcher.worker import doctor_checks

    gate = threading.Event()
    w = doctor_checks.Worker("h0", doctor_checks.Spec())
    try:
        doctor_checks.run_within(w, "storage", 0.05, lambda _w: gate.wait())  # never done within its budget
    finally:
        gate.set()
    [check] = w.checks
    assert check.name == "storage" and check.status == "overrun" and "budget of 0.05 s" in check.detail
    assert "--only storage" in check.fix


def test_a_programmes_variants_are_the_ones_measured(tmp_path):
    from experiments.launcher.gcloud import PodError

    (tmp_path / "programme.json").write_text(json.dumps({
        "name": "p1", "variants": ["exp02a/L6", "exp08/off"], "slices": ["s1"], "zone": "z", "accelerator_type": "v4-8",
        "runtime_version": "r", "overrides": ["data.path=gs://b/d"]}))
    measured = doctor.variant_overrides([], ["train.global_batch_size=16"], tmp_path)
    assert [v[0] for v in measured] == ["+experiment=exp02a/L6", "+experiment=exp08/off"]
    assert all("data.path=gs://b/d" in v and v[-1] == "train.global_batch_size=16" for v in measured)
    with pytest.raises(PodError, match="cannot read its programme.json"):
        doctor.variant_overrides([], [], tmp_path / "nothing")


def test_plan_calibrated_from_a_doctor_file_says_what_moved_above_its_table(tmp_path, monkeypatch):
    """The plan command's own path, its compiles stood in for by rows with known estimates."""
    file = tmp_path / "doctor.json"
    file.write_text(json.dumps({"platform": "tpu", "accelerator": "v4-8", "summary": {
        "runtime_init": {"name": "runtime_init", "variant": None, "seconds": 20.0, "workers": 2, "platform": "tpu",
                         "what": "w"},
        "step_time:exp02a/L6": {"name": "step_time", "variant": "exp02a/L6", "seconds": 0.03, "workers": 1,
                                "platform": "tpu", "what": "s"}}}))

    def plan(self, jobs):
        return [planner.Row(j.group, j.variant, fits=True, total_gib=1.0, hbm_gib=30.0, steps=100,
                            estimate=StepEstimate(0.01, "", 0.0, None, 1.0))
                for j in jobs]

    monkeypatch.setattr(planner.Planner, "plan", plan)
    r = launch_in_process(["plan", "exp02a", "--topology", "v4-8", "--calibrate-from", str(file), "--csv",
                           str(tmp_path / "plan.csv")])
    assert r.returncode == 0, r.stderr
    above = r.stdout.split("|", 1)[0]
    assert "calibrated: runtime_init 7.3 s -> 20 s (+174%)" in above
    assert "step time of exp02a/L6 measured 0.03 s on v4-8 against the estimate 0.01 s: x3" in above
    assert "trm variant(s) on v4-8" in above
