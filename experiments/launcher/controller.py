"""The run queue's controller (`launch.py programme run`; the queue's state: experiments/
launcher/queue_state.py): one thread per slice takes the next queued variant, runs it under the
supervisor's logic (experiments/launcher/supervise.py) until it completes or fails for good, and
takes the next; a slice with nothing left to run is deleted, and on a stop deleted or kept READY
as the stop says (`Stop.release`; its line names what each variant kept or lost and the slices
left billing). A variant's state changes only through ledger.move (ledger.TRANSITIONS). What
ends a variant's run, the budget, requests and pod-hours: docs/RUNNING.md, "Running the whole
programme unattended"; where the time went: experiments/launcher/account.py.

Exit codes of `run`: 0 nothing left to run, the budget reached, or stopped by `programme stop`;
1 stopped on a repeated infrastructure failure; 2 bad input, a damaged state file, a held lease,
no credentials, a refused request; 6 a state file that cannot be written; 130 interrupted.
"""

from __future__ import annotations

import io
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, TextIO

from experiments.dashboard import ProgrammeDashboards
from experiments.launcher import supervise
from experiments.launcher.account import charge, idle_from, idle_until, live_ready_seconds, mark
from experiments.launcher.gcloud import Target
from experiments.launcher.ledger import (STOPS_PROGRAMME, Command, ControllerStatus, Move, Outcome, ReadyClock,
                                         StateWriteError, Status, Streak, SupervisionRecord, VariantState, Verb,
                                         can_move, log_line, move)
from experiments.launcher.queue_state import State, Submission, hold_lease
from runtime import events
from runtime.errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USER_ERROR, UserError
from runtime.events import Kind

MIRROR_POLL_S = 10.0  # how often a controller looks for requests on the mirror
KEEP_APPLIED = 200  # ids of the last requests applied, kept in the ledger (a request is applied once)


class VariantSupervision(supervise.Supervision):
    """A variant's supervision record inside the programme's ledger (changed under the ledger's
    lock), its events in the controller's log and the variant's own."""

    prefix = "[programme]"

    def __init__(self, state: State, variant: str, slice_name: str) -> None:
        self.state, self.variant, self.slice = state, variant, slice_name
        with state.lock:
            held = state.ledger.variants[variant]
            record = held.supervision
            record.run_id, record.zone = record.run_id or held.run_id, record.zone or state.sub.zone
            record.tpu = slice_name
        self.log_path = state.dir / "logs" / f"{variant.replace('/', '__')}.log"
        try:
            self.log_path.parent.mkdir(exist_ok=True)
            stream = open(self.log_path, "a", encoding="utf-8")
        except OSError as e:
            raise StateWriteError(self.log_path, e, "variant's log") from None
        super().__init__(record, state.lock, stream, state.dir / "ledger.json")

    def save(self) -> None:
        self.state.save()

    def host_seconds(self, clock: ReadyClock) -> float:
        """The variant's own charge: what it was charged before, and its share of the slice since it took it."""
        with self.state.lock:
            held = self.state.ledger.variants[self.variant]
            since = max(0.0, clock.host_total() - held.mark.host) if held.mark else 0.0
            return held.host_seconds + since

    def event(self, name: str, **fields) -> None:
        self.state.event(name, variant=self.variant, slice=self.slice, **fields)
        try:
            self.stream.write(log_line(self.prefix, name, fields) + "\n")
            self.stream.flush()
        except OSError as e:
            raise StateWriteError(self.log_path, e, "variant's log") from None


# --- the controller ------------------------------------------------------------------------------

class Stop(Exception):
    """The controller stops, said in one line, with an exit code; `release`: the slices are deleted
    once the running variants have stopped (else they are kept READY, and the line says so)."""

    def __init__(self, line: str, code: int, release: bool = False) -> None:
        super().__init__(line)
        self.line, self.code, self.release = line, code, release


