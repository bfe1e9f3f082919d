"""Reference-checkpoint import: a random PyTorch-layout state_dict, converted, must give the
same logits/Q as a forward written here directly from the reference formulas (float64 torch
on the state_dict tensors), for TRM (attention + rope, attention + learned, mlp_t) and HRM.
The checkpoints come as the reference's run folder (step_<N> files and all_config.yaml with
the reference's own arch keys), converted by one command with no overrides; a state_dict that
contradicts its config, or an override that contradicts the saved config, is one error line.

Needs torch (the CPU wheel, torch==2.13.0, a test dependency): without it this file fails.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import yaml

F = torch.nn.functional

from models.recursive_reasoning import HRMConfig, TRMConfig  # noqa: E402
from models.recursive_reasoning import import_reference as imp  # noqa: E402
from runtime.errors import UserError  # noqa: E402

VOCAB, SEQ, PUZZLES, B = 7, 9, 5, 3
PFX = "_orig_mod.model.inner."  # what the reference's compiled ACTLossHead(model).state_dict() writes

CASES = {
    # name: (model, our overrides, reference arch)
    "trm_attn_rope": ("trm", dict(hidden=32, heads=4, expansion=2.0, L_layers=2, H_cycles=2, L_cycles=2, puzzle_emb_ndim=40,
                                  puzzle_emb_len=2, pos_encodings="rope", mlp_t=False)),
    "trm_attn_learned": ("trm", dict(hidden=32, heads=2, expansion=4.0, L_layers=1, H_cycles=3, L_cycles=2,
                                     puzzle_emb_ndim=32, puzzle_emb_len=0, pos_encodings="learned", mlp_t=False)),
    "trm_mlp_t": ("trm", dict(hidden=32, heads=4, expansion=2.0, L_layers=2, H_cycles=2, L_cycles=3, puzzle_emb_ndim=32,
                              puzzle_emb_len=2, pos_encodings="none", mlp_t=True)),
    "hrm": ("hrm", dict(hidden=32, heads=4, expansion=2.0, H_layers=2, L_layers=1, H_cycles=2, L_cycles=2,
                        puzzle_emb_ndim=32, pos_encodings="rope")),
}


def _width(dim, expansion):  # the reference's _find_multiple(round(e * d * 2/3), 256)
    return -(round(expansion * dim * 2 / 3) // -256) * 256


def _prefix(model, a):
    if model == "trm" and a["puzzle_emb_len"] > 0:
        return a["puzzle_emb_len"]
    return -(a["puzzle_emb_ndim"] // -a["hidden"])


def make_state_dict(model: str, a: dict, seed: int = 0, rotary: bool = False) -> dict:
    """Random tensors under the reference's exact key names and [out, in] layouts."""
    g = torch.Generator().manual_seed(seed)
    d, heads = a["hidden"], a["heads"]
    dh = d // heads
    total = SEQ + _prefix(model, a)

    def w(out_f, in_f):  # CastedLinear.weight [out, in], LeCun-ish scale
        return torch.randn(out_f, in_f, generator=g) / math.sqrt(in_f)

    sd = {"embed_tokens.embedding_weight": torch.randn(VOCAB, d, generator=g) / math.sqrt(d),
          "lm_head.weight": w(VOCAB, d),
          "q_head.weight": w(2, d),  # random (not the reference's zero init) so the Q path is tested
          "q_head.bias": torch.randn(2, generator=g),
          "puzzle_emb.weights": 0.5 * torch.randn(PUZZLES, a["puzzle_emb_ndim"], generator=g),
          # persistent buffers in the forward dtype (bfloat16 in the reference's runs)
          "H_init": torch.randn(d, generator=g).to(torch.bfloat16),
          "L_init": torch.randn(d, generator=g).to(torch.bfloat16)}
    if a["pos_encodings"] == "learned":
        sd["embed_pos.embedding_weight"] = torch.randn(total, d, generator=g) / math.sqrt(d)
    if rotary and a["pos_encodings"] == "rope":  # non-persistent in the reference; accepted if present
        cos, sin = _rope(total, dh, torch.float32)
        sd["rotary_emb.cos_cached"], sd["rotary_emb.sin_cached"] = cos, sin
    levels = [("L", a["L_layers"])] + ([("H", a["H_layers"])] if model == "hrm" else [])
    for lvl, n in levels:
        for i in range(n):
            pre = f"{lvl}_level.layers.{i}."
            if a.get("mlp_t"):
                it = _width(total, a["expansion"])
                sd[pre + "mlp_t.gate_up_proj.weight"] = w(2 * it, total)
                sd[pre + "mlp_t.down_proj.weight"] = w(total, it)
            else:
                sd[pre + "self_attn.qkv_proj.weight"] = w(3 * heads * dh, d)
                sd[pre + "self_attn.o_proj.weight"] = w(d, heads * dh)
            inter = _width(d, a["expansion"])
            sd[pre + "mlp.gate_up_proj.weight"] = w(2 * inter, d)
            sd[pre + "mlp.down_proj.weight"] = w(d, inter)
    return {PFX + k: v for k, v in sd.items()}


