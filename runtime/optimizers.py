"""Optimizers for the recursive-reasoning models, as optax transformations.

* `adam_atan2`: AdamATan2 exactly as the reference's fused kernel (the ``adam-atan2`` package
  used by TRM/HRM): decoupled decay ``p <- p (1 - lr wd)``; ``m, v`` EMAs of g and g^2;
  ``p <- p - lr / (1 - b1^t) * atan2(m, sqrt(v) / sqrt(1 - b2^t))``. That package has no
  ``a``/``b`` scale constants (unlike the paper's ``a * atan2(m, b sqrt v)`` variants), i.e.
  a = b = 1. No epsilon, no decay exclusions.
* `lion`: optax's Lion behind the same (learning_rate, b1, b2, weight_decay) signature.
* `sparse_sign_sgd`: the puzzle-embedding optimizer. Only rows whose id appears in the
  global batch change: ``p <- p (1 - lr wd) - lr sign(g)``; untouched rows are left exactly
  as they are (no decay). It takes the ids as an extra argument (``puzzle_identifiers=``).
  The gradient of a ``jnp.take`` lookup is a scatter-add over the whole (global, sharded)
  batch, so gradients of repeated ids are already summed when it gets them; it is plain jnp
  on the full logical table, so a table sharded over rows stays sharded under jit.
* `recursive_optimizer`: `sparse_sign_sgd` on the ``puzzle_emb`` table and a main optimizer
  on everything else (the reference's two optimizers), via ``optax.partition``.
* Full fine-tuning: `adafactor` (optax's, factored second moments, decoupled weight decay)
  and `with_state_dtype` (any optimizer's state stored in e.g. bfloat16, updated in fp32).
* EMA helpers (`ema_init`, `ema_update`, `with_ema`): an EMA of every parameter except the
  puzzle table (the reference keeps EMA only for trained ``nn.Parameter``s; its table is a
  buffer). Evaluation uses EMA weights with the live table.

Learning rates may be floats or optax schedules of the update count (0 for the first update).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

PUZZLE_EMB = "puzzle_emb"  # top-level key of the puzzle-embedding table in the params tree


def _lr_at(learning_rate: optax.ScalarOrSchedule, count: jax.Array) -> jax.Array:
    return learning_rate(count) if callable(learning_rate) else jnp.asarray(learning_rate, jnp.float32)


# ------------------------------------------------------------------------------- AdamATan2

class AdamATan2State(NamedTuple):
    # the field shadows tuple.count (mypy: assignment), as optax's states' `count` does; the name is in checkpoints
    count: jax.Array  # type: ignore[assignment]  # int32 scalar: updates done so far
    mu: Any
    nu: Any


def adam_atan2(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9, b2: float = 0.95,
               weight_decay: float = 0.1) -> optax.GradientTransformation:
    """AdamATan2 (see the module docstring). Updates are ``new_params - params``."""

    def init(params):
        zeros = lambda p: jnp.zeros_like(p)  # noqa: E731  (keeps logical-axis boxes)
        return AdamATan2State(count=jnp.zeros([], jnp.int32), mu=jax.tree.map(zeros, params),
                              nu=jax.tree.map(zeros, params))

    def update(grads, state, params=None):
        if params is None:
            raise ValueError("adam_atan2 needs params (decoupled weight decay)")
        t = state.count + 1
        lr = _lr_at(learning_rate, state.count)
        tf = t.astype(jnp.float32)
        step_size = lr / (1.0 - jnp.power(b1, tf))
        bc2_sqrt = jnp.sqrt(1.0 - jnp.power(b2, tf))
        decay_rate = lr * weight_decay
        mu = jax.tree.map(lambda m, g: m + (1.0 - b1) * (g.astype(m.dtype) - m), state.mu, grads)
        nu = jax.tree.map(lambda v, g: v + (1.0 - b2) * (jnp.square(g.astype(v.dtype)) - v), state.nu, grads)

        def delta(p, m, v):  # new - p, formed directly (no cancellation)
            return (-decay_rate * p - step_size * jnp.arctan2(m, jnp.sqrt(v) / bc2_sqrt)).astype(p.dtype)

        updates = jax.tree.map(delta, params, mu, nu)
        return updates, AdamATan2State(count=t, mu=mu, nu=nu)

    return optax.GradientTransformation(init, update)


# ------------------------------------------------------------------------------- Lion

def lion(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9, b2: float = 0.99,
         weight_decay: float = 0.0) -> optax.GradientTransformation:
    """optax's Lion: ``p <- p - lr (sign(b1 m + (1-b1) g) + wd p)``; ``m <- b2 m + (1-b2) g``."""
    return optax.lion(learning_rate, b1=b1, b2=b2, weight_decay=weight_decay)


# ------------------------------------------------------------------------------- sparse sign-SGD

