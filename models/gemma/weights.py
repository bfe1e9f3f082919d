"""Gemma weights in and out: Hugging Face safetensors and Kaggle Flax/Orbax checkpoints.

`load_params` builds every parameter straight into its sharded `jax.Array` with
`jax.make_array_from_callback`; each callback reads only the slice its device asks for (for the
stacked [L, ...] params: only the requested layers, each sliced). What holds host memory:
- Hugging Face: the safetensors files are memory-mapped; a callback holds its output shard plus
  one layer's slice of one source tensor. gs:// files are first copied to a local cache
  ($GEMMA_WEIGHTS_CACHE, default ~/.cache/podrunner/gemma_weights/<hash of the URL>; a file of
  the right size is not fetched again), so each host needs disk for the checkpoint.
- Kaggle: read with TensorStore slice reads through Orbax's own read spec (local or gs://,
  no copy); same per-callback footprint.
Vocabulary rows: the checkpoint's embedding table may have fewer rows than `cfg.vocab_size`
(HF Gemma 1/2: 256000 in the presets' 256128-row table): missing rows are zero, logged as
padding, and masked to -inf by `cfg.real_vocab_size` (models/gemma/checkpoint_arch.py sets it
from the checkpoint). Extra rows are dropped (logged). The arch itself comes from the
checkpoint's config.json before anything is built (checkpoint_arch.py); here it is checked
against the tensors' shapes. HF RMSNorm weights use the same (1 + w) convention and RoPE needs
no permutation.

`export_hf` writes HF safetensors (+ index when sharded) and config.json (hf_config.py: what
transformers 5.x loads; an arch it cannot express is refused before anything is written), streaming one tensor
at a time from device to file (process 0 writes; every process joins the gathers). Params
with LoRA leaves must be merged first: pass `merge=models.gemma.lora.merge_lora`.
`write_kaggle` writes the Kaggle layout with Orbax (bf16).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import posixpath
import re
import struct
import time
from typing import Any, Callable, Optional

import fsspec
import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy; safetensors needs it)
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath
from flax.traverse_util import unflatten_dict
from jax.experimental import multihost_utils
from safetensors import safe_open

from models.gemma.config import CHECKPOINT_FORMATS, GemmaConfig
from models.gemma.hf_config import GEMMA_TOKEN_IDS, WeightsError, arch_from_hf, generation_config, hf_config
from models.layers import dtype_from_name
from runtime.atomic import replacing

log = logging.getLogger(__name__)

FORMATS = CHECKPOINT_FORMATS
_KAGGLE_MARKERS = {"_METADATA", "checkpoint", "manifest.ocdbt", "_CHECKPOINT_METADATA"}
_HF_INDEX = "model.safetensors.index.json"
_ST_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
_FIELDS = {"V": "vocab_size", "D": "embed_dim", "F": "hidden_dim", "H": "num_heads", "K": "num_kv_heads",
           "h": "head_dim", "L": "num_layers"}


# ----------------------------------------------------------------------------- the tree spec
# Per-layer params (stacked on a leading L axis in the tree) -> symbolic shape; see config.py.
_LAYER = {
    "attn/q_einsum/w": "HDh",
    "attn/kv_einsum/w": "2KDh",
    "attn/attn_vec_einsum/w": "HhD",
    "attn/query_norm/scale": "h",
    "attn/key_norm/scale": "h",
    "mlp/gating_einsum/w": "2DF",
    "mlp/linear/w": "FD",
    "pre_attention_norm/scale": "D",
    "post_attention_norm/scale": "D",
    "pre_ffw_norm/scale": "D",
    "post_ffw_norm/scale": "D",
}


def _layer_names(cfg: GemmaConfig) -> list[str]:
    skip = set()
    if not cfg.post_norms:
        skip |= {"post_attention_norm/scale", "post_ffw_norm/scale"}
    if not cfg.qk_norm:
        skip |= {"attn/query_norm/scale", "attn/key_norm/scale"}
    return [n for n in _LAYER if n not in skip]


def _dim(sym: str, cfg: GemmaConfig) -> int:
    return int(np.prod([int(s) if s.isdigit() else getattr(cfg, _FIELDS[s]) for s in sym.split("*")]))


def _shape(syms, cfg: GemmaConfig) -> tuple[int, ...]:
    return tuple(_dim(s, cfg) for s in syms)


def param_shapes(cfg: GemmaConfig) -> dict[str, tuple[int, ...]]:
    """'/'-joined path -> shape of every base (non-LoRA) param, in a fixed order."""
    out = {"embedder/input_embedding": _shape("VD", cfg)}
    out.update({f"layers/{n}": (cfg.num_layers, *_shape(_LAYER[n], cfg)) for n in _layer_names(cfg)})
    out["final_norm/scale"] = (cfg.embed_dim,)
    return out


def _get(tree: Any, path: str) -> Any:
    for k in path.split("/"):
        if tree is None:
            return None
        tree = tree[k]
    return tree


# ----------------------------------------------------------------------------- sources
class _HFSource:
    """Memory-mapped safetensors files; reads return numpy slices."""

    def __init__(self, files: list[str], stack: contextlib.ExitStack):
        self._file: dict[str, Any] = {}
        for f in files:
            h = stack.enter_context(safe_open(f, framework="np"))
            self._file.update(dict.fromkeys(h.keys(), h))

    def names(self):
        return self._file.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file[name].get_slice(name).get_shape())

    def read(self, name: str, idx: tuple) -> np.ndarray:
        return np.asarray(self._file[name].get_slice(name)[idx])


METADATA_READS = 3  # a storage blip (a timeout, a listing not yet current) is read again, not fatal


def _read_orbax_metadata(path: str) -> Any:
    """The checkpoint's tree metadata, or None where it has no `_METADATA` (the layout check then
    names what is missing). Read through the handler, not `PyTreeCheckpointer.metadata`, which logs
    a failed read and returns nothing: here the storage error is kept for the one line."""
    meta_file = epath.Path(path, "_METADATA")
    error: Optional[Exception] = None
    for attempt in range(METADATA_READS):
        try:
            return ocp.PyTreeCheckpointHandler().metadata(epath.Path(path))
        except (OSError, ValueError) as e:  # FileNotFoundError from a failed exists(), bad JSON
            error = e
        if attempt == 0 and not meta_file.exists():
            return None
        _forget_listings(path)
        time.sleep(0.5 * (attempt + 1))
    detail = " ".join(f"{type(error).__name__}: {error}".split())[:300]
    raise WeightsError(f"{path}: the Orbax metadata of this checkpoint could not be read in "
                       f"{METADATA_READS} tries ({detail}); check its access and try again")


def _forget_listings(path: str) -> None:
    """Drop fsspec's cached listings of `path` so a retry asks the store again."""
    with contextlib.suppress(Exception):
        fs, root = fsspec.core.url_to_fs(path)
        fs.invalidate_cache(root)


