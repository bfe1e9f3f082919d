"""google-cloud-storage, gcsfs, tensorstore and Orbax's async CheckpointManager against
gcp-storage-emulator on loopback, including a GCS outage in the middle of an async save.

Observed behaviour is written down in docs/notes_gcs_emulator.md; the outage tests assert
the parts of it that are deterministic.
"""

from __future__ import annotations

import os

# Before jax / gcsfs are imported (conftest.py does the same; kept for running this file alone).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import gc
import inspect
import signal
import threading
import time
import types

import pytest

try:  # tests/ as a package or as a plain folder on sys.path (conftest.py adds it)
    from .gcs_emulator import Emulator, shorten_client_retries, start_gcs_emulator
except ImportError:
    from gcs_emulator import Emulator, shorten_client_retries, start_gcs_emulator

BUCKET = "ckpt-bucket"  # tensorstore enforces GCS naming rules (>= 3 chars), the emulator does not
CKPT_DIR = f"gs://{BUCKET}/run/checkpoints"
# First request that touches step 2's array item: the step directory and its metadata
# have been started, array data has not been written.
MID_SAVE_OF_STEP_2 = r"checkpoints/2/state/"


@pytest.fixture
def emu(tmp_path):
    with start_gcs_emulator(tmp_path) as e:
        e.apply_env()
        e.create_bucket(BUCKET)
        yield e


@pytest.fixture(scope="module", autouse=True)
def abandoned_saves_closed_here():
    """A save an outage cuts off leaves Orbax coroutines that never started (its commit steps),
    held by Orbax's own closures: close them at the end of this file, where that is expected,
    rather than let them warn "never awaited" in whichever later test frees them."""
    yield
    gc.collect()
    for obj in gc.get_objects():  # type(), not isinstance(): that reads __class__, and torch's deprecated aliases warn
        if (type(obj) is types.CoroutineType and inspect.getcoroutinestate(obj) == inspect.CORO_CREATED
                and "/orbax/" in obj.cr_code.co_filename):
            obj.close()


# ----------------------------------------------------------------------------- helpers
def _jax():
    import jax

    assert jax.device_count() >= 8, f"needs 8 CPU devices (XLA_FLAGS set too late?), have {jax.device_count()}"
    return jax


def _mesh():
    return _jax().make_mesh((4, 2), ("data", "model"))


def _state(step: int):
    """A pytree of sharded arrays whose values depend on `step`."""
    jax = _jax()
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = _mesh()
    return {
        "params": {
            "w": jax.device_put(jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32) * 0.5 + step,
                                NamedSharding(mesh, P("data", "model"))),
            "emb": jax.device_put((jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8) - step).astype(jnp.bfloat16),
                                  NamedSharding(mesh, P(None, "model"))),
        },
        "count": jax.device_put(jnp.full((16,), step, jnp.int32), NamedSharding(mesh, P("data"))),
        "step": jax.device_put(jnp.int32(step), NamedSharding(mesh, P())),
    }


