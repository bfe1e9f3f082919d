"""Hardening, round three: a form setting (`arch.attention`, `arch.mixer`, `arch.grid_width`) on a
model that has no such part is one `error:` line (exit 2), before any compile, with every file that
was there byte-identical afterwards (test_hardening.refused). HRM, Gemma and the tiny transformer
refuse theirs through their schemas (an unknown key); the TRM variants share one schema, so their
family checks which parts this TRM has."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from helpers import base_overrides, compose_config
from test_hardening import refused


@pytest.fixture
def data(sudoku_dir, tmp_path) -> Path:
    copy = tmp_path / "data"
    shutil.copytree(sudoku_dir, copy)
    return copy


@pytest.mark.parametrize("overrides,needles", [
    (["arch=trm_mlp", "arch.attention=xla"], ["arch.attention='xla'", "has no attention", "arch=trm_att"]),
    (["arch=trm_mlp", "arch.attention=splash"], ["arch.attention='splash'", "has no attention"]),
    (["arch=trm_att", "arch.mixer=pallas"], ["arch.mixer='pallas'", "has no mlp_t mixer", "arch=trm_mlp"]),
    (["arch=trm_att", "arch.mixer=xla"], ["arch.mixer='xla'", "has no mlp_t mixer"]),
    (["arch=trm_att", "arch.grid_width=9"], ["arch.grid_width=9", "arch.attention_window is not set"]),
    (["arch=hrm", "+arch.mixer=xla"], ["arch.mixer"]),  # HRM's schema has no mixer
    (["arch=tiny_transformer", "+arch.attention=xla"], ["arch.attention"]),
], ids=["trm_mlp attention=xla", "trm_mlp attention=splash", "trm_att mixer=pallas", "trm_att mixer=xla",
        "trm_att grid_width without window", "hrm mixer", "tiny attention"])
def test_a_form_setting_on_a_model_without_that_part_is_one_line(data, tmp_path, overrides, needles):
    runs = tmp_path / "runs"
    refused(tmp_path, base_overrides(data, runs, steps=2) + overrides, *needles)
    assert not runs.exists()


def test_the_forms_a_trm_has_are_accepted(data, tmp_path):
    """The same settings on the variant that has the part compose and validate."""
    base = base_overrides(data, tmp_path / "runs", steps=2)
    assert compose_config(base + ["arch=trm_mlp", "arch.mixer=xla"]).arch.mixer == "xla"
    assert compose_config(base + ["arch=trm_att", "arch.attention=xla"]).arch.attention == "xla"
    window = compose_config(base + ["arch=trm_att", "arch.attention_window=3", "arch.grid_width=9"]).arch
    assert (window.attention_window, window.grid_width) == (3, 9)