class _KaggleSource:
    """An Orbax PyTree checkpoint read leaf-slice by leaf-slice with TensorStore."""

    def __init__(self, path: str):
        meta = _read_orbax_metadata(path)
        use_zarr3 = bool(getattr(meta, "use_zarr3", False))
        flat: dict[str, Any] = {}

        def walk(node, prefix):
            if isinstance(node, dict):
                for k, v in node.items():
                    walk(v, f"{prefix}/{k}" if prefix else str(k))
            elif hasattr(node, "shape") and hasattr(node, "name"):
                flat[prefix] = node

        walk(getattr(meta, "tree", meta), "")
        self._meta = flat
        self._dir = epath.Path(path)
        self._ocdbt = ocp.type_handlers.is_ocdbt_checkpoint(self._dir)
        self._ctx = ocp.type_handlers.get_ts_context(use_ocdbt=self._ocdbt)
        self._zarr3 = use_zarr3
        self._open: dict[str, Any] = {}

    def names(self):
        return self._meta.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._meta[name].shape)

    def read(self, name: str, idx: tuple) -> np.ndarray:
        if name not in self._open:
            info = ocp.type_handlers.ParamInfo(name=self._meta[name].name, parent_dir=self._dir,
                                               use_zarr3=self._zarr3, ts_context=self._ctx)
            spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=self._ocdbt)
            self._open[name] = ts.open(spec, read=True, context=self._ctx).result()
        return np.asarray(self._open[name][idx].read().result())


# ----------------------------------------------------------------------------- plans
# A plan is (our param -> per-layer reader (layer, slices) -> ndarray, or the source tensor name
# for the embedding and final norm; source tensor -> symbolic shape, checked before reading;
# a regex matching the source's layer tensors). Slices are normalised (ints, step 1).
def _rows(s: slice, n: int) -> slice:
    return slice(s.start * n, s.stop * n)


def _hf_prefix(names) -> str:
    for p in ("model.", "language_model.model.", "model.language_model."):
        if f"{p}embed_tokens.weight" in names:
            return p
    return ""


_HF_LAYER = {  # our per-layer param -> (HF tensors, HF shape [out, in])
    "attn/q_einsum/w": (("self_attn.q_proj",), ("H*h", "D")),
    "attn/kv_einsum/w": (("self_attn.k_proj", "self_attn.v_proj"), ("K*h", "D")),
    "attn/attn_vec_einsum/w": (("self_attn.o_proj",), ("D", "H*h")),
    "attn/query_norm/scale": (("self_attn.q_norm",), ("h",)),
    "attn/key_norm/scale": (("self_attn.k_norm",), ("h",)),
    "mlp/gating_einsum/w": (("mlp.gate_proj", "mlp.up_proj"), ("F", "D")),
    "mlp/linear/w": (("mlp.down_proj",), ("D", "F")),
    "pre_attention_norm/scale": (("input_layernorm",), ("D",)),
    "post_attention_norm/scale": (("post_attention_layernorm",), ("D",)),
    "pre_ffw_norm/scale": (("pre_feedforward_layernorm",), ("D",)),
    "post_ffw_norm/scale": (("post_feedforward_layernorm",), ("D",)),
}


