"""Gemma and Hugging Face transformers, the real consumer: the arch comes from a checkpoint's
config.json (arch.checkpoint, no arch overrides), an override that disagrees or a setting we
cannot express is one error line, the export's config.json loads in transformers 5.x, and tiny
random Gemma 1/2/3 models made by transformers round-trip (load -> same logits and greedy
tokens -> one fine-tuning step -> export -> transformers loads it -> same logits and tokens).
Vocabulary padding is masked to -inf; ids outside the vocabulary are an error, not NaN."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from omegaconf import OmegaConf
from safetensors.numpy import save_file

from helpers import REPO, compose_config, raises_one_line, tree_hash
from models.gemma import Gemma, GemmaConfig, generate
from models.gemma.checkpoint_arch import model_differences
from models.gemma.hf_config import HF_DEFAULTS, arch_from_hf, hf_config
from models.gemma.model import TokenIdError
from models.gemma.task import GemmaTask, build_task
from runtime.errors import EXIT_USER_ERROR, UserError
from runtime.task import DataShape

PRESETS = ["gemma1_2b", "gemma1_7b", "gemma2_2b", "gemma3_1b", "gemma3_4b", "gemma_tiny"]

one_line = functools.partial(raises_one_line, UserError, code=EXIT_USER_ERROR)


def preset(name: str, **changes) -> GemmaConfig:
    d = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "arch" / f"{name}.yaml"))
    d.pop("defaults")
    return GemmaConfig(**(d | changes))


def same_model(a: GemmaConfig, b: GemmaConfig, skip=()) -> list[str]:
    """The checkpoint-determined fields on which a and b mean different models."""
    return [k for k in model_differences(a, b) if k not in skip]


# ------------------------------------------------------------------ config.json, both ways, no weights
def test_hf_defaults_are_transformers_defaults():
    classes = {"gemma": transformers.GemmaConfig, "gemma2": transformers.Gemma2Config,
               "gemma3_text": transformers.Gemma3TextConfig}
    for model_type, cls in classes.items():
        theta = cls.default_theta
        ours = dict(HF_DEFAULTS[model_type])
        assert ours.pop("rope_theta") == (theta["global"] if isinstance(theta, dict) else theta)
        if model_type == "gemma3_text":
            assert ours.pop("rope_local_base_freq") == theta["local"]
            assert ours.pop("sliding_window_pattern") == cls()._sliding_window_pattern
        for key, value in ours.items():
            assert getattr(cls, key) == value, (model_type, key)


@pytest.mark.parametrize("name", PRESETS)
def test_exported_config_loads_in_transformers_and_reads_back(name):
    """Every shipped preset's config.json passes transformers' strict config, and what
    transformers makes of it reads back as the same model."""
    cfg = preset(name)
    written = json.loads(json.dumps(hf_config(cfg)))
    loaded = transformers.AutoConfig.for_model(**written)
    assert type(loaded).__name__ == written["architectures"][0].replace("ForCausalLM", "Config").replace(
        "Gemma3Config", "Gemma3TextConfig")
    assert loaded.vocab_size == cfg.vocab_in_use  # the padding rows are not exported
    back = GemmaConfig(**arch_from_hf(loaded.to_dict(), name))
    assert same_model(back, cfg, skip={"vocab_size"}) == []
    if cfg.version >= 2:
        assert type(written["query_pre_attn_scalar"]) is int and type(written["sliding_window"]) is int


def test_export_refuses_what_transformers_cannot_express():
    g1 = preset("gemma1_2b")
    for change, needle in [({"sliding_window": 8, "global_every": 2}, "sliding-window"),
                           ({"final_logit_softcap": 30.0}, "soft-caps"), ({"query_pre_attn_scalar": 128.0}, "head_dim")]:
        one_line(lambda: hf_config(dataclasses.replace(g1, **change)), "cannot export to Hugging Face", needle)
    g2 = preset("gemma2_2b")
    one_line(lambda: hf_config(dataclasses.replace(g2, rope_base_local=1e6)), "one RoPE")
    one_line(lambda: hf_config(dataclasses.replace(g2, query_pre_attn_scalar=255.5)), "query_pre_attn_scalar")
    one_line(lambda: hf_config(dataclasses.replace(g2, embed_dim=2300)), "multiple of num_attention_heads")


GEMMA2 = {  # config.json files as transformers 4.x saved them on the hub (legacy RoPE keys, no layer_types)
    "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "intermediate_size": 9216, "model_type": "gemma2",
    "num_attention_heads": 8, "num_hidden_layers": 26, "num_key_value_heads": 4, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096, "vocab_size": 256000}
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attn_logit_softcapping": None,
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
    "intermediate_size": 6912, "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26,
    "num_key_value_heads": 1, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "vocab_size": 262144}
GEMMA3_4B = {  # multimodal: a sparse text_config, the rest transformers' defaults
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "vision_config": {"model_type": "siglip_vision_model"}}


def hf_dir(root: Path, name: str, config: dict) -> Path:
    """A folder with config.json and a stand-in safetensors file (the arch is read from the config alone)."""
    d = root / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    save_file({"x": np.zeros(1, np.float32)}, str(d / "model.safetensors"))
    return d


def arch_of(*overrides: str) -> GemmaConfig:
    return compose_config(list(overrides)).arch


def test_hub_configs_give_the_presets(tmp_path):
    g2, g3, g4 = (hf_dir(tmp_path, n, c) for n, c in [("g2", GEMMA2), ("g3", GEMMA3_1B), ("g4", GEMMA3_4B)])
    for path, name, rows in [(g2, "gemma2_2b", 256000), (g3, "gemma3_1b", 262144), (g4, "gemma3_4b", 262208)]:
        derived = arch_of("arch=gemma", f"arch.checkpoint={path}")
        assert derived.vocab_size == rows and derived.real_vocab_size is None
        assert same_model(derived, preset(name), skip={"vocab_size"}) == [], name
    # The preset with its HF checkpoint: every value agrees; its 256128-row table pads HF's 256000.
    padded = arch_of("arch=gemma2_2b", f"arch.checkpoint={g2}", "arch.lora_rank=4", "arch.remat=none")
    assert (padded.vocab_size, padded.real_vocab_size, padded.vocab_in_use, padded.lora_rank) == (256128, 256000, 256000, 4)
    assert arch_of("arch=gemma", f"arch.checkpoint={g2}", "arch.vocab_size=256128").real_vocab_size == 256000
    # An override equal to the checkpoint's value (or meaning the same) is fine.
    same = arch_of("arch=gemma", f"arch.checkpoint={g2}", "arch.num_layers=26", "arch.query_pre_attn_scalar=256")
    assert same.num_layers == 26


def test_overrides_that_disagree_are_one_line(tmp_path):
    g2, g4 = hf_dir(tmp_path, "g2", GEMMA2), hf_dir(tmp_path, "g4", GEMMA3_4B)
    base = ["arch=gemma", f"arch.checkpoint={g2}"]
    for override, needle in [
        ("arch.num_layers=18", "arch.num_layers=18 (checkpoint: 26)"),
        ("arch.sliding_window=1024", "arch.sliding_window=1024 (checkpoint: 4096)"),
        ("arch.global_every=3", "arch.global_every=3 (checkpoint: 2)"),
        ("arch.final_logit_softcap=20", "arch.final_logit_softcap=20.0 (checkpoint: 30.0)"),
        ("arch.attn_logit_softcap=null", None),  # the default: taken from the checkpoint, no error
        ("arch.query_pre_attn_scalar=128", "arch.query_pre_attn_scalar=128.0"),
        ("arch.rope_base_global=1e6", "arch.rope_base_global"),
        ("arch.vocab_size=255000", "arch.vocab_size=255000 (checkpoint: 256000)"),
        ("arch.version=3", "arch.version=3 (checkpoint: 2)"),
    ]:
        if needle is None:
            assert arch_of(*base, override).attn_logit_softcap == 50.0
            continue
        msg = one_line(lambda: arch_of(*base, override), f"arch.checkpoint={g2} disagrees with", needle,
                       "drop these overrides")
        assert msg.count("(checkpoint:") == 1, msg
    # A head split with the same product names both fields.
    one_line(lambda: arch_of(*base, "arch.num_heads=16", "arch.head_dim=128"), "arch.num_heads=16 (checkpoint: 8)",
             "arch.head_dim=128 (checkpoint: 256)")
    one_line(lambda: arch_of(*base, "arch.vocab_size=256128", "arch.real_vocab_size=256100"), "arch.real_vocab_size=256100")
    # The wrong preset: every field that differs, in one line.
    msg = one_line(lambda: arch_of("arch=gemma3_1b", f"arch.checkpoint={g2}"), "arch.version=3 (checkpoint: 2)",
                   "arch.embed_dim=1152 (checkpoint: 2304)")
    assert "arch.hidden_dim" in msg and "arch.sliding_window=512" in msg
    one_line(lambda: arch_of("arch=gemma3_4b", f"arch.checkpoint={g4}"), "arch.vocab_size=262144 (checkpoint: 262208)")
    one_line(lambda: arch_of("arch=gemma", f"arch.checkpoint={tmp_path / 'nope'}"), "no such file or folder")
    (tmp_path / "bare").mkdir()
    save_file({"x": np.zeros(1, np.float32)}, str(tmp_path / "bare" / "model.safetensors"))
    one_line(lambda: arch_of("arch=gemma", f"arch.checkpoint={tmp_path / 'bare'}"), "config.json: not found")


@pytest.mark.parametrize("change,needle", [
    # Settings of a Gemma the model cannot express: "cannot express ..." and the setting.
    ({"rms_norm_eps": 1e-5}, "rms_norm_eps=1e-05"),
    ({"tie_word_embeddings": False}, "untied output"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, "linear RoPE scaling on sliding-window layers"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"layer_types": ["full_attention", "sliding_attention", "sliding_attention"], "num_hidden_layers": 3},
     "not every p-th layer global"),
    ({"use_bidirectional_attention": True}, "embedding model"),
])
def test_unsupported_settings_are_refused_in_one_line(change, needle):
    one_line(lambda: arch_from_hf(GEMMA2 | change, "ckpt/config.json"), "ckpt/config.json", "cannot express", needle)


def test_another_model_type_is_refused_in_one_line():
    one_line(lambda: arch_from_hf(GEMMA2 | {"model_type": "gemma3n"}, "ckpt/config.json"), "ckpt/config.json",
             "model_type='gemma3n' is not a Gemma 1/2/3 text model", "point arch.checkpoint at a Gemma checkpoint")


def test_kaggle_checkpoint_gives_its_shapes(tmp_path):
    from models.gemma.model import init_params
    from models.gemma.weights import write_kaggle

    cfg = preset("gemma_tiny")
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    params = jax.tree.map(lambda x: np.zeros(x.value.shape, np.float32), shapes,
                          is_leaf=lambda x: hasattr(x, "value"))
    write_kaggle(params, cfg, str(tmp_path / "k"))
    path = f"arch.checkpoint={tmp_path / 'k'}"
    got = arch_of("arch=gemma_tiny", path, "arch.vocab_size=640")
    assert (got.num_layers, got.vocab_size, got.real_vocab_size) == (2, 640, 512)
    one_line(lambda: arch_of("arch=gemma_tiny", path, "arch.num_kv_heads=4"), "arch.num_kv_heads=4 (checkpoint: 1)",
             "tensor shapes")
    one_line(lambda: arch_of("arch=gemma", path), "records no sliding window", "arch=gemma2_2b")


# ------------------------------------------------------------------ vocabulary padding and token ids
PADDED = GemmaConfig(version=2, num_layers=1, embed_dim=32, hidden_dim=64, num_heads=4, num_kv_heads=2, head_dim=8,
                     vocab_size=64, real_vocab_size=40, final_logit_softcap=30.0, dtype="float32", remat="none")


def random_params(cfg, seed=0, zero_from=None):
    from models.gemma.model import init_params

    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    params = jax.tree.map(lambda x: jnp.asarray(0.3 * rng.standard_normal(x.value.shape), jnp.float32), shapes,
                          is_leaf=lambda x: hasattr(x, "value"))
    if zero_from is not None:  # padding rows are zero, as loaded from a smaller table
        emb = params["embedder"]["input_embedding"]
        params["embedder"]["input_embedding"] = emb.at[zero_from:].set(0.0)
    return params


def test_padded_rows_are_masked_in_logits_loss_and_sampling():
    unpadded = dataclasses.replace(PADDED, vocab_size=40, real_vocab_size=None)
    params = random_params(PADDED, zero_from=40)
    small = {**params, "embedder": {"input_embedding": params["embedder"]["input_embedding"][:40]}}
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 40, (2, 12)), jnp.int32)
    batch = {"inputs": tokens, "labels": jnp.roll(tokens, -1, axis=1)}

    def run(cfg, p):  # logits and the (chunked) loss sum
        return jax.jit(lambda p: (Gemma(cfg).apply({"params": p}, tokens),
                                  GemmaTask(cfg).eval_sums(p, batch)["loss_sum"]))(p)

    logits, loss = run(PADDED, params)
    want_logits, want_loss = run(unpadded, small)
    assert bool(jnp.all(logits[..., 40:] == -jnp.inf))
    np.testing.assert_allclose(logits[..., :40], want_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    # Unmasked, the zero rows (logit 0) would take this much of the mass at temperature 3:
    padded_mass = jax.nn.softmax(jnp.where(jnp.isinf(logits), 0.0, logits) / 3.0)[..., 40:].sum(-1)
    assert float(padded_mass.min()) > 0.1
    out = jax.jit(lambda p, t: generate(p, PADDED, t, jnp.full((8,), 3), max_new_tokens=16, temperature=3.0,
                                        rng=jax.random.key(0), stop_ids=(-1,)))(params, jnp.tile(tokens[:1, :3], (8, 1)))
    assert np.asarray(out).max() < 40 and len(np.unique(np.asarray(out))) > 10  # sampled widely, never a padding id


def test_padding_is_dropped_on_export_and_added_back_with_a_note(tmp_path, caplog):
    from models.gemma.weights import export_hf, load_params

    params = random_params(PADDED, zero_from=40)
    export_hf(params, PADDED, str(tmp_path / "hf"), dtype="float32")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 40
    cfg = arch_of("arch=gemma", f"arch.checkpoint={tmp_path / 'hf'}", "arch.vocab_size=64")
    assert (cfg.vocab_size, cfg.real_vocab_size) == (64, 40)
    with caplog.at_level("INFO", logger="models.gemma.weights"):
        loaded = load_params(str(tmp_path / "hf"), cfg)
    notes = [r.getMessage() for r in caplog.records if "padding" in r.getMessage()]
    assert len(notes) == 1 and "24 zero rows" in notes[0] and "-inf" in notes[0], notes
    np.testing.assert_array_equal(loaded["embedder"]["input_embedding"], params["embedder"]["input_embedding"])


def test_token_ids_out_of_range_are_an_error_not_nan():
    params = random_params(PADDED)
    for bad in (40, 64, 1000, -1):  # padding rows, past the table, negative
        tokens = jnp.asarray([[1, 2, bad]], jnp.int32)
        one_line(lambda: Gemma(PADDED).apply({"params": params}, tokens), f"hold id {bad}", "[0, 40)")
        one_line(lambda: generate(params, PADDED, tokens, jnp.asarray([3]), max_new_tokens=2), "prompt_tokens")
    with pytest.raises(TokenIdError):
        Gemma(PADDED).apply({"params": params}, np.asarray([[64]]))
    one_line(lambda: build_task(PADDED, DataShape(examples=1, vocab_size=50, seq_len=8)), "arch.real_vocab_size")
    build_task(PADDED, DataShape(examples=1, vocab_size=40, seq_len=8))


def test_a_padded_preset_plans_without_its_dataset(tmp_path):
    """compile_only plans an unbuilt SFT set with the ids the model uses, not its padded table."""
    from runtime.registry import dataset_kind

    config = compose_config(["+experiment=gemma_sft/gemma2b_full_v5e8", f"data.path={tmp_path / 'none'}"])
    shape = dataset_kind("sft").planned_shape(config.data, config)
    assert shape.vocab_size == config.arch.real_vocab_size == 256000
    build_task(config.arch, shape)


# ------------------------------------------------------------------ round trip through transformers
HF_TINY = {  # small enough for CPU, windows shorter than the sequence so local layers really mask
    1: ("GemmaConfig", dict(num_hidden_layers=2, num_key_value_heads=1)),
    2: ("Gemma2Config", dict(num_hidden_layers=3, num_key_value_heads=2, sliding_window=4, query_pre_attn_scalar=12,
                             attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    3: ("Gemma3TextConfig", dict(num_hidden_layers=4, num_key_value_heads=2, sliding_window=4, query_pre_attn_scalar=16,
                                 layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                              "sliding_attention"],
                                 rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                     "rope_theta": 1e6},
                                                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
}
SEQ = 16


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """version -> (folder, model): tiny random Gemmas saved by transformers (safetensors)."""
    import torch

    torch.manual_seed(0)
    out = {}
    for version, (cls, sizes) in HF_TINY.items():
        config = getattr(transformers, cls)(vocab_size=300, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                            head_dim=8, **sizes)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
        with torch.no_grad():
            for name, p in model.named_parameters():  # norms too (they start at zero), so every mapping matters;
                # a small embedding keeps greedy decoding from repeating the input token
                p.copy_(torch.randn_like(p) * (0.5 if "norm" in name else 0.05 if "embed" in name else 0.3))
        path = tmp_path_factory.mktemp(f"hf_gemma{version}")
        model.save_pretrained(path, safe_serialization=True)
        out[version] = (path, model)
    return out


def hf_logits(model, tokens) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


def hf_greedy(model, prompt, new: int) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor(np.asarray(prompt), dtype=torch.long), max_new_tokens=new,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[:, prompt.shape[1]:].numpy()


def jitted(cfg, new: int):
    """(forward, greedy generation) for cfg, compiled once for before and after the step."""
    def greedy(p, prompt):
        lengths = jnp.full((prompt.shape[0],), prompt.shape[1], jnp.int32)
        return generate(p, cfg, prompt, lengths, max_new_tokens=new, stop_ids=(-1,))

    return jax.jit(lambda p, t: Gemma(cfg).apply({"params": p}, t)), jax.jit(greedy)


def assert_matches_hf(params, fns, model, tokens, new=8) -> np.ndarray:
    forward, greedy = fns
    ours, theirs = np.asarray(forward(params, tokens)), hf_logits(model, tokens)
    assert ours.shape == theirs.shape
    assert np.abs(ours - theirs).max() < 1e-4, np.abs(ours - theirs).max()
    prompt = tokens[:, :6]
    tokens_out = np.asarray(greedy(params, prompt))
    np.testing.assert_array_equal(tokens_out, hf_greedy(model, prompt, new))
    assert min(len(set(row)) for row in tokens_out.tolist()) >= 2  # not one token repeated: the cache matters
    return ours


@pytest.mark.slow
@pytest.mark.parametrize("version", [1, 2, 3])
def test_hf_round_trip(hf_models, tmp_path, version):
    from models.gemma.weights import load_params

    path, model = hf_models[version]
    # No arch sizes given: only how to run it (fp32, no remat: less to compile on CPU).
    cfg = arch_of("arch=gemma", f"arch.checkpoint={path}", "arch.dtype=float32", "arch.remat=none")
    assert cfg.version == version and cfg.vocab_size == 300
    params = load_params(str(path), cfg)
    tokens = jnp.asarray(np.random.default_rng(version).integers(0, 300, (2, SEQ)), jnp.int32)
    fns = jitted(cfg, 8)
    before = assert_matches_hf(params, fns, model, tokens)

    # One fine-tuning step (plain SGD on the task's loss), then the export transformers must load.
    task = GemmaTask(cfg)
    batch = {"inputs": tokens, "labels": jnp.roll(tokens, -1, axis=1)}
    grads = jax.jit(jax.grad(lambda p: task.train_loss(p, None, batch, None)[0]))(params)
    tuned = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
    task.export(tuned, str(tmp_path / "out"), dtype="float32")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype="float32",
                                                                 attn_implementation="eager").eval()
    assert type(exported) is type(model)
    after = assert_matches_hf(tuned, fns, exported, tokens)
    assert np.abs(after - before).max() > 1e-3  # the step changed the model, so the export carries it


# ------------------------------------------------------------------ config.json read as strictly as transformers
@pytest.mark.parametrize("change,needle,transformers_refuses", [
    ({"num_hidden_layers": 4.7}, "num_hidden_layers=4.7 is not an integer", True),
    ({"num_hidden_layers": 4.0}, "num_hidden_layers=4.0 is not an integer", True),
    ({"sliding_window": "8"}, "sliding_window='8' is not an integer or null", True),
    ({"head_dim": 256.0}, "head_dim=256.0 is not an integer", True),
    ({"query_pre_attn_scalar": 256.0}, "query_pre_attn_scalar=256.0 is not an integer", True),
    ({"rms_norm_eps": "1e-6"}, "rms_norm_eps='1e-6' is not a number", True),
    ({"final_logit_softcapping": "30"}, "final_logit_softcapping='30' is not a number or null", True),
    ({"rope_theta": "abc"}, "rope_theta='abc' is not a number", False),  # transformers loads it: we are stricter
])
def test_config_json_is_read_as_strictly_as_transformers(change, needle, transformers_refuses):
    config = GEMMA2 | change
    one_line(lambda: arch_from_hf(config, "ckpt/config.json"), "ckpt/config.json", needle)
    if transformers_refuses:
        with pytest.raises(Exception):
            transformers.AutoConfig.for_model(**config)
    else:  # transformers takes it as it is: we are stricter, not wrong
        transformers.AutoConfig.for_model(**config)


def with_files(src: Path, dst: Path, config_changes: dict | None = None, tensors: dict | None = None) -> Path:
    """A copy of the checkpoint folder `src` with its config.json changed and tensors added (or replaced)."""
    import shutil

    from safetensors.torch import load_file, save_file as save_torch

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text()) | (config_changes or {})
    (dst / "config.json").write_text(json.dumps(config))
    if tensors:
        save_torch(load_file(str(dst / "model.safetensors")) | tensors, str(dst / "model.safetensors"),
                   metadata={"format": "pt"})
    return dst


def forward(cfg: GemmaConfig):
    return jax.jit(lambda p, t: Gemma(cfg).apply({"params": p}, t))


TOKENS = np.random.default_rng(5).integers(0, 300, (2, SEQ)).astype(np.int32)


def test_a_vocab_size_beyond_the_table_is_refused_or_padded_for_real(hf_models, tmp_path):
    """config.json's vocab_size above the embedding's rows: transformers refuses the folder, and so
    does the config (one line, before anything is built); arch.vocab_size pads it instead, with
    rows that are masked for real: logits equal transformers' on the real ids, -inf beyond."""
    from models.gemma.weights import load_params

    path, model = hf_models[2]
    wide = with_files(path, tmp_path / "wide", {"vocab_size": 400})
    before = tree_hash(wide)
    one_line(lambda: arch_of("arch=gemma", f"arch.checkpoint={wide}"), "vocab_size=400 but model.embed_tokens.weight "
             "has 300 rows", "set vocab_size to 300 in config.json", "arch.vocab_size=400")
    assert tree_hash(wide) == before  # the refused folder is left as it was
    with pytest.raises(Exception, match="size mismatch|mismatched sizes|ignore_mismatched_sizes"):
        transformers.AutoModelForCausalLM.from_pretrained(wide)
    cfg = arch_of("arch=gemma", f"arch.checkpoint={path}", "arch.vocab_size=320", "arch.dtype=float32",
                  "arch.remat=none")
    assert (cfg.vocab_size, cfg.real_vocab_size) == (320, 300)
    logits = np.asarray(forward(cfg)(load_params(str(path), cfg), TOKENS))
    assert np.abs(logits[..., :300] - hf_logits(model, TOKENS)).max() < 1e-5
    assert np.all(logits[..., 300:] == -np.inf)
    # Asked for directly, zero rows the model would use unmasked are refused.
    one_line(lambda: load_params(str(path), dataclasses.replace(cfg, real_vocab_size=None)),
             "the embedding has 300 rows but the model uses 320 ids", "arch.real_vocab_size=300")