class SignSGDState(NamedTuple):
    count: jax.Array  # type: ignore[assignment]  # shadows tuple.count, as optax's states' `count` does


def touched_rows(num_rows: int, ids: jax.Array) -> jax.Array:
    """bool [num_rows]: which rows appear in `ids` (any shape)."""
    return jnp.zeros((num_rows,), jnp.bool_).at[ids.reshape(-1).astype(jnp.int32)].set(True, mode="drop")


def scatter_row_grads(num_rows: int, ids: jax.Array, row_grads: jax.Array) -> jax.Array:
    """Dense table gradient from per-example row gradients [N, D]: repeated ids are summed."""
    out = jnp.zeros((num_rows,) + row_grads.shape[1:], row_grads.dtype)
    return out.at[ids.reshape(-1).astype(jnp.int32)].add(row_grads, mode="drop")


def sign_sgd_delta(table: jax.Array, grad: jax.Array, ids: jax.Array, lr, weight_decay: float) -> jax.Array:
    """Update (new - old): ``-lr wd p - lr sign(g)`` on touched rows, exactly 0 elsewhere."""
    touched = touched_rows(table.shape[0], ids).reshape((-1,) + (1,) * (table.ndim - 1))
    delta = -(lr * weight_decay) * table - lr * jnp.sign(grad.astype(table.dtype))
    return jnp.where(touched, delta, jnp.zeros_like(table)).astype(table.dtype)


def sign_sgd_rows(table: jax.Array, grad: jax.Array, ids: jax.Array, lr, weight_decay: float) -> jax.Array:
    """New table: touched rows get ``p (1 - lr wd) - lr sign(g)``, the others are unchanged."""
    return table + sign_sgd_delta(table, grad, ids, lr, weight_decay)


def _path_keys(path) -> list[Any]:
    return [getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path]


def _table_ids(path, ids: Mapping[str, jax.Array]) -> jax.Array:
    """The ids of the table at `path`: the entry named by the key after ``puzzle_emb`` (else by
    the first key of the path that names an entry)."""
    keys = _path_keys(path)
    if PUZZLE_EMB in keys and keys.index(PUZZLE_EMB) + 1 < len(keys):
        name = keys[keys.index(PUZZLE_EMB) + 1]
    else:
        name = next((k for k in keys if k in ids), None)
    if name not in ids:
        raise ValueError(f"no puzzle_identifiers for the table at {jax.tree_util.keystr(path)}; got ids for {sorted(ids)}")
    return ids[name]


def sparse_sign_sgd(learning_rate: optax.ScalarOrSchedule, weight_decay: float = 0.1
                    ) -> optax.GradientTransformationExtraArgs:
    """Sign-SGD on touched rows of every leaf (the puzzle table). Call
    ``update(grads, state, params, puzzle_identifiers=ids)`` with the ids the forward pass
    looked up (for ACT: ``new_carry.current_data['puzzle_identifiers']``, the whole global
    batch). Several tables (multi-task: ``puzzle_emb/<task>``) take a dict ``{task: ids}``:
    each table is updated with the ids of the task its path names."""

    def init(params):
        del params
        return SignSGDState(count=jnp.zeros([], jnp.int32))

    def update(grads, state, params=None, *, puzzle_identifiers=None, **extra):
        del extra
        if params is None or puzzle_identifiers is None:
            raise ValueError("sparse_sign_sgd needs params and puzzle_identifiers=")
        lr = _lr_at(learning_rate, state.count)
        if isinstance(puzzle_identifiers, Mapping):
            updates = jax.tree_util.tree_map_with_path(
                lambda path, p, g: sign_sgd_delta(p, g, _table_ids(path, puzzle_identifiers), lr, weight_decay),
                params, grads)
        else:
            updates = jax.tree.map(lambda p, g: sign_sgd_delta(p, g, puzzle_identifiers, lr, weight_decay), params, grads)
        return updates, SignSGDState(count=state.count + 1)

    return optax.GradientTransformationExtraArgs(init, update)


# ------------------------------------------------------------------------------- combined

def _top_key(path) -> Any:
    k = path[0]
    return getattr(k, "key", getattr(k, "name", k))


def param_labels(params: Any) -> Any:
    """'puzzle_emb' for the puzzle table, 'main' for everything else.

    Logical-axis boxes (flax ``AxisMetadata``) count as leaves, so the labels are a prefix of
    a boxed tree: masked-out optimizer state is then a bare ``MaskedNode`` (no box around it,
    which the sharding rules could not map).
    """
    return jax.tree_util.tree_map_with_path(lambda path, _: PUZZLE_EMB if _top_key(path) == PUZZLE_EMB else "main",
                                            params, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))


