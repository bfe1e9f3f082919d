"""ACT losses and metrics for TRM/HRM (the reference's ``ACTLossHead``), as pure functions.

Precision. The reference evaluates stablemax in float64. We use **float32** by default:
TPUs have no native float64 (it is emulated and slow) and JAX runs with x64 disabled. In
float32, with the guarded branches below, ``log s(x) - log sum s`` is accurate to ~1e-7
relative for any finite logit, so the loss and its gradient match the float64 reference to
float32 rounding. ``precision="float64"`` is available for checks but requires
``jax_enable_x64`` (otherwise it raises rather than silently computing in float32).

The "double where": ``s(x) = 1/(1-x)`` for ``x < 0`` else ``x + 1``. A plain
``where(x < 0, 1/(1-x), x+1)`` still differentiates the unselected branch: at ``x = 1.0``,
``1/(1-x)`` is inf and its gradient times the zero mask is NaN. Each branch therefore gets an
input that is safe for it (``x_neg = where(x < 0, x, 0)``, ``x_pos = where(x < 0, 0, x)``).

Reductions (match the reference): per sequence, the sum of token losses over valid labels
(``labels != runtime.task.IGNORE_LABEL``) divided by ``max(1, valid count)``; ``lm_loss`` sums sequences over the
batch. ``q_halt_loss = sum BCE-with-logits(q_halt, sequence exactly correct)``;
``q_continue_loss = sum BCE(q_continue, target_q_continue)`` when the target exists.
``total = lm_loss + 0.5 * (q_halt_loss + q_continue_loss)``; the caller divides by the
GLOBAL batch size before differentiating (as the reference's ``loss / global_batch_size``).
With the cycle-consistency regulariser on (``outputs["cycle_delta"]`` present, see
``TRMConfig.cycle_consistency_weight``), ``total += cycle_weight * cycle_loss`` where
``cycle_loss = sum over rows of cycle_delta`` (not part of the reference).
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

from runtime.task import IGNORE_LABEL


def _compute_dtype(precision: str):
    if precision == "float32":
        return jnp.float32
    if precision == "float64":
        if not jax.config.jax_enable_x64:
            raise ValueError("precision='float64' needs jax_enable_x64=True")
        return jnp.float64
    raise ValueError(f"precision must be 'float32' or 'float64', got {precision!r}")


def stablemax_s(x: jax.Array) -> jax.Array:
    """s(x) = 1/(1-x) for x < 0, x + 1 otherwise, with both branches' inputs guarded."""
    neg = x < 0
    x_neg = jnp.where(neg, x, 0.0)
    x_pos = jnp.where(neg, 0.0, x)
    return jnp.where(neg, 1.0 / (1.0 - x_neg), x_pos + 1.0)


def log_stablemax(x: jax.Array, axis: int = -1) -> jax.Array:
    s = stablemax_s(x)
    return jnp.log(s) - jnp.log(jnp.sum(s, axis=axis, keepdims=True))


def _gather_label(logprobs: jax.Array, labels: jax.Array, valid: jax.Array) -> jax.Array:
    safe = jnp.where(valid, labels, 0).astype(jnp.int32)
    picked = jnp.take_along_axis(logprobs, safe[..., None], axis=-1)[..., 0]
    return -jnp.where(valid, picked, 0.0)


def stablemax_cross_entropy(logits: jax.Array, labels: jax.Array, valid_mask: jax.Array | None = None,
                            precision: str = "float32") -> jax.Array:
    """Per-token stablemax CE [..., L]; 0 where the label is ignored."""
    valid = (labels != IGNORE_LABEL) if valid_mask is None else valid_mask
    logprobs = log_stablemax(logits.astype(_compute_dtype(precision)), axis=-1)
    return _gather_label(logprobs, labels, valid)


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array, valid_mask: jax.Array | None = None,
                          precision: str = "float32") -> jax.Array:
    """Per-token softmax CE [..., L] (float32 like the reference); 0 where ignored."""
    valid = (labels != IGNORE_LABEL) if valid_mask is None else valid_mask
    logprobs = jax.nn.log_softmax(logits.astype(_compute_dtype(precision)), axis=-1)
    return _gather_label(logprobs, labels, valid)


