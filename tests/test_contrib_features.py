"""TRM options beyond the reference: remat of the recursion, the cycle-consistency regulariser,
the local-window + global-prefix attention mask, and a traced (annealed) halt exploration
probability. All default off; tiny configs on CPU (the one memory test only compiles).
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.recursive_reasoning.task import ACTTask
from models.recursive_reasoning import (HRM, TRM, HRMConfig, InnerCarry, TRMConfig, act_loss, act_step, dummy_batch,
                                        init_params, initial_carry)
from models.recursive_reasoning.layers import local_global_mask, make_net_fn
from helpers import small_trm

VOCAB, PUZZLES = 11, 5


def make_batch(b=4, seq=9, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    inputs = jax.random.randint(k1, (b, seq), 0, VOCAB)
    labels = jnp.where(jax.random.uniform(k2, (b, seq)) < 0.3, -100, jax.random.randint(k3, (b, seq), 1, VOCAB))
    return {"inputs": inputs, "labels": labels, "puzzle_identifiers": jnp.arange(b, dtype=jnp.int32) % PUZZLES}


def build(cfg, batch, cls=TRM, seed=0):
    """(model, params): random float32 parameters of the model's shapes, drawn with numpy (no init
    compile); LeCun-like scales, a non-zero q-head kernel and puzzle embedding (so everything gets
    a gradient) and the q-head bias at the reference's -5."""
    model = cls(cfg, vocab_size=VOCAB, seq_len=batch["inputs"].shape[1], num_puzzle_identifiers=PUZZLES)
    shapes = jax.eval_shape(lambda: nn.meta.unbox(init_params(model, jax.random.key(0), batch)))
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        name = jax.tree_util.keystr(path)
        if "q_head_bias" in name:
            return jnp.full(leaf.shape, -5.0, jnp.float32)
        fan_in = {"'out'": leaf.shape[0] * leaf.shape[1] if leaf.ndim > 2 else 0, "embed_tokens": leaf.shape[-1],
                  "puzzle_emb": 100, "q_head_kernel": 100}
        fan = next((v for k, v in fan_in.items() if k in name and v), leaf.shape[0])
        return jnp.asarray(rng.standard_normal(leaf.shape) / np.sqrt(fan), jnp.float32)

    return model, jax.tree_util.tree_map_with_path(draw, shapes)


_JITS: dict = {}


def cached_jit(kind, model, fn, **kw):
    """One jitted `fn` per (kind, model object): repeated calls reuse its compilation."""
    key = (kind, id(model))
    if key not in _JITS:
        _JITS[key] = (model, jax.jit(fn, **kw))
    return _JITS[key][1]


def jit_step(model):
    return cached_jit("step", model, functools.partial(act_step, model), static_argnames=("training",))


def random_carry(model, b, seed=3):
    h, l = jax.random.normal(jax.random.key(seed), (2, b, model.total_len, model.cfg.hidden))
    return InnerCarry(z_H=h, z_L=l)


def act_total(model, params, batch, carry, cycle_weight=0.0):
    """(ACT loss total of one training step, metric sums) from `carry`."""
    new, out = act_step(model, params, carry, batch, jax.random.key(0), True)
    return act_loss(out, new.current_data["labels"], new.halted, new.steps, cycle_weight=cycle_weight)


def set_q_bias(params, halt, cont):
    return params | {"q_head_kernel": jnp.zeros_like(params["q_head_kernel"]),
                     "q_head_bias": jnp.array([halt, cont], jnp.float32)}


