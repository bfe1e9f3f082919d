"""`launch.py programme`: the queue of the programme's variants on fake TPU slices (tests/fake_gcloud).

Most tests run a stub trainer (PROGRAMME_STUB: the events of a run of 10 steps, a bad-input failure
for the variants in STUB_BAD, a wait for the file STUB_GATE); the end-to-end test runs the real
trainer on 2 single-host slices (1 CPU device each) through preemptions, a killed trainer and a
killed controller, and checks where the paid time went (experiments/launcher/account.py).
A programme's launches on multi-host slices are the stub tests' (2 workers a slice); the real
trainer as a 2-worker pod through VM shutdowns and a dead worker is test_supervise.py's, through
the same Supervisor the controller runs for each variant.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import jax.numpy as jnp
import pytest

from experiments.launcher import queue_state, queue_status, supervise
from experiments.launcher.account import live_ready_seconds, programme_account
from experiments.launcher.controller import Alerts, Controller, Stop
from experiments.launcher.ledger import (InFlight, LaunchRecord, Mark, Outcome, ReadyClock, Status, SupervisionRecord,
                                         load_ledger)
from experiments.plan import planner, report
from gcs_emulator import start_gcs_emulator
from helpers import (FakeProgramme, error_line, gcloud_calls, logged_metrics, make_fake_workers,
                     read_jsonl, train, wait_for)
from runtime import events, hydra_compose
from runtime.checkpointing import Checkpoints

sys.path.insert(0, str(Path(__file__).resolve().parent / "fake_gcloud"))
import fake_tpu

# Every test here drives the launcher against the fake TPU control plane, with worker processes:
# the slow tier (see pyproject.toml).
pytestmark = pytest.mark.slow

NAME, ZONE = "prog", "us-central2-b"
EMA = ["exp08/ema0.99", "exp08/off"]

PROGRAMME_STUB = """\\
import os, sys, time
from runtime import events
variant = next(a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("+experiment="))
events.emit("started", run_id=os.environ["PODRUNNER_RUN_ID"], step=0, total=10, resumed=False)
if variant in os.environ.get("STUB_BAD", "").split(","):
    events.failed(2, f"{variant}: the stub's bad input")
    sys.exit(2)
events.emit("checkpoint", step=5)
gate = os.environ.get("STUB_GATE")
while gate and not os.path.exists(gate):
    time.sleep(0.05)
events.emit("checkpoint", step=10)
events.emit("completed", step=10, metrics={"eval/exact_accuracy": 0.25})
"""


@pytest.fixture
def stub_programme(tmp_path):
    programme = FakeProgramme(tmp_path)
    make_fake_workers(programme.root, 2, PROGRAMME_STUB, image=True)
    yield programme
    programme.close()


def write_plan(path: Path, hours: dict[str, float], executables: str = "") -> Path:
    """A plan CSV as `launch.py plan` writes it, with these variants' pod-hours (and the folder
    its steps compiled ahead are in and its manifest's digest, as `plan --executables` names them)."""
    digest = "sha256:" + "0" * 64 if executables else ""
    rows = [planner.Row(v.split("/")[0], v.split("/")[1], steps=10, executables=executables,
                        executables_digest=digest) for v in hours]
    report.write_csv(rows, path)
    text = path.read_text().splitlines()
    head = text[0].split(",")
    fixed = [text[0]]
    for line in text[1:]:
        cells = line.split(",")
        key = f"{cells[0]}/{cells[1]}"
        if key in hours:
            cells[head.index("pod_hours")] = repr(hours[key])
        fixed.append(",".join(cells))
    path.write_text("\n".join(fixed) + "\n")
    return path


