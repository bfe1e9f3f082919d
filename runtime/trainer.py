"""One training run: join -> plan -> mesh -> state (fresh or resumed) -> loop -> final save.

`run(config)` returns the process exit code. Everything a user can get wrong is checked
before the first compile (config, dataset, mesh, batch, checkpoint directory and its
compatibility), and reported as one line by `pretrain_jax.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import re
import time
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from data_pipeline.puzzle_format import DatasetError, load_split
from models import build_task
from runtime import manifest as manifest_lib
from runtime.checkpointing import Checkpoints
from runtime.config import Config, Plan, cycles_at, derive, ramp_value, run_dirs, to_dict
from runtime.data_feed import BatchFeeder, MultiTaskFeeder
from runtime.distributed import ProcessInfo, initialize
from runtime.errors import EXIT_NONFINITE, UserError
from runtime.metrics_sinks import MetricsSinks
from runtime.preflight import preflight
from runtime.perf import StepTimer, peak_flops_per_device
from runtime.preemption import PreemptionWatcher
from runtime.sharding import batch_sharding, describe, make_mesh
from runtime.watchdog import Watchdog
from runtime.train_step import (TrainState, build_steps, has_puzzle_table, lr_schedule, make_optimizer,
                                puzzle_lr_schedule, task_batch_shapes)

log = logging.getLogger("runtime")


def setup_logging(is_primary: bool) -> None:
    """Process 0 logs progress; the others only warnings and errors."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", force=True)
    logging.getLogger().setLevel(logging.INFO if is_primary else logging.WARNING)
    for noisy in ("absl", "jax._src", "orbax", "etils"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def ensure_dataset(config: Config, info: ProcessInfo) -> None:
    """Build the small generated dataset when asked and missing (local paths only)."""
    data = config.data
    if data.name == "multitask":  # each task's own dataset, by its own generate_* settings
        from runtime.config import task_data_configs

        for task_data in task_data_configs(data).values():
            ensure_dataset(dataclasses.replace(config, data=task_data), info)
        return
    if not data.generate_if_missing or data.path.startswith("gs://"):
        return

    def build_if_missing():
        if data.name == "sft":
            if not os.path.exists(os.path.join(data.path, data.train_split, "sft.json")):
                from data_pipeline.build_sft import build_generated_arithmetic

                log.info("building a generated arithmetic reasoning set at %s", data.path)
                build_generated_arithmetic(data.path, data.generate_puzzles, data.generate_test_puzzles, data.seq_len,
                                           data.generate_seed)
            return
        if data.name == "maze" and not os.path.exists(os.path.join(data.path, data.train_split, "dataset.json")):
            from data_pipeline.build_maze import build_maze_dataset
            from data_pipeline.maze import DEFAULT_SIZE

            side = data.generate_grid_size or DEFAULT_SIZE
            if data.generate_num_aug not in (0, 7):
                log.warning("maze augmentation adds the 7 other dihedral images of each maze (generate_num_aug=7); "
                            "generate_num_aug=%d is treated as 7", data.generate_num_aug)
            log.info("building a generated %dx%d maze dataset at %s", side, side, data.path)
            build_maze_dataset(data.path, generate=data.generate_puzzles + data.generate_test_puzzles,
                               test_size=data.generate_test_puzzles, aug=data.generate_num_aug > 0, size=side,
                               seed=data.generate_seed)
            return
        if not os.path.exists(os.path.join(data.path, data.train_split, "dataset.json")):
            from data_pipeline.build_sudoku import build_sudoku_dataset

            log.info("building a generated %s dataset at %s", data.name, data.path)
            build_sudoku_dataset(data.path, generate=data.generate_puzzles + data.generate_test_puzzles,
                                 test_size=data.generate_test_puzzles, num_aug=data.generate_num_aug,
                                 min_givens=data.generate_min_givens, seed=data.generate_seed)

    if info.is_primary:
        build_if_missing()
    if info.process_count > 1:
        multihost_utils.sync_global_devices("dataset ready")
        build_if_missing()  # workers with their own disks build the same (seeded) data


def load_any_split(config: Config, split: str):
    """A puzzle split (reference format) or, for data.name=sft, a tokenized chat split."""
    if config.data.name == "sft":
        from data_pipeline.sft_format import load_sft_split

        return load_sft_split(config.data.path, split)
    if config.data.name == "multitask":  # every task's split (runtime/multitask.py)
        from runtime.multitask import load_multitask_split

        return load_multitask_split(config, split)
    return load_split(config.data.path, split)


def make_generation_eval(config: Config, steps, split, mesh, global_batch: int):
    """For SFT runs with data.eval_generate_examples > 0: params -> answer/format metrics."""
    if config.data.name != "sft" or config.data.eval_generate_examples <= 0:
        return None
    from data_pipeline.tokenizer import Tokenizer, TokenizerError
    from models.gemma.task import generation_eval

    path = config.data.tokenizer or f"{config.data.path.rstrip('/')}/tokenizer.model"
    try:
        tokenizer = Tokenizer(path)
    except TokenizerError as e:
        raise UserError(str(e)) from e
    return generation_eval(steps.task, split, tokenizer, mesh, examples=config.data.eval_generate_examples,
                           max_new_tokens=config.data.eval_max_new_tokens, batch_size=global_batch)


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


def local_rows(arrays: dict[str, jax.Array]) -> dict[str, np.ndarray]:
    """This process's rows of batch-sharded global arrays, in row order (replicas counted once)."""
    out = {}
    for name, arr in arrays.items():
        shards = {(s.index[0].start or 0): s.data for s in arr.addressable_shards}
        out[name] = np.concatenate([np.asarray(shards[k]) for k in sorted(shards)])
    return out


def gather_objects(obj: Any) -> list[Any]:
    """`obj` from every process (pickled through a uint8 all-gather), in process order."""
    if jax.process_count() == 1:
        return [obj]
    data = np.frombuffer(pickle.dumps(obj), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int64))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:data.size] = data
    everything = np.asarray(multihost_utils.process_allgather(padded))
    return [pickle.loads(everything[i, :int(n)].tobytes()) for i, n in enumerate(sizes)]


