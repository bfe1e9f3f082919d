"""The experiment programme (../shared/reference/EXPERIMENTS.md) as data: what each group studies
and how its analysis plots it. The variants themselves are the files
`conf/experiment/<group>/<variant>.yaml`; what each changes is computed by composing them
(`experiments/compose.py`), never restated here.

Plot axes: ``params`` (parameter count), ``step``, ``variant`` (one bar per variant), or a
config key such as ``arch.hidden``. Plot values: any metric in metrics.jsonl (the last value,
or the whole curve when x is ``step``).
"""

from __future__ import annotations

from dataclasses import dataclass

BASELINE = "baseline/trm_sudoku_extreme"  # the experiment every TRM group varies
GEMMA_BASELINE = "gemma_sft/gemma2b_full_v5e8"

PRIMARY = "eval/exact_accuracy"


@dataclass(frozen=True)
class Plot:
    y: str  # metric key, e.g. "eval/exact_accuracy"
    x: str  # "params" | "step" | "variant" | a config key ("arch.hidden")
    log_x: bool = False
    title: str = ""


@dataclass(frozen=True)
class Group:
    name: str
    title: str
    varies: str  # in the words of EXPERIMENTS.md
    baseline_variant: str | None  # the variant that is the baseline itself (None: all differ)
    plots: tuple[Plot, ...]
    extra_metrics: tuple[str, ...] = ()  # group-specific table columns
    base: str = BASELINE
    primary: str = PRIMARY
    target: float = 0.87  # the accuracy "time to target" is measured at (the baseline's ~87%)


def _acc(x: str, log_x: bool = False, title: str = "") -> Plot:
    return Plot(PRIMARY, x, log_x, title)


_CURVE = Plot(PRIMARY, "step", title="held-out exact accuracy during training")
_SPEED = Plot("perf/examples_per_sec", "variant", title="throughput")

