"""Train state, optimizer, LR schedule, and the jitted, sharded train and eval steps.

Model-family specifics (loss, metrics, a carry that persists across batches) come from a
`runtime.task.Task` of the model family; this module is generic over it.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, cast

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from runtime import grad_accum, optimizers
from runtime.config import OptimConfig, StateDtype
from runtime.errors import UserError
from runtime.sharding import activation_rules, batch_sharding, batch_spec, logical_shardings, replicated
from runtime.task import PUZZLE_BATCH_FIELDS, Task, in_analysis


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps taken == index of the next global batch
    params: Any
    opt_state: Any
    ema_params: Any  # None when EMA is off; never holds the puzzle table (it is evaluated live)
    rng: jax.Array  # raw key data (uint32[2]) so it checkpoints as a plain array
    carry: Any = None  # the task's state across batches (ACT carry), batch dim sharded; None if stateless


def warmup_cosine(lr: float, lr_min_ratio: float, total_steps: int, warmup_steps: int) -> optax.Schedule:
    """Linear warmup from step 1, then cosine from lr to lr * lr_min_ratio at total_steps."""

    def schedule(count):
        step = count + 1
        warm = lr * jnp.minimum(1.0, step / max(1, warmup_steps))
        progress = jnp.clip((step - warmup_steps) / max(1, total_steps - warmup_steps), 0.0, 1.0)
        cosine = lr * (lr_min_ratio + (1 - lr_min_ratio) * 0.5 * (1 + jnp.cos(jnp.pi * progress)))
        return jnp.where(step <= warmup_steps, warm, cosine)

    return schedule


def lr_schedule(cfg: OptimConfig, total_steps: int, warmup_steps: int) -> optax.Schedule:
    """The network's schedule: warmup + cosine to lr * lr_min_ratio."""
    return warmup_cosine(cfg.lr, cfg.lr_min_ratio, total_steps, warmup_steps)


def puzzle_lr_schedule(cfg: OptimConfig, total_steps: int, warmup_steps: int) -> optax.Schedule:
    """The puzzle table's schedule: the same shape with puzzle_emb_lr."""
    return warmup_cosine(cfg.puzzle_emb_lr, cfg.lr_min_ratio, total_steps, warmup_steps)


def make_optimizer(cfg: OptimConfig, schedule: optax.Schedule, puzzle_schedule: optax.Schedule | None = None
                   ) -> optax.GradientTransformation:
    """The network's optimizer (optim.name from `optimizers.OPTIMIZERS`, optional global-norm
    clipping, moments stored in optim.state_dtype); with `puzzle_schedule` (a model with a puzzle
    table), sign-SGD on the table beside it."""
    if cfg.name not in optimizers.OPTIMIZERS:
        raise ValueError(f"unknown optimizer {cfg.name!r}; use one of {sorted(optimizers.OPTIMIZERS)}")
    parts = [] if cfg.grad_clip_norm is None else [optax.clip_by_global_norm(cfg.grad_clip_norm)]
    main = optax.chain(*parts, optimizers.OPTIMIZERS[cfg.name](cfg, schedule))
    state_dtype = jnp.dtype(StateDtype(cfg.state_dtype).value)
    if state_dtype != jnp.float32:
        main = optimizers.with_state_dtype(main, state_dtype)
    if puzzle_schedule is None:
        return main
    return optimizers.recursive_optimizer(main, puzzle_schedule, cfg.puzzle_emb_weight_decay)


def has_puzzle_table(abstract_params: Any) -> bool:
    return isinstance(abstract_params, dict) and optimizers.PUZZLE_EMB in abstract_params




def batch_shardings(mesh: Mesh, fields: dict[str, int] | None = None) -> dict[str, Any]:
    """Every field split on its first dim by the table's "batch" rule."""
    return {k: batch_sharding(mesh, ndim) for k, ndim in (fields or PUZZLE_BATCH_FIELDS).items()}


