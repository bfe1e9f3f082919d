"""The programme end to end: every group's analysis (its table and every plot of its group.yaml)
on runs written the way the trainer writes them, and a few-step scaled-down training run of
each code path the programme has (each group's `smoke_variants`: a dataset kind, a model
family or a feature switch), then the analysis of those real runs.

The training runs go through `experiments/examples.py --smoke` (the script that draws the
READMEs' example plots), in two processes on one CPU device each: one JAX start-up per process,
no 8-device partitioning."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread
from omegaconf import OmegaConf

from helpers import REPO, child_env
from experiments.analyze import analyze, collect_local
from experiments.compose import compose, variants
from experiments.programme import COMMON_METRICS, GROUPS
from runtime.metrics_sinks import MetricsSinks

STEPS = 2
SMOKE = [g for g in GROUPS if GROUPS[g].smoke_variants]


# ----------------------------------------------------------- every group's analysis, no training


def _metrics(group: str) -> list[str]:
    spec = GROUPS[group]
    keys = [spec.primary, *spec.extra_metrics, *COMMON_METRICS, *(p.y for p in spec.plots)]
    return list(dict.fromkeys(keys))


def _write_run(root: Path, group: str, variant: str, rng: np.random.Generator) -> dict[str, float]:
    """metrics.jsonl (through the trainer's MetricsSinks) and run_manifest.json of one run whose
    every metric the group reports is drawn at random; returns the last value of each."""
    config = OmegaConf.to_container(compose(f"{group}/{variant}"), resolve=True)
    config["run"].update(group=group, name=variant)
    out = root / group / variant
    last: dict[str, float] = {}
    with MetricsSinks(is_primary=True, output_dir=out, wandb_mode="disabled", wandb_project="p", wandb_entity=None,
                      group=group, name=variant, run_id=variant, config=config, total_steps=30,
                      progress_bar=False) as sinks:
        for step in (10, 20, 30):
            last = {key: float(rng.uniform(0.05, 0.95)) for key in _metrics(group)}
            last["model/params"] = float(rng.integers(10_000, 10_000_000))
            sinks.log(step, last)
    manifest = {"run_id": variant, "status": "completed", "exit_code": 0, "config": config,
                "final_metrics": {k: last[k] for k in _metrics(group)}}
    (out / "run_manifest.json").write_text(json.dumps(manifest))
    return last


def _assert_analysis(group: str, root: Path, finals: dict[str, float]) -> None:
    """The table has a row per run with its own final primary metric; every plot is drawn."""
    spec = GROUPS[group]
    runs = collect_local(group, str(root))
    assert {r.name for r in runs} == set(finals)
    md, pngs = analyze(group, runs, root / group / "analysis")
    table = md.read_text()
    assert f"## {group}: {spec.title}" in table
    for run in runs:
        row = next(line for line in table.splitlines() if line.startswith(f"| {run.variant}"))
        assert f"{finals[run.name]:.4f}" in row, row
    assert len(pngs) == len(spec.plots) and sorted(pngs) == sorted((root / group / "analysis").glob("*.png"))
    for png in pngs:
        image = imread(png)
        assert image.ndim == 3 and image.shape[0] > 100 and np.ptp(image) > 0
        pixels = np.round(image * 255).astype(np.uint32).reshape(-1, image.shape[-1])
        colours = pixels @ (256 ** np.arange(pixels.shape[1], dtype=np.uint32))  # one integer per colour
        assert len(np.unique(colours)) > 20  # more than a blank canvas


@pytest.mark.parametrize("group", list(GROUPS))
def test_group_analysis_on_written_runs(group, tmp_path):
    """The runs of the README's example (baseline variant and example variants): two or more per
    group, so that every plot has something to compare."""
    spec = GROUPS[group]
    rng = np.random.default_rng(sorted(GROUPS).index(group))
    chosen = dict.fromkeys(([spec.baseline_variant] if spec.baseline_variant else []) + list(spec.example_variants))
    assert len(chosen) >= 2 and set(chosen) <= set(variants(group))
    finals = {v: _write_run(tmp_path, group, v, rng)[spec.primary] for v in chosen}
    _assert_analysis(group, tmp_path, finals)


# ------------------------------------------------------------------------ the code paths, trained


# Groups whose smoke run is spent executing (900-token mazes), not compiling: they run at XLA's default
# optimisation (16 s), the others at -O0 (contrib05 took 27 s at -O0; gemma01 11 s at -O0, 22 s optimised).
EXECUTION_BOUND = {"contrib05"}


@pytest.fixture(scope="module")
def smoke_root(tmp_path_factory):
    """Two processes (XLA compiles on one core each): the execution-bound groups at XLA's default
    optimisation, the rest at -O0; each process with its own data folder."""
    root = tmp_path_factory.mktemp("programme")
    halves = [[g for g in SMOKE if g not in EXECUTION_BOUND], [g for g in SMOKE if g in EXECUTION_BOUND]]
    procs = [subprocess.Popen([sys.executable, str(REPO / "experiments" / "examples.py"), "--smoke", *half,
                               "--steps", str(STEPS), "--root", str(root)], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=child_env(1, optimized=bool(i), PODRUNNER_LOCAL_DATA=str(root / f"_data{i}")))
             for i, half in enumerate(halves) if half]
    outs = [p.communicate(timeout=1500) for p in procs]
    stderr = "".join(e for _, e in outs)
    (root / "examples.log").write_text("".join(o for o, _ in outs) + "\n--- stderr\n" + stderr)
    return root, stderr


@pytest.mark.slow
@pytest.mark.parametrize("group", SMOKE)
def test_code_path_trains_and_is_analysed(group, smoke_root):
    root, stderr = smoke_root
    assert f"error: {group} failed" not in stderr, stderr[-3000:]
    spec = GROUPS[group]
    runs = collect_local(group, str(root))
    assert {r.variant for r in runs} == set(spec.smoke_variants)
    for run in runs:
        assert max(r["step"] for r in run.rows) == STEPS
        manifest = json.loads((root / group / run.name / "run_manifest.json").read_text())
        assert (manifest["status"], manifest["exit_code"]) == ("completed", 0)
        final = run.last(spec.primary)
        assert final is not None and np.isfinite(final), f"{group}/{run.name}: no {spec.primary}"
    table = (root / group / "analysis" / f"{group}.md").read_text()
    for run in runs:  # each run's own final primary metric is in its row
        row = next(line for line in table.splitlines() if line.startswith(f"| {run.variant}"))
        assert f"{run.last(spec.primary):.4f}" in row, row
    assert len(list((root / group / "analysis").glob("*.png"))) == len(spec.plots)
