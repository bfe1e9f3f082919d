"""The device mesh and the one table that maps logical axis names to mesh axes.

Models name every parameter dimension ("embed", "mlp", "heads", "vocab", ...); activations
use "batch" and "length". `LOGICAL_AXIS_RULES` is the only place that decides which mesh
axis shards which logical axis (as in MaxText). A dimension that does not divide over its
mesh axes is replicated instead (e.g. a vocabulary of 11 over tensor=2); `describe` lists
every parameter's sharding so such a fallback is visible.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # the batch is split over these; tensor replicas share a shard

LOGICAL_AXIS_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", BATCH_AXES),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("vocab", "tensor"),
    ("puzzle", BATCH_AXES),  # puzzle-embedding rows: large tables are split over all batch devices
    ("length", None),
    ("head_dim", None),
    ("qkv", None),
    ("gate", None),
)


def make_mesh(shape: dict[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with axes (data, fsdp, tensor); `shape` comes from `config.resolve_mesh_shape`."""
    devices = list(jax.devices() if devices is None else devices)
    dims = [shape[a] for a in MESH_AXES]
    if devices[0].platform == "tpu":
        # Topology-aware placement: neighbouring mesh coordinates sit on neighbouring chips.
        grid = mesh_utils.create_device_mesh(dims, devices, allow_split_physical_axes=True)
    else:
        grid = np.asarray(devices).reshape(dims)
    return Mesh(grid, MESH_AXES)


def _spec_for(shape: tuple[int, ...], logical: Sequence[str | None], mesh: Mesh) -> P:
    """Logical names -> PartitionSpec, replicating any dim its mesh axes do not divide."""
    rules = dict(LOGICAL_AXIS_RULES)
    used: set[str] = set()
    spec = []
    for dim, name in zip(shape, logical):
        target = rules.get(name) if name is not None else None
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        axes = tuple(a for a in axes if a not in used and mesh.shape[a] > 1)
        size = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
        if not axes or dim % size:
            spec.append(None)
            continue
        used.update(axes)
        spec.append(axes[0] if len(axes) == 1 else axes)
    return P(*spec)


def logical_shardings(abstract_tree: Any, mesh: Mesh) -> Any:
    """NamedShardings for a tree whose leaves may be `nn.LogicallyPartitioned` boxes.

    Unboxed leaves (step counters, optimizer scalars) are replicated.
    """

    def one(leaf):
        if isinstance(leaf, nn.LogicallyPartitioned):
            return NamedSharding(mesh, _spec_for(leaf.value.shape, leaf.names, mesh))
        return NamedSharding(mesh, P())

    return jax.tree.map(one, abstract_tree, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def describe(params: Any) -> str:
    """One line per parameter: path, shape, dtype, partition spec."""
    lines = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        spec = getattr(getattr(leaf, "sharding", None), "spec", None)
        lines.append(f"  {jax.tree_util.keystr(path):<60} {str(leaf.shape):<18} {leaf.dtype} {spec}")
    return "\n".join(lines)
