"""What a reference TRM/HRM run says about its model, for `import_reference`.

The reference's pretrain.py (SamsungSAILMontreal/TinyRecursiveModels, sapientinc/HRM) writes into
its run folder, ``checkpoints/<project>/<run>/``:

    all_config.yaml   the whole run config, once (skipped when the run has no W&B run); its
                      ``arch:`` section is the reference's config/arch/<name>.yaml with the
                      run's overrides applied
    step_<N>          the model's state_dict at training step N (no extension)

This module finds those files, maps the ``arch:`` keys onto our TRMConfig/HRMConfig (one table,
`ARCH_KEYS`; keys missing from the saved config take the reference's defaults,
`REFERENCE_DEFAULTS`, not ours), and refuses a state_dict whose contents contradict the config.
Every refusal is a `UserError` of one line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import typing
from typing import Any, Mapping, Sequence

from omegaconf import OmegaConf

from models.recursive_reasoning import HRMConfig, TRMConfig
from models.recursive_reasoning.losses import LOSS_FNS
from models.recursive_reasoning.task import validate as validate_arch
from models.recursive_reasoning.trm import prefix_len
from runtime.errors import UserError, one_line

CONFIG_FILE = "all_config.yaml"
STEP_FILE = re.compile(r"step_(\d+)(\.pt)?")

# The reference's arch.name -> our model.
MODEL_NAMES = {
    "recursive_reasoning.trm@TinyRecursiveReasoningModel_ACTV1": "trm",
    "recursive_reasoning.hrm@HierarchicalReasoningModel_ACTV1": "hrm",
    "hrm.hrm_act_v1@HierarchicalReasoningModel_ACTV1": "hrm",
}
LOSS_HEAD = "losses@ACTLossHead"  # the reference's only loss head (its arch.loss.name)

IGNORED = None  # a reference key its model reads but that changes nothing (TRM: "H_layers  # ignored")
_SHARED = {"hidden_size": "hidden", "num_heads": "heads", **{k: k for k in (
    "expansion", "H_cycles", "L_cycles", "L_layers", "halt_max_steps", "halt_exploration_prob", "puzzle_emb_ndim",
    "pos_encodings", "forward_dtype", "rope_theta")}}
# Reference arch key -> our config field, per model (arch.loss.loss_type -> loss_type besides).
ARCH_KEYS = {
    "trm": {**_SHARED, "H_layers": IGNORED, "mlp_t": "mlp_t", "puzzle_emb_len": "puzzle_emb_len",
            "no_ACT_continue": "no_ACT_continue"},
    "hrm": {**_SHARED, "H_layers": "H_layers"},
}
# Reference keys of which we implement one value (its default); another is refused.
ONLY_VALUE = {"trm": {"rms_norm_eps": 1e-5}, "hrm": {"rms_norm_eps": 1e-5, "mlp_t": False}}

_DEFAULTS_SHARED = {"loss": {"name": LOSS_HEAD, "loss_type": "stablemax_cross_entropy"}, "halt_exploration_prob": 0.1,
                    "halt_max_steps": 16, "hidden_size": 512, "num_heads": 8, "expansion": 4,
                    "puzzle_emb_ndim": "${.hidden_size}", "pos_encodings": "rope", "forward_dtype": "bfloat16",
                    "rope_theta": 10000.0, "rms_norm_eps": 1e-5}
# The reference's config/arch/{trm,hrm}.yaml plus its config classes' defaults: what a key
# missing from a saved config (or, without one, every key) means.
REFERENCE_DEFAULTS = {
    "trm": {**_DEFAULTS_SHARED, "name": "recursive_reasoning.trm@TinyRecursiveReasoningModel_ACTV1", "H_cycles": 3,
            "L_cycles": 6, "H_layers": 0, "L_layers": 2, "mlp_t": False, "puzzle_emb_len": 16, "no_ACT_continue": True},
    "hrm": {**_DEFAULTS_SHARED, "name": "hrm.hrm_act_v1@HierarchicalReasoningModel_ACTV1", "H_cycles": 2,
            "L_cycles": 2, "H_layers": 4, "L_layers": 4},
}
DEFAULT_SOURCE = "the reference's default"


# ---------------------------------------------------------------- the run folder


def find_checkpoint(directory: str, step: int | None = None) -> tuple[str, int]:
    """(path, step) of the run folder's ``step_<step>`` state_dict, the latest by default."""
    if not os.path.isdir(directory):
        raise UserError(f"--checkpoint-dir {directory}: no such directory; pass the reference run's folder "
                        "(checkpoints/<project>/<run>)")
    steps = {int(m[1]): name for name in os.listdir(directory) if (m := STEP_FILE.fullmatch(name))}
    if not steps:
        raise UserError(f"--checkpoint-dir {directory} holds no step_<N> state_dict; pass the folder the reference "
                        "saved its checkpoints in")
    if step is None:
        step = max(steps)
    elif step not in steps:
        raise UserError(f"--step {step}: {directory} has no step_{step}; its steps are {sorted(steps)}")
    return os.path.join(directory, steps[step]), step


