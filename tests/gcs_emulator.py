"""Local GCS emulator for tests (helper module, not a test file).

Runs ``gcp-storage-emulator`` as a *subprocess* on 127.0.0.1 so a test can
SIGKILL it mid-operation (simulated GCS outage) and start it again on the same
port and the same on-disk data directory.

Typical use::

    from gcs_emulator import start_gcs_emulator

    with start_gcs_emulator(tmp_path) as emu:   # started and answering
        emu.apply_env()                         # this process -> emulator
        emu.create_bucket("bkt")
        ...  # google-cloud-storage / gcsfs / tensorstore / Orbax on gs://bkt
        emu.stop()                              # SIGKILL: outage
        emu.start()                             # same port, same data
    # closed: process killed and reaped, env restored

Child processes: ``subprocess.Popen(..., env=emu.child_env())``.

Also: ``emu.arm_kill(regex)`` (emulator SIGKILLs itself on the first matching
request: a deterministic crash in the middle of an operation; then
``emu.wait_exit()`` / ``emu.start()``), ``shorten_client_retries()`` (test-only:
long outages fail in ~1 s instead of 30 s-15 min), ``reset_gcs_client_caches()``
and ``gcs_emulator_fixture()``. The launcher patches the emulator for crash-safe
writes, ``Expect: 100-continue`` and a larger accept queue, and applies
``gcs_emulator_patch`` (x-goog-generation, ifGenerationMatch); see
docs/notes_gcs_emulator.md.

Environment (see ``docs/notes_gcs_emulator.md`` for the reasons):

* ``STORAGE_EMULATOR_HOST``: google-cloud-storage (-> AnonymousCredentials,
  read when a ``Client`` is built) and gcsfs (read on every request).
* ``TENSORSTORE_GCS_HTTP_URL``: tensorstore ``gcs`` kvstore, i.e. Orbax array
  data. Read when the kvstore is opened.
* ``GOOGLE_AUTH_TOKEN_FOR_TESTING``: tensorstore uses this fixed bearer token
  instead of probing ADC files / the GCE metadata server.
* ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``: read when ``gcsfs`` is *first
  imported*; otherwise gcsfs probes the bucket type over gRPC and stalls.
* ``FSSPEC_GS_TOKEN=anon``: gcsfs skips its credential search (fsspec reads
  ``FSSPEC_*`` at import; ``apply_env`` also patches the live fsspec config).
* ``NO_GCE_CHECK=true``, ``CLOUDSDK_CONFIG=<empty dir>``,
  ``GOOGLE_CLOUD_PROJECT``: google-auth never probes the metadata server nor
  picks up a developer's gcloud credentials; a project is set.
* ``NO_PROXY``/``no_proxy`` get ``127.0.0.1,localhost`` appended.
* ``GOOGLE_APPLICATION_CREDENTIALS`` is *removed* (``UNSET_VARS``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator, Mapping, MutableMapping, Optional

from helpers import free_port

__all__ = [
    "Emulator",
    "EmulatorError",
    "UNSET_VARS",
    "gcs_emulator_fixture",
    "reset_gcs_client_caches",
    "shorten_client_retries",
    "start_gcs_emulator",
]

HOST = "127.0.0.1"
DEFAULT_PROJECT = "test-project"
# Variables removed from the environment of anything talking to the emulator.
UNSET_VARS = ("GOOGLE_APPLICATION_CREDENTIALS",)

# Live emulators of this process, killed at interpreter exit as a last resort.
_LIVE: dict[int, "Emulator"] = {}

# The child watches its parent process and exits when it is gone (reparented),
# so an emulator never outlives the test process, even if pytest is SIGKILLed.
# (PR_SET_PDEATHSIG is not used: it fires when the *thread* that started the
# child exits, which kills an emulator restarted from a helper thread.)
_LAUNCHER = r"""
import os, sys, threading, time
parent = int(sys.argv.pop(1))
def _watch_parent():
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(3)
if os.getppid() != parent:
    sys.exit(3)
