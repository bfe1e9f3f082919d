"""Gemma arch config (the `arch` group's schema for Gemma 1, 2 and 3 text models) and the
parameter layout every Gemma module of this package agrees on.

The sizes of the released models live in conf/arch/gemma*.yaml (one file per model; their
parameter counts are checked in tests/test_gemma_model.py); tests build tiny configs directly.

Parameter tree (the model's `params`; layers stacked on a leading axis so they run under
`lax.scan`). Logical axis names in brackets; runtime/sharding.py maps them to mesh axes::

    embedder/input_embedding          [V, D]           (vocab, embed)
    layers/pre_attention_norm/scale   [L, D]           (layers, embed)        zero init (x * (1 + scale))
    layers/post_attention_norm/scale  [L, D]           Gemma 2/3 only
    layers/pre_ffw_norm/scale         [L, D]
    layers/post_ffw_norm/scale        [L, D]           Gemma 2/3 only
    layers/attn/q_einsum/w            [L, H, D, hd]    (layers, heads, embed, head_dim)
    layers/attn/kv_einsum/w           [L, 2, K, D, hd] (layers, None, kv_heads, embed, head_dim)
    layers/attn/attn_vec_einsum/w     [L, H, hd, D]    (layers, heads, head_dim, embed)
    layers/attn/query_norm/scale      [L, hd]          Gemma 3 only (QK-norm)
    layers/attn/key_norm/scale        [L, hd]          Gemma 3 only
    layers/mlp/gating_einsum/w        [L, 2, D, F]     (layers, None, embed, mlp)  [0] gate (GELU), [1] up
    layers/mlp/linear/w               [L, F, D]        (layers, mlp, embed)
    final_norm/scale                  [D]              (embed,)

LoRA (lora_rank > 0) adds, for each targeted weight `w` above, `lora_a` and `lora_b` beside it
(e.g. layers/attn/q_einsum/lora_a, .../lora_b); see models/gemma/lora.py. B starts at zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from runtime.frozen import Freezable

LORA_TARGETS = ("q_einsum", "kv_einsum", "attn_vec_einsum", "gating_einsum", "linear")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
ATTENTION_FORMS = ("auto", "xla", "splash")
LOSSES = ("chunked", "plain")
CHECKPOINT_FORMATS = ("auto", "hf", "kaggle")
NORM_EPS = 1e-6  # RMSNorm epsilon of every Gemma


@dataclass
class GemmaConfig(Freezable):
    """One Gemma text model. Defaults: a tiny Gemma-2-shaped model for tests and the CPU demo."""

    name: str = "gemma"
    version: int = 2  # 1 | 2 | 3: post-norms from 2 on, QK-norm in 3
    num_layers: int = 2
    embed_dim: int = 64  # D
    hidden_dim: int = 128  # F, the MLP width
    num_heads: int = 4  # H
    num_kv_heads: int = 2  # K; 1 = multi-query
    head_dim: int = 16  # hd
    vocab_size: int = 512  # rows of the embedding table (may exceed the tokenizer's vocab)
    # Ids in use: rows at or past it are padding (e.g. an HF table of 256000 rows in a 256128-row
    # one), their logits -inf in the loss, the logits and sampling. None = every row.
    real_vocab_size: Optional[int] = None
    # Attention pattern: layer i is global when (i + 1) % global_every == 0, else local with
    # `sliding_window` (a key is visible when key_pos > query_pos - window). 1 = all global.
    global_every: int = 1
    sliding_window: Optional[int] = None
    rope_base_local: float = 10_000.0
    rope_base_global: float = 10_000.0
    rope_scale_global: float = 1.0  # linear position scaling on global layers (Gemma3-4B: 8)
    query_pre_attn_scalar: Optional[float] = None  # queries scaled by this ** -0.5; None = head_dim
    attn_logit_softcap: Optional[float] = None  # Gemma 2: 50 (Gemma 3 has none: QK-norm instead)
    final_logit_softcap: Optional[float] = None  # Gemma 2: 30
    # Positions the model was trained for (config.json's max_position_embeddings; RoPE itself has no
    # limit). Carried to the export; None = transformers' default for the version.
    max_position_embeddings: Optional[int] = None
    dtype: str = "auto"  # activations / matmuls; auto: bfloat16 on TPU/GPU, float32 on CPU
    param_dtype: str = "float32"  # stored parameters (the optimizer updates these)
    # Attention over a whole sequence (training, evaluation; decoding with a cache is always dense):
    # xla: the scores written out in float32; splash: jax's Pallas TPU kernel, blocks by the causal
    # and local masks (Pallas' interpreter off TPU); auto: splash where the step is lowered for TPU
    # from SPLASH_MIN_LENGTH tokens (models/attention.py; local layers' windows included: model.py
    # `whole_sequence_attention`), xla elsewhere.
    attention: str = "auto"
    remat: str = "full"  # per-layer rematerialisation: none | full | dots | dots_no_batch
    scan_layers: bool = True  # layers under lax.scan: compile time flat in depth
    # Loss: "chunked" never materialises [B, T, V] logits (scan over token chunks, logits
    # recomputed in the backward pass); "plain" is the naive version, kept to measure against.
    loss: str = "chunked"
    # Tokens per chunk on each device the batch is split over (a chunk of the flattened batch x
    # length holds this many times those devices): per chip, so that each chunk's f32 gradient of
    # the tied embedding table is spread over enough tokens whatever the slice (gemma1_2b_full on
    # v5e-8 by the compile-only estimate: 907 ms a step at 128 tokens a chip, the 1024 of the
    # whole batch it had before; 540 ms at 1024 a chip).
    loss_chunk_size: int = 1024
    # LoRA: rank 0 = full fine-tuning. Base weights are frozen and hold no optimizer state.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    # Pretrained weights to start from: a Hugging Face safetensors file or folder, or a Kaggle
    # Flax/Orbax checkpoint folder; local path or gs://. None = random init. Its config.json (HF;
    # a Kaggle checkpoint: its tensor shapes) sets the fields above that it determines, before
    # anything compiles (models/gemma/checkpoint_arch.py): a field left at its default here takes
    # the checkpoint's value, one set to another value is an error.
    checkpoint: Optional[str] = None
    checkpoint_format: str = "auto"  # auto | hf | kaggle

    # Checked by models/gemma/task.py `validate`: sizes >= 1 (lora_rank >= 0), real_vocab_size <= vocab_size, num_kv_heads divides
    # num_heads (each kv head serves num_heads / num_kv_heads query heads; head_dim is free, not
    # embed_dim / num_heads), dtype names, and the option strings above.

    @property
    def vocab_in_use(self) -> int:
        """Ids the model accepts and emits: [0, token_ids)."""
        return self.real_vocab_size or self.vocab_size

    @property
    def post_norms(self) -> bool:
        return self.version >= 2

    @property
    def qk_norm(self) -> bool:
        return self.version >= 3

    def is_global_layer(self, i: int) -> bool:
        return self.sliding_window is None or (i + 1) % self.global_every == 0
