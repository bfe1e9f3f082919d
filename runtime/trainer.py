"""One training run: join -> preflight -> lease -> data -> plan and build -> state (fresh or
resumed) -> loop -> final save.

`run(config)` returns the process exit code. Its wall time is accounted by category
(runtime/goodput.py) and reported as `timing` events; its compiles go through the run's persistent
compilation cache (runtime/compile_cache.py). Everything a user can get wrong is checked
before the first compile (config, dataset, mesh, batch, checkpoint directory and its
compatibility), and reported as one line by `runtime/job.py`. Dataset kinds and model
families come from the registries (runtime/registry.py); nothing here knows their names.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
from typing import Any, Callable, cast

import jax
import numpy as np
from jax.experimental import multihost_utils

from runtime import compile_cache, events, liveness
from runtime import manifest as manifest_lib
from runtime.builder import plan_and_build
from runtime.checkpointing import Checkpoints, CorruptStep
from runtime.config import Config, planned_steps, resolve_compute_dtype, run_dirs, to_dict
from runtime.distributed import ProcessInfo, initialize
from runtime.errors import (EXIT_FAILURE, EXIT_PREEMPTED, EXIT_STORAGE, OutputDirError, UserError, one_line, storage_fault,
                            storage_fix)
from runtime.evaluation import evaluate
from runtime.executables import Ahead
from runtime.goodput import Category, Timing
from runtime.imported import load_imported_params, load_imported_states
from runtime.lease import Lease, hold_run_lease
from runtime.loop import LoopContext, train_loop
from runtime.metrics_sinks import MetricsSinks
from runtime.preemption import PreemptionWatcher
from runtime.preflight import preflight
from runtime.registry import dataset_kind, family_of
from runtime.run_files import RunFiles
from runtime.run_ids import PROPOSED_RUN_ID_ENV, RUN_ID
from runtime.run_log import console_logging, library_logs_to, run_log_path
from runtime.sharding import batch_sharding, describe
from runtime.task import EvalContext
from runtime.train_step import lr_schedule, warmup_cosine

log = logging.getLogger("runtime")


def setup_logging(is_primary: bool) -> None:
    """Process 0 logs progress; the others only warnings and errors (libraries: one line each)."""
    console_logging(logging.INFO if is_primary else logging.WARNING, "%(asctime)s %(levelname)s %(message)s",
                    "%H:%M:%S")


def ensure_dataset(config: Config, info: ProcessInfo) -> None:
    """Build a generated dataset that is missing (process 0 first; then every worker, for
    workers with their own disks: the builders are seeded, so they build the same data)."""
    kind = dataset_kind(config.data.name)
    if info.is_primary:
        kind.ensure_built(config.data)
    if info.process_count > 1:
        multihost_utils.sync_global_devices("dataset ready")
        kind.ensure_built(config.data)


def new_run_id(config: Config) -> str:
    """A W&B-safe id agreed by all processes (process 0's random draw, broadcast)."""
    token = multihost_utils.broadcast_one_to_all(np.frombuffer(os.urandom(4), np.uint32))
    name = re.sub(r"[^a-zA-Z0-9_-]", "-", cast(str, config.run.name))[:40]  # validate() names every run
    return f"{name}-{int(token[0]):08x}"


def choose_run_id(config: Config, meta: dict | None, directory: str, step: int | None, proposed: str | None) -> str:
    """The run's id (W&B run, manifest, checkpoints), said in one `run id X (why)` line.

    Resuming: the checkpoint's id. A given run.id must equal it (a different one is a UserError:
    it would split one run's history in two). Fresh: run.id, else the launcher's `proposed` one,
    its $PODRUNNER_RUN_ID (launch.py pod without --run-id: a proposal only, so relaunching a run
    resumes it under its own id), else a new random one."""
    if meta is not None:
        saved = meta["run_id"]
        if config.run.id and config.run.id != saved:
            raise UserError(f"run.id={config.run.id} differs from the run id {saved} of the checkpoint (step {step}) "
                            f"in {directory}; drop run.id (launch.py: --run-id) to resume as {saved}, or use a new "
                            "run.name (or run.checkpoint.dir) to start a fresh run")
        run_id, why = saved, "resumed from the checkpoint"
    elif config.run.id:
        run_id, why = config.run.id, "run.id"
    elif proposed:
        if not RUN_ID.fullmatch(proposed):
            raise UserError(f"{PROPOSED_RUN_ID_ENV}={proposed!r} is not a run id: use 1-64 letters, digits, '.', '_' "
                            f"or '-', or unset {PROPOSED_RUN_ID_ENV}")
        run_id, why = proposed, f"a fresh run: the launcher's {PROPOSED_RUN_ID_ENV}"
    else:
        run_id, why = new_run_id(config), "a fresh run"
    log.info("run id %s (%s)", run_id, why)
    return run_id


def check_resumable(meta: dict[str, Any], config: Config, train_examples: int, directory: str, step: int) -> None:
    """Refuse to resume a checkpoint written for a different model or a different data order
    (which depends on seed, global batch and dataset size, not on where the data lives)."""
    saved = dict(meta.get("config", {}), dataset={"train_examples": meta["data_position"].get("train_examples")})
    config = resolve_compute_dtype(config, jax.default_backend(), saved.get("arch"))  # "auto" takes the saved dtype
    now = dict(to_dict(config), dataset={"train_examples": train_examples})
    # What the checkpoint's numbers depend on: a sweep that reuses one checkpoint directory must
    # not resume another variant's run (optimizer, EMA and curriculum included). The step sizes
    # (lr, puzzle_emb_lr, warmup, clipping) may change: relaunching with a lower lr after a
    # spike is the usual recovery.
    optim_keys = tuple(f.name for f in dataclasses.fields(config.optim)
                       if f.name not in ("lr", "puzzle_emb_lr", "warmup_steps", "grad_clip_norm"))
    checks = (("arch", None), ("optim", optim_keys), ("curriculum", None), ("train", ("seed", "global_batch_size")),
              ("data", ("name",)), ("dataset", None))
    forms = set(family_of(config.arch).forms)  # how a step computes, not what: any value resumes
    for section, keys in checks:
        old, new = saved.get(section, {}), now[section]
        if section == "arch":
            old, new = ({k: v for k, v in d.items() if k not in forms} for d in (old, new))
        if keys is None and old:  # keys added to the schema since the checkpoint was written: not compared
            added = sorted(set(new) - set(old))
            if added:
                log.warning("checkpoint step %d predates %s; resuming with their values now: %s", step,
                            ", ".join(f"{section}.{k}" for k in added), ", ".join(repr(new[k]) for k in added))
        for key in keys or sorted(set(old)):
            if old.get(key) != new.get(key):
                raise UserError(
                    f"checkpoint step {step} in {directory} was written with {section}.{key}={old.get(key)!r}, this run "
                    f"has {new.get(key)!r}; use the same value to resume, or a new run.name (or run.checkpoint.dir) to start fresh")


def available_host_bytes() -> int | None:
    """This machine's available memory (MemAvailable of /proc/meminfo), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def check_host_memory(abstract_state: Any, platform: str) -> None:
    """On CPU devices the train state lives in host memory, one shard per local device (a
    replicated array once per device): a state larger than the memory available is one line
    naming the size and the fix, before anything is allocated, rather than an allocation failure
    deep in XLA or the kernel's OOM killer."""
    if platform != "cpu":
        return
    need = 0
    for leaf in jax.tree.leaves(abstract_state):
        sharding = getattr(leaf, "sharding", None)
        shard, copies = (leaf.shape, 1) if sharding is None else (sharding.shard_shape(leaf.shape),
                                                                  len(sharding.addressable_devices))
        need += math.prod(shard) * getattr(leaf.dtype, "itemsize", 4) * copies
    have = available_host_bytes()
    if have is not None and need > have:
        raise UserError(f"the train state needs {need / 2**30:.1f} GiB of host memory on these CPU devices (parameters, "
                        f"optimizer state and EMA, a copy per device where replicated) but {have / 2**30:.1f} GiB is "
                        "available; use a smaller model (arch sizes), mesh=fsdp to shard it, or plan it for a TPU "
                        "with compile_only=<topology>")


def read_init_states(config: Config, meta: dict | None) -> Any:
    """The model's recurrent init states: from the checkpoint being resumed, else from the
    imported directory (train.init_params_from), else None (the family's own)."""
    if meta is not None:
        return meta.get("init_states")
    if not config.train.init_params_from:
        return None
    states = load_imported_states(config.train.init_params_from)
    if states is None:
        return None
    return {name: np.asarray(v, np.float32).tolist() for name, v in states.items()}


def load_init_params(path: str, abstract_params: Any) -> Any:
    """Parameters from an imported directory (DIR/params), placed with the run's shardings."""
    try:
        return load_imported_params(path, abstract_params)
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"train.init_params_from={path} does not fit this model ({one_line(e)[:300]}); "
                        "import with the same arch values and dataset sizes as this run") from e