threading.Thread(target=_watch_parent, name="watch-parent", daemon=True).start()
if os.environ.get("GCS_EMULATOR_ATOMIC_WRITES", "1") == "1":
    # Upstream writes files (objects and the .meta index, rewritten after every
    # mutation) with truncate+write: a SIGKILL mid-write leaves an empty .meta
    # and the next start dies with JSONDecodeError. Write temp file + rename.
    import gcp_storage_emulator.storage as _st
    _orig_write_bytes = _st._FileStore.write_bytes
    def _atomic_write_bytes(self, rel, content):
        if self._use_memory:
            return _orig_write_bytes(self, rel, content)
        rel = self._norm(rel)
        path = self._disk_path(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(".%s.tmp-%d" % (path.name, os.getpid()))
        with open(tmp, "wb") as f:
            f.write(content)
        os.replace(tmp, path)
    _st._FileStore.write_bytes = _atomic_write_bytes
# x-goog-generation and ifGenerationMatch; must run before the server module builds its routes.
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv.pop(1))))  # this tests/ folder
import gcs_emulator_patch
gcs_emulator_patch.apply()
import gcp_storage_emulator.server as _srv
import http.server as _hs
# Bigger accept queue: the server is single-threaded and tensorstore opens many
# connections at once; with the default backlog of 5, SYNs get dropped and
# curl waits a 1 s retransmit.
_hs.HTTPServer.request_queue_size = 128
_expect_100 = os.environ.get("GCS_EMULATOR_EXPECT_100", "1") == "1"
_kill_pattern = [None]
_orig_parse_request = _srv.RequestHandler.parse_request
def _parse_request(self):
    ok = _orig_parse_request(self)
    if not ok:
        return ok
    import re, signal
    from urllib.parse import parse_qs, unquote, urlparse
    if self.path.startswith("/_emulator/arm_kill"):
        # Test hook: SIGKILL this process when a later request's unquoted
        # "path?query" matches the regex (deterministic mid-operation crash).
        _kill_pattern[0] = parse_qs(urlparse(self.path).query).get("pattern", [None])[0]
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"OK")
        return False
    if _kill_pattern[0] and re.search(_kill_pattern[0], unquote(self.path)):
        sys.stderr.write("[gcs_emulator] kill trigger matched %s %s\n" % (self.command, self.path))
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    if (_expect_100 and self.request_version >= "HTTP/1.1"
            and self.headers.get("Expect", "").lower() == "100-continue"):
        # curl (tensorstore) sends "Expect: 100-continue" for bodies > 1 MiB.
        # The emulator speaks HTTP/1.0, so http.server never answers it and
        # curl stalls 1 s per upload before sending the body.
        self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self.wfile.flush()
    return ok
