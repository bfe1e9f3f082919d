"""Sampling from Gemma: `generate` (KV cache, lax.while_loop) and `generate_without_cache`
(full forward every step; the reference for tests). Both are plain jnp code and jittable: wrap
them in jax.jit with cfg and the keyword arguments closed over (cfg is not hashable).

Prompts are left-aligned [B, P] with per-row lengths (padding on the right; see decode.py).
Output: [B, max_new_tokens], the tokens after each prompt; a row's stop token is kept and
everything after it is pad_id. Step t samples with key fold_in(rng, t) in both functions, so
with the same rng they agree token for token (up to float ties).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.gemma.config import GemmaConfig
from models.gemma.decode import decode_step, prefill
from models.gemma.model import Gemma, check_token_ids


def _pick(logits: jax.Array, temperature: float, rng: jax.Array | None, t) -> jax.Array:
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if rng is None:
        raise ValueError("temperature > 0 needs an rng")
    return jax.random.categorical(jax.random.fold_in(rng, t), logits.astype(jnp.float32) / temperature,
                                  axis=-1).astype(jnp.int32)


def _emit(tok, done, stop_ids, pad_id):
    """Mask rows already stopped; return (token to record, new done)."""
    tok = jnp.where(done, pad_id, tok)
    return tok, done | jnp.isin(tok, jnp.asarray(stop_ids, jnp.int32))


def generate(params: Any, cfg: GemmaConfig, prompt_tokens: jax.Array, prompt_lengths: jax.Array, *,
             max_new_tokens: int, temperature: float = 0.0, rng: jax.Array | None = None,
             stop_ids: Sequence[int] = (1,), pad_id: int = 0) -> jax.Array:
    """Sample up to max_new_tokens per row with the KV cache; stops early when every row stopped."""
    check_token_ids(prompt_tokens, cfg, "prompt_tokens")
    params = nn.meta.unbox(params)
    B, P = prompt_tokens.shape
    lengths = prompt_lengths.astype(jnp.int32)
    logits, cache = prefill(params, cfg, prompt_tokens, lengths, P + max_new_tokens)
    tok, done = _emit(_pick(logits, temperature, rng, 0), jnp.zeros((B,), bool), stop_ids, pad_id)
    out = jnp.full((B, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(tok)

    def cond(state):
        t, _, done, _, _ = state
        return (t < max_new_tokens) & ~jnp.all(done)

    def body(state):
        t, tok, done, out, cache = state  # tok: token t-1, fed at position len + t - 1
        logits, cache = decode_step(params, cfg, tok, lengths + t - 1, cache)
        tok, done = _emit(_pick(logits, temperature, rng, t), done, stop_ids, pad_id)
        return t + 1, tok, done, out.at[:, t].set(tok), cache

    _, _, _, out, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), tok, done, out, cache))
    return out


def generate_without_cache(params: Any, cfg: GemmaConfig, prompt_tokens: jax.Array, prompt_lengths: jax.Array, *,
                           max_new_tokens: int, temperature: float = 0.0, rng: jax.Array | None = None,
                           stop_ids: Sequence[int] = (1,), pad_id: int = 0) -> jax.Array:
    """Same contract as `generate`, recomputing the whole sequence every step (slow, simple)."""
    check_token_ids(prompt_tokens, cfg, "prompt_tokens")
    params = nn.meta.unbox(params)
    B = prompt_tokens.shape[0]
    lengths = prompt_lengths.astype(jnp.int32)
    rows = jnp.arange(B)
    buf = jnp.concatenate([prompt_tokens.astype(jnp.int32), jnp.full((B, max_new_tokens), pad_id, jnp.int32)], 1)
    model = Gemma(cfg)

    def step(state, t):
        buf, done = state
        logits = model.apply({"params": params}, buf)[rows, lengths - 1 + t]  # causal: later slots don't matter
        tok, done = _emit(_pick(logits, temperature, rng, t), done, stop_ids, pad_id)
        return (buf.at[rows, lengths + t].set(tok), done), tok

    _, toks = jax.lax.scan(step, (buf, jnp.zeros((B,), bool)), jnp.arange(max_new_tokens))
    return toks.T
