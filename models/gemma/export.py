"""Export a fine-tuned Gemma checkpoint of this runner to Hugging Face safetensors.

    python -m models.gemma.export --checkpoint-dir outputs/gemma_sft/tiny_cpu/checkpoints --out hf-model [--step N]

The run's own config (saved in every checkpoint) rebuilds the state; the parameters are
restored into their shardings, LoRA adapters (if any) are merged into the base weights, and
process 0 writes `model*.safetensors` + `config.json`, one tensor at a time. On a pod, run it on
every worker (like training) so each restores its shards.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional


from runtime.errors import UserError


def export_checkpoint(checkpoint_dir: str, out_dir: str, *, step: Optional[int] = None, dtype: str = "bfloat16",
                      vocab_size: Optional[int] = None) -> int:
    """Export step `step` (default: the latest) of `checkpoint_dir`; returns the step exported."""
    from models.gemma.config import GemmaConfig
    from models.gemma.lora import merge_lora
    from models.gemma.weights import export_hf
    from runtime.builder import load_run_params

    config, step, params = load_run_params(checkpoint_dir, step)
    cfg = config.arch
    if not isinstance(cfg, GemmaConfig):
        raise UserError(f"{checkpoint_dir} holds a {cfg.name} run, not a Gemma one")
    export_hf(params, cfg, out_dir, dtype=dtype, vocab_size=vocab_size,
              merge=merge_lora if cfg.lora_rank > 0 else None)
    return step


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint-dir", required=True, help="the run's checkpoint directory (local or gs://)")
    ap.add_argument("--out", required=True, help="output folder for safetensors + config.json (local or gs://)")
    ap.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--vocab-size", type=int, help="embedding rows to write (e.g. 256000 for HF Gemma 1/2)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        step = export_checkpoint(args.checkpoint_dir, args.out, step=args.step, dtype=args.dtype,
                                 vocab_size=args.vocab_size)
    except (UserError, ValueError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(f"exported step {step} of {args.checkpoint_dir} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
