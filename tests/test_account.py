"""Where the paid time went (experiments/launcher/account.py), in process with an injected clock:
each category's accounting (setup, the trainer's own, replayed steps, the part after the slice
stopped being billed, idle time, the remainder), the categories adding up to the paid time; the
supervisor's measurements (setup before each launch, a launch that ran while no supervisor
watched); the controller's charges and idle stretches adding up to the slices' READY time, also
across a controller that died; a ledger of schema 1 and 2 read and shown; `programme status`
and its page with the goodput and the failure lines.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import time as real_time
from pathlib import Path

import pytest

from experiments.launcher import account, controller, gcloud, ledger, queue_state, queue_status, supervise
from experiments.launcher.account import launch_timing, replayed_steps, unpaid_part, variant_account
from experiments.launcher.controller import Controller
from experiments.launcher.ledger import (Cause, InFlight, LaunchRecord, LaunchTiming, Outcome, Status,
                                         SupervisionRecord, VariantRecord, VariantState)
from experiments.plan.calibrate import calibrate
from runtime import events, wire
from runtime.errors import EXIT_PREEMPTED

V1 = Path(__file__).resolve().parent / "data" / "programme-v1"
NAME, ZONE = "prog", "us-central2-b"


class Clock:
    """time, as the launcher's modules see it: `time()` is this clock's, everything else the real module's."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def time(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def __getattr__(self, name):
        return getattr(real_time, name)


@pytest.fixture
def clock(monkeypatch) -> Clock:
    fake = Clock()
    for module in (ledger, account, supervise, queue_state, controller):
        monkeypatch.setattr(module, "time", fake)
    return fake


def timing(at: float, *, step: int, steps_run: int, wall: float | None = None, **seconds: float) -> dict:
    """A trainer's `timing` event at `at` (its seconds by category; `other`, the rest of `wall`)."""
    full = dict.fromkeys(("runtime_startup", "data_loading", "program_startup", "checkpoint_save",
                          "checkpoint_restore", "eval", "train"), 0.0) | seconds
    wall = sum(full.values()) if wall is None else wall
    return {"event": "timing", "time": at, "process": 0, "step": step, "steps_run": steps_run, "saves": 1,
            "seconds": full | {"other": round(wall - sum(full.values()), 3)}, "wall": wall, "hits": 0, "misses": 2}


def ran(first: int | None, last: int | None, seconds: dict | None = None, *, steps_run: int = 0, setup: float = 0.0,
           unpaid: dict | None = None, outcome: Outcome = Outcome.COMPLETED) -> LaunchRecord:
    return LaunchRecord(started=0.0, ended=1.0, code=0, outcome=outcome, cause=str(outcome), first_step=first,
                        last_step=last, timing=LaunchTiming(setup=setup, seconds=seconds or {}, steps_run=steps_run,
                                                            step=last, unpaid=unpaid or {}))


# --- one variant's account ---------------------------------------------------------------------------

def test_replayed_steps_are_those_an_earlier_launch_had_run():
    """A ran 1-10 (saved 8); B resumed at 8 and ran 9 before it was killed; C resumed at 8 and ran 9-16:
    B ran step 9 again, C steps 9 and 10 again (9 a third time): 3 steps replayed in all, as a
    metrics.jsonl logging every step would show 3 rows too many. A launch that failed before it
    started (no `started` event) replays nothing and changes nothing."""
    launches = [ran(0, 10, steps_run=10), ran(8, 9, steps_run=1), ran(None, None),
                ran(8, 16, steps_run=8)]
    assert replayed_steps(launches) == [0, 1, 0, 2]
    assert replayed_steps([ran(0, 6, steps_run=6), ran(6, 16, steps_run=10)]) == [0, 0]  # saved where it stopped
    # killed before its first `timing` event: its steps are not known, so none is counted replayed
    assert replayed_steps([ran(0, 10, steps_run=10), LaunchRecord(0.0, 1.0, 1, Outcome.RESTART, "crash",
                                                                   first_step=4, last_step=4)]) == [0, 0]