_srv.RequestHandler.parse_request = _parse_request
import runpy
sys.argv[0] = "gcp_storage_emulator"
runpy.run_module("gcp_storage_emulator", run_name="__main__", alter_sys=True)
"""


class EmulatorError(RuntimeError):
    pass


def _append_no_proxy(value: Optional[str]) -> str:
    items = [v for v in (value or "").split(",") if v.strip()]
    for h in (HOST, "localhost"):
        if h not in items:
            items.append(h)
    return ",".join(items)


def reset_gcs_client_caches() -> None:
    """Drop cached gcsfs/epath filesystems and Orbax's cached bucket objects.

    gcsfs caches directory listings per filesystem instance and fsspec caches
    instances; epath caches the fsspec filesystem; Orbax caches
    ``storage.Client().get_bucket``. Call this between tests that use
    different emulators (different ports or wiped data) in one process, or
    after another process wrote to the same prefix.
    """
    if "gcsfs" in sys.modules:
        import gcsfs  # pylint: disable=import-outside-toplevel

        for cls in {gcsfs.GCSFileSystem, gcsfs.core.GCSFileSystem}:
            for fs in list(getattr(cls, "_cache", {}).values()):
                with contextlib.suppress(Exception):
                    fs.invalidate_cache()
            cls.clear_instance_cache()
    if "etils.epath" in sys.modules:
        with contextlib.suppress(Exception):
            from etils.epath import backend  # pylint: disable=import-outside-toplevel

            backend._FileSystemSpecBackend._get_filesystem.cache_clear()
    mod = sys.modules.get("orbax.checkpoint._src.path.gcs_utils")
    if mod is not None and hasattr(mod.get_bucket, "cache_clear"):
        mod.get_bucket.cache_clear()


@contextlib.contextmanager
def shorten_client_retries(
    *,
    gcsfs_backoff_scale: float = 0.01,
    tensorstore_max_retries: int = 2,
    orbax_signal_timeout_secs: int = 3,
) -> Iterator[None]:
    """Test-only: make a long GCS outage fail in about a second, not minutes.

    Defaults (what production sees) and what this changes:

    * gcsfs: 6 attempts, sleeps ~1+2+4+8+16 s (+jitter) -> a request fails
      after ~31-36 s of outage. The attempt count is baked into a decorator,
      so the backoff *sleeps* are scaled by ``gcsfs_backoff_scale`` instead.
    * tensorstore ``gcs`` kvstore (Orbax array data): ``gcs_request_retries``
      context resource, default 32 attempts, 1 s doubling to 32 s (~15 min).
      Set via Orbax's module-level TensorStore context dicts (private API).
    * Orbax: helper threads of an async save wait for the "directory created"
      signal for ``multihost.coordination_timeout()`` = 300 s; if directory
      creation failed they linger (non-daemon) and delay interpreter exit.

    Patches apply to saves *started* inside the ``with`` block.
    """
    import gcsfs.retry as gretry  # pylint: disable=import-outside-toplevel
    from orbax.checkpoint._src.multihost import multihost  # pylint: disable=import-outside-toplevel
    from orbax.checkpoint._src.serialization import tensorstore_utils as tsu  # pylint: disable=import-outside-toplevel

    real_asyncio = gretry.asyncio

    class _ScaledAsyncio:
        def __getattr__(self, name):
            return getattr(real_asyncio, name)

        @staticmethod
        async def sleep(delay, *args, **kwargs):
            return await real_asyncio.sleep(delay * gcsfs_backoff_scale, *args, **kwargs)

    retries = {"max_retries": tensorstore_max_retries, "initial_delay": "20ms", "max_delay": "100ms"}
    ctx_dicts = [tsu._BASE_TS_CONTEXT, tsu._DEFAULT_OCDBT_TS_CONTEXT]
    saved_ctx = [d.get("gcs_request_retries") for d in ctx_dicts]
    saved_timeout = multihost._DEFAULT_BARRIER_TIMEOUT
    gretry.asyncio = _ScaledAsyncio()
    for d in ctx_dicts:
        d["gcs_request_retries"] = retries
    multihost._DEFAULT_BARRIER_TIMEOUT = orbax_signal_timeout_secs
    try:
        yield
    finally:
        gretry.asyncio = real_asyncio
        for d, old in zip(ctx_dicts, saved_ctx):
            if old is None:
                d.pop("gcs_request_retries", None)
            else:
                d["gcs_request_retries"] = old
        multihost._DEFAULT_BARRIER_TIMEOUT = saved_timeout


class Emulator:
    """A gcp-storage-emulator subprocess bound to ``127.0.0.1:port``.

    Data lives on disk under ``data_dir/.cloudstorage`` (objects as files plus
    a ``.meta`` JSON index rewritten after every mutation), so it survives
    ``stop()`` / ``start()``.
    """

    def __init__(
        self,
        data_dir: os.PathLike | str,
        *,
        port: Optional[int] = None,
        project: str = DEFAULT_PROJECT,
        log_path: Optional[os.PathLike | str] = None,
        quiet: bool = True,
        atomic_writes: bool = True,
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = int(port) if port else free_port()
        self.host = HOST
        self.project = project
        self.quiet = quiet
        self.atomic_writes = atomic_writes
        self.log_path = Path(log_path) if log_path else self.data_dir / "emulator.log"
        self._gcloud_dir = self.data_dir / "gcloud-config-empty"
        self._gcloud_dir.mkdir(exist_ok=True)
        self._proc: Optional[subprocess.Popen] = None
        self._saved_env: Optional[dict[str, Optional[str]]] = None

    # ------------------------------------------------------------------ info
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    @property
    def storage_dir(self) -> Path:
        """Where the emulator keeps objects (``<bucket>/<object>``) and ``.meta``."""
        return self.data_dir / ".cloudstorage"

    @property
    def env(self) -> dict[str, str]:
        """Variables to set for this or a child process (see module doc)."""
        return {
            "STORAGE_EMULATOR_HOST": self.url,
            "TENSORSTORE_GCS_HTTP_URL": self.url,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "gcs-emulator-fake-token",
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            "FSSPEC_GS_TOKEN": "anon",
            "NO_GCE_CHECK": "true",
            "CLOUDSDK_CONFIG": str(self._gcloud_dir),
            "GOOGLE_CLOUD_PROJECT": self.project,
            "NO_PROXY": _append_no_proxy(os.environ.get("NO_PROXY")),
            "no_proxy": _append_no_proxy(os.environ.get("no_proxy")),
        }

    def child_env(self, base: Optional[Mapping[str, str]] = None) -> dict[str, str]:
        """A full environment for ``subprocess``: ``base`` (default os.environ)
        plus ``env`` minus ``UNSET_VARS``."""
        out = dict(os.environ if base is None else base)
        for k in UNSET_VARS:
            out.pop(k, None)
        out.update(self.env)
        return out

    # ------------------------------------------------------------- lifecycle
    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 30.0) -> "Emulator":
        """Start (or restart) on the same port and data dir; wait until it answers."""
        if self.is_running():
            return self
        self._proc = None
        cmd = [
            sys.executable,
            "-c",
            _LAUNCHER,
            str(os.getpid()),
            str(Path(__file__).resolve()),  # where gcs_emulator_patch lives
            "--data-dir",
            str(self.data_dir),
            "start",
            "--host",
            self.host,
            "--port",
            str(self.port),
        ]
        if self.quiet:
            cmd.append("--quiet")
        env = dict(os.environ)
        # The emulator's own settings (data dir is also passed with --data-dir).
        env.update(
            STORAGE_BASE=str(self.data_dir),
            STORAGE_DIR=".cloudstorage",
            PYTHONUNBUFFERED="1",
            GCS_EMULATOR_ATOMIC_WRITES="1" if self.atomic_writes else "0",
        )
        deadline = time.monotonic() + timeout
        while True:
            with open(self.log_path, "ab") as log:
                log.write(f"\n--- start {time.strftime('%H:%M:%S')} port {self.port}\n".encode())
                log.flush()
                self._proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,  # own process group; Ctrl-C in pytest won't hit it
                    close_fds=True,
                )
            _LIVE[self._proc.pid] = self
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    break
                if self._ping():
                    return self
                time.sleep(0.05)
            rc = self._proc.poll()
            self._kill()
            tail = self._log_tail()
            if rc is None:
                raise EmulatorError(
                    f"gcp-storage-emulator did not answer on {self.url} within {timeout}s; "
                    f"log: {self.log_path}\n{tail}"
                )
            # Exited early. Retry only a port still held (e.g. just after a kill).
            if "Address already in use" not in tail or time.monotonic() >= deadline:
                raise EmulatorError(
                    f"gcp-storage-emulator exited rc={rc} on start; log: {self.log_path}\n{tail}"
                )
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGKILL the emulator (simulated outage) and reap it. Data stays on disk."""
        self._kill()

    def close(self) -> None:
        """Stop the emulator and restore any env changed by ``apply_env``."""
        self._kill()
        self.restore_env()

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        _LIVE.pop(proc.pid, None)
        if proc.poll() is None:
            # start_new_session=True makes pgid == pid: this kills exactly the
            # group we created (the emulator is a single process with threads).
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            raise EmulatorError(f"emulator pid {proc.pid} did not die after SIGKILL")

    def arm_kill(self, pattern: str) -> None:
        """Make the emulator SIGKILL itself on the first later request whose
        unquoted ``path?query`` matches the regex ``pattern``, before answering
        it. Deterministic "GCS died in the middle of this operation". Object
        names appear in the URL for JSON-API GET/DELETE/PATCH and tensorstore
        uploads (``...?uploadType=media&name=<object>``), but not for gcsfs
        multipart uploads (name in the body). Call ``wait_exit()`` then
        ``start()`` to bring it back."""
        from urllib.parse import quote  # pylint: disable=import-outside-toplevel

        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"{self.url}/_emulator/arm_kill?pattern={quote(pattern)}", timeout=5) as r:
            if r.status != 200:
                raise EmulatorError(f"arm_kill -> HTTP {r.status}")

    def wait_exit(self, timeout: float = 30.0) -> Optional[int]:
        """Wait for the emulator process to exit on its own (e.g. ``arm_kill``);
        returns its exit code (``-9`` for SIGKILL) and reaps it."""
        proc = self._proc
        if proc is None:
            return None
        rc = proc.wait(timeout=timeout)
        self._kill()
        return rc

    def _ping(self) -> bool:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(self.url + "/", timeout=1) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    # ----------------------------------------------------------------- env
    def apply_env(self, environ: Optional[MutableMapping[str, str]] = None) -> None:
        """Point this process at the emulator (``close()`` restores the env).

        Must run before ``gcsfs`` is first imported (its gRPC/HNS switch is
        read at import); raises if it was already imported with that switch
        on. Also patches the live fsspec config (``FSSPEC_GS_TOKEN``) and
        drops cached gcsfs/epath/Orbax client objects.
        """
        environ = os.environ if environ is None else environ
        if self._saved_env is None:
            keys = set(self.env) | set(UNSET_VARS)
            self._saved_env = {k: environ.get(k) for k in keys}
        for k in UNSET_VARS:
            environ.pop(k, None)
        environ.update(self.env)
        gcsfs = sys.modules.get("gcsfs")
        if gcsfs is not None and gcsfs.GCSFileSystem.__name__ != "GCSFileSystem":
            raise EmulatorError(
                "gcsfs was imported before GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false "
                f"was set (gcsfs.GCSFileSystem is {gcsfs.GCSFileSystem.__name__}); "
                "set it before anything imports gcsfs (e.g. at the top of conftest.py)."
            )
        if "fsspec" in sys.modules:
            import fsspec.config  # pylint: disable=import-outside-toplevel

            fsspec.config.conf.setdefault("gs", {})["token"] = "anon"
            fsspec.config.conf.setdefault("gcs", {})["token"] = "anon"
        reset_gcs_client_caches()

    def restore_env(self, environ: Optional[MutableMapping[str, str]] = None) -> None:
        environ = os.environ if environ is None else environ
        saved, self._saved_env = self._saved_env, None
        if saved is None:
            return
        for k, v in saved.items():
            if v is None:
                environ.pop(k, None)
            else:
                environ[k] = v
        reset_gcs_client_caches()

    # ------------------------------------------------------------- buckets
    def create_bucket(self, name: str) -> None:
        """Create ``name`` via the JSON API (idempotent: 409 is fine)."""
        body = json.dumps({"name": name}).encode()
        req = urllib.request.Request(
            f"{self.url}/storage/v1/b?project={self.project}",
            data=body,
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(req, timeout=10) as r:
                if r.status != 200:
                    raise EmulatorError(f"create_bucket({name}) -> HTTP {r.status}")
        except urllib.error.HTTPError as e:
            if e.code != 409:
                raise EmulatorError(f"create_bucket({name}) -> HTTP {e.code}: {e.read()!r}") from e

    # ------------------------------------------------------- context manager
    def __enter__(self) -> "Emulator":
        if not self.is_running():
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Emulator(url={self.url!r}, pid={self.pid}, data_dir={str(self.data_dir)!r})"


def start_gcs_emulator(
    tmp_dir: os.PathLike | str,
    *,
    port: Optional[int] = None,
    project: str = DEFAULT_PROJECT,
    timeout: float = 30.0,
) -> Emulator:
    """Start an emulator with data under ``tmp_dir/gcs-emulator``; returns it
    running. Use it as a context manager (or call ``close()``)."""
    emu = Emulator(Path(tmp_dir) / "gcs-emulator", port=port, project=project)
    emu.start(timeout=timeout)
    return emu


@contextlib.contextmanager
def gs_bucket(tmp_dir: os.PathLike | str, bucket: str):
    """A running emulator that this process talks to, with `bucket` created; yields an fsspec
    "gs" filesystem. EmulatorError when gcsfs was imported earlier in the process without the
    emulator switch (apply_env cannot take effect then: conftest.py sets it first)."""
    import fsspec  # pylint: disable=import-outside-toplevel

    with start_gcs_emulator(tmp_dir) as emu:
        emu.apply_env()
        emu.create_bucket(bucket)
        yield fsspec.filesystem("gs")


def gcs_emulator_fixture(scope: str = "function", *, apply_env: bool = True):
    """Build a pytest fixture yielding a started :class:`Emulator`.

    In a conftest or test module: ``gcs_emulator = gcs_emulator_fixture()``.
    With ``apply_env`` the process env points at it for the fixture's life.
    """
    import pytest  # pylint: disable=import-outside-toplevel

    @pytest.fixture(scope=scope)
    def _fixture(tmp_path_factory) -> Iterator[Emulator]:
        emu = start_gcs_emulator(tmp_path_factory.mktemp("gcs"))
        try:
            if apply_env:
                emu.apply_env()
            yield emu
        finally:
            emu.close()

    return _fixture


@atexit.register
def _kill_leftovers() -> None:
    for emu in list(_LIVE.values()):
        with contextlib.suppress(Exception):
            emu._kill()