def _requested_shardings():
    """Restore layout, deliberately different from the one saved."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = _mesh()
    return {
        "params": {"w": NamedSharding(mesh, P("model", "data")), "emb": NamedSharding(mesh, P())},
        "count": NamedSharding(mesh, P()),
        "step": NamedSharding(mesh, P()),
    }


def _save_args(step: int):
    import orbax.checkpoint as ocp

    return ocp.args.Composite(state=ocp.args.StandardSave(_state(step)),
                              meta=ocp.args.JsonSave({"step": step, "note": f"step {step}"}))


def _restore_args():
    import jax
    import orbax.checkpoint as ocp

    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            _state(0), _requested_shardings())
    return ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())


def _manager(max_to_keep: int = 2):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(CKPT_DIR, options=ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, enable_async_checkpointing=True))


def _assert_restores_exactly(mngr, step: int) -> None:
    import jax
    import numpy as np

    restored = mngr.restore(step, args=_restore_args())
    assert restored["meta"] == {"step": step, "note": f"step {step}"}
    want = _state(step)
    got = restored["state"]
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w, s in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(_requested_shardings())):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert g.sharding.is_equivalent_to(s, g.ndim), (g.sharding, s)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _object_names(prefix: str = "run/checkpoints/") -> set[str]:
    from google.cloud import storage

    return {b.name for b in storage.Client().list_blobs(BUCKET, prefix=prefix)}


def _drain_threads(before: set, timeout: float) -> list[str]:
    """Wait for non-daemon threads started since `before` (a failed async save leaves some);
    returns the names of those still alive."""
    deadline = time.monotonic() + timeout
    while True:  # poll: Orbax's _SignalingThread.join() re-raises the thread's error
        alive = [t.name for t in threading.enumerate() if t not in before and not t.daemon and t.is_alive()]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def _restart_after_exit(emu: Emulator, outage_s: float) -> threading.Thread:
    """In the background: wait until the emulator dies (arm_kill), keep it down `outage_s`, restart."""
    def run():
        emu.wait_exit(timeout=60)
        time.sleep(outage_s)
        emu.start()

    t = threading.Thread(target=run, name="emulator-restarter", daemon=True)
    t.start()
    return t


# ------------------------------------------------------------------------ (a), (b): clients
def test_emulator_restart_keeps_port_and_data(emu):
    from google.cloud import storage

    storage.Client().bucket(BUCKET).blob("a/b.txt").upload_from_string(b"persisted")
    port, pid = emu.port, emu.pid
    emu.stop()
    assert not emu.is_running() and not os.path.exists(f"/proc/{pid}")
    emu.start()
    assert emu.port == port and emu.pid != pid
    assert storage.Client().bucket(BUCKET).blob("a/b.txt").download_as_bytes() == b"persisted"


def test_google_cloud_storage_roundtrip(emu):
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    client = storage.Client()
    assert isinstance(client._credentials, AnonymousCredentials)  # STORAGE_EMULATOR_HOST => anonymous
    bucket = client.create_bucket("gcs-client-bucket")
    bucket.blob("dir/hello.txt").upload_from_string(b"hello")
    bucket.blob("dir/big.bin").upload_from_string(os.urandom(3 << 20))  # > 1 MiB: resumable upload
    assert client.bucket("gcs-client-bucket").blob("dir/hello.txt").download_as_bytes() == b"hello"
    assert len(bucket.blob("dir/big.bin").download_as_bytes()) == 3 << 20
    assert {b.name for b in client.list_blobs("gcs-client-bucket", prefix="dir/")} == {"dir/hello.txt", "dir/big.bin"}
    assert {b.name for b in client.list_buckets()} >= {BUCKET, "gcs-client-bucket"}


def test_gcsfs_epath_and_tensorstore_roundtrip(emu):
    import fsspec
    import gcsfs
    import tensorstore as ts
    from etils import epath

    with fsspec.open(f"gs://{BUCKET}/fs/x.txt", "wb") as f:
        f.write(b"via gcsfs")
    with fsspec.open(f"gs://{BUCKET}/fs/x.txt", "rb") as f:
        assert f.read() == b"via gcsfs"
    fs = fsspec.filesystem("gs")
    assert type(fs) is gcsfs.core.GCSFileSystem  # not the gRPC ExtendedGcsFileSystem
    assert fs.credentials.method == "anon"
    assert fs.ls(f"{BUCKET}/fs") == [f"{BUCKET}/fs/x.txt"]

    # Orbax's metadata I/O: etils.epath -> fsspec -> gcsfs (tensorflow is not installed).
    p = epath.Path(f"gs://{BUCKET}/epath/sub/file.json")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text('{"ok": true}')
    assert p.read_text() == '{"ok": true}' and p.exists()
    assert [q.name for q in p.parent.iterdir()] == ["file.json"]
    assert type(epath.backend.fsspec_backend.fs(os.fspath(p))) is gcsfs.core.GCSFileSystem

    # Orbax's array I/O: tensorstore's gcs kvstore (TENSORSTORE_GCS_HTTP_URL).
    kv = ts.KvStore.open({"driver": "gcs", "bucket": BUCKET, "path": "ts/"}).result()
    kv.write("k", b"via tensorstore").result()
    assert kv.read("k").result().value == b"via tensorstore"
    with fsspec.open(f"gs://{BUCKET}/ts/k", "rb") as f:  # same store seen by both clients
        assert f.read() == b"via tensorstore"


# ----------------------------------------------------------------------------- (c): Orbax
def test_orbax_async_manager_saves_keeps_n_and_restores_with_requested_shardings(emu):
    mngr = _manager(max_to_keep=2)
    for step in range(4):
        assert mngr.save(step, args=_save_args(step))
    mngr.wait_until_finished()
    assert mngr.all_steps() == [2, 3] and mngr.latest_step() == 3
    mngr.close()

    names = _object_names()
    for step in (2, 3):  # CommitFileTemporaryPath: written in place, completion = commit_success.txt
        for item in ("", "state/", "meta/"):
            assert f"run/checkpoints/{step}/{item}commit_success.txt" in names
        assert f"run/checkpoints/{step}/_CHECKPOINT_METADATA" in names
    assert not any(n.startswith(("run/checkpoints/0/", "run/checkpoints/1/")) for n in names)
    assert not any(".orbax-checkpoint-tmp" in n for n in names)  # no tmp dirs on GCS

    fresh = _manager()  # what a restarted job sees
    assert fresh.all_steps() == [2, 3] and fresh.latest_step() == 3
    for step in (2, 3):
        _assert_restores_exactly(fresh, step)
    fresh.close()


# ------------------------------------------------------------------ (d): outage mid-save
@pytest.mark.slow  # waits out a storage outage
def test_orbax_short_outage_mid_async_save_is_absorbed_by_client_retries(emu):
    """Emulator SIGKILLed on the first request for step 2's arrays, back after 1 s: gcsfs
    (6 tries, ~31 s) and tensorstore (32 tries, ~15 min) retry through it; nothing raises."""
    mngr = _manager()
    mngr.save(1, args=_save_args(1))
    mngr.wait_until_finished()

    emu.arm_kill(MID_SAVE_OF_STEP_2)
    restarter = _restart_after_exit(emu, outage_s=1.0)
    assert mngr.save(2, args=_save_args(2)) is True  # returns at once; I/O is in the background
    assert mngr.latest_step() == 2  # reported while the save is still in flight
    mngr.wait_until_finished()  # no exception
    restarter.join(30)
    assert mngr.all_steps() == [1, 2]
    assert "run/checkpoints/2/commit_success.txt" in _object_names()
    mngr.close()

    fresh = _manager()
    assert fresh.latest_step() == 2
    _assert_restores_exactly(fresh, 2)
    fresh.close()


@pytest.mark.slow  # waits out a storage outage
def test_orbax_long_outage_mid_async_save_fails_then_new_manager_resumes(emu):
    """Outage longer than the clients' retry budgets (shortened here so the test takes
    seconds): the error surfaces in wait_until_finished(), the step is dropped, and after
    GCS is back a new manager resumes from the last step with commit_success.txt and can
    re-save the failed step over its partial directory."""
    import aiohttp

    mngr = _manager()
    mngr.save(1, args=_save_args(1))
    mngr.wait_until_finished()

    with shorten_client_retries():
        before = set(threading.enumerate())
        emu.arm_kill(MID_SAVE_OF_STEP_2)
        assert mngr.save(2, args=_save_args(2)) is True  # save() itself does not raise
        assert emu.wait_exit(timeout=30) == -signal.SIGKILL
        assert mngr.latest_step() == 2  # in flight: still reported as the latest step
        t0 = time.monotonic()
        with pytest.raises(Exception) as excinfo:
            mngr.wait_until_finished()
        raised_after = time.monotonic() - t0
        # gcsfs' aiohttp error (connection refused) on every run so far; tensorstore errors
        # would be ValueError("...All N retry attempts failed...").
        assert isinstance(excinfo.value, (aiohttp.ClientError, OSError, ValueError)), repr(excinfo.value)
        assert mngr.latest_step() == 1 and mngr.all_steps() == [1]  # failed step dropped
        lingering = _drain_threads(before, timeout=15)
        assert not lingering, lingering
    print(f"\nwait_until_finished raised {type(excinfo.value).__module__}.{type(excinfo.value).__name__}"
          f" after {raised_after:.1f}s: {str(excinfo.value)[:200]}")

    emu.start()  # GCS is back
    names = _object_names()
    assert "run/checkpoints/1/commit_success.txt" in names
    assert "run/checkpoints/2/commit_success.txt" not in names  # step 2 is incomplete on GCS
    assert not any(n.startswith("run/checkpoints/2/state/") for n in names)

    fresh = _manager()
    assert fresh.all_steps() == [1] and fresh.latest_step() == 1  # partial step 2 is ignored
    _assert_restores_exactly(fresh, 1)
    assert fresh.save(2, args=_save_args(2))  # re-save over the partial directory
    fresh.wait_until_finished()
    assert fresh.all_steps() == [1, 2]
    _assert_restores_exactly(fresh, 2)
    fresh.close()

    # The manager that saw the failure: a later save may first re-raise a stale copy of the
    # background error (AsyncCheckpointer keeps its own); it must work after that.
    try:
        mngr.save(3, args=_save_args(3))
    except Exception as e:
        print(f"old manager: next save re-raised {type(e).__name__}; retrying once")
        mngr.save(3, args=_save_args(3))
    mngr.wait_until_finished()
    assert 3 in mngr.all_steps()
    mngr.close()
