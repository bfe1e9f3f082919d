"""What the Pallas kernels (models/attention.py's splash, models/recursive_reasoning/mixer_kernel.py)
share: the TPU's 128-wide tile, and running a kernel on each shard of its activations.

A Pallas call is not partitioned by XLA: under a mesh of more than one device each kernel runs on
its own shard (shard_map), the activations split as the logical-axis table says
(runtime/sharding.py), other arguments whole on every shard.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import jax
from jax.sharding import PartitionSpec

from runtime.sharding import logical_spec

TILE = 128  # the TPU's lane width and the MXU's tile: a kernel's blocks are multiples of it


def round_up(n: int, multiple: int = TILE) -> int:
    """The smallest multiple of `multiple` that is >= n."""
    return -(-n // multiple) * multiple


def activation_spec(logical_axes: Sequence[Optional[str]], shape: Sequence[int]) -> Optional[PartitionSpec]:
    """How the mesh in use splits an activation of `shape` with these logical axes; None when there
    is no mesh of more than one device (a kernel then runs on the whole array)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or math.prod(mesh.shape.values()) == 1:
        return None
    return logical_spec(tuple(logical_axes), mesh, tuple(shape))


def per_shard(fn: Callable, spec: Optional[PartitionSpec], split_args: Sequence[bool],
              split_out: bool | Sequence[bool], *, sum_whole_outputs: bool = False) -> Callable:
    """`fn` run on each shard: an argument (an output) marked True in `split_args` (`split_out`) is
    split as `spec`, the others are whole on every shard. `sum_whole_outputs`: a whole output (a
    weight's gradient from one shard's activations) is summed over the mesh axes `spec` splits.
    `spec` None (from `activation_spec`: no mesh): `fn` itself."""
    if spec is None:
        return fn
    whole = PartitionSpec()
    axes = tuple(a for entry in spec if entry for a in (entry if isinstance(entry, tuple) else (entry,)))

    def specs(split):
        return tuple(spec if s else whole for s in split) if isinstance(split, (tuple, list)) else (spec if split else whole)

    def local(*args):
        out = fn(*args)
        if sum_whole_outputs and axes:
            out = tuple(o if s else jax.lax.psum(o, axes) for o, s in zip(out, split_out))
        return out

    return jax.shard_map(local, mesh=jax.sharding.get_abstract_mesh(), in_specs=specs(split_args),
                         out_specs=specs(split_out), check_vma=False)
