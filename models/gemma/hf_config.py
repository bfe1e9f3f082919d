"""Hugging Face config.json <-> GemmaConfig, in both directions and without transformers.

`arch_from_hf(config)` derives the checkpoint-determined arch fields from a config.json (as
saved by transformers 4.x or 5.x: legacy `rope_theta` / `rope_scaling` / `rope_local_base_freq`
/ `sliding_window_pattern` or 5.x `rope_parameters` / `layer_types`; keys a file leaves out take
transformers' defaults for its model_type, as hub multimodal `text_config`s rely on). A setting
this implementation cannot express (rms_norm_eps, an untied output, attention bias, other
activations, bidirectional attention, RoPE other than default/linear on global layers, a
layer_types list that is not "every p-th layer global") is a one-line `WeightsError`.

`hf_config(cfg)` writes the config.json transformers 5.x loads (its strict config checks types:
`query_pre_attn_scalar` and `sliding_window` are ints, soft-caps floats), and refuses an arch
HF's Gemma classes cannot express. tests/test_gemma_hf.py checks both against transformers.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from models.gemma.config import NORM_EPS, GemmaConfig
from runtime.errors import UserError

ACTIVATION = "gelu_pytorch_tanh"
MODEL_TYPES = {"gemma": 1, "gemma2": 2, "gemma3_text": 3}
ARCHITECTURES = {1: "GemmaForCausalLM", 2: "Gemma2ForCausalLM", 3: "Gemma3ForCausalLM"}
ARCH_MODEL_TYPE = {v: k for k, v in MODEL_TYPES.items()}
FULL, SLIDING = "full_attention", "sliding_attention"

# transformers' defaults (5.x config classes) for the keys read here, by model_type; a test
# compares them with transformers' own.
_COMMON = dict(rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False, head_dim=256,
               max_position_embeddings=8192)
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma": dict(_COMMON, vocab_size=256000, hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=16, hidden_act=ACTIVATION, rope_theta=10_000.0),
    "gemma2": dict(_COMMON, vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                   num_attention_heads=8, num_key_value_heads=4, hidden_activation=ACTIVATION, rope_theta=10_000.0,
                   query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=30.0,
                   attn_logit_softcapping=50.0),
    "gemma3_text": dict(_COMMON, vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, hidden_activation=ACTIVATION,
                        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, query_pre_attn_scalar=256,
                        max_position_embeddings=131_072,
                        sliding_window=4096, final_logit_softcapping=None, attn_logit_softcapping=None,
                        sliding_window_pattern=6),
}
# Fields of GemmaConfig a config.json determines (all others are the run's choice).
HF_FIELDS = ("version", "num_layers", "embed_dim", "hidden_dim", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
             "global_every", "sliding_window", "rope_base_local", "rope_base_global", "rope_scale_global",
             "query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap", "max_position_embeddings")
# transformers' Gemma special token ids, for an export whose tokenizer cannot be read (a warning says so).
GEMMA_TOKEN_IDS = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}

log = logging.getLogger(__name__)


_UNSET = object()


class WeightsError(UserError, ValueError):
    """A checkpoint that cannot be read as this config; one line naming the path and the fix."""


# ----------------------------------------------------------------------------- config.json -> arch
def arch_from_hf(config: dict, where: str) -> dict[str, Any]:
    """GemmaConfig values (HF_FIELDS) of an HF config.json; `where` names the file in errors."""
    c = config
    if c.get("model_type") == "gemma3" and isinstance(c.get("text_config"), dict):  # multimodal: its text half
        c = {"model_type": "gemma3_text", **c["text_config"]}
    model_type = c.get("model_type")
    if model_type not in MODEL_TYPES:
        raise WeightsError(f"{where}: model_type={model_type!r} is not a Gemma 1/2/3 text model (gemma, gemma2, "
                           "gemma3_text, or gemma3 with a text_config); point arch.checkpoint at a Gemma checkpoint")
    defaults = HF_DEFAULTS[model_type]
    get = _Strict(c, defaults, where)
    version = MODEL_TYPES[model_type]
    _refuse_unsupported(c, get, version, where)
    out: dict[str, Any] = dict(
        version=version, num_layers=get.int("num_hidden_layers"), embed_dim=get.int("hidden_size"),
        hidden_dim=get.int("intermediate_size"), num_heads=get.int("num_attention_heads"),
        num_kv_heads=get.int("num_key_value_heads"), head_dim=get.int("head_dim"), vocab_size=get.int("vocab_size"),
        max_position_embeddings=get.int("max_position_embeddings"))
    kinds = _layer_types(c, get, version, out["num_layers"], where)
    out.update(_pattern(kinds, get.int("sliding_window_pattern", null=True), get.int("sliding_window", null=True), where))
    out.update(_rope(c, get, version, kinds, where))
    if version >= 2:
        out.update(query_pre_attn_scalar=float(get.int("query_pre_attn_scalar")),
                   attn_logit_softcap=get.float("attn_logit_softcapping", null=True),
                   final_logit_softcap=get.float("final_logit_softcapping", null=True))
    else:  # HF Gemma 1 scales queries by head_dim ** -0.5 and has no soft-caps
        out.update(query_pre_attn_scalar=None, attn_logit_softcap=None, final_logit_softcap=None)
    if version == 3 and out["attn_logit_softcap"] is not None:
        log.warning("%s: attn_logit_softcapping=%g is ignored: Gemma 3 has no attention soft-cap (QK-norm takes its "
                    "place), in the reference implementation as in transformers", where, out["attn_logit_softcap"])
        out["attn_logit_softcap"] = None
    return out


class _Strict:
    """A config.json's values (transformers' defaults for keys it leaves out), read as strictly as
    transformers' own config classes: an integer field must be a JSON integer (4.7, 4.0 and "8"
    are refused, as transformers refuses them), a float field a JSON number; either fails in one
    line naming the key, never a traceback or a silently truncated value."""

    def __init__(self, config: dict, defaults: dict, where: str):
        self.config, self.defaults, self.where = config, defaults, where

    def __call__(self, key: str) -> Any:
        return self.config.get(key, self.defaults.get(key))

    def int(self, key: str, *, null: bool = False, value: Any = _UNSET) -> Optional[int]:
        value = self(key) if value is _UNSET else value
        if value is None and null:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise WeightsError(f"{self.where}: {key}={value!r} is not an integer{' or null' if null else ''} (transformers "
                               f"refuses it too); write {key} as a whole number in the config.json")
        return value

    def float(self, key: str, *, null: bool = False, value: Any = _UNSET) -> Optional[float]:
        value = self(key) if value is _UNSET else value
        if value is None and null:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise WeightsError(f"{self.where}: {key}={value!r} is not a number{' or null' if null else ''}; write {key} "
                               "as a JSON number in the config.json")
        return float(value)


def _refuse(where: str, what: str) -> WeightsError:
    return WeightsError(f"{where}: {what}, which this Gemma implementation cannot express; use a checkpoint "
                        "without it (or convert it with transformers first)")


def _refuse_unsupported(c: dict, get: _Strict, version: int, where: str) -> None:
    if get.float("rms_norm_eps") != NORM_EPS:
        raise _refuse(where, f"rms_norm_eps={get('rms_norm_eps')} (every Gemma uses {NORM_EPS})")
    if get("tie_word_embeddings") is False:
        raise _refuse(where, "tie_word_embeddings=false (an untied output layer)")
    if get("attention_bias"):
        raise _refuse(where, "attention_bias=true (biases on the attention projections)")
    if c.get("use_bidirectional_attention"):
        raise _refuse(where, "use_bidirectional_attention=true (an embedding model)")
    key = "hidden_act" if version == 1 else "hidden_activation"
    act = get(key) or ACTIVATION
    if not (act == ACTIVATION or (version == 1 and act == "gelu")):  # transformers reads Gemma 1's "gelu" as tanh
        raise _refuse(where, f"{key}={act!r} (Gemma uses {ACTIVATION})")


def _layer_types(c: dict, get: _Strict, version: int, layers: int, where: str) -> list[str]:
    kinds = c.get("layer_types")
    if kinds is None:  # transformers' defaults: Gemma 2 alternates from a local layer 0; Gemma 3 every 6th global
        every = {1: 1, 2: 2, 3: get.int("sliding_window_pattern", null=True) or 6}[version]
        kinds = [FULL if (i + 1) % every == 0 else SLIDING for i in range(layers)]
    elif not isinstance(kinds, list):
        raise WeightsError(f"{where}: layer_types={kinds!r} is not a list; expected {layers} of {FULL!r} / {SLIDING!r}")
    if version == 1 and any(k != FULL for k in kinds):
        raise _refuse(where, "sliding-window layers in a Gemma 1 config")
    unknown = sorted(set(kinds) - {FULL, SLIDING})
    if len(kinds) != layers or unknown:
        raise WeightsError(f"{where}: layer_types has {len(kinds)} entries {unknown or ''} for num_hidden_layers={layers}; "
                           f"expected {layers} of {FULL!r} / {SLIDING!r}")
    return list(kinds)


def _pattern(kinds: list[str], hint: Optional[int], window: Optional[int], where: str) -> dict[str, Any]:
    """layer_types -> (global_every, sliding_window): layer i is global when (i + 1) % p == 0."""
    is_full = [k == FULL for k in kinds]
    if all(is_full):
        return {"global_every": 1, "sliding_window": None}
    if not window or window < 1:
        raise WeightsError(f"{where}: sliding-window layers but sliding_window={window!r}; the config is incomplete")
    hints = [hint] if hint else []
    for p in hints + list(range(2, len(kinds) + 2)):
        if is_full == [(i + 1) % p == 0 for i in range(len(kinds))]:
            return {"global_every": p, "sliding_window": window}
    raise _refuse(where, f"layer_types={kinds} (not every p-th layer global)")


def _rope_kind(params: dict, get: _Strict, where: str, layers: str) -> tuple[float, float]:
    """(theta, linear factor) of one RoPE parameter dict."""
    kind = params.get("rope_type", params.get("type", "default"))
    if get.float("partial_rotary_factor", value=params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise _refuse(where, f"partial_rotary_factor={params['partial_rotary_factor']} on {layers} layers")
    if kind not in ("default", "linear"):
        raise _refuse(where, f"rope_type={kind!r} on {layers} layers (only default and linear RoPE)")
    theta = get.float("rope_theta", value=params["rope_theta"])
    return theta, get.float("factor", value=params.get("factor", 1.0)) if kind == "linear" else 1.0


def _rope(c: dict, get: _Strict, version: int, kinds: list[str], where: str) -> dict[str, float]:
    """RoPE bases and the global layers' linear scaling, from 5.x rope_parameters or the legacy keys."""
    params = c.get("rope_parameters") or {}
    for name, value in (("rope_parameters", params), ("rope_scaling", c.get("rope_scaling") or {})):
        if not isinstance(value, dict):
            raise WeightsError(f"{where}: {name}={value!r} is not a JSON object; fix the config.json")
    if version == 3:
        nested = isinstance(params, dict) and (FULL in params or SLIDING in params)
        full = dict(params.get(FULL) or {}) if nested else dict(params)
        local = dict(params.get(SLIDING) or {}) if nested else {}
        full.update(c.get("rope_scaling") or {})
        full.setdefault("rope_theta", c.get("rope_theta", HF_DEFAULTS["gemma3_text"]["rope_theta"]))
        local.setdefault("rope_theta", c.get("rope_local_base_freq", HF_DEFAULTS["gemma3_text"]["rope_local_base_freq"]))
    else:  # one RoPE for every layer (legacy rope_scaling takes precedence, as in transformers)
        full = dict(c.get("rope_scaling") or params)
        full.setdefault("rope_theta", c.get("rope_theta", HF_DEFAULTS["gemma"]["rope_theta"]))
        if "partial_rotary_factor" in c:
            full.setdefault("partial_rotary_factor", c["partial_rotary_factor"])
        local = full
    base_global, scale = _rope_kind(full, get, where, "global")
    base_local, local_scale = _rope_kind(local, get, where, "sliding-window")
    if local_scale != 1.0 and SLIDING in kinds:
        raise _refuse(where, "linear RoPE scaling on sliding-window layers")
    return {"rope_base_global": base_global, "rope_scale_global": scale, "rope_base_local": base_local}


