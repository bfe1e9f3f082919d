"""The train loop: step, log, evaluate, checkpoint, NaN guard, preemption, watchdog, profiler.

`train_loop(ctx, state, position)` runs optimizer steps `position .. plan.total_steps` and
returns (exit code, status for the manifest, final metrics). Everything it needs is in one
`LoopContext`; the evaluators (a dataset kind's, a model family's) come in it as a list.

Time is accounted as it goes (runtime/goodput.py): the loop is `train` time except the batches it
waits for, evaluations, checkpoint saves, log rows and compiles; a `timing` event follows every
log row. Evaluations before the last run on `train.eval_subset` of the eval set, the last one on
all of it. Saves come every `checkpoint_every` steps and, with `train.checkpoint_every_minutes`,
at the first log row after that many minutes (`SaveClock`: process 0's clock decides for all).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np

from runtime import events, liveness
from runtime.builder import curriculum_metrics
from runtime.checkpointing import Checkpoints, SaveClock
from runtime.config import Config, Plan
from runtime.errors import EXIT_FAILURE, EXIT_NONFINITE, EXIT_PREEMPTED, UserError, one_line
from runtime.evaluation import evaluate
from runtime.executables import Ahead
from runtime.goodput import Category, Timing
from runtime.metrics_sinks import MetricsSinks
from runtime.perf import StepTimer, formula_flops_per_step, peak_flops_per_device
from runtime.preemption import PreemptionWatcher
from runtime.task import Evaluator
from runtime.watchdog import Watchdog

log = logging.getLogger("runtime")


@dataclass
class LoopContext:
    config: Config
    plan: Plan
    steps: Any  # runtime.train_step.Steps (steps.at_step(step): a curriculum stage's)
    feeder: Any
    eval_feeder: Any
    ckpt: Checkpoints
    sinks: MetricsSinks
    run_id: str
    config_dict: dict
    seq_len: int  # tokens per row, for throughput figures
    init_states: Any = None  # kept in every checkpoint's metadata (resume rebuilds the same model)
    evaluators: Sequence[Evaluator] = field(default_factory=list)
    # Installed when the run starts (a SIGTERM during the first compile is a preemption too); None:
    # the loop installs its own.
    preemption: Optional[PreemptionWatcher] = None
    # Called with "at step N" at every metrics row: raises OutputDirError when a file the run writes
    # by path (its run.log) has something else standing in its place now (runtime/run_log.py).
    check_outputs: Optional[Callable[[str], None]] = None
    timing: Timing = field(default_factory=Timing)  # the run's time account (a fresh one: from the loop's start)
    ahead: Ahead = field(default_factory=lambda: Ahead(None, None))  # steps compiled ahead (run.executables)


def compiled_memory(compiled) -> dict[str, float]:
    """Per-device bytes of the compiled train step (arguments = state + batch; temporaries =
    activations and workspace), in GiB; empty where the backend does not report them."""
    try:
        mem = compiled.memory_analysis()
        return {"perf/compiled_argument_gib": mem.argument_size_in_bytes / 2**30,
                "perf/compiled_temp_gib": mem.temp_size_in_bytes / 2**30}
    except Exception:  # noqa: BLE001 - diagnostics only
        return {}


class _Progress:
    """The loop's bookkeeping: compiled steps per curriculum stage, metrics not yet fetched
    from the device, the latest train/eval metrics, the last good checkpoint."""

    def __init__(self, ctx: LoopContext, state, position: int):
        self.ctx, self.state = ctx, state
        with ctx.timing.measure(Category.DATA_LOADING):
            self.first_batch = ctx.feeder.train_batch(position)
        self.compiled: dict[int, Any] = {}
        self.timer: StepTimer | None = None
        self.pending: list[tuple[int, dict]] = []
        self.last_good_ckpt = ctx.ckpt.latest_step()
        self.train_metrics: dict[str, float] = {}
        self.eval_metrics: dict[str, float] = {}

    def step_fn(self, step: int):
        """The compiled train step of the curriculum stage in use at `step` (compiled once)."""
        stage = self.ctx.steps.at_step(step)
        if id(stage) not in self.compiled:
            with self.timer.paused() if self.timer is not None else contextlib.nullcontext():
                t0 = time.perf_counter()
                self.compiled[id(stage)] = self.ctx.ahead.compile(stage.train.lower(self.state, self.first_batch),
                                                                  "train step")
                stage.eval = self.ctx.ahead.wrap(stage.eval, "eval step")  # its evaluations' program too
                hits, misses = self.ctx.timing.cache_counts()
                log.info("compiled train step in %.1fs (compile cache so far: %d hits, %d misses)",
                         time.perf_counter() - t0, hits, misses)
            if self.timer is not None:  # a curriculum stage with other cycle counts: other FLOPs per step
                self.timer.flops_per_step = self.formula_flops(stage)
        return self.compiled[id(stage)]

    def formula_flops(self, stage) -> float | None:
        """Model FLOPs per step per device of `stage`'s task, by its formula."""
        return formula_flops_per_step(stage.task, self.ctx.seq_len, self.ctx.plan.global_batch_size, jax.device_count())

    def start_timer(self, position: int) -> None:
        ctx = self.ctx
        compiled = self.step_fn(position)
        xla_flops = (compiled.cost_analysis() or {}).get("flops")
        flops = self.formula_flops(ctx.steps.at_step(position))
        # XLA counts a loop body once (TRM/HRM recursion, layer scans), so MFU uses the formula
        log.info("model FLOPs/step/device: %s by formula (MFU, TFLOP/s); XLA's count with loop bodies once: %s",
                 f"{flops:.4g}" if flops else "unknown", xla_flops)
        ctx.sinks.log(position, {"model/params": sum(x.size for x in jax.tree.leaves(self.state.params))}
                      | ({"model/flops_per_step_per_device": flops} if flops else {}) | compiled_memory(compiled))
        self.timer = StepTimer(ctx.plan.global_batch_size, ctx.seq_len, flops, peak_flops_per_device(jax.devices()[0]))
        self.timer.lap(position)

    @property
    def started_timer(self) -> StepTimer:
        """The step timer, which train_loop starts before any step, evaluation or save."""
        assert self.timer is not None, "start_timer first"
        return self.timer

    def drain(self) -> bool:
        """Fetch pending metrics into `train_metrics`; False if any step was non-finite."""
        fetched = jax.device_get([m for _, m in self.pending])
        bad = [s for (s, _), m in zip(self.pending, fetched) if not m["finite"]]
        if bad:
            where = self.last_good_ckpt
            line = (f"non-finite loss or gradient at step {bad[0]}; stopping. Last good checkpoint: "
                    + (f"step {where} in {self.ctx.plan.checkpoint_dir}" if where is not None else "none"))
            log.error("%s", line)
            self.ctx.timing.finish()  # the last account, before the end's event
            events.failed(EXIT_NONFINITE, line)
            return False
        if fetched:  # task metrics from the sums over the interval (ratios of sums, not means of ratios)
            totals = {k: sum(float(m["sums"][k]) for m in fetched) for k in fetched[-1]["sums"]}
            rows = self.ctx.plan.global_batch_size * len(fetched)
            self.train_metrics.update({f"train/{k}": v for k, v in self.ctx.steps.summarize(totals, rows, True).items()})
            self.train_metrics.update({f"train/{k}": float(np.mean([m[k] for m in fetched])) for k in fetched[-1]
                                       if k not in ("finite", "sums")})
        self.pending.clear()
        return True

    def evaluate(self, step: int, done: int, watchdog: Watchdog, final: bool) -> None:
        """An evaluation: of the whole eval set when `final`, else of train.eval_subset of it."""
        ctx = self.ctx
        jax.block_until_ready(self.state)  # the steps still running are training's time, not evaluation's
        with self.started_timer.paused(), ctx.timing.measure(Category.EVAL):
            self.eval_metrics = evaluate(ctx.steps.at_step(step), self.state, ctx.eval_feeder,
                                         ctx.config.data.eval_max_examples, ctx.evaluators,
                                         lambda: watchdog.beat(done, "eval"),
                                         subset=None if final else ctx.config.train.eval_subset)
            ctx.sinks.log(done, self.eval_metrics)

    def save(self, done: int) -> None:
        ctx, plan = self.ctx, self.ctx.plan
        jax.block_until_ready(self.state)  # as for an evaluation: only the save's own blocking part counts
        with self.started_timer.paused(), ctx.timing.measure(Category.CHECKPOINT_SAVE):
            position = {"next_batch": done, "examples_seen": done * plan.global_batch_size,
                        "epoch": done / plan.steps_per_epoch, "global_batch_size": plan.global_batch_size,
                        "seed": ctx.config.train.seed, "train_examples": plan.train_examples}
            ctx.ckpt.save(done, self.state, {"step": done, "run_id": ctx.run_id, "config": ctx.config_dict,
                                             "metrics": self.train_metrics | self.eval_metrics,
                                             "data_position": position, "init_states": ctx.init_states})
            self.last_good_ckpt = done
        ctx.timing.saves += 1
        log.info("saving the checkpoint of step %d (asynchronously)", done)  # progress, for operators (launchers read events)

    def profile(self, step: int, done: int | None = None) -> None:
        start, count = self.ctx.config.train.profile_start_step, self.ctx.config.train.profile_steps
        if start is None:
            return
        if done is None and step == start:
            jax.profiler.start_trace(f"{self.ctx.plan.output_dir}/profile")
        elif done is not None and done == start + count:
            jax.block_until_ready(self.state)
            jax.profiler.stop_trace()


