#!/usr/bin/env bash
# Set up, then run the main job on embedded defaults as a simulated 2-process pod
# (2 processes x 4 CPU devices, joined with jax.distributed on 127.0.0.1): a Sudoku set
# generated locally, checkpoints under outputs/, W&B offline. Extra args are Hydra overrides.
source "$(dirname "$0")/venv.sh"
python experiments/launch.py local --processes 2 --devices-per-process 4 -- "$@"
echo
echo "outputs: $(ls -d outputs/*/* | head -1)  (metrics.jsonl, wandb/, checkpoints/, run_manifest.json)"
