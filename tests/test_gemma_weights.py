"""Gemma weights in and out (models/gemma/weights.py): Hugging Face safetensors and Kaggle
Orbax checkpoints written by this test's own conversion code load to the same param tree,
straight into sharded arrays; export_hf / write_kaggle round-trip; gs:// via the emulator;
bad input gives one-line WeightsErrors."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import dataclasses
import json
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from flax.traverse_util import flatten_dict, unflatten_dict
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from safetensors.numpy import load_file, save_file

from helpers import raises_one_line
from models.gemma import weights as W
from models.gemma.checkpoint_arch import model_differences
from models.gemma.config import GemmaConfig
from models.gemma.hf_config import arch_from_hf

BF16 = ml_dtypes.bfloat16
CFGS = {  # Gemma 1 K == H (Kaggle qkv_einsum) and K == 1; Gemma 2 (vocab 67: not divisible); Gemma 3 K == 1
    "g1_mha": GemmaConfig(version=1, num_layers=2, embed_dim=32, hidden_dim=64, num_heads=4, num_kv_heads=4,
                          head_dim=8, vocab_size=64),
    "g1_mqa": GemmaConfig(version=1, num_layers=2, embed_dim=32, hidden_dim=64, num_heads=4, num_kv_heads=1,
                          head_dim=8, vocab_size=64, param_dtype="bfloat16"),
    "g2": GemmaConfig(version=2, num_layers=3, embed_dim=32, hidden_dim=48, num_heads=4, num_kv_heads=2,
                      head_dim=8, vocab_size=67, global_every=2, sliding_window=4, attn_logit_softcap=50.0,
                      final_logit_softcap=30.0, query_pre_attn_scalar=8.0),
    "g3": GemmaConfig(version=3, num_layers=3, embed_dim=32, hidden_dim=64, num_heads=4, num_kv_heads=1,
                      head_dim=16, vocab_size=64, global_every=3, sliding_window=4, rope_base_global=1e6,
                      rope_scale_global=8.0),
}
# How each test checkpoint differs from the Flax layout: HF embedding rows, HF name prefix,
# Kaggle gating stored [2, F, D].
HF_ROWS = {"g1_mha": -4, "g1_mqa": 0, "g2": 0, "g3": +4}
HF_PREFIX = {"g3": "language_model.model."}
KAGGLE_GATING_FD = {"g3"}


# ----------------------------------------------------------------------------- test's own layout code
def shapes(cfg) -> dict[str, tuple]:
    L, D, F, H, K, h, V = (cfg.num_layers, cfg.embed_dim, cfg.hidden_dim, cfg.num_heads, cfg.num_kv_heads,
                           cfg.head_dim, cfg.vocab_size)
    s = {"embedder/input_embedding": (V, D), "layers/pre_attention_norm/scale": (L, D),
         "layers/pre_ffw_norm/scale": (L, D), "layers/attn/q_einsum/w": (L, H, D, h),
         "layers/attn/kv_einsum/w": (L, 2, K, D, h), "layers/attn/attn_vec_einsum/w": (L, H, h, D),
         "layers/mlp/gating_einsum/w": (L, 2, D, F), "layers/mlp/linear/w": (L, F, D), "final_norm/scale": (D,)}
    if cfg.version >= 2:
        s.update({"layers/post_attention_norm/scale": (L, D), "layers/post_ffw_norm/scale": (L, D)})
    if cfg.version >= 3:
        s.update({"layers/attn/query_norm/scale": (L, h), "layers/attn/key_norm/scale": (L, h)})
    return s


LOGICAL = {"embedder/input_embedding": ("vocab", "embed"), "layers/attn/q_einsum/w": ("layers", "heads", "embed", None),
           "layers/attn/kv_einsum/w": ("layers", None, "kv_heads", "embed", None),
           "layers/attn/attn_vec_einsum/w": ("layers", "heads", None, "embed"),
           "layers/mlp/gating_einsum/w": ("layers", None, "embed", "mlp"), "layers/mlp/linear/w": ("layers", "mlp", "embed"),
           "final_norm/scale": ("embed",)}
RULES = {"embed": "fsdp", "heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "vocab": "tensor"}


def shardings(cfg, mesh) -> dict:
    flat = {}
    for p, shape in shapes(cfg).items():
        names = LOGICAL.get(p, ("layers", "head_dim" if "query" in p or "key" in p else "embed"))
        flat[p] = NamedSharding(mesh, P(*[RULES.get(n) if RULES.get(n) and d % mesh.shape[RULES[n]] == 0 else None
                                          for d, n in zip(shape, names)]))
    return nest(flat)


def nest(flat: dict) -> dict:
    return unflatten_dict(flat, sep="/")


def flat(tree) -> dict:
    return flatten_dict(tree, sep="/")


def ref_params(cfg, seed=0) -> dict[str, np.ndarray]:
    """Random float32 values that bf16 holds exactly."""
    rng = np.random.default_rng(seed)
    return {p: rng.standard_normal(s).astype(BF16).astype(np.float32) for p, s in shapes(cfg).items()}


def to_hf(ref, cfg, prefix="model.", rows=0) -> dict[str, np.ndarray]:
    """Our layout -> HF names, PyTorch [out, in] layout; `rows` extra (or missing) embedding rows."""
    H, K, D, h = cfg.num_heads, cfg.num_kv_heads, cfg.embed_dim, cfg.head_dim
    emb = ref["embedder/input_embedding"]
    emb = np.concatenate([emb, np.ones((rows, D), np.float32)]) if rows > 0 else emb[: len(emb) + rows]
    out = {f"{prefix}embed_tokens.weight": emb, f"{prefix}norm.weight": ref["final_norm/scale"]}
    for i in range(cfg.num_layers):
        r = {p[len("layers/"):]: v[i] for p, v in ref.items() if p.startswith("layers/")}
        t = f"{prefix}layers.{i}."
        out[t + "self_attn.q_proj.weight"] = np.einsum("hdk->hkd", r["attn/q_einsum/w"]).reshape(H * h, D)
        out[t + "self_attn.k_proj.weight"] = np.einsum("hdk->hkd", r["attn/kv_einsum/w"][0]).reshape(K * h, D)
        out[t + "self_attn.v_proj.weight"] = np.einsum("hdk->hkd", r["attn/kv_einsum/w"][1]).reshape(K * h, D)
        out[t + "self_attn.o_proj.weight"] = np.einsum("hkd->dhk", r["attn/attn_vec_einsum/w"]).reshape(D, H * h)
        out[t + "mlp.gate_proj.weight"] = np.einsum("df->fd", r["mlp/gating_einsum/w"][0])
        out[t + "mlp.up_proj.weight"] = np.einsum("df->fd", r["mlp/gating_einsum/w"][1])
        out[t + "mlp.down_proj.weight"] = np.einsum("fd->df", r["mlp/linear/w"])
        out[t + "input_layernorm.weight"] = r["pre_attention_norm/scale"]
        if cfg.version == 1:  # the trap
            out[t + "post_attention_layernorm.weight"] = r["pre_ffw_norm/scale"]
        else:
            out[t + "post_attention_layernorm.weight"] = r["post_attention_norm/scale"]
            out[t + "pre_feedforward_layernorm.weight"] = r["pre_ffw_norm/scale"]
            out[t + "post_feedforward_layernorm.weight"] = r["post_ffw_norm/scale"]
        if cfg.version == 3:
            out[t + "self_attn.q_norm.weight"] = r["attn/query_norm/scale"]
            out[t + "self_attn.k_norm.weight"] = r["attn/key_norm/scale"]
    return {k: np.ascontiguousarray(v).astype(BF16) for k, v in out.items()}


def to_kaggle(ref, cfg, gating_fd=False) -> dict:
    tree = {"transformer/embedder": {"input_embedding": ref["embedder/input_embedding"]},
            "transformer/final_norm": {"scale": ref["final_norm/scale"]}}
    for i in range(cfg.num_layers):
        r = {p[len("layers/"):]: v[i] for p, v in ref.items() if p.startswith("layers/")}
        t = f"transformer/layer_{i}/"
        if cfg.num_kv_heads == cfg.num_heads:
            tree[t + "attn/qkv_einsum"] = {"w": np.concatenate([r["attn/q_einsum/w"][None], r["attn/kv_einsum/w"]])}
        else:
            tree[t + "attn/q_einsum"] = {"w": r["attn/q_einsum/w"]}
            tree[t + "attn/kv_einsum"] = {"w": r["attn/kv_einsum/w"]}
        tree[t + "attn/attn_vec_einsum"] = {"w": r["attn/attn_vec_einsum/w"]}
        g = r["mlp/gating_einsum/w"]
        tree[t + "mlp/gating_einsum"] = {"w": np.einsum("tdf->tfd", g) if gating_fd else g}
        tree[t + "mlp/linear"] = {"w": r["mlp/linear/w"]}
        for n in ("pre_attention_norm", "post_attention_norm", "pre_ffw_norm", "post_ffw_norm"):
            if f"{n}/scale" in r:
                tree[t + n] = {"scale": r[f"{n}/scale"]}
        if cfg.version == 3:
            tree[t + "attn/_query_norm"] = {"scale": r["attn/query_norm/scale"]}
            tree[t + "attn/_key_norm"] = {"scale": r["attn/key_norm/scale"]}
    return jax.tree.map(lambda x: np.ascontiguousarray(x).astype(BF16), tree)


def hf_expected(ref, name) -> dict[str, np.ndarray]:
    """What an HF load must give: missing embedding rows are zero."""
    out = dict(ref)
    if HF_ROWS[name] < 0:
        out["embedder/input_embedding"] = ref["embedder/input_embedding"].copy()
        out["embedder/input_embedding"][HF_ROWS[name]:] = 0
    return out


def assert_tree(got, want: dict[str, np.ndarray], dtype):
    g = flat(got)
    assert sorted(g) == sorted(want)
    for p, v in want.items():
        assert g[p].dtype == np.dtype(dtype), p
        np.testing.assert_array_equal(np.asarray(g[p], np.float32), v, err_msg=p)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """name -> (cfg, ref, hf file, kaggle dir), written by this file's own conversion code."""
    import orbax.checkpoint as ocp

    root = tmp_path_factory.mktemp("gemma_ckpts")
    out = {}
    for name, cfg in CFGS.items():
        ref = ref_params(cfg, seed=len(out))
        hf = root / name / "hf" / "model.safetensors"
        hf.parent.mkdir(parents=True)
        tensors = to_hf(ref, cfg, HF_PREFIX.get(name, "model."), HF_ROWS[name])
        if name == "g3":  # multimodal checkpoints also hold vision tensors
            tensors["vision_tower.encoder.weight"] = np.zeros((3, 3), BF16)
        save_file(tensors, str(hf))
        kaggle = root / name / "kaggle"
        ocp.PyTreeCheckpointer().save(kaggle, to_kaggle(ref, cfg, name in KAGGLE_GATING_FD))
        out[name] = (cfg, ref, hf, kaggle)
    return out