def train_loop(ctx: LoopContext, state, position: int) -> tuple[int, str, dict | None]:
    plan, total, timing = ctx.plan, ctx.plan.total_steps, ctx.timing
    if position >= total:
        log.info("nothing to do: the checkpoint is at step %d of %d", position, total)
        return 0, "completed", None
    run = _Progress(ctx, state, position)
    run.start_timer(position)
    preemption = ctx.preemption or PreemptionWatcher()
    watchdog = Watchdog(ctx.config.train.watchdog_timeout_s).start()
    save_clock = SaveClock(ctx.config.train.checkpoint_every_minutes)
    batch, step = run.first_batch, position
    try:
        with timing.measure(Category.TRAIN):
            for step in range(position, total):
                run.profile(step)
                run.state, metrics = run.step_fn(step)(run.state, batch)
                done = step + 1  # optimizer steps taken == index of the next global batch
                timing.step_done(done)
                last = done == total
                if not last:
                    with timing.measure(Category.DATA_LOADING):
                        batch = ctx.feeder.train_batch(done)  # host work overlaps the step running on device
                run.pending.append((done, metrics))
                watchdog.beat(done)
                run.profile(step, done)
                with timing.measure(Category.CHECKPOINT_SAVE):
                    ctx.ckpt.poll()  # a save finished meanwhile: its `checkpoint` event
                preempted = preemption.should_stop(done)
                noticed = time.time()
                log_row = done % plan.log_every == 0 or last
                if log_row or done % plan.checkpoint_every == 0 or preempted:
                    if not run.drain():
                        return EXIT_NONFINITE, "nonfinite", None
                    if log_row:
                        with timing.measure(Category.OTHER):
                            ctx.sinks.log(done, run.train_metrics | run.started_timer.lap(done)
                                          | curriculum_metrics(ctx.config, step, total))
                            if ctx.check_outputs is not None:
                                ctx.check_outputs(f"at step {done}")
                            timing.emit()
                # every process asks at the same steps (log rows): process 0's clock decides for all
                minutes_due = log_row and not last and save_clock.due()
                if done % plan.eval_every == 0 or last:
                    run.evaluate(step, done, watchdog, final=last)
                if done % plan.checkpoint_every == 0 or last or preempted or minutes_due:
                    run.save(done)
                    save_clock.saved()
                if preempted:
                    watchdog.beat(done, "preemption checkpoint")
                    with timing.measure(Category.CHECKPOINT_SAVE):
                        ctx.ckpt.wait()
                    log.warning("preempted (SIGTERM): checkpoint saved at step %d in %s; relaunch the same command to "
                                "resume", done, plan.checkpoint_dir)
                    timing.finish()
                    events.emit("preempted", step=done, noticed=round(noticed, 3))
                    return EXIT_PREEMPTED, "preempted", run.train_metrics | run.eval_metrics
    except UserError:
        raise  # its one line is printed as the run's error
    except Exception as e:
        liveness.failing()  # a lost peer, if that is the cause, is named instead (and this process exits)
        line = f"training failed in step {step + 1}: {one_line(e)[:500]}"
        log.error("%s", line)
        timing.finish()
        events.failed(EXIT_FAILURE, line)
        raise
    finally:
        watchdog.stop()
        if ctx.preemption is None:
            preemption.close()
    return 0, "completed", run.train_metrics | run.eval_metrics
