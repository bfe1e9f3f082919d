"""The experiment programme (docs/EXPERIMENTS.md) as data: one folder per group.

A group is `experiments/<group>/group.yaml` (what it studies, its baseline variant, its plots,
the variants the tests run); its variants are `conf/experiment/<group>/<variant>.yaml`, and what
each changes is composed (`experiments/compose.py`), never restated here. `GROUPS` loads them on
first use; a bad group.yaml raises `GroupFileError` (one line naming the file and the fix).
"""

from __future__ import annotations

import dataclasses
import re
from collections import UserDict
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from runtime.errors import UserError

EXPERIMENTS_DIR = Path(__file__).resolve().parent
VARIANTS_DIR = EXPERIMENTS_DIR.parent / "conf" / "experiment"
GROUP_FILE = "group.yaml"

BASELINE = "baseline/trm_sudoku_extreme"  # the experiment every TRM group varies
PRIMARY = "eval/exact_accuracy"

# The W&B keys every run of a family logs, and what each shows: docs/EXPERIMENTS.md's table and
# the group READMEs (experiments/readmes.py) are written from these; a group's own keys are in
# its group.yaml (`readme.watch`). Families: experiments/compose.py `family`.
WANDB_KEYS: dict[str, tuple[tuple[str, str], ...]] = {
    "trm": (
        (PRIMARY, "**primary**: share of held-out puzzles solved exactly (EMA weights when EMA is on)"),
        ("eval/token_accuracy", "share of cells predicted right"),
        ("eval/steps", "mean ACT steps in evaluation; every row runs `halt_max_steps`, so it equals that value"),
        ("train/steps", "mean ACT step at which training rows halted (learned halting; `eval/steps` cannot show it)"),
        ("train/lm_loss", "stablemax cross-entropy of the training rows"),
        ("train/q_halt_accuracy", "how often the halting head's \"solved\" call is right"),
        ("train/grad_norm", "global gradient norm"),
        ("perf/examples_per_sec", "training throughput"),
        ("perf/compiled_temp_gib", "per-device temporaries of the compiled train step (logged once, at start)"),
        ("model/params", "parameter count (logged once)"),
        ("eval_subset/exact_accuracy_stderr", "standard error of the exact accuracy on the seeded evaluation subset"),
    ),
    "gemma": (
        ("eval/answer_exact_match", "**primary**: share of greedy answers whose `<answer>` matches (first "
                                    "`data.eval_generate_examples` test prompts)"),
        ("eval/format_adherence", "share of greedy answers in the `<reasoning>...</reasoning><answer>...</answer>` format"),
        ("eval/loss", "held-out next-token loss on the model turns"),
        ("train/loss", "training next-token loss on the model turns"),
        ("train/grad_norm", "global gradient norm (before clipping at 1.0)"),
        ("perf/examples_per_sec", "training throughput in examples"),
        ("perf/tokens_per_sec", "training throughput in tokens"),
        ("perf/mfu", "model FLOPs utilisation"),
        ("perf/compiled_temp_gib", "per-device temporaries of the compiled train step (logged once)"),
        ("model/params", "parameter count (logged once)"),
    ),
}


class GroupFileError(UserError):
    """A group folder whose group.yaml is missing, malformed or names something that is not there."""


@dataclass(frozen=True)
class Plot:
    y: str  # a metric key, e.g. "eval/exact_accuracy": its last value, or its curve when x is "step"
    x: str  # "params" | "step" | "variant" (a bar each) | a config key ("arch.hidden")
    log_x: bool = False
    title: str = ""


@dataclass(frozen=True)
class Group:
    name: str
    title: str
    varies: str  # in the words of EXPERIMENTS.md
    baseline_variant: str | None  # the variant that is the base itself (None: all differ)
    plots: tuple[Plot, ...]
    extra_metrics: tuple[str, ...] = ()  # group-specific table columns
    base: str = BASELINE  # the experiment the variants build on
    primary: str = PRIMARY
    target: float = 0.87  # the accuracy "time to target" is measured at (the baseline's ~87%)
    varies_keys: tuple[str, ...] = ()  # the resolved keys its variants may change (besides preset swaps)
    example_variants: tuple[str, ...] = ()  # run beside the baseline variant for the README's example plot
    smoke_variants: tuple[str, ...] = ()  # variants that add a code path: the tests train them for a few steps
    readme: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)  # its README's own facts (experiments/readmes.py)


# The metrics every group's table reports (EXPERIMENTS.md), beside its own `extra_metrics`.
# (Mean halt steps: train/steps; evaluation always runs halt_max_steps.)
COMMON_METRICS = ("eval/token_accuracy", "train/steps", "model/params", "perf/examples_per_sec",
                  "perf/compiled_temp_gib")

_REQUIRED = ("title", "varies", "baseline_variant", "varies_keys", "plots")
_FIELDS = {f.name: f for f in dataclasses.fields(Group) if f.name != "name"}
_PLOT_FIELDS = {f.name for f in dataclasses.fields(Plot)}


_NUMBER = re.compile(r"(\d+(?:\.\d+)?)")


def natural_key(name: str) -> tuple:
    """Numbers by value (hidden256 < hidden1024, lr0.5 < lr2), then the text (x01 < x1), so the order
    never depends on the order names were found in."""
    return tuple((0, float(t), "") if _NUMBER.fullmatch(t) else (1, 0.0, t) for t in _NUMBER.split(name) if t), name


