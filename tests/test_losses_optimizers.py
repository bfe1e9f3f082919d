"""Stablemax/softmax CE and the ACT loss; AdamATan2, sign-SGD, Lion, EMA — against hand values."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from models.recursive_reasoning.losses import (act_loss, log_stablemax, softmax_cross_entropy, stablemax_cross_entropy,
                                               stablemax_s, summarize)
from runtime.optimizers import (adam_atan2, ema_init, ema_update, lion, param_labels, recursive_optimizer,
                                scatter_row_grads, sign_sgd_rows, sparse_sign_sgd, with_ema)

# ------------------------------------------------------------------ stablemax


def test_stablemax_values():
    x = jnp.array([1.0, 0.0, -1.0, -3.0])
    np.testing.assert_allclose(stablemax_s(x), [2.0, 1.0, 0.5, 0.25])
    total = 2 + 1 + 0.5 + 0.25
    np.testing.assert_allclose(log_stablemax(x), np.log(np.array([2, 1, 0.5, 0.25]) / total), rtol=1e-6)
    ce = stablemax_cross_entropy(x[None, None], jnp.array([[2]]))
    np.testing.assert_allclose(ce, [[-math.log(0.5 / total)]], rtol=1e-6)


def _stablemax_grad_by_hand(x, y):
    xn = np.minimum(x, 0)
    s = np.where(x < 0, 1 / (1 - xn), x + 1)
    ds = np.where(x < 0, 1 / (1 - xn) ** 2, 1.0)
    g = ds / s.sum()
    g[y] -= ds[y] / s[y]
    return g


@pytest.mark.parametrize("label", [0, 1])
def test_stablemax_gradient_finite_at_logit_one(label):
    """x = 1.0 exactly: the unselected branch 1/(1-x) would be inf -> NaN gradient unguarded."""
    x = np.array([1.0, -2.0, 0.5, 0.0], np.float32)
    g = jax.grad(lambda z: stablemax_cross_entropy(z[None], jnp.array([label])).sum())(jnp.asarray(x))
    assert bool(jnp.isfinite(g).all())
    np.testing.assert_allclose(g, _stablemax_grad_by_hand(x.astype(np.float64), label), rtol=1e-5, atol=1e-7)

    # the trap the guard avoids: a single where (the reference's form, eps 1e-30) in float32
    def naive(z):
        s = jnp.where(z < 0, 1 / (1 - z + 1e-30), z + 1)
        return -jnp.log(s[label] / s.sum())

    assert not bool(jnp.isfinite(jax.grad(naive)(jnp.asarray(x))).all())


def test_cross_entropies_ignore_labels_and_softmax_matches_optax():
    logits = jax.random.normal(jax.random.key(0), (2, 3, 5)) * 3
    labels = jnp.array([[1, -100, 4], [0, 2, -100]])
    sm = jax.jit(softmax_cross_entropy)(logits, labels)
    want = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(labels, 0))
    np.testing.assert_allclose(sm, jnp.where(labels == -100, 0.0, want), rtol=1e-6)
    st = jax.jit(stablemax_cross_entropy)(logits, labels)
    assert st[0, 1] == 0 and st[1, 2] == 0 and bool((st[labels != -100] > 0).all())


def test_float64_precision_requires_x64():
    if not jax.config.jax_enable_x64:
        with pytest.raises(ValueError, match="x64"):
            stablemax_cross_entropy(jnp.zeros((1, 3)), jnp.array([0]), precision="float64")


# ------------------------------------------------------------------ ACT loss


def test_act_loss_reductions_and_metrics():
    v = 3
    # row 0: labels [0, 1, -100], predicted [0, 1, x] -> exactly correct
    # row 1: labels [2, 2, 2], predicted [2, 0, 2] -> 2/3 tokens
    # row 2: all ignored -> counts 0 -> excluded from metrics; seq "correct" (0 == 0) as in the reference
    # row 3: labels [1, -100, -100], predicted [1] -> correct but NOT halted -> excluded from metrics
    big = 4.0
    preds = np.array([[0, 1, 2], [2, 0, 2], [0, 0, 0], [1, 0, 0]])
    logits = jax.nn.one_hot(preds, v) * big
    labels = jnp.array([[0, 1, -100], [2, 2, 2], [-100, -100, -100], [1, -100, -100]])
    halted = jnp.array([True, True, True, False])
    steps = jnp.array([3, 5, 7, 2])
    q_halt = jnp.array([1.0, 2.0, -1.0, 0.5])
    out = {"logits": logits, "q_halt_logits": q_halt, "q_continue_logits": jnp.zeros(4)}
    total, m = jax.jit(act_loss)(out, labels, halted, steps)

    tok = np.asarray(jax.jit(stablemax_cross_entropy)(logits, labels))
    counts = np.array([2, 3, 0, 1])
    lm = (tok.sum(-1) / np.maximum(counts, 1)).sum()
    seq_correct = np.array([1.0, 0.0, 1.0, 1.0])
    qh = np.asarray(q_halt)
    bce = np.maximum(qh, 0) - qh * seq_correct + np.log1p(np.exp(-np.abs(qh)))
    np.testing.assert_allclose(m["lm_loss"], lm, rtol=1e-6)
    np.testing.assert_allclose(m["q_halt_loss"], bce.sum(), rtol=1e-6)
    np.testing.assert_allclose(total, lm + 0.5 * bce.sum(), rtol=1e-6)
    assert int(m["count"]) == 2  # rows 0 and 1
    np.testing.assert_allclose(m["accuracy"], 1.0 + 2 / 3, rtol=1e-6)
    assert int(m["exact_accuracy"]) == 1
    assert int(m["q_halt_accuracy"]) == 1  # row 0: q>=0 & correct; row 1: q>=0 but wrong
    assert int(m["steps"]) == 8
    assert float(m["q_continue_loss"]) == 0.0

    # with a bootstrapped target the Q-continue BCE is added with weight 0.5
    target = jnp.array([0.2, 0.9, 0.5, 0.1])
    total2, m2 = jax.jit(act_loss)(out | {"target_q_continue": target}, labels, halted, steps)
    qc = -(np.asarray(target) * np.log(0.5) + (1 - np.asarray(target)) * np.log(0.5)).sum()
    np.testing.assert_allclose(m2["q_continue_loss"], qc, rtol=1e-6)
    np.testing.assert_allclose(total2, total + 0.5 * qc, rtol=1e-6)

    s = summarize(m, global_batch=4)
    np.testing.assert_allclose(s["lm_loss"], lm / 4, rtol=1e-6)
    np.testing.assert_allclose(s["accuracy"], (1 + 2 / 3) / 2, rtol=1e-6)
    np.testing.assert_allclose(s["steps"], 4.0)


def test_act_loss_gradient_finite_with_logit_one():
    logits = jnp.array([[[1.0, 0.0, -1.0], [1.0, 1.0, 1.0]]])
    out = {"logits": logits, "q_halt_logits": jnp.array([0.0]), "q_continue_logits": jnp.array([0.0])}
    g = jax.jit(jax.grad(lambda o: act_loss(o, jnp.array([[1, 2]]), jnp.array([True]), jnp.array([1]))[0]))(out)
    assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(g))


# ------------------------------------------------------------------ AdamATan2


def _adam_atan2_numpy(p, grads, lr, b1, b2, wd):
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        p = p * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr / (1 - b1 ** t) * np.arctan2(m, np.sqrt(v) / np.sqrt(1 - b2 ** t))
    return p, m, v


def test_adam_atan2_one_and_two_steps():
    lr, b1, b2, wd = 1e-2, 0.9, 0.95, 0.1
    p0 = np.array([[0.5, -1.0, 0.0], [2.0, 0.1, -0.3]])
    g1 = np.array([[0.1, -0.2, 0.0], [1e-4, 3.0, -0.5]])
    g2 = np.array([[-0.3, -0.2, 0.7], [1e-4, -3.0, 0.0]])
    tx = adam_atan2(lr, b1=b1, b2=b2, weight_decay=wd)
    params = {"w": jnp.asarray(p0, jnp.float32), "b": jnp.asarray(p0[0], jnp.float32)}
    state = tx.init(params)
    # step 1 by hand: m = (1-b1) g, v = (1-b2) g^2, so sqrt(v)/sqrt(1-b2) = |g| and
    # p1 = p0 (1 - lr wd) - lr/(1-b1) * atan2((1-b1) g, |g|) = p0 (1 - lr wd) - 10 lr * atan(0.1 sign g)
    # (m is bias-corrected in the step size, outside the atan2, as in the reference kernel)
    upd, state = tx.update({"w": jnp.asarray(g1, jnp.float32), "b": jnp.asarray(g1[0], jnp.float32)}, state, params)
    params = optax.apply_updates(params, upd)
    hand = p0 * (1 - lr * wd) - 10 * lr * np.arctan(0.1 * np.sign(g1))
    np.testing.assert_allclose(params["w"], hand, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(params["w"], _adam_atan2_numpy(p0, [g1], lr, b1, b2, wd)[0], rtol=1e-6, atol=1e-7)
    upd, state = tx.update({"w": jnp.asarray(g2, jnp.float32), "b": jnp.asarray(g2[0], jnp.float32)}, state, params)
    params = optax.apply_updates(params, upd)
    want, m, v = _adam_atan2_numpy(p0, [g1, g2], lr, b1, b2, wd)
    np.testing.assert_allclose(params["w"], want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(params["b"], want[0], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(state.mu["w"], m, rtol=1e-6)
    np.testing.assert_allclose(state.nu["w"], v, rtol=1e-6)
    assert int(state.count) == 2


def test_adam_atan2_schedule_and_jit():
    sched = lambda count: 1e-3 * (count + 1)  # noqa: E731  lr(count) with count = updates done so far
    tx = adam_atan2(sched, weight_decay=0.0)
    p = {"w": jnp.ones(3)}
    st = tx.init(p)
    upd, st = jax.jit(tx.update)({"w": jnp.array([1.0, -1.0, 0.0])}, st, p)
    step1 = 1e-3 / 0.1 * math.atan(0.1)  # lr(0) / (1 - b1) * atan2(0.1 g, |g|)
    np.testing.assert_allclose(upd["w"], [-step1, step1, 0.0], rtol=1e-5)
    upd, st = jax.jit(tx.update)({"w": jnp.array([1.0, -1.0, 0.0])}, st, p)
    step2 = 2e-3 / 0.19 * math.atan(0.19)  # lr(1) / (1 - b1^2) * atan2(0.19 g, |g|)
    np.testing.assert_allclose(upd["w"], [-step2, step2, 0.0], rtol=1e-5)


# ------------------------------------------------------------------ sign-SGD


def test_sign_sgd_only_touched_rows_and_duplicate_ids_summed():
    lr, wd = 0.1, 0.5
    table = jnp.arange(12, dtype=jnp.float32).reshape(6, 2) - 5.0
    ids = jnp.array([1, 3, 1, 4])
    row_grads = jnp.array([[1.0, -2.0], [0.0, 0.5], [-3.0, 1.0], [0.0, 0.0]])
    grad = scatter_row_grads(6, ids, row_grads)
    np.testing.assert_allclose(grad[1], [-2.0, -1.0])  # 1 + (-3), -2 + 1: summed, not sign-summed
    new = sign_sgd_rows(table, grad, ids, lr, wd)
    t = np.asarray(table)
    want = t.copy()
    for r in (1, 3, 4):
        want[r] = t[r] * (1 - lr * wd) - lr * np.sign(np.asarray(grad)[r])
    np.testing.assert_allclose(new, want, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(new)[[0, 2, 5]], t[[0, 2, 5]])  # untouched: no step, no decay
    np.testing.assert_allclose(new[4], t[4] * (1 - lr * wd))  # touched with zero gradient: decay only

    # the dense gradient of a gather (what the model produces) sums repeated ids over the batch
    g = jax.grad(lambda tb: (jnp.take(tb, ids, axis=0) * row_grads).sum())(table)
    np.testing.assert_allclose(g, grad)

    # as an optax transformation (via apply_updates)
    tx = sparse_sign_sgd(lr, wd)
    upd, _ = tx.update({"puzzle_emb": grad}, tx.init(None), {"puzzle_emb": table}, puzzle_identifiers=ids)
    np.testing.assert_allclose(optax.apply_updates({"puzzle_emb": table}, upd)["puzzle_emb"], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(upd["puzzle_emb"])[[0, 2, 5]], 0.0)


def test_sign_sgd_on_row_sharded_table():
    """The table sharded over rows by the runtime's rules ("puzzle" -> data x fsdp) stays sharded."""
    import flax.linen as nn

    from runtime.sharding import logical_shardings, make_mesh

    n = len(jax.devices())
    assert n >= 2, "conftest gives the session 8 CPU devices"
    mesh = make_mesh({"data": n, "fsdp": 1, "tensor": 1})
    rows = 4 * n
    host_table = jnp.arange(rows * 3, dtype=jnp.float32).reshape(rows, 3)
    sharding = logical_shardings(nn.LogicallyPartitioned(host_table, ("puzzle", "embed")), mesh)
    assert sharding.spec[0] is not None  # really split over rows
    table = jax.device_put(host_table, sharding)
    ids = jnp.array([0, rows - 1, 2, 2])
    row_grads = jnp.array([[1.0, -1.0, 0.0], [2.0, 2.0, 2.0], [-1.0, 0.5, 0.0], [-1.0, 0.5, 0.0]])
    want = sign_sgd_rows(host_table, scatter_row_grads(rows, ids, row_grads), ids, 0.1, 1.0)

    @jax.jit
    def step(tb, i, rg):
        return sign_sgd_rows(tb, scatter_row_grads(rows, i, rg), i, 0.1, 1.0)

    out = step(table, ids, row_grads)
    np.testing.assert_allclose(out, want, rtol=1e-6)
    assert out.sharding.is_equivalent_to(table.sharding, 2)


