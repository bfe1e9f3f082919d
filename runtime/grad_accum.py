"""Gradient accumulation: one optimizer step's gradient as the sum over k micro-batches.

With ``train.grad_accum_steps=k`` the train step splits the global batch (and the task's carry,
row for row) into k micro-batches and runs the task's loss and backward pass on each in turn
(`jax.lax.scan`, so only one micro-batch's activations are live), summing the gradients in
float32; one optimizer update follows. The result equals the full-batch step:

* Row placement: micro-batch i takes rows ``i*r .. (i+1)*r - 1`` of every batch shard's block
  (r = rows / (k x shards)), so each device computes on rows it already holds (no shuffle), and
  carry row j is always paired with batch row j.
* Normalisation: a task's loss is a sum divided by ``Task.loss_denominator(batch)`` (rows for
  TRM/HRM, target tokens for Gemma). Micro-batch i's loss is scaled by d_i / D (its denominator
  over the full batch's), so the scaled losses, and their gradients, add up to the full batch's
  exactly, whatever the micro-batches' token counts.
* Metric sums add up across micro-batches (they are sums over rows), so the host-side
  normalisation is that of the full batch. Optimizer extras are per-row arrays (TRM's puzzle
  ids) and are put back in row order like the carry.

Not equal bit for bit: the tasks' random draws (TRM/HRM halt exploration) use one key per
micro-batch (``fold_in(rng, i)``), so they differ from the full batch's, with the same distribution.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from runtime.sharding import batch_spec


def batch_shards(mesh: Mesh) -> int:
    """Devices a batch's rows are split over: the mesh axes of the table's "batch" rule."""
    axes = batch_spec(mesh, 1)[0]
    return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes or ()))


def micro_batch_error(rows: dict[str, int], k: int, shards: int) -> str | None:
    """Why `rows` (a batch field's rows by name, e.g. {"global batch": 49152}) cannot be cut into
    k micro-batches that each give every one of `shards` devices the same number of rows; None if they can."""
    for name, n in rows.items():
        if n % (k * shards):
            fits = [d for d in range(1, n // shards + 1) if n % (d * shards) == 0]
            return (f"train.grad_accum_steps={k} splits the {name} of {n} rows into micro-batches of {n / k:g}, "
                    f"which must be a whole multiple of the {shards} batch devices (data x fsdp); use "
                    f"grad_accum_steps in {fits[:12]}{' ...' if len(fits) > 12 else ''}")
    return None


def _constrain(x: jax.Array, mesh: Mesh) -> jax.Array:
    """[k, m, ...] with m split like a batch: the micro-batch axis unsharded."""
    spec = batch_spec(mesh, x.ndim - 1, x.shape[1:])
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, *spec)))


def split(tree: Any, k: int, mesh: Mesh) -> Any:
    """Every [rows, ...] leaf -> [k, rows / k, ...]; micro-batch i holds rows i*r .. (i+1)*r - 1
    of each shard's block (see the module docstring)."""
    shards = batch_shards(mesh)

    def one(x):
        rows, rest = x.shape[0], x.shape[1:]
        blocks = x.reshape((shards, k, rows // (k * shards)) + rest).swapaxes(0, 1)
        return _constrain(blocks.reshape((k, rows // k) + rest), mesh)

    return jax.tree.map(one, tree)


def join(tree: Any, k: int, mesh: Mesh) -> Any:
    """The inverse of `split`: [k, rows / k, ...] -> [rows, ...] in the original row order."""
    shards = batch_shards(mesh)

    def one(x):
        m, rest = x.shape[1], x.shape[2:]
        blocks = x.reshape((k, shards, m // shards) + rest).swapaxes(0, 1)
        return blocks.reshape((k * m,) + rest)

    return jax.tree.map(one, tree)


def accumulated_value_and_grad(task: Any, loss_of: Callable, trainable: Any, carry: Any, batch: Any, rng: jax.Array,
                               k: int, mesh: Mesh, grad_shardings: Any):
    """Like ``value_and_grad(loss_of, has_aux=True)(trainable)`` on the whole batch, by k micro-batches.

    `loss_of(trainable, carry, batch, rng) -> (loss, (new_carry, sums, optimizer extras))` is one
    task loss on any rows. Returns ((loss, (new_carry, sums, extras)), grads), with grads in the
    trainable leaves' dtypes, summed in float32 (sharded like the parameters: `grad_shardings`)."""
    total = task.loss_denominator(batch)

    def micro(i, carry_i, batch_i):
        weight = task.loss_denominator(batch_i) / total

        def scaled(tr):
            loss, aux = loss_of(tr, carry_i, batch_i, jax.random.fold_in(rng, i))
            return loss * weight, aux

        return jax.value_and_grad(scaled, has_aux=True)(trainable)

    def body(acc, xs):
        (loss, (new_carry, sums, extra)), grads = micro(*xs)
        acc_loss, acc_sums, acc_grads = acc
        grads = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc_grads, grads)
        sums = jax.tree.map(jnp.add, acc_sums, sums)
        return (acc_loss + loss, sums, grads), (new_carry, extra)

    xs = (jnp.arange(k), split(carry, k, mesh), split(batch, k, mesh))
    (_, (_, sums_shape, _)), _ = jax.eval_shape(micro, *jax.tree.map(lambda x: x[0], xs))
    zeros = jax.tree.map(lambda p, s: jax.lax.with_sharding_constraint(jnp.zeros(p.shape, jnp.float32), s),
                         trainable, grad_shardings)
    init = (jnp.zeros((), jnp.float32), jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sums_shape), zeros)
    (loss, sums, grads), (new_carry, extra) = jax.lax.scan(body, init, xs)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, trainable)
    return (loss, (join(new_carry, k, mesh), sums, join(extra, k, mesh))), grads