def assert_trees_close(a, b, rtol, atol, scaled_atol=0.0):
    """Leafwise allclose; `scaled_atol` adds that fraction of the leaf's largest |b| to atol."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol + scaled_atol * float(jnp.abs(y).max()))


# ------------------------------------------------------------------ 1. remat


def _has_checkpoint(model, params, batch) -> bool:
    text = str(jax.make_jaxpr(lambda p: model.apply({"params": p}, batch))(params))
    return "checkpoint" in text or "remat" in text


@pytest.mark.parametrize("cls,cfg", [
    (TRM, small_trm(H_cycles=2, L_cycles=3, L_layers=1, mlp_t=True, pos_encodings="none", recompute_mlp=False)),
    (HRM, HRMConfig(hidden=32, heads=4, H_layers=1, L_layers=1, H_cycles=1, L_cycles=1, puzzle_emb_ndim=32,
                    forward_dtype="float32", halt_max_steps=4, halt_exploration_prob=0.0, recompute_mlp=False)),
], ids=["trm", "hrm"])  # recompute_mlp off: its own checkpoint (the TPU form's) is not the one looked for
def test_remat_same_loss_and_gradients(cls, cfg):
    """remat=True gives the same loss and parameter gradients as remat=False (it only changes
    what the backward pass stores), and the traced step really contains a checkpoint."""
    batch = make_batch()
    model, params = build(cfg, batch, cls)
    model_r = cls(dataclasses.replace(cfg, remat=True), vocab_size=VOCAB, seq_len=9, num_puzzle_identifiers=PUZZLES)
    carry = initial_carry(model, batch)
    carry = carry.replace(inner=random_carry(model, 4), halted=jnp.zeros((4,), bool),
                          current_data=batch)  # continue from a non-initial carry

    (l0, g0), (l1, g1) = jax.jit(lambda p: [jax.value_and_grad(lambda pp, m=m: act_total(m, pp, batch, carry)[0])(p)
                                            for m in (model, model_r)])(params)
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    assert_trees_close(g1, g0, rtol=1e-5, atol=1e-8, scaled_atol=1e-4)  # float32 rounding of a re-fused recompute
    assert all(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(g0))
    assert _has_checkpoint(model_r, params, batch) and not _has_checkpoint(model, params, batch)


def test_remat_reduces_compiled_temporaries():
    """The compiled value-and-grad of an ACT step with L_cycles=12 needs fewer temporary bytes
    with remat: only the per-iteration z carries are kept, not every block's activations."""
    cfg = small_trm(hidden=128, heads=4, L_layers=1, H_cycles=1, L_cycles=12, mlp_t=True, pos_encodings="none",
                    puzzle_emb_ndim=128, puzzle_emb_len=4)
    batch = jax.eval_shape(lambda: dummy_batch(32, 16))
    temps = {}
    for remat in (False, True):
        model = TRM(dataclasses.replace(cfg, remat=remat), vocab_size=VOCAB, seq_len=16, num_puzzle_identifiers=1)
        params = jax.eval_shape(lambda m=model: nn.meta.unbox(init_params(m, jax.random.key(0), dummy_batch(1, 16))))
        carry = jax.eval_shape(lambda m=model: initial_carry(m, dummy_batch(32, 16)))

        def loss(p, c, b, m=model):  # a stand-in loss on the step's outputs (as act.compile_seconds)
            _, out = act_step(m, p, c, b, None, True)
            return out["logits"].mean() + out["q_halt_logits"].mean()

        fn = jax.jit(jax.value_and_grad(loss))
        temps[remat] = fn.lower(params, carry, batch).compile().memory_analysis().temp_size_in_bytes
    print(f"\ncompiled temp bytes, L_cycles=12: remat off {temps[False]:,}, remat on {temps[True]:,} "
          f"(ratio {temps[True] / temps[False]:.3f})")
    assert temps[True] < 0.5 * temps[False]


# ------------------------------------------------------------------ 2. cycle consistency


def _cycle_delta(model, params, batch, carry):
    _, state = model.apply({"params": params}, batch, carry, mutable=["intermediates"])
    return state["intermediates"]["cycle_delta"][0]


