"""Gemma fine-tuning through the real entry point: a 2 x 4 pod matches one process, pretrained
weights load into the trainer, LoRA trains only the adapters, and the merged export reloads
into the same logits, here and in transformers."""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import flax.linen as nn
import pytest
from omegaconf import OmegaConf

from helpers import REPO, child_env, read_jsonl, run_pretrain, train, train_losses

pytestmark = pytest.mark.slow


def tiny_config(**changes):
    from models.gemma.config import GemmaConfig

    raw = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "arch" / "gemma_tiny.yaml"))
    raw.pop("defaults")
    return GemmaConfig(**(raw | {"dtype": "float32"} | changes))


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory) -> Path:
    from data_pipeline.build_sft import build_generated_arithmetic

    root = tmp_path_factory.mktemp("sft") / "arith"
    build_generated_arithmetic(str(root), 256, 32, 128, seed=0)
    return root


def overrides(data: Path, root: Path, name: str, steps: int) -> list[str]:
    return ["arch=gemma_tiny", "data=sft_arithmetic", f"data.path={data}", "data.generate_if_missing=false",
            f"run.root={root}", "run.group=g", f"run.name={name}", "run.progress_bar=false", f"train.steps={steps}",
            "train.log_every=1", f"train.eval_every={steps}", f"train.checkpoint_every={steps}",
            "train.global_batch_size=16", "arch.dtype=float32", "arch.loss_chunk_size=256", "optim.warmup_steps=2",
            "data.eval_max_examples=16", "data.eval_generate_examples=0", "run.wandb.mode=disabled"]


def test_pod_matches_single_process(sft_dir, tmp_path):
    """A 2 x 4 pod, accumulating gradients over 2 micro-batches (each spread over both processes),
    gives the losses of one process taking the whole batch at once."""
    from experiments.launcher.local_pod import run_local_pod

    mesh = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "arch.remat=full"]
    train(overrides(sft_dir, tmp_path / "one", "t", 4) + mesh)
    single = train_losses(tmp_path / "one" / "g" / "t")

    log = io.StringIO()
    env = {k: v for k, v in child_env(4).items() if k != "XLA_FLAGS"}
    code = run_local_pod(2, 4, overrides(sft_dir, tmp_path / "pod", "t", 4) + mesh + ["train.grad_accum_steps=2"],
                         script=str(REPO / "pretrain_jax.py"), extra_env=env, log_dir=tmp_path / "pod-logs", stream=log,
                         timeout=300)
    assert code == 0, log.getvalue()[-6000:]
    assert "gradient accumulation: 2 micro-batches of 8 rows per optimizer step" in log.getvalue()
    pod = train_losses(tmp_path / "pod" / "g" / "t")
    assert sorted(pod) == [1, 2, 3, 4]
    assert pod == pytest.approx(single, rel=1e-5, abs=1e-6)
    assert pod[4] < pod[1]


def _eval_loss(cfg, params, data: Path, rows: int) -> float:
    from data_pipeline.sft_format import load_sft_split
    from models.gemma.task import GemmaTask

    batch = {k: jnp.asarray(v) for k, v in load_sft_split(str(data), "test").rows(np.arange(rows)).items()}
    sums = jax.device_get(GemmaTask(cfg).eval_sums(params, batch))
    return float(sums["loss_sum"]) / float(sums["tokens"])


