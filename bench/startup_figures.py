"""Measure, on this machine, the start-up figures `launch.py plan` prices (experiments/plan/bill.py
FIGURES), with the real trainer's own account of its time (its `timing` events, runtime/goodput.py).

    python bench/startup_figures.py [--root DIR] [--setup]

What it runs, each timed:
  - `gcloud version`: the gcloud CLI's own start, paid by every ssh to the workers and every
    describe of the slice (the launch, the versions check, the controller between variants);
  - the workers' versions check (`python -m experiments.launcher.worker.versions`), what the
    supervisor runs on every worker before a launch on a slice that is set up;
  - the baseline model (exp02a/L6: hidden 512, its parameters, optimizer state and EMA) trained
    on this machine's CPU with a save every 2 steps and a small generated Sudoku set, in a fresh
    run directory with an empty compilation cache, preempted (SIGTERM) once step 2 is saved, then
    relaunched: the first run's `timing` event gives runtime start-up (the process's start,
    imports included, to the backend), data loading, `other`, compiles (cache misses) and saves;
    the relaunch's, the restore and the compilation cache's hits;
  - arrays of the baseline set's shapes (Sudoku-Extreme 1000 x 1000 augmentations: 1,001,000
    training rows and the 423,168 test puzzles, 81 cells each, as data_pipeline/build_sudoku.py
    stores them) written to the work folder and read back whole, as the trainer reads a gs://
    dataset (data_pipeline/puzzle_format.py `_load_array`): the host's part of data loading;
  - with --setup: a fresh virtualenv with the project's TPU stack (`pip install -e .[tpu]`), what
    setup_tpu.sh does on a re-created slice's fresh disks.

Prints a markdown table: figure, seconds, what measured it. CPU figures, not a TPU VM's: the TPU
backend's own start and jax.distributed across hosts are not in them; `runtime_init` adds a public
figure for those (see docs/BILL.md).
"""

from __future__ import annotations

import argparse
import io
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from runtime import wire  # noqa: E402
STEPS = 12  # the fresh run is preempted once step 2 is saved, well before its end
RUN = ["+experiment=exp02a/L6", "train.global_batch_size=8", "train.epochs=null", "train.eval_every=2",
       "train.eval_every_epochs=null", "train.checkpoint_every=2", "train.checkpoint_every_epochs=null",
       "train.eval_subset=8", "train.log_every=1", "data.generate_if_missing=true", "data.generate_puzzles=200",
       "data.generate_num_aug=20", "data.generate_test_puzzles=64", "data.eval_max_examples=8",
       "run.wandb.mode=disabled", "run.progress_bar=false"]


def seconds(argv: list[str], repeat: int = 3) -> float:
    """Median wall seconds of `argv` (run from the repo)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read_baseline_set(folder: Path) -> tuple[float, int]:
    """(median seconds, bytes) to read arrays of the baseline set's shapes whole and parse them."""
    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", 1_001_000), ("test", 423_168)):
        for field in ("inputs", "labels"):
            np.save(folder / f"{split}_{field}.npy", np.zeros((rows, 81), np.uint8))
        np.save(folder / f"{split}_puzzle_identifiers.npy", np.zeros(rows, np.int32))
        np.save(folder / f"{split}_puzzle_indices.npy", np.arange(rows + 1, dtype=np.int32))
    np.save(folder / "train_group_indices.npy", np.arange(0, 1_001_001, 1001, dtype=np.int32))
    np.save(folder / "test_group_indices.npy", np.arange(423_169, dtype=np.int32))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for path in sorted(folder.glob("*.npy")):
            np.load(io.BytesIO(path.read_bytes()))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), sum(p.stat().st_size for p in folder.glob("*.npy"))