# ----------------------------------------------------------------------------- arch -> config.json
def _as_int(value: float, name: str) -> int:
    if float(value) != int(value):
        raise WeightsError(f"arch.{name}={value} is not a whole number; transformers needs an integer {name}")
    return int(value)


def _check_expressible(cfg: GemmaConfig) -> None:
    """Refuse an arch transformers' Gemma classes would load as a different model."""
    local = [i for i in range(cfg.num_layers) if not cfg.is_global_layer(i)]
    fail = lambda what: WeightsError(f"cannot export to Hugging Face: {what}; export a config HF's Gemma "  # noqa: E731
                                     f"{cfg.version} can express")
    if cfg.version == 1:
        if local:
            raise fail("Gemma 1 in transformers has no sliding-window layers (arch.sliding_window is set)")
        if cfg.attn_logit_softcap is not None or cfg.final_logit_softcap is not None:
            raise fail("Gemma 1 in transformers has no soft-caps")
        if (cfg.query_pre_attn_scalar or cfg.head_dim) != cfg.head_dim:
            raise fail("Gemma 1 in transformers scales queries by head_dim ** -0.5 (arch.query_pre_attn_scalar differs)")
    if cfg.version == 2 and local and (cfg.rope_base_local != cfg.rope_base_global or cfg.rope_scale_global != 1):
        raise fail("Gemma 2 in transformers uses one RoPE for every layer (arch.rope_base_local / rope_scale_global differ)")
    if cfg.version >= 2 and cfg.embed_dim % cfg.num_heads:
        raise fail(f"transformers requires hidden_size ({cfg.embed_dim}) to be a multiple of num_attention_heads "
                   f"({cfg.num_heads})")


