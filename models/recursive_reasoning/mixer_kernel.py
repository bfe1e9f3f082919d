"""The mlp_t token mixer with its residual norm as one Pallas TPU kernel (`arch.mixer`).

The mixer is ``z = rms(h + SwiGLU over the sequence)``, normalised over the sequence, for each
feature column of h [B, L, D] (models/recursive_reasoning/layers.py `SequenceMixer`). XLA computes
it as three products with the [B, D, 2F] gate/up intermediate written to HBM and read back, forward
and backward: at Sudoku's sizes (L = 97, F = 512) a 200 MB tensor per call for products whose
contraction is only 97 wide, so the mixer is bound by HBM traffic (exp02a/L6 on v4-64: 55% of the
step's estimated time for a quarter of its FLOPs). This kernel keeps the intermediate in VMEM: per
batch row and tile of feature columns it computes ``g, u = Wg^T x, Wu^T x`` ([F, L] @ [L, Dt]),
``m = Wd^T (silu(g) * u)``, and the norm over L; HBM sees only h, z and the weights. The backward
kernel recomputes all of it from h (nothing else is saved) and writes dh and each core's partial
weight gradients, summed outside (and over the batch shards under a mesh).

Forms (`arch.mixer`): ``xla`` (the products as einsums, layers.py), ``pallas`` (this kernel; on a
platform other than TPU Pallas' interpreter, for tests), ``auto`` (this kernel on TPU where its
working set fits `VMEM_BUDGET` and the compute dtype is bfloat16 or float32, else xla; an explicit
``pallas`` that auto would not choose for those reasons is refused before compiling, task.py
`check_platform`). The values are the same up to rounding: the kernel accumulates in float32 and
keeps the gate/up products, the residual sum and the norm's input in float32 where the xla form
rounds them to the compute dtype.

The kernel declares its cost (FLOPs with the sequence padded to the MXU's 128-wide tiles, which
is the work the hardware does; HBM bytes), which runtime/hlo_cost.py prices at the roofline.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from models.kernels import TILE, activation_spec, per_shard, round_up

FORMS = ("auto", "xla", "pallas")
MXU = TILE  # the MXU's tile: a product's sequence dimension is padded to it
VMEM_BUDGET = 4 << 20  # bytes of float32 intermediates per grid step (the backward's [2F, Dt] tiles, ~8 of them)
_TILES = (512, 256, 128)  # feature-column tiles tried, widest first
_ROWS = (8, 4, 2, 1)  # batch rows per grid step, most first


def check(form: str) -> str:
    if form not in FORMS:
        raise ValueError(f"mixer form {form!r} is not one of {FORMS}")
    return form


DTYPES = (jnp.bfloat16, jnp.float32)  # Mosaic on v4 cannot lay out float16's packed loads


def fits(dim: int, inter: int, dtype) -> bool:
    """Whether the kernel takes a mixer of width `inter` on `dim` features in `dtype` (auto's test)."""
    return column_tile(dim, inter) is not None and jnp.dtype(dtype) in DTYPES


def column_tile(dim: int, inter: int) -> int | None:
    """The feature-column tile for a mixer of width `inter` on `dim` features: the widest of
    `_TILES` dividing `dim` (or `dim` itself when 128 does not) whose backward working set fits
    `VMEM_BUDGET`; None when none does (the xla form is used)."""
    tiles = [t for t in _TILES if dim % t == 0] or [dim]
    return next((t for t in tiles if 8 * 2 * inter * t * 4 <= VMEM_BUDGET), None)


def _silu_parts(g):
    sig = jax.nn.sigmoid(g)
    return sig, g * sig


def _normed(s, eps):
    """(z, r): s normalised over its first axis (the sequence), and the scale r [1, Dt]."""
    r = jax.lax.rsqrt(jnp.mean(s * s, axis=0, keepdims=True) + eps)
    return s * r, r


def _forward_kernel(x_ref, wgu_ref, wd_ref, z_ref, *, rows, inter, eps):
    wgu, wd = wgu_ref[...], wd_ref[...]
    for i in range(rows):
        x = x_ref[i]  # [L, Dt]
        gu = jnp.dot(wgu, x, preferred_element_type=jnp.float32)  # [2F, Dt]
        _, silu = _silu_parts(gu[:inter])
        m = jnp.dot(wd, (silu * gu[inter:]).astype(x.dtype), preferred_element_type=jnp.float32)  # [L, Dt]
        z_ref[i] = _normed(x.astype(jnp.float32) + m, eps)[0].astype(z_ref.dtype)


_NT = (((1,), (1,)), ((), ()))  # a @ b^T: both contract their last axis


def _backward_kernel(x_ref, dz_ref, wgu_ref, wgu_t_ref, wd_ref, wd_t_ref, dx_ref, dwgu_ref, dwd_ref, *,
                     rows, inter, eps):
    @pl.when((pl.program_id(1) == 0) & (pl.program_id(2) == 0))
    def _():
        dwgu_ref[...] = jnp.zeros_like(dwgu_ref)
        dwd_ref[...] = jnp.zeros_like(dwd_ref)

    wgu, wgu_t, wd, wd_t = wgu_ref[...], wgu_t_ref[...], wd_ref[...], wd_t_ref[...]
    dwgu = jnp.zeros(dwgu_ref.shape[1:], jnp.float32)
    dwd = jnp.zeros(dwd_ref.shape[1:], jnp.float32)
    for i in range(rows):
        x, dz = x_ref[i], dz_ref[i].astype(jnp.float32)
        gu = jnp.dot(wgu, x, preferred_element_type=jnp.float32)
        g, u = gu[:inter], gu[inter:]
        sig, silu = _silu_parts(g)
        hidden = (silu * u).astype(x.dtype)
        z, r = _normed(x.astype(jnp.float32) + jnp.dot(wd, hidden, preferred_element_type=jnp.float32), eps)
        ds = r * (dz - z * jnp.mean(dz * z, axis=0, keepdims=True))  # through the norm: d(residual sum)
        dm = ds.astype(x.dtype)
        dh = jnp.dot(wd_t, dm, preferred_element_type=jnp.float32)  # [F, Dt]
        dgu = jnp.concatenate([dh * u * (sig * (1 + g * (1 - sig))), dh * silu], axis=0).astype(x.dtype)
        dx_ref[i] = (ds + jnp.dot(wgu_t, dgu, preferred_element_type=jnp.float32)).astype(dx_ref.dtype)
        dwgu += jax.lax.dot_general(dgu, x, _NT, preferred_element_type=jnp.float32)  # [2F, L]
        dwd += jax.lax.dot_general(dm, hidden, _NT, preferred_element_type=jnp.float32)  # [L, F]
    dwgu_ref[0] += dwgu
    dwd_ref[0] += dwd


def _layout(shape, inter: int):
    """(cores, batch steps per core, rows per step, column tile, column steps) for x of `shape`.
    Two "parallel" halves of the batch (a v4/v5p chip's two TensorCores each take one, with its
    own partial weight gradients); one where the batch is odd."""
    batch, _, dim = shape
    cores = 2 if batch % 2 == 0 else 1
    per_core = batch // cores
    rows = next(r for r in _ROWS if per_core % r == 0)
    tile = column_tile(dim, inter)
    return cores, per_core // rows, rows, tile, dim // tile


def _call(kernel, activations, weights, partials, cost: pl.CostEstimate, inter: int, interpret: bool, name: str):
    """The kernel over the grid (core, batch step, column tile): the x-shaped `activations` (x,
    and dz) and the x-shaped output by blocks of `rows` batch rows and a column tile, `weights`
    whole, and one float32 output of each shape in `partials` per core (its partial weight
    gradients)."""
    x = activations[0]
    cores, steps, rows, tile, col_steps = _layout(x.shape, inter)
    block = pl.BlockSpec((rows, x.shape[1], tile), lambda c, i, j: (c * steps + i, 0, j))
    whole = [pl.BlockSpec(w.shape, lambda c, i, j: (0, 0)) for w in weights]
    per_core = [pl.BlockSpec((1,) + shape, lambda c, i, j: (c, 0, 0)) for shape in partials]
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype)] + [jax.ShapeDtypeStruct((cores,) + s, jnp.float32)
                                                            for s in partials]
    return pl.pallas_call(
        functools.partial(kernel, rows=rows, inter=inter),
        out_shape=out_shape, grid=(cores, steps, col_steps),
        in_specs=[block] * len(activations) + whole, out_specs=[block] + per_core,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        cost_estimate=cost, interpret=interpret, name=name)(*activations, *weights)


