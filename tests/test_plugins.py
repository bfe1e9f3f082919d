"""The plug-in seams: a dataset kind and a model family registered from this file only train
end to end through the unchanged runtime; and the runtime knows no kind or family by name."""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import compose_config
from runtime.errors import UserError
from runtime.frozen import Freezable
from runtime.registry import (DATASET_KINDS, MODEL_FAMILIES, DatasetKind, ModelFamily, dataset_kind,
                              register_dataset_kind, register_model_family)
from runtime.task import IGNORE_LABEL, DataShape, Evaluator, Task

REPO = Path(__file__).resolve().parents[1]
KIND_NAMES = ("sudoku", "maze", "arc", "sft", "multitask")


# ------------------------------------------------------------------- a toy dataset kind


class CopySplit:
    """Rows of random tokens whose label is the token itself: a task a model learns in a few steps."""

    def __init__(self, rows: int, seq_len: int, vocab: int, seed: int):
        rng = np.random.default_rng(seed)
        self.tokens = rng.integers(0, vocab, (rows, seq_len)).astype(np.int32)
        self.metadata = SimpleNamespace(vocab_size=vocab, seq_len=seq_len)

    def __len__(self) -> int:
        return len(self.tokens)

    def rows(self, idx):
        return {"inputs": self.tokens[idx], "labels": self.tokens[idx]}


class CopyKind(DatasetKind):
    name = "toy_copy"

    def load_split(self, data, split):
        return CopySplit(256 if split == data.train_split else 40, 6, 8, seed=0 if split == data.train_split else 1)

    def shape(self, data, train_split):
        return DataShape(examples=len(train_split), vocab_size=8, seq_len=6, source="toy")

    def evaluators(self, data, context):
        return [RowCounter()]


class RowCounter(Evaluator):
    """Counts the labelled eval rows it is shown (padding rows carry ignored labels only)."""

    def start(self):
        self.rows = 0

    def update(self, batch, outputs):
        self.rows += int((np.asarray(jax.device_get(batch["labels"])) != IGNORE_LABEL).any(-1).sum())

    def finish(self, params):
        return {"toy_rows": float(self.rows)}


# ------------------------------------------------------------------- a toy model family


@dataclass
class ToyConfig(Freezable):
    name: str = "toy_embed"
    hidden: int = 16


class ToyNet(nn.Module):
    cfg: ToyConfig
    vocab: int

    @nn.compact
    def __call__(self, tokens):
        init = nn.with_logical_partitioning(nn.initializers.normal(0.5), ("vocab", "embed"))
        table = self.param("table", init, (self.vocab, self.cfg.hidden))
        head = self.param("head", nn.with_logical_partitioning(nn.initializers.zeros, ("embed", "vocab")),
                          (self.cfg.hidden, self.vocab))
        return jnp.take(table, tokens, axis=0) @ head


class ToyTask(Task):
    batch_fields = {"inputs": 2, "labels": 2}

    def __init__(self, cfg: ToyConfig, vocab: int):
        self.net = ToyNet(cfg, vocab)

    def init(self, rng, example_batch):
        return self.net.init(rng, example_batch["inputs"][:1])["params"]

    def _sums(self, params, batch):
        logits = self.net.apply({"params": params}, batch["inputs"])
        valid = batch["labels"] != IGNORE_LABEL
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(valid, batch["labels"], 0))
        return {"loss_sum": jnp.where(valid, ce, 0).sum(), "tokens": valid.sum()}

    def train_loss(self, params, carry, batch, rng, step=None):
        sums = self._sums(params, batch)
        return sums["loss_sum"] / sums["tokens"], (None, sums, {})

    def eval_sums(self, params, batch):
        return self._sums(params, batch)

    def summarize(self, sums, global_batch, training):
        return {"loss": float(sums["loss_sum"]) / max(float(sums["tokens"]), 1.0)}


def build_toy(arch: ToyConfig, shape: DataShape, **_: Any) -> ToyTask:
    return ToyTask(arch, shape.vocab_size)


@pytest.fixture
def toy_plugins():
    register_dataset_kind(CopyKind())
    register_model_family(ModelFamily("toy_embed", ToyConfig, build_toy))
    yield
    DATASET_KINDS.pop("toy_copy")
    MODEL_FAMILIES.pop("toy_embed")


def compose(overrides: list[str]):
    return compose_config(overrides)  # register_schemas() offers the new family as arch=base_toy_embed