def train(root: Path, data: Path, steps: int, preempt_at: int | None = None) -> dict:
    """The last `timing` event of a trainer run (process 0's account of its wall time); with
    `preempt_at`, the run gets SIGTERM once its checkpoint of that step is committed (a preemption:
    it saves and exits 8)."""
    proc = subprocess.Popen([sys.executable, "pretrain_jax.py", *RUN, f"train.steps={steps}", f"data.path={data}",
                             f"run.root={root}"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    events, tail = [], []
    for line in proc.stdout:
        tail = (tail + [line])[-40:]
        if (event := wire.event(line)) is None:
            continue
        events.append(event)
        if preempt_at is not None and event["event"] == "checkpoint" and event["step"] >= preempt_at:
            proc.send_signal(signal.SIGTERM)
            preempt_at = None
    code = proc.wait()
    if code not in (0, 8):
        raise SystemExit(f"error: the trainer run failed (exit {code}): {''.join(tail)}")
    return [e for e in events if e["event"] == "timing"][-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=None, help="work folder (default: a temporary one, removed)")
    parser.add_argument("--setup", action="store_true", help="also time a fresh virtualenv with the TPU stack")
    args = parser.parse_args()
    root = Path(args.root or tempfile.mkdtemp(prefix="startup-figures-"))
    rows = []
    gcloud = seconds(["gcloud", "version"]) if shutil.which("gcloud") else None
    versions = seconds([sys.executable, "-m", "experiments.launcher.worker.versions", "bench"])
    if gcloud is not None:
        rows += [("launch", gcloud, "`gcloud version` (the gcloud CLI's start; the ssh itself not included)"),
                 ("setup_check", gcloud + versions,
                  "`gcloud version` + `python -m experiments.launcher.worker.versions bench`"),
                 ("between_variants", gcloud, "`gcloud version` (the controller's describe of the slice)")]
    read_s, size = read_baseline_set(root / "baseline-shapes")
    rows.append(("data_load (baseline set)", read_s, f"{size / 1e6:.0f} MB of arrays of the baseline set's shapes read "
                                                     "whole and parsed (local disk; the GCS transfer not included)"))
    train(root / "prepare", root / "data", 1)  # builds the data set (not timed)
    fresh = train(root / "runs", root / "data", STEPS, preempt_at=2)
    resumed = train(root / "runs", root / "data", STEPS)
    f, r = fresh["seconds"], resumed["seconds"]
    where = f"the baseline model on this CPU, preempted at step {fresh['step']} (the fresh run's timing event)"
    rows += [("runtime_init", f["runtime_startup"], where + ": runtime_startup"),
             ("data_load (small set)", f["data_loading"], where + ": data_loading (a small generated set)"),
             ("other", f["other"], where + ": other"),
             ("save", f["checkpoint_save"] / max(1, fresh["saves"]),
              where + f": checkpoint_save / {fresh['saves']} saves, the last waited for"),
             ("final_save", f["checkpoint_save"] / max(1, fresh["saves"]), "as save"),
             ("compile (misses)", f["program_startup"], where + f": program_startup, {fresh['misses']} misses"),
             ("restore", r["checkpoint_restore"], "the run relaunched to its end: checkpoint_restore")]
    if resumed["hits"] and not resumed["misses"]:
        rows.append(("compile_cache_hit", r["program_startup"] / resumed["hits"],
                     f"the resumed run: program_startup / {resumed['hits']} cache hits"))
    else:
        rows.append(("compile (resumed)", r["program_startup"],
                     f"the resumed run: program_startup, {resumed['hits']} hits, {resumed['misses']} misses"))
    if args.setup:
        venv = root / "venv"
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "-e", f"{REPO}[tpu]"],
                       check=True)
        rows.append(("setup_fresh (install)", time.perf_counter() - t0,
                     "`python -m venv V && V/bin/python -m pip install -e .[tpu]` (no clone, no TPU check)"))
    print("| figure | seconds | measured by |\n|---|---|---|")
    for name, value, how in rows:
        print(f"| {name} | {value:.2f} | {how} |")
    if args.root is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
