"""One writer per run directory: a lease with a heartbeat.

Two launches on one run directory would both resume the same step and both write steps,
checkpoints and metrics into it. So process 0 takes a lease on the run's directories before
anything is written there, renews it from a daemon thread every `run.lease.renew_every_s`,
and releases it when the run ends; any other run is refused with one line naming the holder.
A lease not renewed for `run.lease.stale_after_s` (the holder crashed or hangs) is taken over;
on the holder's own host, a lease whose process is gone is taken over at once.

The lease is a small JSON record, `<dir>/.lease.json` (holder's host, pid, run, run id, time
of the last heartbeat, a random token that tells leases apart):

* local paths: created with O_CREAT|O_EXCL (only if absent); renewed by writing a temp file
  and renaming it over the record (on a full disk: rewritten in place); a stale record is
  taken over by renaming it aside (of two runs taking over at once, exactly one rename
  succeeds), checking it is the record judged stale, and creating a new one.
* gs://: an object written with a generation precondition: ifGenerationMatch=0 creates it
  only if absent; renewals and take-overs name the generation they read, so of two writers
  exactly one succeeds (google-cloud-storage, as preflight uses).

Both directories are leased (once when they are the same): the output directory, which
holds metrics.jsonl, the manifest and W&B files, and the checkpoint directory, the durable
one (on gs:// for pods), which runs with different run.root values may share through
run.checkpoint.dir. Only process 0 holds the lease, taken after preflight and before the
checkpoint manager is opened; `hold_run_lease` tells every process of a pod the outcome
(they wait for it), so all of them stop with the same line when refused. If renewals keep
failing (storage unreachable) or another run took the lease over (this process was stalled
longer than the stale period), the heartbeat thread ends the process at once with one line
and exit 6 rather than let two runs write on; it notices within one renewal period.

Hosts' clocks are compared (heartbeat times are wall-clock): keep them in sync (NTP).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import socket
import threading
import time
from typing import Any, Callable, Optional, Sequence

from runtime import liveness
from runtime.atomic import write_atomic
from runtime.errors import StorageError, UserError, one_line, storage_fault, storage_fix
from runtime.preflight import RUN_MARKER, split_gs

log = logging.getLogger(__name__)

LEASE_FILE = ".lease.json"
GCS_TIMEOUT_S = 15.0

# Tokens of the leases held by this process: a record naming this host and pid but none of
# these was left by an earlier run in this process (a test session, a notebook).
_HELD: set[str] = set()


class LeaseHeld(UserError):
    """Another live run holds the lease (exit 2: found before anything is compiled or written)."""

    failure = "lease-held"  # its class in the `failed` event (runtime/events.py): wait, do not give up


class _RenewFailed(Exception):
    """Storage failed while renewing the record in `store`."""

    def __init__(self, store, error: BaseException):
        super().__init__(str(error))
        self.store, self.error = store, error


def _now() -> float:
    return time.time()


def _age(record: dict[str, Any]) -> float:
    """Seconds since the record's last heartbeat (a record edited by hand may hold anything)."""
    try:
        return _now() - float(record.get("heartbeat", 0))
    except (TypeError, ValueError):
        return float("inf")


def describe(record: dict[str, Any]) -> str:
    age = _age(record)
    run_id = record.get("run_id") or "not yet known"
    return (f"run {record.get('run', '?')} (id {run_id}) on host {record.get('host', '?')}, pid {record.get('pid', '?')}, "
            f"last heartbeat {age:.0f}s ago")


# --------------------------------------------------------------------------------- stores


