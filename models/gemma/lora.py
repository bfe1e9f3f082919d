"""LoRA for the Gemma einsums (see config.py for the parameter layout).

For a targeted weight `w` the module holds, beside it, `lora_a` [<input dims of w>, r] and
`lora_b` [r, <output dims of w>] (a leading "layers" axis under the layer stack). The forward
pass adds the low-rank path on activations, ``y += (alpha / r) * (x @ A) @ B``: cheaper than
merging, since the backward never forms a full-size weight gradient. `merge_lora` folds
``(alpha / r) * A @ B`` into `w` (same forward up to float rounding) and drops the lora leaves.
A starts normal(1 / sqrt(fan_in)), B at zero, so training starts from the base model exactly.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.gemma.config import LORA_TARGETS, GemmaConfig
from models.layers import dtype_from_name

# Which axes of each per-layer weight are its inputs (contracted with the activations); the
# remaining axes are its outputs. Layouts as in config.py.
LORA_IN_AXES: dict[str, tuple[int, ...]] = {
    "q_einsum": (1,),  # [H, D, hd]
    "kv_einsum": (2,),  # [2, K, D, hd]
    "attn_vec_einsum": (0, 1),  # [H, hd, D]
    "gating_einsum": (1,),  # [2, D, F]
    "linear": (0,),  # [F, D]
}
RANK_AXIS = "lora_rank"  # logical name of r: not in the sharding rules, so replicated


def enabled(cfg: GemmaConfig, target: str) -> bool:
    unknown = set(cfg.lora_targets) - set(LORA_TARGETS)
    if unknown:
        raise ValueError(f"unknown lora_targets {sorted(unknown)}; choose from {LORA_TARGETS}")
    return cfg.lora_rank > 0 and target in cfg.lora_targets


def _split(target: str, ndim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    ins = LORA_IN_AXES[target]
    return ins, tuple(i for i in range(ndim) if i not in ins)


def lora_path(module: nn.Module, target: str, eqn: str, x: jax.Array, w_shape, w_names, cfg: GemmaConfig,
              dtype) -> jax.Array:
    """Declare `lora_a` / `lora_b` on `module` and return the scaled low-rank output for `eqn`.

    `eqn` is the base einsum "x,w->y"; the two low-rank einsums are derived from it.
    """
    ins, outs = _split(target, len(w_shape))
    r = cfg.lora_rank
    fan_in = math.prod(w_shape[i] for i in ins)
    a = module.param("lora_a", nn.with_logical_partitioning(nn.initializers.normal(fan_in**-0.5),
                                                            tuple(w_names[i] for i in ins) + (RANK_AXIS,)),
                     tuple(w_shape[i] for i in ins) + (r,), dtype_from_name(cfg.param_dtype))
    b = module.param("lora_b", nn.with_logical_partitioning(nn.initializers.zeros,
                                                            (RANK_AXIS,) + tuple(w_names[i] for i in outs)),
                     (r,) + tuple(w_shape[i] for i in outs), dtype_from_name(cfg.param_dtype))
    lhs, out = eqn.split("->")
    xs, ws = lhs.split(",")
    assert "r" not in eqn, eqn
    w_in = "".join(ws[i] for i in ins)
    w_out = "".join(ws[i] for i in outs)
    x_rest = "".join(c for c in xs if c not in w_in)
    xa = jnp.einsum(f"{xs},{w_in}r->{x_rest}r", x, a.astype(dtype))
    y = jnp.einsum(f"{x_rest}r,r{w_out}->{out}", xa, b.astype(dtype))
    return y * jnp.asarray(cfg.lora_alpha / r, dtype)


def lora_delta(a: jax.Array, b: jax.Array, target: str, alpha: float) -> jax.Array:
    """(alpha / r) * A @ B in w's layout, float32; leading axes (the layer stack) pass through."""
    r = a.shape[-1]
    n_in = len(LORA_IN_AXES[target])
    lead = a.ndim - n_in - 1
    ins, outs = _split(target, n_in + b.ndim - 1 - lead)
    letters = "abcdefgh"[:len(ins) + len(outs)]
    w_in = "".join(letters[i] for i in ins)
    w_out = "".join(letters[i] for i in outs)
    delta = jnp.einsum(f"...{w_in}r,...r{w_out}->...{letters}", a.astype(jnp.float32), b.astype(jnp.float32))
    return delta * (alpha / r)


def _value(leaf):
    return leaf.value if isinstance(leaf, nn.meta.AxisMetadata) else leaf


def merge_lora(params: Any, cfg: GemmaConfig) -> Any:
    """Params with every (lora_a, lora_b) folded into its `w` and the lora leaves removed.

    Works on plain or boxed (nn.LogicallyPartitioned) trees; merged `w` keeps its dtype and box.
    Use the result with a config whose lora_rank is 0.
    """

    def walk(node, name):
        if not isinstance(node, dict) and not hasattr(node, "items"):
            return node
        if "lora_a" in node:
            w = node["w"]
            wv = _value(w)
            merged = (wv.astype(jnp.float32) + lora_delta(_value(node["lora_a"]), _value(node["lora_b"]), name,
                                                          cfg.lora_alpha)).astype(wv.dtype)
            rest = {k: v for k, v in node.items() if k not in ("lora_a", "lora_b")}
            rest["w"] = w.replace_boxed(merged) if isinstance(w, nn.meta.AxisMetadata) else merged
            return rest
        return {k: walk(v, k) for k, v in node.items()}

    return walk(params, "")


def _key_name(entry) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def is_lora_path(path) -> bool:
    """True for a LoRA parameter: `path` is a jax key path, a tuple of names, or "a/b/c"."""
    if isinstance(path, str):
        parts = path.split("/")
    else:
        parts = [_key_name(p) for p in path]
    return any(p.startswith("lora_") for p in parts)