def _hf_layer_table(cfg: GemmaConfig) -> dict[str, tuple]:
    table = {n: _HF_LAYER[n] for n in _layer_names(cfg)}
    if cfg.version == 1:  # the trap: HF Gemma 1 calls its pre-FFW norm post_attention_layernorm
        table["pre_ffw_norm/scale"] = (("post_attention_layernorm",), ("D",))
    return table


def _hf_plan(src: _HFSource, cfg: GemmaConfig) -> tuple[dict, dict, str]:
    p = _hf_prefix(src.names())
    hd = cfg.head_dim
    t = lambda i, n: f"{p}layers.{i}.{n}.weight"  # noqa: E731
    table = _hf_layer_table(cfg)

    def proj_in(name):  # [n*hd, D] -> [n, D, hd]
        def f(i, s):
            x = src.read(t(i, name), (_rows(s[0], hd), s[1]))
            return x.reshape(-1, hd, x.shape[1])[:, s[2], :].transpose(0, 2, 1)
        return f

    def kv(i, s):
        return np.stack([proj_in(n)(i, s[1:]) for n in table["attn/kv_einsum/w"][0][s[0]]])

    def attn_vec(i, s):  # [D, H*hd] -> [H, hd, D]
        x = src.read(t(i, "self_attn.o_proj"), (s[2], _rows(s[0], hd)))
        return x.reshape(x.shape[0], -1, hd)[:, :, s[1]].transpose(1, 2, 0)

    def gating(i, s):  # 2 x [F, D] -> [2, D, F]
        return np.stack([src.read(t(i, n), (s[2], s[1])).T for n in table["mlp/gating_einsum/w"][0][s[0]]])

    readers = {
        "attn/q_einsum/w": proj_in("self_attn.q_proj"),
        "attn/kv_einsum/w": kv,
        "attn/attn_vec_einsum/w": attn_vec,
        "mlp/gating_einsum/w": gating,
        "mlp/linear/w": lambda i, s: src.read(t(i, "mlp.down_proj"), (s[1], s[0])).T,
    }
    expect = {f"{p}embed_tokens.weight": ("V", "D"), f"{p}norm.weight": ("D",)}
    plan = {}
    for n, (hf_names, syms) in table.items():
        expect.update({t(i, h): syms for i in range(cfg.num_layers) for h in hf_names})
        plan[n] = readers.get(n) or (lambda i, s, h=hf_names[0]: src.read(t(i, h), s))
    plan["embedder/input_embedding"] = f"{p}embed_tokens.weight"
    plan["final_norm/scale"] = f"{p}norm.weight"
    return plan, expect, rf"{re.escape(p)}layers\.(\d+)\.(.+)"


def _kaggle_plan(src: _KaggleSource, cfg: GemmaConfig) -> tuple[dict, dict, str]:
    names = set(src.names())
    t = lambda i, n: f"transformer/layer_{i}/{n}"  # noqa: E731
    rename = {"attn/query_norm/scale": "attn/_query_norm/scale", "attn/key_norm/scale": "attn/_key_norm/scale"}
    expect = {"transformer/embedder/input_embedding": ("V", "D"), "transformer/final_norm/scale": ("D",)}
    plan: dict[str, Any] = {}
    for n in _layer_names(cfg):
        k = rename.get(n, n)
        expect.update({t(i, k): tuple(_LAYER[n]) for i in range(cfg.num_layers)})
        plan[n] = lambda i, s, k=k: src.read(t(i, k), s)
    qkv = "attn/qkv_einsum/w"
    if t(0, qkv) in names:  # K == H checkpoints store one [3, H, D, hd] tensor
        if cfg.num_kv_heads != cfg.num_heads:
            raise WeightsError(f"{t(0, qkv)} means num_kv_heads == num_heads, but arch.num_kv_heads="
                               f"{cfg.num_kv_heads} and arch.num_heads={cfg.num_heads}; set arch.num_kv_heads="
                               f"{cfg.num_heads}")
        for i in range(cfg.num_layers):
            del expect[t(i, "attn/q_einsum/w")], expect[t(i, "attn/kv_einsum/w")]
            expect[t(i, qkv)] = ("3", "H", "D", "h")
        plan["attn/q_einsum/w"] = lambda i, s: src.read(t(i, qkv), (slice(0, 1), *s))[0]
        plan["attn/kv_einsum/w"] = lambda i, s: src.read(t(i, qkv), (slice(s[0].start + 1, s[0].stop + 1), *s[1:]))
    g = t(0, "mlp/gating_einsum/w")
    if g in names and src.shape(g) == _shape("2FD", cfg) and cfg.embed_dim != cfg.hidden_dim:
        for i in range(cfg.num_layers):  # later releases store [2, F, D]
            expect[t(i, "mlp/gating_einsum/w")] = ("2", "F", "D")
        plan["mlp/gating_einsum/w"] = lambda i, s: src.read(
            t(i, "mlp/gating_einsum/w"), (s[0], s[2], s[1])).transpose(0, 2, 1)
    plan["embedder/input_embedding"] = "transformer/embedder/input_embedding"
    plan["final_norm/scale"] = "transformer/final_norm/scale"
    return plan, expect, r"transformer/layer_(\d+)/(.+)"