def test_a_variants_categories_add_up_to_its_paid_time():
    first = {"runtime_startup": 10.0, "data_loading": 2.0, "program_startup": 30.0, "checkpoint_save": 5.0,
             "checkpoint_restore": 0.0, "eval": 0.0, "train": 20.0, "other": 6.0}
    second = {"runtime_startup": 8.0, "data_loading": 2.0, "program_startup": 3.0, "checkpoint_save": 1.0,
              "checkpoint_restore": 1.5, "eval": 4.0, "train": 16.0, "other": 2.0}
    record = VariantRecord(state=VariantState.COMPLETED, supervision=SupervisionRecord(launches=[
        ran(0, 10, first, steps_run=10, setup=7.0, unpaid={"checkpoint_save": 2.0}, outcome=Outcome.PREEMPTED),
        LaunchRecord(0.0, 1.0, 2, Outcome.BACKOFF, "lease held", timing=LaunchTiming(setup=1.5)),  # failed at once
        ran(8, 16, second, steps_run=8, setup=2.0)]))
    got = variant_account(record, paid=140.0)
    assert got.replayed == 2
    expected = {"setup": 10.5, "runtime_startup": 18.0, "data_loading": 4.0, "program_startup": 33.0,
                "checkpoint_save": 4.0,  # 5 - 2 unpaid (after the preemption's notice) + 1
                "checkpoint_restore": 1.5, "eval": 4.0,
                "train": 20.0 + 16.0 - 4.0, "wasted_progress": 2 * 16.0 / 8,  # 2 steps replayed at 2 s a step
                "idle": 0.0}
    expected["other"] = 140.0 - sum(expected.values())  # the trainers' own `other`, the ssh, the gaps
    assert got.seconds == pytest.approx(expected)
    assert sum(got.seconds.values()) == pytest.approx(got.paid) == 140.0
    assert got.goodput == pytest.approx((32.0 + 4.0) / 140.0)
    assert [name for name, _ in got.badput()] == ["program_startup", "other", "runtime_startup"]
    assert account.badput_text(got) == "program_startup 24%, other 21%, runtime_startup 13%"

    old = VariantRecord(supervision=SupervisionRecord(launches=[LaunchRecord(0.0, 1.0, 0, Outcome.COMPLETED, "done")]))
    unmeasured = variant_account(old, paid=100.0)  # launches of a ledger before schema 3: no timing
    assert unmeasured.seconds["other"] == 100.0 and unmeasured.goodput is None
    assert account.goodput_text(unmeasured) == account.badput_text(unmeasured) == "-"


def test_a_running_variant_counts_its_launch_under_way_as_far_as_its_last_checkpoint():
    now_on = {"runtime_startup": 5.0, "program_startup": 10.0, "train": 30.0}
    sup = SupervisionRecord(launch=InFlight(started=0.0, setup=4.0, first_step=0, last_step=30, timing=launch_timing(
        [timing(100.0, step=30, steps_run=30, **now_on)], setup=4.0)))
    got = variant_account(VariantRecord(state=VariantState.RUNNING, supervision=sup), paid=60.0)
    assert got.seconds["train"] == 30.0 and got.seconds["setup"] == 4.0
    assert got.seconds["other"] == pytest.approx(60.0 - 49.0)


def test_the_part_after_the_slice_stopped_being_billed_is_taken_out():
    """The trainer said its account at 100 s and, after the preemption's notice at 104 s, its last at
    110 s (its preemption save): 6 of those 10 s were not billed, in the proportions of what it did
    between the two."""
    said = [timing(100.0, step=8, steps_run=8, train=50.0, checkpoint_save=1.0),
            timing(110.0, step=9, steps_run=9, train=52.0, checkpoint_save=9.0)]
    assert unpaid_part(said, 104.0) == pytest.approx({"train": 1.2, "checkpoint_save": 4.8})
    assert unpaid_part(said, None) == {} and unpaid_part(said, 111.0) == {}
    only = [timing(110.0, step=9, steps_run=9, wall=20.0, train=10.0, checkpoint_save=10.0)]
    assert unpaid_part(only, 100.0) == pytest.approx({"train": 5.0, "checkpoint_save": 5.0})  # from the process's start
    record = launch_timing(said, setup=3.0, billed_until=104.0)
    assert (record.setup, record.step, record.steps_run, record.seconds["train"]) == (3.0, 9, 9, 52.0)
    assert launch_timing([], setup=2.0) == LaunchTiming(setup=2.0)  # the trainer said nothing
    garbled = [{"event": "timing", "time": 5.0, "seconds": {"train": "x", "mystery": 3.0, "eval": 1.0},
                "steps_run": None}]
    assert launch_timing(garbled).seconds == {"eval": 1.0} and launch_timing(garbled).steps_run == 0