def mesh8():
    assert jax.device_count() >= 8, "conftest gives the session 8 CPU devices"
    return Mesh(np.asarray(jax.devices()[:8]).reshape(4, 2), ("fsdp", "tensor"))  # as runtime/sharding.py


# ----------------------------------------------------------------------------- 1. HF == Kaggle (== logits)
@pytest.mark.parametrize("name", list(CFGS))
def test_hf_and_kaggle_load_the_same_tree(ckpts, name):
    cfg, ref, hf, kaggle = ckpts[name]
    assert W.param_shapes(cfg) == shapes(cfg)
    # Fewer rows than the model uses are zero, masked as padding (real_vocab_size; unmasked is refused).
    hf_cfg = dataclasses.replace(cfg, real_vocab_size=cfg.vocab_size + HF_ROWS[name]) if HF_ROWS[name] < 0 else cfg
    from_hf = W.load_params(str(hf.parent), hf_cfg, None)
    from_file = W.load_params(str(hf), hf_cfg, None, fmt="hf")
    from_kaggle = W.load_params(str(kaggle), cfg, None)
    assert_tree(from_hf, hf_expected(ref, name), cfg.param_dtype)
    assert_tree(from_file, hf_expected(ref, name), cfg.param_dtype)
    assert_tree(from_kaggle, ref, cfg.param_dtype)

    from models.gemma.model import Gemma, init_params

    boxed = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    assert {p: tuple(getattr(v, "value", v).shape) for p, v in flat(boxed).items()} == shapes(cfg)
    tokens = np.arange(16, dtype=np.int32).reshape(2, 8) % 60
    run = jax.jit(lambda p: Gemma(cfg).apply({"params": p}, tokens))
    logits = lambda tree: run(jax.tree.map(lambda x: np.asarray(x).astype(cfg.param_dtype), tree))  # noqa: E731
    want_kaggle = np.asarray(logits(nest(ref)))
    np.testing.assert_array_equal(np.asarray(logits(from_kaggle)), want_kaggle)
    np.testing.assert_array_equal(np.asarray(logits(from_hf)), np.asarray(logits(nest(hf_expected(ref, name)))))
    if HF_ROWS[name] >= 0:
        np.testing.assert_array_equal(np.asarray(logits(from_hf)), want_kaggle)
    assert np.isfinite(want_kaggle).all()


