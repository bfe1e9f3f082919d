#!/usr/bin/env bash
# Set up, then run the main job on embedded defaults as a simulated 2-process pod
# (2 processes x 4 CPU devices, joined with jax.distributed on 127.0.0.1): a Sudoku set
# generated locally, checkpoints under outputs/, W&B offline. Extra args are Hydra overrides.
source "$(dirname "$0")/venv.sh"
python experiments/launch.py local --processes 2 --devices-per-process 4 -- "$@"
echo
# The run just made (the newest manifest): outputs/ also holds other runs and the compilation cache.
echo "outputs: $(dirname "$(ls -t outputs/*/*/run_manifest.json | head -1)")  (metrics.jsonl, wandb/, checkpoints/, run_manifest.json)"
