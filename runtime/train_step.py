"""Train state, optimizer, loss, and the jitted, sharded train and eval steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from runtime.config import OptimConfig
from runtime.sharding import batch_sharding, logical_shardings, replicated

IGNORE_LABEL = -100


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps taken == index of the next global batch
    params: Any
    opt_state: Any
    ema_params: Any  # None when EMA is off
    rng: jax.Array  # raw key data (uint32[2]) so it checkpoints as a plain array


def lr_schedule(cfg: OptimConfig, total_steps: int, warmup_steps: int) -> optax.Schedule:
    """Linear warmup from step 1, then cosine from lr to lr * lr_min_ratio at total_steps."""

    def schedule(count):
        step = count + 1
        warm = cfg.lr * jnp.minimum(1.0, step / max(1, warmup_steps))
        progress = jnp.clip((step - warmup_steps) / max(1, total_steps - warmup_steps), 0.0, 1.0)
        cosine = cfg.lr * (cfg.lr_min_ratio + (1 - cfg.lr_min_ratio) * 0.5 * (1 + jnp.cos(jnp.pi * progress)))
        return jnp.where(step <= warmup_steps, warm, cosine)

    return schedule


def make_optimizer(cfg: OptimConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    parts = []
    if cfg.grad_clip_norm is not None:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip_norm))
    if cfg.name == "adamw":
        parts.append(optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay))
    else:
        raise ValueError(f"unknown optimizer {cfg.name}")
    return optax.chain(*parts)


def sequence_loss(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Softmax cross-entropy averaged per sequence over its valid tokens, then over the batch.

    Returns the loss and metric sums (reduced over the global batch on device).
    """
    valid = labels != IGNORE_LABEL
    safe = jnp.where(valid, labels, 0)
    token_loss = optax.softmax_cross_entropy_with_integer_labels(logits, safe)
    count = valid.sum(-1)
    seq_loss = jnp.where(valid, token_loss, 0.0).sum(-1) / jnp.maximum(count, 1)
    correct = (logits.argmax(-1) == safe) & valid
    has_labels = count > 0
    sums = {
        "loss_sum": seq_loss.sum(),
        "sequences": has_labels.sum(),
        "correct_tokens": correct.sum(),
        "tokens": count.sum(),
        "exact": (has_labels & (correct.sum(-1) == count)).sum(),
    }
    return seq_loss.sum() / logits.shape[0], sums


def summarize(sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
    seqs = jnp.maximum(sums["sequences"], 1)
    return {
        "loss": sums["loss_sum"] / seqs,
        "token_accuracy": sums["correct_tokens"] / jnp.maximum(sums["tokens"], 1),
        "exact_accuracy": sums["exact"] / seqs,
    }


def batch_shardings(mesh: Mesh) -> dict[str, Any]:
    return {"inputs": batch_sharding(mesh, 2), "labels": batch_sharding(mesh, 2),
            "puzzle_identifiers": batch_sharding(mesh, 1)}


def abstract_batch(mesh: Mesh, global_batch: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes, dtypes and shardings of a global batch, for lowering without data."""
    shapes = {"inputs": (global_batch, seq_len), "labels": (global_batch, seq_len), "puzzle_identifiers": (global_batch,)}
    return {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_shardings(mesh)[k]) for k, shape in shapes.items()}


@dataclass
class Steps:
    """The compiled-once building blocks of a run, all sharded on `mesh`."""

    init: Callable[[jax.Array], TrainState]
    train: Callable  # (state, batch) -> (state, metrics)
    eval: Callable  # (params, batch) -> metric sums
    state_shardings: Any
    abstract_state: Any  # ShapeDtypeStructs with shardings: the restore target


def build_steps(model: nn.Module, tx: optax.GradientTransformation, schedule: optax.Schedule, mesh: Mesh,
                seq_len: int, ema_rate: float | None) -> Steps:
    def boxed_init(rng_data):
        params = model.init(jax.random.wrap_key_data(rng_data), jnp.zeros((1, seq_len), jnp.int32))["params"]
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(params),
            ema_params=params if ema_rate is not None else None,
            rng=rng_data,
        )

    rng_shape = jax.ShapeDtypeStruct((2,), jnp.uint32)
    boxed = jax.eval_shape(boxed_init, rng_shape)
    state_shardings = logical_shardings(boxed, mesh)
    # Created already sharded: each device computes only its own shard of every parameter.
    init = jax.jit(lambda r: nn.meta.unbox(boxed_init(r)), in_shardings=replicated(mesh), out_shardings=state_shardings)
    abstract_state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nn.meta.unbox(boxed), state_shardings)

    def train_step(state: TrainState, batch):
        def loss_fn(params):
            logits = model.apply({"params": params}, batch["inputs"])
            return sequence_loss(logits, batch["labels"])

        (loss, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        ema = state.ema_params
        if ema is not None:
            ema = jax.tree.map(lambda e, p: ema_rate * e + (1 - ema_rate) * p, ema, params)
        metrics = summarize(sums) | {
            "grad_norm": optax.global_norm(grads),
            "param_norm": optax.global_norm(params),
            "lr": schedule(state.step),
        }
        metrics["finite"] = jnp.isfinite(loss) & jnp.isfinite(metrics["grad_norm"])
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state, ema_params=ema), metrics

    def eval_step(params, batch):
        logits = model.apply({"params": params}, batch["inputs"])
        return sequence_loss(logits, batch["labels"])[1]

    batch_specs = batch_shardings(mesh)
    train = jax.jit(train_step, in_shardings=(state_shardings, batch_specs),
                    out_shardings=(state_shardings, replicated(mesh)), donate_argnums=(0,))
    evaluate = jax.jit(eval_step, in_shardings=(state_shardings.params, batch_specs), out_shardings=replicated(mesh))
    return Steps(init=init, train=train, eval=evaluate, state_shardings=state_shardings, abstract_state=abstract_state)