def test_cycle_delta_value_matches_carry_in_and_out():
    """cycle_delta[b] = mean over (positions, features) of (z_H out - z_H in)^2 for H_cycles=1;
    for H_cycles=3 the 'in' is the z_H after the two no-gradient cycles."""
    batch = make_batch()
    model, params = build(small_trm(H_cycles=1, cycle_consistency_weight=0.5), batch)
    c = random_carry(model, 4)
    delta, out = jax.jit(lambda p, cc: (_cycle_delta(model, p, batch, cc), model.apply({"params": p}, batch, cc)[0])
                         )(params, c)
    assert delta.shape == (4,) and delta.dtype == jnp.float32
    np.testing.assert_allclose(delta, jnp.mean((out.z_H - c.z_H) ** 2, axis=(1, 2)), rtol=1e-5)
    assert float(delta.min()) > 0
    # H_cycles=3: the cycle with gradient starts from 2 no-gradient cycles' z_H
    cfg3 = small_trm(H_cycles=3, cycle_consistency_weight=0.5)
    m3, m2 = (TRM(dataclasses.replace(cfg3, H_cycles=h), VOCAB, 9, PUZZLES) for h in (3, 2))
    mid, end, delta3 = jax.jit(lambda p: (m2.apply({"params": p}, batch, c)[0], m3.apply({"params": p}, batch, c)[0],
                                          _cycle_delta(m3, p, batch, c)))(params)
    np.testing.assert_allclose(delta3, jnp.mean((end.z_H - mid.z_H) ** 2, axis=(1, 2)), rtol=1e-4)
    # act_step reports it (reset rows start from H_init) and the model without the weight does not
    m0 = TRM(small_trm(H_cycles=1), VOCAB, 9, PUZZLES)
    (new, outs), (_, outs0) = jax.jit(lambda p: [act_step(m, p, initial_carry(m, batch), batch, None, False)
                                                 for m in (model, m0)])(params)
    fresh = model.initial_carry(4)
    np.testing.assert_allclose(outs["cycle_delta"], jnp.mean((new.inner.z_H - fresh.z_H) ** 2, axis=(1, 2)), rtol=1e-5)
    assert "cycle_delta" not in outs0


def test_cycle_loss_gradient_decomposes():
    """grad(total at weight w) = grad(total at w=0) + w * grad(sum cycle_delta), the term is
    non-zero, and the metric sums carry `cycle_loss` only when the term is on."""
    w = 0.7
    batch = make_batch()
    cfg = small_trm(H_cycles=2, L_cycles=1, mlp_t=True, pos_encodings="none", cycle_consistency_weight=w)
    model_w, params = build(cfg, batch)
    model_0 = TRM(dataclasses.replace(cfg, cycle_consistency_weight=0.0), VOCAB, 9, PUZZLES)
    carry = initial_carry(model_w, batch)

    @jax.jit
    def grads(p):
        (tw, sw), gw = jax.value_and_grad(lambda pp: act_total(model_w, pp, batch, carry, w), has_aux=True)(p)
        (t0, s0), g0 = jax.value_and_grad(lambda pp: act_total(model_0, pp, batch, carry, w), has_aux=True)(p)
        gc = jax.grad(lambda pp: act_step(model_w, pp, carry, batch, jax.random.key(0), True)[1]["cycle_delta"].sum())(p)
        return tw, sw, gw, t0, s0, g0, gc

    tw, sw, gw, t0, s0, g0, gc = grads(params)
    assert "cycle_loss" in sw and "cycle_loss" not in s0
    assert set(sw) - set(s0) == {"cycle_loss"}
    np.testing.assert_allclose(tw, t0 + w * sw["cycle_loss"], rtol=1e-5)
    assert float(sw["cycle_loss"]) > 0
    assert_trees_close(gw, jax.tree.map(lambda a, b: a + w * b, g0, gc), rtol=1e-4, atol=1e-6)
    assert float(jnp.abs(gc["L_level"]["block_0"]["mlp"]["down"]).max()) > 0  # the term trains the net


