"""Hierarchical Reasoning Model (HRM), the TRM's predecessor, as an inner model for `act.py`.

Semantics follow the public reference (sapientinc/HRM, ``models/hrm/hrm_act_v1.py``): two
attention stacks, ``H_level`` and ``L_level``; one ACT step runs ``H_cycles`` cycles of
(``L_cycles`` L-updates, then one H-update) where everything is without gradient except the
final L-update and the final H-update ("one-step gradient"). Halting uses
``q_halt > q_continue`` and the Q-continue head is trained against a bootstrapped target
(computed in ``act.py`` by an extra no-gradient inner call).

Input embedding, heads, H_init/L_init and the carry are shared with TRM (``trm.RecursiveIO``);
the puzzle embedding takes ``ceil(puzzle_emb_ndim / hidden)`` prefix positions (1 by default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import flax.linen as nn
import jax

from models.recursive_reasoning.layers import make_net_fn, repeat, stop_gradient_tree
from models.recursive_reasoning.trm import InnerCarry, RecursiveIO
from runtime.frozen import Freezable


@dataclass
class HRMConfig(Freezable):
    """HRM arch config; defaults are the reference's ``hrm_v1`` arch."""

    name: str = "hrm"
    hidden: int = 512
    heads: int = 8
    expansion: float = 4.0
    H_layers: int = 4
    L_layers: int = 4
    H_cycles: int = 2
    L_cycles: int = 2
    halt_max_steps: int = 16
    halt_exploration_prob: float = 0.1
    puzzle_emb_ndim: int = 512
    pos_encodings: str = "rope"  # rope | learned | none (the reference rejects none)
    forward_dtype: str = "auto"  # as TRMConfig.forward_dtype
    rope_theta: float = 10000.0
    # HRM always halts on q_halt > q_continue and learns Q-continue; kept for the ACT wrapper.
    no_ACT_continue: bool = False
    loss_type: str = "stablemax_cross_entropy"  # | softmax_cross_entropy
    remat: bool = False  # jax.checkpoint the final (with-gradient) L- and H-updates, as TRMConfig.remat
    attention: str = "auto"  # as TRMConfig.attention
    recompute_mlp: bool = True  # as TRMConfig.recompute_mlp


class HRM(RecursiveIO):
    """Inner HRM. ``apply({'params': p}, batch, carry) -> (new_carry, logits, q_halt, q_continue)``."""

    cfg: HRMConfig
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
        h_def, l_def = self._net_def(cfg.H_layers), self._net_def(cfg.L_layers)
        p_H = self._net_params("H_level", h_def, (carry.z_H, carry.z_L), cos_sin)
        p_L = self._net_params("L_level", l_def, (carry.z_L, carry.z_H + x), cos_sin)
        if self.is_initializing():  # parameters exist now; skip the recursion (cheaper init compile)
            return (carry, *self._heads(carry.z_H))
        net_H, net_L = make_net_fn(h_def, cos_sin), make_net_fn(l_def, cos_sin)

        # Everything but the last L-update and the last H-update runs without gradient.
        pH_ng, pL_ng, x_ng = stop_gradient_tree(p_H), stop_gradient_tree(p_L), jax.lax.stop_gradient(x)

        def l_updates(z, n):
            z_H, z_L = z
            inj = z_H + x_ng
            return z_H, repeat(lambda zl: net_L(pL_ng, zl, inj), n, z_L)

        def full_cycle(z):
            z_H, z_L = l_updates(z, cfg.L_cycles)
            return net_H(pH_ng, z_H, z_L), z_L

        z = stop_gradient_tree((carry.z_H, carry.z_L))
        z = repeat(full_cycle, cfg.H_cycles - 1, z)
        z_H, z_L = stop_gradient_tree(l_updates(z, cfg.L_cycles - 1))

        # One-step gradient.
        if cfg.remat:
            net_H, net_L = make_net_fn(h_def, cos_sin, remat=True), make_net_fn(l_def, cos_sin, remat=True)
        z_L = net_L(p_L, z_L, z_H + x)
        z_H = net_H(p_H, z_H, z_L)

        logits, q_halt, q_continue = self._heads(z_H)
        new_carry = InnerCarry(z_H=jax.lax.stop_gradient(z_H), z_L=jax.lax.stop_gradient(z_L))
        return new_carry, logits, q_halt, q_continue
