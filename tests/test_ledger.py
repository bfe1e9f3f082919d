"""The launcher's typed records (experiments/launcher/ledger.py), in process: a ledger written before
they were typed is read, shown and carried on; a file of the wrong shape is one line; the
variant state table and the failure classes are the documented ones; slice threads changing
their records while saves run never tear a save; the mirror holds one consistent snapshot, and
`programme stop` reaches a controller on another machine through it.

tests/data/programme-v1/ is a programme's state as the code before the records were typed
(commit 706b599) wrote it: test_run_queue.py's budget test, stopped by its budget with one
variant completed and one queued (its programme.json's mirror, a temporary folder, set to null).
"""

from __future__ import annotations

import copy
import io
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from experiments.launch import main as launch
from experiments.launcher import ledger, queue_state, supervise
from experiments.launcher.controller import Controller, Stop, VariantSupervision
from experiments.launcher.ledger import (TRANSITIONS, IllegalTransition, LaunchRecord, Move, Outcome, RecordError,
                                         Status, VariantRecord, VariantState, load_ledger, move)
from runtime import distributed, events, wire
from runtime.config import DistributedConfig
from runtime.errors import (EXIT_DOES_NOT_FIT, EXIT_FAILURE, EXIT_HANG, EXIT_INTERRUPTED, EXIT_NONFINITE,
                            EXIT_PEER_LOST, EXIT_PREEMPTED, EXIT_USER_ERROR, StorageError,
                            UserError, one_line)
from runtime.events import Failure, Policy
from runtime.lease import LeaseHeld

V1 = Path(__file__).resolve().parent / "data" / "programme-v1"
OPERATIONS = Path(__file__).resolve().parent.parent / "docs" / "OPERATIONS.md"
NAME, DONE, QUEUED = "prog", "exp08/ema0.99", "exp08/off"


def table(heading: str) -> list[list[str]]:
    """The rows of the first markdown table whose header row starts with `heading` in OPERATIONS.md
    (the failure classes) or RUNNING.md (the states), each its cells (backticks removed)."""
    lines = "\n".join(p.read_text() for p in (OPERATIONS, OPERATIONS.with_name("RUNNING.md"))).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {heading} |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip().replace("`", "") for cell in line.strip("|").split("|")])
    return rows


def completes(self: supervise.Supervisor) -> int:
    """Supervisor.run of a launch that completes at once (in process, no gcloud)."""
    with self.sup.changing() as record:
        record.launches.append(LaunchRecord(started=1.0, ended=2.0, code=0, outcome=Outcome.COMPLETED,
                                            cause="completed", last_step=10, total=10))
    return self.finish(Status.COMPLETED, 0)


# --- a ledger written before the records were typed ----------------------------------------------

