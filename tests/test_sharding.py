"""runtime/sharding.py: one table (LOGICAL_AXIS_RULES) resolved by flax's logical rules decides the
sharding of parameters, the batch, the carry and Gemma's residual stream; a dimension its mesh axes
do not divide is replicated; the mesh comes from jax.make_mesh on CPU and TPU topologies."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from omegaconf import OmegaConf

from helpers import REPO
from runtime import sharding
from runtime.sharding import logical_shardings, logical_spec, make_mesh


def mesh(data=1, fsdp=4, tensor=2):
    return make_mesh({"data": data, "fsdp": fsdp, "tensor": tensor}, jax.devices()[:data * fsdp * tensor])


def test_cpu_mesh_axes_and_device_order():
    m = mesh(2, 2, 2)
    assert m.axis_names == ("data", "fsdp", "tensor") and dict(m.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert all(t == jax.sharding.AxisType.Auto for t in m.axis_types)  # shardings stay hints to XLA
    assert [d.id for d in m.devices.flat] == [d.id for d in jax.devices()[:8]]


@pytest.mark.parametrize("topology,shape", [("v5e-8", (1, 8, 1)), ("v5e-8", (2, 2, 2)), ("v4-64", (32, 1, 1)),
                                            ("v4-64", (2, 2, 8))])  # 2x2x8 splits a physical axis of 2x4x4
def test_topology_mesh(topology, shape):
    from runtime.compile_only import topology_devices

    _, _, devices = topology_devices(topology)
    m = make_mesh(dict(zip(sharding.MESH_AXES, shape)), devices)
    assert m.devices.shape == shape and sorted(d.id for d in m.devices.flat) == sorted(d.id for d in devices)


def test_non_dividing_dim_is_replicated():
    m = mesh(1, 4, 2)
    assert logical_spec(("vocab", "embed"), m, (12, 16)) == P("tensor", "fsdp")
    assert logical_spec(("vocab", "embed"), m, (11, 16)) == P(None, "fsdp")  # 11 over tensor=2: replicated
    # A replicated dim releases its axes: embed may take fsdp once the 10 puzzle rows cannot.
    assert logical_spec(("puzzle", "embed"), m, (12, 16)) == P(("data", "fsdp"), None)
    assert logical_spec(("puzzle", "embed"), m, (10, 16)) == P(None, "fsdp")
    assert logical_spec(("lora_rank", "embed"), m, (3, 16)) == P(None, "fsdp")  # not in the table: replicated

    tree = {"embed": nn.LogicallyPartitioned(jax.ShapeDtypeStruct((11, 16), jnp.float32), ("vocab", "embed")),
            "step": jax.ShapeDtypeStruct((), jnp.int32)}
    shardings = logical_shardings(tree, m)
    assert shardings["embed"].spec == P(None, "fsdp") and shardings["step"].spec == P()
    placed = jax.device_put(jnp.ones((11, 16)), shardings["embed"])
    assert placed.addressable_shards[0].data.shape == (11, 4)


def test_batch_and_carry_specs_follow_the_batch_rule(monkeypatch):
    from runtime.train_step import abstract_batch, batch_shardings, carry_shardings

    m = mesh(2, 2, 2)
    carry = {"z": jax.ShapeDtypeStruct((8, 5, 3), jnp.float32), "halted": jax.ShapeDtypeStruct((8,), jnp.bool_)}

    def specs():
        return ({k: s.spec for k, s in batch_shardings(m, {"inputs": 2, "ids": 1}).items()},
                {k: s.spec for k, s in carry_shardings(carry, m).items()},
                abstract_batch(m, 8, 5, {"inputs": 2})["inputs"].sharding.spec,
                sharding.batch_sharding(m, 1).spec)

    assert specs() == ({"inputs": P(("data", "fsdp"), None), "ids": P(("data", "fsdp"))},
                       {"z": P(("data", "fsdp"), None, None), "halted": P(("data", "fsdp"))},
                       P(("data", "fsdp"), None), P(("data", "fsdp")))
    rules = tuple((name, ("data", "tensor") if name == "batch" else target)
                  for name, target in sharding.LOGICAL_AXIS_RULES)
    monkeypatch.setattr(sharding, "LOGICAL_AXIS_RULES", rules)
    assert specs() == ({"inputs": P(("data", "tensor"), None), "ids": P(("data", "tensor"))},
                       {"z": P(("data", "tensor"), None, None), "halted": P(("data", "tensor"))},
                       P(("data", "tensor"), None), P(("data", "tensor")))


def _gemma_train_jaxpr(m):
    from models.gemma.config import GemmaConfig
    from models.gemma.task import GemmaTask
    from runtime.train_step import abstract_batch, build_steps

    raw = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "arch" / "gemma_tiny.yaml"))
    raw.pop("defaults")
    cfg = GemmaConfig(**(raw | {"dtype": "float32"}))
    steps = build_steps(GemmaTask(cfg), optax.adamw(1e-3), lambda s: 1e-3, m, 16, None, global_batch=8)
    batch = abstract_batch(m, 8, 16, steps.batch_fields)
    return cfg, jax.make_jaxpr(steps.train)(steps.abstract_state, batch)


def _constraints(jaxpr):
    """(shape, spec) of every sharding_constraint, inner jaxprs (scan, remat, grad) included."""
    found = []

    def walk(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name == "sharding_constraint":
                found.append((eqn.outvars[0].aval.shape, eqn.params["sharding"].spec))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr.jaxpr)
    return found


def test_gemma_residual_constraint_in_train_step(monkeypatch):
    m = mesh(2, 4, 1)
    cfg, jaxpr = _gemma_train_jaxpr(m)
    residual = (8, 16, cfg.embed_dim)
    specs = {spec for shape, spec in _constraints(jaxpr) if shape == residual}
    assert specs == {P(("data", "fsdp"), None, None)}  # batch over data x fsdp, embed not sharded

    # The names resolve through the same table: change the batch rule and the constraint follows.
    rules = tuple((name, "data" if name == "batch" else target) for name, target in sharding.LOGICAL_AXIS_RULES)
    monkeypatch.setattr(sharding, "LOGICAL_AXIS_RULES", rules)
    _, jaxpr = _gemma_train_jaxpr(m)
    assert {spec for shape, spec in _constraints(jaxpr) if shape == residual} == {P("data", None, "fsdp")}


def test_gemma_without_rules_has_no_constraint():
    """Outside a train/eval step (decoding, plain apply) the residual names are a no-op."""
    from models.gemma import Gemma
    from models.gemma.config import GemmaConfig

    raw = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "arch" / "gemma_tiny.yaml"))
    raw.pop("defaults")
    model = Gemma(GemmaConfig(**(raw | {"dtype": "float32"})))
    tokens = jnp.asarray(np.arange(16).reshape(2, 8) % 7, jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), tokens)
    assert not _constraints(jax.make_jaxpr(model.apply)(params, tokens))
