"""The contract between the runtime and the plug-ins: a model family's `Task`, a dataset's
`DataShape`, and the `Evaluator`s a run adds to its evaluations.

Nothing here imports a model or a dataset kind: `runtime/` depends on these classes and on the
registries (`runtime/registry.py`); `models/` and the dataset kinds depend on them, never on
the trainer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Mapping

from runtime.errors import UserError

IGNORE_LABEL = -100  # a label the losses skip: prompt tokens, padding, padded eval rows
AUTO_DTYPE = "auto"  # a family's compute dtype chosen by platform (`platform_compute_dtype`)

# A batch's fields and their ranks (int32, batch first). Puzzle tasks use these; a Task may
# declare its own (Gemma SFT: inputs, labels, segment_ids, positions).
PUZZLE_BATCH_FIELDS: dict[str, int] = {"inputs": 2, "labels": 2, "puzzle_identifiers": 1}


@dataclass(frozen=True)
class DataShape:
    """What building a model needs of a training set, read without loading its arrays: from a
    built split's metadata, or from the config's sizes when the set is still to be built.

    `tasks`: for a mixture of datasets (data.name=multitask), each task's own shape; the
    top-level numbers are then the mixture's (examples summed, the widest vocabulary)."""

    examples: int
    vocab_size: int
    seq_len: int
    num_puzzle_identifiers: int = 1
    packed: bool = False  # SFT rows packed with segment ids and positions
    epoch_examples: int | None = None  # examples per epoch; None = the whole training set
    source: str = ""  # where the numbers came from, for the plan's printout
    examples_exact: bool = True  # False: `examples` stands in for a set that is not on this machine
    tasks: Mapping[str, "DataShape"] = field(default_factory=dict)
    batch_fraction: float = 1.0  # a task of a mixture: its share of every global batch

    def sub_batches(self, global_batch: int) -> dict[str, int]:
        """A mixture's rows of each task per global batch."""
        return sub_batches({name: t.batch_fraction for name, t in self.tasks.items()}, global_batch)


def sub_batches(fractions: Mapping[str, float], global_batch: int) -> dict[str, int]:
    """Rows of each task of a mixture per global batch: round(fraction x batch / sum of fractions)."""
    total = sum(fractions.values())
    return {name: round(f * global_batch / total) for name, f in fractions.items()}


def platform_compute_dtype(platform: str) -> str:
    """What a compute dtype of "auto" means on a JAX platform ("cpu", "tpu", "gpu"): bfloat16 on
    accelerators, float32 on CPU, where XLA runs bfloat16 dots slower than float32 ones."""
    return "float32" if platform == "cpu" else "bfloat16"


class Task:
    """A model family's training semantics, all methods traceable under `jit` unless noted.

    Required: `init`, `train_loss`, `eval_sums`, `summarize`. Every other hook has a default
    that means "this family does not use it"; the runtime never probes with hasattr.
    """

    batch_fields: Mapping[str, int] = PUZZLE_BATCH_FIELDS
    # True when `eval_outputs` returns per-row outputs (ARC voting reads predictions and q_halt)
    has_eval_outputs: bool = False

    def init(self, rng, example_batch) -> Any:
        """Boxed parameters (flax logical axis names attached)."""
        raise NotImplementedError

    def init_carry(self, example_batch) -> Any:
        """State kept across batches (batch dimension first, checkpointed), or None."""
        return None

    def train_loss(self, params, carry, batch, rng, step=None):
        """(loss, (new_carry, metric sums, optimizer extras)): the loss is a sum over the batch's rows
        divided by ``loss_denominator(batch)``."""
        raise NotImplementedError

    def loss_denominator(self, batch) -> Any:
        """What `train_loss` divides its summed loss by for these rows (a number or a traced
        scalar): by default the rows. Gradient accumulation (runtime/grad_accum.py) weighs each
        micro-batch by its denominator over the whole batch's, so the summed gradient is the full batch's."""
        return next(iter(batch.values())).shape[0]

    def eval_sums(self, params, batch) -> dict:
        raise NotImplementedError

    def eval_outputs(self, params, batch):
        """(metric sums, per-row outputs); only called when `has_eval_outputs`."""
        raise NotImplementedError

    def summarize(self, sums: Mapping[str, Any], global_batch: int, training: bool) -> dict[str, float]:
        """Host side: metrics from sums added over steps or eval batches (`global_batch` rows)."""
        raise NotImplementedError

    def batch_shapes(self, global_batch: int) -> dict[str, tuple[int, ...]] | None:
        """Per-field global shapes when they are not (global_batch, seq_len)[:rank]."""
        return None

    def trainable_mask(self, params) -> Any:
        """A tree of bools (False = frozen: no gradient, no optimizer state, no EMA), or None."""
        return None

    def load_pretrained(self, abstract_params: Any, rng) -> Any:
        """Host side: parameters from the family's pretrained checkpoint (arch.checkpoint),
        placed with `abstract_params`' shardings; None when the family has none configured."""
        return None

    def evaluators(self, context: EvalContext) -> list["Evaluator"]:
        """Host side: extra evaluations of this family (Gemma: greedy generation)."""
        return []

    def export(self, params: Any, out_dir: str, **options: Any) -> list[str]:
        """Host side: write `params` in the family's interchange format (`python -m runtime.export`)."""
        raise UserError(f"{type(self).__name__} has no export format")

    def flops_per_example(self, seq_len: int) -> float | None:
        """Model FLOPs of one training example of `seq_len` tokens (forward and backward, one
        train step), by formula (models/flops.py); None where unknown."""
        return None


_ANALYSIS = [False]


@contextlib.contextmanager
def analysis_mode():
    """Models traced inside run without loops (Python-unrolled), rematerialisation or chunked-loss
    scans, so XLA's cost analysis (which counts a loop body once) sees every FLOP. For checking
    the FLOP formulas only (`runtime.perf.analysis_flops`): compile time grows with the loops' trip counts."""
    _ANALYSIS.append(True)
    try:
        yield
    finally:
        _ANALYSIS.pop()


def in_analysis() -> bool:
    return _ANALYSIS[-1]


@dataclass(frozen=True)
class EvalContext:
    """What a family's or a kind's evaluators may need of the run."""

    config: Any  # the run's validated Config
    eval_split: Any
    mesh: Any
    global_batch: int
    output_dir: str


class Evaluator:
    """Something computed at every evaluation besides the loss metrics.

    `start()` begins one evaluation; `update(batch, outputs)` sees every eval batch (with the
    task's per-row outputs when `wants_rows`); `finish(params)` returns metrics (without the
    "eval/" prefix). Every process calls each method; an evaluator gathers what it needs."""

    wants_rows: bool = False

    def start(self) -> None:
        pass

    def update(self, batch: Mapping[str, Any], outputs: Mapping[str, Any] | None) -> None:
        pass

    def finish(self, params: Any) -> dict[str, float]:
        return {}
