"""The arch of `arch.checkpoint`, read when the config is validated (before anything compiles).

The checkpoint is the single source of the fields it determines: a Hugging Face checkpoint's
config.json gives every field of `hf_config.HF_FIELDS` (see hf_config.arch_from_hf); a Kaggle
Flax/Orbax checkpoint records only its tensor shapes, which give version, depth, widths, heads
and vocabulary (the sliding window, soft-caps and RoPE come from the arch preset).

`resolve_arch(arch)` merges them into the run's arch, in place (the config is not frozen yet):
- a field left at GemmaConfig's default takes the checkpoint's value;
- a field set to another value (by a preset or on the command line) must mean the same model
  (query_pre_attn_scalar None == head_dim; a window or RoPE base of layers the model lacks is
  ignored), else one error line lists each such field with both values: drop the override;
- arch.vocab_size may exceed the checkpoint's rows (padding, e.g. to the Flax table's 256128):
  the extra rows are zero and `real_vocab_size` (the checkpoint's rows) masks them to -inf.
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
import re
import struct
from typing import Any

from models.gemma.config import GemmaConfig
from models.gemma.hf_config import HF_FIELDS, WeightsError, arch_from_hf, max_positions
from models.gemma.weights import _KaggleSource, check_hf_tensors, locate

_DEFAULTS = GemmaConfig()


def read_checkpoint_arch(path: str, fmt: str = "auto") -> tuple[str, dict[str, Any]]:
    """(kind, the GemmaConfig fields the checkpoint determines)."""
    kind, fs, files = locate(path, fmt)
    if kind == "kaggle":
        return kind, _kaggle_fields(path, files[0])
    folder = posixpath.dirname(files[0])  # config.json lies beside the safetensors
    where = posixpath.join(posixpath.dirname(path) if path.endswith(".safetensors") else path.rstrip("/"),
                           "config.json")
    try:
        with fs.open(posixpath.join(folder, "config.json")) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise WeightsError(f"{where}: not found; a Hugging Face checkpoint ships its config.json beside the "
                           "safetensors: copy it there") from None
    except (OSError, ValueError) as e:
        raise WeightsError(f"{where}: cannot read ({type(e).__name__}: {e}); check the file and its access") from e
    if not isinstance(config, dict):
        raise WeightsError(f"{where}: not a JSON object; a Hugging Face config.json holds the model's settings")
    fields = arch_from_hf(config, where)
    try:
        check_hf_tensors(fs, files, fields["vocab_size"], where)
    except (OSError, ValueError, struct.error) as e:
        if isinstance(e, WeightsError):
            raise
        raise WeightsError(f"{where}: cannot read the safetensors headers beside it ({type(e).__name__}: {e}); "
                           "check that the checkpoint is complete") from e
    return kind, fields


def _kaggle_fields(path: str, folder: str) -> dict[str, Any]:
    """Shape fields from the Orbax metadata of a Kaggle checkpoint (no tensor is read)."""
    try:
        src = _KaggleSource(folder)
    except Exception as e:
        raise WeightsError(f"{path}: cannot read the Kaggle checkpoint's metadata ({type(e).__name__}: {e}); "
                           "check that it is complete") from e
    names = set(src.names())
    layers = {int(m.group(1)) for n in names if (m := re.fullmatch(r"transformer/layer_(\d+)/.+", n))}
    emb = "transformer/embedder/input_embedding"
    if emb not in names or not layers:
        raise WeightsError(f"{path}: no {emb} or layer tensors; point arch.checkpoint at a Gemma checkpoint")
    t = "transformer/layer_0/"
    vocab, embed = src.shape(emb)
    if t + "attn/qkv_einsum/w" in names:  # K == H: one [3, H, D, hd] tensor
        _, heads, _, head_dim = src.shape(t + "attn/qkv_einsum/w")
        kv_heads = heads
    else:
        heads, _, head_dim = src.shape(t + "attn/q_einsum/w")
        kv_heads = src.shape(t + "attn/kv_einsum/w")[1]
    version = 3 if t + "attn/_query_norm/scale" in names else 2 if t + "post_attention_norm/scale" in names else 1
    return dict(version=version, num_layers=max(layers) + 1, embed_dim=embed, hidden_dim=src.shape(t + "mlp/linear/w")[0],
                num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=vocab)


def _effective(cfg: GemmaConfig, name: str) -> Any:
    """What a field means for the model: values of layers it does not have do not count."""
    kinds = [cfg.is_global_layer(i) for i in range(cfg.num_layers)]
    if name == "global_every":
        return tuple(kinds)
    if name in ("sliding_window", "rope_base_local"):
        return getattr(cfg, name) if not all(kinds) else None
    if name in ("rope_base_global", "rope_scale_global"):
        return getattr(cfg, name) if any(kinds) else None
    if name == "query_pre_attn_scalar":
        return cfg.query_pre_attn_scalar or cfg.head_dim
    if name == "max_position_embeddings":
        return max_positions(cfg)
    return getattr(cfg, name)


def model_differences(a: GemmaConfig, b: GemmaConfig, fields=HF_FIELDS) -> list[str]:
    """The checkpoint-determined fields on which a and b mean different models."""
    return [k for k in fields if _effective(a, k) != _effective(b, k)]


def _is_set(arch: GemmaConfig, name: str) -> bool:
    return getattr(arch, name) != getattr(_DEFAULTS, name)


def merged_arch(arch: GemmaConfig, found: dict[str, Any], path: str, kind: str) -> dict[str, Any]:
    """The field values the run uses: `found` (the checkpoint's) checked against what `arch` sets."""
    rows = found["vocab_size"]
    out = dict(found)
    if _is_set(arch, "vocab_size") and arch.vocab_size > rows:  # padding: keep the table, mask the extra rows
        out["vocab_size"] = arch.vocab_size
        out["real_vocab_size"] = min(arch.real_vocab_size or rows, rows)
    # What the user meant: their set fields, the checkpoint's for the rest (an override of the
    # pattern is read with the checkpoint's depth).
    given = dataclasses.replace(arch, **{k: v for k, v in out.items() if not _is_set(arch, k)})
    derived = dataclasses.replace(arch, **out)
    wrong = [f"arch.{k}={getattr(arch, k)!r} (checkpoint: {getattr(derived, k)!r})"
             for k in model_differences(given, derived, [k for k in found if _is_set(arch, k)])]
    if arch.real_vocab_size and arch.real_vocab_size > out.get("real_vocab_size", arch.real_vocab_size):
        wrong.append(f"arch.real_vocab_size={arch.real_vocab_size} (checkpoint: {rows} rows)")
    if wrong:
        source = "config.json" if kind == "hf" else "tensor shapes"
        raise WeightsError(f"arch.checkpoint={path} disagrees with " + ", ".join(wrong) + f" (its {source}); drop "
                           "these overrides to take the checkpoint's values (arch=gemma takes every size from it)")
    return out


def resolve_arch(arch: GemmaConfig) -> None:
    """Set arch's checkpoint-determined fields from arch.checkpoint, in place (module docstring)."""
    kind, found = read_checkpoint_arch(arch.checkpoint, arch.checkpoint_format)
    for name, value in merged_arch(arch, found, arch.checkpoint, kind).items():
        setattr(arch, name, value)
    if kind == "kaggle" and arch.version >= 2 and arch.sliding_window is None:
        raise WeightsError(f"arch.checkpoint={arch.checkpoint}: a Kaggle checkpoint records no sliding window, soft-caps "
                           f"or RoPE settings, and Gemma {arch.version} has them; pick the model's preset (e.g. "
                           "arch=gemma2_2b, arch=gemma3_1b) or load its Hugging Face checkpoint")
