"""Non-causal multi-head attention in one of three forms (`arch.attention`), same semantics:
softmax(q k^T / sqrt(head_dim), masked) v, over [batch, length, heads, head_dim] activations.

  xla          the scores written out: float32 [B, H, T, T], masked with float32's minimum, softmax
               in float32, probabilities cast to the compute dtype for the product with v. Every
               platform runs it; on TPU the scores and the probabilities saved for the backward
               pass are most of a long sequence's step time.
  splash       jax's Pallas TPU kernel (jax.experimental.pallas.ops.tpu.splash_attention): scores
               only block by block in VMEM, blocks the mask leaves empty skipped. The sequence is
               padded to a multiple of 128 (padded keys masked; a padded query sees only itself
               and is dropped). Under a mesh it runs per shard (shard_map over the batch and head
               axes). Where the step is lowered for CPU it runs in Pallas' interpret mode (tests).
  dot_product  jax.nn.dot_product_attention: on GPU, XLA's cuDNN fused attention where cuDNN
               takes the shapes; elsewhere its XLA form.
  auto         chosen for the platform the step is lowered for (models/layers.py `for_platform`, so a
               compile for a TPU topology on a CPU host gets the TPU choice): on TPU splash from SPLASH_MIN_LENGTH
               tokens, xla below (the padding and the heads-major copies cost more than the scores
               save: Sudoku's 97 tokens, 16.4 ms xla vs 21.0 ms splash by the v4-64 estimate); on
               GPU dot_product; elsewhere xla.

The splash kernels declare no cost, so `price_splash` gives runtime/hlo_cost.py the FLOPs and HBM
bytes of each (from the blocks of the mask it visits) for the compile-only estimate.
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

from models.kernels import TILE, activation_spec, per_shard, round_up
from models.layers import for_platform
from runtime.hlo_cost import PRICED_KERNELS, _bytes

IMPLEMENTATIONS = ("auto", "xla", "splash", "dot_product")
SPLASH_MIN_LENGTH = 512
PAD_MULTIPLE = TILE  # splash's smallest block


def tpu_form(length: int) -> str:
    """What arch.attention=auto runs on TPU for a sequence of `length` tokens."""
    return "splash" if length >= SPLASH_MIN_LENGTH else "xla"


def auto_forms(length: int) -> dict[str, str]:
    """What arch.attention=auto runs, by platform (`for_platform`'s keywords)."""
    return {"tpu": tpu_form(length), "cuda": "dot_product", "rocm": "dot_product", "default": "xla"}


def check(impl: str) -> str:
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"attention {impl!r} is not one of {IMPLEMENTATIONS}")
    return impl


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: Optional[np.ndarray] = None, *,
           impl: str = "xla", interpret: bool = False) -> jax.Array:
    """q, k, v [B, T, H, Dh] -> [B, T, H, Dh] in v's dtype. `mask`: bool [T, T] (True = may attend;
    every row allows at least one key), a constant (numpy)."""
    if check(impl) == "auto":
        forms = {p: functools.partial(attend, mask=mask, impl=name) for p, name in auto_forms(q.shape[1]).items()}
        return for_platform(q, k, v, **forms)
    if impl == "splash":
        return splash_attention(q, k, v, mask, interpret=interpret)
    if impl == "dot_product":
        return jax.nn.dot_product_attention(q, k, v, mask=None if mask is None else jnp.asarray(mask)[None, None])
    return xla_attention(q, k, v, mask)


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: Optional[np.ndarray] = None) -> jax.Array:
    scores = jnp.einsum("bqhk,bshk->bhqs", q, k, preferred_element_type=jnp.float32) * (q.shape[-1] ** -0.5)
    if mask is not None:
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqs,bshk->bqhk", probs, v)


# ---------------------------------------------------------------- splash (Pallas, TPU)

def padded_length(length: int) -> int:
    return round_up(length, PAD_MULTIPLE)


def block_size(padded: int) -> int:
    """The largest of 512, 256, 128 that divides the padded length."""
    return next(b for b in (512, 256, 128) if padded % b == 0)


def padded_mask(mask: Optional[np.ndarray], length: int) -> np.ndarray:
    """bool [P, P]: `mask` (None: all True) on the first `length` rows and columns; a padded query
    attends only to itself (its row is dropped), no real query sees a padded key."""
    padded = padded_length(length)
    out = np.zeros((padded, padded), dtype=bool)
    out[:length, :length] = True if mask is None else np.asarray(mask, dtype=bool)
    pad = np.arange(length, padded)
    out[pad, pad] = True
    return out


@dataclass(frozen=True)
class BlockStats:
    """The (q block, kv block) pairs a splash kernel visits for one head of one batch row."""
    padded: int
    block: int
    visited: float  # pairs with any True in the mask (the kernel skips the others); a layer mean (causal_stats)
    q_per_kv: int = 1  # query heads per kv head (GQA): the dkv kernel's outputs are the kv heads'