def test_an_untied_lm_head_is_refused_and_a_tied_copy_loads(hf_models, tmp_path):
    import torch

    from models.gemma.weights import load_params

    path, model = hf_models[2]
    embedding = model.model.embed_tokens.weight.detach().clone()
    untied = with_files(path, tmp_path / "untied", tensors={"lm_head.weight": torch.randn_like(embedding)})
    before = tree_hash(untied)
    one_line(lambda: arch_of("arch=gemma", f"arch.checkpoint={untied}"), "lm_head.weight that differs from "
             "model.embed_tokens.weight", "transformers uses even with tie_word_embeddings=true")
    assert tree_hash(untied) == before
    theirs = transformers.AutoModelForCausalLM.from_pretrained(untied, attn_implementation="eager")  # why: it uses it
    assert not torch.equal(theirs.lm_head.weight, theirs.model.embed_tokens.weight)

    tied = with_files(path, tmp_path / "tied", tensors={"lm_head.weight": embedding})
    cfg = arch_of("arch=gemma", f"arch.checkpoint={tied}", "arch.dtype=float32", "arch.remat=none")
    ours = np.asarray(forward(cfg)(load_params(str(tied), cfg), TOKENS))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tied, attn_implementation="eager").eval()
    assert np.abs(ours - hf_logits(theirs, TOKENS)).max() < 1e-5


