"""Multi-task TRM: several puzzle datasets, one shared reasoning core.

Each task (e.g. ``sudoku``, ``maze``) has its own inner TRM (vocabulary, sequence length,
puzzle identifiers), its own token embedding, output heads and puzzle-embedding table, and its
own ACT carry; the recursion network ``L_level`` is ONE set of parameters used by every task.
Only the attention variant can share it (``mlp_t=False``): the mlp_t sequence-MLP's width is
the sequence length, which differs between tasks.

Parameters::

    L_level                 the shared reasoning core (attention blocks)
    puzzle_emb/<task>       each task's table (sign-SGD, no EMA: the top-level key "puzzle_emb"
                            is what runtime/optimizers.py's param_labels and EMA helpers key on)
    tasks/<task>/...        embed_tokens, lm_head, q_head_kernel, q_head_bias (pos_embed)

The batch is flat, with keys prefixed by task: ``sudoku/inputs`` [B_sudoku, 81],
``maze/inputs`` [B_maze, 900], ...; each task's sub-batch size is fixed (its batch_fraction of
the global batch, see data_pipeline/kinds/multitask.py). One `train_loss` call is one ACT step of every
task: loss = (sum over tasks of the ACT loss totals) / (global batch), so every row of the
global batch weighs the same, whichever task it belongs to. Metric sums are prefixed
``<task>/``; `summarize` gives each task's metrics under its prefix and the means over tasks of
``exact_accuracy`` and ``token_accuracy``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from models.recursive_reasoning import TRMConfig
from models.recursive_reasoning.losses import bce_with_logits
from models.recursive_reasoning.task import ACTTask, build_model
from runtime.errors import UserError
from runtime.task import IGNORE_LABEL, DataShape, Task

CORE = "L_level"  # the shared parameters
TABLE = "puzzle_emb"
TASKS = "tasks"
FIELDS = {"inputs": 2, "labels": 2, "puzzle_identifiers": 1}  # a puzzle batch's fields and ranks


@dataclass(frozen=True)
class TaskSpec:
    """One task's dataset shape and its rows per global batch."""

    vocab_size: int
    seq_len: int
    num_puzzle_identifiers: int
    batch_size: int


