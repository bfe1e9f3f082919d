"""Everything a run builds before its first step, shared by the run, compile_only, export,
bench and the examples: the plan (every derived number, checked against the machine), the
mesh, the task of the config's model family, and the jitted steps (one per curriculum stage).

Nothing here reads a dataset's arrays: the dataset is described by a `DataShape`, from the
loaded split (`DatasetKind.shape`) or from its metadata / the config (`planned_shape`).

The eval step a run compiles is `steps.eval` at `plan.eval_batch_size` rows (train.eval_batch_size):
`eval_step_args` gives it with its abstract arguments, to compile for a topology the way
runtime/compile_only.py compiles the train step (`compile_step(*eval_step_args(...), gen)`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
from omegaconf import OmegaConf

from runtime.checkpointing import Checkpoints
from runtime.config import Config, Plan, cycles_at, derive, ramp_value, resolve_compute_dtype, validate
from runtime.errors import UserError
from runtime.registry import dataset_kind, family_of, family_of_saved
from runtime.sharding import make_mesh
from runtime.task import DataShape, Task
from runtime.train_step import (Steps, abstract_batch, build_steps, has_puzzle_table, lr_schedule, make_optimizer,
                                puzzle_lr_schedule, task_batch_shapes)

log = logging.getLogger("runtime")


def plan_and_build(config: Config, *, devices, num_processes: int, shape: DataShape,
                   init_states: Any = None) -> tuple[Plan, Any, Steps]:
    """(plan, mesh, steps) for real devices or a TPU topology's compile-only devices. Every
    check that needs the machine raises a one-line UserError before anything compiles. A
    compute dtype of "auto" is the devices' platform's (a trainer resolves it earlier)."""
    config = resolve_compute_dtype(config, devices[0].platform)
    plan = derive(config, num_processes=num_processes, num_devices=len(devices), train_examples=shape.examples,
                  epoch_examples=shape.epoch_examples)
    log.info("plan:\n%s", plan.table())
    if config.train.grad_accum_steps > 1:
        k = config.train.grad_accum_steps
        log.info("gradient accumulation: %d micro-batches of %d rows per optimizer step", k, plan.global_batch_size // k)
    dataset_kind(config.data.name).check_plan(config.data, plan, shape)
    mesh = make_mesh(plan.mesh_shape, devices)
    ramp = config.curriculum.halt_exploration_prob
    exploration = (lambda step: ramp_value(ramp, step, plan.total_steps)) if ramp.on else None
    family = family_of(config.arch)
    if family.check_platform is not None:
        family.check_platform(config.arch, devices[0].platform, shape)

    def new_task(arch) -> Task:
        return family.build_task(arch, shape, init_states=init_states, exploration=exploration,
                                 global_batch=plan.global_batch_size)

    task = new_task(config.arch)
    schedule = lr_schedule(config.optim, plan.total_steps, plan.warmup_steps)
    puzzle_schedule = puzzle_lr_schedule(config.optim, plan.total_steps, plan.warmup_steps)
    shapes = task_batch_shapes(task, plan.global_batch_size, shape.seq_len)
    abstract_params = jax.eval_shape(lambda: task.init(jax.random.key(0), {
        k: jnp.zeros(s, jnp.int32) for k, s in shapes.items()}))
    tx = make_optimizer(config.optim, schedule, puzzle_schedule if has_puzzle_table(abstract_params) else None)

    def new_steps(task: Task) -> Steps:
        return build_steps(task, tx, schedule, mesh, shape.seq_len, config.optim.ema_rate,
                           global_batch=plan.global_batch_size, grad_accum_steps=config.train.grad_accum_steps)

    steps = new_steps(task)
    steps.at_step = curriculum_stages(config, plan.total_steps, steps, lambda arch: new_steps(new_task(arch)))
    return plan, mesh, steps


def planned_steps(config: Config, *, devices, num_processes: int):
    """(config with its compute dtype resolved for `devices`, plan, mesh, steps, abstract batch, data
    shape): a fresh run's steps from its config alone, the dataset described by its planned shape
    (no arrays read). What the plan compiles for a topology."""
    config = resolve_compute_dtype(config, devices[0].platform)
    data = dataset_kind(config.data.name).planned_shape(config.data, config)
    plan, mesh, steps = plan_and_build(config, devices=devices, num_processes=num_processes, shape=data)
    batch = abstract_batch(mesh, plan.global_batch_size, data.seq_len, steps.batch_fields, steps.batch_shapes)
    return config, plan, mesh, steps, batch, data


def eval_step_args(plan: Plan, mesh, steps: Steps, seq_len: int) -> tuple[Callable, tuple]:
    """(the jitted eval step, its abstract arguments): the parameters, the EMA parameters and one
    eval batch of `plan.eval_batch_size` rows, sharded like the run's. A mixture's sub-batches are
    its global batch's (it evaluates at that size, data_pipeline/kinds/multitask.py)."""
    shapes = steps.batch_shapes if plan.eval_batch_size == plan.global_batch_size else None
    batch = abstract_batch(mesh, plan.eval_batch_size, seq_len, steps.batch_fields, shapes)
    state = steps.abstract_state
    return steps.eval, (state.params, state.ema_params, batch)


