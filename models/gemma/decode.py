"""KV-cache decoding for Gemma.

Cache: {"k", "v"} each [L, B, S, K, hd] in cfg.dtype, stacked over layers so it scans with
them. Slot s of a row holds that row's token at position s, so rows advance independently
(per-row positions). Prompts are LEFT-aligned (row b's prompt at positions 0..len_b-1, padding
on the right): prefill writes the whole padded [B, P] chunk; the padding slots of a short row
are overwritten by its generated tokens before any query can see them (a query at position p
sees slots <= p only). Local layers mask keys older than the window; the cache stays full
length for every layer (simple; a ring buffer for local layers would save memory).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.gemma.config import GemmaConfig
from models.gemma.model import Gemma, logits_from_hidden
from models.layers import dtype_from_name

Cache = dict[str, jax.Array]


def init_cache(cfg: GemmaConfig, batch: int, length: int) -> Cache:
    shape = (cfg.num_layers, batch, length, cfg.num_kv_heads, cfg.head_dim)
    dtype = dtype_from_name(cfg.dtype)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def forward_cached(params: Any, cfg: GemmaConfig, tokens: jax.Array, positions: jax.Array, cache: Cache, *,
                   return_hidden: bool = False) -> tuple[jax.Array, Cache]:
    """Run a chunk tokens [B, T] at positions [B, T]; returns (logits or hidden [B, T, ...], cache)."""
    return Gemma(cfg).apply({"params": params}, tokens, positions, return_hidden=return_hidden, cache=cache)


def prefill(params: Any, cfg: GemmaConfig, prompt_tokens: jax.Array, prompt_lengths: jax.Array,
            cache_len: int) -> tuple[jax.Array, Cache]:
    """Left-aligned prompts [B, P] -> (logits [B, V] at each row's last prompt token, cache)."""
    params = nn.meta.unbox(params)
    B, P = prompt_tokens.shape
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    hidden, cache = forward_cached(params, cfg, prompt_tokens, positions, init_cache(cfg, B, cache_len),
                                   return_hidden=True)
    last = jnp.take_along_axis(hidden, (prompt_lengths - 1)[:, None, None].astype(jnp.int32), axis=1)[:, 0]
    return logits_from_hidden(last, params["embedder"]["input_embedding"], cfg), cache


def decode_step(params: Any, cfg: GemmaConfig, tokens: jax.Array, positions: jax.Array,
                cache: Cache) -> tuple[jax.Array, Cache]:
    """One token per row: tokens [B] at positions [B] -> (logits [B, V], cache)."""
    logits, cache = forward_cached(params, cfg, tokens[:, None], positions[:, None], cache)
    return logits[:, 0], cache
