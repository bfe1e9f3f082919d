"""Model FLOPs by formula, shared by the model families' `Task.flops_per_example`.

Only matrix multiplications count (2*m*k*n each): the weights' einsums, attention's QK^T and
AV, the heads. Elementwise work (norms, activations, softmax, RoPE, the optimizer) and gathers
(token and puzzle embeddings) are left out: they are a few percent at real sizes. Backward =
2x forward for a matmul whose weight trains (activation and weight gradients), 1x for a frozen
weight (the activation gradient only: LoRA's base), and 2x for attention's QK^T / AV.
Rematerialisation is not counted (model FLOPs, not hardware FLOPs).

XLA's `cost_analysis()` counts a loop body once whatever its trip count, so the compiler's
figure for a step with loops (TRM/HRM recursion, Gemma's layer scan and chunked loss) is far
below these. `analysis_mode()` (runtime/task.py) traces the models without loops or remat, so
that a compile made inside it can be checked against the formula (tests/test_flops.py,
compile_only).
"""

from __future__ import annotations

from runtime.task import analysis_mode, in_analysis  # the switch is part of the Task contract

__all__ = ["analysis_mode", "in_analysis", "matmul", "swiglu", "attention_core", "trained", "frozen"]


def matmul(m: float, k: float, n: float) -> float:
    """[m, k] @ [k, n]."""
    return 2.0 * m * k * n


def swiglu(tokens: float, dim: int, inter: int) -> float:
    """Gate, up and down projections of a (Swi/Ge)GLU of width `inter` on `dim` features."""
    return 3 * matmul(tokens, dim, inter)


def attention_core(queries: float, keys: float, heads: int, head_dim: int) -> float:
    """QK^T and AV of `queries` query rows against `keys` keys per head (no projections)."""
    return 2 * heads * matmul(queries, head_dim, keys)


def trained(forward: float) -> float:
    """Forward + backward of matmuls whose weights train (or attention's QK^T / AV): 3x."""
    return 3.0 * forward


def frozen(forward: float) -> float:
    """Forward + the activation gradient only (a frozen weight still passing gradients on): 2x."""
    return 2.0 * forward
