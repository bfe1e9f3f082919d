"""Schedules that change during training (config.curriculum): the ramp values at given steps,
one train step per (H_cycles, L_cycles) stage, and the annealed halt exploration."""

from __future__ import annotations

import pytest

from helpers import base_overrides, compose_config, read_jsonl, train
from runtime.config import RampConfig, cycles_at, ramp_value
from runtime.errors import UserError
from runtime.builder import curriculum_metrics, curriculum_stages


def test_ramp_values_at_given_steps():
    linear = RampConfig(start=0.3, end=0.05, fraction=1.0)
    assert [float(ramp_value(linear, s, 100)) for s in (0, 50, 100, 150)] == pytest.approx([0.3, 0.175, 0.05, 0.05])
    early = RampConfig(start=2, end=6, fraction=0.2)  # reach the end at 20% of training, then hold
    assert [float(ramp_value(early, s, 100)) for s in (0, 10, 20, 90)] == pytest.approx([2, 4, 6, 6])
    cosine = RampConfig(start=1.0, end=0.0, fraction=1.0, shape="cosine")
    assert [float(ramp_value(cosine, s, 100)) for s in (0, 50, 100)] == pytest.approx([1.0, 0.5, 0.0], abs=1e-6)


def test_curriculum_stage_values_and_boundaries():
    """contrib01's schedule: H 1->3 and L 2->6 over the first 20% (floor: equal shares)."""
    config = compose_config(["+experiment=contrib01/curriculum"])
    total = 1000  # the ramp spans 200 steps
    assert cycles_at(config, 0, total) == (1, 2)
    assert cycles_at(config, 49, total) == (1, 2) and cycles_at(config, 50, total) == (1, 3)
    assert cycles_at(config, 100, total) == (2, 4)
    assert cycles_at(config, 199, total) == (2, 5) and cycles_at(config, 200, total) == (3, 6)
    assert cycles_at(config, 999, total) == (3, 6)
    fixed = compose_config(["+experiment=contrib01/fixed"])
    assert {cycles_at(fixed, s, total) for s in (0, 500, 999)} == {(3, 6)}
    assert curriculum_metrics(fixed, 10, total) == {}
    assert curriculum_metrics(config, 100, total) == {"train/H_cycles": 2, "train/L_cycles": 4}
    annealed = compose_config(["+experiment=contrib02/annealed"])
    assert curriculum_metrics(annealed, 500, total)["train/halt_exploration_prob"] == pytest.approx(0.175)


def test_each_stage_is_built_once_with_its_cycles():
    config = compose_config(["+experiment=contrib01/curriculum"])
    built = []

    def build(arch):
        built.append((arch.H_cycles, arch.L_cycles))
        return object()

    final = object()
    at_step = curriculum_stages(config, 1000, final, build)
    stages = [at_step(s) for s in range(0, 1000, 10)]
    assert built == [(1, 2), (1, 3), (2, 4), (2, 5)]  # each distinct pair once, in order
    assert stages[-1] is final and stages[0] is stages[1] is not final  # (3, 6) is the arch's own Steps
    assert len({id(s) for s in stages}) == 5
    fixed = compose_config(["+experiment=contrib01/fixed"])
    assert curriculum_stages(fixed, 1000, final, build)(0) is final
    three = compose_config(["curriculum.L_cycles.start=2", "curriculum.L_cycles.end=6", "arch=trm_mlp"])  # dotted keys work too
    assert cycles_at(three, 0, 10) == (3, 2)


@pytest.mark.parametrize("override, message", [
    ("curriculum.H_cycles={start:0,end:3}", "curriculum.H_cycles must stay >= 1"),
    ("curriculum.L_cycles={start:2,end:6,fraction:1.5}", "0 < fraction <= 1"),
    ("curriculum.L_cycles.start=2", "needs both start and end"),
])
def test_bad_curriculum_is_one_line(override, message):
    with pytest.raises(UserError, match=message):
        compose_config(["+experiment=baseline/trm_sudoku_extreme", override])


@pytest.mark.slow
@pytest.mark.devices(1)  # stages and their checks, not the mesh
def test_curriculum_run_switches_stages_and_logs_them(sudoku_dir, tmp_path):
    """A real run: H_cycles 1 -> 2 over the first half; each stage compiles once, the logged
    values follow the schedule, and the exploration probability anneals."""
    overrides = base_overrides(sudoku_dir, tmp_path, steps=6) + [
        "arch=trm_mlp", "arch.hidden=32", "arch.heads=2", "arch.L_layers=1", "arch.H_cycles=2", "arch.L_cycles=1",
        "arch.halt_max_steps=2", "arch.puzzle_emb_len=1", "arch.forward_dtype=float32", "optim=adam_atan2",
        "curriculum.H_cycles={start:1,end:2,fraction:0.5}",
        "curriculum.halt_exploration_prob={start:0.5,end:0.0,fraction:1.0}"]
    log = train(overrides).log
    assert log.count("compiled train step") == 2
    assert "curriculum: H_cycles=1 L_cycles=1 from step 0" in log
    rows = [r for r in read_jsonl(tmp_path / "test" / "t" / "metrics.jsonl") if "train/H_cycles" in r]
    assert [(r["step"], r["train/H_cycles"]) for r in rows] == [(1, 1), (2, 1), (3, 1), (4, 2), (5, 2), (6, 2)]
    assert [r["train/halt_exploration_prob"] for r in rows] == pytest.approx([0.5 * (1 - s / 6) for s in range(6)])


@pytest.mark.slow
@pytest.mark.devices(1)  # stages and their checks, not the mesh
def test_resume_refuses_another_variant_s_optimizer(sudoku_dir, tmp_path):
    """One checkpoint directory, two variants that differ only in the optimizer (a sweep with a
    fixed run.checkpoint.dir): the second must not continue the first's run."""
    train(base_overrides(sudoku_dir, tmp_path, steps=2))
    result = train(base_overrides(sudoku_dir, tmp_path, steps=4) + ["optim.b2=0.99"], check=False)
    assert result.code == 2 and "optim.b2=0.95" in result.error and "0.99" in result.error
