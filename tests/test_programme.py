"""The experiment programme's configs: every variant of every group composes, validates, and
changes exactly what EXPERIMENTS.md says it varies; the listing; the scaled-down overrides."""

from __future__ import annotations

import math

import pytest

from experiments import launch
from experiments.compose import changes, compose, local_overrides, variants
from experiments.programme import GROUPS
from runtime.config import validate

BASE = {}  # the baseline variant of a group changes nothing


def _sqrt_lr(batch: int) -> dict:
    return {"train.global_batch_size": batch, "optim.lr": pytest.approx(1e-4 * math.sqrt(batch / 6144), rel=1e-12)}


def _ramp(start, end, fraction):
    return {"start": start, "end": end, "fraction": fraction, "shape": "linear"}


def _hidden(h, heads=None):
    return {"arch.hidden": h, "arch.puzzle_emb_ndim": h} | ({"arch.heads": heads} if heads else {})


def _sudoku(puzzles=1000, aug=1000):
    return {"data.generate_puzzles": puzzles, "data.generate_num_aug": aug,
            "data.path": f"data/sudoku-extreme-{puzzles}-aug-{aug}"}


def _drop_unchanged(d: dict) -> dict:
    base = _sudoku()
    return {k: v for k, v in d.items() if base.get(k) != v}


_LORA = {"arch.lora_rank": 16, "arch.lora_alpha": 32, "arch.param_dtype": "bfloat16", "optim.lr": 2e-4}

# What each variant is meant to change, written from the table in EXPERIMENTS.md.
EXPECTED: dict[str, dict[str, dict]] = {
    "exp01": {"hidden256": _hidden(256, 4), "hidden384": _hidden(384, 6), "hidden512": BASE,
              "hidden768": _hidden(768), "hidden1024": _hidden(1024), "hidden1536": _hidden(1536)},
    "exp02a": {f"L{n}": ({"arch.L_cycles": n} if n != 6 else BASE) for n in (2, 4, 6, 8, 10, 12)},
    "exp02b": {f"H{n}": ({"arch.H_cycles": n} if n != 3 else BASE) for n in (1, 2, 3, 4, 5)},
    "exp03": {f"layers{a}_cycles{b}": ({"arch.L_layers": a, "arch.L_cycles": b} if a != 2 else BASE)
              for a, b in ((1, 12), (2, 6), (3, 4), (4, 3), (6, 2))},
    "exp04a": {f"puzzles{n}": _drop_unchanged(_sudoku(puzzles=n)) for n in (100, 250, 500, 1000, 2000, 5000)},
    "exp04b": {f"aug{n}": _drop_unchanged(_sudoku(aug=n)) for n in (10, 100, 500, 1000, 2000)},
    "exp05": {f"halt{n}": ({"arch.halt_max_steps": n} if n != 16 else BASE) for n in (4, 8, 12, 16, 24, 32)},
    "exp06": {f"batch{b}": (_sqrt_lr(b) if b != 6144 else BASE) for b in (1536, 3072, 6144, 12288, 24576, 49152)},
    "exp07": {"float32": {"arch.forward_dtype": "float32"}, "bfloat16": BASE, "float16": {"arch.forward_dtype": "float16"}},
    "exp08": {"off": {"optim.ema_rate": None}, "ema0.99": {"optim.ema_rate": 0.99}, "ema0.995": {"optim.ema_rate": 0.995},
              "ema0.999": BASE, "ema0.9995": {"optim.ema_rate": 0.9995}},
    "exp09": {"adam_atan2": BASE, "adamw_b2_0.95": {"optim.name": "adamw"},
              "adamw_b2_0.99": {"optim.name": "adamw", "optim.b2": 0.99},
              "adamw_b2_0.999": {"optim.name": "adamw", "optim.b2": 0.999},
              "lion_b2_0.99": {"optim.name": "lion", "optim.b2": 0.99}},
    "exp10": {"lr3e-5": {"optim.lr": 3e-5}, "lr1e-4": BASE, "lr3e-4": {"optim.lr": 3e-4},
              "lr1e-4_min0.1": {"optim.lr_min_ratio": 0.1}, "lr1e-4_min0.01": {"optim.lr_min_ratio": 0.01}},
    "contrib01": {"fixed": BASE, "curriculum": {"curriculum.H_cycles": _ramp(1, 3, 0.2),
                                                 "curriculum.L_cycles": _ramp(2, 6, 0.2)}},
    "contrib02": {"fixed": BASE, "annealed": {"curriculum.halt_exploration_prob": _ramp(0.3, 0.05, 1.0)}},
    "contrib03": {f"L{n}{r}": ({"arch.L_cycles": n} if n != 6 else {}) | ({"arch.remat": True} if r else {})
                  for n in (6, 12, 24) for r in ("", "_remat")},
    "contrib04": {"lambda0": BASE} | {f"lambda{w}": {"arch.cycle_consistency_weight": float(w)} for w in ("0.01", "0.1", "1.0")},
    "contrib05": {f"maze{s}_{p}": {"arch": "trm_att", "data": f"maze_{s}x{s}", "train.global_batch_size": 768}
                  | ({"arch.attention_window": 7} if p == "local7" else {}) for s in (30, 50) for p in ("full", "local7")},
    "contrib06": {"sudoku": {"arch": "trm_att", "train.global_batch_size": 768},
                  "maze": {"arch": "trm_att", "data": "maze_30x30", "train.global_batch_size": 768},
                  "sudoku_maze": {"arch": "trm_att", "data": "sudoku_maze", "train.global_batch_size": 768}},
    "gemma01": {"gemma1_2b_full": BASE, "gemma1_2b_lora": _LORA, "gemma2_2b_full": {"arch": "gemma2_2b"},
                "gemma2_2b_lora": {"arch": "gemma2_2b"} | _LORA, "gemma3_1b_full": {"arch": "gemma3_1b"},
                "gemma3_1b_lora": {"arch": "gemma3_1b"} | _LORA},
    "gemma02": {f"seq{n}": ({"data.seq_len": n} if n != 1024 else BASE) for n in (512, 1024, 2048)},
    "gemma03": {f"rank{r}": ({"arch.lora_rank": r, "arch.lora_alpha": 2 * r} if r != 16 else BASE) for r in (4, 8, 16, 64)},
    "gemma04": {f"lr{lr}": ({"optim.lr": float(lr)} if lr != "1e-5" else BASE) for lr in ("5e-6", "1e-5", "2e-5", "5e-5")},
}


