"""Compiled memory of one TRM training ACT step (value and gradient of the ACT loss) with and
without `TRMConfig.remat`, for L_cycles 6, 12, 24, printed as a markdown table. Nothing runs:
the step is only lowered and compiled, for the host CPU or for one chip of a TPU topology
(libtpu's compile-only devices, as `compile_only=`; no TPU needed). When XLA's TPU compiler
stops at its HBM check, the table shows its figure for the temporaries and "no" under fits.

    python bench/remat_memory.py                        # host CPU, batch 768
    python bench/remat_memory.py --topology v4-64       # one chip of a v4-64 slice, batch 768 per chip

Sizes are the Sudoku baseline (hidden 512, mlp_t, seq 81, 16 puzzle-embedding positions, bf16
forward, H_cycles 3) unless overridden.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CPU backend compiles; libtpu only describes the topology

import flax.linen as nn
import jax

from models.recursive_reasoning import TRM, TRMConfig, act_loss, act_step, dummy_batch, init_params, initial_carry
from runtime.compile_only import _xla_oom, topology_devices
from runtime.task import platform_compute_dtype

MiB, GiB = 1 << 20, 1 << 30


def step_memory(cfg: TRMConfig, batch: int, seq_len: int = 81, vocab: int = 11, device=None) -> dict[str, int]:
    """memory_analysis() of the compiled value-and-grad of one training ACT step (bytes), and
    whether it compiled (False: out of HBM, "temp" is then XLA's estimate from its error)."""
    model = TRM(cfg, vocab_size=vocab, seq_len=seq_len, num_puzzle_identifiers=1)
    b = dummy_batch(batch, seq_len)
    params = jax.eval_shape(lambda: nn.meta.unbox(init_params(model, jax.random.key(0), dummy_batch(1, seq_len))))
    carry = jax.eval_shape(lambda: initial_carry(model, b))
    b = jax.eval_shape(lambda: b)

    def train(p, c, bb, rng):
        def loss(pp):
            new, out = act_step(model, pp, c, bb, rng, True)
            total, sums = act_loss(out, new.current_data["labels"], new.halted, new.steps, loss_type=cfg.loss_type)
            return total / batch, (new, sums)
        return jax.value_and_grad(loss, has_aux=True)(p)

    args = (params, carry, b, jax.eval_shape(lambda: jax.random.key(1)))
    if device is not None:  # place every argument on that (compile-only) device
        sharding = jax.sharding.SingleDeviceSharding(device)
        args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), args)
    lowered = jax.jit(train).lower(*args)
    try:
        mem = lowered.compile().memory_analysis()
    except jax.errors.JaxRuntimeError as e:
        oom = _xla_oom(str(e))
        if oom is None:
            raise
        def nbytes(tree):
            return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
        return {"temp": int(oom[0] * GiB), "argument": nbytes(args[:3]), "output": None, "fits": False}
    return {"temp": mem.temp_size_in_bytes, "argument": mem.argument_size_in_bytes, "output": mem.output_size_in_bytes,
            "fits": True}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=768, help="rows per device (default 768)")
    ap.add_argument("--topology", help="TPU slice to compile one chip of, e.g. v4-64 (default: the host CPU)")
    ap.add_argument("--L-cycles", type=int, nargs="+", default=[6, 12, 24])
    ap.add_argument("--H-cycles", type=int, default=3)
    ap.add_argument("--attention", action="store_true", help="the attention variant (mlp_t=False, rope)")
    args = ap.parse_args()

    device, where = None, f"host CPU ({jax.devices()[0].device_kind})"
    if args.topology:
        gen, shape, devices = topology_devices(args.topology)
        device, where = devices[0], f"one chip of {args.topology} ({gen.device_kind}, {'x'.join(map(str, shape))})"
    platform = device.platform if device is not None else jax.default_backend()
    base = TRMConfig(H_cycles=args.H_cycles, forward_dtype=platform_compute_dtype(platform))  # "auto" on the target
    if args.attention:
        base = dataclasses.replace(base, mlp_t=False, pos_encodings="rope")
    print(f"TRM {'attention' if args.attention else 'mlp_t'} hidden {base.hidden}, seq 81 + {base.puzzle_emb_len} "
          f"prefix, {base.forward_dtype}, H_cycles {base.H_cycles}, batch {args.batch} per device; {where}\n")
    print("| L_cycles | remat | temporaries (GiB) | arguments (MiB) | outputs (MiB) | temp remat / no remat | fits |")
    print("|---:|---|---:|---:|---:|---:|---|")
    for n in args.L_cycles:
        off = None
        for remat in (False, True):
            m = step_memory(dataclasses.replace(base, L_cycles=n, remat=remat), args.batch, device=device)
            off = off or m["temp"]
            fits = "-" if device is None else ("yes" if m["fits"] else f"no (> {gen.hbm_gib} GiB HBM)")
            out = "-" if m["output"] is None else f"{m['output'] / MiB:.1f}"
            print(f"| {n} | {'on' if remat else 'off'} | {m['temp'] / GiB:.2f} | {m['argument'] / MiB:.1f} | {out} | "
                  f"{m['temp'] / off:.2f} | {fits} |", flush=True)


if __name__ == "__main__":
    main()