def read_run_config(config: str | Mapping[str, Any]):
    """The reference run's saved config (an all_config.yaml path, or its contents) as an OmegaConf node."""
    if isinstance(config, str) and not os.path.isfile(config):
        raise UserError(f"--config {config}: no such file; pass the reference run's {CONFIG_FILE}")
    try:
        node = OmegaConf.load(config) if isinstance(config, str) else OmegaConf.create(dict(config))
    except Exception as e:
        raise UserError(f"cannot read {config if isinstance(config, str) else 'the config'} as YAML: "
                        f"{one_line(e)[:300]}") from e
    if not isinstance(node.get("arch"), Mapping):
        raise UserError(f"{config if isinstance(config, str) else 'the config'} has no arch: section; it is not a "
                        f"reference run's {CONFIG_FILE}")
    return node


def model_of(saved, label: str, model_name: str | None) -> str:
    """Our model ("trm" / "hrm") for the saved config's arch.name, checked against --model."""
    name = saved.arch.get("name")
    ours = MODEL_NAMES.get(name)
    if ours is None:
        raise UserError(f"{label} has arch.name: {name}; the importer takes {sorted(MODEL_NAMES)}")
    if model_name is not None and model_name != ours:
        raise UserError(f"--model {model_name} but {label} has arch.name: {name} (a {ours.upper()}); drop --model")
    return ours


def reference_arch(saved, model_name: str, label: str) -> dict[str, Any]:
    """The saved arch section over the reference's defaults, interpolations resolved."""
    merged = OmegaConf.merge({"arch": REFERENCE_DEFAULTS[model_name]}, saved or {})
    try:
        return OmegaConf.to_container(merged.arch, resolve=True)
    except Exception as e:
        raise UserError(f"{label}: cannot resolve its arch: section ({one_line(e)[:300]})") from e


def dataset_seq_len(saved, config_path: str | None) -> int | None:
    """seq_len from the run's first data path's train/dataset.json, when it is here.

    A relative data path is the reference's working directory's, which is where the config's
    folder minus its (relative) checkpoint_path leads; the current directory is tried first.
    """
    paths = list(saved.get("data_paths") or []) if saved is not None else []
    if not paths:
        return None
    roots = [""]
    ckpt = saved.get("checkpoint_path")
    if config_path and ckpt and not os.path.isabs(ckpt):
        here, tail = os.path.abspath(os.path.dirname(config_path)), os.sep + os.path.normpath(ckpt)
        if here.endswith(tail):
            roots.append(here[: -len(tail)])
    for root in roots:
        path = os.path.join(root, str(paths[0]), "train", "dataset.json")
        if os.path.isfile(path):
            with open(path) as f:
                return int(json.load(f)["seq_len"])
    return None


# ---------------------------------------------------------------- arch: reference keys -> our config


def _parse_text(where: str, text: str, kind: Any) -> Any:
    low = text.lower()
    if kind is bool:
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise UserError(f"{where}={text}: expected true/false")
    if kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            raise UserError(f"{where}={text}: expected a {kind.__name__}") from None
    return text


def _field_kinds(cls) -> dict[str, Any]:
    """{field: bool | int | float | str} (Optional[X] -> X)."""
    kinds = {}
    for name, hint in typing.get_type_hints(cls).items():
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        kinds[name] = args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint
    return kinds


def _coerce(where: str, value: Any, kind: Any) -> Any:
    """A YAML value for a field of `kind`, as the reference's pydantic config would take it."""
    if isinstance(value, str) and kind is not str:
        return _parse_text(where, value, kind)
    ok = {bool: lambda v: isinstance(v, bool), int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str)}.get(kind, lambda v: True)(value)
    if not ok:
        raise UserError(f"{where}: {value!r} is not a {getattr(kind, '__name__', kind)}")
    return float(value) if kind is float else value


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) or value is None else str(value)