# ------------------------------------------------------------ independent reference forward


def _rope(length, dim, dtype, base=10000.0):
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    ang = torch.outer(torch.arange(length, dtype=torch.float64), inv)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def reference_forward(sd: dict, model: str, a: dict, inputs: np.ndarray, pids: np.ndarray):
    """One inner step from (H_init, L_init), float64, straight from the reference's formulas."""
    P = {k[len(PFX):]: v.to(torch.float64) for k, v in sd.items()}
    d, heads = a["hidden"], a["heads"]
    dh = d // heads
    pl = _prefix(model, a)
    inputs, pids = torch.as_tensor(inputs, dtype=torch.long), torch.as_tensor(pids, dtype=torch.long)
    b = inputs.shape[0]

    emb = P["embed_tokens.embedding_weight"][inputs]
    pe = P["puzzle_emb.weights"][pids]
    pe = F.pad(pe, (0, pl * d - pe.shape[-1]))
    x = torch.cat([pe.view(b, pl, d), emb], dim=1)
    if a["pos_encodings"] == "learned":
        x = 0.707106781 * (x + P["embed_pos.embedding_weight"])
    x = math.sqrt(d) * x
    cos, sin = _rope(x.shape[1], dh, torch.float64)

    def rms(h):
        return h * torch.rsqrt(h.square().mean(-1, keepdim=True) + 1e-5)

    def lin(h, name):
        return h @ P[name].T

    def swiglu(h, pre):
        gate, up = lin(h, pre + "gate_up_proj.weight").chunk(2, dim=-1)
        return lin(F.silu(gate) * up, pre + "down_proj.weight")

    def rot(t):
        h1, h2 = t[..., : dh // 2], t[..., dh // 2:]
        return torch.cat([-h2, h1], dim=-1)

    def attn(h, pre):
        s = h.shape[1]
        qkv = lin(h, pre + "qkv_proj.weight").view(b, s, 3 * heads, dh)
        q, k, v = qkv[:, :, :heads], qkv[:, :, heads:2 * heads], qkv[:, :, 2 * heads:]
        if a["pos_encodings"] == "rope":
            c, sn = cos[:, None, :], sin[:, None, :]
            q, k = q * c + rot(q) * sn, k * c + rot(k) * sn
        scores = torch.einsum("bqhd,bshd->bhqs", q, k) / math.sqrt(dh)
        o = torch.einsum("bhqs,bshd->bqhd", scores.softmax(-1), v)
        return lin(o.reshape(b, s, heads * dh), pre + "o_proj.weight")

    def block(h, pre):
        if a.get("mlp_t"):
            ht = h.transpose(1, 2)
            h = rms(ht + swiglu(ht, pre + "mlp_t.")).transpose(1, 2)
        else:
            h = rms(h + attn(h, pre + "self_attn."))
        return rms(h + swiglu(h, pre + "mlp."))

    def level(lvl, n, h, inj):
        h = h + inj
        for i in range(n):
            h = block(h, f"{lvl}_level.layers.{i}.")
        return h

    shape = (b, x.shape[1], d)
    z_H, z_L = P["H_init"].expand(shape), P["L_init"].expand(shape)
    if model == "trm":
        for _ in range(a["H_cycles"]):
            for _ in range(a["L_cycles"]):
                z_L = level("L", a["L_layers"], z_L, z_H + x)
            z_H = level("L", a["L_layers"], z_H, z_L)
    else:  # HRM: the one-step-gradient split does not change values
        for _ in range(a["H_cycles"]):
            for _ in range(a["L_cycles"]):
                z_L = level("L", a["L_layers"], z_L, z_H + x)
            z_H = level("H", a["H_layers"], z_H, z_L)
    logits = lin(z_H, "lm_head.weight")[:, pl:]
    q = z_H[:, 0] @ P["q_head.weight"].T + P["q_head.bias"]
    return logits.numpy(), q[:, 0].numpy(), q[:, 1].numpy()


# ------------------------------------------------------------ a reference run folder

NAMES = {"trm": "recursive_reasoning.trm@TinyRecursiveReasoningModel_ACTV1",
         "hrm": "recursive_reasoning.hrm@HierarchicalReasoningModel_ACTV1"}
RUN = "checkpoints/Toy-ACT-torch/TinyRecursiveReasoningModel_ACTV1 brave-owl"  # the reference's naming


def reference_arch(model: str, a: dict) -> dict:
    """The arch: section the reference writes for these settings, in its own keys: its
    config/arch yaml (TRM's unused H_layers, HRM's mlp_t, name, loss, ${.hidden_size})."""
    e = a["expansion"]
    arch = {"name": NAMES[model], "loss": {"name": "losses@ACTLossHead", "loss_type": "stablemax_cross_entropy"},
            "halt_exploration_prob": 0.1, "halt_max_steps": 16, "H_cycles": a["H_cycles"], "L_cycles": a["L_cycles"],
            "H_layers": a.get("H_layers", 0), "L_layers": a["L_layers"], "hidden_size": a["hidden"],
            "num_heads": a["heads"], "expansion": int(e) if e == int(e) else e,
            "puzzle_emb_ndim": "${.hidden_size}" if a["puzzle_emb_ndim"] == a["hidden"] else a["puzzle_emb_ndim"],
            "pos_encodings": a["pos_encodings"], "forward_dtype": "bfloat16", "mlp_t": a.get("mlp_t", False)}
    if model == "trm":
        arch.update(puzzle_emb_len=a["puzzle_emb_len"], no_ACT_continue=True)
    return arch


def write_reference_run(root, model: str, a: dict, sd: dict, arch: dict | None = None, dataset: bool = True):
    """<root>/<RUN>/ with all_config.yaml and step_2 (another draw) and step_10 (`sd`), and the
    run's data path <root>/data/toy with its train/dataset.json, as the reference leaves them."""
    run = root / RUN
    run.mkdir(parents=True)
    config = {"arch": arch or reference_arch(model, a), "data_paths": ["data/toy"], "data_paths_test": [],
              "evaluators": [], "global_batch_size": 768, "epochs": 50000, "lr": 1e-4, "lr_min_ratio": 1.0,
              "lr_warmup_steps": 2000, "weight_decay": 1.0, "beta1": 0.9, "beta2": 0.95, "puzzle_emb_lr": 1e-4,
              "puzzle_emb_weight_decay": 1.0, "project_name": "Toy-ACT-torch", "run_name": RUN.split("/")[-1],
              "load_checkpoint": None, "checkpoint_path": RUN, "seed": 0, "ema": True, "ema_rate": 0.999}
    (run / "all_config.yaml").write_text(yaml.dump(config))
    torch.save(make_state_dict(model, a, seed=7), run / "step_2")
    torch.save(sd, run / "step_10")
    if dataset:
        (root / "data/toy/train").mkdir(parents=True)
        (root / "data/toy/train/dataset.json").write_text(json.dumps(
            {"seq_len": SEQ, "vocab_size": VOCAB, "num_puzzle_identifiers": PUZZLES, "pad_id": 0}))
    return run


def _cli_error(capsys, argv) -> str:
    assert imp.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


# ------------------------------------------------------------ tests


@pytest.mark.parametrize("case", list(CASES))
def test_import_matches_reference_forward(case, tmp_path):
    """One command on the reference's run folder, no overrides: the latest step, the arch from
    all_config.yaml, the sizes from the state_dict (rope tables, learned positions, mlp_t
    shapes) or from the run's dataset.json (HRM: nothing in its state_dict shows seq_len)."""
    model_name, a = CASES[case]
    sd = make_state_dict(model_name, a, rotary=case == "trm_attn_rope")
    run = write_reference_run(tmp_path, model_name, a, sd)
    out = tmp_path / "imported"
    assert imp.main(["--checkpoint-dir", str(run), "--out", str(out)]) == 0

    params, init_states, meta = imp.load_imported(str(out))
    assert (meta["model"], meta["step"], meta["seq_len"], meta["vocab_size"]) == (model_name, 10, SEQ, VOCAB)
    assert meta["arch"]["forward_dtype"] == "bfloat16" and meta["init_states_equal_ours"] is False
    cfg = {"trm": TRMConfig, "hrm": HRMConfig}[model_name](**{**meta["arch"], "forward_dtype": "float32"})
    model = imp.build_model(model_name, cfg, VOCAB, SEQ, PUZZLES, init_states)
    # the restored tree is exactly the shape tree our init produces
    flat = {"/".join(k.key for k in path): tuple(v.shape) for path, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    assert flat == imp.expected_params(model)

    batch = {k: jnp.asarray(v) for k, v in _batch().items()}
    _, logits, q_halt, q_cont = jax.jit(lambda p, bt: model.apply({"params": p}, bt))(params, batch)
    ref_logits, ref_qh, ref_qc = reference_forward(sd, model_name, a, batch["inputs"], batch["puzzle_identifiers"])
    assert logits.shape == ref_logits.shape == (B, SEQ, VOCAB)
    # ours float32 vs float64 through up to 16 block calls; logits are O(3): ~1e-5 relative
    np.testing.assert_allclose(np.asarray(logits), ref_logits, rtol=1e-5, atol=3e-5)
    np.testing.assert_allclose(np.asarray(q_halt), ref_qh, rtol=1e-5, atol=3e-5)
    np.testing.assert_allclose(np.asarray(q_cont), ref_qc, rtol=1e-5, atol=3e-5)
    # the reference's H_init/L_init matter: our fixed ones give other logits
    _, ours_init_logits, _, _ = model.clone(init_states=None).apply({"params": params}, batch)
    assert np.abs(np.asarray(ours_init_logits) - ref_logits).max() > 0.1


def test_function_form_model_starts_from_imported_states_and_overrides_build_it(tmp_path):
    from helpers import compose_config

    a = CASES["trm_mlp_t"][1]
    sd = make_state_dict("trm", a)
    run = write_reference_run(tmp_path, "trm", a, sd, dataset=False)  # seq_len from the mlp_t shapes
    model, params, states, info = imp.import_reference(checkpoint_dir=str(run))
    h_init = sd[PFX + "H_init"].float().numpy()
    np.testing.assert_array_equal(states["H_init"], h_init)
    carry = model.initial_carry(2)  # what act_step's reset and act_evaluate use
    assert carry.z_H.dtype == jnp.bfloat16  # the run's forward dtype; its bf16 vectors are exact in it
    np.testing.assert_array_equal(np.asarray(carry.z_H[1, 3], np.float32), h_init)
    np.testing.assert_array_equal(np.asarray(model.reset_carry(jnp.array([True]), carry).z_L[0, 0], np.float32),
                                  sd[PFX + "L_init"].float().numpy())
    # the printed pretrain_jax.py overrides build the same arch in the trainer
    config = compose_config(info["pretrain_overrides"])
    assert dataclasses.asdict(config.arch) == dataclasses.asdict(model.cfg)


def test_attention_checkpoint_with_mlp_t_config_is_refused(tmp_path, capsys):
    model_name, a = CASES["trm_attn_rope"]
    arch = {**reference_arch(model_name, a), "mlp_t": True}
    run = write_reference_run(tmp_path, model_name, a, make_state_dict(model_name, a), arch=arch)
    err = _cli_error(capsys, ["--checkpoint-dir", str(run), "--out", str(tmp_path / "out")])
    assert "attention weights (L_level.layers.0.self_attn" in err and "(arch.mlp_t: true)" in err
    assert not (tmp_path / "out").exists()


ATTN = CASES["trm_attn_rope"][1]
REFUSED = {
    # name: (changes to the saved arch (None: no config), overrides, state_dict case, error)
    "override contradicts config": ({}, ["hidden_size=64"], "trm_attn_rope",
                                    r"--arch-overrides hidden_size=64 contradicts .*arch.hidden_size: 32"),
    "learned positions, config rope": ({}, [], "trm_attn_learned",
                                       r"learned positions \(embed_pos.embedding_weight\), but pos_encodings=rope"),
    "layer count": ({"L_layers": 3}, [], "trm_attn_rope", r"2 L_level layers, but L_layers=3 by .*arch.L_layers: 3"),
    "puzzle table": ({"puzzle_emb_ndim": 0}, [], "trm_attn_rope", r"puzzle table of width 40"),
    "unknown key": ({"attention_sink": True}, [], "trm_attn_rope", r"arch.attention_sink, which the reference TRM"),
    "loss type": ({"loss": {"name": "losses@ACTLossHead", "loss_type": "focal"}}, [], "trm_attn_rope",
                  r"loss_type: focal\): loss_type is not one we implement"),
    "another model": ({"name": "recursive_reasoning.trm_singlez@TinyRecursiveReasoningModel_ACTV1"}, [],
                      "trm_attn_rope", r"arch.name: recursive_reasoning.trm_singlez"),
    "HRM mlp_t": ({"mlp_t": True}, [], "hrm", r"arch.mlp_t: true\): only mlp_t=false is implemented for HRM"),
    # without a config the reference's defaults (rope attention, hidden 512) apply, not ours
    "no config": (None, ["--model", "trm"], "trm_attn_rope",
                  r"width 32 \(embed_tokens.embedding_weight\), but hidden=512 by the reference's default; "
                  r"set --arch-overrides hidden=32"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_contradictions_are_one_line(case, tmp_path, capsys):
    changes, extra, sd_case, error = REFUSED[case]
    model_name, a = CASES[sd_case]
    sd = make_state_dict(model_name, a)
    if changes is None:
        torch.save(sd, tmp_path / "step_10")
        argv = ["--state-dict", str(tmp_path / "step_10"), *extra]
    else:
        a_config = ATTN if sd_case == "trm_attn_learned" else a  # a config saying rope for learned weights
        run = write_reference_run(tmp_path, model_name, a, sd, arch={**reference_arch(model_name, a_config), **changes})
        argv = ["--checkpoint-dir", str(run), *(["--arch-overrides", *extra] if extra else [])]
    err = _cli_error(capsys, argv + ["--out", str(tmp_path / "out")])
    assert re.search(error, err), err


def test_run_folder_errors(tmp_path, capsys):
    model_name, a = CASES["hrm"]
    run = write_reference_run(tmp_path, model_name, a, make_state_dict(model_name, a), dataset=False)
    out = ["--out", str(tmp_path / "out")]
    assert "its steps are [2, 10]" in _cli_error(capsys, ["--checkpoint-dir", str(run), "--step", "5", *out])
    # rope attention: no shape shows seq_len, and the run's data path is gone
    assert "pass --seq-len" in _cli_error(capsys, ["--checkpoint-dir", str(run), *out])
    assert imp.main(["--checkpoint-dir", str(run), "--seq-len", str(SEQ), "--step", "2", *out]) == 0
    # one step_<N> file: the all_config.yaml beside it says what it is
    _, _, _, info = imp.import_reference(str(run / "step_10"), seq_len=SEQ)
    assert info["model"] == "hrm" and info["config"] == str(run / "all_config.yaml")
    assert "holds no step_<N>" in _cli_error(capsys, ["--checkpoint-dir", str(tmp_path), *out])


def _overrides(a: dict) -> list[str]:
    return [f"{k}={v}" for k, v in a.items()] + ["forward_dtype=float32"]


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    return {"inputs": rng.integers(0, VOCAB, (B, SEQ)).astype(np.int32),
            "puzzle_identifiers": np.array([1, 4, 0][:B], np.int32)}


def _convert(sd, model_name="trm", a=None, **sizes):
    a = a or CASES["trm_attn_rope"][1]
    return imp.import_reference({k: v.float().numpy() for k, v in sd.items()}, model_name, _overrides(a),
                                sizes.get("vocab", VOCAB), SEQ, PUZZLES)


def test_prefixes_stripped_and_layouts():
    model_name, a = CASES["trm_attn_rope"]
    sd = make_state_dict(model_name, a)
    plain = {k[len(PFX):]: v for k, v in sd.items()}  # no prefix works too
    _, params, init_states, info = _convert(plain)
    assert info["keys_consumed"] == len(sd)
    d, h = a["hidden"], a["heads"]
    qkv = plain["L_level.layers.0.self_attn.qkv_proj.weight"].numpy()  # [3*H*Dh, D]
    ours = params["L_level"]["block_0"]["attn"]["qkv"]  # [D, 3, H, Dh]
    # key head 1, dim 2 of our kernel == row (1*H + 1)*Dh + 2 of the reference weight
    np.testing.assert_array_equal(ours[:, 1, 1, 2], qkv[(1 * h + 1) * (d // h) + 2])
    gu = plain["L_level.layers.1.mlp.gate_up_proj.weight"].numpy()
    inter = gu.shape[0] // 2
    np.testing.assert_array_equal(params["L_level"]["block_1"]["mlp"]["gate_up"][:, 1, 5], gu[inter + 5])  # up half
    np.testing.assert_array_equal(init_states["H_init"], plain["H_init"].float().numpy())


def test_unconsumed_key_is_one_clear_error():
    sd = make_state_dict(*CASES["trm_attn_rope"])
    sd[PFX + "L_level.layers.0.self_attn.extra.weight"] = torch.zeros(3)
    with pytest.raises(UserError, match=r"'L_level.layers.0.self_attn.extra.weight'.*unconsumed") as e:
        _convert(sd)
    assert "\n" not in str(e.value)


def test_extra_layer_and_missing_param_and_shape_errors():
    a = CASES["trm_attn_rope"][1]
    sd = make_state_dict("trm", a)
    with pytest.raises(UserError, match=r"'L_level.layers.0.mlp.down_proj.weight' has shape .* expected"):
        bad = dict(sd)
        bad[PFX + "L_level.layers.0.mlp.down_proj.weight"] = torch.zeros(a["hidden"], 7)
        _convert(bad)
    with pytest.raises(UserError, match=r"'L_level/block_1/mlp/down'.*has no state_dict key"):
        bad = dict(sd)
        del bad[PFX + "L_level.layers.1.mlp.down_proj.weight"]
        _convert(bad)
    with pytest.raises(UserError, match=r"holds H_level layers \(1\), which a TRM does not have"):
        bad = dict(sd)
        bad[PFX + "H_level.layers.0.mlp.down_proj.weight"] = sd[PFX + "L_level.layers.0.mlp.down_proj.weight"]
        _convert(bad)
    with pytest.raises(UserError, match=r"'embed_tokens.embedding_weight' has shape"):
        _convert(sd, vocab=VOCAB + 1)