def arc_evaluator_factory(config: Config):
    """For an ARC dataset, `() -> a fresh ARCEvaluator` (votes, pass@k, submission.json), with
    the dataset's identifiers and test puzzles read once; else None."""
    if config.data.name != "arc":
        return None
    from data_pipeline.arc_eval import ARCEvaluator

    template = ARCEvaluator.from_dataset(config.data.path)
    return lambda: ARCEvaluator(template.identifiers, template.test_puzzles)


def evaluate(steps, state: TrainState, feeder: BatchFeeder, max_examples: int | None, beat=lambda: None, *,
             new_arc=None, submission_path: str | None = None, generation=None) -> dict[str, float]:
    """Metrics over the eval set, with the EMA weights when EMA is on (and the live puzzle table).

    With an ARC evaluator (`new_arc()`, fresh per evaluation), every process votes with the rows
    it holds; process 0 merges all votes, adds pass@k and writes the Kaggle submission.
    `generation(params)` adds the SFT answer/format metrics."""
    arc = new_arc() if new_arc is not None else None
    totals: dict[str, float] = {}
    rows = 0
    for batch in feeder.eval_batches(max_examples):
        beat()
        rows += feeder.global_batch
        if arc is None:
            sums = steps.eval(state.params, state.ema_params, batch)
        else:
            sums, outputs = steps.eval_rows(state.params, state.ema_params, batch)
            mine = local_rows({k: batch[k] for k in ("inputs", "labels", "puzzle_identifiers")} | outputs)
            real = (mine["labels"] != -100).any(-1)  # padding rows of the last batch have no labels
            arc.update(mine["inputs"][real], mine["preds"][real], mine["puzzle_identifiers"][real],
                       mine["q_halt_logits"][real])
        for k, v in jax.device_get(sums).items():
            totals[k] = totals.get(k, 0) + float(v)
    metrics = {f"eval/{k}": float(v) for k, v in steps.summarize(totals, rows, False).items()} if totals else {}
    if arc is not None:
        states = gather_objects(arc.state())
        if jax.process_index() == 0:
            for other in states[1:]:
                arc.merge(other)
            metrics |= {f"eval/{k}": v for k, v in arc.result(submission_path).items()}
    if generation is not None:
        beat()
        metrics |= {f"eval/{k}": v for k, v in generation(state.params).items()}
    return metrics