class MultiTaskACT(Task):
    """The `models` Task interface over several TRMs sharing `L_level` (see the module docstring)."""

    def __init__(self, arch: Any, specs: Mapping[str, TaskSpec], init_states=None,
                 exploration: Callable | None = None):
        if not isinstance(arch, TRMConfig):
            raise UserError(f"multi-task training needs a TRM arch (arch=trm_att), got {getattr(arch, 'name', arch)!r}")
        if arch.mlp_t:
            raise UserError("multi-task training shares the reasoning core across sequence lengths, which the mlp_t "
                            "variant cannot (its sequence-MLP is as wide as the sequence); use arch=trm_att or "
                            "arch.mlp_t=false")
        if not specs:
            raise UserError("multi-task training needs at least one task in data.tasks")
        bad = [name for name in specs if not name or "/" in name]
        if bad:
            raise UserError(f"task names {bad} cannot be batch-key prefixes; name data.tasks entries without '/'")
        self.arch = arch
        self.specs = dict(specs)
        self.names = tuple(self.specs)
        self.global_batch = sum(s.batch_size for s in self.specs.values())
        self.acts = {}
        for name, spec in self.specs.items():
            model = build_model(arch, DataShape(examples=0, vocab_size=spec.vocab_size, seq_len=spec.seq_len,
                                                num_puzzle_identifiers=spec.num_puzzle_identifiers), init_states)
            self.acts[name] = ACTTask(model, exploration) if exploration is not None else ACTTask(model)
        self.batch_fields = {f"{t}/{f}": ndim for t in self.names for f, ndim in FIELDS.items()}

    # ------------------------------------------------------------------ batch layout

    def batch_shapes(self, global_batch: int) -> dict[str, tuple[int, ...]]:
        """Global shape of every batch field (each task's sub-batch rows first)."""
        if global_batch != self.global_batch:
            raise ValueError(f"the tasks' sub-batches {self.sub_batches()} add up to {self.global_batch}, "
                             f"not the global batch {global_batch}")
        return {f"{t}/{f}": (self.specs[t].batch_size, self.specs[t].seq_len)[:ndim]
                for t in self.names for f, ndim in FIELDS.items()}

    def sub_batches(self) -> dict[str, int]:
        return {t: s.batch_size for t, s in self.specs.items()}

    def split(self, batch: Mapping[str, jax.Array]) -> dict[str, dict[str, jax.Array]]:
        """Flat prefixed batch -> {task: {inputs, labels, puzzle_identifiers}}."""
        return {t: {f: batch[f"{t}/{f}"] for f in FIELDS} for t in self.names}

    def task_params(self, params: Mapping[str, Any], task: str) -> dict[str, Any]:
        """The inner TRM's parameter tree of `task`: its own parts plus the shared core."""
        out = dict(params[TASKS][task])
        out[CORE] = params[CORE]
        if TABLE in params and task in params[TABLE]:
            out[TABLE] = params[TABLE][task]
        return out

    # ------------------------------------------------------------------ Task interface

    def init(self, rng, example_batch):
        parts = self.split(example_batch)
        core, tables, own = None, {}, {}
        for i, t in enumerate(self.names):
            p = dict(self.acts[t].init(jax.random.fold_in(rng, i), parts[t]))
            task_core = p.pop(CORE)
            if core is None:
                core = task_core  # the first task's draw initialises the shared core
            elif jax.tree.map(jnp.shape, task_core) != jax.tree.map(jnp.shape, core):
                raise UserError(f"task {t!r} needs a reasoning core of another shape than {self.names[0]!r}; only "
                                "length-independent cores (attention) can be shared")
            if TABLE in p:
                tables[t] = p.pop(TABLE)
            own[t] = p
        params = {CORE: core, TASKS: own}
        if tables:
            params[TABLE] = tables
        return params

    def init_carry(self, example_batch):
        parts = self.split(example_batch)
        return {t: self.acts[t].init_carry(parts[t]) for t in self.names}

    def train_loss(self, params, carry, batch, rng, step=None):
        parts = self.split(batch)
        rows = self.loss_denominator(batch)
        total, sums, new_carry, ids = 0.0, {}, {}, {}
        for i, t in enumerate(self.names):
            kwargs = {} if step is None else {"step": step}
            loss, (c, s, extra) = self.acts[t].train_loss(self.task_params(params, t), carry[t], parts[t],
                                                          jax.random.fold_in(rng, i), **kwargs)
            # ACTTask divides by its own rows; re-weight so every row of the batch counts once
            total = total + loss * (self.acts[t].loss_denominator(parts[t]) / rows)
            sums |= {f"{t}/{k}": v for k, v in s.items()}
            new_carry[t] = c
            ids[t] = extra["puzzle_identifiers"]
        return total, (new_carry, sums, {"puzzle_identifiers": ids})

    def loss_denominator(self, batch):
        """Rows of every task's sub-batch."""
        return sum(self.acts[t].loss_denominator(part) for t, part in self.split(batch).items())

    def flops_per_example(self, seq_len: int = 0) -> float:
        """Each task's ACT step (the shared core at its sequence length) weighted by its rows of
        the global batch."""
        return sum(self.acts[t].flops_per_example() * s.batch_size for t, s in self.specs.items()) / self.global_batch

    def eval_sums(self, params, batch):
        """Each task's ACT eval sums. Rows without labels (padding: a task whose eval set ran out
        fills whole sub-batches with it) would add BCE(q_halt, 1) to ``q_halt_loss`` (they count
        as exactly correct); that part is taken out, so padding counts nowhere."""
        parts = self.split(batch)
        sums = {}
        for t in self.names:
            task_sums, rows = self.acts[t].eval_outputs(self.task_params(params, t), parts[t])
            task_sums = dict(task_sums)
            padding = ~(parts[t]["labels"] != IGNORE_LABEL).any(-1)
            task_sums["q_halt_loss"] = task_sums["q_halt_loss"] - jnp.where(
                padding, bce_with_logits(rows["q_halt_logits"], jnp.ones_like(rows["q_halt_logits"])), 0.0).sum()
            sums |= {f"{t}/{k}": v for k, v in task_sums.items()}
        return sums

    def summarize(self, sums: Mapping[str, Any], global_batch: int, training: bool) -> dict[str, float]:
        """Per-task ACT metrics under ``<task>/``; ``exact_accuracy`` / ``token_accuracy`` are means
        over tasks. ``loss`` is, in training, what was optimised (all tasks' loss sums / rows of the
        global batches), in evaluation the mean of the tasks' losses."""
        out: dict[str, float] = {}
        weighted_loss = 0.0
        for t in self.names:
            mine = {k[len(t) + 1:]: v for k, v in sums.items() if k.startswith(f"{t}/")}
            if not mine:
                continue
            rows = global_batch * self.specs[t].batch_size / self.global_batch  # this task's rows of those batches
            metrics = self.acts[t].summarize(mine, rows, training)
            out |= {f"{t}/{k}": v for k, v in metrics.items()}
            weighted_loss += metrics["loss"] * rows
        present = [t for t in self.names if f"{t}/loss" in out]
        if not present:
            return out
        for k in ("exact_accuracy", "token_accuracy"):
            out[k] = sum(out[f"{t}/{k}"] for t in present) / len(present)
        out["loss"] = (weighted_loss / max(global_batch, 1) if training
                       else sum(out[f"{t}/loss"] for t in present) / len(present))
        return out


def build_multitask(arch: Any, shape: DataShape, global_batch: int, init_states=None, exploration=None) -> MultiTaskACT:
    """The mixture's model: each task of `shape.tasks` with its rows of a `global_batch`."""
    sizes = shape.sub_batches(global_batch)
    specs = {t: TaskSpec(vocab_size=s.vocab_size, seq_len=s.seq_len, num_puzzle_identifiers=s.num_puzzle_identifiers,
                         batch_size=sizes[t]) for t, s in shape.tasks.items()}
    return MultiTaskACT(arch, specs, init_states=init_states, exploration=exploration)
