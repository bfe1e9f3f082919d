"""Hardening, round four (issue 39), items 8-10: what `programme stop` says and does with the slices,
the ledger's account of slice time, and a spot programme whose data would not reach a re-created slice.

Each class with members beside the instance the issue found:
  8.  a stop says what it kept and lost: the steps a variant lost when the grace ran out, the one that
      saved; the slices left READY and what they cost an hour, or their release (`--release` / `--keep`,
      refused where deleting the slices would delete the checkpoints); a queued resource deleted with
      its node (`supervise --at-end delete`, a programme's slice given back);
  9.  a stop is not a preemption; the ledger's slice time is the control plane's READY time x hosts
      (after a stop, and short of it by at most one poll interval per creation, docs/BILL.md); each
      variant's `completed` line carries its own charge;
  10. a spot programme whose inputs (a dataset, a task of a multi-task set, imported parameters) are on
      the workers' disks is refused at submit in one line, naming the fix; on gs://, or declared on
      every slice, it goes ahead.

Programmes and supervisors against the fake TPU control plane (tests/fake_gcloud) with stub trainers.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.launcher import queue_state, supervise
from experiments.launcher.account import programme_account
from experiments.launcher.controller import Controller, Stop, VariantSupervision
from experiments.launcher.gcloud import OWNER_LABEL, Shape, Target, create_argv, owner_label, queued_create_argv
from experiments.launcher.ledger import Command, ReadyClock, Status, Verb, load_ledger
from helpers import (LAUNCH, FakeProgramme, error_line, fake_plane, gcloud_calls, launch_in_process, make_fake_workers,
                     wait_for)

sys.path.insert(0, str(Path(__file__).resolve().parent / "fake_gcloud"))
import fake_tpu

NAME, ZONE = "prog", "us-central2-b"
SAVES, KILLED = "exp08/off", "exp08/ema0.99"  # on SIGTERM: saves its step (as the trainer does) / outlasts the grace

# A trainer at step 27 whose checkpoint of step 20 has committed (an async save reports its commit
# later). On SIGTERM, SAVES checkpoints step 27 and exits as preempted, as the real trainer does;
# KILLED goes on past any grace (a save that takes longer), so the stop's SIGKILL ends it.
STOP_STUB = """\\
import os, signal, sys, time
from runtime import events
variant = next(a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("+experiment="))
def saved(*_):
    events.emit("checkpoint", step=27)
    events.emit("preempted", step=27, noticed=time.time())
    sys.exit(8)
signal.signal(signal.SIGTERM, (lambda *_: None) if variant == os.environ["STUB_KILLED"] else saved)
events.emit("started", run_id=os.environ["PODRUNNER_RUN_ID"], step=0, total=40, resumed=False)
events.emit("timing", step=27, steps_run=27, saves=1, seconds={"train": 1.0}, wall=1.0, time=time.time())
events.emit("checkpoint", step=20)
while True:
    time.sleep(0.05)
"""

QUICK_STUB = """\\
import os
from runtime import events
events.emit("started", run_id=os.environ["PODRUNNER_RUN_ID"], step=0, total=10, resumed=False)
events.emit("checkpoint", step=10)
events.emit("completed", step=10, metrics={"eval/exact_accuracy": 0.25})
"""


class Programme(FakeProgramme):
    """tests/helpers.py's programme, its workers running `stub`, submitted with a grace of 1 s."""

    def __init__(self, tmp_path: Path, stub: str, **env: str) -> None:
        super().__init__(tmp_path, **env)
        make_fake_workers(self.root, 2, stub, image=True)

    def argv(self, verb: str, *args: str) -> list[str]:
        return self.launch(verb, *args)[2:]

    def submit(self, *args: str, variants: tuple[str, ...], slices: tuple[str, ...], poll: str = "0.05"):
        r = super().submit("--poll-seconds", poll, "--stop-grace", "1", *args, variants=variants, slices=slices)
        assert r.returncode == 0, r.stdout + r.stderr
        return r


