"""The generated docs (experiments/readmes.py): each group README is what its group.yaml, its
variants, its plots and docs/results/ make; a group.yaml without a README fact is one line naming
it; the READMEs repeat almost nothing (what they share is in docs/EXPERIMENTS.md)."""

from __future__ import annotations

import collections
import shutil

import pytest

from experiments import readmes
from experiments.programme import EXPERIMENTS_DIR, GROUPS, GroupFileError, load_group


def shared_lines(texts: list[str], at_least: int = 10) -> int:
    """How many non-blank lines stand in `at_least` or more of `texts`, counted at every occurrence:
    the measure of what the group READMEs repeat (about a thousand before they were generated)."""
    seen_in = collections.Counter(line for t in texts for line in {ln for ln in t.splitlines() if ln.strip()})
    return sum(1 for t in texts for line in t.splitlines() if line.strip() and seen_in[line] >= at_least)


@pytest.mark.parametrize("group", list(GROUPS))
def test_each_group_readme_is_what_the_generator_writes(group):
    path = EXPERIMENTS_DIR / group / "README.md"
    assert path.read_text() == readmes.render(GROUPS[group], readmes.plan_results()), (
        f"experiments/{group}/README.md differs from what its group.yaml makes; run `{readmes.COMMAND}`")


def test_results_and_the_shared_wandb_keys_are_generated():
    from experiments.results import render_results
    assert readmes.RESULTS_MD.read_text() == render_results(), f"docs/RESULTS.md is stale; run `{readmes.COMMAND}`"
    text = readmes.EXPERIMENTS_MD.read_text()
    assert text == readmes.with_wandb_keys(text), f"docs/EXPERIMENTS.md's W&B keys are stale; run `{readmes.COMMAND}`"
    for keys in readmes.WANDB_KEYS.values():
        for key, _ in keys:
            assert f"`{key}`" in text


@pytest.mark.parametrize("fact", readmes.REQUIRED)
def test_a_group_yaml_without_a_readme_fact_names_it(tmp_path, fact):
    folder = tmp_path / "exp01"
    shutil.copytree(EXPERIMENTS_DIR / "exp01", folder)
    group = load_group(folder)
    facts = dict(group.readme)
    del facts[fact]
    broken = type(group)(**{**group.__dict__, "readme": facts})
    with pytest.raises(GroupFileError, match=f"experiments/exp01/group.yaml: readme: missing fact\\(s\\) \\['{fact}'\\]"):
        readmes.check_facts(broken)


def test_a_plan_variant_that_is_not_a_variant_is_named():
    group = GROUPS["exp01"]
    broken = type(group)(**{**group.__dict__, "readme": {**group.readme, "plan_variant": "hidden9999"}})
    with pytest.raises(GroupFileError, match="plan_variant 'hidden9999' is not a variant"):
        readmes.check_facts(broken)


def test_shared_lines_counts_each_occurrence_of_a_line_most_files_hold():
    texts = ["a\nb\nb\n\nc", "a\nb", "a\nd"]
    assert shared_lines(texts, at_least=3) == 3  # "a" in all three; blank lines never count
    assert shared_lines(texts, at_least=2) == 6  # and "b", at each of its three occurrences


def test_the_group_readmes_share_fewer_than_50_lines():
    texts = [(EXPERIMENTS_DIR / g / "README.md").read_text() for g in GROUPS]
    assert len(texts) >= 10
    assert shared_lines(texts, at_least=10) < 50, "say what every group shares once, in docs/EXPERIMENTS.md"
