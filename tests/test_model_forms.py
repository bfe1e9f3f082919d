"""Forms of the same computation in the recursive models, chosen for speed, equal to today's:
the attention's splash (Pallas, in interpret mode on CPU) and dot_product forms against the XLA
form in float32, values and gradients, with the sequence padded (97 -> 128), rope and a local
window, and on a mesh (the kernel per shard); the mlp_t mixer's fused kernel (arch.mixer=pallas,
interpret mode) against its XLA form in float32, on one device and per shard; the SwiGLU and
mlp_t mixer recomputed in the backward pass (arch.recompute_mlp) against their plain TPU forms in
float64. The kernels' priced cost and auto's choice on a TPU topology: tests/test_hlo_cost.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.recursive_reasoning.layers import Attention, local_global_mask, rope_cos_sin

PREFIX, SIDE, HIDDEN, HEADS = 16, 9, 32, 2
LENGTH = PREFIX + SIDE * SIDE  # 97: padded to 128 for splash


def attention_and_grads(impl: str, params, x, cos_sin, mask):
    """The module's output and the gradients of a weighted sum of it (every output feature counts
    differently), for the parameters and the input."""
    def loss(p, x):
        y = Attention(HIDDEN, HEADS, jnp.float32, impl).apply(p, x, cos_sin, mask)
        return (y * jnp.arange(1, HIDDEN + 1, dtype=jnp.float32)).sum() + (y ** 2).sum(), y

    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
    return y, grads


def inputs(batch: int, window: int | None):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((batch, LENGTH, HIDDEN)), jnp.float32)
    mask = None if window is None else local_global_mask(PREFIX, SIDE, SIDE, window)
    cos_sin = rope_cos_sin(LENGTH, HIDDEN // HEADS)
    params = Attention(HIDDEN, HEADS, jnp.float32, "xla").init(jax.random.key(0), x, cos_sin, mask)
    return params, x, cos_sin, mask


def assert_same(got, want, rtol=2e-5):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        scale = float(jnp.abs(b).max())
        assert float(jnp.abs(a - b).max()) <= rtol * scale, (float(jnp.abs(a - b).max()), scale)


@pytest.mark.slow  # Pallas' interpreter: seconds a call
@pytest.mark.parametrize("window", [3, None], ids=["local-window", "full"])
def test_splash_and_dot_product_equal_the_xla_form(window):
    params, x, cos_sin, mask = inputs(2, window)
    want = attention_and_grads("xla", params, x, cos_sin, mask)
    for impl in ("splash", "dot_product"):
        assert_same(attention_and_grads(impl, params, x, cos_sin, mask), want)
    # the padded keys are really masked: a value at a padded position would change the output
    if window is not None:
        assert not np.array_equal(np.asarray(want[0]), np.asarray(attention_and_grads("xla", params, x, cos_sin,
                                                                                          None)[0]))


@pytest.mark.slow
@pytest.mark.devices(4)
def test_splash_on_a_mesh_runs_per_shard():
    """The batch split over data=4 (a Pallas call is not partitioned by XLA): shard_map gives each
    device its rows; the result equals the XLA form on one device."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from runtime.sharding import activation_rules, make_mesh

    params, x, cos_sin, mask = inputs(4, 3)
    want = attention_and_grads("xla", params, x, cos_sin, mask)
    mesh = make_mesh({"data": 4, "fsdp": 1, "tensor": 1})

    def on_mesh(p, x):
        with activation_rules(mesh):
            return attention_and_grads("splash", p, x, cos_sin, mask)

    step = jax.jit(on_mesh)
    sharded = jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"))))
    assert "sdy.manual_computation" in step.lower(params, sharded).as_text()  # the kernel inside a shard_map
    assert_same(step(params, sharded), want)


def test_auto_is_xla_on_cpu_and_a_bad_name_is_refused():
    """auto on TPU: tests/test_hlo_cost.py compiles it for a topology."""
    from models.attention import tpu_form

    params, x, cos_sin, mask = inputs(2, 3)
    auto = Attention(HIDDEN, HEADS, jnp.float32, "auto").apply(params, x, cos_sin, mask)
    assert np.array_equal(np.asarray(auto), np.asarray(Attention(HIDDEN, HEADS, jnp.float32, "xla").apply(
        params, x, cos_sin, mask)))
    assert (tpu_form(97), tpu_form(916)) == ("xla", "splash")
    with pytest.raises(ValueError, match="not one of"):
        Attention(HIDDEN, HEADS, jnp.float32, "flash").apply(params, x, cos_sin, mask)