def describe_seconds(env: dict[str, str]) -> float:
    """How long one describe of the fake control plane takes here (the poll bound's second part)."""
    took = []
    for _ in range(3):
        t0 = time.monotonic()
        subprocess.run(["gcloud", "compute", "tpus", "tpu-vm", "describe", "nothere", "--zone", ZONE,
                        "--format=json"], env=env, capture_output=True)
        took.append(time.monotonic() - t0)
    return max(took)


def host_seconds(ledger: dict, now: float) -> float:
    book = load_ledger(json.dumps(ledger), "ledger.json")
    return sum(s.clock.host_total(now) for s in book.slices.values())


# --- 8 and 9: programme stop ---------------------------------------------------------------------

@pytest.mark.slow
def test_a_stop_says_what_each_variant_lost_and_what_the_kept_slices_cost(tmp_path):
    """Two variants on two slices, `programme stop` with a grace of 1 s: the one that saved says so, the
    one SIGKILLed says it lost 7 steps (step 27 reached, last checkpoint 20); neither counts as a
    preemption; the slices kept READY are named with their cost an hour; and the ledger, read later,
    holds every second they were READY (x hosts) since they were created."""
    programme = Programme(tmp_path, STOP_STUB)
    try:
        programme.submit(variants=(KILLED, SAVES), slices=("s1", "s2"))
        controller = programme.start(STUB_KILLED=KILLED)
        launch = lambda v: programme.ledger()["variants"][v]["supervision"].get("launch") or {}  # noqa: E731
        wait_for(lambda: all(launch(v).get("last_step") == 27 for v in (KILLED, SAVES)), timeout=120,
                 what="both variants at step 27, their checkpoint of step 20 committed", procs=[controller])
        asked = launch_in_process(programme.argv("stop"), env=programme.env, cwd=tmp_path)
        assert asked.returncode == 0, asked.stdout + asked.stderr
        assert "the slices s1, s2 are kept READY, billing 2 pod-hours an hour (v4-16 each)" in asked.stdout, asked.stdout
        out = controller.communicate(timeout=120)[0]
    finally:
        programme.close()
    assert controller.returncode == 0, out[-3000:]
    for bad in ("Traceback", "error:", "checkpointed"):
        assert bad not in out, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("stopped by `programme stop`")]
    assert len(lines) == 1, out[-3000:]
    assert f"{KILLED} lost 7 steps (it reached step 27, its last checkpoint is step 20: the --stop-grace of 1 s" in lines[0]
    assert f"{SAVES} stopped at its checkpoint of step 27" in lines[0]
    assert "kept READY, billing 2 pod-hours (4 host-hours) an hour until deleted: s1, s2" in lines[0], lines[0]
    ledger = programme.ledger()
    for variant in (KILLED, SAVES):
        record = ledger["variants"][variant]
        last = record["supervision"]["launches"][-1]
        assert record["state"] == "queued" and record["supervision"]["preemptions"] == 0, record
        assert (last["outcome"], last["cause"]) == ("stopped", "stopped: asked to"), last
    assert ledger["variants"][KILLED]["supervision"]["launches"][-1]["saved_step"] == 20
    status = launch_in_process(programme.argv("status"), env=programme.env, cwd=tmp_path)
    assert "READY with nothing running, billing 2 pod-hours an hour: s1, s2" in status.stdout, status.stdout
    # The slices bill on; the ledger counts them, read at any later moment, as the control plane does.
    later = time.time() + 3600
    billed, counted = fake_tpu.ready_host_seconds(programme.root, later), host_seconds(ledger, later)
    bound = 2 * 2 * (0.05 + describe_seconds(programme.env))  # a poll interval per creation, x hosts
    assert abs(counted - billed) <= bound, (counted, billed, bound)
    idle = programme_account(load_ledger(json.dumps(ledger), "ledger.json"), later).idle
    assert min(idle.values()) > 3000, idle  # the kept slices' hour is idle time, not the variants'