# Our arch fields by the config.json keys that set them (hf_config.arch_from_hf).
_HF_KEYS = {"vocab_size": "vocab_size", "embed_dim": "hidden_size", "hidden_dim": "intermediate_size",
            "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
            "num_layers": "num_hidden_layers", "version": "model_type"}


def _set_fields(fields: list[str], cfg: GemmaConfig, described: Optional[dict]) -> str:
    """How to make `fields` agree with the tensors: the arch overrides, unless cfg holds what the
    checkpoint's own config.json says (arch.checkpoint reads it): then that file is wrong, and an
    override that disagrees with it would be refused."""
    if described is not None and all(described.get(f) == getattr(cfg, f) for f in fields):
        keys = ", ".join(f"{_HF_KEYS.get(f, f)}={described[f]}" for f in fields)
        return (f"its config.json says {keys}, which its tensors contradict: correct config.json to the tensors (or "
                "use the checkpoint it came with)")
    return " / ".join(f"set arch.{f}" for f in fields) + " to match the checkpoint"


def _fix(names, layer_re: str, cfg: GemmaConfig, described: Optional[dict] = None) -> str:
    """The fix for a tensor-set mismatch: the version and depth the checkpoint looks like."""
    layers, kinds = set(), set()
    for n in names:
        m = re.fullmatch(layer_re, n)
        if m:
            layers.add(int(m.group(1)))
            kinds.add(m.group(2))
    if not layers:
        return "it has no layer tensors; point arch.checkpoint at a Gemma checkpoint"
    version = 3 if any("q_norm" in k or "query_norm" in k for k in kinds) else (
        2 if any("pre_feedforward" in k or "post_attention_norm" in k for k in kinds) else 1)
    if (version, max(layers) + 1) == (cfg.version, cfg.num_layers):
        return "the checkpoint is incomplete; download it again"
    wrong = [f for f, v in (("version", version), ("num_layers", max(layers) + 1)) if getattr(cfg, f) != v]
    return f"it looks like Gemma {version} with {max(layers) + 1} layers: {_set_fields(wrong, cfg, described)}"


def _check(path: str, src, expect: dict, layer_re: str, cfg: GemmaConfig, described: Optional[dict] = None) -> None:
    """The tensors `expect`s (name -> symbolic shape) are there with cfg's shapes; else one line.
    `described`: the arch fields the checkpoint's config.json gives, for the hint."""
    names = set(src.names())
    for name, syms in expect.items():
        if name not in names:
            raise WeightsError(f"{path}: tensor {name} is missing for Gemma {cfg.version} with {cfg.num_layers} "
                               f"layers; {_fix(names, layer_re, cfg, described)}")
        found, want = src.shape(name), _shape(syms, cfg)
        if syms[0] == "V":  # vocabulary rows are padded or truncated
            found, want, syms = found[1:], want[1:], syms[1:]
        if found != want:
            bad = [s for i, s in enumerate(syms) if len(found) != len(want) or found[i] != want[i]]
            fields = sorted({_FIELDS[c] for s in bad for c in s.split("*") if not c.isdigit()})
            vals = ", ".join(f"{f}={getattr(cfg, f)}" for f in fields)
            raise WeightsError(f"{path}: tensor {name} has shape {tuple(found)} but the config expects {tuple(want)} "
                               f"= ({', '.join('*'.join(_FIELDS.get(c, c) for c in x.split('*')) for x in syms)}) "
                               f"with {vals}; {_set_fields(fields, cfg, described)}")
    extra = sorted(n for n in names if re.fullmatch(layer_re, n) and n not in expect)
    if extra:
        raise WeightsError(f"{path}: tensor {extra[0]} is not part of Gemma {cfg.version} with {cfg.num_layers} "
                           f"layers; {_fix(names, layer_re, cfg, described)}")


def described_arch(fs, first_file: str) -> Optional[dict]:
    """The arch fields the config.json beside an HF checkpoint's files gives (None without a
    readable one): what the error hints compare the config with."""
    try:
        with fs.open(posixpath.join(posixpath.dirname(first_file), "config.json")) as f:
            return arch_from_hf(json.load(f), "config.json")
    except Exception:  # noqa: BLE001 - no config.json, or one the arch check already reported
        return None