def initial_state(config: Config, steps, ckpt: Checkpoints, resumed: tuple[int | None, dict | None],
                  train_examples: int) -> tuple[Any, int | None, dict | None]:
    """(state, resumed step, its metadata): the resumed state (see resumed_state), else a new one."""
    if resumed[0] is None:
        return new_state(config, steps), None, None
    # a resumed step comes with its metadata
    step, meta, state = resumed_state(config, steps, ckpt, cast(tuple[int, dict], resumed), train_examples)
    log.info("resumed from step %d of %s", step, ckpt.directory)
    return state, step, meta


def new_state(config: Config, steps):
    """A state from imported or pretrained parameters, else a fresh init."""
    rng = jax.random.key_data(jax.random.key(config.train.seed))
    if config.train.init_params_from:
        log.info("parameters from %s", config.train.init_params_from)
        return steps.init_from(rng, load_init_params(config.train.init_params_from, steps.abstract_state.params))
    pretrained = steps.task.load_pretrained(steps.abstract_state.params, jax.random.key(config.train.seed))
    if pretrained is not None:
        log.info("pretrained weights from the arch's checkpoint")
        return steps.init_from(rng, pretrained)
    if config.train.eval_only:  # a random init's numbers would look like a result
        raise UserError(f"train.eval_only=true but there is nothing to evaluate: no checkpoint in {run_dirs(config)[1]}, "
                        "no train.init_params_from and no pretrained weights (arch.checkpoint); point one of them at "
                        "a trained model, or drop train.eval_only")
    return steps.init(rng)