# ----------------------------------------------------------------------------- 2. straight into shards
@pytest.mark.parametrize("name,kind", [("g2", "hf"), ("g2", "kaggle"), ("g3", "hf"), ("g1_mha", "kaggle")])
def test_load_into_mesh_reads_only_shards(ckpts, monkeypatch, name, kind):
    cfg, ref, hf, kaggle = ckpts[name]
    mesh = mesh8()
    sh = shardings(cfg, mesh)
    calls, read = [], [0]
    real_make = jax.make_array_from_callback

    def make(shape, sharding, cb, dtype=None):
        def wrapped(index):
            read[0] = 0
            out = cb(index)
            calls.append((shape, sharding, out.shape, read[0]))
            return out
        return real_make(shape, sharding, wrapped, dtype=dtype)

    def count(real):
        def f(self, name, idx):
            x = real(self, name, idx)
            read[0] += x.size
            return x
        return f

    monkeypatch.setattr(jax, "make_array_from_callback", make)
    monkeypatch.setattr(W._HFSource, "read", count(W._HFSource.read))
    monkeypatch.setattr(W._KaggleSource, "read", count(W._KaggleSource.read))
    got = W.load_params(str(hf if kind == "hf" else kaggle), cfg, sh)
    want = hf_expected(ref, name) if kind == "hf" else ref
    assert_tree(got, want, cfg.param_dtype)
    for p, a in flat(got).items():
        assert a.sharding == flat(sh)[p], p
        for s in a.addressable_shards:
            np.testing.assert_array_equal(np.asarray(s.data, np.float32), want[p][s.index], err_msg=p)
    specs = {p: s.spec for p, s in flat(sh).items()}
    assert specs["layers/attn/q_einsum/w"] == P(None, "tensor", "fsdp", None)
    assert specs["embedder/input_embedding"] == (P(None, "fsdp") if cfg.vocab_size % 2 else P("tensor", "fsdp"))
    assert specs["layers/attn/kv_einsum/w"] == P(None, None, "tensor" if cfg.num_kv_heads % 2 == 0 else None, "fsdp", None)
    assert len(calls) >= len(shapes(cfg))
    for shape, sharding, got_shape, n_read in calls:
        assert got_shape == sharding.shard_shape(shape)  # asked only for its shard ...
        assert n_read <= int(np.prod(got_shape))  # ... and read no more than that
        if not sharding.is_fully_replicated:
            assert got_shape != tuple(shape)


