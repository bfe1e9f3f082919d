"""Model FLOPs by formula (`Task.flops_per_example`, models/flops.py) against XLA's count of
the real train step compiled on CPU with the loops unrolled (`runtime.task.analysis_mode`).

XLA's cost analysis also counts elementwise work and the optimizer, which the formula leaves
out, so the configs are sized for matmuls to dominate (hidden 128, 100+ tokens per row)
while each compile stays small.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import optax
import pytest

from models.gemma.config import GemmaConfig
from helpers import base_overrides, read_jsonl, train
from models.flops import attention_core, trained
from models.gemma.task import GemmaTask, gemma_flops_per_token
from models.recursive_reasoning import HRMConfig, TRMConfig
from models.multitask import MultiTaskACT, TaskSpec
from models.recursive_reasoning.task import build_task as build_act_task, net_flops
from models.tiny_transformer import TinyTransformerConfig, build_task as build_tiny_task
from runtime.perf import StepTimer, analysis_flops, formula_flops_per_step
from runtime.sharding import make_mesh
from runtime.task import DataShape
from runtime.train_step import build_steps

BATCH = 2
SHAPE = DataShape(examples=16, vocab_size=12, seq_len=100, num_puzzle_identifiers=1)


def trm(**kw) -> TRMConfig:
    base = dict(hidden=128, heads=4, L_layers=1, H_cycles=2, L_cycles=2, puzzle_emb_ndim=0, puzzle_emb_len=4,
                forward_dtype="float32", halt_max_steps=4, halt_exploration_prob=0.0, mlp_t=False)
    return TRMConfig(**(base | kw))


def hrm(**kw) -> HRMConfig:
    base = dict(hidden=128, heads=4, H_layers=1, L_layers=1, H_cycles=2, L_cycles=2, puzzle_emb_ndim=0,
                forward_dtype="float32", halt_max_steps=4, halt_exploration_prob=0.0)
    return HRMConfig(**(base | kw))


def gemma(**kw) -> GemmaConfig:
    base = dict(num_layers=2, embed_dim=128, hidden_dim=256, num_heads=4, num_kv_heads=2, head_dim=32,
                vocab_size=256, dtype="float32", remat="full", loss_chunk_size=64)
    return GemmaConfig(**(base | kw))


def build(task, seq_len: int):
    """(steps, abstract batch) of the real train step on one CPU device."""
    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    steps = build_steps(task, optax.sgd(1e-3), optax.constant_schedule(1e-3), mesh, seq_len, None, global_batch=BATCH)
    shapes = steps.batch_shapes or {k: (BATCH, seq_len)[:rank] for k, rank in steps.batch_fields.items()}
    return steps, {k: jax.ShapeDtypeStruct(shape, jnp.int32) for k, shape in shapes.items()}


def formula_and_compiler(task, seq_len: int) -> tuple[float, float]:
    """(the task's formula, XLA's count with loops unrolled), FLOPs per train step."""
    steps, batch = build(task, seq_len)
    return formula_flops_per_step(task, seq_len, BATCH, 1), analysis_flops(steps, steps.abstract_state, batch)


def assert_close(formula: float, compiler: float) -> None:
    assert abs(formula - compiler) <= 0.1 * compiler, f"formula {formula:.4g} vs XLA {compiler:.4g}"


@pytest.mark.parametrize("arch", [trm(), trm(mlp_t=True), trm(no_ACT_continue=False), hrm()],
                         ids=["trm_att", "trm_mlp", "trm_q_continue", "hrm"])
def test_recursive_formula_matches_compiler(arch):
    formula, compiler = formula_and_compiler(build_act_task(arch, SHAPE), SHAPE.seq_len)
    assert_close(formula, compiler)


@pytest.mark.parametrize("arch", [gemma(), gemma(lora_rank=8)], ids=["full", "lora"])
def test_gemma_formula_matches_compiler(arch):
    formula, compiler = formula_and_compiler(GemmaTask(arch), 128)
    assert_close(formula, compiler)


def test_recursion_depth_counts():
    """One more H cycle adds L_cycles + 1 forward-only network applications: the formula grows by
    that, XLA's unrolled count agrees, and the looped step's own count (each loop body once) is
    far below both: the undercount the formula replaces."""
    shallow, deep = trm(H_cycles=2, L_cycles=3), trm(H_cycles=3, L_cycles=3)
    f_shallow, x_shallow = formula_and_compiler(build_act_task(shallow, SHAPE), SHAPE.seq_len)
    task = build_act_task(deep, SHAPE)
    f_deep, x_deep = formula_and_compiler(task, SHAPE.seq_len)
    per_app = net_flops(task.model._net_def(deep.L_layers)) * BATCH
    assert f_deep - f_shallow == pytest.approx((deep.L_cycles + 1) * per_app)
    assert_close(f_deep - f_shallow, x_deep - x_shallow)
    steps, batch = build(task, SHAPE.seq_len)
    looped = float(steps.train.lower(steps.abstract_state, batch).compile().cost_analysis()["flops"])
    assert looped < 0.75 * f_deep


def test_gemma_sliding_window_layers_attend_the_window():
    """Local layers count QK^T and AV over min(window, seq_len) keys (the model computes the
    masked dense scores; model FLOPs count the visible keys), global layers over the row."""
    seq, window = 128, 32
    local = gemma(sliding_window=window, global_every=2)  # layer 0 local, layer 1 global
    saved = trained(attention_core(1, seq - window, local.num_heads, local.head_dim))
    assert gemma_flops_per_token(gemma(), seq) - gemma_flops_per_token(local, seq) == pytest.approx(saved)
    wide = gemma(sliding_window=4 * seq, global_every=2)  # a window wider than the row: all keys
    assert gemma_flops_per_token(wide, seq) == gemma_flops_per_token(gemma(), seq)


def test_multitask_weights_tasks_by_rows():
    arch = trm(puzzle_emb_len=0)
    specs = {"long": TaskSpec(vocab_size=12, seq_len=100, num_puzzle_identifiers=1, batch_size=1),
             "short": TaskSpec(vocab_size=7, seq_len=36, num_puzzle_identifiers=1, batch_size=1)}
    task = MultiTaskACT(arch, specs)
    singles = [build_act_task(arch, DataShape(examples=1, vocab_size=s.vocab_size, seq_len=s.seq_len))
               for s in specs.values()]
    assert task.flops_per_example() == pytest.approx(sum(t.flops_per_example() for t in singles) / 2)
    assert_close(*formula_and_compiler(task, 100))


def test_tiny_transformer_formula_matches_compiler():
    task = build_tiny_task(TinyTransformerConfig(hidden=128, heads=4, layers=2), SHAPE)
    assert_close(*formula_and_compiler(task, SHAPE.seq_len))


def test_trm_sudoku_baseline_figure():
    """The reference TRM-MLP Sudoku step (hidden 512, H 3 x L 6, 2 layers, 16 prefix tokens):
    21 network applications forward, 7 with backward: about 43 GFLOP per example."""
    task = build_act_task(TRMConfig(), DataShape(examples=1, vocab_size=11, seq_len=81))
    assert task.flops_per_example() == pytest.approx(42.7e9, rel=0.01)


def test_timer_reports_model_flops_rate(monkeypatch):
    now = iter([100.0, 100.0, 105.0])  # an injected clock: 10 steps in 5 s
    monkeypatch.setattr("runtime.perf.time.perf_counter", lambda: next(now))
    timer = StepTimer(global_batch=4, seq_len=8, flops_per_step=2e12, peak_flops=4e12)
    timer.lap(0)
    out = timer.lap(10)
    assert out["perf/steps_per_sec"] == pytest.approx(2.0)
    assert out["perf/tflops_per_sec_per_device"] == pytest.approx(4.0)  # 2 steps/s x 2 TFLOP
    assert out["perf/mfu"] == pytest.approx(1.0)  # 4 of a peak of 4 TFLOP/s


@pytest.mark.slow
def test_run_logs_formula_flops_and_rate(sudoku_dir, tmp_path):
    """A run's metrics carry the formula's FLOPs per step per device (global batch 16 over the
    session's 8 CPU devices) and the TFLOP/s it gives; the log labels XLA's own count."""
    trained_run = train(base_overrides(sudoku_dir, tmp_path, steps=4))
    rows = read_jsonl(tmp_path / "test" / "t" / "metrics.jsonl")
    per_step = next(r["model/flops_per_step_per_device"] for r in rows if "model/flops_per_step_per_device" in r)
    task = build_tiny_task(TinyTransformerConfig(hidden=32, heads=2), DataShape(examples=1, vocab_size=11, seq_len=81))
    assert per_step == pytest.approx(task.flops_per_example(81) * 16 / jax.device_count())
    rates = [r for r in rows if "perf/tflops_per_sec_per_device" in r]
    assert rates and all(r["perf/tflops_per_sec_per_device"] == pytest.approx(per_step * r["perf/steps_per_sec"] / 1e12)
                         for r in rates)
    assert "by formula" in trained_run.log and "XLA's count with loop bodies once" in trained_run.log