def resumable_meta(config: Config, ckpt: Checkpoints, step: int, train_examples: int) -> dict:
    """The step's metadata, checked against this run (a UserError naming the config if it does not fit)."""
    meta = ckpt.read_meta(step)
    if not {"run_id", "data_position"} <= meta.keys():
        raise CorruptStep(ckpt.directory, step, "meta: no run_id or data_position")
    check_resumable(meta, config, train_examples, ckpt.directory, step)
    return meta


def resume_point(config: Config, ckpt: Checkpoints, train_examples: int) -> tuple[int | None, dict | None]:
    """(latest complete step, its metadata), after checking the checkpoint fits this run. A step
    whose metadata cannot be read is quarantined and the one before it used."""
    if ckpt.latest_step() is None:
        if ckpt.quarantined_names():  # relaunched after every step was quarantined: never start over silently
            raise ckpt.nothing_left()
        return None, None
    if not config.run.checkpoint.resume:
        raise UserError(f"{ckpt.directory} already holds checkpoints (latest step {ckpt.latest_step()}) and "
                        "run.checkpoint.resume=false; pick a new run.name or run.checkpoint.dir so nothing is overwritten")
    return ckpt.first_readable(lambda step: resumable_meta(config, ckpt, step, train_examples))


def resumed_state(config: Config, steps, ckpt: Checkpoints, resumed: tuple[int, dict],
                  train_examples: int) -> tuple[int, dict, Any]:
    """(step, meta, state) of the newest step whose state restores, starting at `resumed` (the
    step the model was built for). A corrupt state is quarantined and the step before it used
    (see Checkpoints.first_readable), its metadata read and checked again."""
    built_step, built_meta = resumed

    def read(step: int) -> tuple[dict, Any]:
        meta = built_meta if step == built_step else resumable_meta(config, ckpt, step, train_examples)
        return meta, ckpt.restore_state(step, steps.abstract_state)

    step, (meta, state) = ckpt.first_readable(read)
    if meta.get("init_states") != built_meta.get("init_states"):  # the model was built with built_step's
        raise UserError(f"checkpoint step {step} in {ckpt.directory} holds other init states than step {built_step}, "
                        f"which was unreadable and quarantined; relaunch the same command to resume from step {step}")
    return step, meta, state


