"""Layers shared by the models, with logical axis names on every parameter."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from runtime.errors import UserError
from runtime.task import AUTO_DTYPE, platform_compute_dtype

# The one table of dtype names the configs use (arch.dtype, arch.param_dtype, arch.forward_dtype,
# optim.state_dtype): every model and the optimizer resolve names through `dtype_from_name`.
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def traced_platform() -> str:
    """The platform a step is traced for: its mesh's (the train step sets it, runtime/sharding.py
    `activation_rules`; a compile for a TPU topology on a CPU host is "tpu"), else the default
    backend's (a model applied outside a train step is lowered there, unless the jit is given
    devices of another platform: then only a mesh set around the trace says so)."""
    mesh = jax.sharding.get_abstract_mesh()
    platform = None if mesh.empty else getattr(getattr(mesh, "abstract_device", None), "platform", None)
    return platform or jax.default_backend()


def for_platform(*args, default, **forms):
    """`forms[platform](*args)` (cpu=, tpu=, cuda=, rocm=) for the platform the step is lowered
    for, else `default(*args)`. A step traced for the CPU (`traced_platform`) traces only the CPU
    form: the suite's many small steps trace in half the time. Any other goes through
    jax.lax.platform_dependent, which traces every form and lowers the platform's: the programs
    the plan's figures were read from (the same form called directly is fused differently:
    maze50_full 388 ms by platform_dependent, 410 ms called directly)."""
    if traced_platform() == "cpu":
        return forms.get("cpu", default)(*args)
    return jax.lax.platform_dependent(*args, default=default, **forms)


def dtype_from_name(name: str):
    """A config's dtype name ("bfloat16") -> the jnp dtype; "auto" (a compute dtype the runtime
    did not resolve: a model built directly) -> the default backend's; ValueError naming the
    choices otherwise."""
    if name == AUTO_DTYPE:
        name = platform_compute_dtype(jax.default_backend())
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(_DTYPES)}") from None


def check_dtype_names(arch, *fields: str, auto: bool = False) -> None:
    """Each `arch.<field>` names a dtype of `_DTYPES` (or with `auto`, is "auto"); else one
    UserError listing them."""
    names = sorted(_DTYPES) + ([AUTO_DTYPE] if auto else [])
    for name in fields:
        value = getattr(arch, name)
        if value not in names:
            raise UserError(f"arch.{name}={value!r} is not a dtype name; use one of {names}")


def check_at_least(arch, low: int, *fields: str) -> None:
    """Each `arch.<field>` is >= `low` (sizes, counts); else one UserError."""
    for name in fields:
        value = getattr(arch, name)
        if value < low:
            raise UserError(f"arch.{name}={value!r} is out of range: it must be >= {low}")


def check_heads(arch, hidden: str = "hidden", heads: str = "heads") -> None:
    """Attention splits `hidden` into `heads` equal parts (head_dim = hidden / heads)."""
    h, n = getattr(arch, hidden), getattr(arch, heads)
    if h % n:
        divisors = [d for d in range(1, min(h, 64) + 1) if h % d == 0]  # the usual head counts
        raise UserError(f"arch.{heads}={n} does not divide arch.{hidden}={h}; use heads in {divisors} (or change "
                        f"arch.{hidden})")


def dense_init(fan_in: int):
    return nn.initializers.truncated_normal(stddev=fan_in**-0.5)


class Attention(nn.Module):
    """Non-causal multi-head attention with a fused qkv projection."""

    hidden: int
    heads: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        head_dim = self.hidden // self.heads
        qkv_w = self.param("qkv", nn.with_logical_partitioning(dense_init(self.hidden), ("embed", "qkv", "heads", "head_dim")),
                           (self.hidden, 3, self.heads, head_dim))
        out_w = self.param("out", nn.with_logical_partitioning(dense_init(self.hidden), ("heads", "head_dim", "embed")),
                           (self.heads, head_dim, self.hidden))
        q, k, v = jnp.einsum("ble,ethd->tblhd", x, qkv_w.astype(self.dtype))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * head_dim**-0.5
        probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
        y = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        return jnp.einsum("blhd,hde->ble", y, out_w.astype(self.dtype))


class MlpBlock(nn.Module):
    """SwiGLU feed-forward."""

    features: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        hidden = x.shape[-1]
        gate_up = self.param("gate_up", nn.with_logical_partitioning(dense_init(hidden), ("embed", "gate", "mlp")),
                             (hidden, 2, self.features))
        down = self.param("down", nn.with_logical_partitioning(dense_init(self.features), ("mlp", "embed")),
                          (self.features, hidden))
        gate, up = jnp.einsum("ble,egf->gblf", x, gate_up.astype(self.dtype))
        return jnp.einsum("blf,fe->ble", jax.nn.silu(gate) * up, down.astype(self.dtype))