def test_the_budget_stops_the_queue_before_a_variant_that_would_exceed_it(stub_programme, tmp_path):
    """... and says so in one line; raised, the queue goes on, here from the state's mirror on
    "another machine" (another state directory): a controller takes over from the mirror."""
    plan_csv = write_plan(tmp_path / "plan.csv", {EMA[0]: 0.9, EMA[1]: 1.0})
    mirror = tmp_path / "bucket" / "programmes" / NAME  # as gs://, through fsspec
    r = stub_programme.submit("--budget", "1", "--plan", str(plan_csv), "--mirror", str(mirror), "--run")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    budget = [line for line in r.stdout.splitlines() if line.startswith("budget:")]
    assert len(budget) == 1 and f"{EMA[1]} not started" in budget[0] and "> budget 1" in budget[0], r.stdout[-2000:]
    assert stub_programme.states() == {EMA[0]: "completed", EMA[1]: "queued"}
    with fake_tpu.control(stub_programme.root) as state:
        assert state["tpus"] == {}  # nothing left for the slice: deleted
    status = stub_programme.command("status")
    assert status.returncode == 0, status.stderr
    assert "exp08/ema0.99" in status.stdout and "eval/exact_accuracy=0.25" in status.stdout and "/0.900 " in status.stdout
    assert "controller: budget" in status.stdout
    page = (stub_programme.state_dir / NAME / "status.html").read_text()
    assert "<table>" in page and "data:image/png;base64," in page
    stub_programme.state_dir = tmp_path / "elsewhere"  # another machine: no state but the mirror
    assert stub_programme.command("status", "--mirror", str(mirror)).returncode == 0
    assert stub_programme.command("budget", "5").returncode == 0  # raised: the queue goes on
    r = stub_programme.command("run", "--mirror", str(mirror))
    assert r.returncode == 0 and stub_programme.states() == {EMA[0]: "completed", EMA[1]: "completed"}, r.stdout[-2000:]
    assert json.loads((mirror / "state.json").read_text())["ledger"]["variants"][EMA[1]]["state"] == "completed"