def test_cycle_term_gives_no_gradient_to_z_H_before():
    """H_cycles=1, L_cycles=1: rebuild the cycle by hand, z_H_after = f(z_H). The model's
    d(sum cycle_delta)/d z_H equals the gradient of mean((f(z) - stop_gradient(z))^2), not the
    one where z_H_before is differentiated too."""
    batch = make_batch()
    model, params = build(small_trm(H_cycles=1, L_cycles=1, L_layers=1, mlp_t=True, pos_encodings="none",
                                    cycle_consistency_weight=1.0), batch)
    c = random_carry(model, 4)
    net = make_net_fn(model._net_def(1), None)
    # input embedding by hand (pos_encodings none): sqrt(hidden) * [puzzle emb, padded to 2 tokens; tokens]
    pe = jnp.pad(params["puzzle_emb"][batch["puzzle_identifiers"]], ((0, 0), (0, 32))).reshape(4, 2, 32)
    x = 32 ** 0.5 * jnp.concatenate([pe, params["embed_tokens"][batch["inputs"]]], axis=1)

    def f(zh):  # the cycle with gradient, by hand
        z_L = net(params["L_level"], c.z_L, zh + x)
        return net(params["L_level"], zh, z_L)

    def manual(zh, detach_before):
        before = jax.lax.stop_gradient(zh) if detach_before else zh
        return jnp.mean((f(zh) - before) ** 2, axis=(1, 2)).sum()

    @jax.jit
    def run(zh):
        def model_delta(z):
            return _cycle_delta(model, params, batch, c.replace(z_H=z)).sum()
        return (model_delta(zh), manual(zh, True), jax.grad(model_delta)(zh), jax.grad(lambda z: manual(z, True))(zh),
                jax.grad(lambda z: manual(z, False))(zh))

    d_model, d_manual, g_model, g_detached, g_both = run(c.z_H)
    np.testing.assert_allclose(d_manual, d_model, rtol=1e-5)
    np.testing.assert_allclose(g_model, g_detached, rtol=1e-4, atol=1e-7)
    assert float(jnp.abs(g_both - g_detached).max()) > 100 * 1e-7 + 1e-4 * float(jnp.abs(g_detached).max())


def test_act_task_cycle_loss_and_summarize():
    w = 0.25
    batch = make_batch()
    model, params = build(tiny_trm(cycle_consistency_weight=w), batch)
    task = ACTTask(model)
    loss, (_, sums, _) = jax.jit(task.train_loss)(params, task.init_carry(batch), batch, jax.random.key(1))
    s = jax.device_get(sums)
    np.testing.assert_allclose(loss * 4, s["lm_loss"] + 0.5 * (s["q_halt_loss"] + s["q_continue_loss"]) + w * s["cycle_loss"],
                               rtol=1e-5)
    m = task.summarize(s, 4, True)
    np.testing.assert_allclose(m["cycle_loss"], s["cycle_loss"] / 4, rtol=1e-6)
    np.testing.assert_allclose(m["loss"], loss, rtol=1e-5)
    ev = task.summarize(s | {"count": 2}, 4, False)  # evaluation: losses / count
    np.testing.assert_allclose(ev["cycle_loss"], s["cycle_loss"] / 2, rtol=1e-6)
    np.testing.assert_allclose(ev["loss"], m["loss"] * 2, rtol=1e-5)
    # without the term (no cycle_loss sum): the reference's loss, no cycle_loss key
    s0 = {k: v for k, v in s.items() if k != "cycle_loss"}
    m0 = ACTTask(TRM(tiny_trm(), VOCAB, 9, PUZZLES)).summarize(s0, 4, True)
    assert "cycle_loss" not in m0
    np.testing.assert_allclose(m0["loss"], m["loss"] - w * m["cycle_loss"], rtol=1e-5)


# ------------------------------------------------------------------ 3. local-window attention mask


def test_local_global_mask_pattern():
    prefix, height, width, window = 2, 4, 5, 3
    m = local_global_mask(prefix, height, width, window)
    assert m.shape == (22, 22) and m.dtype == bool
    assert (m == m.T).all() and m.diagonal().all()
    assert m[:prefix].all() and m[:, :prefix].all()
    def pos(r, c):
        return prefix + r * width + c
    assert m[pos(1, 1), pos(0, 0)] and m[pos(1, 1), pos(2, 2)] and m[pos(1, 1), pos(0, 2)]
    assert not m[pos(1, 1), pos(1, 3)] and not m[pos(1, 1), pos(3, 1)] and not m[pos(0, 0), pos(2, 0)]
    assert not m[pos(0, 4), pos(1, 0)]  # no wrap-around between rows
    k = window // 2
    for r in range(height):
        for c in range(width):
            area = (min(r + k, height - 1) - max(r - k, 0) + 1) * (min(c + k, width - 1) - max(c - k, 0) + 1)
            assert m[pos(r, c)].sum() == prefix + area
    assert local_global_mask(0, 3, 3, 5).all()  # window covers the grid
    assert local_global_mask(1, 3, 3, 1)[1:, 1:].sum() == 9  # window 1: each cell only itself
    with pytest.raises(ValueError):
        local_global_mask(0, 3, 3, 2)


