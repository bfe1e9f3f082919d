"""Gemma supervised fine-tuning as a runner Task (the `gemma` model family).

Loss: next-token cross-entropy on the model turns only (labels -100 elsewhere), summed over the
tokens of the global batch and divided by their count, computed from the final hidden states
with `models.gemma.loss` (chunked: never the full [B, T, V] logits). LoRA (lora_rank > 0):
only the adapters train (`trainable_mask`); the base weights get no gradient and no optimizer
state. Pretrained weights (`arch.checkpoint`) load straight into the run's shardings.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from data_pipeline.sft import score
from data_pipeline.sft_format import PACKED_FIELDS as PACKED_ARRAYS
from data_pipeline.tokenizer import Tokenizer, TokenizerError
from models.flops import attention_core, frozen, matmul, trained
from models.gemma.config import ATTENTION_FORMS, CHECKPOINT_FORMATS, LORA_TARGETS, LOSSES, REMAT_POLICIES, GemmaConfig
from models.gemma.hf_config import GEMMA_TOKEN_IDS
from models.gemma.lora import is_lora_path, merge_lora
from models.gemma.loss import cross_entropy
from models.gemma.model import Gemma, check_token_ids
from models.gemma.sampling import generate
from models.layers import check_at_least, check_dtype_names, dtype_from_name
from runtime.errors import UserError
from runtime.grad_accum import batch_shards
from runtime.registry import ModelFamily, register_model_family
from runtime.sharding import batch_sharding
from runtime.task import IGNORE_LABEL, DataShape, EvalContext, Evaluator, Task

# models.gemma.weights and .checkpoint_arch (which imports it) are imported where a checkpoint is read or
# written: they bring Orbax, TensorStore and safetensors (0.8 s), and every config check registers this family.

PACKED_FIELDS = dict.fromkeys(PACKED_ARRAYS, 2)  # what SFTSplit.rows returns: [batch, seq_len] each
PADDED_FIELDS = {"inputs": 2, "labels": 2}


def traced_batch_shards() -> int:
    """Devices the batch is split over in the step being traced (its mesh, set by the train
    step's activation rules); 1 outside one."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else batch_shards(mesh)


class GemmaTask(Task):
    def __init__(self, cfg: GemmaConfig, packed: bool = False):
        self.cfg = cfg
        self.model = Gemma(cfg)
        self.batch_fields = PACKED_FIELDS if packed else PADDED_FIELDS

    def init(self, rng, example_batch):
        return self.model.init(rng, jnp.zeros((1, 8), jnp.int32))["params"]

    def trainable_mask(self, params) -> Any:
        """LoRA: only lora_* leaves train. Full fine-tuning: everything (None)."""
        if self.cfg.lora_rank <= 0:
            return None
        return jax.tree_util.tree_map_with_path(lambda path, _: is_lora_path(path), params)

    def _sums(self, params, batch) -> dict[str, jax.Array]:
        hidden = self.model.apply({"params": params}, batch["inputs"], batch.get("positions"), batch.get("segment_ids"),
                                  return_hidden=True)
        embedding = params["embedder"]["input_embedding"].astype(dtype_from_name(self.cfg.dtype))
        loss_sum, stats = cross_entropy(hidden, embedding, batch["labels"], kind=self.cfg.loss,
                                        chunk_size=self.cfg.loss_chunk_size * traced_batch_shards(),
                                        softcap=self.cfg.final_logit_softcap,
                                        vocab_in_use=self.cfg.vocab_in_use)
        return {"loss_sum": loss_sum, "tokens": stats["tokens"], "correct": stats["correct"]}

    def train_loss(self, params, carry, batch, rng, step=None):
        sums = self._sums(params, batch)
        return sums["loss_sum"] / self.loss_denominator(batch), (None, sums, {})

    def loss_denominator(self, batch):
        """The batch's target tokens (at least 1): the loss is a mean over tokens."""
        return jnp.maximum(jnp.sum(batch["labels"] != IGNORE_LABEL, dtype=jnp.int32), 1)

    def eval_sums(self, params, batch):
        return self._sums(params, batch)

    @staticmethod
    def summarize(sums: Mapping[str, Any], global_batch: int, training: bool) -> dict[str, float]:
        tokens = max(float(sums["tokens"]), 1.0)
        return {"loss": float(sums["loss_sum"]) / tokens, "token_accuracy": float(sums["correct"]) / tokens,
                "target_tokens": float(sums["tokens"])}

    def flops_per_example(self, seq_len: int) -> float:
        return gemma_flops_per_token(self.cfg, seq_len) * seq_len

    def load_pretrained(self, abstract_params: Any, rng: jax.Array) -> Any:
        """Parameters from `arch.checkpoint` (HF safetensors or Kaggle Orbax), placed with the
        shardings of `abstract_params`; LoRA adapters fresh (A random, B zero). None without one."""
        from models.gemma.weights import load_params  # Orbax: see the imports

        cfg = self.cfg
        if not cfg.checkpoint:
            return None
        shardings = jax.tree.map(lambda a: a.sharding, abstract_params)
        base = load_params(cfg.checkpoint, cfg, shardings, fmt=cfg.checkpoint_format)
        if cfg.lora_rank <= 0:
            return base
        fresh = jax.jit(lambda r: nn.meta.unbox(self.init(r, None)), out_shardings=shardings)(rng)
        return jax.tree_util.tree_map_with_path(
            lambda path, f: f if is_lora_path(path) else _at(base, path), fresh)


    def export(self, params: Any, out_dir: str, *, dtype: str = "bfloat16", vocab_size: int | None = None,
               tokenizer: str | None = None, data: Any = None, **_: Any) -> list[str]:
        """Hugging Face safetensors + config.json + generation_config.json, LoRA adapters merged
        into the base weights; the special token ids from `tokenizer` (default: the run's, from
        `data`, its data config). Returns the files written."""
        from models.gemma.weights import export_hf  # Orbax: see the imports

        return export_hf(params, self.cfg, out_dir, dtype=dtype, vocab_size=vocab_size,
                         merge=merge_lora if self.cfg.lora_rank > 0 else None,
                         token_ids=export_token_ids(tokenizer, data))

    def evaluators(self, context: EvalContext) -> list[Evaluator]:
        """Greedy generation on the first data.eval_generate_examples eval prompts (SFT sets)."""
        data = context.config.data
        examples = getattr(data, "eval_generate_examples", 0)
        if examples <= 0 or not hasattr(context.eval_split, "prompts"):
            return []
        path = data.tokenizer or f"{data.path.rstrip('/')}/tokenizer.model"
        try:
            tokenizer = Tokenizer(path)
        except TokenizerError as e:
            raise UserError(str(e)) from e
        return [GenerationEval(generation_eval(self, context.eval_split, tokenizer, context.mesh, examples=examples,
                                               max_new_tokens=data.eval_max_new_tokens,
                                               batch_size=context.global_batch))]


def export_token_ids(tokenizer: str | None, data: Any) -> dict[str, Any]:
    """pad/eos/bos_token_id for an export: from `tokenizer`, else the run's tokenizer (an SFT run's
    data.tokenizer or <data.path>/tokenizer.model), its <end_of_turn> a second stop id. A given
    tokenizer that cannot be read is an error; the run's, a warning and transformers' Gemma ids."""
    path = tokenizer
    if path is None and getattr(data, "name", None) == "sft":
        path = data.tokenizer or f"{str(data.path).rstrip('/')}/tokenizer.model"
    if path is None:
        logging.getLogger("runtime").warning("no tokenizer for the export's special token ids (the run's data has "
                                             "none): writing Gemma's %s; pass --tokenizer to take them from yours",
                                             GEMMA_TOKEN_IDS)
        return dict(GEMMA_TOKEN_IDS)
    try:
        t = Tokenizer(path)
    except TokenizerError as e:
        if tokenizer is not None:
            raise UserError(f"--tokenizer: {e}") from e
        logging.getLogger("runtime").warning("the run's tokenizer %s cannot be read (%s): writing Gemma's special token "
                                             "ids %s; pass --tokenizer to take them from yours", path, e,
                                             GEMMA_TOKEN_IDS)
        return dict(GEMMA_TOKEN_IDS)
    stops = list(dict.fromkeys(i for i in (t.eos_id, t.end_of_turn_id) if i is not None and i >= 0))
    return {"pad_token_id": t.pad_id, "eos_token_id": t.eos_id, "bos_token_id": t.bos_id, "stop_token_ids": stops}


class GenerationEval(Evaluator):
    """Answer exact match and format adherence of greedy answers (`generation_eval`)."""

    def __init__(self, metrics):
        self.metrics = metrics

    def finish(self, params) -> dict[str, float]:
        return dict(self.metrics(params))


def _at(tree: Any, path) -> Any:
    for entry in path:
        tree = tree[getattr(entry, "key", entry)]
    return tree


def generation_eval(task: GemmaTask, split: Any, tokenizer: Any, mesh: Any, *, examples: int, max_new_tokens: int,
                    batch_size: int):
    """`params -> metrics`: greedy answers for the first `examples` eval prompts (KV cache,
    batch sharded over the mesh), scored on every process from the all-gathered tokens: answer
    exact match and adherence to <reasoning>...</reasoning><answer>...</answer>.

    Prompts, answers and the jitted generator are prepared once; every batch has the same shape
    (prompts padded to the longest of the `examples`), so one compile serves all evaluations."""
    n = min(examples, len(split))
    rows = -(-n // batch_size) * batch_size
    tokens, lengths = split.prompts(np.arange(rows) % n)  # the last batch wraps around; extra rows are dropped
    tokens = tokens[:, :int(lengths.max())]
    check_token_ids(tokens, task.cfg, "eval prompts")
    answers = split.answers(np.arange(n))
    stop = (tokenizer.eos_id, tokenizer.end_of_turn_id)
    sharding = batch_sharding(mesh, 1)
    put = lambda a: jax.make_array_from_callback(a.shape, sharding, lambda i: a[i])  # noqa: E731
    gen = jax.jit(lambda p, t, lens: generate(p, task.cfg, t, lens, max_new_tokens=max_new_tokens, stop_ids=stop,
                                              pad_id=tokenizer.pad_id))

    def metrics(params) -> dict[str, float]:
        responses: list[str] = []
        for start in range(0, rows, batch_size):
            batch = slice(start, start + batch_size)
            out = multihost_utils.process_allgather(gen(params, put(tokens[batch]), put(lengths[batch])), tiled=True)
            responses += [tokenizer.decode([int(t) for t in row if t not in (*stop, tokenizer.pad_id)])
                          for row in np.asarray(out)]
        responses = responses[:n]
        if responses and jax.process_index() == 0:
            logging.getLogger("runtime").info("eval sample: %r", responses[0][:300])
        return score(responses, answers)

    return metrics


def _weight_flops(cfg: GemmaConfig, name: str, d_in: int, d_out: int) -> float:
    """Per token, forward and backward, of one weight [d_in, d_out] and its LoRA adapters."""
    if cfg.lora_rank <= 0:
        return trained(matmul(1, d_in, d_out))
    base = frozen(matmul(1, d_in, d_out))
    if name in cfg.lora_targets:
        base += trained(matmul(1, d_in, cfg.lora_rank) + matmul(1, cfg.lora_rank, d_out))
    return base


def gemma_flops_per_token(cfg: GemmaConfig, seq_len: int) -> float:
    """Model FLOPs per token of a train step on `seq_len`-token rows: the weights' matmuls
    (6 per weight with full fine-tuning; with LoRA 4 per frozen base weight plus 6 per adapter
    weight), attention's QK^T and AV (a query against every position of the row on global
    layers, min(window, seq_len) on sliding-window ones) and the tied LM head (frozen under LoRA)."""
    d, hd = cfg.embed_dim, cfg.head_dim
    weights = {"q_einsum": (d, cfg.num_heads * hd), "kv_einsum": (d, 2 * cfg.num_kv_heads * hd),
               "attn_vec_einsum": (cfg.num_heads * hd, d), "gating_einsum": (d, 2 * cfg.hidden_dim),
               "linear": (cfg.hidden_dim, d)}
    layer = sum(_weight_flops(cfg, name, *dims) for name, dims in weights.items())
    total = cfg.num_layers * layer
    for i in range(cfg.num_layers):
        keys = seq_len if cfg.is_global_layer(i) else min(cfg.sliding_window, seq_len)
        total += trained(attention_core(1, keys, cfg.num_heads, hd))
    head = matmul(1, d, cfg.vocab_size)
    return total + (frozen(head) if cfg.lora_rank > 0 else trained(head))


def build_task(arch: GemmaConfig, shape: DataShape, **_: Any) -> GemmaTask:
    if shape.vocab_size > arch.vocab_in_use:
        what = (f"arch.vocab_size={arch.vocab_size} embedding rows" if arch.real_vocab_size is None else
                f"the model uses only {arch.vocab_in_use} (arch.real_vocab_size; the other rows are padding)")
        raise UserError(f"the tokenizer has {shape.vocab_size} ids but {what}; use the model's own tokenizer, or "
                        f"set arch.vocab_size >= {shape.vocab_size} without a checkpoint")
    return GemmaTask(arch, packed=shape.packed)


def validate(arch: GemmaConfig) -> None:
    """Checks the arch; with arch.checkpoint, first sets the fields the checkpoint determines
    (in place, before the config is frozen: models/gemma/checkpoint_arch.py)."""
    if arch.checkpoint:
        from models.gemma.checkpoint_arch import resolve_arch  # Orbax: see the imports

        resolve_arch(arch)
    check_at_least(arch, 1, "num_layers", "embed_dim", "hidden_dim", "num_heads", "num_kv_heads", "head_dim",
                   "vocab_size", "global_every", "loss_chunk_size")
    check_at_least(arch, 0, "lora_rank")
    if arch.real_vocab_size is not None and not 0 < arch.real_vocab_size <= arch.vocab_size:
        raise UserError(f"arch.real_vocab_size={arch.real_vocab_size} must be in 1..arch.vocab_size={arch.vocab_size} "
                        "(the ids in use; rows past it are padding); set it in that range or to null")
    if arch.num_heads % arch.num_kv_heads:
        divisors = [k for k in range(1, arch.num_heads + 1) if arch.num_heads % k == 0]
        raise UserError(f"arch.num_kv_heads={arch.num_kv_heads} does not divide arch.num_heads={arch.num_heads} (each kv "
                        f"head serves num_heads / num_kv_heads query heads); use num_kv_heads in {divisors}")
    check_dtype_names(arch, "dtype", auto=True)
    check_dtype_names(arch, "param_dtype")
    choices = {"version": (1, 2, 3), "remat": REMAT_POLICIES, "attention": ATTENTION_FORMS, "loss": LOSSES,
               "checkpoint_format": CHECKPOINT_FORMATS}
    for name, allowed in choices.items():
        if getattr(arch, name) not in allowed:
            raise UserError(f"arch.{name}={getattr(arch, name)!r} is not one of {list(allowed)}")
    unknown = sorted(set(arch.lora_targets) - set(LORA_TARGETS))
    if unknown:
        raise UserError(f"arch.lora_targets has {unknown}; choose from {list(LORA_TARGETS)}")
    positive = {"sliding_window": arch.sliding_window, "query_pre_attn_scalar": arch.query_pre_attn_scalar,
                "attn_logit_softcap": arch.attn_logit_softcap, "final_logit_softcap": arch.final_logit_softcap,
                "rope_base_local": arch.rope_base_local, "rope_base_global": arch.rope_base_global,
                "rope_scale_global": arch.rope_scale_global}
    for name, value in positive.items():
        if value is not None and not value > 0:
            raise UserError(f"arch.{name}={value!r} is out of range: it must be > 0")
    if arch.max_position_embeddings is not None:
        check_at_least(arch, 1, "max_position_embeddings")
    if arch.version == 3 and arch.attn_logit_softcap is not None:
        raise UserError(f"arch.attn_logit_softcap={arch.attn_logit_softcap} with arch.version=3: Gemma 3 has no attention "
                        "soft-cap (QK-norm takes its place, in the reference implementation as in transformers); set "
                        "arch.attn_logit_softcap=null")


register_model_family(ModelFamily("gemma", GemmaConfig, build_task, validate, compute_dtype="dtype",
                                  forms=("attention",), pretrained="checkpoint"))