def test_on_several_slices_the_budget_counts_what_the_running_variants_will_take(stub_programme, tmp_path):
    """Two slices, a budget of 1 pod-hour, two variants planned at 0.6 each: the second does not
    start beside the first (0.6 + 0.6 > 1); its slice is given back, and the variant runs after the
    first on the first's slice, where 0.6 planned on top of what was spent still fits."""
    plan_csv = write_plan(tmp_path / "plan.csv", {EMA[0]: 0.6, EMA[1]: 0.6})
    r = stub_programme.submit("--budget", "1", "--plan", str(plan_csv), "--run", slices=("s1", "s2"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    assert stub_programme.states() == {EMA[0]: "completed", EMA[1]: "completed"}
    log = (stub_programme.state_dir / NAME / "controller.log").read_text()
    assert log.count("budget-wait") == 1 and "budget:" not in r.stdout, log[-3000:]
    ran_on = {v: rec["slice"] for v, rec in stub_programme.ledger()["variants"].items()}
    assert ran_on[EMA[0]] == ran_on[EMA[1]], ran_on  # one after the other, on one slice


def test_a_second_controller_is_refused_and_a_dead_ones_lease_taken_over(stub_programme, tmp_path):
    assert stub_programme.submit().returncode == 0
    gate = tmp_path / "gate"
    first = stub_programme.start(STUB_GATE=str(gate))
    wait_for(lambda: "running" in stub_programme.states().values() and
             "launch " in (stub_programme.state_dir / NAME / "controller.log").read_text(),
             timeout=60, what="the first controller's launch", procs=[first])
    # While the launch runs, status shows it: the step of its last checkpoint, its run id, READY time so far.
    progress = lambda: stub_programme.ledger()["variants"][EMA[0]]["supervision"].get("launch") or {}  # noqa: E731
    wait_for(lambda: progress().get("last_step") == 5, timeout=60, what="the checkpoint of step 5", procs=[first])
    row = next(l for l in stub_programme.command("status").stdout.splitlines() if l.startswith(EMA[0] + " "))
    assert " running " in row and " 5/10 " in row and progress()["wandb_run_id"] in row, row
    ledger = load_ledger(json.dumps(stub_programme.ledger()), "ledger.json")
    assert live_ready_seconds(ledger, ledger.variants[EMA[0]]) > 0
    second = stub_programme.command("run")
    assert second.returncode == 2, second.stdout + second.stderr
    error_line(second.stderr, f"another controller runs programme {NAME}", f"pid {first.pid}", last=True)
    os.kill(first.pid, signal.SIGKILL)  # its launch goes on on the workers
    first.wait()
    gate.touch()
    third = stub_programme.command("run", timeout=120)
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr
    assert "took over the lease" in third.stderr + third.stdout and f"process {first.pid} is gone" in third.stderr + third.stdout
    assert stub_programme.states() == {EMA[0]: "completed", EMA[1]: "completed"}
    assert "stopped-stale-processes" in third.stdout  # the killed controller's launch was stopped, then resumed


def test_the_same_quota_refusal_on_three_variants_stops_the_controller(tmp_path):
    programme = FakeProgramme(tmp_path, FAKE_GCLOUD_CREATE_ERROR="RESOURCE_EXHAUSTED")
    make_fake_workers(programme.root, 2, PROGRAMME_STUB, image=True)
    try:
        variants = [*EMA, "exp08/ema0.995"]
        r = programme.submit("--create-attempts", "1", "--run", variants=variants)
        assert r.returncode == 1, r.stdout[-3000:] + r.stderr
        line = error_line(r.stderr, "the same infrastructure failure ended 3 variants in a row", "quota",
                          "RESOURCE_EXHAUSTED", last=True)
        assert "programme run prog" in line
        assert set(programme.states().values()) == {"queued"}  # none ran; each is there for the next run
        creates = [c for c in gcloud_calls(tmp_path / "gcloud.jsonl") if c[4] == "create"]
        assert len(creates) == 3
    finally:
        programme.close()


def test_preflight_is_one_line_per_variant_and_commands_steer_the_queue(stub_programme):
    r = stub_programme.submit(overrides=("arch=tiny_transformer", "arch.heads=5"))
    assert r.returncode == 2 and not (stub_programme.state_dir / NAME).exists()
    lines = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert [line.split()[1] for line in lines] == [f"{v}:" for v in EMA] and "arch.heads=5" in lines[0], r.stderr

    variants = [*EMA, "exp08/ema0.995"]
    assert stub_programme.submit(variants=variants).returncode == 0
    assert stub_programme.command("skip", "exp08/ema0.995").returncode == 0
    r = stub_programme.command("run", timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    assert stub_programme.states() == {EMA[0]: "completed", EMA[1]: "completed", "exp08/ema0.995": "skipped"}
    bad = stub_programme.env.copy()
    assert stub_programme.command("retry", "exp08/ema0.995").returncode == 0
    stub_programme.env = dict(bad, STUB_BAD="exp08/ema0.995")
    r = stub_programme.command("run", timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    record = load_ledger(json.dumps(stub_programme.ledger()), "ledger.json").variants["exp08/ema0.995"]
    assert record.state == "failed" and record.verdict() == "exp08/ema0.995: the stub's bad input"
    assert stub_programme.command("retry", "nope/x").returncode == 2


# --- end to end: the real trainer on 2 fake single-host slices (v4-8), 1 CPU device each -----------

# Two data-scaling groups: every variant trains the same model (one compile for all) on its own set.
E2E_VARIANTS = ["exp04a/puzzles100", "exp04a/puzzles500", "exp04b/aug10", "exp04b/aug100"]
BAD = "exp04a/puzzles500"  # its dataset was never built: bad input, found on the workers
E2E_STEPS = 16


def e2e_overrides(bucket: Path) -> list[str]:
    """Every variant scaled down to the tests' tiny model; metrics on the workers' own disks (lost
    with a VM), checkpoints in the shared bucket, one directory per experiment; a compilation cache
    of their own in the bucket (the test session's would let a first start hit)."""
    return ["arch=tiny_transformer", "arch.hidden=32", "arch.heads=2", "train.global_batch_size=16",
            f"train.steps={E2E_STEPS}", "train.epochs=null", "train.eval_every_epochs=null",
            "train.checkpoint_every_epochs=null", "train.log_every=1", "train.checkpoint_every=4",
            f"train.eval_every={E2E_STEPS}", "optim.warmup_steps=2", "data.generate_if_missing=false",
            "run.progress_bar=false", "run.wandb.mode=disabled", "run.root=outputs", "mesh=fsdp",
            f"run.checkpoint.dir={bucket}/${{hydra:runtime.choices.experiment}}",
            f"run.compile_cache={bucket}/compile_cache", "distributed.initialization_timeout_s=60"]


@pytest.mark.devices(1)  # this process trains only the uninterrupted reference
def test_the_programme_runs_itself_through_preemptions_and_a_killed_controller(tmp_path, sudoku_dir, monkeypatch):
    seed = int.from_bytes(os.urandom(2), "big")
    rng, seed_note = random.Random(seed), f"(random seed {seed})"
    data, bucket = tmp_path / "data", tmp_path / "bucket"
    data.mkdir()
    for name in ("100-aug-1000", "1000-aug-10", "1000-aug-100"):  # not puzzles500's set
        (data / f"sudoku-extreme-{name}").symlink_to(sudoku_dir)
    # The variants read their sets from gs:// (the emulator), as a spot programme must: a slice re-created
    # after a preemption has empty disks. puzzles500's prefix holds no set: bad input, found on the workers.
    emulator = start_gcs_emulator(tmp_path)
    emulator.apply_env()  # before the programme's environment is made: its workers reach the emulator
    emulator.create_bucket("data")
    from google.cloud import storage

    sets = storage.Client().bucket("data")
    for name in ("100-aug-1000", "1000-aug-10", "1000-aug-100"):
        for f in sorted(p for p in sudoku_dir.rglob("*") if p.is_file()):
            sets.blob(f"sudoku-extreme-{name}/{f.relative_to(sudoku_dir).as_posix()}").upload_from_filename(str(f))
    sets.blob("sudoku-extreme-500-aug-1000/README").upload_from_string("not a dataset")
    programme = FakeProgramme(tmp_path, FAKE_GCLOUD_CREATE_POLLS="4", FAKE_GCLOUD_WORKERS="1")
    make_fake_workers(programme.root, 1, None, image=True)
    overrides = e2e_overrides(bucket)
    try:
        r = programme.submit("--env", "PODRUNNER_DATA=gs://data", "--poll-seconds", "0.2", variants=E2E_VARIANTS,
                             slices=("s1", "s2"), overrides=tuple(overrides), accelerator="v4-8",
                             data_on_every_slice=False)
        assert r.returncode == 0, r.stdout + r.stderr
        controller = programme.start()

        def running_on(slice_name: str) -> str | None:
            return programme.ledger()["slices"][slice_name]["variant"]

        def step_on(slice_name: str) -> int:
            variant = running_on(slice_name)
            rows = programme.root / slice_name / "worker-0" / "repo" / "outputs" / (variant or "-") / "metrics.jsonl"
            return max((row["step"] for row in read_jsonl(rows)), default=0) if rows.exists() else 0

        def tpu_state(slice_name: str) -> str | None:
            with fake_tpu.control(programme.root) as state:
                return state["tpus"].get(slice_name, {}).get("state")

        # 1. a preemption at a random step of the first variant on s1, in its first half: the steps
        # after the signal, until the workers agree where to save, must not reach the run's end
        at = rng.randint(2, E2E_STEPS // 2)
        wait_for(lambda: step_on("s1") >= at, timeout=300, what=f"step {at} on s1 {seed_note}", procs=[controller],
                 every=0.01)
        assert fake_tpu.preempt(programme.root, "s1"), "no trainer on s1"
        # 2. another while the re-created s1 is still CREATING
        wait_for(lambda: tpu_state("s1") == "CREATING", timeout=300, what="s1 re-created", procs=[controller])
        fake_tpu.preempt(programme.root, "s1")
        # 3. one during a checkpoint save on s2: at the trainer's "saving the checkpoint" line (not the last)
        def saving_on_s2() -> bool:
            logs = (programme.root / "s2" / "worker-0" / "podrunner-logs").glob("*/worker-*.log")
            last = [log.read_text().rstrip().rsplit("\n", 1)[-1] for log in logs]
            return any("saving the checkpoint of step" in line and f"step {E2E_STEPS} " not in line for line in last)
        wait_for(saving_on_s2, timeout=300, what=f"a checkpoint save on s2 {seed_note}", procs=[controller],
                 every=0.01)
        assert fake_tpu.preempt(programme.root, "s2"), "no trainer on s2"
        # 4. a trainer killed (SIGKILL: its slice stays READY, the relaunch runs again the steps since its
        # last checkpoint, on the same disk) at a random step of a run; once the controller has recorded
        # that launch, the controller killed too (a launch of the other slice, or the relaunch, left in
        # flight), then started again
        kill_at = rng.randint(1, E2E_STEPS // 2)

        def launches_of(variant: str) -> list[dict]:
            return programme.ledger()["variants"][variant]["supervision"]["launches"]

        def kill_trainer_at_a_logged_step(slice_name: str) -> tuple[str, int] | None:
            """The trainer stopped (SIGSTOP) and looked at: at a step it has logged and accounted for
            (its metrics row and `timing` event), past the step it started from, before the last and
            not a checkpoint's (so steps are lost), it is killed; else it goes on. (variant, launches
            recorded before), or None."""
            with fake_tpu.control(programme.root) as state:  # the trainer of the slice's latest launch (a
                tpu = state["tpus"].get(slice_name, {})  # preempted VM's may still be saving at the same home)
                groups = tpu.get("workers") if tpu.get("state") == "READY" else None
            variant, home = running_on(slice_name), programme.root / slice_name / "worker-0"
            pids = [pid for pid, cmd in fake_tpu.group_members(groups[0]) if fake_tpu.is_trainer(cmd)] if groups else []
            if not variant or len(pids) != 1 or step_on(slice_name) < kill_at:
                return None
            out, recorded = home / "repo" / "outputs" / variant, len(launches_of(variant))
            os.kill(pids[0], signal.SIGSTOP)
            try:
                rows = [r["step"] for r in read_jsonl(out / "metrics.jsonl") if any(k.startswith("train/") for k in r)]
                said = read_jsonl(out / events.FILE)
                started = [e["step"] for e in said if e["event"] == "started"]
                timed = [e["step"] for e in said if e["event"] == "timing"]
                if rows and timed and started and started[-1] < rows[-1] == timed[-1] < E2E_STEPS and rows[-1] % 4:
                    os.kill(pids[0], signal.SIGKILL)
                    return variant, recorded
            except (OSError, ValueError):  # a file not there yet
                pass
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pids[0], signal.SIGCONT)
            return None

        killed, recorded = wait_for(lambda: kill_trainer_at_a_logged_step("s2") or kill_trainer_at_a_logged_step("s1"),
                                    timeout=300, what=f"a trainer at step {kill_at} or later {seed_note}",
                                    procs=[controller], every=0.02)
        wait_for(lambda: len(launches_of(killed)) > recorded, timeout=300, what=f"{killed}'s launch recorded {seed_note}",
                 procs=[controller])
        os.kill(controller.pid, signal.SIGKILL)
        controller.wait()
        restarted = programme.start()
        out = restarted.communicate(timeout=600)[0]
        assert restarted.returncode == 0, out[-6000:]
    finally:
        programme.close()
        emulator.close()

    ledger = programme.ledger()
    states = {v: r["state"] for v, r in ledger["variants"].items()}
    assert states == {v: "failed" if v == BAD else "completed" for v in E2E_VARIANTS}, (states, seed_note)
    book = load_ledger(json.dumps(ledger), "ledger.json")
    assert "not found at gs://data/" in book.variants[BAD].verdict() and book.variants[BAD].failure == "bad input"
    # Each completed variant's metrics (all but wall-clock ones), from beside its checkpoints, equal an
    # uninterrupted run's at every step.
    # Here the variants differ only in their data folder, and every folder links to one set: one
    # uninterrupted run is each one's reference.
    monkeypatch.setenv("PODRUNNER_DATA", str(data))
    reference = tmp_path / "reference"
    train([f"+experiment={E2E_VARIANTS[0]}", *overrides, f"run.root={reference}", f"run.checkpoint.dir={reference}/ckpt"])
    expected = logged_metrics(reference / E2E_VARIANTS[0])
    assert sorted(expected) == list(range(1, E2E_STEPS + 1)) and "eval/exact_accuracy" in expected[E2E_STEPS]
    for variant in E2E_VARIANTS:
        if variant != BAD:
            got = logged_metrics(bucket / variant / "run_files")
            assert got.keys() == expected.keys(), (variant, seed_note)
            for step, metrics in expected.items():  # loss, accuracies, gradient norm, learning rate, eval ...
                assert got[step] == pytest.approx(metrics, rel=1e-5, abs=1e-6), (variant, step, seed_note)
    # The ledger's pod time is the fake's READY time (x hosts).
    billed = fake_tpu.ready_host_seconds(programme.root)
    counted = sum(s["clock"]["host_seconds"] for s in ledger["slices"].values())
    assert counted == pytest.approx(billed, rel=0.01), (counted, billed)
    assert sum(r["host_seconds"] for r in ledger["variants"].values()) <= counted * 1.0001
    assert sum(r["supervision"].get("preemptions", 0) for r in ledger["variants"].values()) >= 2
    # Where the paid time went: each variant's categories add up to its READY time, the measured ones
    # within it; the variants' and the slices' idle time add up to the slices' READY time.
    accounts = programme_account(book)
    assert accounts.total.paid == pytest.approx(billed, rel=0.01)  # 1 host a slice
    assert abs(accounts.unattributed) <= 0.01 * accounts.total.paid, accounts.unattributed
    for variant, spent in accounts.variants.items():
        measured = sum(v for c, v in spent.seconds.items() if c != "other")
        assert sum(spent.seconds.values()) == pytest.approx(spent.paid, rel=0.01), (variant, spent)
        assert min(spent.seconds.values()) >= -0.01 * spent.paid and measured <= spent.paid * 1.01, (variant, spent)
        assert spent.measured is (spent.seconds["train"] > 0) is (variant != BAD), (variant, spent)  # BAD: no account
        # The steps replayed it counted are those its runs logged more than once (every step is logged).
        rows = bucket / variant / "run_files" / "metrics.jsonl"
        steps = Counter(r["step"] for r in read_jsonl(rows) if any(k.startswith("train/") for k in r)) if (
            rows.exists()) else Counter()
        assert spent.replayed == sum(n - 1 for n in steps.values()), (variant, steps, seed_note)
    assert accounts.variants[killed].replayed >= 1, (killed, seed_note)  # the trainer killed past its checkpoint
    # The first compile in the programme missed the (empty) cache; a restart of its variant read it
    # (the event: the cache's own hit and miss counts, not how long the start-up took).
    compiled = [(launch.started, variant, launch) for variant, record in book.variants.items()
                for launch in record.supervision.launches
                if launch.timing and launch.timing.hits + launch.timing.misses]
    started = sorted(compiled, key=lambda item: item[:2])
    assert started[0][2].timing.misses > 0, started[0]
    for variant, record in book.variants.items():
        ran = [launch.timing for launch in record.supervision.launches if launch.timing and launch.timing.steps_run]
        assert all(t.hits > 0 for t in ran[1:]), (variant, ran)  # every restart that ran steps read the cache
    cold = started[0][1]
    ran = [launch.timing for launch in book.variants[cold].supervision.launches
           if launch.timing and launch.timing.steps_run]
    assert len(ran) > 1 and ran[0].misses > 0 and ran[-1].hits > 0 and ran[-1].misses < ran[0].misses, (cold, ran)


def test_a_group_on_one_on_demand_slice_recovers_after_a_preemption(stub_programme, tmp_path):
    """A group's variants on one slice (once `sweep --tpu`): after a preemption the first variant
    resumes on the slice re-created, and the second runs (before: the first failed with 255 and the
    second on a TPU that was gone)."""
    gate = tmp_path / "gate"
    proc = subprocess.Popen(stub_programme.launch("submit", "exp08", "--variants", "ema0.99,off", "--slice", "t1",
                                                  "--zone", ZONE, "--accelerator-type", "v4-16", "--runtime-version",
                                                  "v2-alpha", "--repo-dir", "~/repo", "--poll-seconds", "0.05",
                                                  "--run"),
                            cwd=tmp_path, env=dict(stub_programme.env, STUB_GATE=str(gate)), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stub_programme.started.append(proc)
    home = stub_programme.root / "t1" / "worker-0"
    wait_for(lambda: any(fake_tpu.is_trainer(cmd) for _, cmd in fake_tpu.vm_processes(home)), timeout=60,
             what="the first variant's trainer", procs=[proc])
    assert fake_tpu.preempt(stub_programme.root, "t1")  # the stub dies on SIGTERM: no checkpoint, a hard stop
    gate.touch()
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out[-4000:]
    assert stub_programme.states() == {"exp08/ema0.99": "completed", "exp08/off": "completed"}
    verbs = [c[4] for c in gcloud_calls(tmp_path / "gcloud.jsonl") if c[4] in ("create", "delete")]
    assert verbs == ["create", "delete", "create", "delete"], verbs  # re-created after the preemption; deleted at the end


def test_a_failed_variant_and_a_stopping_controller_raise_an_alert(tmp_path, monkeypatch):
    """wandb.alert (W&B online only): on a variant failed for good, and on a controller that stops
    on a failure. In process, the supervision replaced by its outcome."""
    sub = queue_state.Submission(name=NAME, variants=EMA, slices=["s1"], zone=ZONE, accelerator_type="v4-16",
                                   runtime_version="v", overrides=["++run.wandb.mode=online", "run.wandb.project=p1",
                                                                   "run.wandb.tags=[mine]"])
    # Each run is tagged with the programme's name, beside the user's tags.
    assert list(hydra_compose.composed(sub.overrides_of(EMA[1])).run.wandb.tags) == ["mine", NAME]
    assert not Alerts(sub).online  # no API key here
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    online = Alerts(sub)
    assert online.online and online.wandb.project == "p1"  # as the runs' composed config says, whatever the form
    assert not Alerts(queue_state.Submission(**{**sub.__dict__, "overrides": []})).online  # offline
    state = queue_state.State(tmp_path / NAME)
    state.create(sub)
    alerts: list[tuple[str, str]] = []
    controller = Controller(state, alert=lambda title, text: alerts.append((title, text)))

    def fails_for_good(self) -> int:
        self.sup.record.launches.append(LaunchRecord(started=0.0, ended=1.0, code=2, outcome=Outcome.FATAL,
                                                     cause="bad input", line="error: bad data"))
        return self.finish(Status.FAILED, 2, line="error: bad data", cause="'bad input'")
    monkeypatch.setattr(supervise.Supervisor, "run", fails_for_good)
    assert controller.take("s1") == EMA[0]
    controller.run_variant(EMA[0], "s1")
    assert alerts == [(f"{NAME}: {EMA[0]} failed", "error: bad data")]
    assert state.ledger.variants[EMA[0]].state == "failed"
    controller.halt(Stop("the same infrastructure failure ended 3 variants in a row (quota: q)", 1))
    assert controller.finish() == 1 and alerts[-1][0] == f"{NAME}: the controller stopped"


def test_cheapest_order_and_programme_stop(stub_programme, tmp_path):
    """--order cheapest queues by planned pod-hours; `programme stop` while a variant runs stops
    its workers (through the launch's stop: SIGTERM, so a real trainer checkpoints) and ends the
    controller with exit 0 and one line; the variant is queued again and the next `programme run`
    carries it and the rest to the end."""
    plan_csv = write_plan(tmp_path / "plan.csv", {EMA[0]: 2.0, EMA[1]: 0.5}, executables=str(tmp_path / "exe"))
    r = stub_programme.submit("--plan", str(plan_csv), "--order", "cheapest")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    assert list(stub_programme.ledger()["variants"]) == [EMA[1], EMA[0]]
    submitted = json.loads((stub_programme.state_dir / NAME / "programme.json").read_text())
    assert f"run.executables={tmp_path / 'exe'}" in submitted["overrides"]  # the runs read what the plan priced
    gate = tmp_path / "gate"
    controller = stub_programme.start(STUB_GATE=str(gate))
    progress = lambda: stub_programme.ledger()["variants"][EMA[1]]["supervision"].get("launch") or {}  # noqa: E731
    wait_for(lambda: progress().get("last_step") == 5, timeout=60, what="the checkpoint of step 5", procs=[controller])
    assert stub_programme.command("stop").returncode == 0
    out = controller.communicate(timeout=120)[0]
    assert controller.returncode == 0, out[-3000:]
    assert "stopped by `programme stop`" in out, out[-3000:]
    assert stub_programme.states() == {EMA[1]: "queued", EMA[0]: "queued"}, out[-3000:]
    trainers = [pid for home in stub_programme.root.glob("*/worker-*") for pid, cmd in fake_tpu.vm_processes(home)
                if fake_tpu.is_trainer(cmd)]
    assert not trainers  # nothing left running on the workers
    gate.touch()
    r = stub_programme.command("run", timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    assert stub_programme.states() == {EMA[1]: "completed", EMA[0]: "completed"}


def test_a_variant_whose_run_is_complete_is_never_launched(tmp_path, monkeypatch):
    """Complete means its `completed` event beside its checkpoints, or, with the event lost (the
    run stopped right after its last commit), its newest committed checkpoint at the run's total
    (from the run's `started` event, else the config's or the plan's steps). In process; a
    launch would fail the test."""
    ckpt = tmp_path / "ckpt"
    sub = queue_state.Submission(name=NAME, variants=EMA, slices=["s1"], zone=ZONE, accelerator_type="v4-8",
                                   runtime_version="v", checkpoint_dirs={v: str(ckpt / v) for v in EMA},
                                   total_steps={EMA[1]: 10})
    state = queue_state.State(tmp_path / NAME)
    state.create(sub)
    controller = Controller(state, alert=lambda title, text: None)
    assert controller.already_complete(EMA[0]) is None  # nothing there yet

    def save(variant: str, step: int) -> None:
        saved = Checkpoints(str(ckpt / variant), keep=3, async_save=False)
        meta = {"step": step, "metrics": {"eval/exact_accuracy": step / 100}}
        saved.save(step, {"w": jnp.full(2, float(step))}, meta)
        saved.wait()
        saved.close()

    events_dir = Path(sub.events_file(EMA[0])).parent  # where the run's events are copied
    events_dir.mkdir(parents=True)
    events.attach(str(events_dir), process=0)
    try:
        events.emit("started", run_id="r", step=0, total=8, resumed=False)
        save(EMA[0], 4)
        assert controller.already_complete(EMA[0]) is None  # 4 of 8
        save(EMA[0], 8)
        assert controller.already_complete(EMA[0])["step"] == 8  # no completed event: the checkpoint at the total
        events.emit("completed", step=8, metrics={"eval/exact_accuracy": 0.5})
    finally:
        events.detach()
    assert controller.already_complete(EMA[0])["metrics"] == {"eval/exact_accuracy": 0.5}
    save(EMA[1], 10)  # no events at all: the total known before the run (config or plan)
    assert controller.already_complete(EMA[1])["metrics"] == {"eval/exact_accuracy": 0.1}

    monkeypatch.setattr(supervise.Supervisor, "run", lambda self: pytest.fail("a complete run was launched"))
    for variant in EMA:
        assert controller.take("s1") == variant
        controller.run_variant(variant, "s1")
    record = state.ledger.variants
    assert [(record[v].state, record[v].said("last_step")) for v in EMA] == [("completed", 8), ("completed", 10)]
    assert record[EMA[1]].metrics == {"eval/exact_accuracy": 0.1}


def test_status_table_totals_eta_and_page(tmp_path):
    """`programme status` from a ledger: a row per variant, totals per group and for the programme,
    the ETA (a running variant at its own measured pace; a queued one at its plan, scaled by how
    the measured variants compare with theirs; shared over the slices), failures' lines, the page.
    (Goodput from the launches' accounts: tests/test_account.py; these have none.)"""
    done, running, queued, bad = "exp08/ema0.99", "exp08/off", "exp08/ema0.995", "exp04a/puzzles100"
    sub = queue_state.Submission(name=NAME, variants=[done, running, queued, bad], slices=["s1", "s2"], zone=ZONE,
                                   accelerator_type="v4-8", runtime_version="v",
                                   planned={v: {"pod_hours": h, "steps": 100}
                                            for v, h in ((done, 0.5), (running, 1.0), (queued, 2.0), (bad, 0.25))})
    state = queue_state.State(tmp_path / NAME)
    state.create(sub)
    now = 1_000_000.0
    v = state.ledger.variants
    primary = queue_status.primary_of("exp08")
    v[done].__dict__.update(state="completed", attempts=1, ready_seconds=3600.0, metrics={primary: 0.75},
                            supervision=SupervisionRecord(launches=[LaunchRecord(0.0, 1.0, 0, Outcome.COMPLETED,
                                                                                 "completed", last_step=100, total=100,
                                                                                 wandb_run_id="w1")]))
    v[running].__dict__.update(state="running", attempts=2, slice="s1", ready_seconds=0.0, mark=Mark(3600.0, 3600.0),
                               supervision=SupervisionRecord(preemptions=1, restarts=0,
                                                             launch=InFlight(started=0.0, last_step=50, total=100)))
    state.ledger.slices["s1"].__dict__.update(variant=running, clock=ReadyClock(  # done ran there first
        ready_since=now - 1800, hosts=1, ready_seconds=3600.0, host_seconds=3600.0))
    v[bad].__dict__.update(state="failed", attempts=1, line="exp04a/puzzles100: dataset not found")

    out = queue_status.text(sub, state.ledger, now=now)
    cells = {c[0]: c[1:] for c in (re.split(r"\s{2,}", line.strip()) for line in out.splitlines()) if len(c) > 2}
    assert cells[done] == ["completed", "1", "0", "0", "1.000/0.500", "100/100", "-", "-", f"{primary}=0.75", "w1"]
    assert cells[running] == ["running", "2", "1", "0", "0.500/1.000", "50/100", "-", "-", f"{primary}=-", "-"]
    assert cells[queued] == ["queued", "0", "0", "0", "0.000/2.000", "-/100", "-", "-", f"{primary}=-", "-"]
    assert cells["exp08 total"] == ["1 completed, 1 running, 1 queued", "1.500/3.500", "-", "-"]
    assert cells["programme total"] == ["1 completed, 1 running, 1 queued, 1 failed", "1.500/3.750", "-", "-"]
    # ETA: running 0.5 h more at its pace (0.5 h for 50 steps); queued 2.0 h x 1.5 (measured 1.5 h
    # where the plans said 1.0 for the same work); over 2 slices
    assert "ETA 1.75 h" in out, out
    assert out.rstrip().endswith("exp04a/puzzles100: exp04a/puzzles100: dataset not found")
    del sub.planned[queued]
    assert "ETA unknown" in queue_status.text(sub, state.ledger, now=now)
    page = queue_status.page(sub, state.ledger)
    assert page.count("<tr class='completed'>") == 1 and page.count("<img alt=") == 2
    assert "<li>exp04a/puzzles100: exp04a/puzzles100: dataset not found</li>" in page
