"""Every group's scaled-down local run (a few steps) and its analysis: the table names the
group's variants with their real numbers and every plot is drawn.

All groups run in ONE subprocess on one CPU device (`experiments/examples.py`, the script
that draws the READMEs' example plots): one JAX start-up, no 8-device partitioning."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from matplotlib.image import imread

from conftest import REPO, child_env
from experiments.analyze import collect_local
from experiments.examples import EXAMPLE_VARIANTS
from experiments.programme import GROUPS

pytestmark = pytest.mark.slow
STEPS = 2


class _Done:
    def __init__(self, procs):
        outs = [p.communicate(timeout=1500) for p in procs]
        self.stdout = "".join(o for o, _ in outs)
        self.stderr = "".join(e for _, e in outs)


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory):
    """Two processes (XLA compiles on one core each), each with half the groups and its own
    data folder (the TRM baseline runs in each)."""
    root = tmp_path_factory.mktemp("programme")
    gemma = [g for g in GROUPS if g.startswith("gemma")]
    heavy = ["contrib05", "contrib06"]  # attention over 900-cell mazes, two tasks
    trm = [g for g in GROUPS if g not in gemma + heavy]
    halves = [trm[:8] + gemma + ["contrib06"], trm[8:] + ["contrib05"]]
    procs = [subprocess.Popen([sys.executable, str(REPO / "experiments" / "examples.py"), *halves[i],
                               "--steps", str(STEPS), "--scale", "smoke", "--root", str(root)], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=child_env(1, PODRUNNER_LOCAL_DATA=str(root / f"_data{i}")))
             for i in range(2)]
    done = _Done(procs)
    (root / "examples.log").write_text(done.stdout + "\n--- stderr\n" + done.stderr)
    return root, done


@pytest.mark.parametrize("group", list(GROUPS))
def test_group_local_run_and_analysis(group, runs_root):
    root, proc = runs_root
    assert f"error: {group} failed" not in proc.stderr, proc.stderr[-3000:]
    spec = GROUPS[group]
    expected = set(EXAMPLE_VARIANTS[group]) | ({spec.baseline_variant} if spec.baseline_variant else set())
    runs = collect_local(group, str(root))
    assert {r.variant for r in runs} == expected
    for run in runs:
        assert max(r["step"] for r in run.rows) == STEPS
        assert json.loads((root / group / run.name / "run_manifest.json").read_text())["status"] == "completed"
    table = (root / group / "analysis" / f"{group}.md").read_text()
    assert f"## {group}: {spec.title}" in table
    for run in runs:  # each run's own final primary metric is in its row
        row = next(line for line in table.splitlines() if line.startswith(f"| {run.variant}"))
        final = run.last(spec.primary)
        assert final is not None and f"{final:.4f}" in row, row
    plots = sorted((root / group / "analysis").glob("*.png"))
    assert len(plots) == len(spec.plots)
    for png in plots:
        image = imread(png)
        assert image.ndim == 3 and image.shape[0] > 100 and np.ptp(image) > 0