# --- the supervisor's measurements -------------------------------------------------------------------

class FakeCloud:
    """gcloud as the supervisor calls it: describes answer the TPU's state (a second each); the rest succeed."""

    def __init__(self, clock: Clock, states: list[str]) -> None:
        self.clock, self.states = clock, states

    def __call__(self, argv: list[str]) -> tuple[int, str]:
        self.clock.advance(1.0)
        if "describe" in argv:
            state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
            return 0, json.dumps({"state": state, "networkEndpoints": [{}, {}]})
        return 0, ""


def supervisor_for(tmp_path: Path, clock: Clock, states: list[str], *, record: SupervisionRecord | None = None,
                   events_file: Path | None = None) -> supervise.Supervisor:
    spec = supervise.Spec(gcloud.Target("t1", ZONE), "run-1", [], accelerator_type="v4-16", log_dir=tmp_path / "logs",
                          poll_s=5.0, storage_backoff_s=120.0, at_end="keep",
                          events_file=str(events_file) if events_file else None)
    sup = supervise.FileSupervision(spec, io.StringIO())
    if record is not None:
        sup.record = record
    return supervise.Supervisor(spec, sup, sup.record.slice, run=FakeCloud(clock, states), sleep=clock.advance)


def trainer(clock: Clock, said: list[dict], code: int = 0):
    """pod.launch_pod: the trainer's events, each at the clock's time, 10 s apart."""
    def launch_pod(target, overrides, *, on_line, **_):
        clock.advance(2.0)  # the ssh, before the trainer says anything
        for event in said:
            clock.advance(10.0)
            on_line("t1v-n-w-0: " + wire.event_line({"process": 0, **event, "time": clock.now}))
        clock.advance(1.0)
        return code
    return launch_pod


def test_setup_is_measured_from_ready_to_the_launch_and_a_failed_setup_counts_towards_the_next(tmp_path, clock,
                                                                                              monkeypatch):
    supervisor = supervisor_for(tmp_path, clock, ["READY"])
    setups = iter([(20.0, 1), (4.0, 0)])  # a setup that fails after 20 s, then a versions check of 4 s

    def ensure_setup(self, hosts):
        seconds, code = next(setups)
        clock.advance(seconds)
        return code

    monkeypatch.setattr(supervise.Supervisor, "ensure_setup", ensure_setup)
    monkeypatch.setattr(supervise.pod, "stop_pod", lambda *a, **k: 0)
    started = clock.now
    monkeypatch.setattr(supervise.pod, "launch_pod", trainer(clock, [
        {"event": "started", "run_id": "run-1", "step": 0, "total": 4},
        timing(0.0, step=4, steps_run=4, train=8.0),
        {"event": "completed", "step": 4, "metrics": {}}]))
    assert supervisor.run() == 0
    (done,) = supervisor.sup.record.launches
    # READY seen at the first describe (asked at `started`); each round: its describe and setup; the
    # backoff between them (120 s) is not setup
    assert done.timing.setup == pytest.approx((1.0 + 20.0) + (1.0 + 4.0)) and not done.timing.setup_ran
    assert done.started == pytest.approx(started + 1 + 20 + 120 + 1 + 4)
    assert (done.first_step, done.timing.steps_run, done.timing.seconds["train"]) == (0, 4, 8.0)
    assert supervisor.sup.record.launch is None and not supervisor.sup.record.in_flight


