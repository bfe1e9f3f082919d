"""Import a PyTorch reference checkpoint (TRM or HRM ``state_dict``) into our params pytree.

    python -m models.recursive_reasoning.import_reference --state-dict step_XXXX.pt --model trm \\
        --arch-overrides hidden=512 L_layers=2 mlp_t=true pos_encodings=none \\
        --vocab-size 11 --seq-len 81 --num-puzzle-identifiers 1 --out /path/imported

The reference (SamsungSAILMontreal/TinyRecursiveModels, sapientinc/HRM) saves the
``state_dict`` of ``ACTLossHead(model)``, usually compiled, so keys read
``_orig_mod.model.inner.<name>``; the prefixes ``_orig_mod.``, ``module.``, ``model.``,
``inner.`` are stripped wherever they lead. The name mapping and the layout changes are in
``docs/REFERENCE_IMPORT.md`` (and `_rule` below). In short: every ``CastedLinear`` weight is
stored ``[out, in]`` and ours ``[in, out]`` (reshaped: fused qkv -> ``[embed, 3, heads,
head_dim]``, o_proj -> ``[heads, head_dim, embed]``, SwiGLU gate_up -> ``[in, 2, mlp]``, gate
first); embeddings and the puzzle table are copied as they are.

Checks (each failure is a `UserError` with one line naming the key): every reference key is
consumed, every parameter of our model (built from the config + overrides) is filled, and
every shape matches. Non-persistent rotary tables (``rotary_emb.cos_cached/sin_cached``), if
present, are checked against ours and dropped. All values are stored as float32 (the
reference keeps ``H_init``/``L_init`` in its forward dtype, usually bfloat16: upcast exactly).

Output layout (``--out DIR``)::

    DIR/params        Orbax StandardCheckpointer item: the *unboxed* params dict, float32,
                      exactly the tree ``nn.meta.unbox(init_params(model, ...))`` has
    DIR/init_states   Orbax StandardCheckpointer item: {"H_init": [hidden], "L_init": [hidden]}
    DIR/import.json   model name, arch config, vocab/seq/puzzle sizes, source file, and whether
                      the reference H_init/L_init equal our fixed ones (they never do in practice)

Restore with `load_imported` (or ``ocp.StandardCheckpointer().restore(DIR/params, abstract)``
with an abstract tree from ``jax.eval_shape``, which also gives the arrays a sharding).

H_init/L_init: ours are fixed vectors drawn from a constant key (``trm.initial_states``), not
parameters; the reference draws them from the run's seed and stores them. An imported model
reproduces the reference's forward only when its carry starts from the *imported* vectors
(pass ``InnerCarry`` built by `imported_initial_carry` to ``model.apply``); ``act_step``'s
reset still uses our fixed ones until the model can take them (see docs/REFERENCE_IMPORT.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
from typing import Any, Mapping, Sequence

import numpy as np

from runtime.errors import UserError, one_line
from runtime.imported import load_imported_params, load_imported_states

PREFIXES = ("_orig_mod.", "module.", "model.", "inner.")

# Reference config names accepted as aliases of ours in --arch-overrides.
ALIASES = {"hidden_size": "hidden", "num_heads": "heads"}

_LEVEL = r"(?P<level>[HL])_level\.layers\.(?P<i>\d+)\."


# ---------------------------------------------------------------- state_dict reading


def strip_prefixes(key: str) -> str:
    changed = True
    while changed:
        changed = False
        for p in PREFIXES:
            if key.startswith(p):
                key, changed = key[len(p):], True
    return key


def load_state_dict(path: str) -> dict[str, np.ndarray]:
    """Read a torch ``state_dict`` file as {stripped key: float32 numpy}. Needs torch."""
    try:
        import torch
    except ImportError as e:
        raise UserError("reading a .pt state_dict needs PyTorch: pip install torch==2.13.0 (CPU wheel)") from e
    if not os.path.exists(path):
        raise UserError(f"--state-dict {path}: no such file")
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UserError(f"cannot read {path} as a torch state_dict: {one_line(e)[:300]}") from e
    if not isinstance(sd, Mapping):
        raise UserError(f"{path} holds a {type(sd).__name__}, not a state_dict (a mapping of names to tensors)")
    out: dict[str, np.ndarray] = {}
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            raise UserError(f"state_dict entry {k!r} is a {type(v).__name__}, not a tensor; pass the model's state_dict")
        out.update(_stripped(k, v.detach().to(torch.float32).cpu().numpy(), out))
    return out


def _stripped(key: str, value: np.ndarray, seen: Mapping[str, Any]) -> dict[str, np.ndarray]:
    name = strip_prefixes(key)
    if name in seen:
        raise UserError(f"state_dict key {key!r} collides with another after stripping prefixes {PREFIXES}")
    return {name: value}


def normalize_state_dict(sd: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """{key: array-like} (prefixed or not, any float dtype numpy can hold) -> stripped float32 numpy."""
    out: dict[str, np.ndarray] = {}
    for k, v in sd.items():
        if hasattr(v, "detach"):  # a torch tensor; numpy cannot take bfloat16 from torch directly
            v = v.detach().float().cpu().numpy()
        out.update(_stripped(k, np.asarray(v, np.float32), out))
    return out


# ---------------------------------------------------------------- model / config


def _parse_value(field: str, text: str, default: Any) -> Any:
    if isinstance(default, bool):
        low = text.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise UserError(f"--arch-overrides {field}={text}: expected true/false")
    if isinstance(default, (int, float)):
        try:
            val = float(text) if isinstance(default, float) else int(text)
        except ValueError:
            raise UserError(f"--arch-overrides {field}={text}: expected a {type(default).__name__}") from None
        return val
    return text


def build_config(model_name: str, overrides: Sequence[str] = ()):
    """Our TRMConfig/HRMConfig with `k=v` overrides (our field names, or the reference's
    ``hidden_size``/``num_heads``)."""
    from models.recursive_reasoning import HRMConfig, TRMConfig

    cls = {"trm": TRMConfig, "hrm": HRMConfig}.get(model_name)
    if cls is None:
        raise UserError(f"--model {model_name!r}: use trm or hrm")
    base = cls()
    names = {f.name for f in dataclasses.fields(cls)}
    kw: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise UserError(f"--arch-overrides {item!r}: expected key=value")
        k, v = item.split("=", 1)
        k = ALIASES.get(k.strip(), k.strip())
        if k not in names or k == "name":
            raise UserError(f"--arch-overrides {k}: not a {cls.__name__} field; fields: {', '.join(sorted(names - {'name'}))}")
        kw[k] = _parse_value(k, v.strip(), getattr(base, k))
    return dataclasses.replace(base, **kw)


def build_model(model_name: str, cfg, vocab_size: int, seq_len: int, num_puzzle_identifiers: int):
    from models.recursive_reasoning import HRM, TRM

    cls = TRM if model_name == "trm" else HRM
    return cls(cfg, vocab_size=vocab_size, seq_len=seq_len, num_puzzle_identifiers=num_puzzle_identifiers)


def expected_params(model) -> dict[str, tuple[int, ...]]:
    """{'a/b/c': shape} of the model's (unboxed) params, computed without allocating."""
    import flax.linen as nn
    import jax

    from models.recursive_reasoning import dummy_batch, init_params

    tree = jax.eval_shape(lambda: nn.meta.unbox(init_params(model, jax.random.key(0), dummy_batch(1, model.seq_len))))
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        flat["/".join(p.key for p in path)] = tuple(leaf.shape)
    return flat