def schedule_change(config: Config, plan, meta: dict | None, step: int | None, *, announce: bool) -> dict | None:
    """How the lr schedule changed when the planned total steps differ from those of the run that
    wrote the checkpoint (a relaunch with another train.steps or train.epochs), said in one line
    if `announce`; None if they do not differ."""
    saved = (meta or {}).get("config", {})
    old_train, old_optim = saved.get("train", {}), saved.get("optim", {})
    if step is None or (old_train.get("steps") is None and old_train.get("epochs") is None):
        return None
    old_total = planned_steps(old_train.get("steps"), old_train.get("epochs"), plan.epoch_examples / plan.global_batch_size)
    if old_total == plan.total_steps:
        return None
    name = "steps" if config.train.steps is not None else "epochs"
    setting = f"train.{name} changed from {old_train.get(name)} to {getattr(config.train, name)}"
    if name == "epochs" or old_train.get(name) is None:
        setting += f" ({old_total} -> {plan.total_steps} steps)"
    new = lr_schedule(config.optim, plan.total_steps, plan.warmup_steps)
    old = warmup_cosine(old_optim.get("lr", config.optim.lr), old_optim.get("lr_min_ratio", config.optim.lr_min_ratio),
                        old_total, min(old_optim.get("warmup_steps", config.optim.warmup_steps), old_total))
    change = {"setting": setting, "at_step": step, "total_steps_before": old_total, "total_steps": plan.total_steps,
              "warmup_steps": plan.warmup_steps, "lr_next_step_before": float(old(step)), "lr_next_step": float(new(step)),
              "lr_last_step": float(new(plan.total_steps - 1))}
    if announce:
        log.warning("%s at step %d: the cosine schedule now ends at step %d (lr at step %d: %.3g, was %.3g on the old "
                    "schedule; %.3g at the last step)", setting, step, plan.total_steps, step + 1,
                    change["lr_next_step"], change["lr_next_step_before"], change["lr_last_step"])
    return change


def run_evaluators(config: Config, kind, steps, context: EvalContext) -> list:
    """The dataset kind's evaluators, then the model family's."""
    evaluators = kind.evaluators(config.data, context) + steps.task.evaluators(context)
    if any(e.wants_rows for e in evaluators) and steps.eval_rows is None:
        raise UserError(f"data.name={config.data.name} evaluates per-row outputs that arch {config.arch.name!r} does not "
                        "produce; use a TRM/HRM arch")
    return evaluators


def open_sinks(config: Config, plan, info: ProcessInfo, run_id: str, position: int, config_dict: dict,
               git_commit: str | None) -> MetricsSinks:
    wb = config.run.wandb
    return MetricsSinks(is_primary=info.is_primary, output_dir=plan.output_dir, wandb_mode=wb.mode,
                        wandb_project=wb.project, wandb_entity=wb.entity,
                        group=cast(str, config.run.group), name=cast(str, config.run.name),  # validate() sets both
                        run_id=run_id, config=config_dict, total_steps=plan.total_steps, start_step=position,
                        tags=list(wb.tags), progress_bar=config.run.progress_bar, system_metrics=wb.system_metrics,
                        console=wb.console, git_commit=git_commit)


