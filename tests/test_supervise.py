"""`launch.py supervise` against the fake TPU control plane (tests/fake_gcloud: gcloud + fake_tpu.py).

Most tests run a stub trainer on the fake workers (cheap): the n-th launch on a worker exits with
the n-th code of STUB_CODES (the last one repeats) after its `checkpoint` event of step 10 n (or
STUB_STEP, a fixed step: no progress), saying what a trainer says through runtime/events.py. Its
launch count lives in STUB_DIR (a re-created TPU's workers have fresh disks). The end-to-end
test runs the real pretrain_jax.py on 2 workers x 1 CPU device through two preemptions and a
dead worker.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from experiments.launcher import pod, supervise
from experiments.launcher.ledger import Cause
from experiments.launcher.pod import Target
from runtime import wire
from gcs_emulator import start_gcs_emulator
from helpers import (LAUNCH, REFERENCE_EXTRA, REFERENCE_STEPS, base_overrides, error_line, fake_plane, gcloud_calls,
                     make_fake_workers, reached, read_jsonl, train_losses, wait_for)

sys.path.insert(0, str(Path(__file__).resolve().parent / "fake_gcloud"))
import fake_tpu

# Every test here drives the launcher against the fake TPU control plane, with worker processes:
# the slow tier (see pyproject.toml).
pytestmark = pytest.mark.slow

TPU, ZONE, RUN_ID = "sup-tpu", "us-central2-b", "run-1"

STUB = """\
import os, sys, time
import hydra  # a trainer's dependency: a .venv without packages fails here, as the real one does
from runtime import events
state = os.path.join(os.environ["STUB_DIR"], os.environ["TPU_WORKER_ID"])
os.makedirs(state, exist_ok=True)
count_file = os.path.join(state, "launches")
n = int(open(count_file).read()) + 1 if os.path.exists(count_file) else 1
codes = [int(c) for c in os.environ.get("STUB_CODES", "0").split(",")]
code, step = codes[min(n, len(codes)) - 1], int(os.environ.get("STUB_STEP") or 10 * n)
events.emit("started", run_id=os.environ["PODRUNNER_RUN_ID"], step=0, total=100, resumed=n > 1)
events.emit("checkpoint", step=step)
open(count_file, "w").write(str(n))
if os.environ.get("STUB_LEASE_HELD") == str(n):  # as runtime/lease.py refuses a busy run directory
    events.failed(2, "the checkpoint directory /x is in use by another run: host h pid 1; wait", "lease-held")
    sys.exit(2)
while os.environ.get("STUB_WAIT_LAUNCH") == str(n) and not os.path.exists(os.path.join(state, "go")):
    time.sleep(0.05)
if code == 0:
    events.emit("completed", step=step, metrics={"eval/exact_accuracy": 0.5})
else:
    events.failed(code, f"stub failure {code}")
if os.environ.get("STUB_LINGER"):  # still exiting (a last upload, W&B's end) until SIGTERM, then as long again
    import signal
    signal.signal(signal.SIGTERM, lambda *_: (time.sleep(float(os.environ["STUB_LINGER"])), os._exit(code)))
    open(os.path.join(state, "ended"), "w").close()
    while True:
        time.sleep(0.05)
