"""TRM / HRM / ACT: shapes, parameter counts, gradient structure, halting, layer maths.

Small configs (hidden 32-64, short sequences) on CPU; parameter counts at full size use
`jax.eval_shape` (nothing is allocated).
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.recursive_reasoning import (HRM, HRMConfig, TRM, InnerCarry, TRMConfig, act_evaluate, act_loss, act_step,
                                        compile_seconds, dummy_batch, init_params, initial_carry, initial_states)
from models.recursive_reasoning.layers import Block, apply_rope, count_params, rms_norm, rope_cos_sin, swiglu_width
from helpers import small_trm

VOCAB, SEQ, PUZZLES = 11, 9, 5


def small_hrm(**kw) -> HRMConfig:
    base = dict(hidden=32, heads=4, H_layers=1, L_layers=1, puzzle_emb_ndim=32, forward_dtype="float32",
                halt_max_steps=4)
    return HRMConfig(**(base | kw))


def make_batch(b=4, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    inputs = jax.random.randint(k1, (b, SEQ), 0, VOCAB)
    labels = jnp.where(jax.random.uniform(k2, (b, SEQ)) < 0.3, -100, jax.random.randint(k3, (b, SEQ), 1, VOCAB))
    return {"inputs": inputs, "labels": labels, "puzzle_identifiers": jnp.arange(b, dtype=jnp.int32) % PUZZLES}


_BUILT: dict = {}
_STEPS: dict = {}


def build(model_cls, cfg, batch, seed=0):
    """(model, unboxed params); the same config returns the same objects (shared jit caches)."""
    key = (model_cls.__name__, repr(cfg), batch["inputs"].shape, seed)
    if key not in _BUILT:
        model = model_cls(cfg, vocab_size=VOCAB, seq_len=SEQ, num_puzzle_identifiers=PUZZLES)
        init = jax.jit(lambda r: nn.meta.unbox(init_params(model, r, batch)))
        _BUILT[key] = model, init(jax.random.key(seed))
    return _BUILT[key]


def jit_step(model):
    """act_step bound to `model`, jitted (training is static), cached per model object."""
    if id(model) not in _STEPS:
        _STEPS[id(model)] = (model, jax.jit(functools.partial(act_step, model), static_argnames=("training",)))
    return _STEPS[id(model)][1]


def jit_apply(model):
    return jax.jit(lambda p, b, c: model.apply({"params": p}, b, c))


def set_q_bias(params, halt, cont):
    return params | {"q_head_bias": jnp.array([halt, cont], jnp.float32)}


# ------------------------------------------------------------------ parameter counts


def test_parameter_counts_match_reference():
    """Parameter counts at the reference's sizes (Sudoku: vocab 11, seq 81, one puzzle id).

    TRM.md quotes TRM-Att 6.83M, TRM-MLP (Sudoku) 5.03M, HRM 27.3M. Ours, counting every
    parameter except the puzzle-embedding table (a non-trained *buffer* in the reference, so
    not in its parameter count), are exactly the reference's:

    * TRM-MLP Sudoku 5,028,866 = 2 blocks x (mlp_t SwiGLU over L = 81 + 16 prefix = 97
      positions: width round(4*97*2/3)=259 -> 512: 97*2*512 + 512*97 = 148,992; channel SwiGLU
      512 -> 1536: 512*2*1536 + 1536*512 = 2,359,296) + embeddings 11*512 + lm_head 512*11
      + q_head 512*2+2.
    * TRM-Att 6,828,034: the token mixer is attention (qkv 512*1536 + out 512*512 = 1,048,576).
    * HRM 27,275,266: 8 attention blocks (4 H + 4 L) of 3,407,872 + the same 12,290 of I/O.
    There is no difference to explain; the small vocab/seq dependence (ARC: vocab 12) moves
    the counts by ~1k.
    """
    batch = dummy_batch(1, 81)

    def count(model):
        return count_params(jax.eval_shape(lambda: init_params(model, jax.random.key(0), batch)), exclude=("puzzle_emb",))

    trm_mlp = TRM(TRMConfig(), vocab_size=11, seq_len=81)  # defaults = Sudoku MLP-t run
    assert (trm_mlp.cfg.mlp_t, trm_mlp.cfg.pos_encodings, trm_mlp.cfg.H_cycles, trm_mlp.cfg.L_cycles) == (True, "none", 3, 6)
    assert count(trm_mlp) == 5_028_866
    assert count(TRM(TRMConfig(mlp_t=False, pos_encodings="rope"), vocab_size=11, seq_len=81)) == 6_828_034
    assert count(HRM(HRMConfig(), vocab_size=11, seq_len=81)) == 27_275_266
    assert round(5_028_866 / 1e6, 2) == 5.03 and round(6_828_034 / 1e6, 2) == 6.83 and round(27_275_266 / 1e6, 1) == 27.3


def test_swiglu_width():
    assert swiglu_width(512, 4) == 1536
    assert swiglu_width(97, 4) == 512  # mlp_t over 81 + 16 positions
    assert swiglu_width(64, 4) == 256


# ------------------------------------------------------------------ TRM shapes, init, variants


def test_trm_shapes_and_init():
    cfg = small_trm()
    batch = make_batch()
    model, params = build(TRM, cfg, batch)
    assert params["puzzle_emb"].shape == (PUZZLES, 32) and not params["puzzle_emb"].any()
    assert not params["q_head_kernel"].any()
    np.testing.assert_array_equal(params["q_head_bias"], [-5.0, -5.0])
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    carry, out = jit_step(model)(params, initial_carry(model, batch), batch, None, training=False)
    assert out["logits"].shape == (4, SEQ, VOCAB) and out["logits"].dtype == jnp.float32
    assert out["q_halt_logits"].shape == out["q_continue_logits"].shape == (4,)
    np.testing.assert_allclose(out["q_halt_logits"], -5.0)  # zero kernel, bias -5
    assert carry.inner.z_H.shape == carry.inner.z_L.shape == (4, 2 + SEQ, 32)
    assert "target_q_continue" not in out
    # the boxed params carry logical axis names
    boxed = jax.eval_shape(lambda: init_params(model, jax.random.key(0), batch))
    assert boxed["puzzle_emb"].names == ("puzzle", "embed")
    assert boxed["embed_tokens"].names == ("vocab", "embed")


def test_truncated_normal_init_std():
    """Reference trunc_normal_init_: truncated at 2 sigma, *actual* std = requested std."""
    model = TRM(TRMConfig(), vocab_size=2000, seq_len=4)
    params = jax.jit(lambda r: nn.meta.unbox(init_params(model, r, dummy_batch(1, 4))))(jax.random.key(0))
    emb = np.asarray(params["embed_tokens"])  # std 1/sqrt(512)
    std = 512 ** -0.5
    assert abs(emb.std() / std - 1) < 0.02
    assert np.abs(emb).max() <= 2 * std / 0.8796 + 1e-6
    w = np.asarray(params["L_level"]["block_0"]["mlp"]["down"])  # fan_in 1536
    assert abs(w.std() * 1536 ** 0.5 - 1) < 0.02
    h, l = initial_states(512, jnp.float32)
    assert abs(float(jnp.std(h)) - 1) < 0.15 and float(jnp.abs(h).max()) <= 2 / 0.8796 + 1e-6
    assert not jnp.allclose(h, l)


@pytest.mark.parametrize("pos,mlp_t,dtype", [("learned", True, "float32"), ("none", False, "float16")])
def test_trm_variants_run(pos, mlp_t, dtype):
    batch = make_batch()
    model, params = build(TRM, small_trm(pos_encodings=pos, mlp_t=mlp_t, forward_dtype=dtype), batch)
    assert ("pos_embed" in params) == (pos == "learned")
    carry, out = jit_step(model)(params, initial_carry(model, batch), batch, jax.random.key(1), training=True)
    assert carry.inner.z_H.dtype == jnp.dtype(dtype)
    assert all(bool(jnp.isfinite(v).all()) for v in out.values())
    assert "target_q_continue" not in out  # TRM default no_ACT_continue: no Q-continue target
    # (rope + attention: test_bf16_forward_with_fp32_params and the gradient test)


def test_bf16_forward_with_fp32_params():
    dtype = "bfloat16"
    batch = make_batch()
    model, params = build(TRM, small_trm(forward_dtype=dtype, mlp_t=False, pos_encodings="rope"), batch)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))

    def f(p):
        carry, out = act_step(model, p, initial_carry(model, batch), batch, None, False)
        return out["logits"].sum(), (carry, out)

    grads, (carry, out) = jax.jit(jax.grad(f, has_aux=True))(params)
    assert carry.inner.z_H.dtype == jnp.dtype(dtype)
    assert out["logits"].dtype == jnp.float32 and bool(jnp.isfinite(out["logits"]).all())
    assert all(g.dtype == jnp.float32 and bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))


# ------------------------------------------------------------------ gradient structure


def _loss(model, params, batch, carry):
    _, logits, q_halt, _ = model.apply({"params": params}, batch, carry)
    return (logits ** 2).mean() + q_halt.sum()


def test_trm_gradient_only_through_last_cycle():
    """H_cycles=3 from carry c == H_cycles=1 from c' = (2 cycles of c): same outputs and same
    parameter gradients, and no gradient reaches the incoming carry."""
    batch = make_batch()
    cfg3 = small_trm(mlp_t=False, pos_encodings="rope", H_cycles=3, L_cycles=2)
    model3, params = build(TRM, cfg3, batch)
    model2 = TRM(dataclasses.replace(cfg3, H_cycles=2), VOCAB, SEQ, PUZZLES)
    model1 = TRM(dataclasses.replace(cfg3, H_cycles=1), VOCAB, SEQ, PUZZLES)
    h, l = jax.random.normal(jax.random.key(3), (2, 4, 2 + SEQ, 32))
    c = InnerCarry(z_H=h, z_L=l)
    c_after2 = jit_apply(model2)(params, batch, c)[0]  # 2 full cycles

    def grads(model, cc):
        """loss, d loss/d params, d loss/d carry, d (returned carry)/d params."""
        loss, (gp, gc) = jax.value_and_grad(lambda p, c_: _loss(model, p, batch, c_), argnums=(0, 1))(params, cc)
        gout = jax.grad(lambda p: model.apply({"params": p}, batch, cc)[0].z_H.sum())(params)
        return loss, gp, gc, gout

    loss3, g3, gc3, gout = jax.jit(lambda cc: grads(model3, cc))(c)
    loss1, g1, gc1, _ = jax.jit(lambda cc: grads(model1, cc))(c_after2)
    for a, b in zip(jax.tree.leaves(g3), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=5e-5)
    np.testing.assert_allclose(loss3, loss1, rtol=1e-5)
    assert any(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(g1["L_level"]))
    # the incoming carry gets no gradient when H_cycles > 1 (it does with a single cycle)
    assert not any(bool(x.any()) for x in jax.tree.leaves(gc3))
    assert any(bool(x.any()) for x in jax.tree.leaves(gc1))
    # the returned carry is detached
    assert not any(bool(x.any()) for x in jax.tree.leaves(gout))


def test_hrm_one_step_gradient():
    """HRM(H=2, L=2) runs L L H L without gradient, then L H with. From carry c it must equal
    HRM(H=1, L=2) (L without, then L H with) from c' = HRM(H=1, L=2)'s carry of c (L L H):
    same gradients, so the gradient flows only through the final L-update and H-update."""
    batch = make_batch()
    cfg = small_hrm(H_cycles=2, L_cycles=2)
    model, params = build(HRM, cfg, batch)
    m_prefix = HRM(dataclasses.replace(cfg, H_cycles=1, L_cycles=2), VOCAB, SEQ, PUZZLES)
    m_last = m_prefix
    h, l = jax.random.normal(jax.random.key(3), (2, 4, 1 + SEQ, 32))
    c = InnerCarry(z_H=h, z_L=l)
    g, gc = jax.jit(jax.grad(lambda p, cc: _loss(model, p, batch, cc), argnums=(0, 1)))(params, c)

    @jax.jit
    def grad_last(p, cc):
        c_prefix = m_prefix.apply({"params": p}, batch, cc)[0]
        return jax.grad(lambda pp: _loss(m_last, pp, batch, c_prefix))(p)

    g_last = grad_last(params, c)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_last)):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=5e-5)
    assert any(bool(x.any()) for x in jax.tree.leaves(g["H_level"]))
    assert not any(bool(x.any()) for x in jax.tree.leaves(gc))


# ------------------------------------------------------------------ ACT


def test_act_reset_and_step_counting():
    b1, b2 = make_batch(seed=0), make_batch(seed=1)
    model, params = build(TRM, small_trm(), b1)
    step = jit_step(model)
    carry = initial_carry(model, b1)
    carry, _ = step(params, carry, b1, None, training=False)  # all halted at start -> all load b1
    np.testing.assert_array_equal(carry.steps, [1, 1, 1, 1])
    for k in b1:
        np.testing.assert_array_equal(carry.current_data[k], b1[k])

    halted = jnp.array([True, False, True, False])
    carry = carry.replace(halted=halted, steps=jnp.array([3, 2, 1, 1], jnp.int32))
    new, out = step(params, carry, b2, None, training=False)
    np.testing.assert_array_equal(new.steps, [1, 3, 1, 2])
    for k in b1:
        want = jnp.where(halted.reshape((-1,) + (1,) * (b1[k].ndim - 1)), b2[k], b1[k])
        np.testing.assert_array_equal(new.current_data[k], want)
    # halted rows restart from (H_init, L_init) on the new data; the others continue their carry
    fresh = jit_apply(model)(params, new.current_data, model.initial_carry(4))
    cont = jit_apply(model)(params, new.current_data, carry.inner)
    want_logits = jnp.where(halted[:, None, None], fresh[1], cont[1])
    np.testing.assert_allclose(out["logits"], want_logits, rtol=1e-5, atol=1e-5)


def test_act_eval_runs_exactly_max_steps():
    batch = make_batch()
    model, params = build(TRM, small_trm(halt_max_steps=4), batch)
    params = set_q_bias(params, 5.0, -5.0)  # q_halt > 0: training would halt at once; eval must not
    carry, run = initial_carry(model, batch), jit_step(model)
    for step in range(1, 5):
        carry, last_out = run(params, carry, batch, None, training=False)
        np.testing.assert_array_equal(carry.steps, step)
        assert bool(carry.halted.all()) == (step == 4)
    carry, _ = run(params, carry, batch, None, training=False)  # everything restarts
    np.testing.assert_array_equal(carry.steps, 1)
    # act_evaluate: the same halt_max_steps steps as one compiled loop
    ev_carry, ev_out = jax.jit(lambda p, b: act_evaluate(model, p, b))(params, batch)
    np.testing.assert_array_equal(ev_carry.steps, 4)
    assert bool(ev_carry.halted.all())
    np.testing.assert_allclose(ev_out["logits"], last_out["logits"], rtol=1e-5, atol=1e-5)


def _halting_steps(model, params, batch, rng, n_calls):
    carry, run = initial_carry(model, batch), jit_step(model)
    halts = []
    for i in range(n_calls):
        carry, _ = run(params, carry, batch, jax.random.fold_in(rng, i), training=True)
        halts.extend(np.asarray(carry.steps)[np.asarray(carry.halted)].tolist())
    return halts


def test_act_training_halting_and_exploration():
    batch = make_batch()
    # q_halt > 0 everywhere, no exploration: every row halts after one step (no_ACT_continue)
    model, params = build(TRM, small_trm(), batch)  # halt_max_steps 4
    halts = _halting_steps(model, set_q_bias(params, 5.0, -5.0), batch, jax.random.key(0), 3)
    assert set(halts) == {1} and len(halts) == 3 * 4
    # q_halt < 0: rows run to halt_max_steps
    halts = _halting_steps(model, params, batch, jax.random.key(0), 4)
    assert set(halts) == {4} and len(halts) == 4
    # exploration with probability 1: each row halts exactly at its min_halt ~ U{2..4}
    model_x, _ = build(TRM, small_trm(halt_exploration_prob=1.0), batch)
    halts = _halting_steps(model_x, set_q_bias(params, 5.0, -5.0), batch, jax.random.key(0), 12)
    assert set(halts) == {2, 3, 4}
    # eval ignores exploration and q
    carry, run = initial_carry(model_x, batch), jit_step(model_x)
    for _ in range(3):
        carry, _ = run(set_q_bias(params, 5.0, -5.0), carry, batch, jax.random.key(1), training=False)
        assert not bool(carry.halted.any())


def test_act_hrm_halting_and_bootstrap_target():
    batch = make_batch()
    model, params = build(HRM, small_hrm(halt_max_steps=3, halt_exploration_prob=0.0), batch)
    # q_halt (-1) > q_continue (-2): halts, even though q_halt < 0 (TRM's rule would not)
    run = jit_step(model)
    carry, out = run(set_q_bias(params, -1.0, -2.0), initial_carry(model, batch), batch, None, training=True)
    assert bool(carry.halted.all())
    carry, out = run(set_q_bias(params, -2.0, -1.0), initial_carry(model, batch), batch, None, training=True)
    assert not bool(carry.halted.any())
    # target = sigmoid(max(next q_halt, next q_continue)) from an extra inner step on the new carry
    _, _, nqh, nqc = jit_apply(model)(set_q_bias(params, -2.0, -1.0), carry.current_data, carry.inner)
    np.testing.assert_allclose(out["target_q_continue"], jax.nn.sigmoid(jnp.maximum(nqh, nqc)), rtol=1e-6)
    # last step: target = sigmoid(next q_halt)
    p = set_q_bias(params, -2.0, -1.0)
    for _ in range(2):
        carry, out = run(p, carry, batch, None, training=True)
    assert bool(carry.halted.all())
    np.testing.assert_allclose(out["target_q_continue"], jax.nn.sigmoid(-2.0), rtol=1e-4)
    total, sums = jax.jit(act_loss)(out, carry.current_data["labels"], carry.halted, carry.steps)
    assert float(sums["q_continue_loss"]) > 0 and bool(jnp.isfinite(total))


def test_act_step_jits_and_trains():
    batch = make_batch()
    model, params = build(TRM, small_trm(), batch)

    @jax.jit
    def step(p, c, r):
        def loss(pp):
            new, out = act_step(model, pp, c, batch, r, True)
            total, sums = act_loss(out, new.current_data["labels"], new.halted, new.steps)
            return total / batch["inputs"].shape[0], (new, sums)
        (l, (new, sums)), g = jax.value_and_grad(loss, has_aux=True)(p)
        return l, new, g

    l, new, g = step(params, initial_carry(model, batch), jax.random.key(0))
    assert bool(jnp.isfinite(l)) and all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(g))
    assert float(jnp.abs(g["puzzle_emb"]).sum()) > 0  # the table gets a (dense) gradient


# ------------------------------------------------------------------ layer maths


def test_rope_preserves_norms_and_is_relative():
    head_dim, length = 16, 12
    cos, sin = rope_cos_sin(length, head_dim, 10000.0)
    rope = jax.jit(apply_rope)
    x = jax.random.normal(jax.random.key(0), (2, length, 3, head_dim))
    y = rope(x, cos, sin)
    np.testing.assert_allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(y[:, 0], x[:, 0], rtol=1e-6)  # position 0 is unrotated
    # <R_m q, R_n k> depends only on m - n
    q, k = jax.random.normal(jax.random.key(1), (2, head_dim))
    rq = rope(jnp.broadcast_to(q, (1, length, 1, head_dim)), cos, sin)[0, :, 0]
    rk = rope(jnp.broadcast_to(k, (1, length, 1, head_dim)), cos, sin)[0, :, 0]
    np.testing.assert_allclose(rq[5] @ rk[2], rq[9] @ rk[6], rtol=1e-4)


def test_rms_norm_no_gain_fp32():
    x = (jax.random.normal(jax.random.key(0), (3, 7, 16)) * 5).astype(jnp.bfloat16)
    y = jax.jit(rms_norm)(x)
    assert y.dtype == jnp.bfloat16
    want = x.astype(jnp.float32) / jnp.sqrt((x.astype(jnp.float32) ** 2).mean(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(y.astype(jnp.float32), want, rtol=1e-2)


def _swiglu_ref(p, x):
    gu = jnp.einsum("...d,dgf->...gf", x, p["gate_up"])
    return (jax.nn.silu(gu[..., 0, :]) * gu[..., 1, :]) @ p["down"]


def _rms(x, axis):
    return x / jnp.sqrt((x ** 2).mean(axis, keepdims=True) + 1e-5)


def test_mlp_t_block_normalises_over_sequence_axis():
    b, length, d = 2, 7, 16
    blk = Block(hidden=d, heads=2, expansion=4, total_len=length, mlp_t=True, dtype=jnp.float32)
    h = jax.random.normal(jax.random.key(0), (b, length, d))
    p = jax.jit(lambda r: nn.meta.unbox(blk.init(r, h)["params"]))(jax.random.key(1))
    assert p["mlp_t"]["gate_up"].shape == (length, 2, 256)

    @jax.jit
    def manual(p, h):
        ht = jnp.swapaxes(h, 1, 2)
        h1 = jnp.swapaxes(_rms(ht + _swiglu_ref(p["mlp_t"], ht), axis=-1), 1, 2)  # over L on [B, D, L]
        return _rms(h1 + _swiglu_ref(p["mlp"], h1), axis=-1)

    got = jax.jit(lambda p, h: blk.apply({"params": p}, h))(p, h)
    np.testing.assert_allclose(got, manual(p, h), rtol=1e-4, atol=1e-5)


def test_attention_block_matches_manual():
    b, length, d, heads = 2, 6, 16, 2
    cs = rope_cos_sin(length, d // heads)
    blk = Block(hidden=d, heads=heads, expansion=2, total_len=length, mlp_t=False, dtype=jnp.float32)
    h = jax.random.normal(jax.random.key(0), (b, length, d))
    p = jax.jit(lambda r: nn.meta.unbox(blk.init(r, h, cs)["params"]))(jax.random.key(1))

    @jax.jit
    def manual(p, h):
        q, k, v = jnp.einsum("bld,dthk->tblhk", h, p["attn"]["qkv"])
        q, k = apply_rope(q, *cs), apply_rope(k, *cs)
        att = jax.nn.softmax(jnp.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(d // heads), -1)  # no causal mask
        y = jnp.einsum("blhk,hkd->bld", jnp.einsum("bhqs,bshk->bqhk", att, v), p["attn"]["out"])
        h1 = _rms(h + y, -1)
        return _rms(h1 + _swiglu_ref(p["mlp"], h1), -1)

    got = jax.jit(lambda p, h: blk.apply({"params": p}, h, cs))(p, h)
    np.testing.assert_allclose(got, manual(p, h), rtol=1e-4, atol=1e-5)
    assert set(p) == {"attn", "mlp"} and set(p["attn"]) == {"qkv", "out"}  # no biases, no norm gains


def test_compile_time_is_flat_in_cycles_report():
    """Diagnostic: the recursion is a loop traced once, so the lowered train step has the same
    size for L_cycles 2 and 12 (asserted) and flat compile time (`compile_seconds(...)`; the
    timings are not asserted and not compiled here, to keep the test fast)."""
    res = {}
    for l_cycles in (2, 12):
        model = TRM(small_trm(L_cycles=l_cycles, mlp_t=False, pos_encodings="rope"), VOCAB, SEQ, PUZZLES)
        res[l_cycles] = compile_seconds(model, batch_size=4, compile=False)
        print(f"TRM L_cycles={l_cycles}: {res[l_cycles]}")
    assert res[2]["stablehlo_lines"] == res[12]["stablehlo_lines"]


@pytest.mark.parametrize("form", ["swiglu", "sequence_mixer", "qkv", "attention_out"])
def test_accelerator_and_cpu_forms_of_each_product_agree(form):
    """The products have a TPU/GPU form and a CPU form (layers.py, chosen when the step is
    lowered); this CPU runs only the CPU form, so the other is checked against it here, value
    and gradient, in float64."""
    from models.recursive_reasoning import layers

    b, length, d, heads = 3, 7, 8, 2
    rng = np.random.default_rng(0)
    inter = swiglu_width(d, 2.0)
    args = {
        "swiglu": ((b, length, d), (d, 2, inter), (inter, d)),
        "sequence_mixer": ((b, length, d), (length, 2, swiglu_width(length, 2.0)), (swiglu_width(length, 2.0), length)),
        "qkv": ((b, length, d), (d, 3, heads, d // heads)),
        "attention_out": ((b, length, heads, d // heads), (heads, d // heads, d)),
    }[form]
    pairs = {
        "swiglu": (layers._swiglu_fused, layers._swiglu_rows),
        "sequence_mixer": (functools.partial(layers._mix_sequence_transposed, eps=1e-5),
                           functools.partial(layers._mix_sequence_major, eps=1e-5)),
        "qkv": (layers._qkv_fused, layers._qkv_rows),
        "attention_out": (layers._attn_out_fused, layers._attn_out_rows),
    }[form]
    with jax.enable_x64():
        values = [jnp.asarray(rng.normal(size=shape)) for shape in args]
        outputs = jax.tree.leaves(jax.eval_shape(pairs[0], *values))
        weights = [jnp.asarray(rng.normal(size=o.shape)) for o in outputs]  # a random linear loss of the outputs
        loss = lambda f: lambda *v: sum(jnp.vdot(w, y) for w, y in zip(weights, jax.tree.leaves(f(*v))))  # noqa: E731
        (accel, accel_grads), (cpu, cpu_grads) = (
            jax.value_and_grad(loss(f), argnums=tuple(range(len(values))))(*values) for f in pairs)
        np.testing.assert_allclose(accel, cpu, rtol=1e-12)
        for g_accel, g_cpu in zip(accel_grads, cpu_grads):
            np.testing.assert_allclose(g_accel, g_cpu, rtol=1e-10, atol=1e-12)


def test_each_platform_lowers_its_own_form():
    """A step traced on a TPU topology's mesh on this CPU host (as the train step is: its
    activation rules set the mesh) takes the TPU form (one fused gate/up product, no optimization
    barrier); on a CPU mesh, or outside a mesh here, the CPU form."""
    from jax.sharding import NamedSharding, PartitionSpec

    from runtime.compile_only import topology_devices
    from runtime.sharding import activation_rules, make_mesh

    block = Block(hidden=32, heads=4, expansion=2.0, total_len=SEQ, mlp_t=True, dtype=jnp.float32)
    h = jnp.zeros((8, SEQ, 32), jnp.float32)
    params = jax.eval_shape(block.init, jax.random.key(0), h)

    def on(mesh):
        def apply(p, x):
            with activation_rules(mesh):
                return block.apply(p, x)
        return apply

    _, _, devices = topology_devices("v5e-8")
    mesh = make_mesh({"data": 8, "fsdp": 1, "tensor": 1}, list(devices))
    shardings = (NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data")))
    tpu_text = jax.jit(on(mesh), in_shardings=shardings).lower(params, jax.ShapeDtypeStruct(h.shape, h.dtype)).as_text()
    cpu_text = jax.jit(on(make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1]))).lower(params, h).as_text()
    bare_text = jax.jit(lambda p, x: block.apply(p, x)).lower(params, h).as_text()
    assert "optimization_barrier" in bare_text
    assert "optimization_barrier" in cpu_text and "optimization_barrier" not in tpu_text
