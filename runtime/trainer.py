"""One training run: join -> preflight -> lease -> data -> plan and build -> state (fresh or
resumed) -> loop -> final save.

`run(config)` returns the process exit code. Everything a user can get wrong is checked
before the first compile (config, dataset, mesh, batch, checkpoint directory and its
compatibility), and reported as one line by `pretrain_jax.py`. Dataset kinds and model
families come from the registries (runtime/registry.py); nothing here knows their names.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from runtime import manifest as manifest_lib
from runtime.builder import plan_and_build
from runtime.checkpointing import Checkpoints
from runtime.config import Config, run_dirs, to_dict
from runtime.distributed import ProcessInfo, initialize
from runtime.errors import EXIT_FAILURE, OutputDirError, UserError, one_line, storage_fault, storage_fix
from runtime.evaluation import evaluate
from runtime.imported import load_imported_params, load_imported_states
from runtime.lease import Lease, hold_run_lease
from runtime.loop import LoopContext, train_loop
from runtime.metrics_sinks import MetricsSinks
from runtime.preflight import preflight
from runtime.registry import dataset_kind
from runtime.run_log import library_logs_to, run_log_path
from runtime.sharding import batch_sharding, describe
from runtime.task import EvalContext

log = logging.getLogger("runtime")


def setup_logging(is_primary: bool) -> None:
    """Process 0 logs progress; the others only warnings and errors."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", force=True)
    logging.getLogger().setLevel(logging.INFO if is_primary else logging.WARNING)
    for noisy in ("absl", "jax._src", "orbax", "etils"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


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
    if config.run.id:
        return config.run.id
    token = multihost_utils.broadcast_one_to_all(np.frombuffer(os.urandom(4), np.uint32))
    name = re.sub(r"[^a-zA-Z0-9_-]", "-", config.run.name)[:40]
    return f"{name}-{int(token[0]):08x}"


def check_resumable(meta: dict[str, Any], config: Config, train_examples: int, directory: str, step: int) -> None:
    """Refuse to resume a checkpoint written for a different model or a different data order
    (which depends on seed, global batch and dataset size, not on where the data lives)."""
    saved = dict(meta.get("config", {}), dataset={"train_examples": meta["data_position"].get("train_examples")})
    now = dict(to_dict(config), dataset={"train_examples": train_examples})
    # What the checkpoint's numbers depend on: a sweep that reuses one checkpoint directory must
    # not resume another variant's run (optimizer, EMA and curriculum included). The step sizes
    # (lr, puzzle_emb_lr, warmup, clipping) may change: relaunching with a lower lr after a
    # spike is the usual recovery.
    optim_keys = tuple(f.name for f in dataclasses.fields(config.optim)
                       if f.name not in ("lr", "puzzle_emb_lr", "warmup_steps", "grad_clip_norm"))
    checks = (("arch", None), ("optim", optim_keys), ("curriculum", None), ("train", ("seed", "global_batch_size")),
              ("data", ("name",)), ("dataset", None))
    for section, keys in checks:
        old, new = saved.get(section, {}), now[section]
        for key in keys or sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                raise UserError(
                    f"checkpoint step {step} in {directory} was written with {section}.{key}={old.get(key)!r}, this run "
                    f"has {new.get(key)!r}; use the same value to resume, or a new run.name (or run.checkpoint.dir) to start fresh")


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


def initial_state(config: Config, steps, ckpt: Checkpoints, start_step: int | None):
    """The resumed state, else one from imported or pretrained parameters, else a fresh init."""
    rng = jax.random.key_data(jax.random.key(config.train.seed))
    if start_step is not None:
        state = ckpt.restore_state(start_step, steps.abstract_state)
        log.info("resumed from step %d of %s", start_step, ckpt.directory)
        return state
    if config.train.init_params_from:
        log.info("parameters from %s", config.train.init_params_from)
        return steps.init_from(rng, load_init_params(config.train.init_params_from, steps.abstract_state.params))
    pretrained = steps.task.load_pretrained(steps.abstract_state.params, jax.random.key(config.train.seed))
    if pretrained is not None:
        log.info("pretrained weights from the arch's checkpoint")
        return steps.init_from(rng, pretrained)
    return steps.init(rng)


def resume_point(config: Config, ckpt: Checkpoints, train_examples: int) -> tuple[int | None, dict | None]:
    """(latest complete step, its metadata), after checking the checkpoint fits this run."""
    start_step = ckpt.latest_step()
    if start_step is None:
        return None, None
    if not config.run.checkpoint.resume:
        raise UserError(f"{ckpt.directory} already holds checkpoints (latest step {start_step}) and "
                        "run.checkpoint.resume=false; pick a new run.name or run.checkpoint.dir so nothing is overwritten")
    meta = ckpt.read_meta(start_step)
    check_resumable(meta, config, train_examples, ckpt.directory, start_step)
    return start_step, meta


def run_evaluators(config: Config, kind, steps, context: EvalContext) -> list:
    """The dataset kind's evaluators, then the model family's."""
    evaluators = kind.evaluators(config.data, context) + steps.task.evaluators(context)
    if any(e.wants_rows for e in evaluators) and steps.eval_rows is None:
        raise UserError(f"data.name={config.data.name} evaluates per-row outputs that arch {config.arch.name!r} does not "
                        "produce; use a TRM/HRM arch")
    return evaluators


def open_sinks(config: Config, plan, info: ProcessInfo, run_id: str, position: int, config_dict: dict) -> MetricsSinks:
    return MetricsSinks(is_primary=info.is_primary, output_dir=plan.output_dir, wandb_mode=config.run.wandb.mode,
                        wandb_project=config.run.wandb.project, wandb_entity=config.run.wandb.entity,
                        group=config.run.group, name=config.run.name, run_id=run_id, config=config_dict,
                        total_steps=plan.total_steps, start_step=position, tags=list(config.run.wandb.tags),
                        progress_bar=config.run.progress_bar)


def run(config: Config) -> int:
    setup_logging(is_primary=True)
    info = initialize(config.distributed)
    setup_logging(info.is_primary)
    output_dir, checkpoint_dir = run_dirs(config)
    preflight(config, checkpoint_dir=checkpoint_dir, output_dir=output_dir, is_primary=info.is_primary)
    # Before anything is written to the run's directories: one run at a time writes there.
    lease = hold_run_lease(config, info.is_primary, info.process_count, output_dir, checkpoint_dir)
    try:
        with library_logs_to(run_log_path(output_dir, info.process_index)):
            return run_leased(config, info, checkpoint_dir, lease)
    finally:
        if lease is not None:
            lease.release()


def run_leased(config: Config, info: ProcessInfo, checkpoint_dir: str, lease: Lease | None) -> int:
    kind = dataset_kind(config.data.name)
    ensure_dataset(config, info)
    train_split, eval_split = (kind.load_split(config.data, s) for s in (config.data.train_split, config.data.eval_split))
    shape = kind.shape(config.data, train_split)
    ckpt = Checkpoints(checkpoint_dir, keep=config.run.checkpoint.keep, async_save=config.run.checkpoint.async_save)
    start_step, meta = resume_point(config, ckpt, shape.examples)
    init_states = read_init_states(config, meta)
    plan, mesh, steps = plan_and_build(config, devices=jax.devices(), num_processes=info.process_count, shape=shape,
                                       init_states=init_states)
    evaluators = run_evaluators(config, kind, steps, EvalContext(config=config, eval_split=eval_split, mesh=mesh,
                                                                 global_batch=plan.global_batch_size,
                                                                 output_dir=plan.output_dir))
    state = initial_state(config, steps, ckpt, start_step)
    log.info("parameters (%d):\n%s", sum(x.size for x in jax.tree.leaves(state.params)), describe(state.params))
    run_id = meta["run_id"] if meta else new_run_id(config)
    if lease is not None:
        lease.set_run_id(run_id)
    position = int(meta["data_position"]["next_batch"]) if meta else 0

    feeder, eval_feeder = (kind.make_feeder(split, batch_sharding(mesh, 1), plan.global_batch_size, config.train.seed,
                                            prefetch=prefetch) for split, prefetch in ((train_split, True), (eval_split, False)))
    config_dict = to_dict(config)
    sinks = open_sinks(config, plan, info, run_id, position, config_dict)
    manifest = manifest_lib.new_manifest(config=config_dict, plan=dataclasses.asdict(plan), run_id=run_id,
                                         resumed_from=start_step)
    status, exit_code, final = "failed", EXIT_FAILURE, None
    try:
        if info.is_primary:
            write_manifest(manifest, plan.output_dir, plan.checkpoint_dir)
        if config.train.eval_only:
            final = evaluate(steps, state, eval_feeder, config.data.eval_max_examples, evaluators)
            sinks.log(position, final)
            status, exit_code = "evaluated", 0
            return exit_code
        ctx = LoopContext(config=config, plan=plan, steps=steps, feeder=feeder, eval_feeder=eval_feeder, ckpt=ckpt,
                          sinks=sinks, run_id=run_id, config_dict=config_dict, seq_len=shape.seq_len,
                          init_states=init_states, evaluators=evaluators)
        exit_code, status, final = train_loop(ctx, state, position)
        ckpt.wait()  # the run is done only when its last checkpoint is committed
        return exit_code
    except OutputDirError as e:  # add where a relaunch resumes from
        status, exit_code = "failed", e.exit_code
        _best_effort(ckpt.wait, "committing the checkpoint in flight")
        last = ckpt.last_complete
        raise OutputDirError(f"{e}; the last complete checkpoint: {'none yet' if last is None else f'step {last}'}") from e
    except UserError as e:
        status, exit_code = "failed", e.exit_code
        raise
    finally:  # record how it ended; never let a second failure here hide the first
        feeder.close()
        _best_effort(ckpt.close, "closing the checkpoint manager")
        try:
            if info.is_primary:
                record_end(manifest, plan, sinks, exit_code=exit_code, status=status, final=final,
                           beside_checkpoints=not ckpt.save_failed)
        finally:
            sinks.close(exit_code)


def write_manifest(manifest: dict, *directories: str) -> list[str]:
    """run_manifest.json into each directory; a failed write is one line (exit 6)."""
    try:
        return manifest_lib.write(manifest, *directories)
    except Exception as e:
        fault = storage_fault(e)
        where = " and ".join(directories)
        raise OutputDirError(f"cannot write run_manifest.json in {where} ({fault or one_line(e)[:200]}); "
                             f"{storage_fix(fault, where)} and relaunch the same command to resume") from e


def record_end(manifest: dict, plan, sinks: MetricsSinks, *, exit_code: int, status: str, final: dict | None,
               beside_checkpoints: bool) -> None:
    """The final manifest (output dir, beside the checkpoints unless their storage just failed:
    a GCS outage would hold the exit for another round of client retries, W&B). A failed run
    only tries to write it (its own error is the one to report); a run that succeeded fails
    here with one line."""
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
        sinks.save_file(paths[0])
    if final:
        sinks.set_summary(final)


def _best_effort(action, what: str) -> None:
    try:
        action()
    except Exception as e:
        log.warning("%s failed: %s", what, storage_fault(e) or one_line(e)[:300])
