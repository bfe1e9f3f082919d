"""Gemma 1/2/3 text model in Flax linen (the published Gemma architectures; layout: config.py).

One code path serves training (full sequences, optional packed segments) and decoding (a
KV cache [L, B, S, K, hd] whose slot s holds the key/value of position s; see decode.py).

Init: weights normal(fan_in ** -0.5); norm scales 0 (the norm multiplies by 1 + scale); the
embedding normal(D ** -0.5), so that the sqrt(D)-scaled inputs and the tied output logits
both start at unit scale.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models.flops import in_analysis
from models.gemma import lora
from models.gemma.config import NORM_EPS, REMAT_POLICIES, GemmaConfig
from models.gemma.loss import mask_padding
from models.attention import SPLASH_BLOCKS, causal_stats, padded_length, splash_causal, tpu_form
from models.layers import dtype_from_name, for_platform
from runtime.errors import UserError

_NEG = float(jnp.finfo(jnp.float32).min)  # finite: a fully masked row gives no NaN

_REMAT_POLICY = {
    "full": None,  # save nothing: recompute the whole layer in the backward pass
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


# The residual stream [B, T, D] at block boundaries: batch-sharded, replicated over length and
# embed (the table's "batch" rule claims fsdp first). The names resolve through the runtime's
# logical rules while a train/eval step is traced; without rules (decoding) they are a no-op.
RESIDUAL_AXES = ("batch", "length", "embed")


def constrain_residual(x: jax.Array) -> jax.Array:
    return nn.with_logical_constraint(x, RESIDUAL_AXES)


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    return x if cap is None else jnp.tanh(x / cap) * cap


def logits_from_hidden(hidden: jax.Array, embedding: jax.Array, cfg: GemmaConfig) -> jax.Array:
    """Tied output layer: hidden [..., D] @ E^T with float32 accumulation, then the final softcap;
    padding rows (ids >= cfg.vocab_in_use) at -inf, so sampling never picks them."""
    dtype = dtype_from_name(cfg.dtype)
    logits = jnp.einsum("...d,vd->...v", hidden.astype(dtype), embedding.astype(dtype),
                        preferred_element_type=jnp.float32)
    return mask_padding(softcap(logits, cfg.final_logit_softcap), cfg.vocab_in_use)


class TokenIdError(UserError, ValueError):
    """Token ids outside the model's vocabulary (the embedding lookup would give NaN)."""


def check_token_ids(tokens: Any, cfg: GemmaConfig, what: str = "tokens") -> None:
    """Raise TokenIdError for ids outside [0, cfg.vocab_in_use); no-op on traced values (under
    jit the ids are checked where they come from: the data set's metadata, the tokenizer)."""
    if isinstance(tokens, jax.core.Tracer):
        return
    ids = np.asarray(tokens)
    if ids.size and (ids.min() < 0 or ids.max() >= cfg.vocab_in_use):
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise TokenIdError(f"{what} hold id {bad}, outside the model's vocabulary [0, {cfg.vocab_in_use}) "
                           "(arch.real_vocab_size or arch.vocab_size); tokenize with the model's tokenizer")


def rope_table(positions: jax.Array, head_dim: int, base: float, scale: float) -> tuple[jax.Array, jax.Array]:
    """(sin, cos) [B, T, head_dim / 2] float32 for positions [B, T] (divided by `scale`: linear scaling)."""
    half = head_dim // 2
    inv_freq = base ** (-2.0 * jnp.arange(half, dtype=jnp.float32) / head_dim)
    angle = (positions.astype(jnp.float32) / scale)[..., None] * inv_freq
    return jnp.sin(angle), jnp.cos(angle)


def apply_rope(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    """Rotate-half RoPE on x [B, T, N, hd] (first half / second half), in float32."""
    sin, cos = sin[:, :, None, :], cos[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * (1 + scale) in float32, returned in x's dtype."""

    names: tuple[str, ...]
    param_dtype: str = "float32"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.zeros, self.names), (x.shape[-1],),
                           jnp.dtype(self.param_dtype))
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + NORM_EPS)
        return (y * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)