class LocalStore:
    """The record as a local file; `version` is its content (what a compare needs)."""

    def __init__(self, directory: str):
        self.where = directory
        self.path = os.path.join(os.path.abspath(directory), LEASE_FILE)

    def read(self) -> tuple[Optional[dict], Any]:
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
            mtime = os.path.getmtime(self.path)
        except FileNotFoundError:
            return None, None
        return _parse(raw, mtime), raw

    def create(self, raw: bytes) -> Any:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)  # only if absent
        except FileExistsError:
            return None
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
        except OSError:  # a full disk: leave no empty record behind
            _remove(self.path)
            raise
        return raw

    def mark(self, raw: bytes) -> None:
        """Leave the run directory's marker (preflight.RUN_MARKER), unless one is there already."""
        try:
            fd = os.open(os.path.join(os.path.dirname(self.path), RUN_MARKER), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return
        with os.fdopen(fd, "wb") as f:
            f.write(raw)

    @contextlib.contextmanager
    def _exclusive(self):
        """Renewals and take-overs one at a time (an flock beside the record): each reads, compares
        and writes as one step, so that a renewal never lands on a record another run just took over."""
        try:
            fd = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:  # no room even for an empty file: the rename-aside protocol alone
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def renew(self, raw: bytes, version: Any) -> Any:
        with self._exclusive():
            return self._renew(raw, version)

    def _renew(self, raw: bytes, version: Any) -> Any:
        if self.read()[1] != version:
            return None
        try:
            write_atomic(self.path, raw)  # readers see the old record or the new one, never a torn one
        except OSError as e:
            if storage_fault(e) not in ("no space left on device", "disk quota exceeded"):
                raise
            with open(self.path, "r+b") as f:  # a full disk: rewrite the record's own block in place (a
                f.write(raw)  # reader that catches it half-written judges it by its fresh mtime: held)
                f.truncate(len(raw))
        return raw

    def take_over(self, raw: bytes, version: Any) -> Any:
        with self._exclusive():
            return self._take_over(raw, version)

    def _take_over(self, raw: bytes, version: Any) -> Any:
        aside = f"{self.path}.stale-{secrets.token_hex(6)}"
        try:
            os.rename(self.path, aside)  # of two runs taking over at once, exactly one gets here
        except FileNotFoundError:
            return None
        try:
            with open(aside, "rb") as f:
                moved = f.read()
            if moved != version:  # renewed since it was judged stale: its holder is live, put it back
                self.create(moved)
                return None
            return self.create(raw)
        finally:
            _remove(aside)

    def delete(self, version: Any) -> None:
        if self.read()[1] == version:
            _remove(self.path)


def _settled(store, held: Optional[dict[str, Any]], wait_s: float = 1.0) -> Optional[dict[str, Any]]:
    """The record as its writer finishes it: one read while it was being written (cut short, no
    token) is read again for up to `wait_s`, so that the message names the run that holds it."""
    deadline = time.monotonic() + wait_s
    while held is not None and held.get("token") is None and time.monotonic() < deadline:
        time.sleep(0.05)
        held = store.read()[0]
    return held


def _parse(raw: bytes, written_at: float) -> dict[str, Any]:
    """The record; one damaged by hand (or cut short) is judged by when it was written only."""
    try:
        record = json.loads(raw)
        if isinstance(record, dict) and "token" in record:
            return record
    except ValueError:
        pass
    return {"heartbeat": written_at, "token": None}


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


class GcsStore:
    """The record as a GCS object; `version` is its generation (a precondition of every write)."""

    # google.* is imported in the methods: optional heavy (0.8 s), needed only for gs:// leases

    def __init__(self, url: str, timeout_s: float = GCS_TIMEOUT_S):
        self.where = url
        self.bucket_name, prefix = split_gs(url)
        self.name = "/".join(p for p in (prefix, LEASE_FILE) if p)
        self.timeout_s = timeout_s
        self._bucket = None

    def _blob(self):
        if self._bucket is None:
            from google.cloud import storage

            try:
                client = storage.Client()
            except OSError:  # no default project: not needed for object calls
                client = storage.Client(project=None)
            self._bucket = client.bucket(self.bucket_name)
        return self._bucket.blob(self.name)

    def _kw(self) -> dict[str, Any]:
        from google.cloud.storage.retry import DEFAULT_RETRY

        retry = DEFAULT_RETRY.with_timeout(self.timeout_s).with_delay(initial=0.2, maximum=2.0, multiplier=2.0)
        return {"timeout": (min(5.0, self.timeout_s), self.timeout_s), "retry": retry}

    def read(self) -> tuple[Optional[dict], Any]:
        from google.api_core.exceptions import NotFound

        blob = self._blob()
        try:
            raw = blob.download_as_bytes(**self._kw())
        except NotFound:
            return None, None
        return _parse(raw, 0.0), blob.generation

    def _write(self, raw: bytes, generation: int) -> Any:
        from google.api_core.exceptions import PreconditionFailed

        blob = self._blob()
        try:
            blob.upload_from_string(raw, content_type="application/json", if_generation_match=generation,
                                    **self._kw())
        except PreconditionFailed:
            return None
        return blob.generation

    def create(self, raw: bytes) -> Any:
        return self._write(raw, 0)

    def mark(self, raw: bytes) -> None:
        """Leave the run directory's marker (preflight.RUN_MARKER), unless one is there already."""
        from google.api_core.exceptions import PreconditionFailed

        blob = self._blob().bucket.blob(self.name[:-len(LEASE_FILE)] + RUN_MARKER)
        try:
            blob.upload_from_string(raw, content_type="application/json", if_generation_match=0, **self._kw())
        except PreconditionFailed:
            pass

    def renew(self, raw: bytes, version: Any) -> Any:
        return self._write(raw, version)

    take_over = renew

    def delete(self, version: Any) -> None:
        from google.api_core.exceptions import NotFound, PreconditionFailed

        try:  # one attempt: the run is ending, and a record left behind goes stale by itself
            self._blob().delete(if_generation_match=version, timeout=5.0, retry=None)
        except (NotFound, PreconditionFailed):
            pass


def store_for(directory: str):
    return GcsStore(directory) if directory.startswith("gs://") else LocalStore(directory)


# ---------------------------------------------------------------------------------- lease


def _exit_on_loss(error: StorageError) -> None:
    """The default reaction to a lost lease: stop now (the main thread may be mid-write), through
    the liveness channel, so that a pod's other processes say "stopped with exit code 6, its log
    says why" and process 0 waits for them to go first."""
    liveness.stop(str(error), error.exit_code)


class Lease:
    """The lease on a run's directories. `targets`: (directory, what it is, the setting that
    picks another) for each; `run`: the run's group/name."""

    def __init__(self, targets: Sequence[tuple[str, str, str]], *, run: str, run_id: Optional[str] = None,
                 renew_every_s: float = 30.0, stale_after_s: float = 90.0,
                 on_lost: Callable[[StorageError], None] = _exit_on_loss, clock: Callable[[], float] = time.monotonic):
        self.targets = [(store_for(d), what, setting) for d, what, setting in targets]
        self.record: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid(), "run": run, "run_id": run_id,
                       "heartbeat": 0.0, "stale_after_s": stale_after_s, "token": secrets.token_hex(8)}
        self.renew_every_s, self.stale_after_s, self.on_lost = renew_every_s, stale_after_s, on_lost
        self._clock = clock  # measures how long renewals have failed (a test steps it by hand)
        self._versions: dict[int, Any] = {}  # index of a target -> the version of our record there
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._renewed = 0.0  # monotonic time of the last successful renewal of every target

    # -- taking and giving back

    def acquire(self) -> "Lease":
        """Take the lease on every target (or none: LeaseHeld) and start the heartbeat."""
        _HELD.add(self.record["token"])
        try:
            for i, (store, what, setting) in enumerate(self.targets):
                self._versions[i] = self._acquire_one(store, what, setting)
            marker = json.dumps({"run": self.record["run"], "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode()
            for store, _, _ in self.targets:  # a later run knows the folder as a run directory of ours
                _io(store, "mark", lambda: store.mark(marker))
        except BaseException:
            self.release()
            raise
        self._renewed = self._clock()
        threading.Thread(target=self._heartbeat, name="run-lease-heartbeat", daemon=True).start()
        return self

    def _acquire_one(self, store, what: str, setting: str) -> Any:
        for _ in range(5):  # only a concurrent create or take-over makes this go round
            raw = self._raw()
            version = _io(store, "take the lease on", lambda: store.create(raw))
            if version is not None:
                return version
            held, seen = _io(store, "read the lease of", store.read)
            if held is None:
                continue  # released meanwhile
            if held.get("token") == self.record["token"]:
                return seen  # a retried create of ours whose first attempt had gone through
            reason = self.stale_reason(held)
            if reason is None:
                raise LeaseHeld(f"{what} {store.where} is in use by another run: {describe(held)}; wait for it to finish, "
                                f"stop it, or use another {setting}. If that run crashed, relaunch once its lease is "
                                f"stale ({_stale_after(held, self.stale_after_s):g}s after its last heartbeat)")
            version = _io(store, "take over the lease on", lambda: store.take_over(raw, seen))
            if version is not None:
                log.warning("took over the lease on %s from %s: %s", store.where, describe(held), reason)
                return version
        raise LeaseHeld(f"{what} {store.where}: other runs keep taking its lease; stop them or use another {setting}")

    def stale_reason(self, held: dict[str, Any]) -> Optional[str]:
        """Why a record found in place may be taken over, or None while its holder is live."""
        age = _age(held)
        limit = _stale_after(held, self.stale_after_s)
        if age > limit:
            return f"its last heartbeat is {age:.0f}s old (stale after {limit:g}s)"
        if held.get("host") != self.record["host"]:
            return None
        pid = held.get("pid")
        if pid == os.getpid():
            return None if held.get("token") in _HELD else "left by an earlier run in this process"
        if isinstance(pid, int) and not _pid_alive(pid):
            return f"its process {pid} is gone"
        return None

    def release(self) -> None:
        """Stop the heartbeat and remove our records (never another run's). Idempotent. Quick
        even when storage is down: a record left behind goes stale by itself."""
        self._stop.set()
        locked = self._lock.acquire(timeout=2.0)  # a renewal in flight (storage down) is not waited for
        try:
            versions, self._versions = self._versions, {}
            for i, version in sorted(versions.items()):
                store = self.targets[i][0]
                try:
                    store.delete(version)
                except Exception as e:  # noqa: BLE001
                    log.warning("could not remove the lease on %s (%s); it goes stale %gs after its last heartbeat",
                                store.where, storage_fault(e) or type(e).__name__, self.stale_after_s)
        finally:
            if locked:
                self._lock.release()
        _HELD.discard(self.record["token"])

    # -- while the run lives

    def set_run_id(self, run_id: str) -> None:
        """Name the run id in the record (known only once the checkpoint has been read)."""
        if run_id != self.record["run_id"]:
            self.record["run_id"] = run_id
            try:
                self.renew()
            except _RenewFailed as failed:  # the heartbeat tries again
                log.warning("renewing the run lease on %s failed (%s)", failed.store.where, one_line(failed.error)[:200])

    def renew(self) -> None:
        """Rewrite every record with a new heartbeat; StorageError if another run holds one now,
        _RenewFailed if storage failed."""
        with self._lock:
            raw = self._raw()
            for i, version in list(self._versions.items()):
                store = self.targets[i][0]
                try:
                    new = store.renew(raw, version)
                    held, seen = store.read() if new is None else (None, None)
                except Exception as e:
                    raise _RenewFailed(store, e) from e
                if new is None and held is not None and held.get("token") == self.record["token"]:
                    new = seen  # a retried write of ours that had gone through
                if new is None:
                    self._versions.pop(i)
                    held = _settled(store, held)
                    now = f"held by {describe(held)}" if held else "removed"
                    raise self._lost(store, f"another run took it over (it is {now})", "wait until no other run uses it")
                self._versions[i] = new
            self._renewed = self._clock()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.renew_every_s):
            try:
                self.renew()
            except StorageError as e:
                return self._give_up(e)
            except _RenewFailed as failed:  # storage trouble: retried while the lease cannot be stale yet
                silent, fault = self._clock() - self._renewed, storage_fault(failed.error)
                detail = fault or one_line(failed.error)[:150]
                log.warning("renewing the run lease on %s failed (%s); retrying", failed.store.where, detail)
                if silent + self.renew_every_s >= self.stale_after_s:  # stop before another run may take it
                    return self._give_up(self._lost(failed.store, f"it could not be renewed for {silent:.0f}s ({detail})",
                                                    storage_fix(fault, failed.store.where)))

    def _give_up(self, error: StorageError) -> None:
        if not self._stop.is_set():
            self.on_lost(error)

    def _lost(self, store, why: str, fix: str) -> StorageError:
        return StorageError(f"lost the lease on {store.where}: {why}; this run stopped so that two runs never write "
                            f"there. {fix[0].upper()}{fix[1:]} and relaunch the same command to resume from the last "
                            "complete checkpoint")

    def _raw(self) -> bytes:
        self.record["heartbeat"] = _now()
        return json.dumps(self.record).encode()


def _stale_after(held: dict[str, Any], default: float) -> float:
    """The holder's own stale period (it renews well within it), else ours."""
    try:
        return float(held.get("stale_after_s") or default)
    except (TypeError, ValueError):
        return default


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _io(store, doing: str, action: Callable[[], Any]) -> Any:
    """Run a store call; an I/O failure becomes one line (exit 2: nothing was written yet)."""
    try:
        return action()
    except (UserError, KeyboardInterrupt):
        raise
    except Exception as e:
        fault = storage_fault(e)
        raise UserError(f"cannot {doing} {store.where} ({fault or one_line(e)[:200]}); "
                        f"{storage_fix(fault, store.where)} and relaunch") from e


# ------------------------------------------------------------------------ the trainer's use


def lease_targets(config: Any, output_dir: str, checkpoint_dir: str) -> list[tuple[str, str, str]]:
    """The run's output directory and its checkpoint directory (once when they are one): another
    run may share either one alone (the same run.root and name with another run.checkpoint.dir,
    or the same run.checkpoint.dir under another run.root)."""
    name = "run.name (or run.root)"
    targets = [(output_dir, "output directory", name)]
    if os.path.normpath(checkpoint_dir) != os.path.normpath(output_dir):
        setting = "run.checkpoint.dir" if config.run.checkpoint.dir else name
        targets.append((checkpoint_dir, "checkpoint directory", setting))
    return targets


def hold_run_lease(config: Any, is_primary: bool, process_count: int, output_dir: str,
                   checkpoint_dir: str) -> Optional[Lease]:
    """Process 0 takes the lease (None on the other processes); a refusal reaches every
    process (it waits here for process 0's answer), so the whole pod stops with one line."""
    lease, error = None, None
    if is_primary:
        try:
            lease = Lease(lease_targets(config, output_dir, checkpoint_dir), run=f"{config.run.group}/{config.run.name}",
                          run_id=config.run.id, renew_every_s=config.run.lease.renew_every_s,
                          stale_after_s=config.run.lease.stale_after_s).acquire()
        except UserError as e:
            error = e
    if process_count > 1:
        shared = _shared_error(error)
        error = error if is_primary else shared
        if error is not None:  # every process is here and stops: leave the job together, else
            _leave_job()  # process 0's exit takes the coordination service down under the others
    if error is not None:
        raise error
    return lease


def _leave_job() -> None:
    import jax  # here, not at the top: the launchers import this module, and jax costs them 1.5 s a command

    try:
        jax.distributed.shutdown()  # a barrier of all processes, then the service stops
    except Exception as e:  # noqa: BLE001 - the refusal is what is reported
        log.warning("leaving the JAX job failed: %s", one_line(e)[:200])


def _shared_error(error: Optional[UserError]) -> Optional[UserError]:
    """Process 0's error (exit code and message), broadcast to every process."""
    import numpy as np  # here, as jax in `_leave_job`
    from jax.experimental import multihost_utils

    buffer = np.zeros(2048, np.uint8)
    if error is not None:
        text = str(error).encode()[:buffer.size - 1]
        buffer[0] = error.exit_code
        buffer[1:1 + len(text)] = np.frombuffer(text, np.uint8)
    buffer = np.asarray(multihost_utils.broadcast_one_to_all(buffer))
    if not buffer[0]:
        return None
    shared = LeaseHeld(bytes(buffer[1:]).rstrip(b"\0").decode(errors="replace"))
    shared.exit_code = int(buffer[0])
    return shared
