"""Per-chip memory of Gemma fine-tuning plans, from the real train step compiled for a TPU
topology (`compile_only`, no TPU needed), printed as a markdown table.

    python bench/gemma_memory.py                 # the README's table (about 3 minutes on 2 cores)
    python bench/gemma_memory.py --only lora     # rows whose label contains "lora"
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from runtime.errors import EXIT_DOES_NOT_FIT  # noqa: E402  (the repo on the path first)

ROWS = [  # (label, topology, overrides)
    ("2B full FT, FSDP + chunked CE + remat (shipped)", "v5e-8", ["+experiment=gemma_sft/gemma2b_full_v5e8"]),
    ("2B full FT, FSDP + plain CE", "v5e-8", ["+experiment=gemma_sft/gemma2b_full_v5e8", "arch.loss=plain"]),
    ("2B full FT, naive: replicated + plain CE", "v5e-8",
     ["+experiment=gemma_sft/gemma2b_full_v5e8", "arch.loss=plain", "mesh=data_parallel"]),
    ("2B full FT, bf16 AdamW state", "v5e-8", ["+experiment=gemma_sft/gemma2b_full_v5e8", "optim.state_dtype=bfloat16"]),
    ("2B LoRA r16 (shipped)", "v5e-8", ["+experiment=gemma_sft/gemma2b_lora_v5e8"]),
    ("2B full FT on v4-64, batch 64 (shipped)", "v4-64", ["+experiment=gemma_sft/gemma2b_full_v4_64"]),
]


def plan(topology: str, overrides: list[str]) -> dict[str, str]:
    proc = subprocess.run([sys.executable, str(REPO / "pretrain_jax.py"), *overrides, f"compile_only={topology}",
                           "run.progress_bar=false"], cwd=REPO, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    row = {"exit": str(proc.returncode)}
    for key in ("total", "arguments", "temporaries", "compile_s"):
        m = re.search(rf"^  {key}\s+(.+)$", out, re.M)
        row[key] = m.group(1).split(" per chip")[0].split(" (")[0] if m else "-"
    row["fits"] = "yes" if proc.returncode == 0 else ("no" if proc.returncode == EXIT_DOES_NOT_FIT else f"error {proc.returncode}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--only", help="substring of the row labels to run")
    args = ap.parse_args()
    print("| plan | topology | per-chip total | arguments | temporaries | fits | compile (s) |")
    print("|---|---|---|---|---|---|---|")
    for label, topology, overrides in ROWS:
        if args.only and args.only not in label:
            continue
        r = plan(topology, overrides)
        print(f"| {label} | {topology} | {r['total']} | {r['arguments']} | {r['temporaries']} | {r['fits']} | "
              f"{r['compile_s']} |", flush=True)


if __name__ == "__main__":
    main()
