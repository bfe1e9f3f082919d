"""Compose the programme's variants and say what each changes (`changes`, `differences`); scale
them down for one CPU (`local_overrides`, `local_experiment`).

Differences are between RESOLVED configs, so derived values (exp06's learning rate) show up as
what they become.

Scaling down (experiments/local_scale.yaml): every key listed there takes its local value, except
that a key the variant changes keeps its ratio to the pod baseline (hidden 256 of 512 becomes 32
of a local 64; an EMA rate keeps its ratio of 1 - rate); keys not listed keep the variant's
value. So each group keeps what it studies and shrinks everything else.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from experiments.programme import GROUPS, Group, variant_files
from runtime import hydra_compose

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"
LOCAL_SCALE = Path(__file__).resolve().parent / "local_scale.yaml"
IGNORED = ("run.",)  # where a run goes is not what it studies


variants = variant_files  # a group's variants, in natural order
GROUP_CHOICES = ("arch", "data", "optim", "mesh")  # config groups an experiment may swap


@lru_cache(maxsize=None)
def _composed(experiment: str, overrides: tuple[str, ...] = ()) -> tuple[DictConfig, dict[str, str]]:
    cfg, choices = hydra_compose.compose([f"+experiment={experiment}", *overrides])
    return cfg, {k: choices[k] for k in GROUP_CHOICES}


def compose(experiment: str, overrides: tuple[str, ...] = ()) -> DictConfig:
    """The composed (unresolved) config of `+experiment=<experiment>` with `overrides`."""
    return _composed(experiment, tuple(overrides))[0]


def choices(experiment: str) -> dict[str, str]:
    """The experiment's config-group choices, e.g. {"arch": "trm_mlp", "data": "sudoku_extreme", ...}."""
    return _composed(experiment)[1]


def flat(cfg: DictConfig) -> dict[str, Any]:
    """Resolved config as {dotted key: leaf value}; lists, and each curriculum ramp, stay whole."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node and prefix.count(".") < (2 if prefix.startswith("curriculum.") else 99):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            out[prefix[:-1]] = node

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return out


def _diff(before: dict[str, Any], after: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    keys = set(before) | set(after)
    return {k: (before.get(k), after.get(k)) for k in sorted(keys)
            if before.get(k) != after.get(k) and not k.startswith(IGNORED)}


def base_of(group: str) -> str:
    return GROUPS[group].base if group in GROUPS else Group.base


def differences(group: str, variant: str) -> dict[str, tuple[Any, Any]]:
    """{key: (baseline value, variant value)} of every resolved key the variant changes."""
    return _diff(flat(compose(base_of(group))), flat(compose(f"{group}/{variant}")))


def changes(group: str, variant: str) -> dict[str, Any]:
    """Swapped presets ({"arch": "trm_att"}), then every resolved key that differs from the baseline
    composed with those presets."""
    base = base_of(group)
    swapped = {k: v for k, v in choices(f"{group}/{variant}").items() if choices(base)[k] != v}
    like_base = compose(base, tuple(f"{k}={v}" for k, v in swapped.items()))
    keys = _diff(flat(like_base), flat(compose(f"{group}/{variant}")))
    return swapped | {k: new for k, (_, new) in keys.items()}


def describe(change: dict[str, Any]) -> str:
    """'arch.hidden=256 arch.heads=4' (or 'the baseline')."""
    return " ".join(f"{k}={_short(v)}" for k, v in change.items()) or "the baseline"


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_short(v)}" for k, v in value.items()) + "}"
    return str(value)


# ------------------------------------------------------------------------------ scaled down


def local_scale(family: str, scale: str = "local") -> dict[str, Any]:
    """The family's section of local_scale.yaml; `scale="smoke"` merges the smaller test values in."""
    with open(LOCAL_SCALE) as f:
        spec = yaml.safe_load(f)
    out = dict(spec[family])
    if scale == "smoke":
        smoke = dict(spec["smoke"][family])
        out["task"] = {**out.get("task", {}), **smoke.pop("task", {})}
        out["set"] = {**out["set"], **smoke}
    return out


def family(group: str) -> str:
    return "gemma" if GROUPS[group].base.startswith("gemma") else "trm"


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _rescaled(key: str, local: Any, pod: Any, new: Any, scale: dict[str, Any]) -> Any:
    """The local value of a key the variant changes from `pod` to `new`: numbers keep their
    ratio; anything else keeps the variant's value, except strings the local file sets (paths)."""
    if not (_number(local) and _number(pod) and pod):
        return local if isinstance(local, str) else new
    if new is None or not _number(new):
        return new
    if key in scale.get("complement", ()):  # rates near 1: keep the ratio of 1 - rate
        return 1 - (1 - local) * (1 - new) / (1 - pod)
    value = local * new / pod
    if isinstance(local, int) and isinstance(new, int):
        return max(0 if key in scale.get("may_be_zero", ()) else 1, round(value))
    return float(f"{value:.6g}")


def local_settings(group: str, variant: str, scale_name: str = "local") -> tuple[dict[str, str], dict[str, Any]]:
    """(config groups to swap, {dotted key: value} to set) that run `<group>/<variant>` scaled down."""
    scale = local_scale(family(group), scale_name)
    diff = differences(group, variant)
    values = {key: _rescaled(key, local, *diff[key], scale) if key in diff and diff[key][0] is not None else local
              for key, local in scale["set"].items()}
    tasks = OmegaConf.select(compose(f"{group}/{variant}"), "data.tasks") or {}
    for task in tasks:  # multi-task data: each task's set is generated small, under the local data root
        for key, local in scale.get("task", {}).items():
            values[f"data.tasks.{task}.{key}"] = local.replace("<task>", task) if isinstance(local, str) else local
    for key in scale.get("keep", ()):  # variant values to re-apply over a swapped group (arch=gemma_tiny)
        if key in diff:
            values[key] = diff[key][1]
    return dict(scale.get("groups", {})), values


def local_overrides(group: str, variant: str, extra: tuple[str, ...] = (), scale_name: str = "local") -> list[str]:
    """Hydra overrides that run `<group>/<variant>` scaled down (see the module docstring)."""
    swaps, values = local_settings(group, variant, scale_name)
    return ([f"{k}={v}" for k, v in swaps.items()] + [f"{k}={_override_value(v)}" for k, v in values.items()]
            + list(extra))


def local_experiment(group: str, variant: str, scale_name: str = "local") -> str:
    """The scaled-down run as an experiment file (YAML) for `launch.py sweep --local`'s multirun."""
    swaps, values = local_settings(group, variant, scale_name)
    nested: dict[str, Any] = {}
    for key, value in values.items():
        *parents, leaf = key.split(".")
        node = nested
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    defaults = [f"/experiment/{group}/{variant}", *({f"override /{k}": v} for k, v in swaps.items()), "_self_"]
    header = f"# @package _global_\n# {group}/{variant} scaled down (experiments/compose.py, local_scale.yaml)\n"
    return header + yaml.safe_dump({"defaults": defaults, **nested}, sort_keys=False)


def _override_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, str) and "${" in value:
        return f"'{value}'"
    return str(value)