def _from_reference(model_name: str, arch: Mapping[str, Any], saved_keys: set, label: str, kinds: dict):
    """Our fields from a (defaults-merged, resolved) reference arch section, and where each came from."""
    table, only = ARCH_KEYS[model_name], ONLY_VALUE[model_name]
    fields: dict[str, Any] = {}
    source: dict[str, str] = {}

    def where(key: str) -> str:
        return f"{label} (arch.{key}: {_text(arch_value(key))})" if key.split(".")[0] in saved_keys else DEFAULT_SOURCE

    def arch_value(key: str) -> Any:
        return arch["loss"].get("loss_type") if key == "loss.loss_type" else arch[key]

    for key, value in arch.items():
        if key in ("name", "loss"):
            continue
        if key in only:
            if value != only[key]:
                raise UserError(f"{where(key)}: only {key}={_text(only[key])} is implemented for {model_name.upper()}")
        elif key not in table:
            raise UserError(f"{label} has arch.{key}, which the reference {model_name.upper()} does not read and "
                            f"the importer does not know; its keys are {sorted(set(table) | set(only))}")
        elif table[key] is not IGNORED:
            fields[table[key]] = _coerce(f"arch.{key}", value, kinds[table[key]])
            source[table[key]] = where(key)
    loss = dict(arch["loss"])
    if loss.pop("name", LOSS_HEAD) != LOSS_HEAD or set(loss) - {"loss_type"}:
        raise UserError(f"{label} arch.loss is {arch['loss']}; the importer takes name {LOSS_HEAD} with a loss_type")
    fields["loss_type"], source["loss_type"] = loss.get("loss_type"), where("loss.loss_type")
    if fields["loss_type"] not in LOSS_FNS:
        raise UserError(f"{source['loss_type']}: loss_type is not one we implement ({sorted(LOSS_FNS)})")
    return fields, source


def _apply_overrides(model_name: str, cls, fields: dict, source: dict, overrides: Sequence[str], kinds: dict) -> None:
    """Our `k=v` overrides (our field names or the reference's) on top; one that contradicts the
    saved config is refused."""
    aliases = {k: v for k, v in ARCH_KEYS[model_name].items() if v is not IGNORED}
    for item in overrides:
        if "=" not in item:
            raise UserError(f"--arch-overrides {item!r}: expected key=value")
        key, text = (s.strip() for s in item.split("=", 1))
        if ARCH_KEYS[model_name].get(key, "") is IGNORED:
            continue
        field = aliases.get(key, key)
        if field not in kinds or field == "name":
            raise UserError(f"--arch-overrides {key}: not a {cls.__name__} field; fields: "
                            f"{', '.join(sorted(set(kinds) - {'name'}))}")
        value = _parse_text(f"--arch-overrides {key}", text, kinds[field])
        if field in source and source[field] != DEFAULT_SOURCE and fields[field] != value:
            raise UserError(f"--arch-overrides {key}={text} contradicts {source[field]}; drop the override "
                            "(the saved config is the run's)")
        fields[field], source[field] = value, "--arch-overrides"


def arch_config(model_name: str, saved=None, overrides: Sequence[str] = (), label: str = CONFIG_FILE):
    """(our TRMConfig/HRMConfig, {field: where its value came from}).

    `saved`: the run's config (`read_run_config`) or None; missing keys take the reference's
    defaults. `overrides`: `k=v` in our field names or the reference's.
    """
    cls = {"trm": TRMConfig, "hrm": HRMConfig}.get(model_name)
    if cls is None:
        raise UserError(f"--model {model_name!r}: use trm or hrm")
    kinds = _field_kinds(cls)
    saved_keys = set(saved.arch) if saved is not None else set()
    arch = reference_arch(saved, model_name, label)
    fields, source = _from_reference(model_name, arch, saved_keys, label, kinds)
    _apply_overrides(model_name, cls, fields, source, overrides, kinds)
    cfg = cls(**fields)
    validate_arch(cfg)
    return cfg, source


def trainer_overrides(model_name: str, cfg) -> list[str]:
    """The pretrain_jax.py overrides that build this arch: every field the reference sets, and
    any other that differs from our default."""
    base = "hrm" if model_name == "hrm" else ("trm_mlp" if cfg.mlp_t else "trm_att")
    default = type(cfg)()
    names = [f.name for f in dataclasses.fields(cfg) if f.name != "name"]
    from_reference = set(ARCH_KEYS[model_name].values()) | {"loss_type"}
    return [f"arch={base}"] + [f"arch.{n}={_text(getattr(cfg, n))}" for n in names
                               if n in from_reference or getattr(cfg, n) != getattr(default, n)]


# ---------------------------------------------------------------- the state_dict against the config