def block_stats(mask: np.ndarray) -> BlockStats:
    padded = mask.shape[0]
    block = block_size(padded)
    n = padded // block
    visited = int(mask.reshape(n, block, n, block).any(axis=(1, 3)).sum())
    return BlockStats(padded, block, visited)


# Visited-block statistics of the splash kernels traced in this process, by (padded length,
# head_dim): what `price_splash` needs to price a kernel it finds in a compiled step.
SPLASH_BLOCKS: dict[tuple[int, int], BlockStats] = {}

# Per visited (q block, kv block) pair, 2 x the [block, Dh] x [Dh, block]-sized products each kernel
# does: forward s = q k^T, o += p v; dq: s again, dp = do v^T, dq += ds k; dkv: s and dp again,
# dv += p^T do, dk += ds^T q.
SPLASH_PRODUCTS = {"splash_mha_fwd": 2, "splash_mha_dq": 3, "splash_mha_dkv": 4}
_LANES = TILE  # splash keeps each query row's softmax statistics lane-broadcast: float32 [.., P, 128]
_ITEM = {"bf16": 2, "f16": 2, "f32": 4}


def price_splash(name: str, types: str) -> tuple[float, float] | None:
    """(FLOPs, HBM bytes) of one run of a splash kernel (instruction `name`, output `types` of a
    compiled TPU step): its products over the visited blocks; q, k, v and do read once per visited
    block where a kernel streams them (the rest once), the softmax statistics, and its outputs."""
    kind = next((k for k in SPLASH_PRODUCTS if name.startswith(k)), None)
    found = []
    for dtype, dims in re.findall(r"\b(bf16|f16|f32)\[([\d,]+)\]", types):
        *lead, length, head_dim = (int(d) for d in dims.split(","))
        if lead and (length, head_dim) in SPLASH_BLOCKS:  # [(batch,) heads, P, Dh]: the batch is gone when 1
            found.append((dtype, math.prod(lead), SPLASH_BLOCKS[(length, head_dim)], head_dim))
    if kind is None or not found:
        return None
    dtype, rows, stats, head_dim = found[0]
    rows *= stats.q_per_kv if kind == "splash_mha_dkv" else 1  # its outputs are [.., K, P, Dh]; it runs per q head
    item, length, block, visited = _ITEM[dtype], stats.padded, stats.block, stats.visited
    flops = rows * visited * SPLASH_PRODUCTS[kind] * 2 * block * block * head_dim
    row_stats = length * _LANES * 4
    streamed = visited * block * head_dim * item * 2  # the other side's two operands, per visited block
    reads = {"splash_mha_fwd": length * head_dim * item + streamed,  # q; k, v streamed
             "splash_mha_dq": 2 * length * head_dim * item + 2 * row_stats + streamed,  # q, do, stats; k, v
             "splash_mha_dkv": 2 * length * head_dim * item + streamed + 2 * visited * block * _LANES * 4}[kind]
    return float(flops), float(rows * reads + _bytes(types))


def _register_pricing() -> None:
    PRICED_KERNELS["splash_mha_"] = price_splash


_register_pricing()


_kernels: dict[tuple, object] = {}  # one splash kernel per mask, length, heads and mode (its mask info is built once)


def _splash_kernel(mask: np.ndarray, heads: int, interpret: bool):
    key = (hashlib.sha1(mask.tobytes()).hexdigest(), mask.shape[0], heads, interpret)
    if key not in _kernels:
        b = block_size(mask.shape[0])
        sizes = sk.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                              block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
        head_mask = sm.FullMask(mask.shape) if mask.all() else sm.NumpyMask(mask)
        with jax.ensure_compile_time_eval():  # its mask arrays concrete, whatever trace asked first (it is kept)
            _kernels[key] = sk.make_splash_mha(sm.MultiHeadMask([head_mask] * heads), block_sizes=sizes,
                                               head_shards=1, q_seq_shards=1, interpret=interpret)
    return _kernels[key]


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: Optional[np.ndarray] = None, *,
                     interpret: bool = False) -> jax.Array:
    """The splash form on [B, T, H, Dh] activations (see the module docstring): heads-major and
    padded for `splash_heads_major`, and back."""
    _, length, _, head_dim = q.shape
    padded = padded_length(length)

    def heads_major(x):
        return jnp.pad(jnp.swapaxes(x, 1, 2), ((0, 0), (0, 0), (0, padded - length), (0, 0)))

    out = splash_heads_major(heads_major(q * jnp.asarray(head_dim ** -0.5, q.dtype)), heads_major(k), heads_major(v),
                             padded_mask(mask, length), interpret=interpret)
    return jnp.swapaxes(out[:, :, :length], 1, 2).astype(v.dtype)


