"""Adaptive computation time (ACT) wrapper shared by TRM and HRM, as pure functions.

One call of `act_step` is one ACT step (one optimizer step in training: deep supervision):

1. rows that halted last call are reset: inner carry -> (H_init, L_init), steps -> 0, and
   their data replaced by the new batch's row (non-halted rows keep their old data);
2. one inner step runs (``model.apply``);
3. ``steps += 1``; ``halted = steps >= halt_max_steps``; in training only (and when
   ``halt_max_steps > 1``): ``halted |= q_halt > 0`` (``no_ACT_continue``) or
   ``q_halt > q_continue``; with probability ``halt_exploration_prob`` (or the traced
   ``exploration_prob`` argument, e.g. an annealed schedule's value) a row draws
   ``min_halt ~ U{2..halt_max_steps}`` and ``halted &= steps >= min_halt``;
4. training with Q-continue (HRM, or TRM with ``no_ACT_continue=False``): a second inner
   call without gradient on the new carry gives the bootstrapped target
   ``sigmoid(last step ? q_halt' : max(q_halt', q_continue'))``.

Evaluation (``training=False``) always runs exactly ``halt_max_steps`` steps per row.

`model` is an inner model (``trm.TRM`` or ``hrm.HRM``); `params` is its ``'params'``
collection (boxed or not). The carry persists across batches; start from `initial_carry`.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Mapping

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from models.recursive_reasoning.layers import stop_gradient_tree
from models.recursive_reasoning.trm import InnerCarry, dummy_batch


@flax.struct.dataclass
class ACTCarry:
    inner: InnerCarry  # z_H, z_L [B, prefix + L, hidden] in the forward dtype
    steps: jax.Array  # int32 [B]
    halted: jax.Array  # bool [B]
    current_data: dict  # the batch rows each carry row is working on (same keys as the batch)


def initial_carry(model: nn.Module, batch: Mapping[str, jax.Array]) -> ACTCarry:
    """All rows halted, so the first `act_step` loads every row of its batch."""
    b = batch["inputs"].shape[0]
    return ACTCarry(inner=model.initial_carry(b), steps=jnp.zeros((b,), jnp.int32),
                    halted=jnp.ones((b,), jnp.bool_),
                    current_data={k: jnp.zeros_like(v) for k, v in batch.items()})


def init_params(model: nn.Module, rng: jax.Array, batch: Mapping[str, jax.Array]) -> Any:
    """The model's boxed ``'params'`` (logical axis names attached)."""
    return model.init(rng, dict(batch))["params"]


