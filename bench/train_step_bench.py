"""Train-step throughput of the recursive models on this machine's devices; prints a table.

    python bench/train_step_bench.py                  # TRM-MLP and TRM-Att (Sudoku shapes), batch 32 and 128
    python bench/train_step_bench.py --steps 20 --batches 64

Each row builds the real sharded train step (the same code path as pretrain_jax.py: Hydra
config, plan, mesh, task, optimizer), compiles it once (timed), then times `--steps` steps
after one warm-up step. Numbers are wall-clock on whatever devices JAX sees; nothing here is
asserted anywhere.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from runtime.config import register_schemas, validate  # noqa: E402
from runtime.builder import plan_and_build  # noqa: E402
from runtime.task import DataShape  # noqa: E402

MODELS = {  # label -> overrides (reference Sudoku shapes: vocab 11, 81 cells, hidden 512)
    "TRM-MLP (Sudoku, hidden 512)": ["arch=trm_mlp", "optim=adam_atan2"],
    "TRM-Att (rope, hidden 512)": ["arch=trm_att", "optim=adam_atan2"],
}
VOCAB, SEQ_LEN = 11, 81


def bench(overrides: list[str], batch: int, steps: int) -> dict[str, float]:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=overrides + [f"train.global_batch_size={batch}",
                                                                   "train.steps=1000", "mesh=data_parallel"])
    config = validate(cfg)
    plan, mesh, built = plan_and_build(config, devices=jax.devices(), num_processes=1,
                                       shape=DataShape(examples=100 * batch, vocab_size=VOCAB, seq_len=SEQ_LEN))
    state = built.init(jax.random.key_data(jax.random.key(0)))
    rng = np.random.default_rng(0)
    batch_arrays = {"inputs": rng.integers(1, VOCAB, (batch, SEQ_LEN)).astype(np.int32),
                    "labels": rng.integers(2, VOCAB, (batch, SEQ_LEN)).astype(np.int32),
                    "puzzle_identifiers": np.zeros((batch,), np.int32)}
    from runtime.train_step import batch_shardings

    device_batch = jax.device_put(batch_arrays, batch_shardings(mesh))
    t0 = time.perf_counter()
    compiled = built.train.lower(state, device_batch).compile()
    compile_s = time.perf_counter() - t0
    state, metrics = compiled(state, device_batch)  # warm-up
    jax.block_until_ready(metrics)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, metrics = compiled(state, device_batch)
    jax.block_until_ready(metrics)
    per_step = (time.perf_counter() - t0) / steps
    params = sum(x.size for x in jax.tree.leaves(state.params))
    return {"params": params, "compile_s": compile_s, "steps_per_s": 1 / per_step, "examples_per_s": batch / per_step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--only", help="run only the models whose label contains this text (e.g. TRM-Att)")
    args = parser.parse_args()
    register_schemas()
    device = jax.devices()[0]
    print(f"devices: {jax.device_count()} x {device.device_kind} ({device.platform}), jax {jax.__version__}, "
          f"{os.cpu_count()} host cores; {args.steps} timed steps after 1 warm-up\n")
    print("| model | params | batch | compile (s) | steps/s | examples/s |")
    print("|---|---|---|---|---|---|")
    for label, overrides in MODELS.items():
        if args.only and args.only not in label:
            continue
        for batch in args.batches:
            r = bench(overrides, batch, args.steps)
            print(f"| {label} | {r['params'] / 1e6:.2f}M | {batch} | {r['compile_s']:.1f} | {r['steps_per_s']:.2f} | "
                  f"{r['examples_per_s']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