def recursive_optimizer(main: optax.GradientTransformation, puzzle_lr: optax.ScalarOrSchedule,
                        puzzle_weight_decay: float) -> optax.GradientTransformationExtraArgs:
    """`main` on all parameters but the puzzle table, `sparse_sign_sgd` on the table.
    Update with ``tx.update(grads, state, params, puzzle_identifiers=ids)``."""
    return optax.partition({"main": main, PUZZLE_EMB: sparse_sign_sgd(puzzle_lr, puzzle_weight_decay)}, param_labels)


# ------------------------------------------------------------------------------- EMA

def _without_table(params: Any) -> Any:
    if isinstance(params, dict) and PUZZLE_EMB in params:
        return {k: v for k, v in params.items() if k != PUZZLE_EMB}
    return params


def ema_init(params: Any) -> Any:
    """EMA shadow: a copy of the parameters without the puzzle table."""
    return jax.tree.map(lambda p: p, _without_table(params))


def ema_update(ema: Any, params: Any, rate: float = 0.999) -> Any:
    """``ema <- rate * ema + (1 - rate) * params`` (puzzle table excluded)."""
    return jax.tree.map(lambda e, p: rate * e + (1.0 - rate) * p, ema, _without_table(params))


def with_ema(params: Any, ema: Any) -> Any:
    """Parameters for evaluation: EMA weights, and the live puzzle table."""
    if isinstance(params, dict) and PUZZLE_EMB in params:
        return dict(ema) | {PUZZLE_EMB: params[PUZZLE_EMB]}
    return ema


# ------------------------------------------------------------------------------- full fine-tuning

def adafactor(learning_rate: optax.ScalarOrSchedule, *, weight_decay: float = 0.0, min_dim_size_to_factor: int = 128,
              decay_rate: float = 0.8, clipping_threshold: float | None = 1.0,
              multiply_by_parameter_scale: bool = True, momentum: float | None = None,
              weight_decay_mask: Any = None) -> optax.GradientTransformationExtraArgs:
    """optax's Adafactor (factored second moments: a [R, C] matrix keeps R + C floats of state,
    not Adam's 2 R C) with decoupled weight decay ``p <- p (1 - lr wd)`` as in AdamW.

    optax adds its ``weight_decay_rate`` after the learning-rate scaling (``-wd p``, not
    ``-lr wd p``), so the rate handed to it is ``lr(count) * wd``. Both count updates from 0.
    With ``multiply_by_parameter_scale`` (optax's default) the step is relative to each
    parameter block's RMS; pass False for an absolute learning rate.
    """
    decay = None
    if weight_decay:
        decay = ((lambda count: learning_rate(count) * weight_decay) if callable(learning_rate)
                 else learning_rate * weight_decay)
    return optax.adafactor(learning_rate, min_dim_size_to_factor=min_dim_size_to_factor, decay_rate=decay_rate,
                           clipping_threshold=clipping_threshold,
                           multiply_by_parameter_scale=multiply_by_parameter_scale, momentum=momentum,
                           weight_decay_rate=decay, weight_decay_mask=weight_decay_mask)


def _cast_state(tree: Any, dtype) -> Any:
    """Floating arrays (ndim >= 1) to `dtype`. Counts stay integer; float scalars (injected
    hyperparameters, scale factors) stay as they are: they cost nothing and need the precision."""
    def cast(x):
        if hasattr(x, "dtype") and getattr(x, "ndim", 0) >= 1 and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x
    return jax.tree.map(cast, tree)


def with_state_dtype(tx: optax.GradientTransformation, dtype) -> optax.GradientTransformationExtraArgs:
    """`tx` with its floating-point state stored in `dtype` (e.g. bfloat16: half the optimizer
    memory). The update runs in float32 (state cast up, then back down), so only storage
    precision is lost: with round-to-nearest, EMA increments below ~1/256 of a bf16 moment
    (e.g. Adam's nu with b2 = 0.999 once it has settled) are rounded away."""
    inner = optax.with_extra_args_support(tx)

    def init(params):
        return _cast_state(inner.init(params), dtype)

    def update(grads, state, params=None, **extra):
        updates, new_state = inner.update(grads, _cast_state(state, jnp.float32), params, **extra)
        return updates, _cast_state(new_state, dtype)

    return optax.GradientTransformationExtraArgs(init, update)


# ------------------------------------------------------------------------------- the optim.name registry

# optim.name -> factory(optim config, learning-rate schedule) -> the network's optimizer. The one
# list of optimizer names: config validation reads its keys, `train_step.make_optimizer` calls it.
OPTIMIZERS: dict[str, Callable[[Any, optax.ScalarOrSchedule], optax.GradientTransformation]] = {
    "adamw": lambda cfg, lr: optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay),
    "adam_atan2": lambda cfg, lr: adam_atan2(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay),
    "lion": lambda cfg, lr: lion(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay),
    # factored second moments: O(rows + cols) state per matrix; an absolute learning rate
    "adafactor": lambda cfg, lr: adafactor(lr, weight_decay=cfg.weight_decay, multiply_by_parameter_scale=False),
}
