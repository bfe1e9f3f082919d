"""Next-token cross-entropy over a tied embedding, with and without full logits.

Gemma's vocabulary is 256K: fp32 logits cost ~1 MB per token, and the naive loss (and its
gradient) keeps several [B, T, V] arrays alive. `chunked_cross_entropy` scans over token
chunks and rematerialises each chunk's logits in the backward pass, so at most a chunk's
[C, V] logits exist at once. `plain_cross_entropy` is the naive version, kept to measure
against (and as the reference in tests).

Both return ``(loss_sum, stats)``: the fp32 sum of per-token losses over non-ignored tokens
(labels == runtime.task.IGNORE_LABEL are skipped) and ``{"tokens", "correct"}`` int32 counts; divide outside.
Plain jnp throughout, so sharded inputs (batch over data axes, embedding over vocab/embed)
are partitioned by the compiler.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from models.flops import in_analysis
from runtime.task import IGNORE_LABEL


def mask_padding(logits: jax.Array, vocab_in_use: int | None) -> jax.Array:
    """Logits [..., V] with the padding rows' columns (ids >= vocab_in_use) at -inf."""
    if vocab_in_use is None or vocab_in_use >= logits.shape[-1]:
        return logits
    return jnp.where(jnp.arange(logits.shape[-1]) < vocab_in_use, logits, -jnp.inf)


def _token_terms(h: jax.Array, embedding: jax.Array, labels: jax.Array, softcap: float | None,
                 vocab_in_use: int | None = None):
    """h [N, D], labels [N] -> (loss sum, correct count, token count) over non-ignored tokens."""
    logits = jnp.einsum("nd,vd->nv", h, embedding, preferred_element_type=jnp.float32)
    if softcap is not None:
        logits = jnp.tanh(logits / softcap) * softcap
    logits = mask_padding(logits, vocab_in_use)
    valid = labels != IGNORE_LABEL
    safe = jnp.where(valid, labels, 0)
    label_logit = jnp.take_along_axis(logits, safe[:, None], axis=-1)[:, 0]
    nll = jax.nn.logsumexp(logits, axis=-1) - label_logit
    loss = jnp.sum(jnp.where(valid, nll, 0.0))
    correct = jnp.sum(valid & (jnp.argmax(logits, axis=-1) == safe), dtype=jnp.int32)
    return loss, correct, jnp.sum(valid, dtype=jnp.int32)


def _flatten(hidden: jax.Array, labels: jax.Array):
    return hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1).astype(jnp.int32)


def plain_cross_entropy(hidden: jax.Array, embedding: jax.Array, labels: jax.Array, *,
                        softcap: float | None = None,
                        vocab_in_use: int | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """hidden [B, T, D], embedding [V, D], labels [B, T] -> (loss_sum, stats). Materialises [B*T, V]."""
    h, y = _flatten(hidden, labels)
    loss, correct, tokens = _token_terms(h, embedding, y, softcap, vocab_in_use)
    return loss, {"tokens": tokens, "correct": correct}


def chunked_cross_entropy(hidden: jax.Array, embedding: jax.Array, labels: jax.Array, *, chunk_size: int,
                          softcap: float | None = None,
                          vocab_in_use: int | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Same results as `plain_cross_entropy`, holding one chunk's [chunk_size, V] logits at a time."""
    h, y = _flatten(hidden, labels)
    n, d = h.shape
    c = min(chunk_size, n)
    pad = -n % c
    if pad:  # padded tokens are ignored, so they add nothing to loss, stats or gradients
        h = jnp.pad(h, ((0, pad), (0, 0)))
        y = jnp.pad(y, (0, pad), constant_values=IGNORE_LABEL)
    steps = (n + pad) // c
    # Chunk j holds tokens j, j + steps, j + 2*steps, ...: a batch-sharded token axis stays
    # sharded inside every chunk (each device works on every step), rather than the scan
    # slicing along the sharded axis.
    h = h.reshape(c, steps, d).swapaxes(0, 1)
    y = y.reshape(c, steps).swapaxes(0, 1)

    # Checkpointed body: the scan saves only its inputs (hidden chunk, labels), and the
    # backward pass recomputes the chunk's logits rather than storing [N, V] of them.
    @jax.checkpoint
    def chunk(h_c, y_c):
        return _token_terms(h_c, embedding, y_c, softcap, vocab_in_use)

    def body(carry, xs):
        loss, correct, tokens = chunk(*xs)
        return (carry[0] + loss, carry[1] + correct, carry[2] + tokens), None

    zero = jnp.zeros([], jnp.int32)
    (loss, correct, tokens), _ = lax.scan(body, (jnp.zeros([], jnp.float32), zero, zero), (h, y))
    return loss, {"tokens": tokens, "correct": correct}


def cross_entropy(hidden: jax.Array, embedding: jax.Array, labels: jax.Array, *, kind: str = "chunked",
                  chunk_size: int = 512, softcap: float | None = None,
                  vocab_in_use: int | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Dispatch on `GemmaConfig.loss` ("chunked" | "plain"). Ids >= vocab_in_use (padding rows)
    get logit -inf."""
    if kind == "chunked" and not in_analysis():  # analysis: no loop, so every chunk counts
        return chunked_cross_entropy(hidden, embedding, labels, chunk_size=chunk_size, softcap=softcap,
                                     vocab_in_use=vocab_in_use)
    if kind in ("plain", "chunked"):
        return plain_cross_entropy(hidden, embedding, labels, softcap=softcap, vocab_in_use=vocab_in_use)
    raise ValueError(f"unknown loss kind {kind!r} (chunked | plain)")