def test_gemma3_has_no_attention_softcap(hf_models, tmp_path, caplog):
    """As in the reference Gemma 3 and transformers: attn_logit_softcapping in a Gemma 3 config.json
    is ignored (one warning line), the logits equal transformers'; asked for as an override, refused."""
    from models.gemma.weights import load_params

    path, _ = hf_models[3]
    capped = with_files(path, tmp_path / "capped", {"attn_logit_softcapping": 0.5})
    with caplog.at_level("WARNING", logger="models.gemma.hf_config"):
        cfg = arch_of("arch=gemma", f"arch.checkpoint={capped}", "arch.dtype=float32", "arch.remat=none")
    assert cfg.attn_logit_softcap is None
    warned = [r.getMessage() for r in caplog.records if "attn_logit_softcapping" in r.getMessage()]
    assert len(warned) == 1 and "is ignored: Gemma 3 has no attention soft-cap" in warned[0], warned
    theirs = transformers.AutoModelForCausalLM.from_pretrained(capped, attn_implementation="eager").eval()
    ours = np.asarray(forward(cfg)(load_params(str(capped), cfg), TOKENS))
    assert np.abs(ours - hf_logits(theirs, TOKENS)).max() < 1e-5
    one_line(lambda: arch_of("arch=gemma3_1b", "arch.attn_logit_softcap=50"),
             "arch.attn_logit_softcap=50.0 with arch.version=3", "arch.attn_logit_softcap=null")