# ------------------------------------------------------------------ combined optimizer, Lion, EMA


def _toy_params():
    return {"puzzle_emb": jnp.ones((5, 2)), "dense": {"w": jnp.ones((2, 2))}}


def test_recursive_optimizer_partitions_table_and_rest():
    params = _toy_params()
    assert param_labels(params) == {"puzzle_emb": "puzzle_emb", "dense": {"w": "main"}}
    tx = recursive_optimizer(adam_atan2(0.01, weight_decay=0.0), puzzle_lr=0.1, puzzle_weight_decay=0.0)
    state = tx.init(params)
    grads = {"puzzle_emb": jnp.full((5, 2), -1.0), "dense": {"w": jnp.full((2, 2), 2.0)}}
    upd, state = jax.jit(lambda g, s, p, i: tx.update(g, s, p, puzzle_identifiers=i))(grads, state, params,
                                                                                     jnp.array([0, 3]))
    new = optax.apply_updates(params, upd)
    np.testing.assert_allclose(np.asarray(new["puzzle_emb"])[[0, 3]], 1.1, rtol=1e-6)  # sign-SGD, lr 0.1
    np.testing.assert_array_equal(np.asarray(new["puzzle_emb"])[[1, 2, 4]], 1.0)
    np.testing.assert_allclose(new["dense"]["w"], 1 - 0.1 * math.atan(0.1), rtol=1e-6)  # AdamATan2 step 1


