"""Building blocks of the recursive-reasoning models (TRM, HRM).

Semantics follow the public PyTorch references (SamsungSAILMontreal/TinyRecursiveModels, sapientinc/HRM):

* RMSNorm has no learned gain, eps 1e-5, and is computed in float32 (result cast back).
* Blocks are post-norm and bias-free: ``h = rms(h + mix(h)); h = rms(h + swiglu(h))`` where
  ``mix`` is non-causal attention, or (``mlp_t``) a SwiGLU over the *sequence* axis applied to
  the transposed ``[B, D, L]`` tensor, whose residual norm then normalises over the sequence
  axis (on CPU the same products run sequence-major, ``[L, B, D]``: see "two forms" below).
* SwiGLU width: ``round(expansion * d * 2/3)`` rounded up to a multiple of 256.
* Weights: truncated normal (cut at +-2 standard units) rescaled so the *actual* standard
  deviation is the requested one (LeCun: ``1/sqrt(fan_in)``), as the reference's
  ``trunc_normal_init_``. Parameters are float32; the forward pass casts them to the forward
  dtype at use.

Every parameter carries logical axis names (``runtime/sharding.py`` maps them to mesh axes).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models.attention import attend, auto_forms, padded_length, padded_mask, splash_heads_major
from models.attention import check as check_attention
from models.flops import in_analysis
from models.layers import for_platform
from models.recursive_reasoning import mixer_kernel

RMS_EPS = 1e-5

# Standard deviation of a standard normal truncated to [-2, 2]; dividing by it makes the
# truncated sample's std equal to the requested one (the reference's correction).
_TRUNC2_STD = 0.87962566103423978

CosSin = Optional[Tuple[jax.Array, jax.Array]]
Mask = Optional[jax.Array]  # bool [T, T] (query, key); True = may attend; None = unmasked


def trunc_normal_init(std: float) -> Callable:
    """Initializer: normal truncated at +-2 sigma whose actual standard deviation is `std`."""

    def init(key, shape, dtype=jnp.float32):
        if std == 0:
            return jnp.zeros(shape, dtype)
        sample = jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32)
        return (sample * (std / _TRUNC2_STD)).astype(dtype)

    return init


def lecun_init(fan_in: int) -> Callable:
    return trunc_normal_init(fan_in ** -0.5)


def swiglu_width(dim: int, expansion: float) -> int:
    """Hidden width of a SwiGLU on `dim` features: round(e*dim*2/3) up to a multiple of 256."""
    inter = round(expansion * dim * 2 / 3)
    return -(inter // -256) * 256


def rms_norm(x: jax.Array, eps: float = RMS_EPS, axis: int = -1) -> jax.Array:
    """RMS normalisation without gain, computed in float32, returned in `x`'s dtype."""
    x32 = x.astype(jnp.float32)
    var = jnp.mean(jnp.square(x32), axis=axis, keepdims=True)
    return (x32 * jax.lax.rsqrt(var + eps)).astype(x.dtype)


# ---------------------------------------------------------------- rotary position embedding

def rope_cos_sin(length: int, head_dim: int, theta: float = 10000.0) -> Tuple[jax.Array, jax.Array]:
    """cos, sin tables [length, head_dim] (float32) for the rotate-half layout."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = jnp.arange(length, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def rotate_half(x: jax.Array) -> jax.Array:
    first, second = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-second, first], axis=-1)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, heads_first: bool = False) -> jax.Array:
    """x [B, L, H, Dh] (heads_first: [B, H, L, Dh]); cos/sin [L, Dh]; rotation done in float32,
    result in x's dtype."""
    x32 = x.astype(jnp.float32)
    c, s = (cos, sin) if heads_first else (cos[:, None, :], sin[:, None, :])
    return (x32 * c + rotate_half(x32) * s).astype(x.dtype)


# ---------------------------------------------------------------- attention masks