def load_init_params(path: str, abstract_params: Any) -> Any:
    """Parameters from an imported checkpoint (DIR/params), placed with the run's shardings."""
    from models.recursive_reasoning.import_reference import load_imported_params

    try:
        return load_imported_params(path, abstract_params)
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"train.init_params_from={path} does not fit this model ({' '.join(str(e).split())[:300]}); "
                        "import with the same arch values and dataset sizes as this run") from e


def read_init_states(config: Config, meta: dict | None) -> Any:
    """TRM/HRM (H_init, L_init): from the checkpoint being resumed, else from the imported
    checkpoint (init_params_from/init_states), else None (the models' fixed vectors)."""
    if meta is not None:
        return meta.get("init_states")
    if not config.train.init_params_from:
        return None
    from models.recursive_reasoning.import_reference import load_imported_states

    states = load_imported_states(config.train.init_params_from)
    if states is None:
        return None
    return [np.asarray(states["H_init"], np.float32).tolist(), np.asarray(states["L_init"], np.float32).tolist()]


def epoch_examples(metadata: Any) -> int | None:
    """The reference's epoch of a puzzle split: total_groups x mean_puzzle_examples; a
    multi-task split: the sum over its tasks; None (the whole set) for other formats."""
    if hasattr(metadata, "total_groups"):
        return max(1, round(metadata.total_groups * metadata.mean_puzzle_examples))
    return None


def plan_and_build(config: Config, *, devices, num_processes: int, train_examples: int, vocab_size: int,
                   seq_len: int, per_epoch: int | None = None, num_puzzle_identifiers: int = 1, init_states: Any = None,
                   packed: bool = False, tasks: Any = None) -> tuple[Plan, Any, Any]:
    """Plan (all checks that need the machine), mesh, model and the jitted steps, for real
    devices or a TPU topology's compile-only devices (runtime/compile_only.py). For
    data.name=multitask, `tasks` = each task's `runtime.multitask.TaskShape`."""
    plan = derive(config, num_processes=num_processes, num_devices=len(devices), train_examples=train_examples,
                  epoch_examples=per_epoch)
    log.info("plan:\n%s", plan.table())
    mesh = make_mesh(plan.mesh_shape, devices)
    ramp = config.curriculum.halt_exploration_prob
    exploration = (lambda step: ramp_value(ramp, step, plan.total_steps)) if ramp.on else None

    def new_task(arch):
        if config.data.name == "multitask":  # checks each task's sub-batch first (one line, before compile)
            from runtime.multitask import build_multitask_task

            return build_multitask_task(config, plan, tasks, arch=arch, init_states=init_states, exploration=exploration)
        return build_task(arch, vocab_size=vocab_size, seq_len=seq_len, num_puzzle_identifiers=num_puzzle_identifiers,
                          init_states=init_states, packed=packed, exploration=exploration)

    task = new_task(config.arch)
    schedule = lr_schedule(config.optim, plan.total_steps, plan.warmup_steps)
    puzzle_schedule = puzzle_lr_schedule(config.optim, plan.total_steps, plan.warmup_steps)
    shapes = task_batch_shapes(task, plan.global_batch_size) or {"inputs": (1, seq_len), "labels": (1, seq_len),
                                                                  "puzzle_identifiers": (1,)}
    abstract_params = jax.eval_shape(lambda: task.init(jax.random.key(0), {
        k: jax.numpy.zeros(shape, jax.numpy.int32) for k, shape in shapes.items()}))
    tx = make_optimizer(config.optim, schedule, puzzle_schedule if has_puzzle_table(abstract_params) else None)

    def new_steps(task):
        return build_steps(task, tx, schedule, mesh, seq_len, config.optim.ema_rate, global_batch=plan.global_batch_size)

    steps = new_steps(task)
    steps.at_step = curriculum_stages(config, plan.total_steps, steps, lambda arch: new_steps(new_task(arch)))
    return plan, mesh, steps


def curriculum_stages(config: Config, total_steps: int, steps, build):
    """`step -> Steps` under config.curriculum's H_cycles/L_cycles: one Steps per distinct
    (H_cycles, L_cycles), built when first reached (same parameters and state shardings, so the
    train state passes from one stage's compiled step to the next)."""
    c = config.curriculum
    if not (c.H_cycles.on or c.L_cycles.on):
        return lambda step: steps
    stages = {(config.arch.H_cycles, config.arch.L_cycles): steps}

    def at_step(step: int):
        cycles = cycles_at(config, step, total_steps)
        if cycles not in stages:
            log.info("curriculum: H_cycles=%d L_cycles=%d from step %d", *cycles, step)
            stages[cycles] = build(dataclasses.replace(config.arch, H_cycles=cycles[0], L_cycles=cycles[1]))
        return stages[cycles]

    return at_step


