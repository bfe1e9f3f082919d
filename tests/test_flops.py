"""Model FLOPs by formula (`Task.flops_per_example`, models/flops.py) against XLA's count of
the real train step compiled on CPU with the loops unrolled (`runtime.perf.analysis_mode`).

XLA's cost analysis also counts elementwise work and the optimizer, which the formula leaves
out, so the configs are sized for matmuls to dominate (hidden 128, 100+ tokens per row)
while each compile stays small.
"""

from __future__ import annotations

import jax
import optax
import pytest

from models.gemma.config import GemmaConfig
from models.gemma.task import GemmaTask
from models.recursive_reasoning import HRMConfig, TRMConfig
from models.recursive_reasoning.task import build_task as build_act_task
from runtime.perf import analysis_flops, formula_flops_per_step
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


def formula_and_compiler(task, seq_len: int) -> tuple[float, float]:
    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    steps = build_steps(task, optax.sgd(1e-3), optax.constant_schedule(1e-3), mesh, seq_len, None, global_batch=BATCH)
    batch = {k: jax.ShapeDtypeStruct((BATCH, seq_len)[:rank], jax.numpy.int32) for k, rank in steps.batch_fields.items()}
    return formula_flops_per_step(task, seq_len, BATCH, 1), analysis_flops(steps, steps.abstract_state, batch)


def assert_close(formula: float, compiler: float) -> None:
    assert abs(formula - compiler) <= 0.1 * compiler, f"formula {formula:.4g} vs XLA {compiler:.4g}"


@pytest.mark.parametrize("arch", [trm(), trm(mlp_t=True), trm(no_ACT_continue=False), hrm()],
                         ids=["trm_att", "trm_mlp", "trm_q_continue", "hrm"])
def test_recursive_formula_matches_compiler(arch):
    formula, compiler = formula_and_compiler(build_act_task(arch, SHAPE), SHAPE.seq_len)
    print(type(arch).__name__, formula, compiler, formula / compiler)
    assert_close(formula, compiler)


@pytest.mark.parametrize("arch", [gemma(), gemma(lora_rank=8), gemma(sliding_window=128, global_every=2)],
                         ids=["full", "lora", "sliding"])
def test_gemma_formula_matches_compiler(arch):
    formula, compiler = formula_and_compiler(GemmaTask(arch), 128)
    print(formula, compiler, formula / compiler)
    assert_close(formula, compiler)