def test_a_launch_after_the_workers_were_set_up_says_so(tmp_path, clock, monkeypatch):
    """The versions check finds a worker's .venv wanting (3 s), setup runs (30 s): the launch's
    setup holds both, marked as one that set the workers up (the plan prices the two apart)."""
    supervisor = supervisor_for(tmp_path, clock, ["READY"])

    def versions(argv, on_line, **_):
        clock.advance(3.0)
        for host in ("w0", "w1"):
            on_line(wire.versions_line({"host": host, "ok": False, "problem": "jax is missing"}))
        return 0

    monkeypatch.setattr(supervise.pod, "run_gcloud", versions)
    monkeypatch.setattr(supervise.pod, "setup_pod", lambda *a, **k: clock.advance(30.0) or 0)
    monkeypatch.setattr(supervise.pod, "launch_pod", trainer(clock, [
        {"event": "started", "run_id": "run-1", "step": 0, "total": 4}, {"event": "completed", "step": 4}]))
    assert supervisor.run() == 0
    (done,) = supervisor.sup.record.launches
    assert done.timing.setup_ran and done.timing.setup == pytest.approx(1.0 + 3.0 + 30.0)


def test_a_preempted_launchs_time_after_the_notice_is_unpaid(tmp_path, clock, monkeypatch):
    supervisor = supervisor_for(tmp_path, clock, ["PREEMPTED"])  # as the describe after the launch says
    t0 = clock.now
    supervisor.clock.ready(t0, 2)
    # the ssh from t0; events at t0 + 12 (started), 22 and 32 (its account), 42 (preempted, noticed at 27)
    monkeypatch.setattr(supervise.pod, "launch_pod", trainer(clock, [
        {"event": "started", "run_id": "run-1", "step": 0, "total": 100},
        timing(0.0, step=5, steps_run=5, train=10.0),
        timing(0.0, step=6, steps_run=6, train=12.0, checkpoint_save=8.0),
        {"event": "preempted", "step": 6, "noticed": t0 + 27.0}], code=EXIT_PREEMPTED))
    outcome, code, _ = supervisor.launch_once(2)
    assert (outcome, code) == (Outcome.PREEMPTED, EXIT_PREEMPTED)
    (done,) = supervisor.sup.record.launches
    # the clock stopped at the notice (t0 + 27), 5 s before the last account, of the 10 s since the
    # one before: half of its 2 s of train and 8 s of save are unpaid
    assert done.timing.unpaid == pytest.approx({"train": 1.0, "checkpoint_save": 4.0})
    assert supervisor.billing_stopped == pytest.approx(t0 + 27.0)
    assert supervisor.clock.ready_seconds == pytest.approx(27.0) and supervisor.sup.record.preemptions == 1


@pytest.mark.parametrize("down", [False, True], ids=["stopped", "preempted"])
def test_a_launch_that_ran_while_no_supervisor_watched_is_recorded_from_the_runs_events(tmp_path, clock, monkeypatch,
                                                                                       down):
    """A supervisor killed mid-launch leaves the launch in flight; the next one finds it (the slice
    still READY: it stops it, the trainer checkpoints; or the slice gone under it) and records it from
    the run's events beside its checkpoints: its steps, its account, the setup before it."""
    t0 = clock.now
    events_file = tmp_path / "ckpt" / "run_files" / events.FILE
    events_file.parent.mkdir(parents=True)
    before = [{"event": "started", "time": t0 - 100, "step": 0}, timing(t0 - 90, step=6, steps_run=6, train=9.0)]
    orphan = [{"event": "started", "time": t0 + 20, "step": 4, "run_id": "run-1", "total": 16},
              timing(t0 + 40, step=9, steps_run=5, runtime_startup=12.0, train=6.0),
              timing(t0 + 46, step=10, steps_run=6, runtime_startup=12.0, train=7.0, checkpoint_save=5.0),
              {"event": "preempted", "time": t0 + 47, "step": 10, "noticed": t0 + 42}]
    events_file.write_text("".join(json.dumps(e) + "\n" for e in before + orphan))
    record = SupervisionRecord(run_id="run-1", in_flight=True, launches=[ran(0, 6, {"train": 9.0}, steps_run=6)],
                               launch=InFlight(started=t0 + 10, setup=6.0))
    record.slice.ready(t0 - 200, 2)
    clock.advance(60)
    supervisor = supervisor_for(tmp_path, clock, ["PREEMPTED", "READY"] if down else ["READY"], record=record,
                                events_file=events_file)
    monkeypatch.setattr(supervise.Supervisor, "ensure_setup", lambda self, hosts: 0)
    stopped = []
    monkeypatch.setattr(supervise.pod, "stop_pod", lambda *a, **k: stopped.append(clock.now) or 0)
    monkeypatch.setattr(supervise.pod, "launch_pod", trainer(clock, [
        {"event": "started", "run_id": "run-1", "step": 10, "total": 16}, {"event": "completed", "step": 16}]))
    assert supervisor.run() == 0
    unwatched, last = supervisor.sup.record.launches[1:]
    assert unwatched.unwatched and not last.unwatched and bool(stopped) is not down
    assert (unwatched.started, unwatched.ended, unwatched.first_step, unwatched.last_step) == (t0 + 10, t0 + 47, 4, 10)
    # the slice went down under it: a preemption; else this supervisor stopped it: none
    assert unwatched.outcome == Outcome.PREEMPTED and supervisor.sup.record.preemptions == (1 if down else 0)
    assert unwatched.cause == ("preempted" if down else Cause.SUPERVISOR_DIED)
    assert unwatched.timing.setup == 6.0 and unwatched.timing.seconds["train"] == 7.0
    assert replayed_steps(supervisor.sup.record.launches) == [0, 2, 0]  # steps 5 and 6 run again
    # preempted: the clock stopped at the notice (t0 + 42), 4 s before its last account of the 6 s
    # since the one before (1 s train, 5 s save): two thirds of those unpaid
    unpaid = pytest.approx({"train": 2 / 3, "checkpoint_save": 10 / 3}, abs=1e-3)
    assert unwatched.timing.unpaid == (unpaid if down else {})
    assert last.first_step == 10 and not supervisor.sup.record.in_flight