GROUPS: dict[str, Group] = {g.name: g for g in [
    Group("exp01", "model scaling", "hidden (heads); puzzle_emb_ndim = hidden", "hidden512",
          (_acc("params", True, "exact accuracy vs parameters"), Plot("perf/examples_per_sec", "params", True)),
          ("train/exact_accuracy",)),
    Group("exp02a", "L_cycles", "L_cycles", "L6",
          (_acc("arch.L_cycles", title="exact accuracy vs L_cycles"), _CURVE)),
    Group("exp02b", "H_cycles", "H_cycles", "H3",
          (_acc("arch.H_cycles", title="exact accuracy vs H_cycles"), _CURVE)),
    Group("exp03", "depth vs recursion", "(L_layers, L_cycles) at L_layers x L_cycles = 12", "layers2_cycles6",
          (_acc("arch.L_layers", title="exact accuracy vs layers (effective depth fixed)"), _SPEED)),
    Group("exp04a", "data scaling", "training puzzles (x1000 augmentations; one dataset each)", "puzzles1000",
          (_acc("data.generate_puzzles", True, "exact accuracy vs training puzzles"),
           Plot("train/exact_accuracy", "data.generate_puzzles", True, "training exact accuracy (overfitting gap)")),
          ("train/exact_accuracy",)),
    Group("exp04b", "augmentation", "augmentations per puzzle (1000 puzzles)", "aug1000",
          (_acc("data.generate_num_aug", True, "exact accuracy vs augmentations"),
           Plot("train/exact_accuracy", "data.generate_num_aug", True)), ("train/exact_accuracy",)),
    Group("exp05", "supervision steps", "halt_max_steps", "halt16",
          (_acc("arch.halt_max_steps", title="exact accuracy vs supervision steps"),
           Plot("train/steps", "arch.halt_max_steps", title="mean ACT steps at halting (training)")), ("train/steps",)),
    Group("exp06", "batch scaling", "global batch; lr = 1e-4 * sqrt(batch / 6144)", "batch6144",
          (_acc("train.global_batch_size", True, "exact accuracy vs global batch"),
           Plot("perf/examples_per_sec", "train.global_batch_size", True, "throughput vs batch")), ("train/lr",)),
    Group("exp07", "precision", "forward dtype", "bfloat16",
          (_acc("variant", title="exact accuracy by forward dtype"), _SPEED), ("train/grad_norm",)),
    Group("exp08", "EMA", "EMA on/off and rate", "ema0.999",
          (_acc("variant", title="exact accuracy by EMA rate"), _CURVE)),
    Group("exp09", "optimizer", "optimizer and betas", "adam_atan2",
          (_acc("variant", title="exact accuracy by optimizer"), Plot("train/grad_norm", "step", title="gradient norm")),
          ("train/grad_norm",)),
    Group("exp10", "LR schedule", "lr and lr_min_ratio (cosine to lr * lr_min_ratio)", "lr1e-4",
          (_CURVE, Plot("train/lr", "step", title="learning rate"))),
    Group("contrib01", "curriculum recursion",
          "L_cycles 2->6 and H_cycles 1->3 linearly over the first 10k epochs, vs fixed", "fixed",
          (_CURVE, Plot("train/L_cycles", "step", title="L_cycles in use")), ("perf/examples_per_sec",)),
    Group("contrib02", "adaptive halting", "halt exploration 0.3 annealed to 0.05 over training, vs fixed 0.1", "fixed",
          (_CURVE, Plot("train/halt_exploration_prob", "step", title="exploration probability")),
          ("train/halt_exploration_prob",)),
    Group("contrib03", "rematerialisation", "L_cycles 6, 12, 24, each with and without remat of the recursion", "L6",
          (Plot("perf/compiled_temp_gib", "arch.L_cycles", title="compiled temporaries per device (GiB)"), _SPEED),
          ("perf/compiled_temp_gib",)),
    Group("contrib04", "cycle consistency", "lambda on ||z_H(t+1) - z_H(t)||^2", "lambda0",
          (_acc("arch.cycle_consistency_weight", title="exact accuracy vs lambda"),
           Plot("train/cycle_loss", "step", title="cycle-consistency term")), ("train/cycle_loss",)),
    Group("contrib05", "sparse attention", "full vs local 7x7 window + global prefix; Maze 30x30 and 50x50",
          None, (_acc("variant", title="exact accuracy by attention pattern"), _SPEED)),
    Group("contrib06", "multi-task", "Sudoku only, Maze only, Sudoku + Maze with a shared reasoning core", None,
          (_acc("variant", title="exact accuracy (multi-task: the mean over its tasks)"), _CURVE),
          ("eval/sudoku/exact_accuracy", "eval/maze/exact_accuracy")),
    Group("gemma01", "Gemma models x fine-tuning method", "Gemma 2B / Gemma2-2B / Gemma3-1B, full vs LoRA",
          "gemma1_2b_full",
          (Plot("eval/answer_exact_match", "variant"), Plot("eval/format_adherence", "variant")),
          ("eval/format_adherence", "eval/loss"), base=GEMMA_BASELINE, primary="eval/answer_exact_match", target=0.5),
    Group("gemma02", "Gemma sequence length", "sequence length (Gemma 2B full fine-tune)", "seq1024",
          (Plot("eval/answer_exact_match", "data.seq_len"), Plot("perf/examples_per_sec", "data.seq_len")),
          ("eval/format_adherence", "eval/loss"), base=GEMMA_BASELINE, primary="eval/answer_exact_match", target=0.5),
    Group("gemma03", "Gemma LoRA rank", "LoRA rank (alpha = 2 x rank), Gemma 2B", "rank16",
          (Plot("eval/answer_exact_match", "arch.lora_rank", True), Plot("eval/loss", "arch.lora_rank", True)),
          ("eval/format_adherence", "eval/loss"), base="gemma_sft/gemma2b_lora_v5e8", primary="eval/answer_exact_match", target=0.5),
    Group("gemma04", "Gemma learning rate", "peak learning rate, Gemma 2B full fine-tune", "lr1e-5",
          (Plot("eval/answer_exact_match", "optim.lr", True), Plot("eval/loss", "step")),
          ("eval/format_adherence", "eval/loss"), base=GEMMA_BASELINE, primary="eval/answer_exact_match", target=0.5),
]}

# The metrics every group's table reports (EXPERIMENTS.md), beside its own `extra_metrics`.
# (Mean halt steps: train/steps; evaluation always runs halt_max_steps.)
COMMON_METRICS = ("eval/token_accuracy", "train/steps", "model/params", "perf/examples_per_sec",
                  "perf/compiled_temp_gib")
