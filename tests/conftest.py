"""Shared test setup: CPU devices, isolated W&B, a small generated dataset, a JAX compilation
cache shared by the whole session, and the shared reference run. The helpers the tests call
(training in this process or as a subprocess, pods, waiting, the one-error-line checks) are in
helpers.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # helper modules: helpers, gcs_emulator, wandb_offline
from helpers import (CPU_XLA_FLAGS, FAKE_GCLOUD_DIR, LAUNCH, POD_SECRET, POD_STUB, POD_WORKERS,
                     REFERENCE_EXTRA, REFERENCE_STEPS, SUITE_DEVICES, base_overrides, make_fake_workers, train,
                     train_losses, use_cpu_devices)

# Before jax/gcsfs are imported anywhere in the session.
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # never probe for a TPU (libtpu may be installed)
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={SUITE_DEVICES} {CPU_XLA_FLAGS}")
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # else gcsfs stalls on the emulator

import pytest


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory):
    """One persistent JAX compilation cache for the session: in-process runs, child processes
    (through os.environ, which child_env copies) and both pytest-xdist workers reuse each other's
    compiled programs. One folder for all: JAX's cache key hashes the cache's own path."""
    import jax

    base = tmp_path_factory.getbasetemp()
    cache = str((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "jax-cache")
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


@pytest.fixture(autouse=True)
def cpu_devices(request):
    """The test's CPU devices in this process: SUITE_DEVICES, or what its devices(n) mark asks."""
    mark = request.node.get_closest_marker("devices")
    use_cpu_devices(mark.args[0] if mark else SUITE_DEVICES)


def _built_once(tmp_path_factory, name: str, build) -> Path:
    """A folder shared by the session's pytest-xdist workers: the first to take its lock builds it
    (`build(folder)`), the others wait for that and read it."""
    import fcntl

    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    with open(f"{folder}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (folder / ".built").exists():
            folder.mkdir(exist_ok=True)
            build(folder)
            (folder / ".built").touch()
    return folder


@pytest.fixture(scope="session")
def sudoku_dir(tmp_path_factory) -> Path:
    """A small generated Sudoku dataset in the reference format (built once per session)."""
    from data_pipeline.build_sudoku import build_sudoku_dataset

    build = lambda folder: build_sudoku_dataset(folder / "sudoku", generate=360, test_size=40, min_givens=30,  # noqa: E731
                                                seed=0)
    return _built_once(tmp_path_factory, "data", build) / "sudoku"


@pytest.fixture(scope="session")
def reference_losses(sudoku_dir, tmp_path_factory) -> dict[int, float]:
    """step -> train/loss of the shared reference run (trained once per session, in process)."""
    def build(root: Path) -> None:
        use_cpu_devices(1)  # the pods and 8-device runs compared with it agree to 1e-5 all the same
        train(base_overrides(sudoku_dir, root, steps=REFERENCE_STEPS) + REFERENCE_EXTRA)
        (root / "losses.json").write_text(json.dumps(train_losses(root / "test" / "t")))

    root = _built_once(tmp_path_factory, "reference", build)
    losses = {int(step): loss for step, loss in json.loads((root / "losses.json").read_text()).items()}
    assert sorted(losses) == list(range(1, REFERENCE_STEPS + 1))
    return losses


@pytest.fixture
def pod(tmp_path: Path):
    """Fake TPU workers behind the fake gcloud (tests/fake_gcloud) with a stand-in repo at ~/repo
    (helpers.POD_STUB as its trainer), and the environment to launch with."""
    root = tmp_path / "workers"
    homes = make_fake_workers(root, POD_WORKERS, POD_STUB, activate="export STUB_VENV=1\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("WANDB_", "PODRUNNER_", "FAKE_GCLOUD_", "HF_"))}
    (tmp_path / "tmp").mkdir()  # the launcher's temporary files, inside what the tests inspect
    env.update(PATH=f"{FAKE_GCLOUD_DIR}{os.pathsep}{env.get('PATH', '')}", FAKE_GCLOUD_ROOT=str(root),
               FAKE_GCLOUD_LOG=str(tmp_path / "gcloud.jsonl"), FAKE_GCLOUD_WORKERS=str(POD_WORKERS),
               FAKE_GCLOUD_LOCAL_ONLY="WANDB_API_KEY,HF_TOKEN", TMPDIR=str(tmp_path / "tmp"),
               WANDB_API_KEY=POD_SECRET, PYTHONUNBUFFERED="1",
               PODRUNNER_LIBTPU_LOCKFILE="~/libtpu_lockfile", PODRUNNER_TPU_DEVICES="~/fake-accel*")
    started: list[subprocess.Popen] = []

    class Pod:
        def __init__(self) -> None:
            self.root, self.homes, self.env, self.tmp = root, homes, env, tmp_path

        def launch(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, str(LAUNCH), *args], cwd=tmp_path, env=env,
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)

        def gcloud_calls(self) -> list[list[str]]:
            log = tmp_path / "gcloud.jsonl"
            return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

        def spawn(self, home: Path, script: str) -> subprocess.Popen:
            """A process "on" a worker: HOME is that worker's (that is how stop/status scope it)."""
            proc = subprocess.Popen(["bash", "-c", script], cwd=home, env=dict(env, HOME=str(home)),
                                    start_new_session=True)
            started.append(proc)
            return proc

    yield Pod()
    for proc in started:  # whatever a failing test left behind
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def pytest_collection_modifyitems(config, items):
    """Files that hold slow tests run first (the order inside each file is kept): with
    `-n 2 --dist loadfile` (scripts/test.sh) the long files start early and the two workers
    finish together instead of one waiting on the last long file."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
