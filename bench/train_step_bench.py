"""Train-step throughput of the recursive models on one JAX device, against XLA's matmul rate
on the same device in the same run; prints a table.

    python bench/train_step_bench.py                      # TRM-MLP and TRM-Att (Sudoku shapes), batch 32
    python bench/train_step_bench.py --reps 5 --batches 32 128 --only TRM-Att
    python bench/train_step_bench.py --untuned            # without runtime/cpu_backend.py's settings
    python bench/train_step_bench.py --dtype bfloat16     # another compute dtype (default: the platform's)

Each row builds the real train step (the code path of pretrain_jax.py: Hydra config, plan,
mesh, task, optimizer) on the first device, compiles it (timed) and runs one warm-up step.
Then, `--reps` times, every row runs one step with a 2048^3 matmul of the row's dtype just
before it (best of 3), so a row and its matmul see the same machine load. A row reports its
fastest step and the fastest matmul beside it:

  GFLOP/s     model FLOPs of the step by formula (Task.flops_per_example x batch; models/flops.py)
              over the step's wall time; examples/s likewise
  vs matmul   that rate over the matmul's: the share of the matmul rate the step reaches
  CPU time    the same ratio from process CPU time instead of wall time: steadier on a machine
              other work is loading (it counts no time spent waiting for a core)

On CPU, JAX uses every core in one device; run without --xla_force_host_platform_device_count.
Nothing here is asserted anywhere.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before jax is imported: it reads JAX_PLATFORMS then

import jax  # noqa: E402  (importing starts no backend: tune_cpu_backend in main still applies)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from runtime.builder import plan_and_build  # noqa: E402
from runtime.config import register_schemas, validate  # noqa: E402
from runtime.cpu_backend import tune_cpu_backend  # noqa: E402
from runtime.task import DataShape  # noqa: E402
from runtime.train_step import batch_shardings  # noqa: E402

MODELS = {  # label -> overrides (reference Sudoku shapes: vocab 11, 81 cells, hidden 512)
    "TRM-MLP (Sudoku, hidden 512)": ["arch=trm_mlp", "optim=adam_atan2"],
    "TRM-Att (rope, hidden 512)": ["arch=trm_att", "optim=adam_atan2"],
}
VOCAB, SEQ_LEN = 11, 81
MATMUL_N = 2048


@dataclass
class Timing:
    """Best wall and CPU seconds seen."""

    wall: float = float("inf")
    cpu: float = float("inf")

    def run(self, fn, *args):
        w, c = time.perf_counter(), time.process_time()
        out = jax.block_until_ready(fn(*args))
        self.wall, self.cpu = min(self.wall, time.perf_counter() - w), min(self.cpu, time.process_time() - c)
        return out


class Row:
    """One model at one batch size: its compiled step, state and timings."""

    def __init__(self, label: str, overrides: list[str], batch: int, device):
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
            cfg = compose(config_name="config", overrides=overrides + [
                f"train.global_batch_size={batch}", "train.steps=1000", "mesh=data_parallel"])
        config = validate(cfg)
        _, mesh, built = plan_and_build(config, devices=[device], num_processes=1,
                                        shape=DataShape(examples=100 * batch, vocab_size=VOCAB, seq_len=SEQ_LEN))
        self.label, self.batch = label, batch
        self.dtype = np.dtype(built.task.model.dtype).name
        self.flops = built.task.flops_per_example(SEQ_LEN) * batch
        self.state = built.init(jax.random.key_data(jax.random.key(0)))
        self.params = sum(x.size for x in jax.tree.leaves(self.state.params))
        rng = np.random.default_rng(0)
        self.data = jax.device_put({"inputs": rng.integers(1, VOCAB, (batch, SEQ_LEN)).astype(np.int32),
                                    "labels": rng.integers(2, VOCAB, (batch, SEQ_LEN)).astype(np.int32),
                                    "puzzle_identifiers": np.zeros((batch,), np.int32)}, batch_shardings(mesh))
        t0 = time.perf_counter()
        self.compiled = built.train.lower(self.state, self.data).compile()
        self.compile_s = time.perf_counter() - t0
        self.step()  # warm-up
        self.timing, self.matmul = Timing(), Timing()

    def step(self, timing: Timing | None = None):
        run = timing.run if timing is not None else (lambda fn, *a: fn(*a))
        self.state, _ = run(self.compiled, self.state, self.data)


def matmul_fn(dtype: str, device):
    """A 2048^3 matmul writing into the buffer of its previous result (donated), so that no run
    allocates: it measures the dot alone, whatever the allocator does."""
    a = jax.device_put(jnp.ones((MATMUL_N, MATMUL_N), dtype), device)
    fn = jax.jit(lambda x, y, out: x @ y, donate_argnums=2, keep_unused=True).lower(a, a, a).compile()
    out = [fn(a, a, jnp.zeros_like(a))]

    def run():
        out[0] = fn(a, a, out[0])
        return out[0]

    run().block_until_ready()
    return run


def table(rows: list[Row]) -> str:
    gf = 1e9
    out = ["| model | params | dtype | batch | compile (s) | step (s) | examples/s | GFLOP/s | matmul GFLOP/s "
           "| vs matmul | vs matmul (CPU time) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mm = 2 * MATMUL_N ** 3
        rate, mm_rate = r.flops / r.timing.wall, mm / r.matmul.wall
        cpu_ratio = (r.flops / r.timing.cpu) / (mm / r.matmul.cpu)
        out.append(f"| {r.label} | {r.params / 1e6:.2f}M | {r.dtype} | {r.batch} | {r.compile_s:.1f} | "
                   f"{r.timing.wall:.2f} | {r.batch / r.timing.wall:.1f} | {rate / gf:.0f} | {mm_rate / gf:.0f} | "
                   f"{rate / mm_rate:.0%} | {cpu_ratio:.0%} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3, help="timed steps per row (each after its own matmul)")
    parser.add_argument("--batches", type=int, nargs="+", default=[32])
    parser.add_argument("--only", help="run only the models whose label contains this text (e.g. TRM-Att)")
    parser.add_argument("--dtype", help="arch.forward_dtype for every row (default: the platform's, 'auto')")
    parser.add_argument("--untuned", action="store_true", help="skip runtime/cpu_backend.py's settings")
    args = parser.parse_args()
    tuned = False if args.untuned else tune_cpu_backend()
    register_schemas()
    device = jax.devices()[0]
    load = os.getloadavg()[0]
    print(f"device: {device.device_kind} ({device.platform}) of {jax.device_count()}, {os.cpu_count()} host cores, "
          f"jax {jax.__version__}; CPU backend settings {'applied' if tuned else 'not applied'}")
    if device.platform == "cpu" and jax.device_count() > 1:
        print("note: several CPU devices (xla_force_host_platform_device_count) split the cores; use one")
    extra = [f"arch.forward_dtype={args.dtype}"] if args.dtype else []
    rows = [Row(label, overrides + extra, batch, device) for label, overrides in MODELS.items()
            if not args.only or args.only in label for batch in args.batches]
    matmuls = {dtype: matmul_fn(dtype, device) for dtype in {r.dtype for r in rows}}
    for _ in range(args.reps):
        for r in rows:
            time.sleep(0.5)  # the previous step's clean-up (freeing gigabytes) runs on after it returns
            for _ in range(3):
                r.matmul.run(matmuls[r.dtype])
            r.step(r.timing)
    print(f"load average (1 min) {load:.1f} before, {os.getloadavg()[0]:.1f} after; best of {args.reps} steps per row\n")
    print(table(rows))


if __name__ == "__main__":
    main()