_BLOCK = re.compile(r"(?P<level>[HL])_level\.layers\.(?P<i>\d+)\.(?P<sub>self_attn|mlp_t|mlp)\.")


def _holdings(sd: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, int]]:
    """({sub-layer kind: first key}, {level: layer count}) of a stripped state_dict."""
    first: dict[str, str] = {}
    layers = {"H": 0, "L": 0}
    for key in sorted(sd):
        m = _BLOCK.match(key)
        if m:
            first.setdefault(m["sub"], key)
            layers[m["level"]] = max(layers[m["level"]], int(m["i"]) + 1)
    return first, layers


def check_state_dict(sd: Mapping[str, Any], model_name: str, cfg, source: Mapping[str, str]) -> None:
    """Refuse, in one line naming both, a state_dict that holds another arch than `cfg` says:
    attention vs mlp_t blocks, learned positions or rope tables, the puzzle table, layer counts, width."""
    first, layers = _holdings(sd)

    def refuse(held: str, field: str, implied: Any) -> None:
        said = source.get(field, DEFAULT_SOURCE)
        fix = (f"set --arch-overrides {field}={_text(implied)}" if said in (DEFAULT_SOURCE, "--arch-overrides")
               else "the checkpoint and that config are not from the same run; import it with its own")
        raise UserError(f"the state_dict holds {held}, but {field}={_text(getattr(cfg, field))} by {said}; {fix}")

    width = sd["embed_tokens.embedding_weight"].shape[1] if "embed_tokens.embedding_weight" in sd else cfg.hidden
    if width != cfg.hidden:
        refuse(f"width {width} (embed_tokens.embedding_weight)", "hidden", width)
    mlp_t = getattr(cfg, "mlp_t", False)
    if model_name == "hrm" and "mlp_t" in first:
        raise UserError(f"the state_dict holds mlp_t blocks ({first['mlp_t']}); HRM with mlp_t is not implemented here")
    if layers["H"] and model_name == "trm":
        raise UserError(f"the state_dict holds H_level layers ({layers['H']}), which a TRM does not have; "
                        "it is an HRM checkpoint (--model hrm, or the run's own config)")
    if "self_attn" in first and mlp_t:
        refuse(f"attention weights ({first['self_attn']})", "mlp_t", False)
    if "mlp_t" in first and not mlp_t:
        refuse(f"mlp_t token-mixing weights ({first['mlp_t']})", "mlp_t", True)
    learned = "embed_pos.embedding_weight" in sd
    if learned != (cfg.pos_encodings == "learned"):
        refuse("learned positions (embed_pos.embedding_weight)" if learned else "no learned positions",
               "pos_encodings", "learned" if learned else "none" if mlp_t else "rope")
    rope = next((k for k in sd if k.startswith("rotary_emb.")), None)
    if rope and cfg.pos_encodings != "rope":
        refuse(f"rope tables ({rope})", "pos_encodings", "rope")
    width = sd["puzzle_emb.weights"].shape[1] if "puzzle_emb.weights" in sd else 0
    if width != cfg.puzzle_emb_ndim:
        refuse(f"a puzzle table of width {width} (puzzle_emb.weights)" if width else "no puzzle table",
               "puzzle_emb_ndim", width)
    for level, field in (("L", "L_layers"), ("H", "H_layers")) if model_name == "hrm" else (("L", "L_layers"),):
        if layers[level] != getattr(cfg, field):
            refuse(f"{layers[level]} {level}_level layers", field, layers[level])


def state_dict_sizes(sd: Mapping[str, Any], cfg) -> dict[str, int | None]:
    """vocab_size, num_puzzle_identifiers and (where a shape shows it) seq_len held by a state_dict."""
    sizes: dict[str, int | None] = {"vocab_size": None, "num_puzzle_identifiers": 1, "seq_len": None}
    if "embed_tokens.embedding_weight" in sd:
        sizes["vocab_size"] = sd["embed_tokens.embedding_weight"].shape[0]
    if "puzzle_emb.weights" in sd:
        sizes["num_puzzle_identifiers"] = sd["puzzle_emb.weights"].shape[0]
    total = next((sd[k].shape[0] for k in ("embed_pos.embedding_weight", "rotary_emb.cos_cached") if k in sd), None)
    token_mixing = next((k for k in sorted(sd) if k.endswith("mlp_t.gate_up_proj.weight")), None)
    if total is None and token_mixing:
        total = sd[token_mixing].shape[1]
    if total is not None:
        sizes["seq_len"] = total - prefix_len(getattr(cfg, "puzzle_emb_len", 0), cfg.puzzle_emb_ndim, cfg.hidden)
    return sizes
