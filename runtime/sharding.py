"""The device mesh and the one table that maps logical axis names to mesh axes.

Models name every parameter dimension ("embed", "mlp", "heads", "vocab", ...); the batch, the
carry and activations use "batch", "length" and "embed". `LOGICAL_AXIS_RULES` is the only place
that decides which mesh axis shards which logical axis (as in MaxText), resolved by flax's
logical-rules machinery (`nn.logical_to_mesh_axes`, `nn.logical_axis_rules`,
`nn.with_logical_constraint`). One addition to flax's resolution: a dimension that does not
divide over its mesh axes is replicated instead (e.g. a vocabulary of 11 over tensor=2) and its
rule is released, so another dimension may take those axes. A mesh axis of size 1 stays in the
specs (e.g. ('data', 'fsdp') on fsdp=1): it splits nothing.

`describe` lists every parameter's sharding so such a fallback is visible.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, Iterator, Sequence, cast

import flax.linen as nn
import jax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "tensor")

# In priority order: within one array flax gives a mesh axis to the first rule that claims it, so
# "batch" and "puzzle" (rows over every batch device) come before "embed": activations
# [batch, length, embed] and the puzzle table [puzzle, embed] keep fsdp on their first dimension.
LOGICAL_AXIS_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),  # tensor replicas share a batch shard
    ("puzzle", ("data", "fsdp")),  # puzzle-embedding rows: large tables are split over all batch devices
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("vocab", "tensor"),
    ("length", None),
    ("head_dim", None),
    ("qkv", None),
    ("gate", None),
)

Rules = Sequence[tuple[str, Any]]


def make_mesh(shape: dict[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with axes (data, fsdp, tensor); `shape` comes from `config.resolve_mesh_shape`.

    `jax.make_mesh` places devices topology-aware on TPU (neighbouring mesh coordinates on
    neighbouring chips) and in order elsewhere. Axes are Auto: shardings are hints to XLA's
    propagation, not part of the types.
    """
    devices = list(jax.devices() if devices is None else devices)
    dims = tuple(shape[a] for a in MESH_AXES)
    auto = (AxisType.Auto,) * len(MESH_AXES)
    try:
        return jax.make_mesh(dims, MESH_AXES, axis_types=auto, devices=devices)
    except NotImplementedError:
        # jax.make_mesh splits a physical axis only on v5e; other TPUs need it for e.g. 2x2x8 on 2x4x4.
        grid = mesh_utils.create_device_mesh(dims, devices, allow_split_physical_axes=True)
        return Mesh(grid, MESH_AXES, axis_types=auto)


def _axes(target: Any) -> tuple[str, ...]:
    """A rule's or spec entry's mesh axes as a tuple (None -> ())."""
    if target is None:
        return ()
    return (target,) if isinstance(target, str) else tuple(target)


def mesh_rules(mesh: Mesh, rules: Rules | None = None) -> tuple[tuple[str, Any], ...]:
    """`rules` (default LOGICAL_AXIS_RULES, read at call time) for this mesh: axes it lacks dropped."""
    out = []
    for name, target in LOGICAL_AXIS_RULES if rules is None else rules:
        axes = tuple(a for a in _axes(target) if a in mesh.shape)
        out.append((name, axes[0] if len(axes) == 1 else (axes or None)))
    return tuple(out)


def logical_spec(names: Sequence[str | None], mesh: Mesh, shape: Sequence[int] | None = None,
                 rules: Rules | None = None) -> P:
    """Logical names -> PartitionSpec through flax's rules; with `shape`, any dim its mesh axes do
    not divide is replicated (its rule released, so another dim may take those axes)."""
    rules = list(mesh_rules(mesh, rules))
    names = tuple(names)
    if shape is not None:  # one name per dim (a box may carry more names than e.g. a factored moment has dims)
        names = (names + (None,) * len(shape))[:len(shape)]
    while True:
        spec = cast(P, nn.logical_to_mesh_axes(names, rules))  # None only for names=None
        if shape is None:
            return spec
        bad = next((i for i, (dim, target) in enumerate(zip(shape, spec))
                    if dim % math.prod(mesh.shape[a] for a in _axes(target))), None)
        if bad is None:
            return spec
        rules.remove((cast(str, names[bad]), spec[bad]))  # a dim named None is replicated, never bad


def logical_sharding(names: Sequence[str | None], mesh: Mesh, shape: Sequence[int] | None = None) -> NamedSharding:
    return NamedSharding(mesh, logical_spec(names, mesh, shape))


def logical_shardings(abstract_tree: Any, mesh: Mesh) -> Any:
    """NamedShardings for a tree whose leaves may be `nn.LogicallyPartitioned` boxes.

    Unboxed leaves (step counters, optimizer scalars) are replicated.
    """

    def one(leaf):
        if isinstance(leaf, nn.LogicallyPartitioned):
            return logical_sharding(leaf.names, mesh, leaf.value.shape)
        return NamedSharding(mesh, P())

    return jax.tree.map(one, abstract_tree, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


def batch_spec(mesh: Mesh, ndim: int, shape: Sequence[int] | None = None) -> P:
    """An array with the batch first (a batch field, a carry leaf): the table's "batch" rule on dim 0."""
    return logical_spec(("batch",) + (None,) * (ndim - 1), mesh, shape)


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    return NamedSharding(mesh, batch_spec(mesh, ndim))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


@contextlib.contextmanager
def activation_rules(mesh: Mesh) -> Iterator[None]:
    """Enter inside a function being traced: `nn.with_logical_constraint` in a model then resolves
    its logical names through LOGICAL_AXIS_RULES on `mesh` (outside it, such constraints are no-ops).

    Only the abstract mesh is set (a concrete one may not be set under jit); the shardings of the
    jitted function's arguments name the devices.
    """
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nn.logical_axis_rules(mesh_rules(mesh)):
        yield


def describe(params: Any) -> str:
    """One line per parameter: path, shape, dtype, partition spec."""
    lines = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        spec = getattr(getattr(leaf, "sharding", None), "spec", None)
        lines.append(f"  {jax.tree_util.keystr(path):<60} {str(leaf.shape):<18} {leaf.dtype} {spec}")
    return "\n".join(lines)
