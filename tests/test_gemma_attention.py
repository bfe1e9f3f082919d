"""Gemma's fused attention (arch.attention=splash: jax's splash kernel, Pallas' interpreter on CPU)
against its dense form: logits, loss and gradients for Gemma 1 (MHA), 2 (MQA, local windows, the
soft-cap) and 3 (GQA, QK-norm, local windows), packed and unpacked, at a length that crosses the
local windows and pads to the kernel's 128. And what `auto` picks: dense on CPU, splash for TPU."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.gemma import Gemma
from test_gemma_model import CONFIGS, random_params, tokens_for

LENGTH = 40  # > every test window (3, 4); padded to 128 in the kernel
SEGMENTS = (np.arange(LENGTH) >= 15).astype(np.int32)[None].repeat(2, 0)  # two packed segments, 15 + 25
POSITIONS = np.where(SEGMENTS == 0, np.arange(LENGTH), np.arange(LENGTH) - 15).astype(np.int32)


def loss_logits_grads(cfg, form, params, tokens, packed):
    cfg = dataclasses.replace(cfg, attention=form)
    extra = (jnp.asarray(POSITIONS), jnp.asarray(SEGMENTS)) if packed else ()

    def loss(p):
        logits = Gemma(cfg).apply({"params": p}, tokens, *extra)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], -1)), logits

    (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return value, logits, grads


@pytest.mark.slow
@pytest.mark.parametrize("name,packed", [("v1_mha", False), ("v2_mqa", True), ("v3_gqa", True)])
def test_splash_equals_dense(name, packed):
    cfg = CONFIGS[name]
    params, tokens = random_params(cfg), tokens_for(cfg, (2, LENGTH))
    dense = loss_logits_grads(cfg, "xla", params, tokens, packed)
    fused = loss_logits_grads(cfg, "splash", params, tokens, packed)
    np.testing.assert_allclose(fused[0], dense[0], rtol=1e-5)
    np.testing.assert_allclose(fused[1], dense[1], rtol=1e-5, atol=1e-5)
    for g_fused, g_dense in zip(jax.tree.leaves(fused[2]), jax.tree.leaves(dense[2])):
        np.testing.assert_allclose(g_fused, g_dense, rtol=1e-4, atol=1e-6)


def kernel_calls(cfg, form, tokens):
    cfg = dataclasses.replace(cfg, attention=form)
    params = random_params(cfg)
    return str(jax.make_jaxpr(lambda p: Gemma(cfg).apply({"params": p}, tokens))(params)).count("pallas_call")


def test_auto_is_dense_on_cpu_and_splash_asks_for_the_kernel():
    cfg = dataclasses.replace(CONFIGS["v2_mqa"], num_layers=2)
    tokens = tokens_for(cfg, (1, 512))  # long enough for auto's kernel on TPU (SPLASH_MIN_LENGTH)
    assert kernel_calls(cfg, "auto", tokens) == 0
    assert kernel_calls(cfg, "splash", tokens) == 2  # the global and the local layer's kernel, one scanned body


@pytest.mark.slow
def test_auto_traced_for_a_tpu_topology_runs_the_local_layers_kernel_too():
    """Gemma 2's local windows shorter than the sequence: traced for a TPU mesh, `auto` is the
    splash form with both kernels (global and local, under lax.cond), not the dense one."""
    from runtime.compile_only import topology_devices
    from runtime.sharding import activation_rules, make_mesh

    _, _, devices = topology_devices("v4-8")
    mesh = make_mesh({"data": 4, "fsdp": 1, "tensor": 1}, list(devices))
    cfg = dataclasses.replace(CONFIGS["v2_mqa"], num_layers=2)
    assert cfg.sliding_window is not None and cfg.sliding_window < 512
    tokens = tokens_for(cfg, (4, 512))
    params = random_params(cfg)
    def kernels(form):
        with activation_rules(mesh):
            jaxpr = jax.make_jaxpr(lambda p: Gemma(dataclasses.replace(cfg, attention=form)).apply({"params": p}, tokens))(params)
        return str(jaxpr).count("pallas_call")
    assert kernels("auto") == kernels("splash") > 0 == kernels("xla")  # each form traced (platform_dependent)


@pytest.mark.slow
def test_auto_compiled_for_a_tpu_topology_is_splash():
    """Compiled for a v4-8 slice from this host (compile_only's libtpu devices), `auto` lowers the
    splash kernels (forward, dq, dkv), each priced (PRICED_KERNELS) by its causal blocks."""
    from runtime import hlo_cost
    from runtime.compile_only import topology_devices
    from runtime.sharding import activation_rules, make_mesh

    _, _, devices = topology_devices("v4-8")
    mesh = make_mesh({"data": 4, "fsdp": 1, "tensor": 1}, list(devices))
    cfg = dataclasses.replace(CONFIGS["v1_mha"], num_layers=1, head_dim=128, dtype="bfloat16")
    tokens = jax.ShapeDtypeStruct((4, 512), jnp.int32, sharding=jax.NamedSharding(mesh, jax.P("data")))
    params = jax.eval_shape(lambda: random_params(cfg))

    def loss(p, t):
        with activation_rules(mesh):
            return Gemma(cfg).apply({"params": p}, t).sum()

    hlo = jax.jit(jax.grad(loss)).lower(params, tokens).compile().as_text()
    calls = hlo_cost.kernels(hlo)
    assert len(calls) == 3 and all(k.flops for k in calls)
    # causal at 512 tokens in one 512 block: the one block pair, all of it computed (the kernel masks inside it)
    fwd = next(k for k in calls if k.flops == min(k.flops for k in calls))
    assert fwd.flops == 2 * 2 * 512 * 512 * 128 * cfg.num_heads


GATHERED_MLP = re.compile(r'op_name="[^"]*/mlp/(?:gating_einsum|linear)/')
_LAYOUT = re.compile(r"\[([\d,]+)\](\{[^{}]*\})")  # an array's dims and layout


def gathered_mlp_relayouts(hlo: str) -> tuple[int, list[str]]:
    """(gathers of an MLP weight, copies that change such a gathered weight's layout) in compiled
    TPU HLO text. A gather: an all-gather or the done half of an async one, its op_name that of a
    `gating_einsum` or `linear` product; through get-tuple-element, bitcast and reshape. A copy
    that only moves it to another memory space (the prefetch of a copy-start, `S(1)`) is no relayout."""
    from runtime import hlo_cost

    comps, _ = hlo_cost.computations(hlo)
    gathers, copies = 0, []
    for lines in comps.values():
        ins = {m.group(1): m for line in lines for m in [hlo_cost._INSTR.match(line)] if m}
        operands = {name: {o.strip().split(" ")[-1].lstrip("%") for o in m.group(4).split(",")} for name, m in ins.items()}
        gathered = {name for name, m in ins.items() if GATHERED_MLP.search(m.group(0))
                    and (m.group(3) in ("all-gather", "all-gather-done") or name.startswith("async-collective-done"))}
        gathers += len(gathered)
        while more := {n for n, m in ins.items() if n not in gathered and m.group(3) in ("get-tuple-element", "bitcast", "reshape")
                       and operands[n] & gathered}:
            gathered |= more
        for name, m in ins.items():
            if not (m.group(3) in ("copy", "copy-start", "transpose") and operands[name] & gathered):
                continue
            source = next((_LAYOUT.search(ins[o].group(2)) for o in operands[name] & gathered if o in ins), None)
            if source is None:
                continue
            layouts = {re.sub(r"S\(\d+\)", "", layout) for dims, layout in _LAYOUT.findall(m.group(2)) if dims == source[1]}
            if layouts != {re.sub(r"S\(\d+\)", "", source[2])}:
                copies.append(m.group(0)[:160])
    return gathers, copies


@pytest.mark.slow
def test_gemma1_gathered_mlp_weights_need_no_relayout_copy_on_v5e():
    """gemma2b_full_v5e8's train step compiled for a v5e-8 (two layers, a small table, the widths
    of Gemma 1 2B): each layer's `gating_einsum` and `linear` weights are gathered straight into
    the layout their products read, no copy after the gather (docs/ARCHITECTURE.md, Gemma's attention)."""
    from helpers import compose_config
    from runtime.builder import plan_and_build
    from runtime.compile_only import topology_devices
    from runtime.config import resolve_compute_dtype
    from runtime.registry import dataset_kind
    from runtime.train_step import abstract_batch

    _, _, devices = topology_devices("v5e-8")
    config = compose_config(["+experiment=gemma_sft/gemma2b_full_v5e8", "compile_only=v5e-8", "arch.num_layers=2",
                             "arch.vocab_size=4096", "arch.real_vocab_size=null",
                             "data.seq_len=128", "train.global_batch_size=8"])  # the weights' layouts, not the tokens', decide
    config = resolve_compute_dtype(config, devices[0].platform)
    shape = dataset_kind(config.data.name).planned_shape(config.data, config)
    plan, mesh, steps = plan_and_build(config, devices=devices, num_processes=1, shape=shape)
    batch = abstract_batch(mesh, plan.global_batch_size, shape.seq_len, steps.batch_fields, steps.batch_shapes)
    hlo = steps.train.lower(steps.abstract_state, batch).compile().as_text()
    gathers, copies = gathered_mlp_relayouts(hlo)
    assert gathers >= 2 and not copies, copies  # forward and rematerialised backward gather both weights
