"""Throughput and model-FLOPs utilisation between log points."""

from __future__ import annotations

import contextlib
import time

import jax

from runtime.task import analysis_mode


def analysis_compile(steps, state, batch):
    """The train step compiled in `analysis_mode` (a fresh trace): loops unrolled, no remat."""
    with analysis_mode():
        return steps.train_analysis().lower(state, batch).compile()


def analysis_flops(steps, state, batch) -> float:
    """XLA's FLOPs per device of the train step compiled in `analysis_mode`."""
    return float((analysis_compile(steps, state, batch).cost_analysis() or {}).get("flops", 0.0))


def formula_flops_per_step(task, seq_len: int, global_batch: int, devices: int) -> float | None:
    """The task's model FLOPs per example x the global batch, per device; None where unknown."""
    per_example = task.flops_per_example(seq_len) if task is not None else None
    return None if per_example is None else per_example * global_batch / devices


# Peak dense bf16 FLOP/s per JAX device, by device_kind prefix (vendor datasheets).
PEAK_BF16_FLOPS = (
    ("TPU v4", 275e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5e", 197e12),
    ("TPU v5p", 459e12),
    ("TPU v5", 459e12),
    ("TPU v6 lite", 918e12),
    ("TPU v6e", 918e12),
    ("NVIDIA H100", 989e12),
    ("NVIDIA H200", 989e12),
    ("NVIDIA A100", 312e12),
)


def peak_flops_per_device(device: jax.Device) -> float | None:
    return peak_flops_for_kind(device.device_kind)


def peak_flops_for_kind(device_kind: str) -> float | None:
    for prefix, flops in PEAK_BF16_FLOPS:
        if device_kind.startswith(prefix):
            return flops
    return None  # CPU and unknown kinds: no MFU


class StepTimer:
    """Steps/s, examples/s, tokens/s and MFU over the steps since the last lap.

    `flops_per_step` is the model FLOPs per device by the task's formula (`formula_flops_per_step`),
    so MFU = flops_per_step * steps/s / peak per device, and TFLOP/s = flops_per_step * steps/s.
    """

    def __init__(self, global_batch: int, seq_len: int, flops_per_step: float | None, peak_flops: float | None):
        self.global_batch, self.seq_len = global_batch, seq_len
        self.flops_per_step, self.peak_flops = flops_per_step, peak_flops
        self._mark, self._paused = time.perf_counter(), 0.0
        self._steps_at_mark: int | None = None

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside (eval, checkpoint saves) does not count as training time."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._paused += time.perf_counter() - start

    def lap(self, done_steps: int) -> dict[str, float]:
        now = time.perf_counter()
        elapsed, steps = now - self._mark - self._paused, None
        if self._steps_at_mark is not None:
            steps = done_steps - self._steps_at_mark
        self._mark, self._paused, self._steps_at_mark = now, 0.0, done_steps
        if not steps or elapsed <= 0:
            return {}  # the first lap includes start-up; report from the second on
        rate = steps / elapsed
        out = {"perf/steps_per_sec": rate, "perf/examples_per_sec": rate * self.global_batch,
               "perf/tokens_per_sec": rate * self.global_batch * self.seq_len}
        if self.flops_per_step:
            out["perf/tflops_per_sec_per_device"] = self.flops_per_step * rate / 1e12
        if self.flops_per_step and self.peak_flops:
            out["perf/mfu"] = self.flops_per_step * rate / self.peak_flops
        return out