def submitted(tmp_path: Path, **fields) -> queue_state.State:
    sub = queue_state.Submission(**{"name": NAME, "variants": [KILLED, SAVES], "slices": ["s1"], "zone": ZONE,
                                    "accelerator_type": "v4-16", "runtime_version": "v", **fields})
    state = queue_state.State(tmp_path / NAME)
    state.create(sub)
    return state


def test_stop_release_where_checkpoints_are_on_the_workers_disks_is_refused(tmp_path):
    """--release would delete the checkpoints with the slices: one line, exit 2, no request left,
    the state's files as they were; --keep and the default (keep, here) are asked."""
    state = submitted(tmp_path, checkpoint_dirs={KILLED: "outputs/a/ckpt", SAVES: "gs://b/ckpt"})
    before = {p: p.read_bytes() for p in (tmp_path / NAME).rglob("*") if p.is_file()}
    r = launch_in_process(["programme", "stop", NAME, "--state-dir", str(tmp_path), "--release"])
    assert r.returncode == 2, r.stdout + r.stderr
    error_line(r.stderr, "--release would delete the slices and with them the checkpoints on their disks",
               f"{KILLED}: outputs/a/ckpt", "run.checkpoint.dir=gs://", last=True)
    assert {p: p.read_bytes() for p in (tmp_path / NAME).rglob("*") if p.is_file()} == before
    for args in ((), ("--keep",)):
        r = launch_in_process(["programme", "stop", NAME, "--state-dir", str(tmp_path), *args])
        assert r.returncode == 0 and "the slices s1 are kept READY, billing 1 pod-hour an hour" in r.stdout, r
    assert [c.release for c in state.commands()] == [False, False]  # the default, as the line said it
    on_gs = submitted(tmp_path / "gs", checkpoint_dirs={KILLED: "gs://b/a", SAVES: "gs://b/b"})
    r = launch_in_process(["programme", "stop", NAME, "--state-dir", str(tmp_path / "gs")])
    assert r.returncode == 0 and "the slices s1 are deleted after it (the checkpoints are on gs://)" in r.stdout, r
    assert [c.release for c in on_gs.commands()] == [True]  # the default there: the spending stops


def test_a_stop_releases_a_queued_slice_with_its_queued_resource(tmp_path, monkeypatch):
    """Checkpoints on gs://: a stop releases the slices by default; a queued slice's release deletes its
    queued resource (with --force, its node with it), so nothing is left queued to make a node later;
    the line says so, and the slice's clock closes at the delete."""
    root, env = fake_plane(tmp_path)
    for key in ("PATH", "FAKE_GCLOUD_ROOT", "FAKE_GCLOUD_LOG", "FAKE_GCLOUD_WORKERS"):
        monkeypatch.setenv(key, env[key])
    fake_tpu.enable(root, {"s1": {"state": "READY", "labels": {OWNER_LABEL: owner_label(f"programme-{NAME}")}}})
    with fake_tpu.control(root) as plane:
        plane["queued"]["s1-qr"] = {"state": "ACTIVE", "node": "s1", "describes": 0, "accelerator": "v4-16",
                                    "spot": True}
    state = submitted(tmp_path, queued=True, checkpoint_dirs={KILLED: "gs://b/a", SAVES: "gs://b/b"})
    state.ledger.slices["s1"].clock = ReadyClock(ready_since=time.time(), hosts=2)
    controller = Controller(state, alert=lambda title, text: None)
    controller.apply(Command(id="1", verb=Verb.STOP))
    controller.slice_worker("s1")
    assert controller.finish() == 0
    with fake_tpu.control(root) as plane:
        assert plane["queued"] == {} and plane["tpus"] == {}, plane
    assert ["queued-resources", "delete", "s1-qr"] == next(
        c[3:6] for c in gcloud_calls(tmp_path / "gcloud.jsonl") if c[4] == "delete"), "the queued resource first"
    assert state.ledger.slices["s1"].clock.ready_since is None
    assert "its slices were deleted" in state.ledger.controller.line, state.ledger.controller.line