def test_optimizers_keep_logical_boxes():
    """Optimizer state is built from boxed params (eval_shape), so it can be sharded like them."""
    import flax.linen as nn

    boxed = {"puzzle_emb": nn.LogicallyPartitioned(jnp.ones((5, 2)), ("puzzle", "embed")),
             "dense": {"w": nn.LogicallyPartitioned(jnp.ones((2, 2)), ("embed", "mlp"))}}
    tx = recursive_optimizer(adam_atan2(0.01), puzzle_lr=0.1, puzzle_weight_decay=0.1)
    state = jax.eval_shape(tx.init, boxed)
    boxes = [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
             if isinstance(x, nn.LogicallyPartitioned)]
    assert [b.names for b in boxes] == [("embed", "mlp"), ("embed", "mlp")]  # mu, nu of dense/w only
    from runtime.sharding import logical_shardings, make_mesh

    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    shardings = logical_shardings(state, mesh)  # every leaf maps (masked-out parts have no leaves)
    assert len(jax.tree.leaves(shardings)) == len(jax.tree.leaves(nn.meta.unbox(state)))


def test_lion_wrapper():
    tx = lion(0.1, weight_decay=0.5)
    p = {"w": jnp.array([1.0, -2.0])}
    upd, _ = tx.update({"w": jnp.array([0.3, 0.2])}, tx.init(p), p)
    np.testing.assert_allclose(upd["w"], [-0.1 * (1 + 0.5 * 1.0), -0.1 * (1 + 0.5 * -2.0)], rtol=1e-6)


def test_ema_excludes_puzzle_table():
    params = _toy_params()
    ema = ema_init(params)
    assert "puzzle_emb" not in ema
    params2 = {"puzzle_emb": jnp.zeros((5, 2)), "dense": {"w": jnp.full((2, 2), 3.0)}}
    ema = ema_update(ema, params2, rate=0.9)
    np.testing.assert_allclose(ema["dense"]["w"], 0.9 * 1 + 0.1 * 3)
    merged = with_ema(params2, ema)
    np.testing.assert_array_equal(merged["puzzle_emb"], 0.0)  # live table
    np.testing.assert_allclose(merged["dense"]["w"], 1.2)