def test_pretrained_weights_lora_and_merged_export(sft_dir, tmp_path):
    from models.gemma import Gemma
    from runtime.export import main as export_main
    from models.gemma.lora import merge_lora
    from models.gemma.model import init_params
    from models.gemma.weights import export_hf, load_params
    from runtime.checkpointing import Checkpoints

    # "Pretrained" weights in Hugging Face layout (random, bf16-representable).
    cfg = tiny_config(max_position_embeddings=256)  # a value the export must carry, not transformers' default
    rng = np.random.default_rng(7)  # random norms too (init has them at zero), so every mapping matters
    base = jax.tree.map(lambda a: jnp.asarray(rng.normal(0, 0.2, a.shape), jnp.bfloat16).astype(jnp.float32),
                        nn.meta.unbox(init_params(cfg, jax.random.key(7))))
    hf = tmp_path / "hf"
    export_hf(base, cfg, str(hf), dtype="bfloat16")

    # Evaluating them through the trainer gives the loss computed here.
    common = overrides(sft_dir, tmp_path, "eval", 2) + [f"arch.checkpoint={hf}"]
    train(common + ["train.eval_only=true"])
    logged = next(r for r in read_jsonl(tmp_path / "g" / "eval" / "metrics.jsonl") if "eval/loss" in r)
    assert logged["eval/loss"] == pytest.approx(_eval_loss(cfg, base, sft_dir, 16), rel=1e-5)

    # LoRA from those weights: the base stays bit-identical, adapters move, optimizer state is adapters only.
    # The table is padded from the checkpoint's 512 rows to 640 (zero rows, masked to -inf).
    lora = overrides(sft_dir, tmp_path, "lora", 3) + [f"arch.checkpoint={hf}", "arch.lora_rank=4", "arch.lora_alpha=8",
                                                     "optim.lr=1e-2", "arch.vocab_size=640"]
    train(lora)
    ckpt = Checkpoints(str(tmp_path / "g" / "lora" / "checkpoints"), keep=3, async_save=False)
    import orbax.checkpoint as ocp

    state = ckpt.manager.restore(3, args=ocp.args.Composite(state=ocp.args.StandardRestore())).state
    ckpt.close()
    params = state["params"]
    flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(params)}
    base_flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(base)}
    assert set(base_flat) < set(flat)
    for k, v in base_flat.items():
        np.testing.assert_array_equal(np.asarray(flat[k])[:len(v)], np.asarray(v), err_msg=k)
    assert not np.asarray(flat["['embedder']['input_embedding']"])[512:].any()
    lora_b = [k for k in flat if k.endswith("['lora_b']")]
    assert lora_b and all(np.abs(np.asarray(flat[k])).max() > 0 for k in lora_b)
    opt_leaves = [np.asarray(x) for x in jax.tree.leaves(state["opt_state"]) if np.ndim(x) > 0]
    lora_sizes = sorted(np.size(v) for k, v in flat.items() if "lora_" in k)
    assert sorted(x.size for x in opt_leaves) == sorted(lora_sizes * 2)  # Adam's mu and nu, adapters only

    # Export merges the adapters; the exported model reloads to the merged model's logits. The run's
    # checkpoint is enough: the pretrained folder it started from is gone by then.
    shutil.rmtree(hf)
    out = tmp_path / "exported"
    assert export_main(["--checkpoint-dir", str(tmp_path / "g" / "lora" / "checkpoints"), "--out", str(out),
                        "--dtype", "float32"]) == 0
    from data_pipeline.tokenizer import Tokenizer

    tokenizer = Tokenizer(sft_dir / "tokenizer.model")  # the run's: the special ids come from it
    written = json.loads((out / "config.json").read_text())
    assert ([written[k] for k in ("max_position_embeddings", "pad_token_id", "eos_token_id", "bos_token_id")]
            == [256, tokenizer.pad_id, tokenizer.eos_id, tokenizer.bos_id])
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tokenizer.eos_id, tokenizer.end_of_turn_id]
    lcfg = tiny_config(lora_rank=4, lora_alpha=8.0, vocab_size=640, real_vocab_size=512)
    merged = merge_lora(jax.tree.map(jnp.asarray, params), lcfg)
    reloaded = load_params(str(out), cfg)  # the export drops the padding: 512 rows again
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 500, (2, 12)), jnp.int32)
    padded = Gemma(lcfg).apply({"params": jax.tree.map(jnp.asarray, params)}, tokens)
    want = padded[..., :512]
    assert bool(jnp.all(padded[..., 512:] == -jnp.inf))
    np.testing.assert_allclose(Gemma(dataclasses.replace(lcfg, lora_rank=0)).apply({"params": merged}, tokens), padded,
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(Gemma(cfg).apply({"params": reloaded}, tokens), want, rtol=1e-5, atol=1e-5)
    # ... and so does transformers, the export's real consumer (config.json included).
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="float32", attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = hf(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(theirs, want, rtol=1e-5, atol=1e-5)

    # Exporting again into an earlier export replaces its files and removes those of its own it no
    # longer writes (its marker lists them), never a user's file; --overwrite writes into a user's
    # folder and leaves the rest of it alone.
    marker = out / ".podrunner-export"
    files = json.loads(marker.read_text())["files"]
    assert "config.json" in files and any(f.endswith(".safetensors") for f in files)
    (out / "model-00002-of-00002.safetensors").write_bytes(b"an earlier export's shard")
    marker.write_text(json.dumps({"files": [*files, "model-00002-of-00002.safetensors"]}))
    (out / "notes.txt").write_text("the user's notes")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text("{}")
    (mine / "notes.txt").write_text("the user's notes")
    checkpoints = ["--checkpoint-dir", str(tmp_path / "g" / "lora" / "checkpoints"), "--dtype", "float32"]
    assert export_main([*checkpoints, "--out", str(out)]) == 0
    assert export_main([*checkpoints, "--out", str(mine), "--overwrite"]) == 0
    assert not (out / "model-00002-of-00002.safetensors").exists() and (out / "notes.txt").exists()
    assert json.loads(marker.read_text())["files"] == files
    assert (mine / "notes.txt").read_text() == "the user's notes"
    assert json.loads((mine / "config.json").read_text()) == written


def test_cpu_demo_learns_the_format(tmp_path):
    """A shortened `+experiment=gemma_sft/tiny_cpu` (README: format adherence 1.0 at step 200):
    greedy answers follow <reasoning>...</reasoning><answer>...</answer> and the loss falls. A subprocess:
    the demo runs on one CPU device (this process has 8)."""
    run_pretrain(["+experiment=gemma_sft/tiny_cpu", f"data.path={tmp_path / 'data'}", "data.generate_puzzles=1000",
                  f"run.root={tmp_path}", "run.progress_bar=false", "run.wandb.mode=disabled", "train.steps=100", "train.eval_every=100",
                  "train.checkpoint_every=100", "data.eval_generate_examples=16", "optim.warmup_steps=15",
                  "train.global_batch_size=16"],  # half the demo's batch: half the time, the format still learned
                 devices=1, timeout=600, optimized=True)
    rows = read_jsonl(tmp_path / "gemma_sft" / "tiny_cpu" / "metrics.jsonl")
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    final = next(r for r in rows if "eval/format_adherence" in r)
    assert losses[-1] < 0.45 * losses[0]  # 0.30 measured
    assert final["eval/format_adherence"] >= 0.5, final  # 0 before training; 1.0 measured at step 100