# ----------------------------------------------------------------------------- safetensors headers
def safetensors_header(fs, file: str) -> dict[str, Any]:
    """A safetensors file's header (tensor name -> dtype, shape, data_offsets), with the byte
    offset of its data in "__data_start__"; read without the tensors (local or gs://)."""
    with fs.open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    header["__data_start__"] = 8 + length
    return header


def _same_bytes(fs, a: tuple[str, dict, int], b: tuple[str, dict, int], chunk: int = 64 << 20) -> bool:
    """Whether two tensors (file, header entry, data start) hold the same bytes, read in chunks."""
    (fa, ea, sa), (fb, eb, sb) = a, b
    if ea["dtype"] != eb["dtype"] or ea["shape"] != eb["shape"]:
        return False
    (a0, a1), (b0, _) = ea["data_offsets"], eb["data_offsets"]
    with fs.open(fa, "rb") as x, fs.open(fb, "rb") as y:
        x.seek(sa + a0)
        y.seek(sb + b0)
        for start in range(0, a1 - a0, chunk):
            size = min(chunk, a1 - a0 - start)
            if x.read(size) != y.read(size):
                return False
    return True


def check_hf_tensors(fs, files: list[str], vocab_size: int, where: str) -> None:
    """What config.json cannot say about the tensors, checked before anything is built (as
    transformers does when it loads them): the embedding has config.json's vocab_size rows
    (transformers refuses another count; padding is arch.vocab_size's job, masked), and an
    `lm_head.weight`, which transformers uses instead of the tied embedding, equals the embedding
    (this implementation ties them, so another one is refused, not dropped)."""
    headers = {}
    for file in files:
        header = safetensors_header(fs, file)
        headers.update({name: (file, entry, header["__data_start__"]) for name, entry in header.items()
                        if name != "__data_start__"})
    prefix = _hf_prefix(headers)
    embedding = headers.get(f"{prefix}embed_tokens.weight")
    if embedding is None:
        return  # not a Gemma checkpoint's tensors: loading says which is missing
    rows = embedding[1]["shape"][0]
    if rows != vocab_size:
        raise WeightsError(f"{where}: vocab_size={vocab_size} but {prefix}embed_tokens.weight has {rows} rows "
                           f"(transformers refuses this checkpoint too); set vocab_size to {rows} in config.json, and "
                           f"pad with arch.vocab_size={vocab_size} if you want a larger table (its extra rows masked)")
    head = next((headers[n] for n in ("lm_head.weight", f"{prefix.replace('model.', '', 1)}lm_head.weight")
                 if n in headers), None)
    if head is not None and not _same_bytes(fs, head, embedding):
        raise WeightsError(f"{where}: the checkpoint holds an lm_head.weight that differs from {prefix}embed_tokens.weight "
                           "(an untied output layer, which transformers uses even with tie_word_embeddings=true); this "
                           "Gemma ties the output to the embedding, so it would be another model: use a checkpoint "
                           "without lm_head.weight, or with one equal to the embedding")


# ----------------------------------------------------------------------------- locating files
def locate(path: str, fmt: str) -> tuple[str, Any, list[str]]:
    """-> ("hf", fs, [safetensors files]) or ("kaggle", fs, [folder]); nothing is copied.
    Kaggle folders are local absolute paths or the URL (Orbax/TensorStore read gs:// directly)."""
    if fmt not in FORMATS:
        raise WeightsError(f"checkpoint_format={fmt!r} is not one of {FORMATS}; set arch.checkpoint_format=auto")
    try:
        fs, root = fsspec.core.url_to_fs(path)
        exists = fs.exists(root)
        is_file = exists and fs.isfile(root)
        listing = {} if not exists or is_file else {posixpath.basename(p.rstrip("/")): p for p in fs.ls(root, detail=False)}
    except Exception as e:  # bad URL, no access
        raise WeightsError(f"{path}: cannot read ({type(e).__name__}: {e}); check the path and its access") from e
    if not exists:
        raise WeightsError(f"{path}: no such file or folder; set arch.checkpoint to a Hugging Face .safetensors "
                           "file/folder or a Kaggle Flax checkpoint folder")
    found = "unknown"
    files: list[str] = []
    if is_file and root.endswith(".safetensors"):
        found, files = "hf", [root]
    elif _HF_INDEX in listing:
        with fs.open(listing[_HF_INDEX]) as f:
            wanted = sorted(set(json.load(f)["weight_map"].values()))
        missing = [w for w in wanted if w not in listing]
        if missing:
            raise WeightsError(f"{path}: {_HF_INDEX} names {missing[0]}, which is not in the folder; "
                               "download every shard of the checkpoint")
        found, files = "hf", [listing[w] for w in wanted]
    elif any(n.endswith(".safetensors") for n in listing):
        found, files = "hf", sorted(p for n, p in listing.items() if n.endswith(".safetensors"))
    elif _KAGGLE_MARKERS & set(listing):
        found = "kaggle"
    if found == "unknown":
        seen = ", ".join(sorted(listing)[:6]) or "a file"
        raise WeightsError(f"{path}: unknown checkpoint layout (found {seen}); point arch.checkpoint at a .safetensors "
                           "file, a folder of *.safetensors, or a Kaggle Flax folder holding _METADATA")
    if fmt != "auto" and fmt != found:
        raise WeightsError(f"{path}: looks like a {found} checkpoint but arch.checkpoint_format={fmt}; "
                           f"set arch.checkpoint_format={found} or auto")
    if found == "kaggle":
        files = [os.path.abspath(root) if _is_local(fs) else path]
    return found, fs, files