def max_positions(cfg: GemmaConfig) -> int:
    """cfg.max_position_embeddings, or transformers' default for its version when unset."""
    return cfg.max_position_embeddings or HF_DEFAULTS[ARCH_MODEL_TYPE[cfg.version]]["max_position_embeddings"]


def hf_config(cfg: GemmaConfig, vocab: Optional[int] = None, dtype: str = "bfloat16",
              token_ids: Optional[dict[str, int]] = None) -> dict:
    """The Hugging Face config.json for cfg (`vocab` rows; default the unpadded vocabulary;
    `token_ids`: pad/eos/bos_token_id, default GEMMA_TOKEN_IDS)."""
    _check_expressible(cfg)
    kinds = [FULL if cfg.is_global_layer(i) else SLIDING for i in range(cfg.num_layers)]
    rope_global = {"rope_type": "default", "rope_theta": float(cfg.rope_base_global)}
    if cfg.rope_scale_global != 1:
        rope_global = {"rope_type": "linear", "factor": float(cfg.rope_scale_global), "rope_theta": float(cfg.rope_base_global)}
    c: dict[str, Any] = dict(
        architectures=[ARCHITECTURES[cfg.version]], model_type=ARCH_MODEL_TYPE[cfg.version],
        vocab_size=int(vocab or cfg.vocab_in_use), hidden_size=cfg.embed_dim,
        intermediate_size=cfg.hidden_dim, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=NORM_EPS, tie_word_embeddings=True,
        attention_bias=False, attention_dropout=0.0, dtype=dtype,
        max_position_embeddings=max_positions(cfg),
        **{k: (token_ids or GEMMA_TOKEN_IDS)[k] for k in GEMMA_TOKEN_IDS})
    if cfg.version == 1:
        return c | dict(hidden_act=ACTIVATION, rope_parameters=rope_global)
    soft = lambda x: None if x is None else float(x)  # noqa: E731
    c |= dict(hidden_activation=ACTIVATION, layer_types=kinds, use_bidirectional_attention=False,
              query_pre_attn_scalar=_as_int(cfg.query_pre_attn_scalar or cfg.head_dim, "query_pre_attn_scalar"),
              sliding_window=None if cfg.sliding_window is None else int(cfg.sliding_window),
              attn_logit_softcapping=soft(cfg.attn_logit_softcap), final_logit_softcapping=soft(cfg.final_logit_softcap))
    if cfg.version == 2:
        return c | dict(rope_parameters=rope_global)
    return c | dict(rope_parameters={FULL: rope_global,
                                     SLIDING: {"rope_type": "default", "rope_theta": float(cfg.rope_base_local)}})


def generation_config(token_ids: dict[str, Any]) -> dict:
    """The generation_config.json transformers reads beside config.json: the special token ids,
    generation stopping at every id of `stop_token_ids` when given (Gemma's <eos> and
    <end_of_turn>), else at eos_token_id."""
    stops = token_ids.get("stop_token_ids") or [token_ids["eos_token_id"]]
    return {"bos_token_id": token_ids["bos_token_id"], "eos_token_id": stops[0] if len(stops) == 1 else stops,
            "pad_token_id": token_ids["pad_token_id"]}