def test_a_launch_left_in_flight_that_ran_to_the_end_is_not_launched_again(tmp_path, clock, monkeypatch):
    t0 = clock.now
    events_file = tmp_path / "ckpt" / "run_files" / events.FILE
    events_file.parent.mkdir(parents=True)
    said = [{"event": "started", "time": t0 + 20, "step": 12, "run_id": "run-1", "total": 16},
            timing(t0 + 30, step=16, steps_run=4, train=4.0),
            {"event": "completed", "time": t0 + 31, "step": 16, "metrics": {"eval/exact_accuracy": 0.5}}]
    events_file.write_text("".join(json.dumps(e) + "\n" for e in said))
    record = SupervisionRecord(run_id="run-1", in_flight=True, launch=InFlight(started=t0 + 10, setup=1.0))
    clock.advance(60)
    supervisor = supervisor_for(tmp_path, clock, ["READY"], record=record, events_file=events_file)
    monkeypatch.setattr(supervise.pod, "stop_pod", lambda *a, **k: 0)
    monkeypatch.setattr(supervise.pod, "launch_pod", lambda *a, **k: pytest.fail("a complete run was launched"))
    assert supervisor.run() == 0
    (done,) = supervisor.sup.record.launches
    assert done.unwatched and done.outcome == Outcome.COMPLETED and supervisor.sup.record.status == Status.COMPLETED
    assert done.metrics == {"eval/exact_accuracy": 0.5} and supervisor.sup.record.said("last_step") == 16


