"""Tiny Recursive Model (TRM): one small network applied recursively to (z_H, z_L).

Semantics follow the public reference (SamsungSAILMontreal/TinyRecursiveModels,
``models/recursive_reasoning/trm.py``). This module is the
*inner* model: one call = one ACT step (``H_cycles - 1`` cycles without gradient, then one
with). The ACT wrapper (halting, carry reset, data replacement) is in ``act.py``.

Parameters (float32, logical axis names in brackets)::

    embed_tokens [vocab, embed]      trunc-normal std 1/sqrt(hidden)
    puzzle_emb   [puzzle, embed]     zero init; trained by sign-SGD (runtime/optimizers.py)
    pos_embed    [length, embed]     only with pos_encodings == "learned"
    L_level/block_i/...              the reasoning network (attention or mlp_t blocks)
    lm_head      [embed, vocab]      LeCun trunc-normal
    q_head       kernel [embed, -] = 0, bias [-] = -5

``H_init``/``L_init`` are NOT parameters: they are fixed vectors (trunc normal, std 1) computed
deterministically from a constant key by ``initial_states`` (see there); nothing trains,
checkpoints or shards them.

Options beyond the reference, all off by default (see `TRMConfig`): ``remat`` (jax.checkpoint
of the cycle with gradient), ``cycle_consistency_weight`` (sows ``cycle_delta`` for the loss)
and ``attention_window`` / ``grid_width`` (local-window + global-prefix attention mask).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Tuple

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from models.layers import dtype_from_name
from models.recursive_reasoning.layers import (ReasoningNet, local_global_mask, make_net_fn, repeat,
                                               rope_cos_sin, stop_gradient_tree, trunc_normal_init, lecun_init)
from runtime.frozen import Freezable

POS_ENCODINGS = ("rope", "learned", "none")
INIT_STATE_SEED = 0  # the constant key H_init / L_init are drawn from


@dataclass
class TRMConfig(Freezable):
    """TRM arch config; defaults are the reference's Sudoku-Extreme MLP-t run."""

    name: str = "trm"
    hidden: int = 512
    heads: int = 8
    expansion: float = 4.0
    L_layers: int = 2
    H_cycles: int = 3
    L_cycles: int = 6
    halt_max_steps: int = 16
    halt_exploration_prob: float = 0.1
    puzzle_emb_ndim: int = 512
    puzzle_emb_len: int = 16  # prefix tokens; 0 -> ceil(puzzle_emb_ndim / hidden)
    pos_encodings: str = "none"  # rope | learned | none
    mlp_t: bool = True  # sequence-mixing SwiGLU instead of attention
    # float32 | bfloat16 | float16 | auto: bfloat16 on TPU/GPU, float32 on CPU (runtime/task.py
    # platform_compute_dtype); parameters stay float32
    forward_dtype: str = "auto"
    no_ACT_continue: bool = True  # halt on q_halt > 0; no Q-continue target/loss
    rope_theta: float = 10000.0
    loss_type: str = "stablemax_cross_entropy"  # | softmax_cross_entropy (the reference's two choices)
    # jax.checkpoint the network applications of the cycle with gradient: the backward pass keeps
    # only the per-iteration z carries and recomputes each block's activations (same values).
    remat: bool = False
    # > 0: add weight * sum over rows of mean((z_H_after - z_H_before)^2) (float32, over positions
    # and features) of the cycle with gradient to the loss; z_H_before gets no gradient.
    cycle_consistency_weight: float = 0.0
    # Attention variant only (mlp_t=False): odd side of a local square window on the 2-D grid;
    # grid cells attend only cells within it, prefix tokens attend / are attended by all. None = full.
    attention_window: Optional[int] = None
    grid_width: Optional[int] = None  # grid columns for attention_window; None = sqrt(seq_len) (square grids)
    # Attention variant only: the attention's form (models/attention.py): auto (the platform's:
    # splash on TPU, dot_product on GPU, xla on CPU) | xla | splash | dot_product. Same values.
    attention: str = "auto"
    # On TPU/GPU, the backward pass recomputes each SwiGLU (the channel MLP, the mlp_t mixer with
    # its transposes and norm) from its input rather than keeping its intermediates: the same
    # values, less HBM traffic (exp02a/L6 on v4-64: 138.8 -> 109.5 ms by the compile-only estimate).
    recompute_mlp: bool = True
    # mlp_t variant only: the mixer's form (models/recursive_reasoning/mixer_kernel.py): auto (one
    # fused Pallas kernel on TPU where it fits VMEM, else XLA's products) | xla | pallas. Same values.
    mixer: str = "auto"


