"""Import a reference PyTorch TRM/HRM checkpoint into our params pytree, in one command:

    python -m models.recursive_reasoning.import_reference \\
        --checkpoint-dir "checkpoints/<project>/<run>" --out imported/run

``--checkpoint-dir`` is the reference run's folder: the latest ``step_<N>`` state_dict in it
(``--step N`` for another) is converted, and its ``all_config.yaml`` gives the model (arch.name)
and the arch, its keys as the reference writes them (`reference_config.ARCH_KEYS` maps them onto
ours; missing keys take the reference's defaults). The sizes come from the state_dict (vocab,
puzzle ids, and the sequence length where a shape shows it) or the run's data path
(``train/dataset.json``). A state_dict that contradicts its config (attention vs mlp_t blocks,
positions, puzzle table, layer counts) is refused in one line. Without a saved config,
``--state-dict FILE --model trm|hrm --arch-overrides k=v ...`` takes the arch from the reference's
defaults plus the overrides.

The reference saves the ``state_dict`` of ``ACTLossHead(model)``, usually compiled, so keys read
``_orig_mod.model.inner.<name>``; the prefixes ``_orig_mod.``, ``module.``, ``model.``,
``inner.`` are stripped wherever they lead. The name mapping and the layout changes are in
``docs/REFERENCE_IMPORT.md`` (and `_rule` below). In short: every ``CastedLinear`` weight is
stored ``[out, in]`` and ours ``[in, out]`` (reshaped: fused qkv -> ``[embed, 3, heads,
head_dim]``, o_proj -> ``[heads, head_dim, embed]``, SwiGLU gate_up -> ``[in, 2, mlp]``, gate
first); embeddings and the puzzle table are copied as they are.

Checks (each failure is a `UserError` with one line naming the key): every reference key is
consumed, every parameter of our model is filled, and every shape matches. Non-persistent rotary
tables (``rotary_emb.cos_cached/sin_cached``), if present, are checked against ours and dropped.
All values are stored as float32 (the reference keeps ``H_init``/``L_init`` in its forward
dtype, usually bfloat16: upcast exactly).

Output layout (``--out DIR``)::

    DIR/params        Orbax StandardCheckpointer item: the *unboxed* params dict, float32,
                      exactly the tree ``nn.meta.unbox(init_params(model, ...))`` has
    DIR/init_states   Orbax StandardCheckpointer item: {"H_init": [hidden], "L_init": [hidden]}
    DIR/import.json   model name, arch config, sizes, source files, the pretrain_jax.py
                      overrides for this arch, and whether H_init/L_init equal our fixed ones

Restore with `load_imported` (or ``ocp.StandardCheckpointer().restore(DIR/params, abstract)``
with an abstract tree from ``jax.eval_shape``, which also gives the arrays a sharding).

H_init/L_init: the reference draws them from the run's seed and stores them; ours default to
fixed vectors from a constant key (``trm.initial_states``). The model `import_reference` returns
carries the imported ones (its ``init_states`` field), so its ``initial_carry``/``reset_carry``
(and ``act_step``, ``act_evaluate``) start from them; ``train.init_params_from=DIR`` does the
same in the trainer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import re
import shlex
import shutil
import sys
from typing import Any, Mapping, Sequence

import flax.linen as nn
import fsspec
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax.traverse_util import unflatten_dict

from models.recursive_reasoning import HRM, TRM, dummy_batch, init_params
from models.recursive_reasoning.layers import rope_cos_sin
from models.recursive_reasoning.reference_config import (CONFIG_FILE, arch_config, check_state_dict, dataset_seq_len,
                                                         find_checkpoint, model_of, read_run_config, state_dict_sizes,
                                                         trainer_overrides)
from models.recursive_reasoning.task import init_state_vectors
from models.recursive_reasoning.trm import initial_states
from runtime.atomic import write_atomic
from runtime.errors import StorageError, UserError, one_line, storage_fault, storage_fix
from runtime.imported import load_imported_params, load_imported_states
from runtime.ranges import check_given

PREFIXES = ("_orig_mod.", "module.", "model.", "inner.")

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
        import torch  # optional: not a dependency of the project (pyproject.toml's test extra has it)
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


def build_config(model_name: str, overrides: Sequence[str] = ()):
    """Our TRMConfig/HRMConfig from the reference's defaults and `k=v` overrides (our field names
    or the reference's), without a saved config."""
    return arch_config(model_name, None, overrides)[0]


def build_model(model_name: str, cfg, vocab_size: int, seq_len: int, num_puzzle_identifiers: int,
                init_states: Any = None):
    """Our TRM/HRM module; `init_states` ({"H_init", "L_init"} or None) seeds its carry."""
    cls = TRM if model_name == "trm" else HRM
    return cls(cfg, vocab_size=vocab_size, seq_len=seq_len, num_puzzle_identifiers=num_puzzle_identifiers,
               init_states=init_state_vectors(init_states))


