"""Model zoo. `ARCH_SCHEMAS` maps an arch family name to its typed config; `build_task` turns a
validated arch config plus the dataset's shapes into a `Task`: what the generic train step
(`runtime/train_step.py`) needs to know about a model family.

Parameters carry logical axis names (flax `with_logical_partitioning`); the runtime maps them
to mesh axes with the rules in `runtime/sharding.py`.

A `Task` (all methods traceable under `jit`):

* ``init(rng, example_batch) -> boxed params`` (logical axis names attached);
* ``init_carry(example_batch) -> carry | None``: state that persists across batches, part of the
  train state and checkpointed, batch dimension first (sharded like the batch). None = stateless;
* ``train_loss(params, carry, batch, rng, step) -> (loss, (new_carry, sums, opt_extra))``: the loss
  to differentiate (already divided by the global batch), metric sums over the global batch,
  and extra keyword arguments for the optimizer's ``update`` (the puzzle ids for sign-SGD);
* ``eval_sums(params, batch) -> sums``;
* ``summarize(sums, global_batch, training) -> metrics``: host-side, on sums added over steps
  or eval batches (``global_batch`` = rows those sums cover).

Families: `tiny_transformer` (stateless test model, softmax CE) and the recursive-reasoning
models `trm` / `hrm` (ACT carry, one optimizer step per ACT step, stablemax CE + Q losses),
and `gemma` (supervised fine-tuning on token sequences, models/gemma/task.py).
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import optax

from models.recursive_reasoning import (HRM, HRMConfig, TRM, TRMConfig, act_evaluate, act_loss, act_step, init_params,
                                        initial_carry)
from models.gemma.config import GemmaConfig
from models.tiny_transformer import TinyTransformer, TinyTransformerConfig
from runtime.errors import UserError

ARCH_SCHEMAS: dict[str, type] = {
    "tiny_transformer": TinyTransformerConfig,
    "trm": TRMConfig,
    "hrm": HRMConfig,
    "gemma": GemmaConfig,
}

IGNORE_LABEL = -100


def build_model(arch: Any, *, vocab_size: int, seq_len: int, num_puzzle_identifiers: int = 1, init_states=None):
    """`init_states`: TRM/HRM (H_init, L_init) to start the carry from (imported checkpoints)."""
    if isinstance(arch, TinyTransformerConfig):
        return TinyTransformer(arch, vocab_size=vocab_size, seq_len=seq_len)
    if init_states is not None:
        init_states = tuple(tuple(float(x) for x in v) for v in init_states)  # hashable module field
    if isinstance(arch, TRMConfig):
        return TRM(arch, vocab_size=vocab_size, seq_len=seq_len, num_puzzle_identifiers=num_puzzle_identifiers,
                   init_states=init_states)
    if isinstance(arch, HRMConfig):
        return HRM(arch, vocab_size=vocab_size, seq_len=seq_len, num_puzzle_identifiers=num_puzzle_identifiers,
                   init_states=init_states)
    raise ValueError(f"no model for arch config {type(arch).__name__}")


def build_task(arch: Any, *, vocab_size: int, seq_len: int, num_puzzle_identifiers: int = 1, init_states=None,
               packed: bool = False, exploration=None):
    """`exploration`: TRM/HRM, an optional traceable step -> halt exploration probability."""
    if isinstance(arch, GemmaConfig):
        from models.gemma.task import GemmaTask

        if vocab_size > arch.vocab_size:
            raise UserError(f"the tokenizer has {vocab_size} ids but arch.vocab_size={arch.vocab_size} embedding rows; "
                            f"set arch.vocab_size >= {vocab_size}")
        return GemmaTask(arch, packed=packed)
    model = build_model(arch, vocab_size=vocab_size, seq_len=seq_len, num_puzzle_identifiers=num_puzzle_identifiers,
                        init_states=init_states)
    if isinstance(arch, TinyTransformerConfig):
        return SequenceTask(model)
    return ACTTask(model, exploration=exploration)


# ----------------------------------------------------------------------- tiny_transformer


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


class SequenceTask:
    """A stateless sequence model: ``model.apply(params, inputs) -> logits``."""

    has_carry = False

    def __init__(self, model):
        self.model = model

    def init(self, rng, example_batch):
        return self.model.init(rng, jnp.zeros((1,) + example_batch["inputs"].shape[1:], jnp.int32))["params"]

    def init_carry(self, example_batch):
        return None

    def train_loss(self, params, carry, batch, rng, step=None):
        logits = self.model.apply({"params": params}, batch["inputs"])
        loss, sums = sequence_loss(logits, batch["labels"])
        return loss, (None, sums, {})

    def eval_sums(self, params, batch):
        logits = self.model.apply({"params": params}, batch["inputs"])
        return sequence_loss(logits, batch["labels"])[1]

    @staticmethod
    def summarize(sums: Mapping[str, Any], global_batch: int, training: bool) -> dict[str, float]:
        seqs = max(float(sums["sequences"]), 1.0)
        return {
            "loss": float(sums["loss_sum"]) / seqs,
            "token_accuracy": float(sums["correct_tokens"]) / max(float(sums["tokens"]), 1.0),
            "exact_accuracy": float(sums["exact"]) / seqs,
        }


# ----------------------------------------------------------------------- TRM / HRM (ACT)


class ACTTask:
    """TRM / HRM with the ACT wrapper: one call of `train_loss` = one ACT step (deep supervision).

    The carry (inner z_H/z_L, steps, halted, the data rows being worked on) persists across
    batches; halted rows take the new batch's rows. Loss = `act_loss` total / global batch;
    metrics come from the rows that halted this step. Evaluation runs ``halt_max_steps`` steps.
    """

    has_carry = True

    def __init__(self, model, exploration=None):
        self.model = model
        self.loss_type = model.cfg.loss_type  # stablemax (the reference's Sudoku/ARC/Maze setting) or softmax
        # > 0: the cycle-consistency term (TRMConfig.cycle_consistency_weight) is in the loss
        self.cycle_weight = float(getattr(model.cfg, "cycle_consistency_weight", 0.0))
        # optional traceable step (int32 array) -> halt exploration probability (an annealed
        # schedule); overrides the arch's halt_exploration_prob when train_loss gets a step
        self.exploration = exploration

    def init(self, rng, example_batch):
        one = {k: v[:1] for k, v in example_batch.items()}
        return init_params(self.model, rng, one)

    def init_carry(self, example_batch):
        return initial_carry(self.model, example_batch)

    def train_loss(self, params, carry, batch, rng, step=None):
        prob = self.exploration(step) if (self.exploration is not None and step is not None) else None
        new_carry, out = act_step(self.model, params, carry, batch, rng, True, exploration_prob=prob)
        total, sums = act_loss(out, new_carry.current_data["labels"], new_carry.halted, new_carry.steps,
                               loss_type=self.loss_type, cycle_weight=self.cycle_weight)
        global_batch = batch["inputs"].shape[0]
        return total / global_batch, (new_carry, sums, {"puzzle_identifiers": new_carry.current_data["puzzle_identifiers"]})

    def eval_sums(self, params, batch):
        return self.eval_outputs(params, batch)[0]

    def eval_outputs(self, params, batch):
        """(metric sums, per-row outputs): the predictions and q_halt logits, for the ARC evaluator."""
        carry, out = act_evaluate(self.model, params, batch)
        sums = act_loss(out, carry.current_data["labels"], carry.halted, carry.steps, loss_type=self.loss_type,
                        cycle_weight=self.cycle_weight)[1]
        return sums, {"preds": out["logits"].argmax(-1).astype(jnp.int32), "q_halt_logits": out["q_halt_logits"]}

    def summarize(self, sums: Mapping[str, Any], global_batch: int, training: bool) -> dict[str, float]:
        """The reference's normalisation: in training, losses / global batch and the rest / count
        (halted rows with labels); in evaluation everything / count. ``cycle_loss`` (present only
        with the cycle-consistency term) is a loss too; ``loss`` includes it times its weight."""
        s = {k: float(v) for k, v in sums.items()}
        count = max(s["count"], 1.0)
        loss_div = float(global_batch) if training else count
        out = {k: s[k] / loss_div for k in ("lm_loss", "q_halt_loss", "q_continue_loss")}
        out["loss"] = out["lm_loss"] + 0.5 * (out["q_halt_loss"] + out["q_continue_loss"])
        if "cycle_loss" in s:
            out["cycle_loss"] = s["cycle_loss"] / loss_div
            out["loss"] += self.cycle_weight * out["cycle_loss"]
        out |= {"token_accuracy": s["accuracy"] / count, "exact_accuracy": s["exact_accuracy"] / count,
                "q_halt_accuracy": s["q_halt_accuracy"] / count, "steps": s["steps"] / count, "count": s["count"]}
        return out


__all__ = ["ARCH_SCHEMAS", "ACTTask", "HRMConfig", "SequenceTask", "TRMConfig", "TinyTransformerConfig", "build_model",
           "build_task", "sequence_loss"]
