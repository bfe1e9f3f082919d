"""runtime/hlo_cost.py: every loop iteration counted (trip counts of any counter), collectives
weighted by their loops, custom kernels at their declared cost. Hand-written HLO with known
answers, then small programs compiled for a TPU topology against hand-computed figures and, where
it is the same program, the program unrolled."""

from __future__ import annotations

import dataclasses
import functools
import re

import numpy as np
import pytest

from runtime import hlo_cost
from runtime.compile_only import TOPOLOGIES, CompiledStep, estimate_step


def looped(ctype: str = "s32", start: int = 0, limit: int = 5, step: int = 1, direction: str = "LT",
           body_op: str = "", entry_op: str = "", annotation: str = "") -> str:
    """A while loop whose counter (element 0) runs from `start` by `step` while `counter <direction> limit`;
    `body_op` / `entry_op`: one more instruction inside the body / in the entry computation."""
    add = "add" if step >= 0 else "subtract"
    return f"""HloModule m

%fused (p: f32[8]) -> f32[8] {{
  %p = f32[8]{{0}} parameter(0)
  ROOT %n = f32[8]{{0}} negate(%p)
}}

%body (b: ({ctype}[], f32[8])) -> ({ctype}[], f32[8]) {{
  %b = ({ctype}[], f32[8]{{0}}) parameter(0)
  %i = {ctype}[] get-tuple-element(%b), index=0
  %stride = {ctype}[]{{:T(128)}} constant({abs(step)})
  %next = {ctype}[] {add}(%i, %stride)
  %x = f32[8]{{0}} get-tuple-element(%b), index=1
  %f = f32[8]{{0}} fusion(%x), kind=kLoop, calls=%fused, backend_config={{"estimated_cycles":"100"}}
  {body_op}
  ROOT %t = ({ctype}[], f32[8]{{0}}) tuple(%next, %f)
}}

%cond (c: ({ctype}[], f32[8])) -> pred[] {{
  %c = ({ctype}[], f32[8]{{0}}) parameter(0)
  %limit = {ctype}[]{{:T(128)}} constant({limit})
  %i = {ctype}[] get-tuple-element(%c), index=0
  ROOT %cmp = pred[] compare(%i, %limit), direction={direction}
}}

ENTRY %main (a: f32[8]) -> f32[8] {{
  %a = f32[8]{{0}} parameter(0)
  %g = f32[8]{{0}} fusion(%a), kind=kLoop, calls=%fused, backend_config={{"estimated_cycles":"50"}}
  {entry_op}
  %start = {ctype}[] constant({start})
  %start.copy = {ctype}[] copy(%start)
  %t0 = ({ctype}[], f32[8]{{0}}) tuple(%start.copy, %g)
  %w = ({ctype}[], f32[8]{{0}}) while(%t0), condition=%cond, body=%body{annotation}
  ROOT %r = f32[8]{{0}} get-tuple-element(%w), index=1
}}
"""


def trips(hlo: str) -> float | None:
    comps, entry = hlo_cost.computations(hlo)
    counts, unreadable = hlo_cost.executions(comps, entry)
    return None if unreadable else counts["body"]


@pytest.mark.parametrize("loop,expected", [
    (dict(), 5),
    (dict(ctype="u32", limit=16, step=2), 8),  # FSDP's collective-matmul loops: u32, stride 2
    (dict(ctype="u32", limit=15, step=2), 8),  # the last iteration starts at 14
    (dict(ctype="s64", start=3, limit=10, direction="LE"), 8),
    (dict(start=10, limit=0, step=-2, direction="GT"), 5),
    (dict(start=2, limit=12, step=5, direction="NE"), 2),
    (dict(start=7, limit=5), 0),
    (dict(limit=99, annotation=', backend_config={"known_trip_count":{"n":"4"}}'), 4),  # XLA's own count first
])
def test_trip_count_of_any_counter(loop, expected):
    assert trips(looped(**loop)) == expected
    assert hlo_cost.loop_weight(looped(**loop)) == pytest.approx((50 + expected * 100) / (50 + 100))