def _weights(gate_up, down):
    """gate_up [L, 2, F], down [F, L] -> the kernels' layouts: wgu [2F, L] (gate rows, then up)
    and wd [L, F], and their transposes."""
    length, _, inter = gate_up.shape
    wgu_t = gate_up.reshape(length, 2 * inter)
    return wgu_t.T, wgu_t, down.T, down


def _cost(x, inter: int, products: int, activation_passes: int, weight_bytes: int) -> pl.CostEstimate:
    batch, length, dim = x.shape
    return pl.CostEstimate(flops=2 * batch * dim * round_up(length, MXU) * inter * products,
                           transcendentals=batch * dim * (inter + 1),
                           bytes_accessed=activation_passes * x.size * x.dtype.itemsize + weight_bytes)


def _forward(x, gate_up, down, eps, interpret):
    inter = down.shape[0]
    wgu, _, wd, _ = _weights(gate_up, down)
    cost = _cost(x, inter, 3, 2, (wgu.size + wd.size) * wgu.dtype.itemsize)  # gate, up, down; x in, z out
    (z,) = _call(functools.partial(_forward_kernel, eps=eps), (x,), (wgu, wd), (), cost, inter, interpret,
                 "mlp_t_mixer_fwd")
    return z


def _backward(x, dz, gate_up, down, eps, interpret):
    length, inter = x.shape[1], down.shape[0]
    wgu, wgu_t, wd, wd_t = _weights(gate_up, down)
    cores = _layout(x.shape, inter)[0]
    weight_bytes = 2 * (wgu.size + wd.size) * wgu.dtype.itemsize + cores * (wgu.size + wd.size) * 4
    # gate, up and down again, then dh, dx (2), dWgu (2), dWd; x and dz in, dx out
    cost = _cost(x, inter, 9, 3, weight_bytes)
    dx, dwgu, dwd = _call(functools.partial(_backward_kernel, eps=eps), (x, dz.astype(x.dtype)), (wgu, wgu_t, wd, wd_t),
                          ((2 * inter, length), (length, inter)), cost, inter, interpret, "mlp_t_mixer_bwd")
    return dx, dwgu.sum(0), dwd.sum(0)


