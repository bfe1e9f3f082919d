"""A small bidirectional transformer over puzzle tokens.

A test model for exercising the runtime (sharding, train loop, checkpoints) with real
arithmetic; the recursive-reasoning models replace it for experiments. Every parameter is
annotated with logical axis names so the same sharding rules apply as for the real models.
"""

from __future__ import annotations

from dataclasses import dataclass

import flax.linen as nn
import jax.numpy as jnp

from runtime.frozen import Freezable
from models.layers import Attention, MlpBlock, dtype_from_name


@dataclass
class TinyTransformerConfig(Freezable):
    name: str = "tiny_transformer"
    hidden: int = 64
    heads: int = 4
    layers: int = 2
    mlp_ratio: int = 4
    dtype: str = "float32"  # forward (activation) dtype; parameters stay float32


class Block(nn.Module):
    cfg: TinyTransformerConfig

    @nn.compact
    def __call__(self, x):
        dtype = dtype_from_name(self.cfg.dtype)
        h = nn.RMSNorm(dtype=dtype, scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)))(x)
        x = x + Attention(self.cfg.hidden, self.cfg.heads, dtype)(h)
        h = nn.RMSNorm(dtype=dtype, scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)))(x)
        return x + MlpBlock(self.cfg.hidden * self.cfg.mlp_ratio, dtype)(h)


class TinyTransformer(nn.Module):
    cfg: TinyTransformerConfig
    vocab_size: int
    seq_len: int

    @nn.compact
    def __call__(self, tokens):  # tokens [B, L] int32 -> logits [B, L, V] float32
        dtype = dtype_from_name(self.cfg.dtype)
        init = nn.initializers.normal(stddev=self.cfg.hidden**-0.5)
        embed = self.param("embed", nn.with_logical_partitioning(init, ("vocab", "embed")),
                           (self.vocab_size, self.cfg.hidden))
        pos = self.param("pos_embed", nn.with_logical_partitioning(init, ("length", "embed")),
                         (self.seq_len, self.cfg.hidden))
        x = (jnp.take(embed, tokens, axis=0) + pos[None]).astype(dtype)
        for _ in range(self.cfg.layers):
            x = Block(self.cfg)(x)
        x = nn.RMSNorm(dtype=dtype, scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)))(x)
        head = self.param("head", nn.with_logical_partitioning(nn.initializers.zeros, ("embed", "vocab")),
                          (self.cfg.hidden, self.vocab_size))
        return jnp.einsum("ble,ev->blv", x, head.astype(dtype)).astype(jnp.float32)