def curriculum_metrics(config: Config, step: int, total_steps: int) -> dict[str, float]:
    """The scheduled values in use at `step` (logged beside the train metrics)."""
    c = config.curriculum
    out = {}
    if c.H_cycles.on or c.L_cycles.on:
        out["train/H_cycles"], out["train/L_cycles"] = cycles_at(config, step, total_steps)
    if c.halt_exploration_prob.on:
        out["train/halt_exploration_prob"] = float(ramp_value(c.halt_exploration_prob, step, total_steps))
    return out


def run(config: Config) -> int:
    setup_logging(is_primary=True)
    info = initialize(config.distributed)
    setup_logging(info.is_primary)
    output_dir, checkpoint_dir = run_dirs(config)
    preflight(config, checkpoint_dir=checkpoint_dir, output_dir=output_dir, is_primary=info.is_primary)
    ensure_dataset(config, info)
    try:
        train_split, eval_split = (load_any_split(config, s) for s in (config.data.train_split, config.data.eval_split))
    except DatasetError as e:
        raise UserError(str(e)) from e
    train_meta = train_split.metadata
    ckpt = Checkpoints(checkpoint_dir, keep=config.run.checkpoint.keep, async_save=config.run.checkpoint.async_save)
    start_step, meta = ckpt.latest_step(), None
    if start_step is not None:
        if not config.run.checkpoint.resume:
            raise UserError(f"{checkpoint_dir} already holds checkpoints (latest step {start_step}) and "
                            "run.checkpoint.resume=false; pick a new run.name or run.checkpoint.dir so nothing is overwritten")
        meta = ckpt.read_meta(start_step)
        check_resumable(meta, config, len(train_split), checkpoint_dir, start_step)
    init_states = read_init_states(config, meta)
    if config.data.name == "multitask":
        per_epoch = sum(epoch_examples(s.metadata) or len(s) for s in train_split.splits.values())
    else:
        per_epoch = epoch_examples(train_meta)
    plan, mesh, steps = plan_and_build(config, devices=jax.devices(), num_processes=info.process_count,
                                       train_examples=len(train_split), vocab_size=train_meta.vocab_size,
                                       per_epoch=per_epoch,
                                       seq_len=train_meta.seq_len, num_puzzle_identifiers=train_meta.num_puzzle_identifiers,
                                       init_states=init_states, packed=bool(getattr(train_meta, "packed", False)),
                                       tasks=train_split.task_shapes() if config.data.name == "multitask" else None)
    rng = jax.random.key_data(jax.random.key(config.train.seed))
    if start_step is not None:
        state = ckpt.restore_state(start_step, steps.abstract_state)
        log.info("resumed from step %d of %s", start_step, plan.checkpoint_dir)
    elif config.train.init_params_from:
        state = steps.init_from(rng, load_init_params(config.train.init_params_from, steps.abstract_state.params))
        log.info("parameters from %s", config.train.init_params_from)
    elif getattr(config.arch, "checkpoint", None):
        state = steps.init_from(rng, steps.task.load_pretrained(steps.abstract_state.params, jax.random.key(config.train.seed)))
        log.info("pretrained weights from %s", config.arch.checkpoint)
    else:
        state = steps.init(rng)
    log.info("parameters (%d):\n%s", sum(x.size for x in jax.tree.leaves(state.params)), describe(state.params))
    run_id = meta["run_id"] if meta else new_run_id(config)
    position = int(meta["data_position"]["next_batch"]) if meta else 0

    feeder_class = MultiTaskFeeder if config.data.name == "multitask" else BatchFeeder  # per-task sub-batches
    feeder = feeder_class(train_split, batch_sharding(mesh, 1), plan.global_batch_size, config.train.seed)
    eval_feeder = feeder_class(eval_split, batch_sharding(mesh, 1), plan.global_batch_size, config.train.seed, prefetch=False)
    config_dict = to_dict(config)
    sinks = MetricsSinks(is_primary=info.is_primary, output_dir=plan.output_dir, wandb_mode=config.run.wandb.mode,
                         wandb_project=config.run.wandb.project, wandb_entity=config.run.wandb.entity,
                         group=config.run.group, name=config.run.name, run_id=run_id, config=config_dict,
                         total_steps=plan.total_steps, start_step=position, tags=list(config.run.wandb.tags),
                         progress_bar=config.run.progress_bar)
    manifest = manifest_lib.new_manifest(config=config_dict, plan=dataclasses.asdict(plan), run_id=run_id,
                                         resumed_from=start_step)
    if info.is_primary:
        manifest_lib.write(manifest, plan.output_dir, plan.checkpoint_dir)

    generation = make_generation_eval(config, steps, eval_split, mesh, plan.global_batch_size)
    new_arc = arc_evaluator_factory(config)
    status, exit_code, final = "failed", 1, None
    try:
        if config.train.eval_only:
            final = evaluate(steps, state, eval_feeder, config.data.eval_max_examples, new_arc=new_arc,
                             submission_path=f"{plan.output_dir}/submission.json", generation=generation)
            sinks.log(position, final)
            status, exit_code = "evaluated", 0
            return exit_code
        exit_code, status, final = train_loop(config, plan, steps, state, feeder, eval_feeder, ckpt, sinks, position,
                                              run_id, config_dict, seq_len=train_meta.seq_len, init_states=init_states,
                                              generation=generation, new_arc=new_arc)
        ckpt.wait()  # the run is done only when its last checkpoint is committed
        return exit_code
    except UserError as e:
        status, exit_code = "failed", e.exit_code
        raise
    finally:  # record how it ended; never let a second failure here hide the first
        feeder.close()
        _best_effort(ckpt.close, "closing the checkpoint manager")
        if info.is_primary:
            manifest = manifest_lib.finish(manifest, exit_code=exit_code, status=status, final_metrics=final)
            paths = manifest_lib.write(manifest, plan.output_dir)
            _best_effort(lambda: manifest_lib.write(manifest, plan.checkpoint_dir), "writing the manifest beside the checkpoints")
            sinks.save_file(paths[0])
            if final:
                sinks.set_summary(final)
        sinks.close(exit_code)