def _is_local(fs) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def _cache_locally(url: str, fs, files: list[str]) -> list[str]:
    """Copies remote safetensors files to $GEMMA_WEIGHTS_CACHE/<hash of url>/ (kept between runs)."""
    root = os.environ.get("GEMMA_WEIGHTS_CACHE") or os.path.expanduser("~/.cache/podrunner/gemma_weights")
    dest = os.path.join(root, hashlib.sha1(url.rstrip("/").encode()).hexdigest()[:16])
    os.makedirs(dest, exist_ok=True)
    out = []
    for rf in files:
        local = os.path.join(dest, posixpath.basename(rf))
        if not (os.path.exists(local) and os.path.getsize(local) == fs.size(rf)):
            log.info("copying %s to %s", rf, local)
            with replacing(local) as tmp:  # a copy cut short is never taken for the file
                fs.get(rf, tmp)
        out.append(local)
    return out


# ----------------------------------------------------------------------------- load
def _norm(index: tuple, shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))


def _embed_reader(src, name: str, dtype) -> Callable:
    rows = src.shape(name)[0]

    def read(s):  # zero rows past the checkpoint's table
        out = np.zeros((s[0].stop - s[0].start, s[1].stop - s[1].start), dtype)
        stop = min(s[0].stop, rows)
        if stop > s[0].start:
            out[: stop - s[0].start] = src.read(name, (slice(s[0].start, stop), s[1]))
        return out

    return read


def _stacked_reader(per_layer: Callable, dtype) -> Callable:
    def read(s):
        out = np.empty(tuple(x.stop - x.start for x in s), dtype)
        for j, i in enumerate(range(s[0].start, s[0].stop)):  # only the requested layers
            out[j] = per_layer(i, s[1:])
        return out

    return read


def _callback(read: Callable, shape: tuple[int, ...]) -> Callable:
    last: list = [None, None]  # devices that replicate a shard ask for it back to back

    def cb(index):
        s = _norm(index, shape)
        key = tuple((x.start, x.stop) for x in s)
        if last[0] != key:
            last[:] = [key, read(s)]
        return last[1]

    return cb


def load_params(path: str, cfg: GemmaConfig, shardings: Any = None, *, fmt: str = "auto") -> dict:
    """Reads a Hugging Face or Kaggle Gemma checkpoint into cfg's param tree (see config.py).

    `shardings`: a tree like the params with `jax.sharding.Sharding` leaves (extra leaves such
    as LoRA ones are ignored), or None for one local device. Arrays have dtype cfg.param_dtype.
    Returns only the base params (no LoRA leaves).
    """
    kind, fs, files = locate(path, fmt)
    described = described_arch(fs, files[0]) if kind == "hf" else None
    if kind == "hf" and not _is_local(fs):
        files = _cache_locally(path, fs, files)
    dtype = jnp.dtype(dtype_from_name(cfg.param_dtype))
    shapes = param_shapes(cfg)
    flat = {}
    with contextlib.ExitStack() as stack:
        try:
            src = _HFSource(files, stack) if kind == "hf" else _KaggleSource(files[0])
        except Exception as e:
            raise WeightsError(f"{path}: cannot open the {kind} checkpoint ({type(e).__name__}: {e}); "
                               "check that it is complete") from e
        if kind == "hf" and not _hf_prefix(src.names()):
            raise WeightsError(f"{path}: no model.embed_tokens.weight (nor a language_model. variant); "
                               "this is not a Gemma Hugging Face checkpoint")
        plan, expect, layer_re = (_hf_plan if kind == "hf" else _kaggle_plan)(src, cfg)
        _check(path, src, expect, layer_re, cfg, described)
        emb_rows = src.shape(plan["embedder/input_embedding"])[0]
        if cfg.vocab_in_use > emb_rows:  # zero rows the model would use as ids: refused, never unmasked
            raise WeightsError(f"{path}: the embedding has {emb_rows} rows but the model uses {cfg.vocab_in_use} ids "
                               f"(arch.vocab_size / arch.real_vocab_size), so ids >= {emb_rows} would be zero rows, "
                               f"unmasked; set arch.real_vocab_size={emb_rows} to mask them as padding")
        if emb_rows > cfg.vocab_size:
            log.warning("%s: embedding has %d rows, keeping the first arch.vocab_size=%d", path, emb_rows,
                        cfg.vocab_size)
        elif emb_rows < cfg.vocab_size:
            log.info("%s: embedding has %d rows; arch.vocab_size=%d adds %d zero rows of padding (ids >= %d are "
                     "masked to -inf)", path, emb_rows, cfg.vocab_size, cfg.vocab_size - emb_rows, cfg.vocab_in_use)
        for p, shape in shapes.items():
            if p.startswith("layers/"):
                read = _stacked_reader(plan[p[len("layers/"):]], dtype)
            elif p == "embedder/input_embedding":
                read = _embed_reader(src, plan[p], dtype)
            else:
                read = functools.partial(lambda s, n: src.read(n, s).astype(dtype), n=plan[p])
            sharding = _get(shardings, p) or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            flat[p] = jax.make_array_from_callback(shape, sharding, _callback(read, shape), dtype=dtype)
    return unflatten_dict(flat, sep="/")