# ---------------------------------------------------------------- the mapping


def _rule(name: str) -> tuple[str, int | None] | None:
    """Reference key (prefixes stripped) -> (our param path, in_axes).

    ``in_axes is None``: copied as is. Otherwise the reference ``[out, in]`` weight is our
    kernel ``K`` with ``W = K.reshape(prod(K.shape[:in_axes]), -1).T``; i.e. ours is
    ``W.T.reshape(K.shape)``.
    """
    fixed = {
        "embed_tokens.embedding_weight": ("embed_tokens", None),
        "embed_pos.embedding_weight": ("pos_embed", None),
        "puzzle_emb.weights": ("puzzle_emb", None),
        "lm_head.weight": ("lm_head", 1),
        "q_head.weight": ("q_head_kernel", 1),
        "q_head.bias": ("q_head_bias", None),
    }
    if name in fixed:
        return fixed[name]
    m = re.fullmatch(_LEVEL + r"(?P<rest>.+)", name)
    if not m:
        return None
    block = f"{m['level']}_level/block_{int(m['i'])}"
    rest = {
        "self_attn.qkv_proj.weight": ("attn/qkv", 1),
        "self_attn.o_proj.weight": ("attn/out", 2),
        "mlp.gate_up_proj.weight": ("mlp/gate_up", 1),
        "mlp.down_proj.weight": ("mlp/down", 1),
        "mlp_t.gate_up_proj.weight": ("mlp_t/gate_up", 1),
        "mlp_t.down_proj.weight": ("mlp_t/down", 1),
    }.get(m["rest"])
    return None if rest is None else (f"{block}/{rest[0]}", rest[1])