@pytest.mark.parametrize("change", [("constant(5)", "parameter(1)"),  # the bound is not a constant
                                    ("direction=LT", "direction=GT"),  # counts up while above its bound: no count
                                    ("%start = s32[] constant(0)", "%start = s32[] parameter(1)")])
def test_unreadable_trip_count_is_none(change):
    hlo = looped().replace(*change)
    assert trips(hlo) is None and hlo_cost.loop_weight(hlo) is None


def test_collectives_and_kernels_are_weighted_by_their_loops():
    ar = "%ar{n} = f32[256]{{0}} all-reduce(%{x}), channel_id={n}, replica_groups={{{{0,1,2,3}}}}, to_apply=%fused"
    kernel = ('%k = f32[8]{0} custom-call(%x), custom_call_target="tpu_custom_call", backend_config={"custom_call_config":'
              '{"body":"abc","cost_estimate":{"flops":"2750000000","transcendentals":"0","bytes_accessed":"1200000"}}}')
    hlo = looped(limit=6, body_op=ar.format(n=1, x="x") + "\n  " + kernel, entry_op=ar.format(n=2, x="a"))
    assert hlo_cost.collective_bytes(hlo)["all-reduce"] == (7, 7 * 1024)
    assert hlo_cost.wire_bytes(hlo, devices=8) == pytest.approx(7 * 1024 * 2 * 3 / 4)
    (k,) = hlo_cost.kernels(hlo)
    assert (k.flops, k.bytes_accessed, k.runs) == (2.75e9, 1.2e6, 6)
    assert k.seconds(275e12, 1.2e12) == pytest.approx(1e-5)  # FLOP-bound: 10 us at peak, 1 us of bytes
    assert k.seconds(275e12, 1.2e10) == pytest.approx(1e-4)  # at 1/100 the bandwidth, byte-bound


def test_step_estimate_takes_kernels_out_of_the_loop_weight():
    gen = TOPOLOGIES["v4"]
    step = CompiledStep(hbm_bytes=1.0, total_bytes=0.5, xla_flops=1e12, optimal_s=0.011, has_loops=True,
                        loop_weight=3.0, kernel_once_s=0.001, kernel_s=0.006, undeclared_kernels=1)
    est = estimate_step(step, gen, model_flops=None)
    assert est.compute_s == pytest.approx(0.010 * 3 + 0.006) and est.kernel_s == pytest.approx(0.006)
    assert est.kernel_share == pytest.approx(0.006 / 0.036) and est.undeclared_kernels == 1
    flat = estimate_step(dataclasses.replace(step, has_loops=False, kernel_s=0.001), gen, model_flops=None)
    assert flat.compute_s == pytest.approx(0.011)  # no loops: optimal_seconds as the compiler gave it


def test_each_branch_of_a_conditional_counts_its_share_of_the_runs():
    """Which branch runs is not in the HLO: each of two counts half (Gemma's local and global
    attention kernels, picked per layer by lax.cond, both priced at the layers' mean)."""
    branch = """%{name} (p: f32[8]) -> f32[8] {{
  %p = f32[8]{{0}} parameter(0)
  ROOT %k = f32[8]{{0}} custom-call(%p), custom_call_target="tpu_custom_call", backend_config={{"custom_call_config":{{"body":"x","cost_estimate":{{"flops":"100","bytes_accessed":"8"}}}}}}
}}
"""
    hlo = looped(limit=4, body_op="%pred = pred[] constant(true)\n  %c = f32[8]{0} conditional(%pred, %f, %f), "
                                   "branch_computations={%left, %right}")
    hlo = hlo.replace("%body (b:", branch.format(name="left") + "\n" + branch.format(name="right") + "\n%body (b:")
    assert sorted(k.runs for k in hlo_cost.kernels(hlo)) == [2.0, 2.0]  # 4 iterations, half each