def run(config: Config, started: float | None = None) -> int:
    """The run; `started`: when its process began (Unix time, runtime.goodput.process_start), where
    its timing account starts; None: now (a run inside a longer process)."""
    proposed = os.environ.get(PROPOSED_RUN_ID_ENV)
    timing = Timing(started=started)
    with compile_cache.watching(timing):
        with timing.measure(Category.RUNTIME_STARTUP, since=timing.started):  # imports, backend, jax.distributed
            setup_logging(is_primary=True)
            info = initialize(config.distributed)
            setup_logging(info.is_primary)
        output_dir, checkpoint_dir = run_dirs(config)
        preflight(config, checkpoint_dir=checkpoint_dir, output_dir=output_dir, is_primary=info.is_primary)
        # Before anything is written to the run's directories: one run at a time writes there.
        lease = hold_run_lease(config, info.is_primary, info.process_count, output_dir, checkpoint_dir)
        preemption = PreemptionWatcher()  # from here on a SIGTERM (a preemption) ends the run cleanly, compiles included
        events.attach(output_dir, process=info.process_index)  # the run's directory is this run's now
        timing.live = True
        refused = False
        try:
            with (library_logs_to(run_log_path(output_dir, info.process_index)) as check_run_log,
                  compile_cache.configured(config.run.compile_cache, checkpoint_dir, config.run.root) as cache):
                try:
                    return run_leased(config, info, checkpoint_dir, lease, preemption, timing, check_run_log,
                                      proposed_run_id=proposed)
                finally:
                    hits, misses = timing.cache_counts()
                    log.info("compile cache %s: %d hits, %d misses in this run", cache or "off", hits, misses)
        except UserError:
            refused = True  # bad input said in one line: the run's files stay as they were (its end said any account)
            raise
        finally:
            if not refused:
                timing.finish()  # the process's last account, unless the run's end already said it
            preemption.close()
            events.detach()
            if lease is not None:
                lease.release()


def preempted_early(preemption: PreemptionWatcher, step: int, timing: Timing) -> bool:
    """Whether a SIGTERM came before the first step (one process; a pod's processes agree on the
    step through JAX's preemption service instead): nothing was trained in this launch, so
    nothing new is saved, and a relaunch resumes from `step` (what the checkpoint holds)."""
    if not preemption.signalled:
        return False
    log.warning("preempted (SIGTERM) before the first step: nothing was trained in this launch, so nothing new is "
                "saved; relaunch the same command to go on")
    timing.finish()
    events.emit("preempted", step=step, before_first_step=True)
    return True