def _logits_and_zL(model, params, batch):
    def fn(p, b):
        c, logits, _, _ = model.apply({"params": p}, b)
        return logits, c.z_L
    return cached_jit("logits_zL", model, fn)(params, batch)


def _perturb(batch, r, c, width=9):
    inputs = batch["inputs"].at[:, r * width + c].set((batch["inputs"][:, r * width + c] + 3) % VOCAB)
    return batch | {"inputs": inputs}


def test_attention_window_limits_receptive_field():
    """1 layer, H_cycles=1, L_cycles=1: two network applications (L then H), one attention hop
    each. Window 3 on a 9x9 grid: cell (0,0)'s z_L sees cells within distance 1; its logits (via
    z_H) within distance 2 without a prefix, everything with a prefix (the global tokens relay)."""
    batch = make_batch(b=2, seq=81)
    cfg = small_trm(H_cycles=1, L_cycles=1, L_layers=1, attention_window=3)
    run = _logits_and_zL
    # no prefix: logits at (0,0) depend on cells within 2 hops only
    cfg0 = dataclasses.replace(cfg, puzzle_emb_ndim=0, puzzle_emb_len=0)
    model, params = build(cfg0, batch)
    assert model.prefix == 0
    base = run(model, params, batch)[0][:, 0]
    np.testing.assert_array_equal(run(model, params, _perturb(batch, 4, 4))[0][:, 0], base)
    np.testing.assert_array_equal(run(model, params, _perturb(batch, 0, 3))[0][:, 0], base)
    assert float(jnp.abs(run(model, params, _perturb(batch, 2, 2))[0][:, 0] - base).max()) > 1e-4  # 2 hops
    model_full = TRM(dataclasses.replace(cfg0, attention_window=None), VOCAB, 81, PUZZLES)
    base_full = run(model_full, params, batch)[0][:, 0]
    assert float(jnp.abs(run(model_full, params, _perturb(batch, 4, 4))[0][:, 0] - base_full).max()) > 1e-4
    # with a 2-token prefix: one hop (z_L) stays local, two hops (logits) reach everything
    model, params = build(cfg, batch)
    logits, z_L = run(model, params, batch)
    p_logits, p_zL = run(model, params, _perturb(batch, 2, 2))
    np.testing.assert_array_equal(p_zL[:, 2], z_L[:, 2])  # cell (0,0) = position prefix + 0
    assert float(jnp.abs(run(model, params, _perturb(batch, 1, 1))[1][:, 2] - z_L[:, 2]).max()) > 1e-4
    assert float(jnp.abs(p_logits[:, 0] - logits[:, 0]).max()) > 1e-4


def test_full_window_equals_no_mask():
    batch = make_batch(b=2, seq=16)
    cfg = small_trm(H_cycles=1, L_cycles=2, L_layers=1)
    model, params = build(cfg, batch)
    model_w = TRM(dataclasses.replace(cfg, attention_window=7), VOCAB, 16, PUZZLES)  # 7 >= 2*4 - 1
    model_3 = TRM(dataclasses.replace(cfg, attention_window=3), VOCAB, 16, PUZZLES)
    assert model_w.attention_mask().all() and model.attention_mask() is None
    c = random_carry(model, 2)
    o0, o1, o3 = jax.jit(lambda p: [m.apply({"params": p}, batch, c) for m in (model, model_w, model_3)])(params)
    assert_trees_close(o1, o0, rtol=1e-6, atol=1e-6)
    # and a small window does change the outputs
    assert float(jnp.abs(o3[1] - o0[1]).max()) > 1e-4