@pytest.mark.slow
def test_supervise_at_end_delete_leaves_no_queued_resource(tmp_path):
    """`supervise --queued-resource Q --at-end delete`: the run completes, and the queued resource goes
    with its node (before: the node was deleted, the queued resource left SUSPENDED)."""
    root, env = fake_plane(tmp_path)
    make_fake_workers(root, 2, QUICK_STUB, image=True)
    r = subprocess.run([sys.executable, str(LAUNCH), "supervise", "--tpu", "t1", "--zone", ZONE, "--run-id", "r1",
                        "--accelerator-type", "v4-16", "--runtime-version", "v2", "--spot", "--repo-dir", "~/repo",
                        "--log-dir", str(tmp_path / "logs"), "--poll-seconds", "0.05", "--queued-resource", "q1",
                        "--at-end", "delete", "--", "+experiment=exp08/off"], cwd=tmp_path, env=env,
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    with fake_tpu.control(root) as plane:
        assert plane["queued"] == {} and plane["tpus"] == {}, plane
    record = json.loads((tmp_path / "logs" / "r1" / "supervision.json").read_text())
    assert record["slice"]["ready_since"] is None  # its clock closed at the delete
    billed = fake_tpu.ready_host_seconds(root)
    assert abs(record["slice"]["host_seconds"] - billed) <= 2 * (0.05 + describe_seconds(env)), (record, billed)


# A trainer that has saved step 5 and goes on until $STUB_GO exists, then completes.
WAITING_STUB = """\\
import os, time
from runtime import events
events.emit("started", run_id=os.environ["PODRUNNER_RUN_ID"], step=0, total=10, resumed=False)
events.emit("checkpoint", step=5)
while not os.path.exists(os.environ["STUB_GO"]):
    time.sleep(0.05)
events.emit("checkpoint", step=10)
events.emit("completed", step=10, metrics={"eval/exact_accuracy": 0.25})
"""


@pytest.mark.slow
def test_a_programmes_release_leaves_another_programmes_slice_alone(tmp_path, monkeypatch):
    """Two programmes name the slice s1; the first made it (labelled its own) and runs a variant there.
    The second's end (a stop that releases its slices) leaves s1 alone, in one line naming whose it is
    (before: it deleted s1 under the first's run); the first runs on to completion, one launch, no
    preemption, and its own end deletes s1."""
    programme = Programme(tmp_path, WAITING_STUB)
    go = tmp_path / "go"
    try:
        programme.submit(variants=(SAVES,), slices=("s1",))
        controller = programme.start(STUB_GO=str(go))
        launch = lambda: programme.ledger()["variants"][SAVES]["supervision"].get("launch") or {}  # noqa: E731
        wait_for(lambda: launch().get("last_step") == 5, timeout=120, what="the first programme's run at step 5",
                 procs=[controller])
        for key in ("PATH", "FAKE_GCLOUD_ROOT", "FAKE_GCLOUD_LOG", "FAKE_GCLOUD_WORKERS"):
            monkeypatch.setenv(key, programme.env[key])
        second = queue_state.State(tmp_path / "second", io.StringIO())
        second.create(queue_state.Submission(name="second", variants=[KILLED], slices=["s1"], zone=ZONE,
                                             accelerator_type="v4-16", runtime_version="v",
                                             checkpoint_dirs={KILLED: "gs://b/a"}))
        other = Controller(second, alert=lambda title, text: None)
        other.apply(Command(id="1", verb=Verb.STOP))  # checkpoints on gs://: its slices are released
        other.slice_worker("s1")
        assert other.finish() == 0
        with fake_tpu.control(programme.root) as plane:
            assert plane["tpus"]["s1"]["state"] == "READY", plane["tpus"]
            assert plane["tpus"]["s1"]["labels"] == {OWNER_LABEL: f"programme-{NAME}"}
        said = [line for line in (second.dir / "controller.log").read_text().splitlines() if "tpu-" in line]
        assert len(said) == 1 and f"tpu-left-alone slice=s1 tpu=s1 owner=programme-{NAME}" in said[0], said
        go.touch()
        out = controller.communicate(timeout=120)[0]
    finally:
        programme.close()
    assert controller.returncode == 0 and "Traceback" not in out and "error:" not in out, out[-3000:]
    record = programme.ledger()["variants"][SAVES]
    assert record["state"] == "completed", record
    assert len(record["supervision"]["launches"]) == 1 and record["supervision"]["preemptions"] == 0, record
    with fake_tpu.control(programme.root) as plane:
        assert plane["tpus"] == {}, plane  # the first's own end deleted its slice


def test_the_owner_label_is_a_gce_label_value_and_two_owners_never_share_one():
    """Lowercase letters, digits, _ and -, a letter first, 63 at most; a name that had to change (case,
    dots, slashes, a digit first, too long) ends in a hash of it, so names alike once changed differ."""
    names = ["programme-exp08", "programme-Exp08", "programme-a.b", "programme-a/b", "programme-a-b", "7up",
             "programme-" + "x" * 100, "programme-" + "x" * 101, ""]
    labels = [owner_label(n) for n in names]
    assert all(re.fullmatch(r"[a-z][a-z0-9_-]{0,62}", label) for label in labels), labels
    assert len(set(labels)) == len(names), labels
    assert labels[0] == "programme-exp08" and labels[4] == "programme-a-b"  # already valid: as they are
    flag = f"--labels={OWNER_LABEL}={labels[1]}"
    shape = Shape("v4-16", "v", "spot", "s1-qr", owner="programme-Exp08")
    assert flag in create_argv(Target("s1", ZONE), shape) and flag in queued_create_argv(Target("s1", ZONE), shape)
    assert not any(a.startswith("--labels") for a in create_argv(Target("s1", ZONE), Shape("v4-16", "v")))



def owned_slice(tmp_path: Path, state: str, label: str | None, owner: str | None):
    """A supervisor of slice s1 (for `owner`: a programme's, None: a single `supervise`) whose gcloud
    describes s1 in `state`, labelled with `label`'s owner value; the gcloud calls it makes, its log."""
    calls: list[list[str]] = []

    def run(argv: list[str]) -> tuple[int, str]:
        calls.append(argv)
        labels = {OWNER_LABEL: owner_label(label)} if label else {}
        described = {"state": state, "networkEndpoints": [{}], "labels": labels}
        return 0, json.dumps(described) if "describe" in argv else ""

    spec = supervise.Spec(Target("s1", ZONE), "run-s1", [], accelerator_type="v4-16", runtime_version="v",
                          log_dir=tmp_path, owner=owner)
    stream = io.StringIO()
    return supervise.Supervisor(spec, supervise.FileSupervision(spec, stream), ReadyClock(), run=run), calls, stream


@pytest.mark.parametrize("label, acts", [("programme-first", []), ("programme-second", ["delete", "create"])])
def test_a_preempted_slice_another_programme_labelled_is_waited_for_not_deleted(tmp_path, label, acts):
    """The second programme's supervisor finds the first's slice PREEMPTED: it waits (the owner re-creates
    it) rather than delete it and create it under its own label; its own preempted slice it re-creates."""
    supervisor, calls, stream = owned_slice(tmp_path, "PREEMPTED", label, "programme-second")
    state, _, owner = supervise.tpu_state(supervisor.spec, supervisor.run_gcloud)
    assert supervisor.step_towards_ready(state, owner) is None
    assert [argv[4] for argv in calls if "describe" not in argv] == acts, calls
    if not acts:
        assert f"waiting tpu_state=PREEMPTED owner={owner_label(label)}" in stream.getvalue(), stream.getvalue()


@pytest.mark.parametrize("label, owner, deleted", [
    ("programme-first", None, False),  # `supervise --at-end delete` on a TPU a programme made: left alone
    (None, None, True),  # ... on the unlabelled TPU the user named: deleted (docs/RUNNING.md)
    (None, "programme-second", False),  # a programme's release of a slice it did not make: left alone
    ("programme-second", "programme-second", True)])  # ... of its own: deleted
def test_only_a_slices_own_supervisor_deletes_it(tmp_path, label, owner, deleted):
    supervisor, calls, stream = owned_slice(tmp_path, "READY", label, owner)
    supervisor.delete_slice()
    assert any("delete" in argv for argv in calls) is deleted, calls
    assert ("tpu-left-alone" in stream.getvalue()) is not deleted, stream.getvalue()


@pytest.mark.parametrize("label, deleted", [("programme-first", False), ("programme-second", True)])
def test_a_queued_resource_still_waiting_is_deleted_only_by_its_owner(tmp_path, label, deleted):
    """No node yet (its describe NOT_FOUND): the queued resource's node spec carries the label."""
    calls: list[list[str]] = []

    def run(argv: list[str]) -> tuple[int, str]:
        calls.append(argv)
        if argv[3:5] == ["tpu-vm", "describe"]:
            return 1, "ERROR: (gcloud.compute.tpus.tpu-vm.describe) NOT_FOUND: Resource 's1' was not found"
        node = {"labels": {OWNER_LABEL: owner_label(label)}}
        return 0, json.dumps({"state": {"state": "WAITING_FOR_RESOURCES"}, "tpu": {"nodeSpec": [{"node": node}]}})

    spec = supervise.Spec(Target("s1", ZONE), "run-s1", [], queued_resource="s1-qr", log_dir=tmp_path,
                          owner="programme-second")
    stream = io.StringIO()
    supervise.Supervisor(spec, supervise.FileSupervision(spec, stream), ReadyClock(), run=run).delete_slice()
    assert any(argv[3:5] == ["queued-resources", "delete"] for argv in calls) is deleted, calls
    assert ("tpu-left-alone" in stream.getvalue()) is not deleted, stream.getvalue()

# --- 9: the ledger's slice time ------------------------------------------------------------------

@pytest.mark.slow
def test_two_short_variants_on_a_queued_slice_are_billed_within_one_poll_interval(tmp_path):
    """A queued slice that waits in the queue (the waits grow there) runs two short variants: its ledger
    time is the control plane's READY time x hosts, short by at most one poll interval (the describe
    round of the creation, docs/BILL.md); before, by the grown wait at the moment the queue let it go."""
    poll = 0.3
    programme = Programme(tmp_path, QUICK_STUB, FAKE_GCLOUD_QUEUE_POLLS="3")
    try:
        programme.submit("--queued", variants=(KILLED, SAVES), slices=("s1",), poll=str(poll))
        r = subprocess.run([sys.executable, str(LAUNCH), *programme.argv("run")], cwd=tmp_path, env=programme.env,
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180)
    finally:
        programme.close()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    ledger = programme.ledger()
    assert {v: rec["state"] for v, rec in ledger["variants"].items()} == {KILLED: "completed", SAVES: "completed"}
    billed, counted = fake_tpu.ready_host_seconds(programme.root), host_seconds(ledger, time.time())
    bound = 2 * (poll + 2 * describe_seconds(programme.env))  # one creation, 2 hosts
    assert abs(billed - counted) <= bound, (billed, counted, bound)
    with fake_tpu.control(programme.root) as plane:
        assert plane["queued"] == {} and plane["tpus"] == {}  # nothing left for the slice: released, queue and all


def test_a_variants_completed_line_carries_its_own_charge(tmp_path):
    """Not the slice's cumulative host-hours: a variant that took the slice after 4 host-hours of others
    and ran 1 host-hour says host_hours=1.000 (before: 5.000)."""
    state = submitted(tmp_path)
    state.ledger.slices["s1"].clock = ReadyClock(hosts=2, ready_seconds=2 * 3600, host_seconds=4 * 3600)
    controller = Controller(state, alert=lambda title, text: None)
    assert controller.take("s1") == KILLED
    state.ledger.slices["s1"].clock.host_seconds += 3600
    sup = VariantSupervision(state, KILLED, "s1")
    try:
        supervisor = supervise.Supervisor(state.sub.spec(KILLED, "s1", state.dir), sup, controller.clock("s1"),
                                          owns_slice=False, report=lambda line: None)
        supervisor.finish(Status.COMPLETED, 0)
    finally:
        sup.stream.close()
    said = [line for line in (state.dir / "controller.log").read_text().splitlines() if " completed " in line]
    assert len(said) == 1 and "host_hours=1.000" in said[0], said


# --- 10: a spot programme's inputs on the workers' disks -----------------------------------------

def test_a_spot_programme_with_data_on_the_workers_disks_is_refused_at_submit(tmp_path):
    """One line naming the fix, exit 2, no state written; on demand (no re-created slice with empty
    disks by a preemption of its own) it is submitted."""
    argv = ["programme", "submit", NAME, "exp08", "--variants", f"{KILLED},{SAVES}", "--slice", "s1", "--zone", ZONE,
            "--accelerator-type", "v4-8", "--runtime-version", "v", "--state-dir", str(tmp_path / "p")]
    r = launch_in_process([*argv, "--spot"])
    assert r.returncode == 2, r.stdout + r.stderr
    error_line(r.stderr, f"{KILLED}: data.path=", "is on the workers' disks (and 1 more variants read theirs there)",
               "a spot slice re-created after a preemption has fresh, empty disks", "PODRUNNER_DATA=gs://",
               "--data-on-every-slice", last=True)
    assert not (tmp_path / "p").exists()
    assert launch_in_process(argv).returncode == 0


@pytest.mark.parametrize("overrides, key", [
    (["+experiment=contrib06/sudoku_maze"], "data.tasks."),  # each task of a multi-task set
    (["+experiment=exp08/off", "train.init_params_from=params/imported"], "train.init_params_from=params/imported"),
])
def test_every_input_on_the_workers_disks_is_named(overrides, key, monkeypatch):
    """The class: every input a run reads (a multi-task set's tasks, imported parameters), not only
    data.path; on gs:// (here: found there) or declared on every slice, none is refused."""
    monkeypatch.setattr(queue_state, "_exists", lambda url: True)
    variant = overrides[0].split("=", 1)[1]
    extra = [o for o in overrides[1:]]
    sub = queue_state.Submission(name=NAME, variants=[variant], slices=["s1"], zone=ZONE, accelerator_type="v4-8",
                                 runtime_version="v", tier="spot", overrides=extra)
    problems = queue_state.preflight(sub)
    assert len(problems) == 1 and key in problems[0] and "workers' disks" in problems[0], problems
    remote = [o.replace("=params/", "=gs://b/params/") for o in extra]
    sub = queue_state.Submission(**{**sub.__dict__, "overrides": remote, "env": {"PODRUNNER_DATA": "gs://b/data"}})
    assert queue_state.preflight(sub) == []
    sub = queue_state.Submission(**{**sub.__dict__, "overrides": extra, "env": {}, "data_on_every_slice": True})
    assert queue_state.preflight(sub) == []


@pytest.mark.parametrize("why, code", [("interrupted; run it again to carry on", 130),
                                       ("the same infrastructure failure ended 3 variants in a row (quota: q)", 1)])
def test_every_stop_names_the_slices_it_leaves_billing(tmp_path, why, code):
    """Ctrl-C and a repeated failure keep the slices (a stop asked for may release them): their line
    names each slice left READY and what it costs an hour, and claims no checkpoint (before: "the
    running variants checkpointed", whether they had or not)."""
    state = submitted(tmp_path, slices=["s1", "s2"])
    state.ledger.slices["s1"].clock = ReadyClock(ready_since=time.time(), hosts=4)
    controller = Controller(state, alert=lambda title, text: None)
    controller.halt(Stop(why, code))
    assert controller.finish() == code
    line = state.ledger.controller.line
    assert line.startswith(why) and "checkpointed" not in line, line
    assert "; kept READY, billing 1 pod-hour (4 host-hours) an hour until deleted: s1 (" in line, line  # s2: not READY