@flax.struct.dataclass
class InnerCarry:
    z_H: jax.Array  # [B, prefix + L, hidden], forward dtype
    z_L: jax.Array


def prefix_len(puzzle_emb_len: int, puzzle_emb_ndim: int, hidden: int) -> int:
    """Number of puzzle-embedding prefix positions (the reference's rule)."""
    return puzzle_emb_len if puzzle_emb_len > 0 else -(puzzle_emb_ndim // -hidden)


@functools.lru_cache(maxsize=None)
def _init_states_np(hidden: int, seed: int) -> np.ndarray:
    with jax.ensure_compile_time_eval():
        keys = jax.random.split(jax.random.key(seed), 2)
        vals = [trunc_normal_init(1.0)(k, (hidden,)) for k in keys]
        return np.stack([np.asarray(v) for v in vals])


def initial_states(hidden: int, dtype, seed: int = INIT_STATE_SEED) -> Tuple[jax.Array, jax.Array]:
    """(H_init, L_init): fixed [hidden] vectors, trunc normal std 1, in the forward dtype.

    Drawn once from a constant key (cached as numpy), so they are identical in every process,
    every run and after every restore, and need no storage. The reference draws them from the
    run's seed and stores them as non-trained buffers; only their distribution matters.
    """
    v = _init_states_np(hidden, seed)
    return jnp.asarray(v[0], dtype), jnp.asarray(v[1], dtype)


class RecursiveIO(nn.Module):
    """Shared input embedding and output heads of TRM and HRM (subclassed, not used alone)."""

    @property
    def prefix(self) -> int:
        cfg = self.cfg
        return prefix_len(getattr(cfg, "puzzle_emb_len", 0), cfg.puzzle_emb_ndim, cfg.hidden)

    @property
    def total_len(self) -> int:
        return self.prefix + self.seq_len

    @property
    def dtype(self):
        return dtype_from_name(self.cfg.forward_dtype)

    @nn.nowrap
    def initial_states(self) -> Tuple[jax.Array, jax.Array]:
        if self.init_states is not None:
            h, l = self.init_states
            return jnp.asarray(h, self.dtype), jnp.asarray(l, self.dtype)
        return initial_states(self.cfg.hidden, self.dtype)

    @nn.nowrap
    def initial_carry(self, batch_size: int) -> InnerCarry:
        h, l = self.initial_states()
        shape = (batch_size, self.total_len, self.cfg.hidden)
        return InnerCarry(z_H=jnp.broadcast_to(h, shape), z_L=jnp.broadcast_to(l, shape))

    @nn.nowrap
    def reset_carry(self, reset: jax.Array, carry: InnerCarry) -> InnerCarry:
        h, l = self.initial_states()
        r = reset[:, None, None]
        return InnerCarry(z_H=jnp.where(r, h, carry.z_H), z_L=jnp.where(r, l, carry.z_L))

    def _cos_sin(self):
        cfg = self.cfg
        if cfg.pos_encodings == "rope":
            return rope_cos_sin(self.total_len, cfg.hidden // cfg.heads, cfg.rope_theta)
        return None

    def _input_embeddings(self, inputs: jax.Array, puzzle_identifiers: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, self.dtype
        if cfg.pos_encodings not in POS_ENCODINGS:
            raise ValueError(f"pos_encodings must be one of {POS_ENCODINGS}, got {cfg.pos_encodings!r}")
        std = cfg.hidden ** -0.5
        embed = self.param("embed_tokens", nn.with_logical_partitioning(trunc_normal_init(std), ("vocab", "embed")),
                           (self.vocab_size, cfg.hidden))
        x = jnp.take(embed.astype(dt), inputs.astype(jnp.int32), axis=0, mode="clip")
        b = inputs.shape[0]
        if self.prefix > 0:
            width = self.prefix * cfg.hidden
            if cfg.puzzle_emb_ndim > 0:
                if cfg.puzzle_emb_ndim > width:
                    raise ValueError(f"puzzle_emb_ndim {cfg.puzzle_emb_ndim} exceeds {self.prefix} prefix tokens")
                table = self.param("puzzle_emb", nn.with_logical_partitioning(nn.initializers.zeros, ("puzzle", "embed")),
                                   (self.num_puzzle_identifiers, cfg.puzzle_emb_ndim))
                pe = jnp.take(table, puzzle_identifiers.astype(jnp.int32), axis=0, mode="clip").astype(dt)
                pe = jnp.pad(pe, ((0, 0), (0, width - cfg.puzzle_emb_ndim)))
            else:
                pe = jnp.zeros((b, width), dt)
            x = jnp.concatenate([pe.reshape(b, self.prefix, cfg.hidden), x], axis=1)
        if cfg.pos_encodings == "learned":
            pos = self.param("pos_embed", nn.with_logical_partitioning(trunc_normal_init(std), ("length", "embed")),
                             (self.total_len, cfg.hidden))
            x = 0.707106781 * (x + pos.astype(dt))
        return (cfg.hidden ** 0.5) * x

    def _heads(self, z_H: jax.Array) -> Tuple[jax.Array, jax.Array, jax.Array]:
        """logits [B, L, V] (prefix dropped) and (q_halt, q_continue) [B], all float32.

        Both heads run in the forward dtype and are cast to float32 afterwards, as in the
        reference.
        """
        cfg, dt = self.cfg, self.dtype
        lm = self.param("lm_head", nn.with_logical_partitioning(lecun_init(cfg.hidden), ("embed", "vocab")),
                        (cfg.hidden, self.vocab_size))
        qk = self.param("q_head_kernel", nn.with_logical_partitioning(nn.initializers.zeros, ("embed", None)),
                        (cfg.hidden, 2))
        qb = self.param("q_head_bias", nn.with_logical_partitioning(nn.initializers.constant(-5.0), (None,)), (2,))
        logits = jnp.einsum("bld,dv->blv", z_H[:, self.prefix:], lm.astype(dt)).astype(jnp.float32)
        q = (z_H[:, 0] @ qk.astype(dt) + qb.astype(dt)).astype(jnp.float32)
        return logits, q[..., 0], q[..., 1]

    def _net_params(self, name: str, net: ReasoningNet, probe: Tuple[jax.Array, jax.Array], cos_sin,
                    mask=None) -> Any:
        """Create the named network's parameters (init only) and return them as a subtree."""
        if self.is_initializing() and name not in self.variables.get("params", {}):
            net.clone(parent=self, name=name)(*probe, cos_sin, mask)
        return self.variables["params"][name]

    @nn.nowrap
    def attention_mask(self) -> Optional[np.ndarray]:
        """`local_global_mask` for ``cfg.attention_window`` (None when unset), validated."""
        cfg = self.cfg
        window = getattr(cfg, "attention_window", None)
        if window is None:
            return None
        if getattr(cfg, "mlp_t", False):
            raise ValueError("attention_window needs the attention variant; set mlp_t=False")
        if not isinstance(window, int) or window < 1 or window % 2 == 0:
            raise ValueError(f"attention_window must be a positive odd int, got {window!r}")
        width = getattr(cfg, "grid_width", None)
        if width is None:
            side = math.isqrt(self.seq_len)
            if side * side != self.seq_len:
                raise ValueError(f"seq_len {self.seq_len} is not a perfect square; set grid_width for attention_window")
            width = side
        if width < 1 or self.seq_len % width:
            raise ValueError(f"grid_width {width} does not divide seq_len {self.seq_len}")
        return local_global_mask(self.prefix, self.seq_len // width, width, window)

    @nn.nowrap
    def _net_def(self, layers: int) -> ReasoningNet:
        cfg = self.cfg
        return ReasoningNet(layers=layers, hidden=cfg.hidden, heads=cfg.heads, expansion=cfg.expansion,
                            total_len=self.total_len, mlp_t=getattr(cfg, "mlp_t", False), dtype=self.dtype,
                            attention=getattr(cfg, "attention", "xla"), recompute_mlp=getattr(cfg, "recompute_mlp", False),
                            mixer=getattr(cfg, "mixer", "xla"), parent=None)


class TRM(RecursiveIO):
    """Inner TRM. ``apply({'params': p}, batch, carry) -> (new_carry, logits, q_halt, q_continue)``.

    `batch` needs ``inputs`` [B, L] and ``puzzle_identifiers`` [B]; `carry=None` starts from
    (H_init, L_init). The returned carry is detached. With ``cfg.cycle_consistency_weight > 0``
    the per-row ``cycle_delta`` [B] (float32) is sown into the ``"intermediates"`` collection
    (read it with ``apply(..., mutable=["intermediates"])``; see ``act.act_step``).
    """

    cfg: TRMConfig
    vocab_size: int
    seq_len: int
    num_puzzle_identifiers: int = 1
    # (H_init, L_init) as tuples of floats (hashable), e.g. imported from a reference checkpoint;
    # None = the fixed vectors of `initial_states`.
    init_states: Any = None

    @nn.compact
    def __call__(self, batch: Mapping[str, jax.Array], carry: InnerCarry | None = None):
        cfg = self.cfg
        x = self._input_embeddings(batch["inputs"], batch["puzzle_identifiers"])
        if carry is None:
            carry = self.initial_carry(x.shape[0])
        cos_sin = self._cos_sin()
        mask = self.attention_mask()  # numpy: a constant of every trace (the splash kernel is built from it)
        net_def = self._net_def(cfg.L_layers)
        params = self._net_params("L_level", net_def, (carry.z_L, carry.z_H + x), cos_sin, mask)
        if self.is_initializing():  # parameters exist now; skip the recursion (cheaper init compile)
            return (carry, *self._heads(carry.z_H))
        net = make_net_fn(net_def, cos_sin, mask)
        net_grad = make_net_fn(net_def, cos_sin, mask, remat=getattr(cfg, "remat", False))

        def cycle(p, inp, z, f):
            z_H, z_L = z
            inj = z_H + inp
            z_L = repeat(lambda zl: f(p, zl, inj), cfg.L_cycles, z_L)
            z_H = f(p, z_H, z_L)
            return z_H, z_L

        z = (carry.z_H, carry.z_L)
        if cfg.H_cycles > 1:  # no-gradient cycles: parameters, input and carry all stop-gradient
            p_ng, x_ng = stop_gradient_tree(params), jax.lax.stop_gradient(x)
            z = stop_gradient_tree(repeat(lambda zz: cycle(p_ng, x_ng, zz, net), cfg.H_cycles - 1, stop_gradient_tree(z)))
        z_H, z_L = cycle(params, x, z, net_grad)  # the one cycle with gradient
        if getattr(cfg, "cycle_consistency_weight", 0.0) > 0:
            # per row: mean squared change of z_H over the cycle with gradient (none into z_H before)
            before = jax.lax.stop_gradient(z[0]).astype(jnp.float32)
            self.sow("intermediates", "cycle_delta", jnp.mean(jnp.square(z_H.astype(jnp.float32) - before), axis=(1, 2)))

        logits, q_halt, q_continue = self._heads(z_H)
        new_carry = InnerCarry(z_H=jax.lax.stop_gradient(z_H), z_L=jax.lax.stop_gradient(z_L))
        return new_carry, logits, q_halt, q_continue


def dummy_batch(batch_size: int, seq_len: int) -> dict[str, jax.Array]:
    """An all-zero batch with the shapes/dtypes the models expect (for init and lowering)."""
    return {"inputs": jnp.zeros((batch_size, seq_len), jnp.int32),
            "labels": jnp.zeros((batch_size, seq_len), jnp.int32),
            "puzzle_identifiers": jnp.zeros((batch_size,), jnp.int32)}