def test_a_launch_left_in_flight_whose_run_completed_meanwhile_is_recorded_without_a_launch(tmp_path, clock,
                                                                                           monkeypatch):
    """The controller died while a launch ran, and the run completed before the next one looked: that
    one launches nothing (the run is complete) but records the launch from the run's events."""
    sub = queue_state.Submission(name=NAME, variants=["exp08/a"], slices=["s1"], zone=ZONE, accelerator_type="v4-8",
                                 runtime_version="v", checkpoint_dirs={"exp08/a": str(tmp_path / "ckpt")})
    state = queue_state.State(tmp_path / NAME, io.StringIO())
    state.create(sub)
    t0 = clock.now
    said = [{"event": "started", "time": t0 - 40, "step": 8, "run_id": "r", "total": 16},
            timing(t0 - 10, step=16, steps_run=8, runtime_startup=9.0, train=20.0),
            {"event": "completed", "time": t0 - 9, "step": 16, "metrics": {"eval/exact_accuracy": 0.5}}]
    Path(sub.events_file("exp08/a")).parent.mkdir(parents=True)
    Path(sub.events_file("exp08/a")).write_text("".join(json.dumps(e) + "\n" for e in said))
    held = state.ledger.variants["exp08/a"].supervision
    held.in_flight, held.launch = True, InFlight(started=t0 - 50, setup=2.0)
    monkeypatch.setattr(supervise.Supervisor, "run", lambda self: pytest.fail("a complete run was launched"))
    controller = Controller(state, alert=lambda title, text: None)
    controller.run_variant(controller.take("s1"), "s1")
    record = state.ledger.variants["exp08/a"]
    (found,) = record.supervision.launches
    assert record.state == VariantState.COMPLETED and not record.supervision.in_flight and record.said("total") == 16
    assert found.unwatched and found.outcome == Outcome.COMPLETED and (found.first_step, found.last_step) == (8, 16)
    assert (found.timing.setup, found.timing.seconds["train"], found.ended) == (2.0, 20.0, t0 - 9)


# --- the controller: charges, idle time, a controller that died ---------------------------------------

def one_launch(clock: Clock, seconds: float):
    """Supervisor.run of a variant that takes `seconds` of READY time and completes."""
    def run(self: supervise.Supervisor) -> int:
        with self.sup.changing():
            self.clock.ready(clock.now, 2)
        clock.advance(seconds)
        with self.sup.changing() as record:
            record.launches.append(ran(0, 10, {"train": seconds / 2}, steps_run=10, setup=1.0))
        return self.finish(Status.COMPLETED, 0)
    return run


def test_the_variants_and_the_idle_stretches_add_up_to_the_slices_ready_time(tmp_path, clock, monkeypatch):
    """s1 runs a (100 s), is idle 7 s, runs b (50 s), then a controller stops (`programme stop`: the
    slice kept READY 30 s with nothing on it), then c starts; its controller dies 40 s into it, the
    next one resumes it (charging it those 40 s too) and it runs 20 s more; 5 s later s1 is deleted."""
    variants = ["exp08/a", "exp08/b", "exp08/c"]
    sub = queue_state.Submission(name=NAME, variants=variants, slices=["s1"], zone=ZONE, accelerator_type="v4-16",
                                 runtime_version="v")
    state = queue_state.State(tmp_path / NAME, io.StringIO())
    state.create(sub)
    controller = Controller(state, alert=lambda title, text: None)
    monkeypatch.setattr(supervise, "tpu_state", lambda spec, run: (supervise.TpuState.MISSING, 0))  # at the release
    monkeypatch.setattr(supervise.Supervisor, "run", one_launch(clock, 100.0))
    controller.run_variant(controller.take("s1"), "s1")
    clock.advance(7.0)
    monkeypatch.setattr(supervise.Supervisor, "run", one_launch(clock, 50.0))
    controller.run_variant(controller.take("s1"), "s1")
    clock.advance(30.0)  # stopped between variants: the slice stays READY
    assert controller.take("s1") == "exp08/c"
    clock.advance(40.0)  # ... and the controller dies
    state.save()
    state = queue_state.State(tmp_path / NAME, io.StringIO())
    state.load()
    controller = Controller(state, alert=lambda title, text: None)
    controller.recover()
    monkeypatch.setattr(supervise.Supervisor, "run", one_launch(clock, 20.0))
    assert controller.take("s1") == "exp08/c"  # its own slice's
    controller.run_variant("exp08/c", "s1")
    clock.advance(5.0)
    controller.release("s1")

    book = state.ledger
    slice_ = book.slices["s1"]
    assert slice_.clock.ready_seconds == pytest.approx(100 + 7 + 50 + 30 + 40 + 20 + 5)
    assert [book.variants[v].ready_seconds for v in variants] == pytest.approx([100.0, 50.0, 60.0])
    assert slice_.idle_seconds == pytest.approx(7 + 30 + 5) and slice_.gaps == [7.0, 30.0]
    whole = account.programme_account(book)
    assert whole.unattributed == pytest.approx(0.0, abs=1e-6)
    assert whole.total.paid == pytest.approx(slice_.clock.ready_seconds)
    assert whole.total.seconds["idle"] == pytest.approx(42.0)
    assert sum(whole.total.seconds.values()) == pytest.approx(whole.total.paid)
    assert whole.total.seconds["train"] == pytest.approx((100 + 50 + 20) / 2)
    # the plan's calibration reads this ledger: each launch's setup (the workers checked), the idle stretches
    cal = calibrate(tmp_path / NAME)
    assert cal.launches == 3 and cal.figures["setup_check"].seconds == 1.0
    assert cal.figures["between_variants"].seconds == pytest.approx((7 + 30) / 2)