def test_every_group_of_the_programme_is_here():
    missing = [g for g in GROUPS if g not in EXPECTED]
    assert not missing, f"add the intended changes of {missing} to EXPECTED"


@pytest.mark.parametrize("group", sorted(EXPECTED))
def test_each_variant_changes_exactly_the_intended_keys(group):
    assert variants(group) and set(variants(group)) == set(EXPECTED[group]), "variant files vs EXPECTED"
    for variant, intended in EXPECTED[group].items():
        got = changes(group, variant)
        assert got == intended, f"{group}/{variant}"
        validate(compose(f"{group}/{variant}"), f"{group}/{variant}")  # the typed schema accepts it
    baseline = GROUPS[group].baseline_variant
    assert baseline is None or changes(group, baseline) == {}


def test_the_baseline_is_the_reference_setting():
    config = validate(compose("baseline/trm_sudoku_extreme"), "baseline/trm_sudoku_extreme")
    a, o, t = config.arch, config.optim, config.train
    assert (a.name, a.mlp_t, a.pos_encodings, a.forward_dtype) == ("trm", True, "none", "bfloat16")
    assert (a.L_layers, a.H_cycles, a.L_cycles, a.hidden, a.heads, a.expansion) == (2, 3, 6, 512, 8, 4.0)
    assert (a.halt_max_steps, a.halt_exploration_prob, a.puzzle_emb_ndim) == (16, 0.1, 512)
    assert (o.name, o.lr, o.lr_min_ratio, o.warmup_steps, o.weight_decay, o.b1, o.b2, o.ema_rate) == (
        "adam_atan2", 1e-4, 1.0, 2000, 1.0, 0.9, 0.95, 0.999)
    assert (t.global_batch_size, t.epochs, t.eval_every_epochs, t.checkpoint_every_epochs) == (6144, 50000, 5000, 5000)
    assert (config.data.generate_puzzles, config.data.generate_num_aug) == (1000, 1000)


def test_listing_shows_every_group_and_variant(capsys):
    assert launch.main(["list"]) == 0
    out = capsys.readouterr().out
    for group in GROUPS:
        assert f"{group}: {GROUPS[group].title}" in out
        for variant in variants(group):
            line = next(l for l in out.splitlines() if f" {group}/{variant} " in l)
            assert ("the baseline" in line) == (changes(group, variant) == {})
    assert "exp06/batch1536" in out and "optim.lr=5e-05 train.global_batch_size=1536" in out
    assert launch.main(["list", "exp99"]) == 2


def _as_dict(overrides: list[str]) -> dict[str, str]:
    return dict(o.split("=", 1) for o in overrides)


def test_scaled_down_runs_keep_each_group_s_ratios():
    o = _as_dict(local_overrides("exp01", "hidden256"))
    assert (o["arch.hidden"], o["arch.heads"], o["train.global_batch_size"]) == ("32", "1", "64")
    o = _as_dict(local_overrides("exp01", "hidden512"))
    assert (o["arch.hidden"], o["arch.heads"]) == ("64", "2")
    o = _as_dict(local_overrides("exp06", "batch1536"))
    assert o["train.global_batch_size"] == "16" and float(o["optim.lr"]) == pytest.approx(1e-3 * 0.5)
    o = _as_dict(local_overrides("exp08", "ema0.9995"))  # 1 - rate keeps its ratio: 0.0005/0.001 of 0.01
    assert float(o["optim.ema_rate"]) == pytest.approx(0.995)
    assert _as_dict(local_overrides("exp08", "off"))["optim.ema_rate"] == "null"
    o = _as_dict(local_overrides("exp02a", "L12"))  # not a scaled key: the variant's value stays
    assert "arch.L_cycles" not in o and o["arch.hidden"] == "64"
    local = validate(compose("exp02a/L12", tuple(local_overrides("exp02a", "L12"))), "exp02a/L12")
    assert (local.arch.L_cycles, local.arch.hidden, local.arch.puzzle_emb_ndim, local.train.steps) == (12, 64, 64, 300)
    o = _as_dict(local_overrides("gemma03", "rank64"))
    assert (o["arch"], o["arch.lora_rank"], o["arch.lora_alpha"]) == ("gemma_tiny", "64", "128")
    local = validate(compose("gemma01/gemma2_2b_lora", tuple(local_overrides("gemma01", "gemma2_2b_lora"))), "x/y")
    assert (local.arch.name, local.arch.lora_rank, local.data.name) == ("gemma_tiny", 16, "sft")