def test_an_unmodelled_call_in_each_branch_of_a_conditional_is_added_back_once():
    """libtpu's -1 for an op it has no model for counts one branch of a conditional, not each:
    adding back every ConcatBitcast of the text put a whole second into a Gemma 2 step's compute
    (runtime/hlo_cost.py `optimal_seconds`)."""
    branch = """%{name} (p: f32[8]) -> f32[8] {{
  %p = f32[8]{{0}} parameter(0)
  ROOT %k = f32[8]{{0}} custom-call(%p), custom_call_target="ConcatBitcast"
}}
"""
    hlo = looped(limit=4, body_op="%pred = pred[] constant(true)\n  %c = f32[8]{0} conditional(%pred, %f, %f), "
                                   "branch_computations={%left, %right}",
                 entry_op='%cb = f32[8]{0} custom-call(%a), custom_call_target="ConcatBitcast"')
    hlo = hlo.replace("%body (b:", branch.format(name="left") + "\n" + branch.format(name="right") + "\n%body (b:")
    assert hlo_cost._custom_calls(hlo) == (2, 2)  # the entry's, and the conditional's one
    assert hlo_cost.optimal_seconds({"optimal_seconds": -1.92, "flops": 1e9}, hlo, 275e12) == pytest.approx(0.08)


ASYNC_GATHER = """HloModule m

%fused (p: f32[256]) -> f32[256] {
  %p = f32[256]{0} parameter(0)
  ROOT %n = f32[256]{0} negate(%p)
}

ENTRY %main (a: f32[256]) -> f32[256] {
  %a = f32[256]{0} parameter(0)
  %ags = (f32[256]{0}, f32[1024]{0}) all-gather-start(%a), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
  %g = f32[256]{0} fusion(%a), kind=kLoop, calls=%fused, backend_config={"estimated_cycles":"300"}
  %agd = f32[1024]{0} all-gather-done(%ags)
  %h = f32[256]{0} fusion(%g), kind=kLoop, calls=%fused, backend_config={"estimated_cycles":"100"}
  ROOT %ar = f32[256]{0} all-reduce(%h), channel_id=2, replica_groups={{0,1,2,3}}, to_apply=%fused
}
"""


@pytest.mark.parametrize("compute_s,hidden", [(2.0, 1.0), (1e-6, 0.75e-6)])
def test_an_async_collective_is_hidden_behind_the_compute_between_its_start_and_done(compute_s, hidden):
    """The all-gather's 3 KiB on the wire (3/4 of 4 KiB) overlap the fusion scheduled between its
    start and done (300 of the step's 400 cycles): hidden up to that compute's time; the
    synchronous all-reduce after it hides nothing."""
    gather_wire = 1024 * 4 * 3 / 4
    assert hlo_cost.overlapped_collectives(ASYNC_GATHER, devices=4) == [(gather_wire, 0.75, 1.0)]
    seconds = hlo_cost.hidden_collective_seconds(ASYNC_GATHER, 4, compute_s=compute_s, ici_bytes_s=gather_wire)
    assert seconds == pytest.approx(hidden)  # min(1 s of wire, 3/4 of the compute)
    sync = ASYNC_GATHER.replace("all-gather-start", "all-gather").replace("%agd = f32[1024]{0} all-gather-done(%ags)", "")
    assert hlo_cost.overlapped_collectives(sync, devices=4) == []


# ------------------------------------------------------------- compiled for a TPU topology


@pytest.fixture(scope="module")
def tpu():
    """A v4-8 slice's 4 compile-only chips (libtpu), one mesh axis over them."""
    import jax
    from jax.sharding import Mesh

    from runtime.compile_only import topology_devices

    gen, _, devices = topology_devices("v4-8")
    return jax, gen, Mesh(np.array(devices), ("x",))


def compiled(jax, fn, *shapes):
    c = jax.jit(fn).lower(*shapes).compile()
    return c.as_text(), c.cost_analysis()