def act_step(model: nn.Module, params: Any, carry: ACTCarry, batch: Mapping[str, jax.Array], rng: jax.Array | None,
             training: bool, exploration_prob: jax.Array | float | None = None) -> tuple[ACTCarry, dict[str, jax.Array]]:
    """One ACT step. Returns (new_carry, outputs).

    outputs: ``logits`` [B, L, V] f32, ``q_halt_logits`` / ``q_continue_logits`` [B] f32, in
    training with Q-continue ``target_q_continue`` [B] f32 (no gradient), and with
    ``cfg.cycle_consistency_weight > 0`` the inner model's ``cycle_delta`` [B] f32. The loss
    reads its labels from ``new_carry.current_data`` and its halting mask from ``new_carry.halted``.
    `training` must be a Python bool; `rng` is only used when training with exploration.
    `exploration_prob` (a scalar, may be traced) overrides ``cfg.halt_exploration_prob``; when
    given, exploration is applied (and `rng` needed) even if the config's value is 0.
    """
    cfg = model.cfg
    halted = carry.halted
    inner = model.reset_carry(halted, carry.inner)
    steps = jnp.where(halted, 0, carry.steps)
    data = {k: jnp.where(halted.reshape((-1,) + (1,) * (batch[k].ndim - 1)), batch[k], carry.current_data[k])
            for k in carry.current_data}

    if getattr(cfg, "cycle_consistency_weight", 0.0) > 0:
        (inner, logits, q_halt, q_continue), state = model.apply({"params": params}, data, inner,
                                                                 mutable=["intermediates"])
        cycle_delta = state["intermediates"]["cycle_delta"][0]
    else:
        inner, logits, q_halt, q_continue = model.apply({"params": params}, data, inner)
        cycle_delta = None
    outputs = {"logits": logits, "q_halt_logits": q_halt, "q_continue_logits": q_continue}
    if cycle_delta is not None:
        outputs["cycle_delta"] = cycle_delta

    steps = steps + 1
    is_last = steps >= cfg.halt_max_steps
    new_halted = is_last
    if training and cfg.halt_max_steps > 1:
        qh, qc = jax.lax.stop_gradient(q_halt), jax.lax.stop_gradient(q_continue)
        new_halted = new_halted | ((qh > 0) if cfg.no_ACT_continue else (qh > qc))
        prob = cfg.halt_exploration_prob if exploration_prob is None else exploration_prob
        if exploration_prob is not None or cfg.halt_exploration_prob > 0:
            if rng is None:
                raise ValueError("act_step needs an rng in training when halt_exploration_prob > 0")
            k_explore, k_min = jax.random.split(rng)
            explore = jax.random.uniform(k_explore, steps.shape) < prob
            min_halt = jnp.where(explore, jax.random.randint(k_min, steps.shape, 2, cfg.halt_max_steps + 1), 0)
            new_halted = new_halted & (steps >= min_halt)
        if not cfg.no_ACT_continue:
            # Bootstrapped Q target from one more inner step (no replay buffer / target network).
            _, _, nqh, nqc = model.apply({"params": stop_gradient_tree(params)}, data, inner)
            target = jnp.where(is_last, nqh, jnp.maximum(nqh, nqc))
            outputs["target_q_continue"] = jax.lax.stop_gradient(jax.nn.sigmoid(target))

    return ACTCarry(inner=inner, steps=steps, halted=new_halted, current_data=data), outputs


def act_evaluate(model: nn.Module, params: Any, batch: Mapping[str, jax.Array]) -> tuple[ACTCarry, dict[str, jax.Array]]:
    """Evaluation of one batch: exactly ``halt_max_steps`` ACT steps from a fresh carry (a loop,
    traced once); returns the final carry (every row halted) and the last step's outputs."""
    carry = initial_carry(model, batch)
    n = model.cfg.halt_max_steps
    if n > 1:
        carry, _ = jax.lax.scan(lambda c, _: (act_step(model, params, c, batch, None, False)[0], None), carry, None,
                                length=n - 1)
    return act_step(model, params, carry, batch, None, False)


def make_act_step(model: nn.Module) -> Callable:
    """``(params, carry, batch, rng, training) -> (new_carry, outputs)`` bound to `model`."""
    return functools.partial(act_step, model)


def compile_seconds(model: nn.Module, batch_size: int, training: bool = True, grad: bool = True,
                    compile: bool = True) -> dict[str, float]:
    """Seconds to trace+lower and to compile one (value-and-grad of a stand-in loss of) ACT step.

    A diagnostic for the claim that compile time is flat in H_cycles x L_cycles (the cycles are
    loops traced once). Also reports the lowered program's size in lines, a noise-free proxy.
    Nothing is executed.
    """
    batch = dummy_batch(batch_size, model.seq_len)
    params = jax.eval_shape(lambda: nn.meta.unbox(init_params(model, jax.random.key(0), batch)))
    carry = jax.eval_shape(lambda: initial_carry(model, batch))

    def fn(p, c, b, r):
        def loss(pp):
            new_c, out = act_step(model, pp, c, b, r, training)
            return out["logits"].astype(jnp.float32).mean() + out["q_halt_logits"].mean(), new_c
        if grad:
            return jax.value_and_grad(loss, has_aux=True)(p)
        return loss(p)

    t0 = time.perf_counter()
    lowered = jax.jit(fn).lower(params, carry, batch, jax.random.key(1))
    t1 = time.perf_counter()
    if compile:
        lowered.compile()
    t2 = time.perf_counter()
    return {"lower_s": t1 - t0, "compile_s": t2 - t1, "stablehlo_lines": lowered.as_text().count("\n")}