def reference_shape(our_shape: Sequence[int], in_axes: int | None) -> tuple[int, ...]:
    if in_axes is None:
        return tuple(our_shape)
    return (math.prod(our_shape[in_axes:]), math.prod(our_shape[:in_axes]))


def convert_state_dict(sd: Mapping[str, np.ndarray], model) -> tuple[dict, dict[str, np.ndarray], dict[str, Any]]:
    """Stripped float32 state_dict -> (params tree, {"H_init", "L_init"}, info).

    Raises `UserError` (one line, naming the key) on an unknown key, a shape mismatch or a
    parameter the state_dict lacks.
    """
    from models.recursive_reasoning.layers import rope_cos_sin

    cfg = model.cfg
    expected = expected_params(model)
    flat: dict[str, np.ndarray] = {}
    init_states: dict[str, np.ndarray] = {}
    hint = (f"our {cfg.name} config (hidden={cfg.hidden}, heads={cfg.heads}, vocab={model.vocab_size}, "
            f"seq_len={model.seq_len}, puzzles={model.num_puzzle_identifiers}) differs from the checkpoint's; "
            "fix --arch-overrides / sizes")

    def fail(msg: str):
        raise UserError(msg)

    for key in sorted(sd):
        val = sd[key]
        if key in ("H_init", "L_init"):
            if val.shape != (cfg.hidden,):
                fail(f"state_dict key {key!r} has shape {val.shape}, expected ({cfg.hidden},): {hint}")
            init_states[key] = np.asarray(val, np.float32)
            continue
        if key.startswith("rotary_emb.") and key.endswith(("cos_cached", "sin_cached")):
            if cfg.pos_encodings != "rope":
                fail(f"state_dict key {key!r}: the checkpoint uses rope but our config has pos_encodings="
                     f"{cfg.pos_encodings!r}; set --arch-overrides pos_encodings=rope")
            cos, sin = rope_cos_sin(model.total_len, cfg.hidden // cfg.heads, cfg.rope_theta)
            ours = np.asarray(cos if key.endswith("cos_cached") else sin)
            if val.shape != ours.shape:
                fail(f"state_dict key {key!r} has shape {val.shape}, ours {ours.shape} (prefix + seq_len, head_dim): {hint}")
            if not np.allclose(val, ours, atol=1e-3):
                fail(f"state_dict key {key!r} differs from our rope table (max |diff| "
                     f"{np.abs(val - ours).max():.3g}); check rope_theta")
            continue
        rule = _rule(key)
        if rule is None:
            fail(f"state_dict key {key!r} is not one the importer knows for the reference {cfg.name.upper()} "
                 f"(after stripping {PREFIXES}); unconsumed")
        path, in_axes = rule
        if path not in expected:
            fail(f"state_dict key {key!r} maps to {path!r}, which our {cfg.name} model does not have: {hint} "
                 "(layer counts, mlp_t, pos_encodings, puzzle_emb_ndim)")
        want = reference_shape(expected[path], in_axes)
        if tuple(val.shape) != want:
            fail(f"state_dict key {key!r} has shape {tuple(val.shape)}, expected {want} for our {path!r} "
                 f"{expected[path]}: {hint}")
        out = val if in_axes is None else val.T.reshape(expected[path])
        flat[path] = np.ascontiguousarray(out, dtype=np.float32)

    missing = [p for p in expected if p not in flat]
    if missing:
        fail(f"our parameter {missing[0]!r} {expected[missing[0]]} has no state_dict key"
             + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "") + f": {hint}")
    missing_init = [k for k in ("H_init", "L_init") if k not in init_states]
    if missing_init:
        fail(f"state_dict has no {missing_init[0]!r} (the reference's persistent buffer); not a reference checkpoint?")

    from flax.traverse_util import unflatten_dict

    params = unflatten_dict(flat, sep="/")

    from models.recursive_reasoning.trm import initial_states

    h, l = (np.asarray(v, np.float32) for v in initial_states(cfg.hidden, np.float32))
    info = {"keys_consumed": len(sd), "params": len(flat),
            "init_states_equal_ours": bool(np.array_equal(h, init_states["H_init"])
                                           and np.array_equal(l, init_states["L_init"])),
            "init_states_max_abs_diff": float(max(np.abs(h - init_states["H_init"]).max(),
                                                  np.abs(l - init_states["L_init"]).max()))}
    return params, init_states, info