# ----------------------------------------------------------------------------- export
@functools.partial(jax.jit, static_argnums=(2,))
def _take(a, i, dtype):
    return jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False).astype(dtype)


@functools.partial(jax.jit, static_argnums=(1,))
def _cast(a, dtype):
    return a.astype(dtype)


def _host(x) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def _check_base(params: dict, cfg: GemmaConfig) -> None:
    flat = {"/".join(str(getattr(k, "key", k)) for k in kp): v
            for kp, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    lora = [p for p in flat if p.endswith(("lora_a", "lora_b"))]
    if lora:
        raise WeightsError(f"params hold LoRA leaves ({lora[0]}); pass merge=models.gemma.lora.merge_lora")
    for p, shape in param_shapes(cfg).items():
        if p not in flat or tuple(flat[p].shape) != shape:
            raise WeightsError(f"params/{p} is {getattr(flat.get(p), 'shape', 'missing')}, expected {shape} "
                               "from the arch config; export the params this config built")


def _hf_tensors(params: dict, cfg: GemmaConfig, vocab: int, dtype) -> Any:
    """Yields (HF name, thunk -> host array) in file order; one gather per param and layer."""
    H, K, D, hd = cfg.num_heads, cfg.num_kv_heads, cfg.embed_dim, cfg.head_dim
    table = _hf_layer_table(cfg)
    convert = {  # our per-layer array -> HF arrays ([out, in]), in table order
        "attn/q_einsum/w": lambda w: [w.transpose(0, 2, 1).reshape(H * hd, D)],
        "attn/kv_einsum/w": lambda w: [x.transpose(0, 2, 1).reshape(K * hd, D) for x in w],
        "attn/attn_vec_einsum/w": lambda w: [w.reshape(H * hd, D).T],
        "mlp/gating_einsum/w": lambda w: [w[0].T, w[1].T],
        "mlp/linear/w": lambda w: [w.T],
    }
    emb = _get(params, "embedder/input_embedding")
    yield "model.embed_tokens.weight", lambda: _host(_cast(emb, dtype))[:vocab]
    for i in range(cfg.num_layers):
        for n, (hf_names, _) in table.items():
            get = functools.cache(functools.partial(  # gathered once, split into its HF tensors (k/v, gate/up)
                lambda n, i: convert.get(n, lambda w: [w])(_host(_take(_get(params, f"layers/{n}"), i, dtype))), n, i))
            for j, h in enumerate(hf_names):
                yield f"model.layers.{i}.{h}.weight", lambda get=get, j=j: get()[j]
    yield "model.norm.weight", lambda: _host(_cast(_get(params, "final_norm/scale"), dtype))


def _hf_shapes(cfg: GemmaConfig, vocab: int) -> dict[str, tuple[int, ...]]:
    out = {"model.embed_tokens.weight": (vocab, cfg.embed_dim)}
    for i in range(cfg.num_layers):
        for hf_names, syms in _hf_layer_table(cfg).values():
            out.update({f"model.layers.{i}.{h}.weight": _shape(syms, cfg) for h in hf_names})
    out["model.norm.weight"] = (cfg.embed_dim,)
    return out


def export_hf(params: dict, cfg: GemmaConfig, out_dir: str, *, dtype: str = "bfloat16",
              max_shard_bytes: int = 2 << 30, vocab_size: Optional[int] = None,
              merge: Optional[Callable] = None, token_ids: Optional[dict[str, Any]] = None) -> list[str]:
    """Writes params as a Hugging Face checkpoint (safetensors, index when sharded, config.json,
    generation_config.json).

    Local path or gs://. Every process must call it (gathers are collective); process 0 writes,
    holding one tensor at a time. `vocab_size` truncates the embedding rows (default: the rows in
    use, cfg.vocab_in_use, so padding is dropped); `merge(params, cfg)` folds LoRA leaves in
    first; `token_ids`: pad/eos/bos_token_id (the tokenizer's; default transformers' Gemma ids).
    Returns the files written (on process 0).
    """
    if dtype not in _ST_DTYPES:
        raise WeightsError(f"export dtype {dtype!r} is not one of {sorted(_ST_DTYPES)}")
    vocab = vocab_size or cfg.vocab_in_use  # padding rows are not part of the model
    if not 0 < vocab <= cfg.vocab_size:
        raise WeightsError(f"vocab_size={vocab} must be in 1..arch.vocab_size={cfg.vocab_size}")
    token_ids = dict(token_ids or GEMMA_TOKEN_IDS)
    config = hf_config(cfg, vocab, dtype, token_ids)  # refuses an arch transformers cannot express, before writing
    if merge is not None:
        params = merge(params, cfg)
    _check_base(params, cfg)
    np_dtype = jnp.dtype(dtype)
    shapes = _hf_shapes(cfg, vocab)
    nbytes = {n: int(np.prod(s)) * np_dtype.itemsize for n, s in shapes.items()}
    groups: list[list[str]] = [[]]  # greedy split into files of at most max_shard_bytes
    for n in shapes:
        if groups[-1] and sum(nbytes[m] for m in groups[-1]) + nbytes[n] > max_shard_bytes:
            groups.append([])
        groups[-1].append(n)
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))])
    writer = jax.process_index() == 0
    fs, root = fsspec.core.url_to_fs(out_dir)
    if writer:
        fs.makedirs(root, exist_ok=True)
    tensors = _hf_tensors(params, cfg, vocab, np_dtype)
    for fname, group in zip(names, groups):
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for n in group:
            header[n] = {"dtype": _ST_DTYPES[dtype], "shape": list(shapes[n]), "data_offsets": [off, off + nbytes[n]]}
            off += nbytes[n]
        hb = json.dumps(header, separators=(",", ":")).encode()
        hb += b" " * (-len(hb) % 8)
        with (fs.open(posixpath.join(root, fname), "wb") if writer else contextlib.nullcontext()) as f:
            if writer:
                f.write(struct.pack("<Q", len(hb)) + hb)
            for n in group:
                name, get = next(tensors)
                assert name == n, (name, n)
                x = np.ascontiguousarray(get(), dtype=np_dtype)
                assert x.shape == shapes[n], (n, x.shape, shapes[n])
                if writer:
                    f.write(x.tobytes())
    if writer:
        if len(groups) > 1:
            index = {"metadata": {"total_size": sum(nbytes.values())},
                     "weight_map": {n: f for f, g in zip(names, groups) for n in g}}
            with fs.open(posixpath.join(root, _HF_INDEX), "w") as f:
                json.dump(index, f, indent=2)
        with fs.open(posixpath.join(root, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        with fs.open(posixpath.join(root, "generation_config.json"), "w") as f:
            json.dump(generation_config(token_ids), f, indent=2)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("gemma_export_hf")
    return names + ([_HF_INDEX] if len(groups) > 1 else []) + ["config.json", "generation_config.json"] if writer else []


def _to_kaggle(params: dict, cfg: GemmaConfig) -> dict:
    out = {"transformer/embedder": {"input_embedding": _get(params, "embedder/input_embedding")},
           "transformer/final_norm": {"scale": _get(params, "final_norm/scale")}}
    rename = {"attn/query_norm/scale": "attn/_query_norm/scale", "attn/key_norm/scale": "attn/_key_norm/scale"}
    qkv = cfg.num_kv_heads == cfg.num_heads
    for i in range(cfg.num_layers):
        for n in _layer_names(cfg):
            w = _get(params, f"layers/{n}")[i]
            if n == "mlp/gating_einsum/w" and cfg.version >= 3:
                w = w.transpose(0, 2, 1)  # Gemma 3 releases store [2, F, D]
            if qkv and n == "attn/q_einsum/w":
                continue
            if qkv and n == "attn/kv_einsum/w":
                n, w = "attn/qkv_einsum/w", jnp.concatenate([_get(params, "layers/attn/q_einsum/w")[i][None], w])
            mod, leaf = rename.get(n, n).rsplit("/", 1)
            out[f"transformer/layer_{i}/{mod}"] = {leaf: w}
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16), out)


def write_kaggle(params: dict, cfg: GemmaConfig, out_dir: str) -> None:
    """Writes params in the Kaggle Flax/Orbax layout (bf16; qkv_einsum when K == H; gating
    [2, F, D] for Gemma 3, [2, D, F] before). Holds a bf16 per-layer copy on device while saving.
    Every process must call it. out_dir must not exist yet."""
    _check_base(params, cfg)
    tree = jax.jit(functools.partial(_to_kaggle, cfg=cfg))(params)
    ocp.PyTreeCheckpointer().save(out_dir, tree)