def estimate(jax, gen, fn, *shapes):
    """(the HLO, the step estimate) of `fn` compiled for the topology, read as a train step's is."""
    from runtime.compile_only import cost_figures

    hlo, cost = compiled(jax, fn, *shapes)
    step = CompiledStep(hbm_bytes=1.0, total_bytes=0.0, **cost_figures(hlo, cost, gen, devices=4))
    return hlo, estimate_step(step, gen, model_flops=None)


@pytest.mark.slow
def test_compiled_u32_stride_2_loop_counts_every_iteration(tpu):
    """A bf16 2048^3 matmul in a loop whose u32 counter steps by 2 (as FSDP's collective matmuls
    do): 8 iterations below 16, 4 below 8, 16 below 32. The estimate is the compiler's time of the
    program with its body once, weighted by its per-op cycles: it grows by one body per iteration
    (affine in the trip count). (The unrolled program is not the same program: XLA copies the
    loop's carry in each iteration and fuses differently, so the estimates of the two differ.)"""
    jax, gen, mesh = tpu
    jnp = jax.numpy

    def loop(limit: int):
        def fn(x, w):
            body = lambda c: (c[0] + jnp.uint32(2), c[1] @ w)  # noqa: E731
            return jax.lax.while_loop(lambda c: c[0] < jnp.uint32(limit), body, (jnp.uint32(0), x))[1]
        return fn

    x = jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16, sharding=jax.NamedSharding(mesh, jax.P()))
    runs = {}
    for limit in (8, 16, 32):
        hlo, est = estimate(jax, gen, loop(limit), x, x)
        assert "u32[]" in hlo and trips_of_only_loop(hlo) == limit // 2
        assert "cycle estimates" in est.compute_from  # not the FLOP-ratio fallback of an unreadable loop
        runs[limit // 2] = est.compute_s
    per_iteration = (runs[8] - runs[4]) / 4
    assert per_iteration > 2 * 2048**3 / gen.peak_flops  # at least the matmul at peak
    assert runs[16] - runs[8] == pytest.approx(8 * per_iteration, rel=1e-6)


def trips_of_only_loop(hlo: str) -> float:
    comps, entry = hlo_cost.computations(hlo)
    counts, unreadable = hlo_cost.executions(comps, entry, loops_and_calls_only=True)
    (body,) = [name for name, lines in comps.items() for line in comps[entry] if f"body=%{name}" in line]
    assert not unreadable
    return counts[body]


def looped_and_unrolled(jax, body, trips: int):
    """`body` applied `trips` times: in a fori_loop, and as that many calls in a row."""
    def loop(x):
        return jax.lax.fori_loop(0, trips, lambda i, x: body(x), x)

    def unrolled(x):
        for _ in range(trips):
            x = body(x)
        return x

    return loop, unrolled


@pytest.mark.slow
def test_compiled_collective_in_a_loop_counts_every_iteration(tpu):
    """An all-reduce of a [256, 512] f32 shard in a 6-iteration loop: 6 x 512 KiB, as unrolled."""
    jax, gen, mesh = tpu
    jnp, P = jax.numpy, jax.P

    def step(x):
        return x * 0.5 + jnp.tanh(jax.lax.psum(x, "x"))

    loop, unrolled = looped_and_unrolled(jax, step, 6)
    x = jax.ShapeDtypeStruct((1024, 512), jnp.float32, sharding=jax.NamedSharding(mesh, P("x")))
    shard = functools.partial(jax.shard_map, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    expected = (6, 6 * 256 * 512 * 4)
    looped_hlo, _ = compiled(jax, shard(loop), x)
    flat_hlo, _ = compiled(jax, shard(unrolled), x)
    assert "while(" in looped_hlo and "while(" not in flat_hlo
    assert hlo_cost.collective_bytes(looped_hlo)["all-reduce"] == expected == hlo_cost.collective_bytes(flat_hlo)["all-reduce"]
    assert hlo_cost.wire_bytes(looped_hlo, 4) == pytest.approx(expected[1] * 2 * 3 / 4)


@pytest.mark.slow
def test_compiled_kernel_with_a_declared_cost_in_a_loop(tpu):
    """A Pallas kernel declaring 2.75 GFLOP and 1.2 MB, called 5 times in a loop: 5 x 10 us at
    v4's 275 TFLOP/s, and the same estimate as the 5 calls unrolled."""
    jax, gen, mesh = tpu
    jnp, P = jax.numpy, jax.P
    from jax.experimental import pallas as pl

    def double(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0

    def kernel(x):
        cost = pl.CostEstimate(flops=2_750_000_000, transcendentals=0, bytes_accessed=1_200_000)
        return pl.pallas_call(double, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), cost_estimate=cost)(x)

    loop, unrolled = looped_and_unrolled(jax, kernel, 5)
    x = jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=jax.NamedSharding(mesh, P()))
    shard = functools.partial(jax.shard_map, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    hlo, est = estimate(jax, gen, shard(loop), x)
    _, flat = estimate(jax, gen, shard(unrolled), x)
    (call,) = hlo_cost.kernels(hlo)
    assert call.runs == 5 and call.target == "tpu_custom_call"
    assert est.kernel_s == pytest.approx(5 * 2.75e9 / gen.peak_flops) == pytest.approx(flat.kernel_s)
    # the rest (the loop's counter and copies) is small beside the kernels: never negative, never the bulk
    assert est.kernel_s <= est.compute_s < 1.5 * est.kernel_s and est.kernel_share > 0.6
    assert flat.kernel_s <= flat.compute_s < 1.5 * flat.kernel_s


@pytest.mark.slow
def test_splash_attention_is_priced_by_the_blocks_it_visits(tpu):
    """jax's splash kernels declare no cost; models/attention.py prices each (PRICED_KERNELS):
    forward, dq and dkv do 2, 3 and 4 products of 2 x block^2 x head_dim FLOPs per visited block
    pair, on each chip's shard of the batch. A full mask's forward is the XLA form's two attention
    products (XLA's own count of that compile, an independent figure); a block-diagonal mask
    visits half the blocks: half the FLOPs."""
    jax, gen, mesh = tpu
    jnp, P = jax.numpy, jax.P
    from models.attention import splash_heads_major, xla_attention
    from runtime.sharding import activation_rules, make_mesh

    chips, heads, length, head_dim, block = 4, 4, 1024, 64, 512
    mesh = make_mesh({"data": chips, "fsdp": 1, "tensor": 1}, list(mesh.devices.flat))
    batch = jax.NamedSharding(mesh, P(("data", "fsdp")))
    heads_major = jax.ShapeDtypeStruct((chips, heads, length, head_dim), jnp.bfloat16, sharding=batch)
    full = np.ones((length, length), dtype=bool)
    diagonal = np.kron(np.eye(2, dtype=bool), np.ones((block, block), dtype=bool))

    def priced(mask):
        def loss(q, k, v):
            with activation_rules(mesh):  # as in a train step: the kernel runs per shard
                return splash_heads_major(q, k, v, mask).astype(jnp.float32).sum()
        hlo, est = estimate(jax, gen, jax.grad(loss, argnums=(0, 1, 2)), *(heads_major,) * 3)
        calls = dict(zip(("fwd", "dq", "dkv"), hlo_cost.kernels(hlo)))
        assert len(calls) == 3 and est.undeclared_kernels == 0 and est.kernel_s > 0
        return {name: k.flops for name, k in calls.items()}, hlo

    flops, hlo = priced(full)
    for name in ("splash_mha_fwd", "splash_mha_dq", "splash_mha_dkv"):
        assert name in hlo
    per_product = 2 * 1 * heads * length * length * head_dim  # one batch row per chip; all 4 block pairs
    assert flops == {"fwd": 2 * per_product, "dq": 3 * per_product, "dkv": 4 * per_product}
    rows_major = jax.ShapeDtypeStruct((chips, length, heads, head_dim), jnp.bfloat16, sharding=batch)
    xla_forward = compiled(jax, xla_attention, *(rows_major,) * 3)[1]["flops"]
    assert flops["fwd"] == pytest.approx(xla_forward, rel=0.05)  # the softmax's few FLOPs per score aside
    half, _ = priced(diagonal)
    assert half == {name: f / 2 for name, f in flops.items()}


@pytest.mark.slow
def test_auto_attention_compiled_for_tpu_is_splash_for_long_sequences_only(tpu):
    """arch.attention=auto is chosen where the step is lowered: for a TPU topology (from this CPU
    host) the splash kernels from SPLASH_MIN_LENGTH tokens, XLA's form below."""
    jax, gen, mesh = tpu
    jnp = jax.numpy
    from models.attention import SPLASH_MIN_LENGTH
    from models.recursive_reasoning.layers import Attention
    from runtime.sharding import activation_rules, make_mesh

    mesh = make_mesh({"data": 4, "fsdp": 1, "tensor": 1}, list(mesh.devices.flat))
    module = Attention(128, 2, jnp.bfloat16, "auto")
    kernels = {}
    for length in (SPLASH_MIN_LENGTH - 1, SPLASH_MIN_LENGTH):
        x = jax.ShapeDtypeStruct((4, length, 128), jnp.bfloat16, sharding=jax.NamedSharding(mesh, jax.P("data")))
        params = jax.eval_shape(module.init, jax.random.key(0), x)

        def forward(p, x):
            with activation_rules(mesh):
                return module.apply(p, x)
        kernels[length] = len(hlo_cost.kernels(compiled(jax, forward, params, x)[0]))
    assert kernels == {SPLASH_MIN_LENGTH - 1: 0, SPLASH_MIN_LENGTH: 1}


@pytest.mark.slow
def test_the_mlp_t_kernel_declares_its_products_and_auto_uses_it_on_tpu(tpu):
    """arch.mixer=auto compiled for a TPU topology is the fused kernel (forward and backward, per
    chip's batch shard), and each declares the FLOPs of its products with the sequence padded to
    the MXU's 128: 3 products forward, 9 backward. The forward's against XLA's own count of its
    einsum form: the same products, unpadded (the norm's few FLOPs per element aside)."""
    jax, gen, mesh = tpu
    jnp, P = jax.numpy, jax.P
    from models.recursive_reasoning.layers import SequenceMixer
    from runtime.sharding import activation_rules, make_mesh

    chips, rows, length, features = 4, 2, 97, 256
    mesh = make_mesh({"data": chips, "fsdp": 1, "tensor": 1}, list(mesh.devices.flat))
    h = jax.ShapeDtypeStruct((chips * rows, length, features), jnp.bfloat16,
                             sharding=jax.NamedSharding(mesh, P(("data", "fsdp"))))

    def grads(form):
        module = SequenceMixer(length, 4.0, jnp.bfloat16, form=form)
        params = jax.eval_shape(module.init, jax.random.key(0), h)

        def loss(p, h):
            with activation_rules(mesh):
                return module.apply(p, h).astype(jnp.float32).sum()
        return compiled(jax, jax.value_and_grad(loss, argnums=(0, 1)), params, h)[0], module, params

    hlo, module, params = grads("auto")
    inter = params["params"]["down"].value.shape[0]
    calls = {k.flops for k in hlo_cost.kernels(hlo)}
    per_product = 2 * rows * features * 128 * inter
    assert calls == {3 * per_product, 9 * per_product}
    assert "mlp_t_mixer_fwd" in hlo and "mlp_t_mixer_bwd" in hlo
    assert not hlo_cost.kernels(grads("xla")[0])
    half = jax.ShapeDtypeStruct(h.shape, jnp.float16, sharding=h.sharding)
    module16 = SequenceMixer(length, 4.0, jnp.float16, form="auto")
    params16 = jax.eval_shape(module16.init, jax.random.key(0), half)

    def forward16(p, h):
        with activation_rules(mesh):
            return module16.apply(p, h)
    assert not hlo_cost.kernels(compiled(jax, forward16, params16, half)[0])  # float16: XLA's form

    def forward(p, h):
        with activation_rules(mesh):
            return module.clone(form="xla").apply(p, h)
    xla_flops = compiled(jax, forward, params, h)[1]["flops"]
    assert 3 * per_product * length / 128 == pytest.approx(xla_flops, rel=0.05)


def test_libtpu_defaults_keep_the_users_own_flags():
    from runtime.libtpu_flags import DEFAULTS, apply, with_defaults

    flag = DEFAULTS[0][0]
    added = with_defaults("--xla_foo=1")
    assert added.startswith("--xla_foo=1 ") and all(f"--{f}={v}" in added for f, v in DEFAULTS)
    assert with_defaults(added) == added  # once only
    users = with_defaults(f"--{flag}=true")
    assert f"--{flag}=true" in users and f"--{flag}=false" not in users
    env = {}
    apply(env)
    assert env["LIBTPU_INIT_ARGS"] == with_defaults("")


@pytest.mark.slow
def test_an_fsdp_einsum_is_gathered_then_multiplied_not_split_into_a_collective_matmul():
    """runtime/libtpu_flags.py: compiled for a TPU topology (libtpu started by topology_devices, with
    the run's options), a product with an FSDP-sharded weight all-gathers the weight and multiplies
    once; XLA's collective matmul would be a loop of collective-permutes and partial products."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from runtime.compile_only import topology_devices

    _, _, devices = topology_devices("v5e-8")
    mesh = Mesh(np.array(devices), ("fsdp",))
    x = jax.ShapeDtypeStruct((64, 2048, 2048), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
    w = jax.ShapeDtypeStruct((2048, 8192), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
    hlo = jax.jit(lambda x, w: x @ w, out_shardings=NamedSharding(mesh, P("fsdp"))).lower(x, w).compile().as_text()
    assert "all-gather" in hlo and "collective-permute" not in hlo and not re.search(r"\bwhile\(", hlo)


@pytest.mark.slow
def test_a_compiled_fsdp_loop_prices_its_async_gathers_as_overlapped():
    """An FSDP layer loop compiled for v5e-8 gathers the next weights asynchronously (TPU's async
    collective fusions) while a layer computes: the estimate's collective time is the wire time
    less what those gathers overlap, and never below the collectives left synchronous."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from runtime.compile_only import cost_figures, topology_devices

    gen, _, devices = topology_devices("v5e-8")
    mesh = Mesh(np.array(devices), ("fsdp",))
    w1 = jax.ShapeDtypeStruct((2, 512, 2048), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "fsdp", None)))
    w2 = jax.ShapeDtypeStruct((2, 2048, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, None, "fsdp")))
    x = jax.ShapeDtypeStruct((64, 128, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))

    def loss(w1, w2, x):
        def layer(h, w):
            return h + jnp.einsum("btf,fd->btd", jax.nn.gelu(jnp.einsum("btd,df->btf", h, w[0])), w[1]), None
        return jnp.mean(jax.lax.scan(layer, x, (w1, w2))[0].astype(jnp.float32) ** 2)

    c = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(w1, w2, x).compile()
    hlo = c.as_text()
    step = CompiledStep(hbm_bytes=1.0, total_bytes=0.0, **cost_figures(hlo, c.cost_analysis(), gen, devices=8))
    est = estimate_step(step, gen, model_flops=None)
    windows = hlo_cost.overlapped_collectives(hlo, devices=8)
    assert windows and all(runs == 2 for _, _, runs in windows)  # in the layer loops, every iteration
    ici = gen.ici_gbytes_s * 1e9
    async_s = sum(runs * nbytes for nbytes, _, runs in windows) / ici
    assert 0 < step.hidden_collective_s <= async_s < step.wire_bytes / ici
    assert est.collective_s == pytest.approx(step.wire_bytes / ici - step.hidden_collective_s)
