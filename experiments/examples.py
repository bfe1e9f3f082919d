"""Few-step scaled-down runs of the programme's groups, in one process, then each group's
analysis: what draws the example plot beside each group's README, and (--smoke) what the tests
train (tests/test_programme_runs.py).

    python experiments/examples.py [GROUP ...] [--steps 20] [--root outputs/examples] [--scale local|smoke] [--readme-plots]
    python experiments/examples.py --smoke [GROUP ...] [--steps 2] [--root DIR]

Each run is scaled down as `launch.py sweep GROUP --local` would, cut to `--steps` steps: a
group's `example_variants` and its baseline variant (run once per base experiment, copied into
each group that shares it); `--smoke`: only its `smoke_variants` (those that add a code path), at
the smaller `smoke` scale.
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

from experiments.analyze import analyze, collect_local  # noqa: E402
from experiments.compose import compose, local_overrides  # noqa: E402
from experiments.programme import GROUPS, groups_named  # noqa: E402
from runtime.errors import EXIT_FAILURE, EXIT_USER_ERROR, UserError  # noqa: E402
from runtime.config import validate  # noqa: E402
from runtime.ranges import Rule, at_least, check_args  # noqa: E402
from runtime.trainer import run  # noqa: E402

# Ranges of the command line's numbers (as runtime/config.py's _RULES for a run's settings).
_RULES: dict[str, Rule] = {"--steps": (at_least(1), "")}


def tiny(steps: int) -> tuple[str, ...]:
    """A few steps with a small eval; W&B off (the JSONL metrics are what the analysis reads)."""
    return (f"train.steps={steps}", "train.log_every=1", f"train.eval_every={steps}", f"train.checkpoint_every={steps}",
            "data.eval_max_examples=8", "data.eval_generate_examples=8", "data.eval_max_new_tokens=16",
            "data.generate_test_puzzles=8", "run.wandb.mode=disabled", "run.progress_bar=false")


def run_variant(group: str, variant: str, root: Path, steps: int, scale: str) -> Path:
    """One run at `scale` (local_scale.yaml's "local" or smaller "smoke"), in this process; its directory."""
    overrides = tuple(local_overrides(group, variant, tiny(steps) + (f"run.root={root}",), scale_name=scale))
    config = validate(compose(f"{group}/{variant}", overrides), f"{group}/{variant}")
    code = run(config)
    if code:
        raise RuntimeError(f"{group}/{variant} exited {code}")
    return root / group / variant


def run_group(group: str, root: Path, steps: int, scale: str, baselines: dict[str, Path]) -> None:
    """The group's example variants, plus its baseline variant (copied from the run of its base)."""
    spec = GROUPS[group]
    if spec.baseline_variant is not None:
        if spec.base not in baselines:
            baselines[spec.base] = run_variant(group, spec.baseline_variant, root / f"_baselines_{os.getpid()}",
                                               steps, scale)
        target = root / group / spec.baseline_variant
        if not target.exists():
            shutil.copytree(baselines[spec.base], target, ignore=shutil.ignore_patterns("checkpoints", "wandb"))
    for variant in spec.example_variants:
        if variant != spec.baseline_variant:
            run_variant(group, variant, root, steps, scale)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("groups", nargs="*", metavar="GROUP")
    parser.add_argument("--steps", type=int, default=None, help="default: 20 (2 with --smoke)")
    parser.add_argument("--root", type=Path, default=Path("outputs/examples"))
    parser.add_argument("--scale", choices=("local", "smoke"), default=None,
                        help="local: as `sweep --local` (the default); smoke: smaller still (the default with --smoke)")
    parser.add_argument("--smoke", action="store_true",
                        help="run each group's smoke_variants only (default --scale smoke, --steps 2)")
    parser.add_argument("--readme-plots", action="store_true",
                        help="copy each group's first plot to experiments/<group>/example.png")
    args = parser.parse_args(argv)
    scale = args.scale or ("smoke" if args.smoke else "local")
    steps = args.steps or (2 if args.smoke else 20)
    try:
        check_args(args, _RULES, UserError)  # else every group fails on its own line
        groups = groups_named(args.groups)
    except UserError as e:  # a number out of range, an unknown group, a bad group.yaml
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    os.environ.setdefault("PODRUNNER_LOCAL_DATA", str(args.root / "_data"))
    baselines: dict[str, Path] = {}
    failed = []
    if args.smoke:
        groups = [g for g in groups if GROUPS[g].smoke_variants]
    for group in groups:
        try:
            if args.smoke:  # the group's smoke variants: each adds a code path the tests train
                for variant in GROUPS[group].smoke_variants:
                    run_variant(group, variant, args.root, steps, scale)
            else:
                run_group(group, args.root, steps, scale, baselines)
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
    return EXIT_FAILURE if failed else 0


if __name__ == "__main__":
    sys.exit(main())