def _best_effort(action, what: str) -> None:
    try:
        action()
    except Exception as e:
        log.warning("%s failed: %s", what, " ".join(str(e).split())[:300])


def compiled_memory(compiled) -> dict[str, float]:
    """Per-device bytes of the compiled train step (arguments = state + batch; temporaries =
    activations and workspace), in GiB; empty where the backend does not report them."""
    try:
        mem = compiled.memory_analysis()
        return {"perf/compiled_argument_gib": mem.argument_size_in_bytes / 2**30,
                "perf/compiled_temp_gib": mem.temp_size_in_bytes / 2**30}
    except Exception:  # noqa: BLE001 - diagnostics only
        return {}


def train_loop(config: Config, plan: Plan, steps, state: TrainState, feeder: BatchFeeder, eval_feeder: BatchFeeder,
               ckpt: Checkpoints, sinks: MetricsSinks, position: int, run_id: str, config_dict: dict,
               seq_len: int, init_states: Any = None, generation=None, new_arc=None) -> tuple[int, str, dict | None]:
    """The loop: step, log, eval, checkpoint, NaN guard, preemption, watchdog, profiler window.
    Returns (exit code, status for the manifest, final metrics)."""
    if position >= plan.total_steps:
        log.info("nothing to do: the checkpoint is at step %d of %d", position, plan.total_steps)
        return 0, "completed", None
    first_batch = feeder.train_batch(position)
    compiled_steps: dict[int, Any] = {}  # id(Steps) -> its compiled train step (one per curriculum stage)
    timer = None

    def compiled_for(step: int):
        stage = steps.at_step(step)
        if id(stage) not in compiled_steps:
            with timer.paused() if timer is not None else contextlib.nullcontext():
                t0 = time.perf_counter()
                compiled_steps[id(stage)] = stage.train.lower(state, first_batch).compile()
                log.info("compiled train step in %.1fs", time.perf_counter() - t0)
        return compiled_steps[id(stage)]

    compiled = compiled_for(position)
    flops = (compiled.cost_analysis() or {}).get("flops")
    log.info("%s FLOPs/step/device", flops)
    sinks.log(position, {"model/params": sum(x.size for x in jax.tree.leaves(state.params))} | compiled_memory(compiled))
    timer = StepTimer(plan.global_batch_size, seq_len, flops, peak_flops_per_device(jax.devices()[0]))
    pending: list[tuple[int, dict]] = []  # device metrics not yet checked/logged
    last_good_ckpt = ckpt.latest_step()
    train_metrics: dict[str, float] = {}  # means over the last log interval
    eval_metrics: dict[str, float] = {}
    profile = config.train.profile_start_step

    def drain() -> bool:
        """Fetch pending metrics; False if any step produced a non-finite loss or gradient."""
        fetched = jax.device_get([m for _, m in pending])
        bad = [s for (s, _), m in zip(pending, fetched) if not m["finite"]]
        if bad:
            log.error("non-finite loss or gradient at step %d; stopping. Last good checkpoint: %s", bad[0],
                      f"step {last_good_ckpt} in {plan.checkpoint_dir}" if last_good_ckpt is not None else "none")
            return False
        if fetched:
            # Task metrics from the sums over the interval's steps (ratios of sums, not means of ratios).
            totals = {k: sum(float(m["sums"][k]) for m in fetched) for k in fetched[-1]["sums"]}
            train_metrics.update({f"train/{k}": v for k, v in
                                  steps.summarize(totals, plan.global_batch_size * len(fetched), True).items()})
            train_metrics.update({f"train/{k}": float(np.mean([m[k] for m in fetched])) for k in fetched[-1]
                                  if k not in ("finite", "sums")})
        pending.clear()
        return True

    def save(done: int) -> None:
        nonlocal last_good_ckpt
        with timer.paused():
            position = {"next_batch": done, "examples_seen": done * plan.global_batch_size,
                        "epoch": done / plan.steps_per_epoch, "global_batch_size": plan.global_batch_size,
                        "seed": config.train.seed, "train_examples": plan.train_examples}
            ckpt.save(done, state, {"step": done, "run_id": run_id, "config": config_dict,
                                    "metrics": train_metrics | eval_metrics, "data_position": position,
                                    "init_states": init_states})
            last_good_ckpt = done

    preemption = PreemptionWatcher()
    watchdog = Watchdog(config.train.watchdog_timeout_s).start()
    timer.lap(position)
    batch = first_batch
    try:
        for step in range(position, plan.total_steps):
            if profile is not None and step == profile:
                jax.profiler.start_trace(f"{plan.output_dir}/profile")
            state, metrics = compiled_for(step)(state, batch)
            done = step + 1  # optimizer steps taken == index of the next global batch
            last = done == plan.total_steps
            if not last:
                batch = feeder.train_batch(done)  # host work overlaps the step running on device
            pending.append((done, metrics))
            watchdog.beat(done)
            if profile is not None and done == profile + config.train.profile_steps:
                jax.block_until_ready(state)
                jax.profiler.stop_trace()
            preempted = preemption.should_stop(done)
            if done % plan.log_every == 0 or done % plan.checkpoint_every == 0 or last or preempted:
                if not drain():
                    return EXIT_NONFINITE, "nonfinite", None
                if done % plan.log_every == 0 or last:
                    sinks.log(done, train_metrics | timer.lap(done) | curriculum_metrics(config, step, plan.total_steps))
            if done % plan.eval_every == 0 or last:
                with timer.paused():
                    eval_metrics = evaluate(steps.at_step(step), state, eval_feeder, config.data.eval_max_examples,
                                            lambda: watchdog.beat(done, "eval"), new_arc=new_arc,
                                            submission_path=f"{plan.output_dir}/submission.json", generation=generation)
                    sinks.log(done, eval_metrics)
            if done % plan.checkpoint_every == 0 or last or preempted:
                save(done)
            if preempted:
                watchdog.beat(done, "preemption checkpoint")
                ckpt.wait()
                log.warning("preempted (SIGTERM): checkpoint saved at step %d in %s; relaunch the same command to "
                            "resume", done, plan.checkpoint_dir)
                return 0, "preempted", train_metrics | eval_metrics
    except Exception as e:
        log.error("training failed in step %d: %s", step + 1, " ".join(str(e).split())[:500])
        raise
    finally:
        watchdog.stop()
        preemption.close()
    return 0, "completed", train_metrics | eval_metrics