def run_leased(config: Config, info: ProcessInfo, checkpoint_dir: str, lease: Lease | None,
               preemption: PreemptionWatcher, timing: Timing, check_run_log: Callable[[str], None] | None = None,
               *, proposed_run_id: str | None = None) -> int:
    kind = dataset_kind(config.data.name)
    with timing.measure(Category.DATA_LOADING):
        ensure_dataset(config, info)
        train_split, eval_split = (kind.load_split(config.data, s) for s in (config.data.train_split,
                                                                             config.data.eval_split))
        shape = kind.shape(config.data, train_split)
    files = RunFiles(output_dir_of(config), checkpoint_dir) if info.is_primary else None

    def on_commit(step: int) -> None:  # the account at each commit
        timing.emit()
        committed(step, files)

    ckpt = Checkpoints(checkpoint_dir, keep=config.run.checkpoint.keep, async_save=config.run.checkpoint.async_save,
                       on_commit=on_commit)
    looked = timing.clock()
    start_step, meta = resume_point(config, ckpt, shape.examples)
    with timing.measure(Category.CHECKPOINT_RESTORE if start_step is not None else Category.OTHER, since=looked):
        pass  # a fresh start restored nothing: its look for a checkpoint is not a restore
    config = resolve_compute_dtype(config, jax.default_backend(), ((meta or {}).get("config") or {}).get("arch"))
    run_id = choose_run_id(config, meta, ckpt.directory, start_step, proposed_run_id)
    if lease is not None:
        lease.set_run_id(run_id)
    init_states = read_init_states(config, meta)
    plan, mesh, steps = plan_and_build(config, devices=jax.devices(), num_processes=info.process_count, shape=shape,
                                       init_states=init_states)
    check_host_memory(steps.abstract_state, info.platform)
    ahead = Ahead(config.run.executables, mesh, timing, config.run.executables_digest)
    if preempted_early(preemption, start_step or 0, timing):
        ckpt.close()
        return EXIT_PREEMPTED
    evaluators = run_evaluators(config, kind, steps, EvalContext(config=config, eval_split=eval_split, mesh=mesh,
                                                                 global_batch=plan.global_batch_size,
                                                                 output_dir=plan.output_dir))
    with timing.measure(Category.CHECKPOINT_RESTORE if start_step is not None else Category.OTHER):
        state, start_step, meta = initial_state(config, steps, ckpt, (start_step, meta), shape.examples)
    change = schedule_change(config, plan, meta, start_step, announce=info.is_primary)
    log.info("parameters (%d):\n%s", sum(x.size for x in jax.tree.leaves(state.params)), describe(state.params))
    position = int(meta["data_position"]["next_batch"]) if meta else 0
    timing.step = position

    feeder, eval_feeder = (kind.make_feeder(split, batch_sharding(mesh, 1), batch, config.train.seed, prefetch=prefetch)
                           for split, batch, prefetch in ((train_split, plan.global_batch_size, True),
                                                          (eval_split, plan.eval_batch_size, False)))
    config_dict = to_dict(config)
    manifest = manifest_lib.new_manifest(config=config_dict, plan=dataclasses.asdict(plan), run_id=run_id,
                                         resumed_from=start_step, schedule_change=change, quarantined=ckpt.quarantined)
    if files:  # a re-created VM's fresh disk: the metrics so far come back from beside the checkpoints
        files.restore(start_step)
    try:
        sinks = open_sinks(config, plan, info, run_id, position, config_dict, manifest_lib.source_commit(manifest))
    except BaseException:  # metrics.jsonl or W&B files cannot be written: stop what was started, then say so
        feeder.close()
        _best_effort(ckpt.close, "closing the checkpoint manager")
        raise
    events.emit("started", run_id=run_id, step=position, total=plan.total_steps, resumed=start_step is not None,
                run=f"{config.run.group}/{config.run.name}", output_dir=plan.output_dir, checkpoint_dir=plan.checkpoint_dir)
    status, exit_code, final = "failed", EXIT_FAILURE, None
    failure: tuple[int, str, events.Failure | None] | None = None  # (exit code, line, its finer class)
    unhook = liveness.on_abrupt_exit(lambda code: record_abrupt_end(manifest, plan, code)) if info.is_primary else None
    try:
        if info.is_primary:
            write_manifest(manifest, plan.output_dir, plan.checkpoint_dir)
        if config.train.eval_only:
            with timing.measure(Category.EVAL):
                steps.eval = ahead.wrap(steps.eval, "eval step")
                final = evaluate(steps, state, eval_feeder, config.data.eval_max_examples, evaluators)
            sinks.log(position, final)
            status, exit_code = "evaluated", 0
            timing.finish()
            events.emit("completed", step=position, metrics=final, evaluated=True)
            return exit_code
        if preempted_early(preemption, position, timing):  # the signal came while the state was built (the first compile)
            status, exit_code = "preempted", EXIT_PREEMPTED
            return exit_code
        ctx = LoopContext(config=config, plan=plan, steps=steps, feeder=feeder, eval_feeder=eval_feeder, ckpt=ckpt,
                          sinks=sinks, run_id=run_id, config_dict=config_dict, seq_len=shape.seq_len,
                          init_states=init_states, evaluators=evaluators, preemption=preemption,
                          check_outputs=check_run_log, timing=timing, ahead=ahead)
        exit_code, status, final = train_loop(ctx, state, position)
        with timing.measure(Category.CHECKPOINT_SAVE):
            ckpt.wait()  # the run is done only when its last checkpoint is committed
        if status == "completed":
            log.info("completed: step %d of %d, its checkpoint committed", plan.total_steps, plan.total_steps)
            timing.finish()
            events.emit("completed", step=plan.total_steps, metrics=final or (meta or {}).get("metrics"))
        return exit_code
    except OutputDirError as e:  # add where a relaunch resumes from
        status, exit_code = "failed", e.exit_code
        _best_effort(ckpt.wait, "committing the checkpoint in flight")
        error = with_last_checkpoint(e, ckpt)
        failure = (error.exit_code, str(error), None)
        raise error from e
    except UserError as e:
        status, exit_code, failure = "failed", e.exit_code, (e.exit_code, str(e), events.failure_of(e))
        raise
    except Exception as e:  # a crash: its traceback follows (pretrain_jax.py)
        failure = (EXIT_FAILURE, one_line(e), None)
        raise
    finally:  # record how it ended; never let a second failure here hide the first
        if exit_code not in (0, EXIT_PREEMPTED):  # a lost peer, the likelier cause, is reported instead
            liveness.failing()  # (the hook records it)
        if failure is not None:
            timing.finish()
            events.failed(*failure)
        if unhook:
            unhook()
        feeder.close()
        _best_effort(ckpt.close, "closing the checkpoint manager")
        try:
            if info.is_primary:
                record_end(manifest, plan, sinks, exit_code=exit_code, status=status, final=final, timing=timing,
                           beside_checkpoints=not ckpt.save_failed)
        except OutputDirError as e:  # a run that succeeded, but the manifest (or W&B's copy) could not be written
            raise with_last_checkpoint(e, ckpt) from e
        finally:
            sinks.close(exit_code)
            timing.finish()  # unless the end's event was said (the account comes just before it)
            if files:  # how it ended, beside the checkpoints too
                files.flush()


