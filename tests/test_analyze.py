"""experiments/analyze.py: tables and plots of a group's runs, from local files and from W&B.

Runs are written the way the trainer writes them: metrics.jsonl through MetricsSinks (W&B
disabled, clock faked so that wall times are known) and run_manifest.json with the composed
config. The W&B path is fed by a fake `wandb.Api` built from the same rows (merged per step,
as W&B stores them); no W&B server is reached.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread
from omegaconf import OmegaConf

from experiments import analyze as an
from experiments.compose import compose
from experiments.programme import GROUPS, Plot
from runtime import metrics_sinks
from runtime.metrics_sinks import MetricsSinks

REPO = Path(__file__).resolve().parents[1]
T0 = 1_700_000_000.0

# Per run: eval accuracies at EVAL_STEPS, seconds per step, params, examples/s, compiled temp GiB.
TRAIN_STEPS = (100, 200, 300, 400, 500)
EVAL_STEPS = (200, 400, 500)
EXP01 = {
    "hidden256": dict(acc=(0.40, 0.61, 0.60), sps=1.0, params=1_234_567, eps=900.0, gib=0.5),
    "hidden256_train.seed=1": dict(acc=(0.42, 0.62, 0.63), sps=1.0, params=1_234_567, eps=905.0, gib=0.5),
    "hidden512": dict(acc=(0.70, 0.88, 0.86), sps=2.0, params=5_031_234, eps=500.0, gib=1.234),
    "hidden1024": dict(acc=(0.90, 0.93, 0.95), sps=4.0, params=19_876_543, eps=250.0, gib=3.456),
}
EXP06 = {
    "batch1536": dict(acc=(0.50, 0.80, 0.87), sps=1.0, params=5_031_234, eps=300.0, gib=0.4, batch=1536),
    "batch6144": dict(acc=(0.60, 0.85, 0.90), sps=1.5, params=5_031_234, eps=900.0, gib=1.1, batch=6144),
    "batch24576": dict(acc=(0.30, 0.50, 0.70), sps=3.0, params=5_031_234, eps=2500.0, gib=4.2, batch=24576),
}


class Clock:
    now = T0

    def time(self) -> float:
        return self.now


def write_run(root: Path, group: str, name: str, spec: dict, monkeypatch, *, status="completed",
              truncate=False) -> Path:
    """One run as the trainer leaves it: metrics.jsonl via MetricsSinks, run_manifest.json."""
    variant = an.match_variant(name, an._variants(group))
    config = OmegaConf.to_container(compose(f"{group}/{variant}"), resolve=True)
    config["run"].update(group=group, name=name)
    clock = Clock()
    monkeypatch.setattr(metrics_sinks, "time", clock)
    out = root / group / name
    with MetricsSinks(is_primary=True, output_dir=out, wandb_mode="disabled", wandb_project="p", wandb_entity=None,
                      group=group, name=name, run_id=name, config=config, total_steps=TRAIN_STEPS[-1],
                      progress_bar=False) as sinks:
        sinks.log(0, {"model/params": spec["params"], "perf/compiled_temp_gib": spec["gib"],
                      "perf/compiled_argument_gib": spec["gib"] / 2})
        accs = dict(zip(EVAL_STEPS, spec["acc"]))
        for step in TRAIN_STEPS:
            clock.now = T0 + step * spec["sps"]
            sinks.log(step, {"train/loss": 1.0 / step, "train/exact_accuracy": accs.get(step, 0.1) + 0.05,
                             "train/lr": 1e-4 * step / 500, "perf/examples_per_sec": spec["eps"], "train/steps": 12.5})
            if step in accs:
                clock.now += 0.5
                sinks.log(step, {"eval/exact_accuracy": accs[step], "eval/token_accuracy": 0.9 + accs[step] / 10,
                                 "eval/loss": 0.3})
    manifest = {"run_id": name, "status": status, "exit_code": 0, "plan": {"output_dir": str(out)},
                "config": config, "final_metrics": {"eval/exact_accuracy": spec["acc"][-1]}}
    (out / "run_manifest.json").write_text(json.dumps(manifest, indent=2))
    if truncate:  # a crash in the middle of a row
        with open(out / "metrics.jsonl", "a") as f:
            f.write('{"step": 600, "time": 1700000600.0, "eval/exact_accuracy": 0.')
    return out


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    """outputs/ with exp01 (3 variants + a sweep job) and exp06 (3 variants)."""
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("outputs")
    try:
        for name, spec in EXP01.items():
            write_run(root, "exp01", name, spec, mp, status="failed" if name == "hidden1024" else "completed",
                      truncate=name == "hidden512")
        for name, spec in EXP06.items():
            write_run(root, "exp06", name, spec, mp)
    finally:
        mp.undo()
    (root / "exp01" / "hidden768").mkdir()  # a run that never logged: no metrics.jsonl, skipped
    (root / "exp01" / "hidden768" / "run_manifest.json").write_text("{}")
    return root


def parse_table(text: str) -> tuple[list[str], list[dict[str, str]]]:
    lines = [line for line in text.splitlines() if line.startswith("|")]
    split = lambda line: [c.strip() for c in line.strip().strip("|").split(" | ")]  # noqa: E731
    head = split(lines[0])
    assert set(lines[1]) <= set("|-: ")
    return head, [dict(zip(head, split(line))) for line in lines[2:]]


# ------------------------------------------------------------------------------------ Run


def test_collect_local_reads_the_trainer_files(roots):
    runs = an.collect_local("exp01", roots)
    assert [r.name for r in runs] == ["hidden256", "hidden256_train.seed=1", "hidden512", "hidden1024"]
    assert [r.variant for r in runs] == ["hidden256", "hidden256", "hidden512", "hidden1024"]
    r256, seed1, r512, r1024 = runs
    assert seed1.sweep_suffix == "train.seed=1" and r256.sweep_suffix == ""
    # the truncated last line of hidden512 is skipped; the rest is there
    assert r512.last("eval/exact_accuracy") == 0.86 and r512.best("eval/exact_accuracy") == 0.88
    assert r512.curve("eval/exact_accuracy") == [(200, 0.70), (400, 0.88), (500, 0.86)]
    assert r512.last("model/params") == 5_031_234
    assert r512.config_value("arch.hidden") == 512 and r256.config_value("arch.hidden") == 256
    assert r512.config_value("arch.nope") is None and r512.config_value("nope.x", 3) == 3
    assert (r512.status, r1024.status) == ("completed", "failed")
    # time to target: first eval row >= 0.87 (step 400, 2 s per step, eval 0.5 s after train row)
    assert r512.time_to("eval/exact_accuracy", 0.87) == (400 * 2.0 + 0.5, 400)
    assert r1024.time_to("eval/exact_accuracy", 0.87) == (200 * 4.0 + 0.5, 200)
    assert r256.time_to("eval/exact_accuracy", 0.87) is None
    assert an.collect_local("exp02a", roots) == []


def test_run_helpers_on_nonfinite_and_resumed_rows():
    rows = [{"step": 0, "time": 10.0, "model/params": 7},
            {"step": 100, "time": 20.0, "train/loss": 2.0, "eval/acc": 0.5},
            {"step": 200, "time": 30.0, "train/loss": "nan", "eval/acc": None},
            {"step": 100, "time": 50.0, "eval/acc": 0.6},  # resumed from step 100
            {"step": 200, "time": 60.0, "eval/acc": 0.9}]
    run = an.Run("x", None, {"a": {"b": None}}, rows)
    assert np.isnan(run.last("train/loss")) and run.best("train/loss") == 2.0
    assert run.last("eval/acc") == 0.9 and run.best("eval/acc") == 0.9
    assert run.curve("eval/acc") == [(100, 0.6), (200, 0.9)]
    assert run.time_to("eval/acc", 0.55) == (40.0, 100)
    assert run.last("missing") is None and run.best("missing") is None and run.curve("missing") == []
    assert run.config_value("a.b", "default") is None  # a null value is a value


def test_match_variant_prefers_the_longest_variant():
    known = ["L6", "L6_remat", "L12"]
    assert an.match_variant("L6", known) == "L6"
    assert an.match_variant("L6_remat_train.seed=2", known) == "L6_remat"
    assert an.match_variant("L6_train.seed=2", known) == "L6"
    assert an.match_variant("L60", known) is None


# ---------------------------------------------------------------------------------- table


def test_exp01_table_rows_numbers_and_baseline(roots):
    text = an.table("exp01", an.collect_local("exp01", roots))
    assert text.splitlines()[0] == "## exp01: model scaling"
    head, rows = parse_table(text)
    assert head[:4] == ["variant", "changes", "final eval/exact_accuracy", "best eval/exact_accuracy"]
    assert head[4:] == ["eval/token_accuracy", "train/steps", "params", "perf/examples_per_sec",
                        "perf/compiled_temp_gib", "train/exact_accuracy", "status", "steps to 0.87"]
    assert [r["variant"] for r in rows] == ["hidden256", "hidden256_train.seed=1", "hidden512*", "hidden1024"]
    by = {r["variant"].rstrip("*"): r for r in rows}
    assert by["hidden512"]["changes"] == "the baseline"
    assert by["hidden256"]["changes"] == "heads=4 hidden=256 puzzle_emb_ndim=256"
    assert by["hidden256_train.seed=1"]["changes"] == "heads=4 hidden=256 puzzle_emb_ndim=256 [train.seed=1]"
    assert by["hidden1024"]["changes"] == "hidden=1024 puzzle_emb_ndim=1024"
    expected = {  # variant: (final, best, params, examples/s, GiB, steps to target, status)
        "hidden256": ("0.6000", "0.6100", "1.23M", "900", "0.50", "not reached", "completed"),
        "hidden256_train.seed=1": ("0.6300", "0.6300", "1.23M", "905", "0.50", "not reached", "completed"),
        "hidden512": ("0.8600", "0.8800", "5.03M", "500", "1.23", "400 (13.3 min)", "completed"),
        "hidden1024": ("0.9500", "0.9500", "19.88M", "250", "3.46", "200 (13.3 min)", "failed"),
    }
    for name, (final, best, params, eps, gib, to_target, status) in expected.items():
        row = by[name]
        assert (row["final eval/exact_accuracy"], row["best eval/exact_accuracy"]) == (final, best), name
        assert (row["params"], row["perf/examples_per_sec"], row["perf/compiled_temp_gib"]) == (params, eps, gib), name
        assert (row["steps to 0.87"], row["status"]) == (to_target, status), name
        acc = EXP01[name]["acc"][-1]
        assert row["eval/token_accuracy"] == f"{0.9 + acc / 10:.4f}" and row["train/steps"] == "12.5"
        assert row["train/exact_accuracy"] == f"{acc + 0.05:.4f}"
    assert "Not run: hidden384, hidden768, hidden1536." in text


def test_exp06_table_extra_metric_and_missing_values(roots):
    runs = an.collect_local("exp06", roots)
    runs[0].rows = [r for r in runs[0].rows if "model/params" not in r]  # e.g. a run from before that row existed
    head, rows = parse_table(an.table("exp06", runs))
    assert head[-3] == "train/lr"
    assert [r["variant"] for r in rows] == ["batch1536", "batch6144*", "batch24576"]
    assert rows[0]["params"] == "" and rows[1]["params"] == "5.03M"
    assert [r["train/lr"] for r in rows] == ["0.0001"] * 3
    assert rows[0]["changes"] == "lr=5e-05 global_batch_size=1536"
    # batch1536 lost its step-0 row: its clock starts at its first train row (step 100)
    assert [r["steps to 0.87"] for r in rows] == ["500 (6.7 min)", "500 (12.5 min)", "not reached"]
    assert [r["perf/examples_per_sec"] for r in rows] == ["300", "900", "2,500"]


def test_what_changes_shortens(monkeypatch):
    change = {"arch": "trm_att", "arch.hidden": 256, "curriculum.L_cycles": {"start": 2.0, "end": 6.0},
              "arch.L_cycles": 3, "optim.ema_rate": None, "data.path": "data/sudoku-extreme-100-aug-1000"}
    monkeypatch.setattr(an, "_variant_changes", lambda group, variant: change)
    run = an.Run("hidden256_train.seed=1", "hidden256", {}, [])
    assert an.what_changes("exp01", run) == ("arch=trm_att hidden=256 curriculum.L_cycles=2->6 arch.L_cycles=3 "
                                             "… (+2 more) [train.seed=1]")
    del change["data.path"]
    assert an.what_changes("exp01", run) == ("arch=trm_att hidden=256 curriculum.L_cycles=2->6 arch.L_cycles=3 "
                                             "ema_rate=null [train.seed=1]")
    monkeypatch.setattr(an, "_variant_changes", lambda group, variant: {"arch.x": 1, "optim.x": 2})
    assert an.what_changes("exp01", an.Run("hidden256", "hidden256", {}, [])) == "arch.x=1 optim.x=2"  # ambiguous: kept
    monkeypatch.setattr(an, "_variant_changes", lambda group, variant: {})
    assert an.what_changes("exp01", an.Run("hidden512", "hidden512", {}, [])) == "the baseline"
    assert an.what_changes("exp01", an.Run("mine", None, {}, [])) == "(not a variant of exp01)"


def test_format_value():
    assert an.format_value("model/params", 5_031_234) == "5.03M"
    assert an.format_value("model/params", 1_500_000_000) == "1.50B"
    assert an.format_value("model/params", 52_000) == "52.00K"
    assert an.format_value("perf/compiled_temp_gib", 1.0) == "1.00"
    assert an.format_value("eval/exact_accuracy", 0.87654) == "0.8765"
    assert an.format_value("eval/exact_accuracy", 1) == "1.0000"
    assert an.format_value("train/loss", 0.0123456) == "0.01235"
    assert an.format_value("perf/examples_per_sec", 123456.7) == "123,457"
    assert an.format_value("eval/exact_accuracy", float("nan")) == "nan"
    assert an.format_value("x", None) == ""


# ---------------------------------------------------------------------------------- plots


def _assert_png(path: Path) -> np.ndarray:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = imread(path)
    assert img.ndim == 3 and img.shape[0] >= 300 and img.shape[1] >= 500
    flat = img.reshape(-1, img.shape[-1])
    assert not (flat == flat[0]).all()
    assert len(np.unique(flat, axis=0)) > 20  # text, axes, markers: not a blank canvas
    return img


def test_analyze_writes_markdown_and_pngs(roots, tmp_path):
    runs = an.collect_local("exp01", roots)
    md, pngs = an.analyze("exp01", runs, tmp_path / "analysis")
    assert md == tmp_path / "analysis" / "exp01.md"
    assert [p.name for p in pngs] == ["exp01_1_eval_exact_accuracy.png", "exp01_2_perf_examples_per_sec.png"]
    for p in pngs:
        _assert_png(p)
    text = md.read_text()
    assert text.startswith(an.table("exp01", runs))
    assert "![exact accuracy vs parameters](exp01_1_eval_exact_accuracy.png)" in text
    assert "(exp01_2_perf_examples_per_sec.png)" in text
    # default out_dir: <root>/<group>/analysis, and a second collect ignores it (no metrics.jsonl)
    md2, _ = an.analyze("exp01", runs, root=roots)
    assert md2 == roots / "exp01" / "analysis" / "exp01.md" and md2.is_file()
    assert len(an.collect_local("exp01", roots)) == 4


def test_params_plot_points_are_the_runs(roots):
    runs = an.collect_local("exp01", roots)
    fig = an.make_figure("exp01", GROUPS["exp01"].plots[0], runs)
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_xlabel().startswith("parameters")
    points = sorted(tuple(off) for c in ax.collections for off in c.get_offsets())
    assert points == sorted((s["params"], s["acc"][-1]) for s in EXP01.values())
    sizes = {tuple(c.get_offsets()[0]): c.get_sizes()[0] for c in ax.collections}
    assert sizes.pop((5_031_234, 0.86)) > max(sizes.values())  # the baseline is highlighted
    assert any(t.get_text() == "hidden512 (baseline)" for t in ax.texts)
    line = ax.get_lines()[0]  # mean per x through the runs sorted by x
    assert list(line.get_xdata()) == [1_234_567, 5_031_234, 19_876_543]
    assert np.allclose(line.get_ydata(), [(0.60 + 0.63) / 2, 0.86, 0.95])


def test_step_curves_one_per_run(roots, tmp_path, monkeypatch):
    runs = an.collect_local("exp06", roots)
    curve = Plot("eval/exact_accuracy", "step", title="curves")
    fig = an.make_figure("exp06", curve, runs)
    ax = fig.axes[0]
    lines = ax.get_lines()
    assert len(lines) == 3
    for line, name in zip(lines, ["batch1536", "batch6144", "batch24576"]):
        assert line.get_label().startswith(name)
        assert list(line.get_xdata()) == list(EVAL_STEPS)
        assert list(line.get_ydata()) == list(EXP06[name]["acc"])
    assert lines[1].get_label() == "batch6144 (baseline)" and lines[1].get_linewidth() > lines[0].get_linewidth()
    assert ax.get_legend() is not None
    monkeypatch.setitem(GROUPS, "exp06", dataclasses.replace(GROUPS["exp06"], plots=(curve,)))
    (png,) = an.plot("exp06", runs, tmp_path)
    assert png.name == "exp06_1_eval_exact_accuracy.png"
    _assert_png(png)


def test_config_key_plot_with_null_values_does_not_crash(tmp_path, monkeypatch):
    """exp08-style: optim.ema_rate is null for 'off' -> a labelled line, not a crash."""
    monkeypatch.setitem(GROUPS, "exp08", dataclasses.replace(
        GROUPS["exp08"], plots=(Plot("eval/exact_accuracy", "optim.ema_rate", title="by rate"),
                                Plot("eval/exact_accuracy", "variant"))))
    runs = [an.Run(v, v, {"optim": {"ema_rate": rate}}, [{"step": 10, "time": 1.0, "eval/exact_accuracy": acc}])
            for v, rate, acc in [("ema0.99", 0.99, 0.5), ("ema0.995", 0.995, "nan"), ("ema0.999", 0.999, 0.8),
                                 ("off", None, 0.3)]]
    fig = an.make_figure("exp08", GROUPS["exp08"].plots[0], runs)
    ax = fig.axes[0]
    assert sorted(tuple(o) for c in ax.collections for o in c.get_offsets()) == [(0.99, 0.5), (0.999, 0.8)]
    assert [t.get_text() for t in fig.texts] == ["eval/exact_accuracy not finite: ema0.995"]  # diverged: named
    assert any(line.get_label() == "off (optim.ema_rate=null)" for line in ax.get_lines())
    bars_ax = an.make_figure("exp08", GROUPS["exp08"].plots[1], runs).axes[0]
    assert [round(b.get_height(), 3) for b in bars_ax.patches] == [0.5, 0.8, 0.3]  # nan left out
    assert [t.get_text() for t in bars_ax.get_xticklabels()] == ["ema0.99", "ema0.999 *", "off"]
    colors = [tuple(b.get_facecolor()) for b in bars_ax.patches]
    assert colors[0] == colors[2] != colors[1]  # the baseline's bar stands out
    for p in an.plot("exp08", runs, tmp_path):
        _assert_png(p)


# ------------------------------------------------------------------------------------ W&B


class FakeWandbRun:
    def __init__(self, run_dir: Path, state: str):
        manifest = json.loads((run_dir / "run_manifest.json").read_text())
        self.name, self.id, self.state, self.config = run_dir.name, manifest["run_id"], state, manifest["config"]
        merged: dict[int, dict] = {}  # W&B keeps one history row per step
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            h = merged.setdefault(row["step"], {"_step": row["step"], "_timestamp": row["time"],
                                                "_runtime": row["time"] - T0})
            h.update({k: v for k, v in row.items() if k not in ("step", "time")})
        self._history = [merged[s] for s in sorted(merged)]

    def scan_history(self):
        return iter(self._history)


class FakeApi:
    def __init__(self, runs):
        self._runs, self.calls = runs, []

    def runs(self, path, filters=None):
        self.calls.append((path, filters))
        return [r for r in self._runs if filters.get("group") in ("exp01",)]


def _without(head: list[str], rows: list[dict[str, str]], column: str) -> list[list[str]]:
    return [[r[h] for h in head if h != column] for r in rows]


def test_wandb_path_gives_the_local_table(roots):
    fakes = [FakeWandbRun(d, "finished") for d in sorted((roots / "exp01").iterdir()) if (d / "metrics.jsonl").is_file()]
    api = FakeApi(list(reversed(fakes)))
    runs = an.collect_wandb("exp01", "podrunner", "me", api=api)
    assert api.calls == [("me/podrunner", {"group": "exp01"})]
    assert [r.name for r in runs] == ["hidden256", "hidden256_train.seed=1", "hidden512", "hidden1024"]
    local = an.collect_local("exp01", roots)
    assert runs[2].config == local[2].config and runs[2].curve("eval/exact_accuracy") == local[2].curve("eval/exact_accuracy")
    head_w, rows_w = parse_table(an.table("exp01", runs))
    head_l, rows_l = parse_table(an.table("exp01", local))
    assert head_w == head_l
    assert _without(head_w, rows_w, "status") == _without(head_l, rows_l, "status")
    assert [r["status"] for r in rows_w] == ["finished"] * 4  # W&B's state, not the manifest's word
    an.collect_wandb("exp01", "podrunner", api=api)
    assert api.calls[-1] == ("podrunner", {"group": "exp01"})


# ------------------------------------------------------------------------------------ CLI


def test_cli_no_runs_is_one_error_line(tmp_path, capsys):
    assert an.main(["exp01", "--root", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert err.startswith(f"error: no runs of exp01 under {tmp_path / 'exp01'}; ")
    assert "python experiments/launch.py sweep exp01 --local" in err and "--root" in err
    (tmp_path / "local" / "exp01" / "hidden256").mkdir(parents=True)
    (tmp_path / "local" / "exp01" / "hidden256" / "metrics.jsonl").write_text("")
    assert an.main(["exp01", "--root", str(tmp_path)]) == 2
    assert f"--root {tmp_path / 'local'}" in capsys.readouterr().err
    assert an.main(["exp99"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown group 'exp99'")


def test_cli_script_prints_table_and_paths(roots, tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "experiments/launch.py", "analyze", "exp06", "--root", str(roots), "--out",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "## exp06: batch scaling" in proc.stdout and "| batch6144* |" in proc.stdout
    assert f"wrote {out / 'exp06.md'}" in proc.stdout
    for name in ("exp06_1_eval_exact_accuracy.png", "exp06_2_perf_examples_per_sec.png"):
        assert f"wrote {out / name}" in proc.stdout
        _assert_png(out / name)


def test_cli_wandb_errors_are_one_line(monkeypatch, capsys):
    def unreachable(group, project, entity=None):
        raise RuntimeError("could not reach api.wandb.ai\nretrying...")

    monkeypatch.setattr(an, "collect_wandb", unreachable)
    assert an.main(["exp01", "--wandb", "podrunner"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("error: could not read W&B project 'podrunner': RuntimeError")
    monkeypatch.setattr(an, "collect_wandb", lambda group, project, entity=None: [])
    assert an.main(["exp01", "--wandb", "podrunner", "--entity", "me"]) == 2
    assert capsys.readouterr().err == "error: no W&B runs with group=exp01 in me/podrunner; check the project and --entity, or read local runs with --root\n"
    assert an.main(["exp01", "--entity", "me"]) == 2
    assert capsys.readouterr().err == "error: --entity needs --wandb PROJECT\n"