def variant_files(group: str) -> list[str]:
    """The variants of `group`: conf/experiment/<group>/*.yaml, in natural order (hidden256 < hidden1024)."""
    return sorted((p.stem for p in (VARIANTS_DIR / group).glob("*.yaml")), key=natural_key)


def _strings(where: str, key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise GroupFileError(f"{where}: {key} must be a list of names (quote a name YAML reads as another type, e.g. \"off\"), got {value!r}")
    return tuple(value)


def _plot(where: str, i: int, raw: Any) -> Plot:
    if not isinstance(raw, dict) or not {"x", "y"} <= set(raw) or set(raw) - _PLOT_FIELDS:
        raise GroupFileError(f"{where}: plots[{i}] must be a mapping with y, x and optionally log_x, title; got {raw!r}")
    if not all(isinstance(raw[k], str) for k in ("x", "y")) or not isinstance(raw.get("log_x", False), bool):
        raise GroupFileError(f"{where}: plots[{i}]: x and y are names, log_x true/false; got {raw!r}")
    return Plot(**raw)


def _check_names(where: str, name: str, spec: dict[str, Any]) -> None:
    known = variant_files(name)
    if not known:
        raise GroupFileError(f"{where}: the group has no variants; add conf/experiment/{name}/<variant>.yaml files")
    chosen = [spec["baseline_variant"], *spec.get("example_variants", ()), *spec.get("smoke_variants", ())]
    bad = sorted({v for v in chosen if v is not None and v not in known})
    if bad:
        raise GroupFileError(f"{where}: no variant file(s) {bad} in conf/experiment/{name}/; the variants are {known}")


def load_group(folder: Path) -> Group:
    """Read and check `<folder>/group.yaml`; the group's name is the folder's."""
    name, path = folder.name, folder / GROUP_FILE
    where = f"experiments/{name}/{GROUP_FILE}"
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise GroupFileError(f"{where}: cannot read it: {' '.join(str(e).split())}") from e
    if not isinstance(raw, dict):
        raise GroupFileError(f"{where}: expected a mapping of {sorted(_FIELDS)}, got {type(raw).__name__}")
    wrong = [f"{what} key(s) {keys}" for what, keys in (("unknown", sorted(set(raw) - set(_FIELDS))),
                                                         ("missing", [k for k in _REQUIRED if k not in raw])) if keys]
    if wrong:
        raise GroupFileError(f"{where}: {'; '.join(wrong)}; the keys are {sorted(_FIELDS)}")
    spec: dict[str, Any] = {}
    for key, value in raw.items():
        spec[key] = value
        if key == "plots":
            if not isinstance(value, list) or not value:
                raise GroupFileError(f"{where}: plots must be a non-empty list of {{y, x, log_x, title}}")
            spec[key] = tuple(_plot(where, i, p) for i, p in enumerate(value))
        elif key in ("extra_metrics", "varies_keys", "example_variants", "smoke_variants"):
            spec[key] = _strings(where, key, value)
        elif key == "target":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise GroupFileError(f"{where}: target must be a number, got {value!r}")
            spec[key] = float(value)
        elif key == "readme":
            if not isinstance(value, dict):
                raise GroupFileError(f"{where}: readme must be a mapping of its README's facts (experiments/readmes.py), got {value!r}")
        elif not isinstance(value, str) or not value:
            if key != "baseline_variant" or value is not None:  # a group may have no baseline (null)
                raise GroupFileError(f"{where}: {key} must be a non-empty string, got {value!r}")
    if not spec["varies_keys"]:
        raise GroupFileError(f"{where}: varies_keys is empty; name the config keys the variants change")
    _check_names(where, name, spec)
    return Group(name=name, **spec)


def load_groups() -> dict[str, Group]:
    """Every `experiments/<group>/group.yaml`, in natural order of the folder names."""
    folders = sorted((p.parent for p in EXPERIMENTS_DIR.glob(f"*/{GROUP_FILE}")), key=lambda p: natural_key(p.name))
    return {folder.name: load_group(folder) for folder in folders}


class _Groups(UserDict[str, Group]):
    """GROUPS, loaded on first use: a bad file is one `error:` line of the command that needs it, not
    a traceback at import. UserDict's methods all go through `data`, here loaded when first read."""

    def __init__(self) -> None:  # not UserDict's, which sets `data`
        self._groups: dict[str, Group] | None = None

    @property
    def data(self) -> dict[str, Group]:
        if self._groups is None:
            self._groups = load_groups()
        return self._groups

    @data.setter
    def data(self, groups: dict[str, Group]) -> None:
        self._groups = groups

    def __repr__(self) -> str:
        return f"GROUPS({list(self)})"


GROUPS: MutableMapping[str, Group] = _Groups()


def groups_named(names: list[str]) -> list[str]:
    """The groups `names` names (none, or `all`: every group); an unknown one is a UserError."""
    known = list(GROUPS)
    unknown = [g for g in names if g not in known and names != ["all"]]
    if unknown:
        raise UserError(f"unknown group(s) {unknown}; the groups are {known} (or all)")
    return known if names in ([], ["all"]) else names
