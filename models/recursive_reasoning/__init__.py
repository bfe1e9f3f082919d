"""Recursive-reasoning models (TRM, HRM) in Flax linen, with a pure-function ACT wrapper.

    from models.recursive_reasoning import TRM, TRMConfig, act_step, initial_carry, act_loss

    model = TRM(TRMConfig(), vocab_size=11, seq_len=81, num_puzzle_identifiers=n)
    params = init_params(model, rng, batch)          # boxed: logical axis names attached
    carry = initial_carry(model, batch)              # every row halted -> loaded on first step
    carry, out = act_step(model, params, carry, batch, rng, training=True)
    total, sums = act_loss(out, carry.current_data["labels"], carry.halted, carry.steps)
"""

from models.recursive_reasoning.act import (ACTCarry, act_evaluate, act_step, compile_seconds, init_params, initial_carry,
                                           make_act_step)
from models.recursive_reasoning.hrm import HRM, HRMConfig
from models.recursive_reasoning.losses import act_loss, softmax_cross_entropy, stablemax_cross_entropy, summarize
from models.recursive_reasoning.trm import TRM, InnerCarry, TRMConfig, dummy_batch, initial_states

__all__ = [
    "ACTCarry", "HRM", "HRMConfig", "InnerCarry", "TRM", "TRMConfig", "act_evaluate", "act_loss", "act_step",
    "compile_seconds", "dummy_batch", "init_params", "initial_carry", "initial_states", "make_act_step",
    "softmax_cross_entropy", "stablemax_cross_entropy", "summarize",
]
