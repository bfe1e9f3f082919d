"""Export a run's checkpoint in its model family's interchange format (Gemma: Hugging Face
safetensors + config.json, LoRA merged):

    python -m runtime.export --checkpoint-dir outputs/gemma_sft/tiny_cpu/checkpoints --out hf-model [--step N]

The run's own config (saved in every checkpoint) rebuilds the state; the parameters are
restored into their shardings and handed to the family's `Task.export`. On a pod, run it on
every worker (like training) so each restores its shards.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional

from runtime.errors import EXIT_USER_ERROR, UserError, one_line


def export_checkpoint(checkpoint_dir: str, out_dir: str, *, step: Optional[int] = None, **options) -> int:
    """Export step `step` (default: the latest) of `checkpoint_dir`; returns the step exported."""
    from runtime.builder import load_run_params
    from runtime.registry import family_of
    from runtime.task import DataShape

    config, step, params = load_run_params(checkpoint_dir, step)
    task = family_of(config.arch).build_task(config.arch, DataShape(examples=0, vocab_size=1, seq_len=8))
    task.export(params, out_dir, **options)
    return step


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint-dir", required=True, help="the run's checkpoint directory (local or gs://)")
    ap.add_argument("--out", required=True, help="output folder (local or gs://)")
    ap.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--vocab-size", type=int, help="embedding rows to write (default: the rows in use, without "
                    "padding: arch.real_vocab_size or arch.vocab_size)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        step = export_checkpoint(args.checkpoint_dir, args.out, step=args.step, dtype=args.dtype,
                                 vocab_size=args.vocab_size)
    except (UserError, ValueError) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(f"exported step {step} of {args.checkpoint_dir} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
