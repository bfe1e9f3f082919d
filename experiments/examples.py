"""Few-step scaled-down runs of every group, in one process, then each group's analysis: what
the tests exercise (tests/test_programme_runs.py) and what draws the example plot beside each
group's README.

    python experiments/examples.py [GROUP ...] [--steps 20] [--root outputs/examples] [--scale local|smoke] [--readme-plots]

Each group runs two variants scaled down exactly as `launch.py sweep GROUP --local` would
(experiments/local_scale.yaml), cut to `--steps` steps with a small eval: its baseline variant
(run once per model family and copied in) and the one named in EXAMPLE_VARIANTS.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from experiments.compose import compose, family, local_overrides  # noqa: E402
from experiments.programme import GROUPS  # noqa: E402

# Per group: the variant run beside its baseline (a group without a baseline variant runs both).
EXAMPLE_VARIANTS: dict[str, tuple[str, ...]] = {
    "exp01": ("hidden256",), "exp02a": ("L2",), "exp02b": ("H1",), "exp03": ("layers3_cycles4",),
    "exp04a": ("puzzles100",), "exp04b": ("aug100",), "exp05": ("halt4",), "exp06": ("batch3072",),
    "exp07": ("float32",), "exp08": ("off",), "exp09": ("adamw_b2_0.99",), "exp10": ("lr3e-4",),
    "contrib01": ("curriculum",), "contrib02": ("annealed",), "contrib03": ("L12_remat",),
    "contrib04": ("lambda0.1",), "contrib05": ("maze30_full", "maze30_local7"),
    "contrib06": ("sudoku", "sudoku_maze"),
    "gemma01": ("gemma1_2b_lora",), "gemma02": ("seq512",), "gemma03": ("rank4",), "gemma04": ("lr5e-5",),
}
# The family baselines (run once, copied into each group as its baseline variant).
FAMILY_BASELINE = {"trm": ("exp02a", "L6"), "gemma": ("gemma02", "seq1024")}


def tiny(steps: int) -> tuple[str, ...]:
    """A few steps with a small eval; W&B off (the JSONL metrics are what the analysis reads)."""
    return (f"train.steps={steps}", "train.log_every=1", f"train.eval_every={steps}", f"train.checkpoint_every={steps}",
            "data.eval_max_examples=8", "data.eval_generate_examples=8", "data.eval_max_new_tokens=16",
            "data.generate_test_puzzles=8", "run.wandb.mode=disabled", "run.progress_bar=false")


SCALE = "local"  # or "smoke" (--scale): local_scale.yaml's smaller sizes, for the tests


def run_variant(group: str, variant: str, root: Path, steps: int) -> Path:
    """One scaled-down run, in this process; returns its output directory."""
    from runtime.config import validate
    from runtime.trainer import run

    overrides = tuple(local_overrides(group, variant, tiny(steps) + (f"run.root={root}",), scale_name=SCALE))
    config = validate(compose(f"{group}/{variant}", overrides), f"{group}/{variant}")
    code = run(config)
    if code:
        raise RuntimeError(f"{group}/{variant} exited {code}")
    return root / group / variant


def run_group(group: str, root: Path, steps: int, baselines: dict[str, Path]) -> list[Path]:
    """The group's example variants, plus its baseline variant (copied from the family's run)."""
    spec = GROUPS[group]
    out = []
    if spec.baseline_variant is not None:
        fam = family(group)
        if fam not in baselines:
            baselines[fam] = run_variant(*FAMILY_BASELINE[fam], root=root / f"_baselines_{os.getpid()}", steps=steps)
        target = root / group / spec.baseline_variant
        if not target.exists():
            shutil.copytree(baselines[fam], target, ignore=shutil.ignore_patterns("checkpoints", "wandb"))
        out.append(target)
    for variant in EXAMPLE_VARIANTS[group]:
        out.append(run_variant(group, variant, root, steps))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("groups", nargs="*", metavar="GROUP")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--root", type=Path, default=Path("outputs/examples"))
    parser.add_argument("--scale", choices=("local", "smoke"), default="local",
                        help="local: as `sweep --local` (default); smoke: smaller still (the tests)")
    parser.add_argument("--readme-plots", action="store_true",
                        help="copy each group's first plot to experiments/<group>/example.png")
    args = parser.parse_args(argv)
    global SCALE
    SCALE = args.scale
    os.environ.setdefault("PODRUNNER_LOCAL_DATA", str(args.root / "_data"))
    from experiments.analyze import analyze, collect_local

    baselines: dict[str, Path] = {}
    failed = []
    for group in args.groups or list(GROUPS):
        try:
            run_group(group, args.root, args.steps, baselines)
        except Exception as e:  # noqa: BLE001 - one group's failure must not hide the others
            print(f"error: {group} failed: {' '.join(str(e).split())[:500]}", file=sys.stderr, flush=True)
            failed.append(group)
            continue
        table, plots = analyze(group, collect_local(group, str(args.root)), args.root / group / "analysis")
        print(Path(table).read_text(), flush=True)
        if args.readme_plots and plots:
            shutil.copy(plots[0], REPO_ROOT / "experiments" / group / "example.png")
    if failed:
        print(f"error: failed groups: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