@pytest.mark.slow  # Pallas' interpreter inside the recursion
def test_splash_form_of_the_windowed_trm_equals_xla():
    """models/attention.py's splash kernel (Pallas' interpreter on CPU) inside the recursion (the
    mask a constant of the scanned network), with a gradient through the cycle: equal to XLA's form."""
    batch = make_batch(b=2, seq=16)
    cfg = small_trm(H_cycles=1, L_cycles=1, L_layers=1, attention_window=3, attention="xla")
    model, params = build(cfg, batch)
    splash = TRM(dataclasses.replace(cfg, attention="splash"), VOCAB, 16, PUZZLES)
    c = random_carry(model, 2)

    def out_and_grad(m):
        loss = lambda p: (m.apply({"params": p}, batch, c)[1] ** 2).mean()  # noqa: E731
        return m.apply({"params": params}, batch, c), jax.grad(loss)(params)

    assert_trees_close(out_and_grad(splash), out_and_grad(model), rtol=1e-5, atol=1e-5)


def test_attention_window_config_errors():
    batch = make_batch(b=1, seq=12)
    def init(cfg):
        return init_params(TRM(cfg, VOCAB, 12, PUZZLES), jax.random.key(0), batch)
    with pytest.raises(ValueError, match="mlp_t"):
        init(small_trm(mlp_t=True, attention_window=3))
    with pytest.raises(ValueError, match="grid_width"):
        init(small_trm(attention_window=3))  # 12 is not a square
    with pytest.raises(ValueError, match="odd"):
        init(small_trm(attention_window=4, grid_width=4))
    with pytest.raises(ValueError, match="grid_width"):
        init(small_trm(attention_window=3, grid_width=5))
    m = TRM(small_trm(attention_window=3, grid_width=4), VOCAB, 12, PUZZLES)  # 3 rows x 4 columns
    np.testing.assert_array_equal(m.attention_mask(), local_global_mask(2, 3, 4, 3))
    assert jax.tree.leaves(jax.eval_shape(lambda: init_params(m, jax.random.key(0), batch)))


# ------------------------------------------------------------------ 4. traced halt exploration


def _halts(model, params, batch, prob, calls):
    """Per call: the steps at which rows halted (prob: act_step's exploration_prob, traced)."""
    run = jit_step(model)
    carry, out = initial_carry(model, batch), []
    for i in range(calls):
        kw = {} if prob is None else {"exploration_prob": jnp.float32(prob)}
        carry, _ = run(params, carry, batch, jax.random.key(i), training=True, **kw)
        out.append(np.asarray(carry.steps)[np.asarray(carry.halted)].tolist())
    return out


def tiny_trm(**kw) -> TRMConfig:
    """The cheapest TRM to compile: mlp_t, one layer, one cycle of one L-update."""
    return small_trm(**({"mlp_t": True, "pos_encodings": "none", "H_cycles": 1, "L_cycles": 1} | kw))


def test_exploration_prob_argument_overrides_config():
    batch = make_batch(b=8)
    model, params = build(tiny_trm(halt_exploration_prob=0.0), batch)  # halt_max_steps 4
    params = set_q_bias(params, 5.0, -5.0)  # q_halt > 0: halts at step 1 unless exploring
    assert _halts(model, params, batch, 0.0, 2) == [[1] * 8] * 2
    explored = _halts(model, params, batch, 1.0, 12)
    assert explored[0] == []  # nobody halts at step 1: every row waits for its min_halt >= 2
    flat = [s for call in explored for s in call]
    assert set(flat) == {2, 3, 4}
    # the argument also overrides a non-zero config value
    model_x = TRM(tiny_trm(halt_exploration_prob=1.0), VOCAB, 9, PUZZLES)
    assert _halts(model_x, params, batch, 0.0, 1) == [[1] * 8]


def test_act_task_exploration_schedule():
    batch = make_batch(b=8)
    model, params = build(tiny_trm(halt_exploration_prob=0.0), batch)
    params = set_q_bias(params, 5.0, -5.0)
    task = ACTTask(model, exploration=lambda step: jnp.where(step < 100, 1.0, 0.0))  # explore early only
    loss_fn = jax.jit(task.train_loss)

    def halted(step):
        _, (carry, _, _) = loss_fn(params, task.init_carry(batch), batch, jax.random.key(1), step)
        return int(carry.halted.sum())

    assert halted(jnp.int32(5)) == 0  # prob 1: every row continues past step 1
    assert halted(jnp.int32(500)) == 8  # prob 0: q_halt > 0 halts every row
    assert halted(None) == 8  # no step: the config's 0
