"""Shared test setup: CPU devices, isolated W&B, a small generated dataset, a JAX compilation
cache shared by the whole session, and two ways to run training: `train` (the trainer in this
process, as `pretrain_jax.py` runs it) and `run_pretrain` (the script as a real subprocess, for
tests of the command line, signals, pods and the watchdog)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from runtime.cpu_backend import YNN_DOTS_ONLY  # standard library only: before jax

# Before jax/gcsfs are imported anywhere in the session.
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # never probe for a TPU (libtpu may be installed)
# The tests' models are tiny: compiling dominates, and LLVM's -O0 compiles CPU code about twice as
# fast (same HLO passes and float semantics; only the generated machine code is less optimised).
# The YNNPACK flag is the one pretrain_jax.py adds on CPU (runtime/cpu_backend.py): with it in both,
# in-process runs and child processes keep sharing the compilation cache (its key hashes XLA_FLAGS).
CPU_XLA_FLAGS = f"--xla_backend_optimization_level=0 {YNN_DOTS_ONLY}"
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {CPU_XLA_FLAGS}")
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # else gcsfs stalls on the emulator

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # helper modules: gcs_emulator, wandb_offline


def child_env(devices: int = 8, *, optimized: bool = False, **extra: str) -> dict[str, str]:
    """The environment of a child process on `devices` CPU devices. `optimized`: XLA's default
    optimisation instead of -O0, for children whose running time is in executing larger steps
    rather than compiling tiny ones (3x faster for the programme's smoke runs)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "JAX_COORDINATOR", "JAX_NUM_PROC", "JAX_PROCESS_ID"))}
    flags = YNN_DOTS_ONLY if optimized else CPU_XLA_FLAGS
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {flags}",
               GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false", PYTHONUNBUFFERED="1", WANDB_SILENT="true")
    env.update(extra)
    return env


def run_pretrain(overrides: list[str], *, devices: int = 8, timeout: float = 300, env: dict | None = None,
                 check: bool = True, optimized: bool = False) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(REPO / "pretrain_jax.py"), *overrides], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=env or child_env(devices, optimized=optimized))
    if check and proc.returncode != 0:
        raise AssertionError(f"pretrain_jax.py exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory):
    """One persistent JAX compilation cache for the session: in-process runs and child processes
    (through os.environ, which child_env copies) reuse each other's compiled programs."""
    import jax

    cache = str(tmp_path_factory.getbasetemp() / "jax-cache")
    settings = {"jax_compilation_cache_dir": cache, "jax_persistent_cache_min_compile_time_secs": 0,
                "jax_persistent_cache_min_entry_size_bytes": 0}
    os.environ.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    for name, value in settings.items():
        jax.config.update(name, value)
    yield cache
    for name in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                 "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"):
        os.environ.pop(name, None)


@dataclass
class Trained:
    code: int  # the exit code pretrain_jax.py would give
    log: str  # the run's log lines (the `runtime` loggers), one per line
    error: str | None = None  # a UserError's one-line message (pretrain_jax.py prints it as "error: ...")


def compose_config(overrides: list[str]):
    """The validated Config that `pretrain_jax.py <overrides>` would run."""
    from hydra import compose, initialize_config_dir

    from runtime.config import register_schemas, validate

    register_schemas()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=list(overrides))
    experiment = next((o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("experiment=")), None)
    return validate(cfg, experiment)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def train(overrides: list[str], *, check: bool = True) -> Trained:
    """Run the trainer in this process (one process, the session's 8 CPU devices), as
    `pretrain_jax.py <overrides>` would: a UserError becomes its exit code and one-line message.
    The root logger and the SIGTERM handler are restored afterwards."""
    from runtime.errors import UserError
    from runtime.trainer import run

    root, handler = logging.getLogger(), _Lines()
    handlers, level, on_sigterm = root.handlers[:], root.level, signal.getsignal(signal.SIGTERM)
    logging.getLogger("runtime").addHandler(handler)
    try:
        result = Trained(run(compose_config(overrides)), "")
    except UserError as e:
        result = Trained(e.exit_code, "", str(e))
    finally:
        logging.getLogger("runtime").removeHandler(handler)
        root.handlers[:] = handlers  # setup_logging's basicConfig(force=True) replaced them
        root.setLevel(level)
        signal.signal(signal.SIGTERM, on_sigterm)  # PreemptionWatcher.close() leaves SIG_DFL
    result.log = "\n".join(handler.lines)
    if check and result.code != 0:
        raise AssertionError(f"training exited {result.code}: {result.error}\n--- log\n{result.log[-6000:]}")
    return result


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def train_losses(output_dir: Path) -> dict[int, float]:
    """step -> train/loss from a run's metrics.jsonl (log_every=1 gives every step)."""
    return {r["step"]: r["train/loss"] for r in read_jsonl(Path(output_dir) / "metrics.jsonl") if "train/loss" in r}


@pytest.fixture(scope="session")
def sudoku_dir(tmp_path_factory) -> Path:
    """A small generated Sudoku dataset in the reference format (built once per session)."""
    from data_pipeline.build_sudoku import build_sudoku_dataset

    root = tmp_path_factory.mktemp("data") / "sudoku"
    build_sudoku_dataset(root, generate=360, test_size=40, min_givens=30, seed=0)
    return root


def base_overrides(data: Path, root: Path, *, steps: int = 8, name: str = "t", wandb: str = "disabled") -> list[str]:
    """A fast run: tiny model, batch 16, every step logged, checkpoints at half-way and end,
    W&B off (tests of W&B output pass wandb="offline")."""
    return [f"data.path={data}", "data.generate_if_missing=false", f"run.root={root}", "run.progress_bar=false",
            "run.group=test", f"run.name={name}", f"train.steps={steps}", "train.log_every=1",
            f"train.checkpoint_every={steps // 2}", f"train.eval_every={steps}", "train.global_batch_size=16",
            "arch.hidden=32", "arch.heads=2", "optim.warmup_steps=2", f"run.wandb.mode={wandb}"]


# The shared reference: REFERENCE_STEPS steps of base_overrides + REFERENCE_EXTRA, uninterrupted.
# Tests that stop and resume a run with these settings (and any checkpoint/mesh settings, which do
# not change the losses) compare against its losses instead of training their own.
REFERENCE_STEPS, REFERENCE_EXTRA = 60, ["optim.ema_rate=0.9"]


@pytest.fixture(scope="session")
def reference_losses(sudoku_dir, tmp_path_factory) -> dict[int, float]:
    """step -> train/loss of the shared reference run (trained once per session, in process)."""
    root = tmp_path_factory.mktemp("reference")
    train(base_overrides(sudoku_dir, root, steps=REFERENCE_STEPS) + REFERENCE_EXTRA)
    losses = train_losses(root / "test" / "t")
    assert sorted(losses) == list(range(1, REFERENCE_STEPS + 1))
    return losses


def pytest_collection_modifyitems(config, items):
    """Files that hold slow tests run first (the order inside each file is kept): with
    `-n 2 --dist loadfile` (scripts/test.sh) the long files start early and the two workers
    finish together instead of one waiting on the last long file."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