def expected_params(model) -> dict[str, tuple[int, ...]]:
    """{'a/b/c': shape} of the model's (unboxed) params, computed without allocating."""
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
        if key.startswith("rotary_emb.") and key.endswith(("cos_cached", "sin_cached")) and cfg.pos_encodings == "rope":
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

    params = unflatten_dict(flat, sep="/")
    h, l = (np.asarray(v, np.float32) for v in initial_states(cfg.hidden, np.float32))
    info = {"keys_consumed": len(sd), "params": len(flat),
            "init_states_equal_ours": bool(np.array_equal(h, init_states["H_init"])
                                           and np.array_equal(l, init_states["L_init"])),
            "init_states_max_abs_diff": float(max(np.abs(h - init_states["H_init"]).max(),
                                                  np.abs(l - init_states["L_init"]).max()))}
    return params, init_states, info


# ---------------------------------------------------------------- Orbax output


def save_imported(out_dir: str, params: dict, init_states: Mapping[str, np.ndarray], meta: dict, force: bool = False) -> str:
    """params/, init_states/ and import.json into `out_dir`. A save that fails (a full disk) removes
    what it made, so the same command runs again without --force; StorageError (exit 6) names it."""
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(os.path.join(out_dir, "params")) and not force:
        raise UserError(f"{out_dir}/params exists; choose another --out or pass --force")
    parts = [os.path.join(out_dir, name) for name in ("params", "init_states", "import.json")]
    there = set(os.listdir(out_dir)) if os.path.isdir(out_dir) else None  # what a failed save leaves alone
    try:
        os.makedirs(out_dir, exist_ok=True)
        ckpt = ocp.StandardCheckpointer()
        ckpt.save(parts[0], jax.tree.map(jnp.asarray, params), force=force)
        ckpt.save(parts[1], {k: jnp.asarray(v) for k, v in init_states.items()}, force=force)
        ckpt.wait_until_finished()
        write_atomic(parts[2], json.dumps(meta, indent=2, sort_keys=True))
    except BaseException as e:
        made = [out_dir] if there is None else [os.path.join(out_dir, n) for n in set(os.listdir(out_dir)) - there]
        for path in made:  # its folders (Orbax's temporary ones too); import.json is written whole or not at all
            shutil.rmtree(path, ignore_errors=True)
        fault = storage_fault(e)
        if fault is None:
            raise
        raise StorageError(f"cannot write the import to {out_dir} ({fault}); {storage_fix(fault, out_dir)} and run "
                           "the same command again") from e
    return out_dir


def load_imported(out_dir: str, abstract_params: Any = None) -> tuple[dict, dict, dict]:
    """(params, init_states, meta) from a directory `save_imported` wrote."""
    with fsspec.open(f"{out_dir.rstrip('/')}/import.json", "r") as f:
        meta = json.load(f)
    return load_imported_params(out_dir, abstract_params), load_imported_states(out_dir), meta


# ---------------------------------------------------------------- CLI


def _locate(checkpoint_dir: str | None, step: int | None, state_dict: Any, config: Any):
    """(state_dict path or mapping, step or None, config path or mapping or None)."""
    if (checkpoint_dir is None) == (state_dict is None):
        raise UserError("pass the reference run's folder (--checkpoint-dir) or a state_dict file (--state-dict)")
    if checkpoint_dir is not None:
        state_dict, step = find_checkpoint(checkpoint_dir, step)
    elif step is not None:
        raise UserError("--step picks a checkpoint in --checkpoint-dir; with --state-dict pass that file")
    if config is None and isinstance(state_dict, str):
        beside = os.path.join(os.path.dirname(state_dict), CONFIG_FILE)
        config = beside if os.path.isfile(beside) else None
    return state_dict, step, config


def _sizes(sd: Mapping[str, np.ndarray], cfg, given: Mapping[str, int | None], saved, config: Any) -> dict[str, int]:
    """vocab / seq_len / puzzle ids: as given, else held by the state_dict, else (seq_len) the run's dataset.json."""
    sizes = state_dict_sizes(sd, cfg)
    sizes.update({k: v for k, v in given.items() if v is not None})
    if sizes["seq_len"] is None:
        sizes["seq_len"] = dataset_seq_len(saved, config if isinstance(config, str) else None)
        if sizes["seq_len"] is None:
            raise UserError("cannot tell the sequence length: no shape in the state_dict shows it and the run's "
                            "data path (train/dataset.json) is not here; pass --seq-len (the dataset's seq_len)")
    if sizes["vocab_size"] is None:
        raise UserError("the state_dict has no embed_tokens.embedding_weight; not a reference TRM/HRM checkpoint?")
    return sizes