class Einsum(nn.Module):
    """A weight `w` applied with `eqn` ("x,w->y"), plus the LoRA path when this weight is targeted."""

    shape: tuple[int, ...]
    names: tuple[str | None, ...]
    fan_in: int
    cfg: GemmaConfig

    @nn.compact
    def __call__(self, eqn: str, x: jax.Array) -> jax.Array:
        dtype = dtype_from_name(self.cfg.dtype)
        w = self.param("w", nn.with_logical_partitioning(nn.initializers.normal(self.fan_in**-0.5), self.names),
                       self.shape, jnp.dtype(self.cfg.param_dtype))
        y = jnp.einsum(eqn, x, w.astype(dtype))
        if lora.enabled(self.cfg, self.name):
            y = y + lora.lora_path(self, self.name, eqn, x, self.shape, self.names, self.cfg, dtype)
        return y


class Attention(nn.Module):
    cfg: GemmaConfig

    @nn.compact
    def __call__(self, x, is_global, positions, rope, mask, cache, segment_ids=None):
        """x [B, T, D]; rope: this layer's (sin, cos); mask [B, T, S] (S = T, or the cache length);
        cache None or (k, v) [B, S, K, hd]; segment_ids [B, T] or None (the fused form's mask)."""
        cfg = self.cfg
        dtype = dtype_from_name(cfg.dtype)
        B, T, D = x.shape
        H, K, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q = Einsum((H, D, hd), ("heads", "embed", "head_dim"), D, cfg, name="q_einsum")("btd,hdk->bthk", x)
        k, v = Einsum((2, K, D, hd), (None, "kv_heads", "embed", "head_dim"), D, cfg, name="kv_einsum")(
            "btd,ckdh->cbtkh", x)
        if cfg.qk_norm:
            q = RMSNorm(("head_dim",), cfg.param_dtype, name="query_norm")(q)
            k = RMSNorm(("head_dim",), cfg.param_dtype, name="key_norm")(k)
        q = apply_rope(q, *rope)
        k = apply_rope(k, *rope)
        q = q * jnp.asarray((cfg.query_pre_attn_scalar or hd) ** -0.5, dtype)
        if cache is not None:  # write this chunk into slots = positions, then attend over the cache
            rows = jnp.arange(B)[:, None]
            k = cache[0].at[rows, positions].set(k.astype(cache[0].dtype))
            v = cache[1].at[rows, positions].set(v.astype(cache[1].dtype))
            cache = (k, v)
        def dense(q, k, v):
            return dense_attention(q, k, v, mask, cfg)

        out = dense(q, k, v) if cache is not None else whole_sequence_attention(cfg, q, k, v, is_global, segment_ids,
                                                                              dense)
        y = Einsum((H, hd, D), ("heads", "head_dim", "embed"), H * hd, cfg, name="attn_vec_einsum")("bthk,hkd->btd", out)
        return y, cache


def dense_attention(q, k, v, mask, cfg: GemmaConfig) -> jax.Array:
    """softmax(q k^T, soft-capped, masked) v with the scores written out in float32: q [B, T, H, hd]
    (scaled), k, v [B, S, K, hd], mask [B, T, S] -> [B, T, H, hd]."""
    dtype = q.dtype
    B, T, H, hd = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, H // K, hd)  # query head h reads kv head h // (H / K)
    logits = jnp.einsum("btkgh,bskh->bkgts", qg, k.astype(dtype), preferred_element_type=jnp.float32)
    if not cfg.qk_norm:  # Gemma 3 has no attention soft-cap (validate refuses one): QK-norm instead
        logits = softcap(logits, cfg.attn_logit_softcap)
    logits = jnp.where(mask[:, None, None], logits, _NEG)
    probs = jax.nn.softmax(logits, axis=-1).astype(dtype)
    return jnp.einsum("bkgts,bskh->btkgh", probs, v.astype(dtype)).reshape(B, T, H, hd)