def mixer_block(h: jax.Array, gate_up: jax.Array, down: jax.Array, eps: float, *, interpret: bool = False) -> jax.Array:
    """``rms(h + SwiGLU over the sequence)`` normalised over the sequence, by the kernels; h
    [B, L, D], gate_up [L, 2, F], down [F, L] (the SequenceMixer's parameters in the compute
    dtype). Under a mesh each batch shard runs its own kernels and the weight gradients are summed
    over the batch axes. `interpret`: Pallas' interpreter (any platform)."""
    spec = activation_spec(("batch", None, None), h.shape)  # the weights whole on every shard
    forward = per_shard(lambda x, gu, d: _forward(x, gu, d, eps, interpret), spec, (True, False, False), True)
    backward = per_shard(lambda x, dz, gu, d: _backward(x, dz, gu, d, eps, interpret), spec, (True, True, False, False),
                         (True, False, False), sum_whole_outputs=True)

    @jax.custom_vjp
    def block(x, gu, d):
        return forward(x, gu, d)

    def block_fwd(x, gu, d):
        return forward(x, gu, d), (x, gu, d)

    def block_bwd(res, dz):
        x, gu, d = res
        length, _, inter = gu.shape
        dx, dwgu, dwd = backward(x, dz, gu, d)
        return dx, dwgu.T.reshape(length, 2, inter).astype(gu.dtype), dwd.T.astype(d.dtype)

    block.defvjp(block_fwd, block_bwd)
    return block(h, gate_up, down)