def with_last_checkpoint(e: OutputDirError, ckpt: Checkpoints) -> OutputDirError:
    """`e`, saying where a relaunch resumes from."""
    last = ckpt.last_complete
    return OutputDirError(f"{e}; the last complete checkpoint: {'none yet' if last is None else f'step {last}'}")


def output_dir_of(config: Config) -> str:
    return run_dirs(config)[0]


def committed(step: int, files: RunFiles | None) -> None:
    """A checkpoint is committed: say so, and copy the run's files beside it (process 0)."""
    events.emit("checkpoint", step=step)
    if files:
        files.sync()


def write_manifest(manifest: dict, *directories: str) -> list[str]:
    """run_manifest.json into each directory; a failed write is one line (exit 6)."""
    try:
        return manifest_lib.write(manifest, *directories)
    except Exception as e:
        fault = storage_fault(e)
        where = " and ".join(directories)
        raise OutputDirError(f"cannot write run_manifest.json in {where} ({fault or one_line(e)[:200]}); "
                             f"{storage_fix(fault, where)} and relaunch the same command to resume") from e


def record_abrupt_end(manifest: dict, plan, code: int) -> None:
    """The output dir's manifest when the process ends without unwinding (a lost peer): it must
    not stay "running". Not on a storage exit (a lost lease: the directory is another run's now)."""
    if code != EXIT_STORAGE:
        manifest_lib.write(manifest_lib.finish(manifest, exit_code=code, status="failed", final_metrics=None),
                           plan.output_dir)


def record_end(manifest: dict, plan, sinks: MetricsSinks, *, exit_code: int, status: str, final: dict | None,
               timing: Timing, beside_checkpoints: bool) -> None:
    """The final manifest (output dir, beside the checkpoints unless their storage just failed:
    a GCS outage would hold the exit for another round of client retries, W&B). A failed run
    only tries to write it (its own error is the one to report); a run that succeeded fails
    here with one line. The time account's totals go into the final metrics and W&B's summary."""
    totals = timing.totals()
    final = None if final is None else final | totals
    manifest = manifest_lib.finish(manifest, exit_code=exit_code, status=status, final_metrics=final)
    try:
        paths = write_manifest(manifest, plan.output_dir)
    except OutputDirError as e:
        if exit_code == 0:
            raise
        log.warning("%s", e)
        paths = []
    if beside_checkpoints:
        _best_effort(lambda: manifest_lib.write(manifest, plan.checkpoint_dir), "writing the manifest beside the checkpoints")
    if paths:
        try:
            sinks.save_file(paths[0])
        except OutputDirError as e:  # as for the manifest: a failed run's own error is the one to report
            if exit_code == 0:
                raise
            log.warning("%s", e)
    sinks.set_summary(final or totals)


def _best_effort(action, what: str) -> None:
    try:
        action()
    except Exception as e:  # noqa: BLE001 - a best-effort step: one warning, the run goes on
        log.warning("%s failed: %s", what, storage_fault(e) or one_line(e)[:300])