# ----------------------------------------------------------------------------- 3. export round trips
@pytest.mark.parametrize("name", ["g1_mha", "g2", "g3"])
def test_export_hf_round_trip(ckpts, tmp_path, name):
    cfg, ref, _, _ = ckpts[name]
    params = W.load_params(str(ckpts[name][3]), cfg, shardings(cfg, mesh8()))  # sharded, from Kaggle
    files = W.export_hf(params, cfg, str(tmp_path / "one"))
    assert files == ["model.safetensors", "config.json", "generation_config.json"]
    written = load_file(str(tmp_path / "one" / "model.safetensors"))
    want = to_hf(ref, cfg)
    assert sorted(written) == sorted(want)
    for k, v in want.items():
        assert written[k].dtype == BF16
        np.testing.assert_array_equal(written[k], v, err_msg=k)
    assert_tree(W.load_params(str(tmp_path / "one"), cfg, None), ref, cfg.param_dtype)

    c = json.loads((tmp_path / "one" / "config.json").read_text())
    arch = {1: "GemmaForCausalLM", 2: "Gemma2ForCausalLM", 3: "Gemma3ForCausalLM"}[cfg.version]
    assert c["architectures"] == [arch]
    assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["num_attention_heads"],
            c["num_key_value_heads"], c["head_dim"], c["vocab_size"]) == (
        cfg.embed_dim, cfg.hidden_dim, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size)
    assert c["tie_word_embeddings"] is True
    if cfg.version == 2:
        assert (c["sliding_window"], c["attn_logit_softcapping"], c["final_logit_softcapping"],
                c["query_pre_attn_scalar"]) == (4, 50.0, 30.0, 8)
        assert c["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    if cfg.version == 3:
        assert c["rope_parameters"] == {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
        assert c["query_pre_attn_scalar"] == 16 and c["layer_types"][2] == "full_attention"
    # Read back (as arch.checkpoint does): the same model. transformers itself: tests/test_gemma_hf.py.
    back = dataclasses.replace(cfg, **arch_from_hf(c, "config.json"))
    assert model_differences(back, cfg) == []

    # Sharded files + index; the embedding truncated to fewer rows.
    files = W.export_hf(params, cfg, str(tmp_path / "many"), max_shard_bytes=3000, vocab_size=cfg.vocab_size - 2)
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and files[: len(shards)] == shards and sorted(index["weight_map"]) == sorted(want)
    assert all((tmp_path / "many" / s).stat().st_size <= 3000 + 4096 for s in shards)
    assert json.loads((tmp_path / "many" / "config.json").read_text())["vocab_size"] == cfg.vocab_size - 2
    emb = load_file(str(tmp_path / "many" / index["weight_map"]["model.embed_tokens.weight"]))
    assert emb["model.embed_tokens.weight"].shape == (cfg.vocab_size - 2, cfg.embed_dim)
    short = dict(ref)
    short["embedder/input_embedding"] = ref["embedder/input_embedding"].copy()
    short["embedder/input_embedding"][-2:] = 0
    assert_tree(W.load_params(str(tmp_path / "many"), dataclasses.replace(cfg, real_vocab_size=cfg.vocab_size - 2), None),
                short, cfg.param_dtype)

    # write_kaggle -> load
    W.write_kaggle(params, cfg, str(tmp_path / "kaggle"))
    assert_tree(W.load_params(str(tmp_path / "kaggle"), cfg, None), ref, cfg.param_dtype)


def test_export_needs_merged_lora(ckpts, tmp_path):
    cfg, ref, _, _ = ckpts["g2"]
    with_lora = dict(ref)
    with_lora["layers/attn/q_einsum/lora_a"] = np.zeros((cfg.num_layers, 4), np.float32)
    with pytest.raises(W.WeightsError, match="merge"):
        W.export_hf(nest(with_lora), cfg, str(tmp_path / "x"))
    strip = lambda p, c: nest({k: v for k, v in flat(p).items() if "lora" not in k})  # noqa: E731
    W.export_hf(nest(with_lora), cfg, str(tmp_path / "y"), merge=strip)
    assert_tree(W.load_params(str(tmp_path / "y"), cfg, None), ref, cfg.param_dtype)


# ----------------------------------------------------------------------------- 4. gs://
def test_load_from_gcs_emulator(ckpts, tmp_path, monkeypatch):
    from gcs_emulator import start_gcs_emulator

    cfg, ref, _, kaggle = ckpts["g2"]
    sharded = tmp_path / "sharded"
    W.export_hf(nest(ref), cfg, str(sharded), max_shard_bytes=8000)
    monkeypatch.setenv("GEMMA_WEIGHTS_CACHE", str(tmp_path / "cache"))
    with start_gcs_emulator(tmp_path) as emu:
        emu.apply_env()
        emu.create_bucket("weights")
        import gcsfs

        fs = gcsfs.GCSFileSystem()
        fs.put(str(sharded), "weights/g2/hf", recursive=True)
        fs.put(str(kaggle), "weights/g2/kaggle", recursive=True)
        mesh = mesh8()
        # The arch is read from gs:// config.json alone (when the config is validated): nothing copied yet.
        from models.gemma.checkpoint_arch import read_checkpoint_arch

        assert read_checkpoint_arch("gs://weights/g2/hf") == ("hf", arch_from_hf(W.hf_config(cfg), "x"))
        assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.safetensors"))
        got = W.load_params("gs://weights/g2/hf", cfg, shardings(cfg, mesh))
        assert_tree(got, ref, cfg.param_dtype)
        assert len(list((tmp_path / "cache").rglob("*.safetensors"))) > 1
        assert_tree(W.load_params("gs://weights/g2/kaggle", cfg, shardings(cfg, mesh)), ref, cfg.param_dtype)
        with pytest.raises(W.WeightsError, match="gs://weights/nope"):
            W.load_params("gs://weights/nope", cfg, None)


# ----------------------------------------------------------------------------- 5. bad input
def test_unread_orbax_metadata_is_tried_again_then_one_line(ckpts, monkeypatch):
    """A failed metadata read (a storage blip: seen on the GCS emulator under load, where the
    `_METADATA` file's exists() came back false) is read again; when it never comes, one line with
    the storage error, not "no layer tensors"."""
    import orbax.checkpoint as ocp

    cfg, ref, _, kaggle = ckpts["g2"]
    real, calls = ocp.PyTreeCheckpointHandler.metadata, []

    def flaky(self, path, failures):
        calls.append(path)
        if len(calls) <= failures:
            raise FileNotFoundError("Metadata file (named _METADATA) does not exist at the blip")
        return real(self, path)

    monkeypatch.setattr("time.sleep", lambda s: None)
    monkeypatch.setattr(ocp.PyTreeCheckpointHandler, "metadata", lambda self, path: flaky(self, path, 1))
    assert_tree(W.load_params(str(kaggle), cfg, None), ref, cfg.param_dtype)
    assert len(calls) == 2
    calls.clear()
    monkeypatch.setattr(ocp.PyTreeCheckpointHandler, "metadata", lambda self, path: flaky(self, path, 99))
    raises_one_line(W.WeightsError, lambda: W.load_params(str(kaggle), cfg, None), str(kaggle),
                    "Orbax metadata of this checkpoint could not be read", "3 tries",
                    "FileNotFoundError: Metadata file")
    assert len(calls) == W.METADATA_READS


def test_bad_input_one_line_errors(ckpts, tmp_path):
    cfg, ref, hf, kaggle = ckpts["g2"]
    load = W.load_params
    raises_one_line(W.WeightsError, lambda: load(str(tmp_path / "missing"), cfg), str(tmp_path / "missing"), "arch.checkpoint")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "weights.bin").write_bytes(b"x")
    raises_one_line(W.WeightsError, lambda: load(str(tmp_path / "junk"), cfg), "unknown checkpoint layout", "weights.bin")
    raises_one_line(W.WeightsError, lambda: load(str(hf), cfg, fmt="kaggle"), "checkpoint_format")
    # Shapes that do not match the config name the tensor and the config value to change.
    wide = dataclasses.replace(cfg, num_heads=8)
    raises_one_line(W.WeightsError, lambda: load(str(hf), wide), "model.layers.0.self_attn.q_proj.weight", "(64, 32)", "arch.num_heads")
    raises_one_line(W.WeightsError, lambda: load(str(kaggle), dataclasses.replace(cfg, hidden_dim=40)),
                   "transformer/layer_0/mlp/gating_einsum/w", "arch.hidden_dim")
    raises_one_line(W.WeightsError, lambda: load(str(hf), dataclasses.replace(cfg, embed_dim=16)), "model.embed_tokens.weight", "arch.embed_dim")
    # Version / depth mismatches.
    raises_one_line(W.WeightsError, lambda: load(str(hf), dataclasses.replace(cfg, version=1)), "feedforward_layernorm", "Gemma 2")
    raises_one_line(W.WeightsError, lambda: load(str(hf), dataclasses.replace(cfg, version=3)), "self_attn.q_norm", "Gemma 2")
    raises_one_line(W.WeightsError, lambda: load(str(hf), dataclasses.replace(cfg, num_layers=4)), "model.layers.3.", "3 layers")
    raises_one_line(W.WeightsError, lambda: load(str(kaggle), dataclasses.replace(cfg, num_layers=2)), "transformer/layer_2/", "3 layers")
    # A missing tensor.
    tensors = load_file(str(hf))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "partial.safetensors"))
    raises_one_line(W.WeightsError, lambda: load(str(tmp_path / "partial.safetensors"), cfg), "model.layers.1.mlp.up_proj.weight",
                   "partial.safetensors")
    # Sharded HF folder with a shard gone.
    W.export_hf(nest(ref), cfg, str(tmp_path / "sharded"), max_shard_bytes=8000)
    first = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())["weight_map"]
    (tmp_path / "sharded" / first["model.norm.weight"]).unlink()
    raises_one_line(W.WeightsError, lambda: load(str(tmp_path / "sharded"), cfg), first["model.norm.weight"])
    # Kaggle K == H checkpoint with a config that says otherwise.
    cfg1, _, _, kaggle1 = ckpts["g1_mha"]
    raises_one_line(W.WeightsError, lambda: load(str(kaggle1), dataclasses.replace(cfg1, num_kv_heads=2)), "qkv_einsum", "arch.num_kv_heads")
    shutil.rmtree(tmp_path / "junk")
