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

from omegaconf import OmegaConf

from runtime.errors import EXIT_USER_ERROR, UserError, one_line


def export_checkpoint(checkpoint_dir: str, out_dir: str, *, step: Optional[int] = None, dtype: str = "bfloat16",
                      vocab_size: Optional[int] = None) -> int:
    """Export step `step` (default: the latest) of `checkpoint_dir`; returns the step exported."""
    import jax

    from models.gemma.config import GemmaConfig
    from models.gemma.lora import merge_lora
    from models.gemma.weights import export_hf
    from runtime.checkpointing import Checkpoints
    from runtime.config import validate
    from runtime.trainer import plan_and_build

    ckpt = Checkpoints(checkpoint_dir, keep=1_000_000, async_save=False)
    try:
        step = ckpt.latest_step() if step is None else step
        if step is None or step not in ckpt.all_steps():
            raise UserError(f"no checkpoint {'step ' + str(step) if step is not None else ''} in {checkpoint_dir}; "
                            f"steps there: {ckpt.all_steps() or 'none'}")
        meta = ckpt.read_meta(step)
        saved = OmegaConf.create(meta["config"])
        if "lora_rank" not in saved.arch:
            raise UserError(f"{checkpoint_dir} holds a {saved.arch.get('name')} run, not a Gemma one")
        saved.arch = OmegaConf.merge(OmegaConf.structured(GemmaConfig), saved.arch)
        config = validate(saved)
        cfg = config.arch
        _, _, steps = plan_and_build(config, devices=jax.devices(), num_processes=jax.process_count(),
                                     train_examples=int(meta["data_position"]["train_examples"]),
                                     vocab_size=cfg.vocab_size, seq_len=8,
                                     packed=False)
        params = ckpt.restore_state(step, steps.abstract_state).params
    finally:
        ckpt.close()
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
        print(f"error: {one_line(e)}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(f"exported step {step} of {args.checkpoint_dir} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
