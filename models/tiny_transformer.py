"""A small bidirectional transformer over puzzle tokens.

A test model for exercising the runtime (sharding, train loop, checkpoints) with real
arithmetic; the recursive-reasoning models replace it for experiments. Every parameter is
annotated with logical axis names so the same sharding rules apply as for the real models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from models.flops import attention_core, matmul, swiglu, trained
from models.layers import Attention, MlpBlock, check_at_least, check_dtype_names, check_heads, dtype_from_name
from runtime.frozen import Freezable
from runtime.registry import ModelFamily, register_model_family
from runtime.task import IGNORE_LABEL, DataShape, Task


@dataclass
class TinyTransformerConfig(Freezable):
    name: str = "tiny_transformer"
    hidden: int = 64
    heads: int = 4
    layers: int = 2
    mlp_ratio: int = 4
    dtype: str = "float32"  # forward (activation) dtype, or auto (by platform); parameters stay float32


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


def sequence_loss(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Softmax cross-entropy averaged per sequence over its valid tokens, then over the batch.

    Returns the loss and metric sums (reduced over the global batch on device).
    """
    valid = labels != IGNORE_LABEL
    safe = jnp.where(valid, labels, 0)
    token_loss = optax.softmax_cross_entropy_with_integer_labels(logits, safe)
    count = valid.sum(-1)
    seq_loss = jnp.where(valid, token_loss, 0.0).sum(-1) / jnp.maximum(count, 1)
    correct = (logits.argmax(-1) == safe) & valid
    has_labels = count > 0
    sums = {
        "loss_sum": seq_loss.sum(),
        "sequences": has_labels.sum(),
        "correct_tokens": correct.sum(),
        "tokens": count.sum(),
        "exact": (has_labels & (correct.sum(-1) == count)).sum(),
    }
    return seq_loss.sum() / logits.shape[0], sums


class SequenceTask(Task):
    """A stateless sequence model: ``model.apply(params, inputs) -> logits``."""

    def __init__(self, model):
        self.model = model

    def init(self, rng, example_batch):
        return self.model.init(rng, jnp.zeros((1,) + example_batch["inputs"].shape[1:], jnp.int32))["params"]

    def train_loss(self, params, carry, batch, rng, step=None):
        logits = self.model.apply({"params": params}, batch["inputs"])
        loss, sums = sequence_loss(logits, batch["labels"])
        return loss, (None, sums, {})

    def eval_sums(self, params, batch):
        logits = self.model.apply({"params": params}, batch["inputs"])
        return sequence_loss(logits, batch["labels"])[1]

    def flops_per_example(self, seq_len: int) -> float:
        """Every matmul trains: 3x the forward's QKV/out projections, attention, MLP and head."""
        cfg, t = self.model.cfg, seq_len
        d = cfg.hidden
        block = matmul(t, d, 4 * d) + attention_core(t, t, cfg.heads, d // cfg.heads) + swiglu(t, d, d * cfg.mlp_ratio)
        return trained(cfg.layers * block + matmul(t, d, self.model.vocab_size))

    def summarize(self, sums: Mapping[str, Any], global_batch: int, training: bool) -> dict[str, float]:
        seqs = max(float(sums["sequences"]), 1.0)
        return {
            "loss": float(sums["loss_sum"]) / seqs,
            "token_accuracy": float(sums["correct_tokens"]) / max(float(sums["tokens"]), 1.0),
            "exact_accuracy": float(sums["exact"]) / seqs,
        }


def build_task(arch: TinyTransformerConfig, shape: DataShape, **_: Any) -> SequenceTask:
    return SequenceTask(TinyTransformer(arch, vocab_size=shape.vocab_size, seq_len=shape.seq_len))


def validate(arch: TinyTransformerConfig) -> None:
    check_at_least(arch, 1, "hidden", "heads", "layers", "mlp_ratio")
    check_heads(arch)
    check_dtype_names(arch, "dtype", auto=True)


register_model_family(ModelFamily("tiny_transformer", TinyTransformerConfig, build_task, validate,
                                  compute_dtype="dtype"))