def abstract_batch(mesh: Mesh, global_batch: int, seq_len: int, fields: dict[str, int] | None = None,
                   shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes, dtypes and shardings of a global batch, for lowering without data. Each field is
    (global_batch, seq_len)[:ndim] unless `shapes` (a task's ``batch_shapes(global_batch)``, e.g.
    multi-task sub-batches of different lengths) gives its global shape."""
    shardings = batch_shardings(mesh, fields)
    return {k: jax.ShapeDtypeStruct(tuple(shapes[k]) if shapes is not None else (global_batch, seq_len)[:ndim],
                                    jnp.int32, sharding=shardings[k])
            for k, ndim in (fields or PUZZLE_BATCH_FIELDS).items()}


def task_batch_shapes(task: Task, global_batch: int, seq_len: int) -> dict[str, tuple[int, ...]]:
    """Every batch field's global shape: the task's own (``task.batch_shapes``), else
    (global_batch, seq_len)[:rank]."""
    return task.batch_shapes(global_batch) or {k: (global_batch, seq_len)[:ndim] for k, ndim in task.batch_fields.items()}


def carry_shardings(abstract_carry: Any, mesh: Mesh) -> Any:
    """Every carry leaf has the batch first: sharded by the table's "batch" rule like the batch."""
    return jax.tree.map(lambda a: NamedSharding(mesh, batch_spec(mesh, a.ndim, a.shape)), abstract_carry)


def _is_none(x: Any) -> bool:
    return x is None


def trainable_part(params: Any, mask: Any) -> Any:
    """The trainable leaves of `params`; frozen ones become None (an empty subtree to optax)."""
    return params if mask is None else jax.tree.map(lambda m, p: p if m else None, mask, params)


def with_frozen(trainable: Any, params: Any) -> Any:
    """`trainable` (None at frozen leaves) filled in from `params`."""
    return jax.tree.map(lambda t, p: p if t is None else t, trainable, params, is_leaf=_is_none)


@dataclass
class Steps:
    """The compiled-once building blocks of a run, all sharded on `mesh`."""

    init: Callable[[jax.Array], TrainState]
    init_from: Callable[[jax.Array, Any], TrainState]  # (rng, params) -> state starting from those params
    train: Callable  # (state, batch) -> (state, metrics)
    eval: Callable  # (params, ema_params, batch) -> metric sums
    eval_rows: Callable | None  # (params, ema_params, batch) -> (sums, per-row outputs); tasks with eval_outputs
    state_shardings: Any
    abstract_state: Any  # ShapeDtypeStructs with shardings: the restore target
    summarize: Callable  # (sums, global_batch, training) -> metrics (host side)
    batch_fields: dict[str, int]  # the batch's field names and ranks
    task: Any = None
    batch_shapes: dict[str, tuple[int, ...]] | None = None  # per-field global shapes when the task gives them
    # step -> the Steps in use at that optimizer step (a curriculum swaps cycle counts); self by default
    at_step: Callable[[int], "Steps"] | None = None
    # () -> a fresh jit of the train step (same shardings), to lower in perf.analysis_mode: a
    # new function object, so jit's trace cache cannot hand back the looped trace
    train_analysis: Callable[[], Callable] | None = None

    def __post_init__(self):
        if self.at_step is None:
            self.at_step = lambda step: self


def make_train_step(task: Task, tx: optax.GradientTransformation, schedule: optax.Schedule, mask: Any,
                    ema_rate: float | None, puzzle_table: bool, accum: tuple[int, Mesh, Any] | None = None) -> Callable:
    """(state, batch) -> (state, metrics): one optimizer step on the trainable leaves.

    `accum` = (k, mesh, the trainable leaves' shardings) with k > 1: the gradient is summed over
    k micro-batches (`runtime.grad_accum`); None: one pass over the whole batch. In
    `analysis_mode` (a FLOP count) the whole batch goes at once: the same FLOPs, and no loop
    that XLA's count would take once or, unrolled, k times the compile."""

    def train_step(state: TrainState, batch):
        rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)

        def loss_of(trainable, carry, rows, key):
            return task.train_loss(with_frozen(trainable, state.params), carry, rows, key, step=state.step)

        trainable = trainable_part(state.params, mask)
        if accum is None or in_analysis():
            (loss, (carry, sums, opt_extra)), grads = jax.value_and_grad(
                lambda tr: loss_of(tr, state.carry, batch, rng), has_aux=True)(trainable)
        else:
            (loss, (carry, sums, opt_extra)), grads = grad_accum.accumulated_value_and_grad(
                task, loss_of, trainable, state.carry, batch, rng, *accum)
        if puzzle_table:
            updates, opt_state = tx.update(grads, state.opt_state, trainable, **opt_extra)
        else:
            updates, opt_state = tx.update(grads, state.opt_state, trainable)
        trainable = optax.apply_updates(trainable, updates)
        params = with_frozen(trainable, state.params)
        ema = state.ema_params
        if ema is not None:
            ema = optimizers.ema_update(ema, trainable, cast(float, ema_rate))  # the state has EMA iff a rate is set
        metrics = {
            "sums": sums,
            "grad_norm": optax.tree.norm(grads),
            "param_norm": optax.tree.norm(trainable),
            "lr": schedule(state.step),
        }
        metrics["finite"] = jnp.isfinite(loss) & jnp.isfinite(metrics["grad_norm"])
        new_state = dataclasses.replace(state, step=state.step + 1, params=params, opt_state=opt_state, ema_params=ema,
                                        carry=carry)
        return new_state, metrics

    return train_step