def local_global_mask(prefix: int, height: int, width: int, window: int) -> np.ndarray:
    """bool [T, T] (T = prefix + height*width; True = query row may attend key column).

    The `prefix` (puzzle-embedding) tokens attend to every token and every token attends to
    them; grid cell (r, c) (sequence position ``prefix + r*width + c``) attends grid cell
    (r2, c2) iff ``|r - r2| <= window // 2`` and ``|c - c2| <= window // 2`` (a window x window
    square, clipped at the grid's border). Symmetric, with a True diagonal.
    """
    if window < 1 or window % 2 == 0:
        raise ValueError(f"attention window must be a positive odd side length, got {window}")
    half = window // 2
    rows, cols = np.divmod(np.arange(height * width), width)
    near = ((np.abs(rows[:, None] - rows[None, :]) <= half) & (np.abs(cols[:, None] - cols[None, :]) <= half))
    mask = np.ones((prefix + height * width,) * 2, dtype=bool)
    mask[prefix:, prefix:] = near
    return mask


# ---------------------------------------------------------------- modules

# Two forms of each product, chosen for the devices the step is lowered for (models/layers.py
# `for_platform`: a compile for a TPU topology on a CPU host gets the TPU form).
# TPU and GPU: einsums over the natural layouts, gate and up (q, k and v) fused in one product,
# the reference's transposed [B, D, L] for the sequence mixer; XLA lays them out itself.
# CPU: plain 2-D matrix products with no transposed or sliced activation, forward or backward,
# and the sequence mixer on a sequence-major [L, B, D] activation (one [L, B*D] matrix), which
# XLA:CPU runs near its matmul rate (bench/train_step_bench.py) and the einsum forms well below.
# The parameters are the same either way.


@jax.custom_vjp
def _matmul_tn(a: jax.Array, b: jax.Array) -> jax.Array:
    """a^T b for 2-D a [K, M] (a weight: small) and b [K, N], with every product in it and in
    its gradient a plain or right-transposed one. XLA folds a bare transpose into the dot, and
    XLA:CPU runs a dot contracting its left operand's leading axis on a slower path that
    allocates large packing buffers at every call; so a^T is materialised (a few hundred KiB)
    and the gradient is written out rather than derived through it."""
    return jax.lax.optimization_barrier(a.T) @ b


def _matmul_tn_fwd(a, b):
    return _matmul_tn(a, b), (a, b)


def _matmul_tn_bwd(residuals, g):
    a, b = residuals
    return b @ g.T, a @ g


_matmul_tn.defvjp(_matmul_tn_fwd, _matmul_tn_bwd)


def _swiglu_fused(x: jax.Array, gate_up: jax.Array, down: jax.Array) -> jax.Array:
    """SwiGLU over x's last axis, gate and up in one product (TPU, GPU)."""
    gu = jnp.einsum("...d,dgf->...gf", x, gate_up)
    return jnp.einsum("...f,fd->...d", jax.nn.silu(gu[..., 0, :]) * gu[..., 1, :], down)


def recomputed(fn: Callable, recompute: bool) -> Callable:
    """`fn` whose backward pass recomputes its intermediates from its inputs rather than keeping
    them (`jax.checkpoint`, nothing saved) when `recompute` (arch.recompute_mlp); as it is in the
    analysis compile, whose FLOPs must be the formula's."""
    if not recompute or in_analysis():
        return fn
    return jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable)


def _swiglu_rows(x: jax.Array, gate_up: jax.Array, down: jax.Array) -> jax.Array:
    """SwiGLU over x's last axis as 2-D products on its rows, gate and up apart (CPU). A sharded
    batch axis comes first, so each shard stays one block of rows."""
    rows = x.reshape(-1, x.shape[-1])
    hidden = jax.nn.silu(rows @ gate_up[:, 0]) * (rows @ gate_up[:, 1])
    return (hidden @ down).reshape(x.shape)


def _mix_sequence_transposed(h: jax.Array, gate_up: jax.Array, down: jax.Array, eps: float) -> jax.Array:
    """rms(h + SwiGLU over the sequence) on [B, D, L], normalised over the sequence (TPU, GPU)."""
    ht = jnp.swapaxes(h, 1, 2)
    return jnp.swapaxes(rms_norm(ht + _swiglu_fused(ht, gate_up, down), eps), 1, 2)