def test_a_shape_error_names_config_json_when_it_is_what_is_wrong(hf_models, tmp_path):
    """The arch comes from config.json: an override that disagrees is refused, so the hint must
    name config.json, not an override."""
    from models.gemma.weights import load_params

    path, _ = hf_models[2]
    wrong = with_files(path, tmp_path / "wrong", {"num_attention_heads": 2})
    cfg = arch_of("arch=gemma", f"arch.checkpoint={wrong}")
    before = tree_hash(wrong)
    msg = one_line(lambda: load_params(str(wrong), cfg), "self_attn.q_proj.weight", "its config.json says",
                   "num_attention_heads=2, which its tensors contradict", "correct config.json")
    assert tree_hash(wrong) == before
    assert "set arch." not in msg
    with pytest.raises(Exception, match="size mismatch|mismatched sizes|ignore_mismatched_sizes"):
        transformers.AutoModelForCausalLM.from_pretrained(wrong)  # transformers refuses the folder too


def test_export_carries_positions_token_ids_and_generation_config(hf_models, tmp_path):
    """max_position_embeddings from the checkpoint's config.json, the special ids and stop ids
    from the tokenizer (generation_config.json), and transformers loads it to the same logits."""
    from data_pipeline.tokenizer import Tokenizer, train_tokenizer
    from models.gemma.weights import load_params

    path, _ = hf_models[2]
    short = with_files(path, tmp_path / "short", {"max_position_embeddings": 256})
    cfg = arch_of("arch=gemma", f"arch.checkpoint={short}", "arch.dtype=float32", "arch.remat=none")
    assert cfg.max_position_embeddings == 256
    params = load_params(str(short), cfg)
    vocab = train_tokenizer([f"user {i} + {i} = {2 * i}" for i in range(200)], tmp_path / "tok.model", 300)
    tokenizer = Tokenizer(vocab)
    GemmaTask(cfg).export(params, str(tmp_path / "out"), dtype="float32", tokenizer=vocab)
    config = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert (config.max_position_embeddings, config.pad_token_id, config.eos_token_id, config.bos_token_id) == (
        256, tokenizer.pad_id, tokenizer.eos_id, tokenizer.bos_id)
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "out")
    assert generation.eos_token_id == [tokenizer.eos_id, tokenizer.end_of_turn_id]
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert np.abs(np.asarray(forward(cfg)(params, TOKENS)) - hf_logits(exported, TOKENS)).max() < 1e-5