def traced_with_rules(mesh: Mesh, fn: Callable) -> Callable:
    """`fn` traced under the table's rules on `mesh`: a model's `nn.with_logical_constraint`s take effect."""

    @functools.wraps(fn)
    def traced(*args):
        with activation_rules(mesh):
            return fn(*args)

    return traced


def build_steps(task: Any, tx: optax.GradientTransformation, schedule: optax.Schedule, mesh: Mesh,
                seq_len: int, ema_rate: float | None, global_batch: int = 1, grad_accum_steps: int = 1) -> Steps:
    """`task`: a model family's `runtime.task.Task`.

    A task may name frozen parameters with ``trainable_mask(params) -> tree of bools`` (LoRA:
    only the adapters train): frozen leaves get no gradient, no optimizer state and no EMA.
    `grad_accum_steps` > 1: each train step sums the gradients of that many micro-batches
    (`runtime.grad_accum`); every batch field's rows must split evenly over them and the batch devices.
    """
    shapes = task_batch_shapes(task, global_batch, seq_len)
    if grad_accum_steps > 1:
        problem = grad_accum.micro_batch_error({f"batch field {k!r}": s[0] for k, s in shapes.items()},
                                               grad_accum_steps, grad_accum.batch_shards(mesh))
        if problem:
            raise UserError(problem)
    example = abstract_batch(mesh, global_batch, seq_len, task.batch_fields, shapes)
    zeros_batch = lambda: {k: jnp.zeros(v.shape, v.dtype) for k, v in example.items()}  # noqa: E731
    abstract_unboxed = nn.meta.unbox(jax.eval_shape(lambda: task.init(jax.random.key(0), zeros_batch())))
    mask = task.trainable_mask(abstract_unboxed)

    def state_from(rng_data, params):
        trainable = trainable_part(params, mask)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(trainable),
            ema_params=optimizers.ema_init(trainable) if ema_rate is not None else None,
            rng=rng_data,
            carry=task.init_carry(zeros_batch()),
        )

    def boxed_init(rng_data):
        return state_from(rng_data, task.init(jax.random.wrap_key_data(rng_data), zeros_batch()))

    rng_shape = jax.ShapeDtypeStruct((2,), jnp.uint32)
    boxed = jax.eval_shape(boxed_init, rng_shape)
    state_shardings = logical_shardings(boxed, mesh)
    if boxed.carry is not None:
        state_shardings = state_shardings.replace(carry=carry_shardings(boxed.carry, mesh))
    # Created already sharded: each device computes only its own shard of every parameter.
    init = jax.jit(lambda r: nn.meta.unbox(boxed_init(r)), in_shardings=replicated(mesh), out_shardings=state_shardings)
    init_from = jax.jit(state_from, in_shardings=(replicated(mesh), state_shardings.params),
                        out_shardings=state_shardings)
    abstract_state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nn.meta.unbox(boxed), state_shardings)

    accum = None
    if grad_accum_steps > 1:
        accum = (grad_accum_steps, mesh, trainable_part(state_shardings.params, mask))
    train_step = make_train_step(task, tx, schedule, mask, ema_rate, has_puzzle_table(boxed.params), accum)

    def eval_params(params, ema_params):
        if ema_params is None:
            return params
        return with_frozen(optimizers.with_ema(trainable_part(params, mask), ema_params), params)

    def eval_step(params, ema_params, batch):
        return task.eval_sums(eval_params(params, ema_params), batch)

    with_rules = functools.partial(traced_with_rules, mesh)

    batch_specs = batch_shardings(mesh, task.batch_fields)
    jit_train = lambda fn: jax.jit(with_rules(fn), in_shardings=(state_shardings, batch_specs),  # noqa: E731
                                   out_shardings=(state_shardings, replicated(mesh)), donate_argnums=(0,))
    train = jit_train(train_step)
    evaluate = jax.jit(with_rules(eval_step),
                       in_shardings=(state_shardings.params, state_shardings.ema_params, batch_specs),
                       out_shardings=replicated(mesh))
    eval_rows = None
    if task.has_eval_outputs:
        eval_rows = jax.jit(with_rules(lambda p, e, b: task.eval_outputs(eval_params(p, e), b)),
                            in_shardings=(state_shardings.params, state_shardings.ema_params, batch_specs),
                            out_shardings=(replicated(mesh), batch_sharding(mesh, 1)))
    return Steps(init=init, init_from=init_from, train=train, eval=evaluate, eval_rows=eval_rows,
                 state_shardings=state_shardings,
                 abstract_state=abstract_state, summarize=task.summarize,
                 batch_fields=dict(task.batch_fields), task=task,
                 batch_shapes=shapes, train_analysis=lambda: jit_train(lambda s, b: train_step(s, b)))
