"""Model zoo. `ARCH_SCHEMAS` maps an arch family name to its typed config; `build_model`
turns a validated arch config plus the dataset's shapes into a Flax module.

Parameters carry logical axis names (flax `with_logical_partitioning`); the runtime maps them
to mesh axes with the rules in `runtime/sharding.py`.
"""

from __future__ import annotations

from typing import Any

from models.tiny_transformer import TinyTransformer, TinyTransformerConfig

ARCH_SCHEMAS: dict[str, type] = {
    "tiny_transformer": TinyTransformerConfig,
}


def build_model(arch: Any, *, vocab_size: int, seq_len: int):
    if isinstance(arch, TinyTransformerConfig):
        return TinyTransformer(arch, vocab_size=vocab_size, seq_len=seq_len)
    raise ValueError(f"no model for arch config {type(arch).__name__}")