def test_a_ledger_written_before_is_read_shown_and_carried_on(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # its checkpoint directories are relative: nothing there
    states = tmp_path / "programmes"
    shutil.copytree(V1, states / NAME)
    v1 = json.loads((V1 / "ledger.json").read_text())
    assert "schema" not in v1  # what this test is about

    assert launch(["programme", "status", NAME, "--state-dir", str(states)]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"^{re.escape(DONE)} +completed +1 +0 +0 .* eval/exact_accuracy=0.25 ", out, re.M), out
    assert re.search(rf"^{re.escape(QUEUED)} +queued +0 ", out, re.M) and "controller: budget (budget: " in out, out

    assert launch(["programme", "budget", NAME, "5", "--state-dir", str(states)]) == 0  # the queue goes on
    state = queue_state.State(states / NAME, io.StringIO())
    state.load()
    assert state.ledger.schema == ledger.SCHEMA and state.ledger.variants[QUEUED].state == VariantState.QUEUED
    monkeypatch.setattr(supervise.Supervisor, "run", completes)
    monkeypatch.setattr(supervise, "tpu_state", lambda spec, run: (supervise.TpuState.MISSING, 0))  # its release
    assert Controller(state, alert=lambda title, text: None, sleep_s=0.01).run() == 0

    now = json.loads((states / NAME / "ledger.json").read_text())
    assert now["schema"] == ledger.SCHEMA and now["controller"]["status"] == "done"
    assert {v: r["state"] for v, r in now["variants"].items()} == {DONE: "completed", QUEUED: "completed"}
    # Nothing the old ledger held is lost or changed; what a variant copied from its launches is derived
    # from them since schema 4 (its `progress`: the launch under way's, none here).
    old = copy.deepcopy(v1["variants"][DONE])
    copies = {name: old.pop(name) for name in ("last_step", "total", "wandb_run_id")}
    old["supervision"].pop("progress"), old["supervision"]["end"].pop("last_step")
    assert holds(now["variants"][DONE], old)
    done = ledger.load_ledger(json.dumps(now), "ledger.json").variants[DONE]
    assert {name: done.said(name) for name in copies} == copies and copies["last_step"] == 10
    assert now["slices"]["s1"]["clock"] == v1["slices"]["s1"]["clock"] and now["history"][:3] == v1["history"]


def holds(new, old) -> bool:
    """`new` has every value `old` has (an object may have more keys: fields with defaults)."""
    if isinstance(old, dict):
        return isinstance(new, dict) and all(k in new and holds(new[k], v) for k, v in old.items())
    if isinstance(old, list):
        return isinstance(new, list) and len(new) == len(old) and all(map(holds, new, old))
    return new == old


def test_a_schema_4_records_resident_launch_modes_are_dropped():
    """Schema 4 recorded how a launch used the resident trainers (retired since): a ledger and a
    supervision record of then still load, every other fact of the launch as it was."""
    launched = {"started": 0.0, "ended": 1.0, "code": 0, "outcome": "completed", "cause": "completed",
                "last_step": 8, "total": 8, "resident": "warm:k1"}
    found = {"state": "completed", "supervision": {"status": "completed", "launches": [launched]}}
    book = ledger.load_ledger(json.dumps({"schema": 4, "variants": {"a/found": found}}), "ledger.json")
    assert book.schema == ledger.SCHEMA and book.variants["a/found"].said("last_step") == 8
    sup = ledger.load_supervision(json.dumps({"schema": 4, **found["supervision"]}), "supervision.json")
    assert sup.launches[0].total == 8 and sup.launches[0].outcome == Outcome.COMPLETED
    with pytest.raises(RecordError, match="resident"):  # at the current schema, an unknown key still is one
        ledger.load_ledger(json.dumps({"schema": ledger.SCHEMA, "variants": {"a/found": found}}), "ledger.json")


def test_a_schema_3_record_is_migrated_to_say_each_fact_once():
    """Schema 3 kept copies: a variant's last step, total and W&B run (of its launches), a running
    supervision's `progress` beside its launch under way (whose `timing` was the raw event), an end's
    last step. Read now, each is said once: the launch under way holds what `progress` said, and a
    variant's step only where no launch says it (found complete beside its checkpoints)."""
    event = {"event": "timing", "time": 50.0, "step": 30, "steps_run": 30, "wall": 45.0, "seconds": {"train": 30.0}}
    running = {"state": "running", "supervision": {
        "in_flight": True, "progress": {"step": 30, "total": 100, "wandb_run_id": "w2"},
        "launch": {"started": 0.0, "setup": 4.0, "first_step": 0, "last_step": 30, "timing": event}},
        "last_step": 20, "total": 100, "wandb_run_id": "w2"}
    launched = {"started": 0.0, "ended": 1.0, "code": 0, "outcome": "completed", "cause": "completed",
                "last_step": 8, "total": 8, "wandb_run_id": "w1"}
    found = {"state": "completed", "last_step": 10, "total": 8, "wandb_run_id": "w1", "supervision": {
        "status": "completed", "launches": [launched], "end": {"status": "completed", "code": 0, "last_step": 8}}}
    book = ledger.load_ledger(json.dumps({"schema": 3, "variants": {"a/run": running, "a/found": found}}), "ledger.json")
    assert book.schema == ledger.SCHEMA
    run, done = book.variants["a/run"], book.variants["a/found"]
    assert (run.said("last_step"), run.said("total"), run.said("wandb_run_id")) == (30, 100, "w2")
    timing = run.supervision.launch.timing
    assert (timing.setup, timing.steps_run, timing.seconds, timing.time) == (4.0, 30, {"train": 30.0}, 50.0)
    assert (done.said("last_step"), done.found_step, done.said("total"), done.said("wandb_run_id")) == (10, 10, 8, "w1")
    sup = ledger.load_supervision(json.dumps({"schema": 3, **found["supervision"]}), "supervision.json")
    assert sup.end == ledger.End(status=Status.COMPLETED, code=0) and sup.said("last_step") == 8


def test_an_old_mirror_of_three_files_is_taken_over_and_the_new_one_is_one_snapshot(tmp_path):
    old_mirror = tmp_path / "bucket-old" / NAME  # a mirror the code before wrote: the three files
    shutil.copytree(V1, old_mirror)
    here = queue_state.State(tmp_path / "here" / NAME, io.StringIO())
    here.load(str(old_mirror))
    assert here.ledger.variants[DONE].supervision.launches[0].metrics == {"eval/exact_accuracy": 0.25}

    mirror = tmp_path / "bucket" / NAME
    here.sub.mirror = str(mirror)
    here.save()
    snapshot = json.loads((mirror / "state.json").read_text())
    assert sorted(snapshot) == ["ledger", "schema", "seq", "submission"] and snapshot["seq"] == here.ledger.seq
    assert snapshot["ledger"] == json.loads((here.dir / "ledger.json").read_text())
    assert not (mirror / "ledger.json").exists() and (mirror / "controller.log").exists()
    there = queue_state.State(tmp_path / "there" / NAME, io.StringIO())
    there.load(str(mirror))  # from the snapshot
    assert ledger.as_json(there.ledger) == ledger.as_json(here.ledger) and there.sub == here.sub


@pytest.mark.parametrize("damage", ["wrong type", "unknown key", "missing key", "newer schema", "garbled"])
def test_a_ledger_of_the_wrong_shape_is_one_line_naming_the_file_the_field_and_a_good_copy(tmp_path, capsys, damage):
    states = tmp_path / "programmes"
    shutil.copytree(V1, states / NAME)
    path = states / NAME / "ledger.json"
    data = json.loads(path.read_text())
    launch_0 = data["variants"][DONE]["supervision"]["launches"][0]
    field, text = {
        "wrong type": ('variants["exp08/off"].attempts', lambda: data["variants"][QUEUED].update(attempts="1")),
        "unknown key": ('variants["exp08/ema0.99"].supervision.launches[0].exit', lambda: launch_0.update(exit=0)),
        "missing key": ('variants["exp08/ema0.99"].supervision.launches[0].code', lambda: launch_0.pop("code")),
        "newer schema": ("schema", lambda: data.update(schema=ledger.SCHEMA + 1)),
        "garbled": (None, None),
    }[damage]
    if text:
        text()
        path.write_text(json.dumps(data))
    else:
        path.write_text(path.read_text()[:100])
    before = path.read_bytes()
    mirror = tmp_path / "bucket" / NAME
    assert launch(["programme", "status", NAME, "--state-dir", str(states), "--mirror", str(mirror)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: the ledger {path} "), err
    assert (field or "truncated or garbled") in err[0] and f"restore it from {mirror}/state.json" in err[0], err
    assert path.read_bytes() == before  # nothing was rewritten
    with pytest.raises(RecordError) as caught:
        load_ledger(before, path, "gs://b/p/state.json")
    assert (caught.value.file, caught.value.field, caught.value.good_copy) == (str(path), field, "gs://b/p/state.json")
    assert caught.value.exit_code == EXIT_USER_ERROR


# --- the state table and the failure classes, as documented -----------------------------------------

def test_the_variant_transitions_are_the_documented_table_and_no_other_change_is_made():
    documented = {(VariantState(a), Move(how), VariantState(b)) for a, how, b, *_ in table("from")}
    assert documented == {(a, how, b) for (a, how), b in TRANSITIONS.items()}
    for state in VariantState:
        for how in Move:
            record = VariantRecord(state=state)
            if (state, how) in TRANSITIONS:
                assert move(record, how) == TRANSITIONS[state, how] == record.state
            else:
                with pytest.raises(IllegalTransition):
                    move(record, how)
                assert record.state == state


def tpu_busy() -> BaseException:
    """What the trainer raises when libtpu will not start beside another process (runtime/distributed.py)."""
    def in_use():
        raise RuntimeError("Unable to initialize backend 'tpu': ABORTED: The TPU is already in use by process with "
                           "pid 4242. Not attempting to load libtpu.so in this process.")
    real = distributed.jax.devices
    distributed.jax.devices = in_use
    try:
        distributed.initialize(DistributedConfig(mode="single"))
    except UserError as e:
        return e
    finally:
        distributed.jax.devices = real
    raise AssertionError("no error")


# Each class, the way the trainer reaches it: (exit code, line, class named) as pretrain_jax.py's
# exception paths compute it, or the exit code its own path reports (loop, watchdog, compile_only, liveness).
def raised(e: BaseException) -> tuple[int, str, Failure | None]:
    if isinstance(e, UserError):
        return e.exit_code, str(e), events.failure_of(e)  # pretrain_jax._user_error
    return EXIT_FAILURE, one_line(e), events.failure_of(e)  # pretrain_jax's crash path


TRAINER = {
    Failure.CRASH: lambda: raised(ZeroDivisionError("division by zero")),
    Failure.BAD_INPUT: lambda: raised(UserError("data.path=/x does not exist; build it")),
    Failure.NON_FINITE: lambda: (EXIT_NONFINITE, "the loss is nan at step 3", None),
    Failure.HANG: lambda: (EXIT_HANG, "no step for 600 s", None),
    Failure.DOES_NOT_FIT: lambda: (EXIT_DOES_NOT_FIT, "needs 40 GiB of 32", None),
    Failure.STORAGE: lambda: raised(StorageError("the checkpoint of step 8 was not saved")),
    Failure.PEER_LOST: lambda: (EXIT_PEER_LOST, "process 1 is gone", None),
    Failure.LEASE_HELD: lambda: raised(LeaseHeld("the checkpoint directory is in use by another run")),
    Failure.TPU_BUSY: lambda: raised(tpu_busy()),
}
DECISION = {Policy.PERMANENT: Outcome.FATAL, Policy.BACK_OFF: Outcome.BACKOFF, Policy.RESTART: Outcome.RESTART}


@pytest.mark.parametrize("failure", list(Failure), ids=str)
def test_every_failure_class_is_emitted_decided_by_its_policy_and_documented(failure, capsys, monkeypatch):
    assert set(TRAINER) == set(Failure)  # a new class needs its way here
    monkeypatch.setenv(wire.EVENTS_ENV, "1")  # as the launch guard asks for the events on stdout
    code, line, named = TRAINER[failure]()
    events.detach()  # a fresh process: its first failure is reported
    try:
        events.failed(code, line, named)
    finally:
        events.detach()
    said = [e for e in map(wire.event, capsys.readouterr().out.splitlines()) if e]
    assert [(e["event"], e["failure"], e["exit_code"]) for e in said] == [("failed", failure.value, code)]

    seen = supervise.LaunchEvents()
    seen.line("t1v-n-w-0: " + wire.event_line(said[0]))  # as gcloud prefixes a worker's line
    outcome = supervise.classify(code, seen, supervise.TpuState.READY)
    assert outcome == DECISION[failure.policy] and supervise.cause(code, outcome, seen) == failure.cause

    rows = {row[0]: row for row in table("class")}
    assert rows[failure.value][1].split()[0] == str(failure.exit_code or EXIT_USER_ERROR)
    assert rows[failure.value][2:4] == [failure.policy.value, failure.cause]
    assert len(rows) == len(Failure)
    if failure == Failure.TPU_BUSY:
        assert "launch.py stop" in line


# --- a consistent ledger -----------------------------------------------------------------------------

# 4 slices x 3 variants x 16 launches each. Run against the code before the fix (commit 706b599),
# 17 runs of 20 failed: 14 saved a launch without its preemption, 3 raised "dictionary changed size
# during iteration".
SLICES, PER_SLICE, LAUNCHES = 4, 3, 16


def test_slices_changing_their_records_while_saves_run_leave_every_saved_ledger_whole(tmp_path, monkeypatch):
    """Slice threads drive the supervisor's real paths that change their variants' records (READY,
    launches with their checkpoints and preemptions, a refused create, the end) against a fake
    gcloud and launch, while another thread saves as the controller's does: no save fails, and every
    ledger.json written reads strictly, each launch recorded with its preemption. Before every change
    was made under the lock a save copies the ledger under, a save raised "dictionary changed size
    during iteration" now and then, or wrote a launch without its preemption."""
    variants = [f"exp08/v{i}" for i in range(SLICES * PER_SLICE)]
    sub = queue_state.Submission(name="p", variants=variants, slices=[f"s{i}" for i in range(SLICES)], zone="z",
                                 accelerator_type="v4-8", runtime_version="v", create_attempts=0)
    state = queue_state.State(tmp_path / "p", io.StringIO())
    state.create(sub)
    controller = Controller(state, alert=lambda title, text: None)

    written: list[str] = []
    real_replace = os.replace

    def replace(src, dst, *args, **kw):  # every ledger.json as it is put in place
        if os.fspath(dst).endswith("ledger.json"):
            written.append(Path(src).read_text())
        return real_replace(src, dst, *args, **kw)

    launches = {s: 0 for s in sub.slices}

    def launch_pod(target, overrides, *, run_id, on_line, **_):  # the trainer's events, every other launch preempted
        launches[target.tpu] += 1
        preempted = launches[target.tpu] % 2 == 1
        on_line(wire.event_line({"event": "started", "run_id": run_id, "step": 0, "total": 100}))
        on_line("t1v-n-w-0: " + wire.event_line({"event": "checkpoint", "step": 50}))
        on_line(wire.event_line({"event": "preempted" if preempted else "completed", "step": 50}))
        return EXIT_PREEMPTED if preempted else 0

    def gcloud(argv):  # a process that answers as gcloud does (the caller waits for it, as for gcloud)
        if "describe" in argv:
            answer, code = json.dumps({"state": "READY", "networkEndpoints": [{}, {}]}), 0
        else:
            answer, code = "ERROR: (gcloud.compute.tpus.tpu-vm.create) RESOURCE_EXHAUSTED: no capacity in the zone", 1
        done = subprocess.run(["printf", "%s", answer], capture_output=True, text=True, check=True)
        return code, done.stdout

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # what reaches the disk is not this test's matter: its speed is
    monkeypatch.setattr(supervise.pod, "launch_pod", launch_pod)
    errors: list[BaseException] = []

    def slice_thread(slice_name: str, mine: list[str]) -> None:
        try:
            for variant in mine:
                sup = VariantSupervision(state, variant, slice_name)
                supervisor = supervise.Supervisor(sub.spec(variant, slice_name, state.dir), sup,
                                                  controller.clock(slice_name), run=gcloud, owns_slice=False,
                                                  report=lambda line: None)
                supervisor.ensure_ready()
                for _ in range(LAUNCHES):  # every other one preempted
                    supervisor.launch_once(2)
                supervisor.create(["gcloud", "compute", "tpus", "tpu-vm", "create", slice_name], "tpu-created")
                supervisor.finish(Status.COMPLETED, 0)
                sup.stream.close()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=slice_thread, args=(s, variants[i::SLICES])) for i, s in enumerate(sub.slices)]

    def saver() -> None:
        try:
            while any(t.is_alive() for t in threads):
                state.save()
        except BaseException as e:
            errors.append(e)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads interleave finely: what two slices on a busy machine do now and then
    try:
        for t in threads:
            t.start()
        saving = threading.Thread(target=saver)
        saving.start()
        for t in [*threads, saving]:
            t.join()
    finally:
        sys.setswitchinterval(switch)

    assert not errors, "".join(f"{type(e).__name__}: {e}\n" for e in errors)
    assert len(written) > 100
    for text in written:
        check_ledger(text)
    final = load_ledger((state.dir / "ledger.json").read_text(), "ledger.json")
    assert final.seq == max(json.loads(text)["seq"] for text in written)  # no older copy put over a newer one
    assert all(len(r.supervision.launches) == LAUNCHES and r.supervision.preemptions == LAUNCHES // 2
               and r.supervision.create_refusals == 1 and r.supervision.status == Status.COMPLETED
               for r in final.variants.values())


def check_ledger(text: str) -> None:
    """A saved ledger: it reads strictly, and each supervision holds every launch with its preemption."""
    load_ledger(text, "ledger.json")
    for name, record in json.loads(text)["variants"].items():
        sup = record["supervision"]
        preempted = sum(launch["outcome"] == "preempted" for launch in sup.get("launches", []))
        assert sup.get("preemptions", 0) == preempted, name


# --- requests through the mirror ---------------------------------------------------------------------

def test_programme_stop_from_another_machine_reaches_the_controller_through_the_mirror(tmp_path, monkeypatch, capsys):
    """The controller runs on "this machine" (its state directory); `programme stop --mirror URI` runs
    on "another" (a second state directory, nothing but the mirror): the controller finds the
    request on the mirror, its running variant checkpoints (here: its supervision is interrupted)
    and is queued again, and the controller ends with exit 0, having applied the request once."""
    mirror = tmp_path / "bucket" / NAME  # as gs://, through fsspec
    sub = queue_state.Submission(name=NAME, variants=[DONE, QUEUED], slices=["s1"], zone="z", accelerator_type="v4-8",
                                 runtime_version="v", mirror=str(mirror))
    state = queue_state.State(tmp_path / "here" / NAME, io.StringIO())
    state.create(sub)
    launched = threading.Event()

    def runs_until_interrupted(self: supervise.Supervisor) -> int:
        launched.set()
        self.stop.wait(120)  # Supervisor.interrupt sets it
        return self.finish(Status.INTERRUPTED, EXIT_INTERRUPTED)

    monkeypatch.setattr(supervise.Supervisor, "run", runs_until_interrupted)
    controller = Controller(state, alert=lambda title, text: None, sleep_s=0.01, mirror_poll_s=0.0)
    ended: list[int] = []
    running = threading.Thread(target=lambda: ended.append(controller.run()))
    running.start()
    try:
        assert launched.wait(60), "the variant never started"
        elsewhere = tmp_path / "elsewhere"
        assert launch(["programme", "stop", NAME, "--state-dir", str(elsewhere), "--mirror", str(mirror)]) == 0
        assert "stop: asked" in capsys.readouterr().out
        running.join(60)
    finally:
        controller.halt(Stop("the test ended", 1))
        running.join(60)
    assert ended == [0]
    record = json.loads((state.dir / "ledger.json").read_text())
    assert record["controller"]["status"] == "stopped" and "stopped by `programme stop`" in record["controller"]["line"]
    assert {v: r["state"] for v, r in record["variants"].items()} == {DONE: "queued", QUEUED: "queued"}
    asked = list((elsewhere / NAME / "commands").glob("*.json"))
    assert len(asked) == 1 and record["controller"]["applied"] == [asked[0].stem]
    assert not list((mirror / "commands").glob("*.json"))  # taken from the mirror once applied
    assert controller.state.commands(mirror=True) == []