class Controller:
    """Runs the programme's queue on its slices until nothing is left (see the module docstring).
    Every change of a variant's state goes through ledger.move (the transition table)."""

    def __init__(self, state: State, *, alert: Callable[[str, str], None] | None = None,
                 sleep_s: float = 0.5, mirror_poll_s: float = MIRROR_POLL_S) -> None:
        self.state, self.sub, self.ledger = state, state.sub, state.ledger
        self.alert = alert or Alerts(state.sub).send
        self.stop = threading.Event()
        self.stopping: Stop | None = None  # why the controller stops (None: the queue ran out)
        self.budget_line: str | None = None
        self.supervisors: dict[str, supervise.Supervisor] = {}  # running variant -> its supervisor
        self.stopped: dict[str, tuple[int | None, int | None]] = {}  # variant stopped -> (step saved, step reached)
        self.sleep_s = sleep_s  # how often the directory's requests are looked for
        self.mirror_poll_s = mirror_poll_s  # how often the mirror's
        self.mirror_polled: float | None = None
        self.lock = state.lock
        self.dashboards = ProgrammeDashboards.of(state.dir, state.sub.name)

    # -- time and money

    def clock(self, slice_name: str) -> ReadyClock:
        return self.ledger.slices[slice_name].clock

    def spent_hours(self) -> float:
        """Pod-hours: the slices' READY hours so far."""
        return sum(s.clock.ready_total() for s in self.ledger.slices.values()) / 3600

    def ahead_hours(self) -> float:
        """Pod-hours the running variants are still planned to take (their plan less what they spent):
        on several slices, a new variant must fit the budget beside them."""
        return sum(max(0.0, (self.sub.planned_hours(variant) or 0.0) - live_ready_seconds(self.ledger, record) / 3600)
                   for variant, record in self.ledger.variants.items()
                   if record.state == VariantState.RUNNING and record.mark and record.slice in self.ledger.slices)

    def note_spending(self) -> None:
        self.ledger.history.append((round(time.time(), 3), round(self.spent_hours(), 6)))

    # -- the queue

    def take(self, slice_name: str) -> str | None:
        """The variant this slice runs next: its own that was running when the controller stopped
        (its processes may still run there), else the first queued one; None when nothing is left
        or the budget would be exceeded (said once)."""
        with self.lock:
            if self.stop.is_set() or self.budget_line:
                return None
            own = self.ledger.slices[slice_name].variant
            if own and self.ledger.variants[own].state in (VariantState.QUEUED, VariantState.RUNNING):
                return self._start(own, slice_name)
            held = {s.variant for s in self.ledger.slices.values()}  # other slices' own: each resumes there
            queued = sorted((v for v, r in self.ledger.variants.items() if r.state == VariantState.QUEUED
                             and v not in held), key=lambda v: self.ledger.variants[v].order)
            if not queued:
                return None
            variant, budget = queued[0], self.sub.budget
            planned = self.sub.planned_hours(variant) or 0.0
            if budget is not None:
                spent, ahead = self.spent_hours(), self.ahead_hours()
                if spent + planned > budget:
                    self.budget_line = (f"budget: {variant} not started: {spent:.3f} pod-hours spent + "
                                        f"{planned:.3f} planned > budget {budget:g}; to go on, raise it: "
                                        f"launch.py programme budget {self.state.name} HOURS")
                    self.state.event("budget-stop", variant=variant, spent=f"{spent:.3f}",
                                     planned=f"{planned:.3f}", budget=budget)
                    return None
                if spent + ahead + planned > budget:
                    # It fits only if the running variants end under their plans: this slice is given
                    # back, and the slice of the last one running takes it then, if it still fits.
                    self.state.event("budget-wait", variant=variant, slice=slice_name, ahead=f"{ahead:.3f}")
                    return None
            return self._start(variant, slice_name)

    def _start(self, variant: str, slice_name: str) -> str:
        with self.lock:
            record = self.ledger.variants[variant]
            move(record, Move.START)
            charge(record, self.ledger.slices)  # the slice it held when a controller died: its own time
            record.slice, record.started = slice_name, record.started or time.time()
            record.attempts += 1
            idle_until(self.ledger.slices[slice_name], taken=True)
            record.mark = mark(self.clock(slice_name))
            self.ledger.slices[slice_name].variant = variant
        self.state.save()
        if self.dashboards is not None:  # submit --dashboards: the group's W&B views, at its first variant
            self.dashboards.started(variant)
        return variant

    def already_complete(self, variant: str) -> dict | None:
        """A run that needs no launch: the `completed` event beside its checkpoints, else its newest
        committed checkpoint at its final step (the event lost: the run stopped right after that
        commit, or copying its events failed). None when neither, or when they cannot be read from
        here (the trainer then finds out)."""
        directory = self.sub.checkpoint_dirs.get(variant)
        if not directory:
            return None
        try:
            said = events.read(self.sub.events_file(variant))
        except Exception:  # noqa: BLE001 - unreadable here: the checkpoints may still tell
            said = []
        completed = [e for e in said if e.get("event") == Kind.COMPLETED]
        if completed:
            return completed[-1]
        totals = [e["total"] for e in said if e.get("event") == Kind.STARTED and isinstance(e.get("total"), int)]
        total = totals[-1] if totals else self.sub.total_steps.get(variant)
        if not total:
            return None
        try:
            # Not at the top: Orbax adds a second to every `programme` command, for a check only the controller makes.
            from runtime.checkpointing import newest_committed

            newest = newest_committed(directory)
        except Exception:  # noqa: BLE001 - as above
            return None
        if newest is None or newest[0] < total:
            return None
        return {"event": Kind.COMPLETED, "step": newest[0], "metrics": newest[1].get("metrics"), "from": "checkpoint"}

    # -- one variant on one slice

    def record_left_in_flight(self, variant: str, slice_name: str) -> None:
        """The launch a controller that died left in flight, its run since found complete: recorded from
        the run's events beside its checkpoints (where its time went, its steps)."""
        with self.lock:
            if not self.ledger.variants[variant].supervision.in_flight:
                return
        sup = VariantSupervision(self.state, variant, slice_name)
        try:
            supervise.Supervisor(self.sub.spec(variant, slice_name, self.state.dir), sup, self.clock(slice_name),
                                 owns_slice=False, report=lambda line: None).record_unwatched(down=False)
        finally:
            sup.stream.close()

    def run_variant(self, variant: str, slice_name: str) -> None:
        done = self.already_complete(variant)
        if done is not None:
            self.record_left_in_flight(variant, slice_name)
            self.state.event("skipped-complete", variant=variant, step=done.get("step"),
                             seen=done.get("from", "completed-event"))
            step = done.get("step")
            self.end(variant, slice_name, Move.COMPLETE, metrics=done.get("metrics"),
                     found_step=step if isinstance(step, int) else None)
            return
        sup = VariantSupervision(self.state, variant, slice_name)
        spec = self.sub.spec(variant, slice_name, self.state.dir)
        supervisor = supervise.Supervisor(spec, sup, self.clock(slice_name), owns_slice=False, report=lambda line: None)
        with self.lock:
            stopping = self.stop.is_set()
            if not stopping:
                self.supervisors[variant] = supervisor
        if stopping:
            sup.stream.close()
            return self.end(variant, slice_name, Move.REQUEUE)
        try:
            supervisor.run()
        except supervise.Unavailable as e:  # the slice could not be had: back of the queue
            self.end(variant, slice_name, Move.REQUEUE, line=e.line, failure=e.kind, back=True)
            self.infrastructure(variant, e.kind, e.line)
            return
        finally:
            with self.lock:
                self.supervisors.pop(variant, None)
            sup.stream.close()
        with self.lock:
            record, held = sup.record, self.ledger.variants[variant]
            status, end, skip = record.status, record.end, held.skip
            last = record.launches[-1] if record.launches else None
        if status == Status.COMPLETED:
            self.end(variant, slice_name, Move.COMPLETE, metrics=last.metrics if last else None)
            with self.lock:  # a run that completes ends the streak of infrastructure failures
                self.ledger.controller.streak = Streak()
            self.state.save()
        elif status == Status.INTERRUPTED:
            if last is not None and last.outcome == Outcome.STOPPED:
                with self.lock:
                    self.stopped[variant] = (last.saved_step, last.last_step)
            self.end(variant, slice_name, Move.SKIP if skip else Move.REQUEUE)
        elif status == Status.FAILED and end and end.cause in STOPS_PROGRAMME:
            raise Stop(end.line or "gcloud refused a request", end.code or EXIT_USER_ERROR)  # none fares better
        elif status == Status.FAILED:
            self.end(variant, slice_name, Move.FAIL, failure=last.cause if last else None)
            self.alert(f"{self.state.name}: {variant} failed", held.verdict() or "")
        else:  # gave up: restarts without progress or past --max-restarts
            cause = (last.cause if last else None) or str(status)
            self.end(variant, slice_name, Move.FAIL, failure=cause)
            self.alert(f"{self.state.name}: {variant} failed", f"gave up after restarts: {cause}")
            self.infrastructure(variant, cause, (last.line if last else None) or cause)

    def end(self, variant: str, slice_name: str, how: Move, *, back: bool = False, metrics: dict | None = None,
            line: str | None = None, failure: str | None = None, found_step: int | None = None) -> None:
        """The variant's run on the slice ended: charge it the slice's READY time since it started
        there, record what it got to (what no launch said: `line`, `found_step`), and move it (`how`)."""
        with self.lock:
            record = self.ledger.variants[variant]
            charge(record, self.ledger.slices)
            record.line = line  # a line of an earlier end is not this one's
            for name, value in (("failure", failure), ("found_step", found_step)):
                if value is not None:
                    setattr(record, name, value)
            state = move(record, how)
            if how == Move.SKIP:
                record.skip = False  # honoured
            record.ended = time.time()
            if metrics is not None:
                record.metrics = metrics
            if back:
                record.order = max(r.order for r in self.ledger.variants.values()) + 1
            if self.ledger.slices[slice_name].variant == variant:
                self.ledger.slices[slice_name].variant = None
            if self.ledger.slices[slice_name].variant is None:
                idle_from(self.ledger.slices[slice_name])
            self.note_spending()
        self.state.save()
        self.state.event("variant-" + state, variant=variant, slice=slice_name,
                         **({"failure": shlex.quote(str(failure))} if failure else {}))

    # -- repeated infrastructure failures

    def infrastructure(self, variant: str, kind: str, line: str) -> None:
        with self.lock:
            streak = self.ledger.controller.streak
            if streak.kind != kind:
                streak.kind, streak.variants = kind, []
            if variant not in streak.variants:
                streak.variants.append(variant)
            count = len(streak.variants)
        self.state.save()
        if count >= self.sub.infra_streak:
            raise Stop(f"the same infrastructure failure ended {count} variants in a row ({kind}: {line}); fix it, "
                       f"then `launch.py programme run {self.state.name}` carries on", EXIT_FAILURE)

    # -- the slices

    def slice_worker(self, slice_name: str) -> None:
        try:
            while not self.stop.is_set():
                variant = self.take(slice_name)
                if variant is None:
                    break
                self.run_variant(variant, slice_name)
            if not self.stop.is_set() or (self.stopping is not None and self.stopping.release):
                self.release(slice_name)
        except Stop as e:
            self.halt(e)
        except supervise.GiveUp as e:
            self.halt(Stop(str(e), EXIT_USER_ERROR))
        except UserError as e:  # a state file could not be written (StateWriteError): all stop, in its line
            self.halt(Stop(str(e), e.exit_code))
        except Exception as e:
            self.halt(Stop(f"controller thread of {slice_name} crashed: {type(e).__name__}: {e}", EXIT_FAILURE))
            raise

    def release(self, slice_name: str) -> None:
        """Nothing left for this slice: delete it if it is this programme's (its READY time ends)."""
        supervisor = supervise.Supervisor(
            supervise.Spec(Target(slice_name, self.sub.zone, self.sub.project), f"{self.state.name}-{slice_name}", [],
                           at_end="delete", queued_resource=f"{slice_name}-qr" if self.sub.queued else None,
                           owner=self.sub.owner),
            _SliceRecord(self.state, slice_name), self.clock(slice_name))
        state = supervise.tpu_state(supervisor.spec, supervisor.run_gcloud)[0]
        if state != supervise.TpuState.MISSING or self.sub.queued:  # a queued resource may wait to make one
            supervisor.release_tpu(Status.COMPLETED)
        else:
            supervisor.gone(time.time())
        with self.lock:
            idle_until(self.ledger.slices[slice_name], taken=False)
            self.note_spending()
        self.state.save()

    def halt(self, why: Stop) -> None:
        """Stop everything: the running variants checkpoint and stop, no new one starts."""
        with self.lock:
            if self.stopping is None:
                self.stopping = why
            self.stop.set()
            running = list(self.supervisors.values())
        for supervisor in running:
            supervisor.interrupt()

    # -- requests (programme stop | skip | retry | budget)

    def apply_commands(self, *, mirror: bool | None = None) -> None:
        """Apply the requests left since the last look; the mirror's every `mirror_poll_s` (or when
        `mirror` says)."""
        now = time.monotonic()
        if mirror is None:
            mirror = self.mirror_polled is None or now - self.mirror_polled >= self.mirror_poll_s
        if mirror:
            self.mirror_polled = now
        for command in self.state.commands(mirror=mirror):
            self.apply(command)

    def apply(self, command: Command) -> None:
        """One request, once (the ledger keeps the ids of those applied: one left both here and on the
        mirror is one request)."""
        with self.lock:
            applied = self.ledger.controller.applied
            if command.id in applied:
                return
            applied.append(command.id)
            del applied[:-KEEP_APPLIED]
        verb, variant = command.verb, command.variant
        self.state.event("command", verb=verb, variant=variant or "-")
        if verb == Verb.STOP:
            self.state.save()
            release = self.sub.release_on_stop() if command.release is None else command.release
            self.halt(Stop("stopped by `programme stop`", 0, release=release))
            return
        if verb == Verb.BUDGET:
            with self.lock:
                self.sub.budget, self.budget_line = command.value, None
            self.state.save_submission()
            self.state.save()
            return
        interrupt = None
        with self.lock:
            record = self.ledger.variants.get(variant)
            if record is None:
                self.state.event("command-ignored", reason=shlex.quote(f"no variant {variant}"))
            elif verb == Verb.RETRY and can_move(record.state, Move.RETRY):
                move(record, Move.RETRY)
                record.line = record.failure = None
                record.supervision.restarts, record.supervision.status = 0, Status.RUNNING
            elif verb == Verb.SKIP and record.state == VariantState.RUNNING:
                record.skip = True  # skipped once it has stopped
                interrupt = self.supervisors.get(variant)
            elif verb == Verb.SKIP and can_move(record.state, Move.SKIP):
                move(record, Move.SKIP)
            else:
                self.state.event("command-ignored", reason=shlex.quote(f"{variant} is {record.state}"))
        self.state.save()
        if interrupt is not None:
            threading.Thread(target=interrupt.interrupt, daemon=True).start()

    def run(self) -> int:
        """Until nothing is left to run, the budget is reached, or a stop; the exit code."""
        self.recover()
        with self.lock:
            self.ledger.controller.status = ControllerStatus.RUNNING
            self.ledger.controller.pid, self.ledger.controller.started = os.getpid(), time.time()
        self.state.save()
        self.state.event("start", programme=self.state.name, variants=len(self.ledger.variants),
                         slices=",".join(self.sub.slices), budget=self.sub.budget if self.sub.budget is not None else "none",
                         spent=f"{self.spent_hours():.3f}")
        self.apply_commands(mirror=True)
        workers = [threading.Thread(target=self.slice_worker, args=(s,), name=f"slice-{s}", daemon=True)
                   for s in self.sub.slices]
        for w in workers:
            w.start()
        while any(w.is_alive() for w in workers):
            try:
                try:
                    self.apply_commands()
                except UserError as e:  # a state file could not be written (StateWriteError): all stop, in its line
                    if not self.stop.is_set():
                        self.halt(Stop(str(e), e.exit_code))
                time.sleep(self.sleep_s)  # how often requests are looked for
            except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (`run` turns it into this)
                self.halt(Stop("interrupted; run it again to carry on", EXIT_INTERRUPTED))
        return self.finish()

    def stop_line(self, why: Stop) -> str:
        """The stop's line (call under the lock): what each variant it stopped kept or lost (a stop whose
        --stop-grace ran out before the trainer saved loses the steps since its last checkpoint), and the
        slices it leaves READY, billing, with what they cost an hour."""
        said = []
        for variant, (saved, reached) in sorted(self.stopped.items()):
            lost = max(0, reached - saved) if saved is not None and reached is not None else 0
            said.append(f"{variant} lost {lost} step{'s' * (lost != 1)} (it reached step {reached}, its last "
                        f"checkpoint is step {saved}: the --stop-grace of {self.sub.stop_grace_s:g} s ran out "
                        "before it saved)" if lost else f"{variant} stopped at its checkpoint of step {saved}")
        line = why.line if not said else f"{why.line}: {'; '.join(said)}"
        kept = {name: s.clock.hosts for name, s in self.ledger.slices.items() if s.clock.ready_since is not None}
        if kept:
            line += (f"; kept READY, billing {len(kept)} pod-hour{'s' * (len(kept) != 1)} ({sum(kept.values())} "
                     f"host-hours) an hour until deleted: {', '.join(kept)} (`programme run {self.state.name}` "
                     f"carries on on them; to delete them: `programme stop {self.state.name} --release`, then "
                     f"`programme run {self.state.name}`, where the checkpoints are on gs://, else `gcloud compute "
                     f"tpus tpu-vm delete SLICE --zone {self.sub.zone}`)")
        elif why.release:
            line += f"; its slices were deleted (`programme run {self.state.name}` creates them again)"
        return line

    def recover(self) -> None:
        """A controller killed mid-run: its variants were running; each resumes on its own slice
        (a skip asked meanwhile is honoured once it has stopped)."""
        with self.lock:
            for record in self.ledger.variants.values():
                if record.state == VariantState.RUNNING:
                    move(record, Move.REQUEUE)
        self.state.save()

    def finish(self) -> int:
        with self.lock:
            for record in self.ledger.variants.values():
                if record.skip and record.state == VariantState.QUEUED:
                    move(record, Move.SKIP)
                record.skip = False
            why = self.stopping
            if why is not None:
                status, line, code = ControllerStatus.STOPPED, self.stop_line(why), why.code
            elif self.budget_line:
                status, line, code = ControllerStatus.BUDGET, self.budget_line, 0
            else:
                status, line, code = ControllerStatus.DONE, None, 0
            controller = self.ledger.controller
            controller.status, controller.line, controller.ended = status, line, time.time()
            self.note_spending()
            counts = {s: sum(r.state == s for r in self.ledger.variants.values())
                      for s in (VariantState.COMPLETED, VariantState.FAILED, VariantState.SKIPPED, VariantState.QUEUED)}
        self.state.save()
        self.state.event("controller-" + status, code=code, spent=f"{self.spent_hours():.3f}", **counts)
        if line:
            print(f"error: {line}" if code else line, file=sys.stderr if code else sys.stdout, flush=True)
        if status == ControllerStatus.STOPPED and code:
            self.alert(f"{self.state.name}: the controller stopped", line or "")
        return code