sys.exit(code)
"""


@pytest.fixture
def plane(tmp_path: Path):
    root, env = fake_plane(tmp_path, STUB_DIR=str(tmp_path / "stub"))
    started: list[subprocess.Popen] = []

    class Plane:
        def __init__(self) -> None:
            self.root, self.env, self.tmp, self.log_dir = root, env, tmp_path, tmp_path / "logs"

        def args(self, *extra: str, overrides: tuple[str, ...] = ()) -> list[str]:
            return [sys.executable, str(LAUNCH), "supervise", "--tpu", TPU, "--zone", ZONE, "--run-id", RUN_ID,
                    "--accelerator-type", "v4-16", "--runtime-version", "tpu-ubuntu2204-base", "--spot",
                    "--repo-dir", "~/repo", "--log-dir", str(self.log_dir), "--poll-seconds", "0.05",
                    "--storage-backoff-seconds", "0.1", "--stop-grace", "1", *extra, "--", *overrides]

        def supervise(self, *extra: str, stub_env: dict | None = None, timeout: float = 60,
                      overrides: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
            return subprocess.run(self.args(*extra, overrides=overrides), cwd=tmp_path, env=dict(env, **(stub_env or {})),
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)

        def start(self, *extra: str, stub_env: dict | None = None, overrides: tuple[str, ...] = ()) -> subprocess.Popen:
            proc = subprocess.Popen(self.args(*extra, overrides=overrides), cwd=tmp_path,
                                    env=dict(env, **(stub_env or {})), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            started.append(proc)
            return proc

        def record(self) -> dict:
            return json.loads((self.log_dir / RUN_ID / "supervision.json").read_text())

        def events(self) -> list[str]:
            return [line.split()[2] for line in (self.log_dir / RUN_ID / "supervise.log").read_text().splitlines()]

        def gcloud_calls(self) -> list[list[str]]:
            return gcloud_calls(tmp_path / "gcloud.jsonl")

        def stub_file(self, worker: int, name: str) -> Path:
            return tmp_path / "stub" / str(worker) / name

        def wait_launched(self, proc: subprocess.Popen, n: int) -> None:
            """Until launch `n` runs on every worker: each stub has counted it (after its events), and
            the fake control plane knows the workers' processes (what a preemption or a stop signals)."""
            def launched() -> bool:
                counts = [self.stub_file(i, "launches") for i in range(2)]
                if not all(c.exists() and c.read_text() == str(n) for c in counts):  # written, not just created
                    return False
                with fake_tpu.control(root) as state:
                    return len(state["tpus"].get(TPU, {}).get("workers", [])) == 2

            wait_for(launched, timeout=60, what=f"launch {n} on both workers", procs=[proc])

    yield Plane()
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    fake_tpu.power_off(list(root.glob("*/worker-*")))  # whatever still runs on the fake workers


@pytest.fixture
def stub_plane(plane):
    make_fake_workers(plane.root, 2, STUB, image=True)
    return plane


def test_creates_the_tpu_waits_until_ready_and_completes(stub_plane):
    result = stub_plane.supervise()
    assert result.returncode == 0, result.stdout + result.stderr
    events = stub_plane.events()
    assert events == ["start", "tpu-created", "waiting", "tpu-ready", "setup-skipped", "launch", "launch-ended",
                      "tpu-kept", "completed"], events  # local checkpoints: the TPU is kept (--at-end)
    create = next(c for c in stub_plane.gcloud_calls() if c[4] == "create")
    assert create == ["gcloud", "compute", "tpus", "tpu-vm", "create", TPU, "--zone", ZONE, "--accelerator-type=v4-16",
                      "--version=tpu-ubuntu2204-base", "--spot"]
    record = stub_plane.record()
    assert record["status"] == "completed" and record["restarts"] == 0 and record["launches"][0]["last_step"] == 10
    lines = (stub_plane.log_dir / RUN_ID / "supervise.log").read_text().splitlines()
    assert all(re.fullmatch(r"\[supervise\] \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ [a-z-]+( \S+=\S+)*", line)
               for line in lines), lines
    assert lines[-1] in result.stdout  # the console gets the same lines


def test_bad_input_stops_at_once(stub_plane):
    result = stub_plane.supervise(stub_env={"STUB_CODES": "2"})
    assert result.returncode == 2, result.stdout + result.stderr
    record = stub_plane.record()
    assert record["status"] == "failed" and [launch["cause"] for launch in record["launches"]] == ["bad input"]
    assert "failed" in stub_plane.events()[-1] and "cause='bad input'" in result.stdout


