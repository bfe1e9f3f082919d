"""Full fine-tuning optimizer options: Adafactor (small state, decoupled decay) and optimizer
state stored in bfloat16 (`with_state_dtype`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from runtime.optimizers import adafactor, with_state_dtype


def _params(seed=0):
    kw, kb = jax.random.split(jax.random.key(seed))
    return {"w": jax.random.normal(kw, (256, 128)), "b": jax.random.normal(kb, (8,))}


def _targets(params):
    return jax.tree.map(lambda p: 0.5 * jnp.ones_like(p), params)


def _quadratic(params, targets):
    return sum(jnp.sum((p - t) ** 2) for p, t in zip(jax.tree.leaves(params), jax.tree.leaves(targets)))


def _run(tx, params, steps):
    targets = _targets(params)
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        grads = jax.grad(_quadratic)(params, targets)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, updates

    history = []
    for _ in range(steps):
        params, state, updates = step(params, state)
        history.append(updates)
    return params, state, history


def _nbytes(tree, floating_only=False):
    leaves = [x for x in jax.tree.leaves(tree) if not floating_only or jnp.issubdtype(x.dtype, jnp.floating)]
    return sum(x.size * x.dtype.itemsize for x in leaves)


def test_adafactor_reduces_quadratic_with_small_state():
    params = _params()
    tx = adafactor(0.05)
    final, state, _ = _run(tx, params, 30)
    targets = _targets(params)
    assert float(_quadratic(final, targets)) < 0.1 * float(_quadratic(params, targets))
    # Factored second moments: far below Adam's two full copies of the parameters.
    assert _nbytes(state) < 0.05 * _nbytes(optax.adam(1e-3).init(params))


@pytest.mark.parametrize("schedule", [False, True])
def test_adafactor_decoupled_weight_decay(schedule):
    """Zero gradients: the update is exactly the decay -lr wd p."""
    lr, wd = 0.1, 0.5
    learning_rate = optax.constant_schedule(lr) if schedule else lr
    params = _params()
    tx = adafactor(learning_rate, weight_decay=wd)
    updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    for u, p in zip(jax.tree.leaves(updates), jax.tree.leaves(params)):
        np.testing.assert_allclose(u, -lr * wd * p, rtol=1e-6)


def test_state_dtype_bf16_adamw_matches_fp32():
    params = _params()
    ref = optax.adamw(1e-2, weight_decay=0.1)
    tx = with_state_dtype(optax.adamw(1e-2, weight_decay=0.1), jnp.bfloat16)

    init = tx.init(params)
    _, ref_state, ref_updates = _run(ref, params, 4)
    _, state, updates = _run(tx, params, 4)
    for st in (init, state):
        adam = st[0]  # ScaleByAdamState
        assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves((adam.mu, adam.nu)))
        assert adam.count.dtype == jnp.int32
    assert int(state[0].count) == 4
    # Updates stay in the parameters' dtype and agree with fp32 state to bf16 precision.
    for u, r in zip(jax.tree.leaves(updates), jax.tree.leaves(ref_updates)):
        assert u.dtype == jnp.float32
        np.testing.assert_allclose(u, r, rtol=2e-2, atol=1e-4)
    # Half the memory: every floating leaf halves; only the int32 count is unchanged.
    assert _nbytes(state, floating_only=True) * 2 == _nbytes(ref_state, floating_only=True)
    assert _nbytes(state) - 4 == (_nbytes(ref_state) - 4) // 2


def test_state_dtype_keeps_float_scalars_and_extra_args():
    """Injected hyperparameters (float scalars) keep full precision; extra args pass through."""
    params = _params()
    tx = with_state_dtype(optax.inject_hyperparams(optax.adam)(learning_rate=1e-3), jnp.bfloat16)
    state = tx.init(params)
    assert state.hyperparams["learning_rate"].dtype == jnp.float32
    assert state.inner_state[0].mu["w"].dtype == jnp.bfloat16
    _, state = tx.update(params, state, params, unused_extra=1)
    assert state.inner_state[0].nu["w"].dtype == jnp.bfloat16


def test_state_dtype_adafactor():
    params = _params()
    tx = with_state_dtype(adafactor(0.05, weight_decay=0.01), jnp.bfloat16)
    final, state, _ = _run(tx, params, 30)
    targets = _targets(params)
    assert float(_quadratic(final, targets)) < 0.1 * float(_quadratic(params, targets))
    assert all(x.dtype in (jnp.bfloat16, jnp.int32) for x in jax.tree.leaves(state) if x.ndim >= 1)


def test_state_dtype_keeps_logical_axis_boxes():
    """tx.init sees boxed params (runtime/train_step.py derives state shardings from the boxes)."""
    import flax.linen as nn

    boxed = {"w": nn.LogicallyPartitioned(jnp.ones((4, 8)), ("vocab", "embed"))}
    state = jax.eval_shape(with_state_dtype(optax.adam(1e-3), jnp.bfloat16).init, boxed)
    mu = state[0].mu["w"]
    assert isinstance(mu, nn.LogicallyPartitioned) and mu.names == ("vocab", "embed")
    assert mu.value.dtype == jnp.bfloat16


def test_config_selects_adafactor_and_bf16_state():
    """optim.name=adafactor / optim.state_dtype=bfloat16 reach the optimizer the train step uses."""
    from runtime.config import OptimConfig
    from runtime.train_step import lr_schedule, make_optimizer

    params = {"w": jnp.ones((256, 128), jnp.float32), "b": jnp.ones((128,), jnp.float32)}
    for name, dtype in (("adamw", "bfloat16"), ("adafactor", "float32"), ("adafactor", "bfloat16")):
        cfg = OptimConfig(name=name, state_dtype=dtype, lr=1e-2, warmup_steps=1)
        tx = make_optimizer(cfg, lr_schedule(cfg, 10, 1))
        state = tx.init(params)
        updates, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
        floats = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim > 0]
        assert floats and {x.dtype for x in floats} == {jnp.dtype(dtype)}, (name, dtype)
        assert all(bool(jnp.all(jnp.isfinite(u))) and float(jnp.abs(u).max()) > 0 for u in jax.tree.leaves(updates))
        if name == "adafactor":  # factored: no state of the weight matrix's full size
            assert max(x.size for x in floats) < params["w"].size


def test_every_registered_optimizer_is_what_the_train_step_builds():
    """make_optimizer builds each optim.name of the OPTIMIZERS registry (the list validation
    reads), with clipping in front; a name outside it is refused with the choices."""
    from runtime.config import OptimConfig
    from runtime.optimizers import OPTIMIZERS
    from runtime.train_step import lr_schedule, make_optimizer

    params = {"w": jnp.ones((4, 3), jnp.float32)}
    grads = {"w": jnp.full((4, 3), 100.0)}
    for name in OPTIMIZERS:
        cfg = OptimConfig(name=name, lr=1e-2, warmup_steps=1, grad_clip_norm=1.0)
        tx = make_optimizer(cfg, lr_schedule(cfg, 10, 1))
        state = tx.init(params)
        assert isinstance(state[0], optax.ClipByGlobalNormState), name
        updates, _ = tx.update(grads, state, params)
        assert 0 < float(jnp.abs(updates["w"]).max()) < 1, name
    with pytest.raises(ValueError, match=r"unknown optimizer 'sgd'; use one of \['adafactor', 'adam_atan2', 'adamw', 'lion'\]"):
        make_optimizer(OptimConfig(name="sgd"), lr_schedule(OptimConfig(), 10, 1))