@pytest.mark.slow
def test_a_kind_and_a_family_from_outside_the_runtime_train_end_to_end(toy_plugins, tmp_path):
    from runtime.trainer import run

    config = compose(["arch=base_toy_embed", "data.name=toy_copy", f"data.path={tmp_path / 'unused'}",
                      "data.generate_if_missing=false", f"run.root={tmp_path}", "run.group=toy", "run.name=copy",
                      "run.wandb.mode=disabled", "run.progress_bar=false", "train.steps=40", "train.log_every=10",
                      "train.eval_every=20", "train.checkpoint_every=20", "train.global_batch_size=16",
                      "optim.lr=0.1", "optim.warmup_steps=1"])
    assert run(config) == 0
    rows = [json.loads(line) for line in (tmp_path / "toy" / "copy" / "metrics.jsonl").read_text().splitlines()]
    train = [r["train/loss"] for r in rows if "train/loss" in r]
    evals = [r for r in rows if "eval/loss" in r]
    assert train[-1] < 0.5 * train[0]  # it learned to copy
    assert [r["eval/toy_rows"] for r in evals] == [40.0, 40.0]  # the kind's evaluator ran at each evaluation
    manifest = json.loads((tmp_path / "toy" / "copy" / "run_manifest.json").read_text())
    assert manifest["status"] == "completed" and manifest["config"]["arch"]["name"] == "toy_embed"
    assert (tmp_path / "toy" / "copy" / "checkpoints" / "40").is_dir()


def test_unknown_kind_and_family_are_one_line(toy_plugins):
    with pytest.raises(UserError, match="data.name='nope' is not a registered dataset kind; use one of .*toy_copy"):
        dataset_kind("nope")
    with pytest.raises(UserError, match="data.name='nope' is not a registered dataset kind"):
        compose(["data.name=nope"])


# ------------------------------------------------------------------- the import graph


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_runtime_imports_no_family_and_no_kind():
    specific = ("models.", "data_pipeline.kinds", "data_pipeline.sudoku", "data_pipeline.maze", "data_pipeline.arc",
                "data_pipeline.sft", "data_pipeline.build_", "data_pipeline.puzzle_format", "data_pipeline.tokenizer")
    for path in sorted((REPO / "runtime").glob("*.py")):
        bad = sorted(n for n in _imports(path) if n.startswith(specific) or n == "models")
        assert not bad, f"{path.name} imports {bad}"


def test_models_never_import_the_trainer():
    trainer = ("runtime.trainer", "runtime.loop", "runtime.builder", "runtime.compile_only")
    for path in sorted((REPO / "models").rglob("*.py")):
        bad = sorted(n for n in _imports(path) if n.startswith(trainer))
        assert not bad, f"{path.relative_to(REPO)} imports {bad}"


def test_runtime_compares_no_dataset_names():
    for path in sorted((REPO / "runtime").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                consts = [c.value for c in ast.walk(node) if isinstance(c, ast.Constant)]
                named = [c for c in consts if isinstance(c, str) and c in KIND_NAMES]
                assert not named, f"{path.name}:{node.lineno} compares with {named}"


@pytest.mark.parametrize("preset,family", [("gemma_tiny", "gemma"), ("trm_att", "trm"), ("hrm", "hrm"),
                                           ("tiny_transformer", "tiny_transformer")])
def test_a_saved_arch_finds_its_family_whatever_the_preset_is_named(preset, family):
    """Checkpoints keep the config as plain data; export and restore find the family from it."""
    from runtime.config import to_dict
    from runtime.registry import family_of_saved

    saved = to_dict(compose([f"arch={preset}"]))["arch"]
    assert family_of_saved(saved).name == family


def test_a_checkpoint_older_than_a_schema_field_still_finds_its_family_and_resumes(caplog):
    """A field added to a schema after a checkpoint was written (it lacks the key) neither hides
    the checkpoint's family (export) nor blocks a resume; a changed value still does."""
    from runtime.config import resolve_compute_dtype, to_dict
    from runtime.registry import family_of_saved
    from runtime.trainer import check_resumable

    config = resolve_compute_dtype(compose(["arch=gemma_tiny"]), "cpu")  # as a run saves it: dtype concrete
    saved = to_dict(config)
    newest = sorted(saved["arch"])[-1]
    del saved["arch"][newest]  # as if `newest` had been added since
    assert family_of_saved(saved["arch"]).name == "gemma"
    meta = {"config": saved, "data_position": {"train_examples": 10}}
    with caplog.at_level("WARNING", logger="runtime"):
        check_resumable(meta, config, 10, "ckpt", 5)
    assert f"predates arch.{newest}" in caplog.text
    saved["arch"]["num_layers"] += 1
    with pytest.raises(UserError, match="arch.num_layers"):
        check_resumable(meta, config, 10, "ckpt", 5)