def test_a_refused_create_stops_it_with_one_error_line(stub_plane):
    args = stub_plane.args()
    args[args.index("v4-16")] = "v4-bogus"
    result = subprocess.run(args, env=stub_plane.env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    error_line(result.stderr, "INVALID_ARGUMENT")
    assert stub_plane.record()["status"] == "failed" and stub_plane.record()["launches"] == []


def test_stopping_the_supervisor_stops_the_run(stub_plane):
    proc = stub_plane.start(stub_env={"STUB_WAIT_LAUNCH": "1"})
    stub_plane.wait_launched(proc, 1)
    proc.send_signal(signal.SIGTERM)  # systemctl stop
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 130, out
    assert stub_plane.record()["status"] == "interrupted" and stub_plane.events()[-1] == "interrupted"
    with fake_tpu.control(stub_plane.root) as state:
        groups = state["tpus"][TPU]["groups"]
    assert not any(fake_tpu.signal_trainers(g, 0) for g in groups), "a trainer still runs"


def test_restarts_without_progress_stop_it(stub_plane):
    result = stub_plane.supervise(stub_env={"STUB_CODES": "7", "STUB_STEP": "5"})
    assert result.returncode == 1, result.stdout + result.stderr
    record = stub_plane.record()
    assert [launch["cause"] for launch in record["launches"]] == ["worker lost"] * 3
    assert record["status"] == "gave-up" and "reason=no-progress" in result.stdout
    stops = [c for c in stub_plane.gcloud_calls() if c[4] == "ssh" and "experiments.launcher.worker.stop" in c[-1]]
    assert len(stops) == 2  # stale processes stopped before each relaunch


def test_max_restarts_and_storage_backoff(stub_plane):
    result = stub_plane.supervise("--max-restarts", "2", stub_env={"STUB_CODES": "6,4,4"})
    assert result.returncode == 1, result.stdout + result.stderr
    record = stub_plane.record()
    assert [launch["cause"] for launch in record["launches"]] == ["storage failure", "hang watchdog", "hang watchdog"]
    assert record["restarts"] == 3 and "reason=max-restarts" in result.stdout and "backoff" in stub_plane.events()


def test_a_lease_still_held_is_waited_out_not_fatal(stub_plane):
    result = stub_plane.supervise(stub_env={"STUB_CODES": "2,0", "STUB_LEASE_HELD": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    record = stub_plane.record()
    assert [launch["cause"] for launch in record["launches"]] == ["lease held", "completed"]
    assert "backoff" in stub_plane.events()


def test_a_killed_supervisor_carries_on_where_it_was(stub_plane):
    first = stub_plane.start(stub_env={"STUB_CODES": "7,0", "STUB_WAIT_LAUNCH": "2"})
    stub_plane.wait_launched(first, 2)
    os.kill(first.pid, signal.SIGKILL)  # mid-launch: the second launch is still running on the workers
    first.wait()
    result = stub_plane.supervise(stub_env={"STUB_CODES": "7,0,0"})
    assert result.returncode == 0, result.stdout + result.stderr
    record = stub_plane.record()
    # the launch left running is stopped and recorded (`unwatched`), as no preemption nor restart
    assert [launch["cause"] for launch in record["launches"]] == ["worker lost", Cause.SUPERVISOR_DIED, "completed"]
    assert [launch["unwatched"] for launch in record["launches"]] == [False, True, False]
    assert record["restarts"] == 1 and record["preemptions"] == 0 and "resumed=True" in result.stdout
    events = stub_plane.events()
    assert events.count("start") == 2 and events[events.index("tpu-ready", events.index("start", 1)) + 1] == \
        "stopped-stale-processes"  # the orphaned launch was stopped (else it waits for ~/go forever)
    status = subprocess.run([sys.executable, str(LAUNCH), "supervise", "--status", "--run-id", RUN_ID,
                             "--log-dir", str(stub_plane.log_dir)], capture_output=True, text=True)
    assert status.returncode == 0 and "completed; 3 launches, 1 restarts, 0 preemptions" in status.stdout
    assert "worker lost" in status.stdout and "host-hours" in status.stdout
    pod_status = subprocess.run([sys.executable, str(LAUNCH), "status", "--tpu", TPU, "--zone", ZONE, "--run-id", RUN_ID,
                                 "--log-dir", str(stub_plane.log_dir)], env=stub_plane.env, capture_output=True, text=True)
    assert "completed; 3 launches, 1 restarts" in pod_status.stdout, pod_status.stdout + pod_status.stderr


def test_a_preemption_no_supervisor_saw_end_is_counted(stub_plane):
    """The supervisor killed mid-launch, then the TPU preempted before it is started again: the
    new one finds the slice down under the launch left in flight, counts that preemption once
    (before: never, as no launch end was recorded) and re-creates the slice for the next launch,
    with no stale processes to stop on its fresh VMs."""
    first = stub_plane.start(stub_env={"STUB_CODES": "0", "STUB_WAIT_LAUNCH": "1"})
    stub_plane.wait_launched(first, 1)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    assert fake_tpu.preempt(stub_plane.root, TPU)
    result = stub_plane.supervise()
    assert result.returncode == 0, result.stdout + result.stderr
    record = stub_plane.record()
    assert record["preemptions"] == 1  # the launch left in flight, recorded as it ended: preempted
    assert [(launch["outcome"], launch["unwatched"]) for launch in record["launches"]] == [("preempted", True),
                                                                                         ("completed", False)]
    events = stub_plane.events()
    assert "preempted-unwatched" in events and "stopped-stale-processes" not in events, events


def test_queued_resource_and_preemption(stub_plane):
    stub_plane.env["FAKE_GCLOUD_QUEUE_POLLS"] = "2"
    proc = stub_plane.start("--queued-resource", "qr-1", stub_env={"STUB_CODES": "0", "STUB_WAIT_LAUNCH": "1"})
    stub_plane.wait_launched(proc, 1)
    fake_tpu.preempt(stub_plane.root, TPU)  # the stub ignores SIGTERM's checkpoint: it just dies
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    record = stub_plane.record()
    assert [launch["outcome"] for launch in record["launches"]] == ["preempted", "completed"], out
    assert record["preemptions"] == 1 and record["restarts"] == 0
    calls = [c[3:5] for c in stub_plane.gcloud_calls() if c[3] == "queued-resources" and c[4] != "describe"]
    assert calls == [["queued-resources", "create"], ["queued-resources", "delete"], ["queued-resources", "create"]]
    assert "queued-resource-created" in stub_plane.events()


def test_a_tpu_preempted_as_a_completed_run_exits_is_counted_to_the_preemption(stub_plane):
    """The run completed, and its workers were still exiting when the TPU was preempted: the
    launch is a completion, and the slice's READY time ends at the shutdown's SIGTERM (the launch
    guard's event), not when the ssh ended after the workers' last seconds (seen as 5% too many
    pod-hours in the programme's end-to-end test)."""
    linger = 3.0
    proc = stub_plane.start(stub_env={"STUB_LINGER": str(linger)})
    wait_for(lambda: all(stub_plane.stub_file(i, "ended").exists() for i in range(2)), timeout=60,
             what="both stubs past their completed event", procs=[proc])
    assert fake_tpu.preempt(stub_plane.root, TPU)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    record = stub_plane.record()
    assert [(launch["outcome"], launch["tpu_state_after"]) for launch in record["launches"]] == [
        ("completed", "PREEMPTED")], out
    billed = fake_tpu.ready_host_seconds(stub_plane.root)
    counted = record["slice"]["host_seconds"]
    assert counted == pytest.approx(billed, abs=0.2 * linger), (counted, billed)  # without: billed + 2 x linger


def test_dry_run_prints_the_commands_for_each_state(plane):
    result = plane.supervise("--dry-run", "--queued-resource", "qr-1")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for state in ("# TPU missing:", "# TPU CREATING", "# TPU READY:", "# TPU PREEMPTED or TERMINATED:",
                  "# TPU queued resource FAILED or SUSPENDED:"):
        assert state in out, out
    assert (f"gcloud compute tpus queued-resources create qr-1 --node-id={TPU} --zone {ZONE} --accelerator-type=v4-16 "
            "--runtime-version=tpu-ubuntu2204-base --spot") in out
    assert f"gcloud compute tpus queued-resources delete qr-1 --zone {ZONE} --quiet --force" in out
    assert f"gcloud compute tpus tpu-vm describe {TPU} --zone {ZONE} --format=json" in out
    assert f"run.id={RUN_ID}" in out
    assert not (plane.tmp / "gcloud.jsonl").exists()  # nothing was run


def test_dry_run_with_ship_and_clone_url(plane):
    """--ship packs the tree once (its scp and unpack are in the launch); --clone-url makes setup
    clone the repo where a re-created TPU's fresh disk lacks it."""
    result = plane.supervise("--dry-run", "--ship", "--clone-url", "https://example.com/podrunner.git")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "git clone --quiet https://example.com/podrunner.git" in out
    tree = re.search(r"# ship: \d+ files, .* tree ([0-9a-f]{64})", out)
    assert tree, out
    assert f"gcloud compute tpus tpu-vm scp PACK.tar.gz {TPU}:.podrunner-ship-{tree.group(1)[:16]}.tar.gz" in out
    assert f"podrunner-shipped/{tree.group(1)}" in out
    assert not (plane.tmp / "gcloud.jsonl").exists()


def test_state_is_mirrored_beside_gs_checkpoints(tmp_path, sudoku_dir):
    """A supervisor on another machine (no local record) carries on from the copy on gs://."""
    assert supervise.state_mirror(base_overrides(sudoku_dir, tmp_path)) is None  # local checkpoints
    overrides = base_overrides(sudoku_dir, tmp_path) + ["run.checkpoint.dir=gs://sup-bucket/ckpt/t"]
    uri = supervise.state_mirror(overrides)
    assert uri == "gs://sup-bucket/ckpt/t/supervision.json"
    with start_gcs_emulator(tmp_path) as emu:
        emu.apply_env()
        emu.create_bucket("sup-bucket")
        spec = supervise.Spec(Target(TPU, ZONE), RUN_ID, overrides, log_dir=tmp_path / "here", state_mirror=uri)
        first = supervise.FileSupervision(spec, io.StringIO())
        first.record.restarts = 3
        first.save()
        spec.log_dir = tmp_path / "elsewhere"
        assert supervise.FileSupervision(spec, io.StringIO()).record.restarts == 3


def test_setup_keeps_the_first_commit_and_a_failed_setup_backs_off(tmp_path, monkeypatch):
    """The commit every worker first agreed on is recorded; a later setup (fresh disks of a
    re-created TPU) checks it out rather than the remote's default HEAD; a failed setup waits
    `storage_backoff_s` before the next try instead of spinning."""
    row = {"commit": "c0ffee", "python": "3.12", "jax": "0.10.2", "ok": True}
    answers = iter([[dict(row, host="w0"), dict(row, host="w1")],  # launch 1: versions agree
                    [dict(row, host="w0")],                        # launch 2: worker 1 is a fresh disk
                    [dict(row, host="w0")]])                       # launch 3: the same
    setups: list[str | None] = []

    def versions(argv, on_line):
        for r in next(answers):
            on_line(wire.versions_line(r))
        return 0

    def setup_pod(target, *, git_ref, on_versions, **_):
        setups.append(git_ref)
        if len(setups) == 1:
            return 1  # the first setup fails (a network blip)
        for host in ("w0", "w1"):
            on_versions(dict(row, host=host, commit=git_ref))
        return 0

    outcomes = iter([("restart", 1), ("completed", 0)])
    sleeps: list[float] = []
    monkeypatch.setattr(pod, "run_gcloud", versions)
    monkeypatch.setattr(pod, "setup_pod", setup_pod)
    monkeypatch.setattr(pod, "stop_pod", lambda *a, **k: 0)
    monkeypatch.setattr(supervise.Supervisor, "ensure_ready", lambda self: 2)
    monkeypatch.setattr(supervise.Supervisor, "launch_once", lambda self, hosts: (*next(outcomes), None))
    spec = supervise.Spec(Target(TPU, ZONE), RUN_ID, [], log_dir=tmp_path, storage_backoff_s=7.0)
    sup = supervise.FileSupervision(spec, io.StringIO())
    assert supervise.Supervisor(spec, sup, sup.record.slice, sleep=sleeps.append).run() == 0
    assert setups == ["c0ffee", "c0ffee"]  # both setups after the first launch pin the recorded commit
    assert sleeps == [7.0]  # after the failed setup only (the "restart" launch relaunches at once)
    record = json.loads((tmp_path / RUN_ID / "supervision.json").read_text())
    assert record["commit"] == "c0ffee"


def test_fake_gcloud_refuses_ssh_to_a_tpu_that_is_not_ready(plane):
    fake_tpu.enable(plane.root, {TPU: {"state": "CREATING", "describes": 0, "workers": []}})
    ssh = subprocess.run(["gcloud", "compute", "tpus", "tpu-vm", "ssh", TPU, "--zone", ZONE, "--worker=all",
                          "--command", "true"], env=plane.env, capture_output=True, text=True)
    assert ssh.returncode == 1 and "not READY" in ssh.stderr


# --- the control plane's findings (issue 20): each test failed before its fix ---------------------

def test_an_ssh_drop_reruns_the_command_and_the_rerun_follows_the_launch(stub_plane):
    """gcloud re-runs a --command whose ssh ended with 255. The re-run on worker 1 must not start a
    second trainer nor need the secrets again (they were consumed): it follows the launch running
    there and exits with its code, so a completed run is not taken for bad input."""
    trigger = stub_plane.tmp / "drop-worker-1"
    stub_plane.env.update(WANDB_API_KEY="secret-1", FAKE_GCLOUD_LOCAL_ONLY="WANDB_API_KEY",
                          FAKE_GCLOUD_SSH_DROP=f"1:{trigger}")
    proc = stub_plane.start(stub_env={"STUB_WAIT_LAUNCH": "1"})
    stub_plane.wait_launched(proc, 1)
    with fake_tpu.control(stub_plane.root) as state:
        first = state["tpus"][TPU]["workers"][1]
    trigger.touch()  # worker 1's connection drops; gcloud runs the command there again

    def rerun_started() -> bool:
        with fake_tpu.control(stub_plane.root) as state:
            return state["tpus"][TPU]["workers"][1] != first
    wait_for(rerun_started, timeout=60, what="gcloud's re-run on worker 1", procs=[proc])
    for worker in (0, 1):
        stub_plane.stub_file(worker, "go").touch()
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out
    record = stub_plane.record()
    assert [launch["outcome"] for launch in record["launches"]] == ["completed"], out
    assert stub_plane.stub_file(1, "launches").read_text() == "1"  # one trainer on worker 1, not two
    assert "this launch started here already" in out and "the secrets file did not arrive" not in out


def test_a_failed_setup_is_retried_and_an_empty_venv_is_not_agreement(stub_plane):
    """A fresh worker has no .venv; the first setup fails half-way (pip), leaving one without packages.
    Its versions are the same on every worker (all missing), which must not pass for agreement:
    setup runs again, and the run completes instead of failing on `import hydra` until it gives up."""
    real = Path(sys.prefix)
    setup = f"""n=$(cat ~/setups 2>/dev/null || echo 0); n=$((n+1)); echo $n > ~/setups
if [ $n = 1 ]; then echo "pip: network error" >&2; exit 1; fi
ln -sfn {real}/lib .venv/lib && ln -sfn {real}/pyvenv.cfg .venv/pyvenv.cfg && echo setup_tpu.sh: ok
"""
    image = stub_plane.root / "image" / "repo"
    (image / "setup_tpu.sh").write_text(setup)
    for packages in ("lib", "pyvenv.cfg"):  # a .venv with python only: pip never installed anything
        (image / ".venv" / packages).unlink()
    result = stub_plane.supervise("--max-restarts", "3")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    events = stub_plane.events()
    assert events.count("setup-failed") == 1 and events.count("setup-done") == 1 and "setup-skipped" not in events
    assert [launch["outcome"] for launch in stub_plane.record()["launches"]] == ["completed"]


@pytest.mark.parametrize("kind", ["expired", "missing"])
def test_no_gcloud_credentials_is_one_line_and_a_stop(stub_plane, kind):
    stub_plane.env["FAKE_GCLOUD_AUTH"] = kind
    result = stub_plane.supervise(timeout=30)
    assert result.returncode == 2, result.stdout + result.stderr
    error_line(result.stderr, "gcloud has no valid credentials", "gcloud auth login", last=True)
    assert len(stub_plane.gcloud_calls()) == 1 and stub_plane.record()["status"] == "failed"


def test_pod_hours_are_ready_time_times_hosts_and_the_tpu_is_deleted_at_the_end(stub_plane):
    """READY time counts from the describe that shows READY to the delete, backoffs and stops
    between launches included (they are billed); --at-end delete gives the TPU back."""
    result = stub_plane.supervise("--at-end", "delete", stub_env={"STUB_CODES": "6,0"})
    assert result.returncode == 0, result.stdout + result.stderr
    with fake_tpu.control(stub_plane.root) as state:
        assert TPU not in state["tpus"]  # deleted
    billed = fake_tpu.ready_host_seconds(stub_plane.root)
    counted = stub_plane.record()["slice"]["host_seconds"]
    assert counted == pytest.approx(billed, rel=0.01), (counted, billed)


# --- end to end: the real trainer on 2 fake workers x 1 CPU device --------------------------------

def test_supervised_run_survives_preemptions_and_a_dead_worker(plane, sudoku_dir, reference_losses):
    """Two preemptions are VM shutdowns (every process of each worker gets SIGTERM, W&B's wandb-core
    included, SIGKILL 30 s later) of a run logging to W&B offline on the workers' own disks: each
    still saves its preemption checkpoint (the trainer outlives W&B), the TPU comes back with fresh
    disks, and the metrics, copied beside the checkpoints at every checkpoint, come back with it:
    the run's metrics equal an uninterrupted run's at every step."""
    make_fake_workers(plane.root, 2, None, image=True)
    checkpoints = plane.tmp / "bucket" / "ckpt"  # beside the workers, as gs:// is
    overrides = base_overrides(sudoku_dir, plane.tmp, steps=REFERENCE_STEPS, wandb="offline") + REFERENCE_EXTRA + [
        "run.root=outputs", f"run.checkpoint.dir={checkpoints}", "mesh=fsdp", "train.checkpoint_every=4",
        "distributed.initialization_timeout_s=60"]
    home0 = plane.root / TPU / "worker-0"
    out = home0 / "repo" / "outputs" / "test" / "t"  # on worker 0's disk
    proc = plane.start(overrides=tuple(overrides))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        for step, fault in ((5, "preempt"), (14, "preempt"), (23, "kill")):
            wait_for(lambda: reached(out / "metrics.jsonl", step), timeout=240, what=f"step {step}")
            assert proc.poll() is None, "the supervisor ended early"
            if fault == "preempt":
                vm = [cmd for _, cmd in fake_tpu.vm_processes(home0)]
                assert any("wandb-core" in cmd for cmd in vm), vm  # the shutdown takes W&B down too
                assert fake_tpu.preempt(plane.root, TPU), "no trainer to preempt"
            else:
                assert fake_tpu.kill_worker(plane.root, TPU, 1), "no trainer to kill"
        proc.wait(timeout=240)
    finally:
        proc.kill()
        reader.join(5)
    assert proc.returncode == 0, "".join(lines)[-6000:]
    record = plane.record()
    assert [launch["outcome"] for launch in record["launches"]] == ["preempted", "preempted", "restart",
                                                                   "completed"], "".join(lines)[-4000:]
    assert record["launches"][2]["cause"] == "worker lost" and record["preemptions"] == 2 and record["restarts"] == 1
    verbs = [c[4] for c in plane.gcloud_calls() if c[4] in ("create", "delete")]
    assert verbs == ["create", "delete", "create", "delete", "create"]  # each preempted TPU re-created
    synced = checkpoints / "run_files"
    assert train_losses(synced) == pytest.approx(reference_losses, rel=1e-5, abs=1e-6)
    assert train_losses(out) == pytest.approx(reference_losses, rel=1e-5, abs=1e-6)  # restored on the fresh disk
    assert len(list((synced / "wandb").glob("offline-run-*"))) == 4  # each launch's W&B files, kept
    kinds = [e["event"] for e in read_jsonl(synced / "events.jsonl")]
    assert kinds.count("preempted") == 2 and kinds[-1] == "completed", kinds