class _SliceRecord(supervise.Supervision):
    """The record a slice's own release writes to (never saved: the slice's clock is the ledger's):
    events into the controller's log."""

    prefix = "[programme]"

    def __init__(self, state: State, slice_name: str) -> None:
        self.state, self.slice = state, slice_name
        super().__init__(SupervisionRecord(status=Status.RELEASED), state.lock, io.StringIO(), state.dir / "ledger.json")

    def save(self) -> None:
        self.state.save()

    def event(self, name: str, **fields) -> None:
        self.state.event(name, slice=self.slice, **fields)


class Alerts:
    """wandb.alert on a failed variant and when the controller stops, when W&B is online (the
    programme's runs log online, as their composed config says, and WANDB_API_KEY is set here);
    else nothing. The alerts go to a run of their own in the runs' project."""

    def __init__(self, sub: Submission) -> None:
        self.sub = sub
        self.wandb = self.runs_wandb(sub) if os.environ.get("WANDB_API_KEY") else None
        self.online = self.wandb is not None and str(getattr(self.wandb.mode, "value", self.wandb.mode)) == "online"
        self.run = None
        self.warned = False

    @staticmethod
    def runs_wandb(sub: Submission):
        """The W&B settings of the programme's runs (its first variant's composed config), or None."""
        from runtime import hydra_compose  # here: JAX and Hydra take seconds; only submit and run compose

        try:
            return hydra_compose.composed(sub.overrides_of(sub.variants[0])).run.wandb if sub.variants else None
        except Exception:  # noqa: BLE001 - the preflight said why; no alerts then
            return None

    def send(self, title: str, text: str) -> None:
        if not self.online:
            return
        try:
            import wandb  # optional and heavy: only when an alert is sent

            if self.run is None:
                self.run = wandb.init(project=self.wandb.project, entity=self.wandb.entity,
                                      name=f"programme-{self.sub.name}", id=f"programme-{self.sub.name}",
                                      job_type="programme", tags=[self.sub.name], resume="allow")
            self.run.alert(title=title, text=text[:1000])
        except Exception as e:  # noqa: BLE001 - an alert never stops the programme
            if not self.warned:
                self.warned = True
                print(f"WARNING wandb.alert failed ({type(e).__name__}: {e}); the controller log has the events",
                      file=sys.stderr, flush=True)


def run(state_dir: Path, mirror: str | None = None, *, stream: TextIO | None = None,
        alert: Callable[[str, str], None] | None = None) -> int:
    """`programme run`: take the lease, then run the controller to its end. SIGTERM (systemd's
    stop) is handled as Ctrl-C: the running variants checkpoint, the controller exits 130."""
    state = State(state_dir, stream)
    state.load(mirror)
    if mirror and not state.sub.mirror:
        state.sub.mirror = mirror
    lease = hold_lease(state)  # LeaseHeld: the caller says it in one line
    previous = (signal.signal(signal.SIGTERM, supervise.sigterm_as_ctrl_c)
                if threading.current_thread() is threading.main_thread() else None)
    try:
        return Controller(state, alert=alert).run()
    finally:
        lease.release()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