def _mix_sequence_major(h: jax.Array, gate_up: jax.Array, down: jax.Array, eps: float) -> jax.Array:
    """The same on a sequence-major [L, B, D] activation, one [L, B*D] matrix (CPU)."""
    ht = jnp.swapaxes(h, 0, 1)
    columns = ht.reshape(ht.shape[0], -1)
    hidden = jax.nn.silu(_matmul_tn(gate_up[:, 0], columns)) * _matmul_tn(gate_up[:, 1], columns)
    ht = rms_norm(ht + _matmul_tn(down, hidden).reshape(ht.shape), eps, axis=0)
    return jnp.swapaxes(ht, 0, 1)


def _qkv_fused(x: jax.Array, qkv_w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    qkv = jnp.einsum("bld,dthk->tblhk", x, qkv_w)
    return qkv[0], qkv[1], qkv[2]


def _qkv_rows(x: jax.Array, qkv_w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    hidden, _, heads, head_dim = qkv_w.shape
    rows, w = x.reshape(-1, hidden), qkv_w.reshape(hidden, 3, heads * head_dim)
    q, k, v = ((rows @ w[:, i]).reshape(x.shape[:-1] + (heads, head_dim)) for i in range(3))
    return q, k, v


def _attn_out_fused(y: jax.Array, out_w: jax.Array) -> jax.Array:
    return jnp.einsum("blhk,hkd->bld", y, out_w)


def _attn_out_rows(y: jax.Array, out_w: jax.Array) -> jax.Array:
    b, l, h, k = y.shape
    return (y.reshape(b * l, h * k) @ out_w.reshape(h * k, -1)).reshape(b, l, -1)


def _swiglu_weights(module: nn.Module, dim: int, expansion: float, axis_name: str, dtype) -> tuple[jax.Array, jax.Array]:
    """The gate_up [dim, 2, inter] and down [inter, dim] parameters of `module`, in `dtype`."""
    inter = swiglu_width(dim, expansion)
    gate_up = module.param("gate_up", nn.with_logical_partitioning(lecun_init(dim), (axis_name, "gate", "mlp")),
                           (dim, 2, inter))
    down = module.param("down", nn.with_logical_partitioning(lecun_init(inter), ("mlp", axis_name)), (inter, dim))
    return gate_up.astype(dtype), down.astype(dtype)


class SwiGLU(nn.Module):
    """SwiGLU over the last axis of `x` (width `dim`), no biases."""

    dim: int
    expansion: float
    dtype: jnp.dtype = jnp.bfloat16
    recompute: bool = False  # the TPU/GPU form's backward recomputes it (`recomputed`)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        gate_up, down = _swiglu_weights(self, self.dim, self.expansion, "embed", self.dtype)
        return for_platform(x, gate_up, down, cpu=_swiglu_rows, default=recomputed(_swiglu_fused, self.recompute))


class SequenceMixer(nn.Module):
    """The mlp_t token mixer with its residual norm: ``rms(h + SwiGLU over the sequence axis)``,
    normalised over the sequence axis; h is [B, L, D] (L = `length`, prefix included). Its
    feature axis is the sequence ("length"), so its weights are a SwiGLU's on `length`. `form`:
    xla (the products as einsums), pallas (one fused kernel, mixer_kernel.py) or auto (the kernel
    on TPU where it fits, else xla); the same values up to rounding."""

    length: int
    expansion: float
    dtype: jnp.dtype = jnp.bfloat16
    eps: float = RMS_EPS
    recompute: bool = False  # as SwiGLU.recompute (the transposes and the norm with it); the kernel always does
    form: str = "xla"

    @nn.compact
    def __call__(self, h: jax.Array) -> jax.Array:
        gate_up, down = _swiglu_weights(self, self.length, self.expansion, "length", self.dtype)
        cpu = functools.partial(_mix_sequence_major, eps=self.eps)
        tpu = recomputed(functools.partial(_mix_sequence_transposed, eps=self.eps), self.recompute)
        form = mixer_kernel.check(self.form)
        if self.is_initializing() or in_analysis():  # shapes only; the analysis compile counts XLA's FLOPs
            form = "xla"
        kernel = functools.partial(mixer_kernel.mixer_block, eps=self.eps)
        if form == "pallas":  # the kernel; on any other platform Pallas' interpreter (tests)
            return for_platform(h, gate_up, down, tpu=kernel, default=functools.partial(kernel, interpret=True))
        on_tpu = {"tpu": kernel} if form == "auto" and mixer_kernel.fits(h.shape[-1], down.shape[0], h.dtype) else {}
        return for_platform(h, gate_up, down, cpu=cpu, default=tpu, **on_tpu)


class Attention(nn.Module):
    """Non-causal multi-head attention, fused qkv (kv heads == heads), no biases.

    Unmasked by default; an optional bool `mask` [T, T] (True = may attend, e.g.
    `local_global_mask`; every row must allow at least one key). `impl`: the form of the
    attention itself (models/attention.py: xla, splash, dot_product, or auto).

    The qkv kernel is [embed, 3, heads, head_dim] (the reference's [3*H*Dh, D] transposed and
    reshaped in the same order), the output kernel [heads, head_dim, embed].
    """

    hidden: int
    heads: int
    dtype: jnp.dtype = jnp.bfloat16
    impl: str = "xla"

    @nn.compact
    def __call__(self, x: jax.Array, cos_sin: CosSin = None, mask: Mask = None) -> jax.Array:
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        head_dim = self.hidden // self.heads
        qkv_w = self.param("qkv", nn.with_logical_partitioning(lecun_init(self.hidden), ("embed", "qkv", "heads", "head_dim")),
                           (self.hidden, 3, self.heads, head_dim))
        out_w = self.param("out", nn.with_logical_partitioning(lecun_init(self.heads * head_dim), ("heads", "head_dim", "embed")),
                           (self.heads, head_dim, self.hidden))

        @functools.cache  # one function per form: jax.lax.platform_dependent traces a shared one once
        def form(name: str) -> Callable:
            if name == "splash":
                return lambda x, qkv_w, out_w: _splash_attention(x, qkv_w, out_w, cos_sin, mask)
            return lambda x, qkv_w, out_w: _attention_rows_major(x, qkv_w, out_w, cos_sin, mask, name)

        impl = "xla" if self.is_initializing() else check_attention(self.impl)  # init: shapes only
        args = (x, qkv_w.astype(self.dtype), out_w.astype(self.dtype))
        if impl == "auto":  # chosen for the step's platform (models/attention.py)
            return for_platform(*args, **{p: form(name) for p, name in auto_forms(x.shape[1]).items()})
        return form(impl)(*args)


def _attention_rows_major(x, qkv_w, out_w, cos_sin: CosSin, mask: Mask, impl: str) -> jax.Array:
    """q, k, v as [B, T, H, Dh] (the xla and dot_product forms)."""
    q, k, v = for_platform(x, qkv_w, cpu=_qkv_rows, default=_qkv_fused)
    if cos_sin is not None:
        cos, sin = cos_sin
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    y = attend(q, k, v, mask, impl=impl)
    return for_platform(y, out_w, cpu=_attn_out_rows, default=_attn_out_fused)


def _splash_attention(x, qkv_w, out_w, cos_sin: CosSin, mask: Mask) -> jax.Array:
    """The splash form end to end heads-major: the sequence padded once (x and the rope tables),
    q, k, v projected straight to [B, H, P, Dh] and the output projected from it; no transposes
    of q, k, v or y (on TPU such copies cost more than the attention itself)."""
    length = x.shape[1]
    padded = padded_length(length)
    qkv = jnp.einsum("bld,dthk->tbhlk", jnp.pad(x, ((0, 0), (0, padded - length), (0, 0))), qkv_w)
    q, k, v = qkv[0] * jnp.asarray(qkv_w.shape[-1] ** -0.5, qkv.dtype), qkv[1], qkv[2]
    if cos_sin is not None:
        cos, sin = (jnp.pad(t, ((0, padded - length), (0, 0))) for t in cos_sin)
        q, k = apply_rope(q, cos, sin, heads_first=True), apply_rope(k, cos, sin, heads_first=True)
    y = splash_heads_major(q, k, v, padded_mask(mask, length))
    return jnp.einsum("bhlk,hkd->bld", y, out_w)[:, :length]


class Block(nn.Module):
    """Post-norm block: token mixing (attention or sequence-MLP), then a channel SwiGLU."""

    hidden: int
    heads: int
    expansion: float
    total_len: int  # prefix + sequence positions (the mlp_t width)
    mlp_t: bool = False
    dtype: jnp.dtype = jnp.bfloat16
    eps: float = RMS_EPS
    attention: str = "xla"
    recompute_mlp: bool = False
    mixer: str = "xla"  # SequenceMixer.form

    @nn.compact
    def __call__(self, h: jax.Array, cos_sin: CosSin = None, mask: Mask = None) -> jax.Array:
        if self.mlp_t:
            if mask is not None:
                raise ValueError("an attention mask needs the attention token mixer (mlp_t=False)")
            h = SequenceMixer(self.total_len, self.expansion, self.dtype, self.eps, self.recompute_mlp, self.mixer,
                              name="mlp_t")(h)
        else:
            attn = Attention(self.hidden, self.heads, self.dtype, self.attention, name="attn")
            h = rms_norm(h + attn(h, cos_sin, mask), self.eps)
        mlp = SwiGLU(self.hidden, self.expansion, self.dtype, self.recompute_mlp, name="mlp")
        return rms_norm(h + mlp(h), self.eps)


class ReasoningNet(nn.Module):
    """`net(h, inj)`: `layers` blocks applied to `h + inj` (`mask`: optional attention mask)."""

    layers: int
    hidden: int
    heads: int
    expansion: float
    total_len: int
    mlp_t: bool = False
    dtype: jnp.dtype = jnp.bfloat16
    attention: str = "xla"  # models/attention.py
    recompute_mlp: bool = False  # SwiGLU.recompute
    mixer: str = "xla"  # SequenceMixer.form

    @nn.compact
    def __call__(self, h: jax.Array, inj: jax.Array, cos_sin: CosSin = None, mask: Mask = None) -> jax.Array:
        h = h + inj
        for i in range(self.layers):
            h = Block(self.hidden, self.heads, self.expansion, self.total_len, self.mlp_t, self.dtype,
                      attention=self.attention, recompute_mlp=self.recompute_mlp, mixer=self.mixer,
                      name=f"block_{i}")(h, cos_sin, mask)
        return h


def make_net_fn(net_def: ReasoningNet, cos_sin: CosSin, mask: Mask = None, remat: bool = False) -> Callable:
    """A pure `(params, h, inj) -> h` for a standalone (unbound) ReasoningNet definition.

    The recursion loops call the network through this function inside `lax.scan`/`fori_loop`,
    so the loop body is traced once whatever the cycle counts, and the no-gradient cycles can
    be given stop-gradient parameters. `remat=True` wraps it in `jax.checkpoint`: the backward
    pass keeps only its inputs (params, h, inj) and recomputes the blocks' activations.
    """

    def fn(params, h, inj):
        return net_def.apply({"params": params}, h, inj, cos_sin, mask)

    return jax.checkpoint(fn) if remat and not in_analysis() else fn


def repeat(fn: Callable, n: int, x):
    """Apply `x = fn(x)` n times under a loop (traced once); n == 0 returns x."""
    if n <= 0:
        return x
    if n == 1:
        return fn(x)
    if in_analysis():  # a loop body counts once in XLA's cost analysis: unroll to count every application
        for _ in range(n):
            x = fn(x)
        return x
    out, _ = jax.lax.scan(lambda c, _: (fn(c), None), x, None, length=n)
    return out


def stop_gradient_tree(tree):
    return jax.tree.map(jax.lax.stop_gradient, tree)


def count_params(tree, exclude: Sequence[str] = ()) -> int:
    """Number of scalars in a (possibly boxed) params tree, skipping top-level keys in `exclude`."""
    tree = nn.meta.unbox(tree)
    return int(sum(math.prod(x.shape) for k, v in tree.items() if k not in exclude for x in jax.tree.leaves(v)))