def import_reference(state_dict: str | Mapping[str, Any] | None = None, model_name: str | None = None,
                     arch_overrides: Sequence[str] = (), vocab_size: int | None = None, seq_len: int | None = None,
                     num_puzzle_identifiers: int | None = None, out: str | None = None, force: bool = False, *,
                     checkpoint_dir: str | None = None, step: int | None = None, config: Any = None):
    """Function form of the CLI: `checkpoint_dir` (the reference run's folder; `step` or the
    latest) or `state_dict` (a file, or an in-memory mapping); `config` (an all_config.yaml
    path or its contents; by default the one beside the state_dict). Sizes left None come from
    the state_dict or the run's dataset.json.

    Returns (model, params, init_states, info): `model` starts its carry from the imported
    H_init/L_init. Writes `out` when given.
    """
    sd_source, step, config = _locate(checkpoint_dir, step, state_dict, config)
    saved, label = None, CONFIG_FILE
    if config is not None:
        saved = read_run_config(config)
        label = config if isinstance(config, str) else label
        model_name = model_of(saved, label, model_name)
    elif model_name is None:
        raise UserError(f"no {CONFIG_FILE} beside the checkpoint: pass --config FILE, or --model trm|hrm with the "
                        "run's arch as --arch-overrides")
    cfg, source = arch_config(model_name, saved, arch_overrides, label)
    sd = load_state_dict(sd_source) if isinstance(sd_source, str) else normalize_state_dict(sd_source)
    check_state_dict(sd, model_name, cfg, source)
    sizes = _sizes(sd, cfg, {"vocab_size": vocab_size, "seq_len": seq_len,
                             "num_puzzle_identifiers": num_puzzle_identifiers}, saved, config)
    model = build_model(model_name, cfg, sizes["vocab_size"], sizes["seq_len"], sizes["num_puzzle_identifiers"])
    params, init_states, info = convert_state_dict(sd, model)
    model = build_model(model_name, cfg, sizes["vocab_size"], sizes["seq_len"], sizes["num_puzzle_identifiers"],
                        init_states)
    info.update(model=model_name, step=step, config=os.path.abspath(config) if isinstance(config, str) else None,
                pretrain_overrides=trainer_overrides(model_name, cfg))
    if out is not None:
        meta = {"arch": dataclasses.asdict(cfg), **sizes,
                "source": os.path.abspath(sd_source) if isinstance(sd_source, str) else "<in-memory>", **info}
        save_imported(out, params, init_states, meta, force=force)
    return model, params, init_states, info


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m models.recursive_reasoning.import_reference",
                                 description="Convert a reference TRM/HRM PyTorch checkpoint into an Orbax params "
                                             "checkpoint.")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint-dir", help="the reference run's folder (checkpoints/<project>/<run>): its latest "
                                              f"step_<N> and its {CONFIG_FILE}")
    src.add_argument("--state-dict", help="one reference state_dict file (step_<N>)")
    ap.add_argument("--step", type=int, help="with --checkpoint-dir: convert step_<N> instead of the latest")
    ap.add_argument("--config", help=f"the run's {CONFIG_FILE} (default: the one beside the state_dict)")
    ap.add_argument("--model", choices=("trm", "hrm"), help=f"needed only without a {CONFIG_FILE} (its arch.name says)")
    ap.add_argument("--arch-overrides", nargs="*", default=[], metavar="K=V",
                    help="our TRMConfig/HRMConfig fields or the reference's arch keys; one that contradicts the saved "
                         "config is refused")
    ap.add_argument("--vocab-size", type=int, help="default: the state_dict's")
    ap.add_argument("--seq-len", type=int, help="default: from the state_dict's shapes or the run's dataset.json")
    ap.add_argument("--num-puzzle-identifiers", type=int, help="default: the state_dict's")
    ap.add_argument("--out", required=True, help="output directory (params/, init_states/, import.json)")
    ap.add_argument("--force", action="store_true", help="overwrite an existing output")
    args = ap.parse_args(argv)
    try:
        check_given(args, ("--checkpoint-dir", "--state-dict", "--config", "--out"), UserError)  # '': the working directory
        _, _, _, info = import_reference(args.state_dict, args.model, args.arch_overrides, args.vocab_size,
                                         args.seq_len, args.num_puzzle_identifiers, out=args.out, force=args.force,
                                         checkpoint_dir=args.checkpoint_dir, step=args.step, config=args.config)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    what = f"step {info['step']} " if info["step"] is not None else ""
    print(f"imported {what}{info['model'].upper()} ({info['config'] or 'no saved config'}): {info['keys_consumed']} "
          f"keys -> {info['params']} params into {os.path.abspath(args.out)}")
    print("run it with: python pretrain_jax.py " + " ".join(info["pretrain_overrides"])
          + " " + shlex.quote(f"train.init_params_from={os.path.abspath(args.out)}") + " data.path=DATA")
    return 0


if __name__ == "__main__":
    from runtime.run_log import console_logging

    console_logging(logging.WARNING, "%(levelname)s %(message)s")  # Orbax's failed save: one line, not its traceback
    sys.exit(main())