# --- older ledgers, and what status shows ------------------------------------------------------------

@pytest.mark.parametrize("schema", [1, 2])
def test_a_ledger_of_schema_1_or_2_is_read_and_shown_without_timings(tmp_path, schema):
    shutil.copytree(V1, tmp_path / NAME)
    path = tmp_path / NAME / "ledger.json"
    if schema == 2:  # the same records, marked as version 2 wrote them
        path.write_text(json.dumps({"schema": 2, **json.loads(path.read_text())}))
    state = queue_state.State(tmp_path / NAME, io.StringIO())
    state.load()
    read = state.ledger
    assert read.schema == ledger.SCHEMA
    assert all(launch.timing is None for r in read.variants.values() for launch in r.supervision.launches)
    assert read.slices["s1"].idle_seconds == 0.0 and read.slices["s1"].free is None
    out = queue_status.text(state.sub, read)
    row = next(line for line in out.splitlines() if line.startswith("exp08/ema0.99 "))
    assert re.split(r"\s{2,}", row)[7:9] == ["-", "-"], row  # goodput and badput: not measured
    assert "<img alt='paid time by category, per variant'" in queue_status.page(state.sub, read)
    # what the slice's clock counted that no variant held: the programme's, unattributed (in `other`)
    whole = account.programme_account(read)
    assert whole.unattributed == pytest.approx(read.slices["s1"].clock.ready_seconds
                                               - sum(r.ready_seconds for r in read.variants.values()))


def test_status_shows_goodput_badput_idle_and_the_page_the_failure_lines(tmp_path):
    done, bad = "exp08/ema0.99", "exp08/off"
    sub = queue_state.Submission(name=NAME, variants=[done, bad], slices=["s1"], zone=ZONE, accelerator_type="v4-8",
                                 runtime_version="v")
    state = queue_state.State(tmp_path / NAME, io.StringIO())
    state.create(sub)
    book = state.ledger
    book.variants[done].__dict__.update(state="completed", ready_seconds=1800.0, supervision=SupervisionRecord(
        launches=[ran(0, 10, {"runtime_startup": 180.0, "program_startup": 360.0, "eval": 90.0, "train": 900.0},
                         steps_run=10, setup=72.0)]))
    book.variants[bad].__dict__.update(state="failed", ready_seconds=360.0, line="exp08/off: the loss is nan at step 3",
                                       supervision=SupervisionRecord(launches=[ran(0, 3, {"train": 270.0},
                                                                                      steps_run=3)]))
    book.slices["s1"].__dict__.update(idle_seconds=1440.0)
    book.slices["s1"].clock.ready_seconds = 1800.0 + 360.0 + 1440.0
    out = queue_status.text(sub, book, now=2e9)
    cells = {c[0]: c for c in (re.split(r"\s{2,}", line.strip()) for line in out.splitlines()) if len(c) > 2}
    assert cells[done][6:9] == ["10/-", "55%", "program_startup 20%, other 11%, runtime_startup 10%"]
    assert cells[bad][7:9] == ["75%", "other 25%"]
    # the programme: 1 pod-hour paid, of it 0.4 idle; productive 900 + 90 + 270 s
    assert cells["programme total"][2:5] == ["1.000/0.000", "35%", "idle 40%, program_startup 10%, other 8%"]
    assert "idle READY time (pod-hours): s1 0.400" in out and out.rstrip().endswith("the loss is nan at step 3")
    page = queue_status.page(sub, book, now=2e9)
    assert "<li>exp08/off: exp08/off: the loss is nan at step 3</li>" in page
    assert page.count("data:image/png;base64,") == 2 and "<td>55%</td>" in page