LOSS_FNS = {
    "stablemax_cross_entropy": stablemax_cross_entropy,
    "softmax_cross_entropy": softmax_cross_entropy,
}


def bce_with_logits(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Elementwise binary cross-entropy on logits (numerically stable)."""
    logits = logits.astype(jnp.float32)
    targets = targets.astype(jnp.float32)
    return jnp.maximum(logits, 0.0) - logits * targets + jnp.log1p(jnp.exp(-jnp.abs(logits)))


def act_loss(outputs: Mapping[str, jax.Array], labels: jax.Array, halted: jax.Array, steps: jax.Array,
             loss_type: str = "stablemax_cross_entropy", precision: str = "float32", cycle_weight: float = 0.0
             ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(total, metric sums) for one ACT step.

    `labels`, `halted`, `steps` come from the NEW carry (``carry.current_data['labels']``,
    ``carry.halted``, ``carry.steps``). `total` is summed over the batch (divide by the global
    batch size). Metrics are on-device sums over this batch (reduce globally by summing):
    ``count`` (halted rows with >= 1 valid label), ``accuracy`` (sum of per-row token
    accuracy), ``exact_accuracy``, ``q_halt_accuracy``, ``steps`` (all over those rows), and
    the loss sums ``lm_loss``, ``q_halt_loss``, ``q_continue_loss`` (over all rows), and
    ``cycle_loss`` (unweighted, over all rows) only when `outputs` has ``cycle_delta``. See
    `summarize` for the reference's normalisation.
    """
    try:
        loss_fn = LOSS_FNS[loss_type]
    except KeyError:
        raise ValueError(f"unknown loss_type {loss_type!r}; use one of {sorted(LOSS_FNS)}") from None
    logits = outputs["logits"]
    q_halt = outputs["q_halt_logits"]

    valid = labels != IGNORE_LABEL
    counts = valid.sum(-1)
    divisor = jnp.maximum(counts, 1)[..., None].astype(jnp.float32)

    preds = jnp.argmax(jax.lax.stop_gradient(logits), axis=-1)
    is_correct = valid & (preds == labels)
    seq_correct = is_correct.sum(-1) == counts
    metric_rows = halted & (counts > 0)

    token_loss = loss_fn(logits, labels, valid_mask=valid, precision=precision)
    lm_loss = (token_loss / divisor).sum().astype(jnp.float32)
    q_halt_loss = bce_with_logits(q_halt, seq_correct).sum()
    q_continue_loss = jnp.zeros((), jnp.float32)
    if "target_q_continue" in outputs:
        q_continue_loss = bce_with_logits(outputs["q_continue_logits"], outputs["target_q_continue"]).sum()
    total = lm_loss + 0.5 * (q_halt_loss + q_continue_loss)
    cycle_loss = None
    if "cycle_delta" in outputs:
        cycle_loss = outputs["cycle_delta"].astype(jnp.float32).sum()
        total = total + cycle_weight * cycle_loss

    sg = jax.lax.stop_gradient
    metrics = {
        "count": metric_rows.sum().astype(jnp.int32),
        "accuracy": jnp.where(metric_rows, (is_correct.astype(jnp.float32) / divisor).sum(-1), 0.0).sum(),
        "exact_accuracy": (metric_rows & seq_correct).sum().astype(jnp.int32),
        "q_halt_accuracy": (metric_rows & ((sg(q_halt) >= 0) == seq_correct)).sum().astype(jnp.int32),
        "steps": jnp.where(metric_rows, steps, 0).sum().astype(jnp.int32),
        "lm_loss": sg(lm_loss),
        "q_halt_loss": sg(q_halt_loss),
        "q_continue_loss": sg(q_continue_loss),
    }
    if cycle_loss is not None:
        metrics["cycle_loss"] = sg(cycle_loss)
    return total, metrics


def summarize(sums: Mapping[str, jax.Array], global_batch: int) -> dict[str, jax.Array]:
    """Reference normalisation of globally summed metrics: ``*_loss`` / global batch, the rest
    / max(count, 1)."""
    count = jnp.maximum(sums["count"], 1).astype(jnp.float32)
    return {k: (v / global_batch if k.endswith("loss") else v / count) for k, v in sums.items() if k != "count"} | {
        "count": sums["count"]}