def splash_heads_major(q: jax.Array, k: jax.Array, v: jax.Array, mask: np.ndarray, *,
                       interpret: bool = False) -> jax.Array:
    """softmax(q k^T, masked) v on heads-major [B, H, P, Dh] (q already scaled; P a multiple of
    128, `mask` bool [P, P] from `padded_mask`). `interpret`: Pallas' interpreter wherever the step
    is lowered (tests); else the Mosaic kernel on TPU and the interpreter elsewhere."""
    stats = block_stats(mask)
    SPLASH_BLOCKS[(stats.padded, q.shape[-1])] = stats

    def run(interpreted: bool):
        def local(q, k, v):  # [b, H_local, P, Dh]: one shard's batch rows and heads
            return jax.vmap(_splash_kernel(mask, q.shape[1], interpreted))(q, k, v)

        def sharded(q, k, v):  # a Pallas call is not partitioned by XLA: per shard (models/kernels.py)
            return per_shard(local, activation_spec(("batch", "heads", None, None), q.shape), (True,) * 3, True)(q, k, v)
        return sharded

    if interpret:
        return run(True)(q, k, v)
    return for_platform(q, k, v, tpu=run(False), default=run(True))


# ---------------------------------------------------------------- causal splash (Gemma)

def causal_visited(padded: int, block: int, window: Optional[int]) -> int:
    """Block pairs a causal mask (with `window`: a key visible when key > query - window) leaves
    non-empty, computed from the blocks' corners."""
    q0 = np.arange(0, padded, block)[:, None]  # each q block's first row
    k0 = np.arange(0, padded, block)[None, :]
    seen = k0 <= q0 + block - 1  # some key at or before some query
    if window is not None:
        seen &= k0 + block - 1 > q0 - window  # some key inside the first query's window
    return int(seen.sum())


def causal_stats(padded: int, windows: list[Optional[int]], q_per_kv: int) -> BlockStats:
    """The visited blocks of a stack whose layers have these windows (None: global), as their mean:
    the layers' kernels have one shape, so a compiled step does not say which is which."""
    block = block_size(padded)
    visited = sum(causal_visited(padded, block, w) for w in windows) / len(windows)
    return BlockStats(padded, block, visited, q_per_kv)


_causal_kernels: dict[tuple, object] = {}


def _causal_kernel(padded: int, heads: int, window: Optional[int], soft_cap: Optional[float], interpret: bool):
    key = (padded, heads, window, soft_cap, interpret)
    if key not in _causal_kernels:
        b = block_size(padded)
        sizes = sk.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                              block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
        shape = (padded, padded)
        mask = sm.CausalMask(shape) if window is None else sm.LocalMask(shape, (window - 1, 0), 0)
        with jax.ensure_compile_time_eval():
            _causal_kernels[key] = sk.make_splash_mha(sm.MultiHeadMask([mask] * heads), block_sizes=sizes,
                                                      attn_logits_soft_cap=soft_cap, head_shards=1, q_seq_shards=1,
                                                      interpret=interpret)
    return _causal_kernels[key]


def splash_causal(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: Optional[jax.Array] = None, *,
                  window: Optional[int] = None, soft_cap: Optional[float] = None,
                  interpret: bool = False) -> jax.Array:
    """Causal attention by index in the splash kernel: q [B, T, H, Dh] (already scaled), k, v
    [B, T, K, Dh] (K divides H; query head h reads kv head h // (H / K)) -> [B, T, H, Dh] in v's
    dtype. `segment_ids` [B, T]: a key is visible only within its query's segment (packing);
    `window`: only keys with index > query - window; `soft_cap`: logits tanh(s / cap) * cap.
    The sequence is padded to a multiple of 128: no real query sees a padded key (they come
    after it), the padded queries' rows are dropped. Per shard under a mesh (batch and heads)."""
    batch, length, heads, head_dim = q.shape
    padded = padded_length(length)

    def heads_major(x):
        return jnp.pad(jnp.swapaxes(x, 1, 2), ((0, 0), (0, 0), (0, padded - length), (0, 0)))

    args = [heads_major(q), heads_major(k), heads_major(v)]
    if segment_ids is not None:
        args.append(jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, padded - length)), constant_values=-1))

    def run(interpreted: bool):
        def local(q, k, v, seg=None):  # one shard's batch rows and heads
            kernel = _causal_kernel(padded, q.shape[1], window, soft_cap, interpreted)
            if seg is None:
                return jax.vmap(kernel)(q, k, v)
            return jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=sk.SegmentIds(s, s)))(q, k, v, seg)

        def sharded(*args):
            q_spec = activation_spec(("batch", "heads", None, None), args[0].shape)
            if q_spec is None:
                return local(*args)
            kv_spec = activation_spec(("batch", "kv_heads", None, None), args[1].shape)
            if kv_spec[1] != q_spec[1] and args[1].shape[1] > 1:  # groups split unlike their kv heads: keep heads whole
                q_spec = kv_spec = jax.P(q_spec[0], None, None, None)
            specs = (q_spec, kv_spec, kv_spec, jax.P(q_spec[0], None))[:len(args)]
            return jax.shard_map(local, mesh=jax.sharding.get_abstract_mesh(), in_specs=specs, out_specs=q_spec,
                                 check_vma=False)(*args)
        return sharded

    out = run(True)(*args) if interpret else for_platform(*args, tpu=run(False), default=run(True))
    return jnp.swapaxes(out[:, :, :length], 1, 2).astype(v.dtype)