def whole_sequence_attention(cfg: GemmaConfig, q, k, v, is_global, segment_ids, dense) -> jax.Array:
    """`cfg.attention`'s form of a whole sequence's attention (no cache): `dense`, or the splash
    kernel with the causal mask (a local layer's: its window), the segments and the soft-cap.
    Splash masks by index: the same as `_masks` where positions rise by one within each segment
    (what packing and unpacked rows give)."""
    B, T, H, hd = q.shape
    window = cfg.sliding_window if cfg.sliding_window is not None and cfg.sliding_window < T else None  # else masks nothing
    # auto: splash on TPU from SPLASH_MIN_LENGTH tokens, local layers too (their kernel picked by
    # lax.cond in the scanned body; docs/ARCHITECTURE.md has the figures of both forms)
    if cfg.attention == "xla" or (cfg.attention == "auto" and tpu_form(T) == "xla"):
        return dense(q, k, v)
    windows = [None if cfg.is_global_layer(i) else window for i in range(cfg.num_layers)]
    SPLASH_BLOCKS[(padded_length(T), hd)] = causal_stats(padded_length(T), windows, H // k.shape[2])
    soft_cap = None if cfg.qk_norm else cfg.attn_logit_softcap

    def splash(window):
        return lambda q, k, v: splash_causal(q, k, v, segment_ids, window=window, soft_cap=soft_cap)

    def fused(q, k, v):  # local and global layers share the scanned body: the layer's kernel
        if window is None:
            return splash(None)(q, k, v)
        return jax.lax.cond(is_global, splash(None), splash(window), q, k, v)
    if cfg.attention == "splash":
        return fused(q, k.astype(q.dtype), v.astype(q.dtype))
    return for_platform(q, k.astype(q.dtype), v.astype(q.dtype), tpu=fused, default=dense)


class Mlp(nn.Module):
    cfg: GemmaConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        D, F = cfg.embed_dim, cfg.hidden_dim
        gate, up = Einsum((2, D, F), (None, "embed", "mlp"), D, cfg, name="gating_einsum")("btd,cdf->cbtf", x)
        h = jax.nn.gelu(gate, approximate=True) * up
        return Einsum((F, D), ("mlp", "embed"), F, cfg, name="linear")("btf,fd->btd", h)


class Block(nn.Module):
    """One decoder layer. Signature fits nn.scan: (carry, scanned, *broadcast) -> (carry, scanned out)."""

    cfg: GemmaConfig

    @nn.compact
    def __call__(self, x, layer_in, positions, tables):
        """tables: (global, local) pairs of masks [B, T, S] and RoPE (sin, cos), built once per call,
        and the segment ids [B, T] (or None)."""
        is_global, cache = layer_in
        cfg = self.cfg
        x = constrain_residual(x)
        def norm(name):
            return RMSNorm(("embed",), cfg.param_dtype, name=name)
        def pick(pair):
            return jax.tree.map(lambda g, l: jnp.where(is_global, g, l), *pair)
        masks, ropes, segment_ids = tables
        h, cache = Attention(cfg, name="attn")(norm("pre_attention_norm")(x), is_global, positions, pick(ropes),
                                               pick(masks), cache, segment_ids)
        if cfg.post_norms:
            h = norm("post_attention_norm")(h)
        x = x + h
        h = Mlp(cfg, name="mlp")(norm("pre_ffw_norm")(x))
        if cfg.post_norms:
            h = norm("post_ffw_norm")(h)
        return constrain_residual(x + h), cache


def _masks(cfg: GemmaConfig, positions, segment_ids, cache_len: int | None):
    """(global, local) visibility masks [B, T, S].

    No cache: causal by index within the sequence, plus same-segment. With a cache: slot s holds
    position s, visible when s <= the query's position. Local layers also need key_pos > q_pos - window.
    """
    B, T = positions.shape
    if cache_len is None:
        idx = jnp.arange(T)
        visible = jnp.broadcast_to(idx[None, None, :] <= idx[None, :, None], (B, T, T))
        key_pos = positions[:, None, :]
        if segment_ids is not None:
            visible = visible & (segment_ids[:, :, None] == segment_ids[:, None, :])
    else:
        key_pos = jnp.arange(cache_len)[None, None, :]
        visible = key_pos <= positions[:, :, None]
    if cfg.sliding_window is None:
        return visible, visible
    return visible, visible & (key_pos > positions[:, :, None] - cfg.sliding_window)


def _remat_policy(cfg: GemmaConfig):
    if cfg.remat not in REMAT_POLICIES:
        raise ValueError(f"unknown remat {cfg.remat!r}; use one of {REMAT_POLICIES}")
    return _REMAT_POLICY.get(cfg.remat)


class Gemma(nn.Module):
    config: GemmaConfig

    @nn.compact
    def __call__(self, tokens, positions=None, segment_ids=None, *, return_hidden: bool = False,
                 cache: dict[str, jax.Array] | None = None):
        """tokens [B, T] -> logits [B, T, V] float32, or (return_hidden) final-normed hidden [B, T, D].

        With `cache` ({"k", "v"}: [L, B, S, K, hd]; see decode.py) `positions` are required,
        the chunk is written at slots = positions, and the result is (output, new cache).
        """
        cfg = self.config
        dtype = dtype_from_name(cfg.dtype)
        B, T = tokens.shape
        check_token_ids(tokens, cfg)
        if positions is None:
            if cache is not None:
                raise ValueError("decoding with a cache needs explicit positions")
            positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        if cache is not None and segment_ids is not None:
            raise ValueError("segment_ids are not supported with a cache")
        embedding = Embedder(cfg, name="embedder")()
        x = jnp.take(embedding, tokens, axis=0).astype(dtype) * jnp.asarray(math.sqrt(cfg.embed_dim), dtype)
        masks = _masks(cfg, positions, segment_ids, None if cache is None else cache["k"].shape[2])
        ropes = (rope_table(positions, cfg.head_dim, cfg.rope_base_global, cfg.rope_scale_global),
                 rope_table(positions, cfg.head_dim, cfg.rope_base_local, 1.0))
        is_global = jnp.asarray([cfg.is_global_layer(i) for i in range(cfg.num_layers)])
        layer_in = (is_global, None if cache is None else (cache["k"], cache["v"]))
        # loop mode initialises through the scan (one layout); FLOP analysis traces the Python loop
        if (cfg.scan_layers and not in_analysis()) or self.is_initializing():
            x, new_cache = self._scanned(x, layer_in, positions, (masks, ropes, segment_ids))
        else:
            x, new_cache = self._looped(x, layer_in, positions, (masks, ropes, segment_ids))
        x = RMSNorm(("embed",), cfg.param_dtype, name="final_norm")(x)
        out = x if return_hidden else logits_from_hidden(x, embedding, cfg)
        if cache is None:
            return out
        return out, {"k": new_cache[0], "v": new_cache[1]}

    def _scanned(self, x, layer_in, positions, tables):
        cfg = self.config
        block = Block
        if cfg.remat != "none":
            block = nn.remat(Block, policy=_remat_policy(cfg), prevent_cse=False)
        stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                        in_axes=(0, nn.broadcast, nn.broadcast), length=cfg.num_layers,
                        metadata_params={nn.PARTITION_NAME: "layers"})
        return stack(cfg, name="layers")(x, layer_in, positions, tables)

    def _looped(self, x, layer_in, positions, tables):
        """Python loop over layers, slicing the same stacked params the scan uses."""
        cfg = self.config
        stacked = nn.meta.unbox(self.variables["params"]["layers"])
        block = Block(cfg, parent=None)

        def layer(p, x, li):
            return block.apply({"params": p}, x, li, positions, tables)

        if cfg.remat != "none" and not in_analysis():
            layer = jax.checkpoint(layer, policy=_remat_policy(cfg))
        caches = []
        for i in range(cfg.num_layers):
            def take(a, i=i):
                return a[i]
            x, c = layer(jax.tree.map(take, stacked), x, jax.tree.map(take, layer_in))
            caches.append(c)
        if caches[0] is None:
            return x, None
        return x, jax.tree.map(lambda *a: jnp.stack(a), *caches)


class Embedder(nn.Module):
    cfg: GemmaConfig

    @nn.compact
    def __call__(self) -> jax.Array:
        cfg = self.cfg
        return self.param("input_embedding",
                          nn.with_logical_partitioning(nn.initializers.normal(cfg.embed_dim**-0.5), ("vocab", "embed")),
                          (cfg.vocab_size, cfg.embed_dim), jnp.dtype(cfg.param_dtype))


def init_params(cfg: GemmaConfig, rng: jax.Array) -> Any:
    """Boxed params (nn.LogicallyPartitioned leaves); use under jax.eval_shape to count without allocating."""
    return Gemma(cfg).init(rng, jnp.zeros((1, 8), jnp.int32))["params"]