def curriculum_stages(config: Config, total_steps: int, steps: Steps, build: Callable[[Any], Steps]):
    """`step -> Steps` under config.curriculum's H_cycles/L_cycles: one Steps per distinct
    (H_cycles, L_cycles), built when first reached (same parameters and state shardings, so the
    train state passes from one stage's compiled step to the next)."""
    c = config.curriculum
    if not (c.H_cycles.on or c.L_cycles.on):
        return lambda step: steps
    stages = {(config.arch.H_cycles, config.arch.L_cycles): steps}

    def at_step(step: int) -> Steps:
        cycles = cycles_at(config, step, total_steps)
        if cycles not in stages:
            log.info("curriculum: H_cycles=%d L_cycles=%d from step %d", *cycles, step)
            stages[cycles] = build(dataclasses.replace(config.arch, H_cycles=cycles[0], L_cycles=cycles[1]))
        return stages[cycles]

    return at_step


def curriculum_metrics(config: Config, step: int, total_steps: int) -> dict[str, float]:
    """The scheduled values in use at `step` (logged beside the train metrics)."""
    c = config.curriculum
    out: dict[str, float] = {}
    if c.H_cycles.on or c.L_cycles.on:
        out["train/H_cycles"], out["train/L_cycles"] = cycles_at(config, step, total_steps)
    if c.halt_exploration_prob.on:
        out["train/halt_exploration_prob"] = float(ramp_value(c.halt_exploration_prob, step, total_steps))
    return out


def load_run_params(checkpoint_dir: str, step: int | None = None) -> tuple[Config, int, Any]:
    """(config, step, params) of a run's checkpoint (default: its latest step), restored on
    this machine's devices with the run's own config (its model family from the registry)."""
    if "://" not in checkpoint_dir and not os.path.isdir(checkpoint_dir):  # Orbax would create it
        raise UserError(f"checkpoint directory {checkpoint_dir} does not exist; point it at a run's checkpoints "
                        "(<run.root>/<group>/<name>/checkpoints, or its run.checkpoint.dir)")
    ckpt = Checkpoints(checkpoint_dir, keep=1_000_000, async_save=False)
    try:
        step = ckpt.latest_step() if step is None else step
        if step is None or step not in ckpt.all_steps():
            raise UserError(f"no checkpoint {'step ' + str(step) if step is not None else ''} in {checkpoint_dir}; "
                            f"steps there: {ckpt.all_steps() or 'none'}")
        meta = ckpt.read_meta(step)
        saved = OmegaConf.create(meta["config"])
        family = family_of_saved(saved.arch)
        if family.pretrained:  # the weights and the arch they set are in this checkpoint: no base folder needed
            saved.arch[family.pretrained] = None
        saved.arch = OmegaConf.merge(OmegaConf.structured(family.schema), saved.arch)
        config = validate(saved)
        vocab = getattr(config.arch, "vocab_in_use", 0) or getattr(config.arch, "vocab_size", 1)  # not padding
        shape = DataShape(examples=int(meta["data_position"]["train_examples"]), vocab_size=vocab, seq_len=8)
        _, _, steps = plan_and_build(config, devices=jax.devices(), num_processes=jax.process_count(), shape=shape,
                                     init_states=meta.get("init_states"))
        return config, step, ckpt.restore_state(step, steps.abstract_state).params
    finally:
        ckpt.close()