def imported_initial_carry(model, init_states: Mapping[str, Any], batch_size: int):
    """The inner carry the reference starts from: its own H_init/L_init broadcast."""
    import jax.numpy as jnp

    from models.recursive_reasoning.trm import InnerCarry

    shape = (batch_size, model.total_len, model.cfg.hidden)
    return InnerCarry(z_H=jnp.broadcast_to(jnp.asarray(init_states["H_init"], model.dtype), shape),
                      z_L=jnp.broadcast_to(jnp.asarray(init_states["L_init"], model.dtype), shape))


# ---------------------------------------------------------------- Orbax output


def save_imported(out_dir: str, params: dict, init_states: Mapping[str, np.ndarray], meta: dict, force: bool = False) -> str:
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    out_dir = os.path.abspath(out_dir)
    if os.path.exists(os.path.join(out_dir, "params")) and not force:
        raise UserError(f"{out_dir}/params exists; choose another --out or pass --force")
    os.makedirs(out_dir, exist_ok=True)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(os.path.join(out_dir, "params"), jax.tree.map(jnp.asarray, params), force=force)
    ckpt.save(os.path.join(out_dir, "init_states"), {k: jnp.asarray(v) for k, v in init_states.items()}, force=force)
    ckpt.wait_until_finished()
    with open(os.path.join(out_dir, "import.json"), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
    return out_dir


def load_imported(out_dir: str, abstract_params: Any = None) -> tuple[dict, dict, dict]:
    """(params, init_states, meta) from a directory `save_imported` wrote."""
    import fsspec

    with fsspec.open(f"{out_dir.rstrip('/')}/import.json", "r") as f:
        meta = json.load(f)
    return load_imported_params(out_dir, abstract_params), load_imported_states(out_dir), meta


# ---------------------------------------------------------------- CLI


def import_reference(state_dict: str | Mapping[str, Any], model_name: str, arch_overrides: Sequence[str], vocab_size: int,
                     seq_len: int, num_puzzle_identifiers: int, out: str | None = None, force: bool = False):
    """Function form of the CLI. `state_dict` is a .pt path or an in-memory mapping.
    Returns (model, params, init_states, info); writes `out` when given."""
    cfg = build_config(model_name, arch_overrides)
    model = build_model(model_name, cfg, vocab_size, seq_len, num_puzzle_identifiers)
    sd = load_state_dict(state_dict) if isinstance(state_dict, str) else normalize_state_dict(state_dict)
    params, init_states, info = convert_state_dict(sd, model)
    if out is not None:
        meta = {"model": model_name, "arch": dataclasses.asdict(cfg), "vocab_size": vocab_size, "seq_len": seq_len,
                "num_puzzle_identifiers": num_puzzle_identifiers,
                "source": os.path.abspath(state_dict) if isinstance(state_dict, str) else "<in-memory>", **info}
        save_imported(out, params, init_states, meta, force=force)
    return model, params, init_states, info


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m models.recursive_reasoning.import_reference",
                                 description="Convert a reference TRM/HRM PyTorch state_dict into an Orbax params checkpoint.")
    ap.add_argument("--state-dict", required=True, help="the reference .pt file (a state_dict)")
    ap.add_argument("--model", required=True, choices=("trm", "hrm"))
    ap.add_argument("--arch-overrides", nargs="*", default=[], metavar="K=V",
                    help="our TRMConfig/HRMConfig fields (hidden_size/num_heads accepted as aliases)")
    ap.add_argument("--vocab-size", type=int, required=True)
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--num-puzzle-identifiers", type=int, required=True)
    ap.add_argument("--out", required=True, help="output directory (params/, init_states/, import.json)")
    ap.add_argument("--force", action="store_true", help="overwrite an existing output")
    args = ap.parse_args(argv)
    try:
        _, _, _, info = import_reference(args.state_dict, args.model, args.arch_overrides, args.vocab_size, args.seq_len,
                                         args.num_puzzle_identifiers, out=args.out, force=args.force)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(f"imported {info['keys_consumed']} keys -> {info['params']} params into {os.path.abspath(args.out)}")
    if not info["init_states_equal_ours"]:
        print("note: the checkpoint's H_init/L_init differ from our fixed ones (max |diff| "
              f"{info['init_states_max_abs_diff']:.3g}); they are saved in init_states/ and must seed the carry "
              "(see docs/REFERENCE_IMPORT.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