@pytest.mark.parametrize("form", ["swiglu", "mlp_t mixer"])
def test_recomputed_mlp_equals_the_plain_form_in_float64(form):
    """The TPU/GPU forms (what arch.recompute_mlp wraps) run here on CPU, in float64."""
    import functools


    from models.recursive_reasoning.layers import _mix_sequence_transposed, _swiglu_fused, recomputed

    plain = _swiglu_fused if form == "swiglu" else functools.partial(_mix_sequence_transposed, eps=1e-5)
    rng = np.random.default_rng(1)
    with jax.enable_x64():
        width, inter = (HIDDEN, 48) if form == "swiglu" else (LENGTH, 64)
        x = jnp.asarray(rng.standard_normal((2, LENGTH, HIDDEN) if form == "mlp_t mixer" else (2, LENGTH, width)))
        gate_up = jnp.asarray(rng.standard_normal((width, 2, inter)) / np.sqrt(width))
        down = jnp.asarray(rng.standard_normal((inter, width)) / np.sqrt(inter))

        def value_and_grads(fn):
            loss = lambda *a: (fn(*a) * jnp.arange(a[0].shape[-1], dtype=jnp.float64)).sum()  # noqa: E731
            return fn(x, gate_up, down), jax.grad(loss, argnums=(0, 1, 2))(x, gate_up, down)

        again = recomputed(plain, True)
        assert again is not plain and recomputed(plain, False) is plain
        got, want = value_and_grads(jax.jit(again)), value_and_grads(jax.jit(plain))
        assert jax.tree.leaves(got)[0].dtype == jnp.float64
        # The mixer's norm works in float32 by design (rms_norm): where XLA fuses the recomputed
        # graph differently, that shows at float32's rounding; the SwiGLU alone is float64 through.
        tolerance = 1e-12 if form == "swiglu" else 1e-6
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tolerance, atol=tolerance)


def mixer_and_grads(form: str, params, h):
    from models.recursive_reasoning.layers import SequenceMixer

    def loss(p, h):
        z = SequenceMixer(h.shape[1], 4.0, jnp.float32, form=form).apply(p, h)
        return (z * jnp.arange(1, h.shape[-1] + 1, dtype=jnp.float32)).sum() + (z ** 3).sum(), z

    (_, z), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, h)
    return z, grads


def mixer_inputs(batch: int, features: int):
    from models.recursive_reasoning.layers import SequenceMixer

    h = jnp.asarray(np.random.default_rng(2).standard_normal((batch, LENGTH, features)), jnp.float32)
    return SequenceMixer(LENGTH, 4.0, jnp.float32, form="xla").init(jax.random.key(1), h), h


@pytest.mark.slow  # Pallas' interpreter
@pytest.mark.parametrize("batch", [3, 4], ids=["odd-batch", "two-halves"])
def test_mixer_kernel_equals_the_xla_form(batch, monkeypatch):
    """The fused mlp_t kernel (residual and norm inside) against XLA's products in float32, values
    and the gradients of its weights and input: an odd batch (one grid half), an even one (two
    halves, each with its own partial weight gradients, summed), and the feature columns in two
    tiles (a smaller VMEM budget picks 128 of 256)."""
    from models.recursive_reasoning import mixer_kernel

    monkeypatch.setattr(mixer_kernel, "VMEM_BUDGET", 8 * 2 * 512 * 128 * 4)
    params, h = mixer_inputs(batch, 256)
    assert mixer_kernel._layout(h.shape, 512)[3:] == (128, 2)  # Sudoku's 97-token mixer is 512 wide
    assert_same(mixer_and_grads("pallas", params, h), mixer_and_grads("xla", params, h))


@pytest.mark.slow
@pytest.mark.devices(4)
def test_mixer_kernel_on_a_mesh_sums_its_weight_gradients_over_the_shards():
    from jax.sharding import NamedSharding, PartitionSpec as P

    from runtime.sharding import activation_rules, make_mesh

    params, h = mixer_inputs(8, 128)
    want = mixer_and_grads("xla", params, h)
    mesh = make_mesh({"data": 4, "fsdp": 1, "tensor": 1})

    def on_mesh(p, h):
        with activation_rules(mesh):
            return mixer_and_grads("pallas", p, h)

    step = jax.jit(on_mesh)
    sharded = jax.device_put(h, NamedSharding(mesh, P(("data", "fsdp"))))
    assert "sdy.manual_computation" in step.lower(params, sharded).as_text()
    assert_same(step(params, sharded), want)


def test_mixer_form_auto_is_xla_on_cpu_and_a_bad_name_is_refused():
    from models.recursive_reasoning import mixer_kernel
    from models.recursive_reasoning.layers import SequenceMixer

    params, h = mixer_inputs(2, 32)
    auto = SequenceMixer(LENGTH, 4.0, jnp.float32, form="auto").apply(params, h)
    assert np.array_equal(np.asarray(auto), np.asarray(SequenceMixer(LENGTH, 4.0, jnp.float32).apply(params, h)))
    # too wide for VMEM: auto keeps XLA's form (a 30x30 maze's 916-token mixer, 2560 wide)
    assert mixer_kernel.column_tile(512, 256) == 256 and mixer_kernel.column_tile(512, 512) == 128
    assert mixer_kernel.column_tile(512, 2560) is None
    assert mixer_kernel.fits(512, 512, jnp.bfloat16) and not mixer_kernel.fits(512, 512, jnp.float16)
    with pytest.raises(ValueError, match="not one of"):
        SequenceMixer(LENGTH, 4.0, jnp.float32, form="fused").apply(params, h)
