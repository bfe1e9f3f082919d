"""Preflight: check every path the run will touch before anything is compiled.

`preflight(config, checkpoint_dir=..., output_dir=..., is_primary=...)` runs on every process
right after the plan is known and raises `UserError` (one line naming the path and the fix)
at the first problem:

* W&B (process 0 only): `online` needs credentials on this worker (WANDB_API_KEY, or an
  entry for the W&B host in ~/.netrc); checked locally, without network.
* output directory (process 0 only, the only writer): local, creatable, writable.
* checkpoint directory (every process writes its own shards): local -> created and a probe
  file written, read back and removed; `gs://bucket/prefix` -> the bucket exists and can be
  read (Orbax reads its metadata), and a probe object `<prefix>/.preflight/<host>-<pid>` is
  written, read back and deleted (a 403 names the principal and the role to grant).
* dataset (every process reads it): the dataset kind's own checks (`DatasetKind.preflight`,
  data_pipeline/kinds/): its train and eval splits' metadata parses and the files it promises
  exist (gcsfs for gs://). A missing local path with `data.generate_if_missing` (the run
  builds it) only has its build location checked.

GCS calls use google-cloud-storage with a bounded per-request timeout and a bounded retry
deadline (`gcs_timeout_s`), so an unreachable endpoint is one line within seconds, not a hang.
Nothing global is changed (no env, no fsspec config).
"""

from __future__ import annotations

import netrc
import os
import re
import secrets
import socket
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlparse

from runtime.errors import OutputDirError, UserError, one_line

DEFAULT_GCS_TIMEOUT_S = 15.0
PROBE_DIR = ".preflight"  # gs://: <prefix>/.preflight/<host>-<pid>; local: <dir>/.preflight-<host>-<pid>
WANDB_DEFAULT_HOST = "api.wandb.ai"
WANDB_MISSING = ("run.wandb.mode=online but no W&B credentials on this worker: export WANDB_API_KEY "
                 "(the pod launcher forwards it) or use run.wandb.mode=offline")


def preflight(config: Any, *, checkpoint_dir: str, output_dir: str, is_primary: bool,
              gcs_timeout_s: float = DEFAULT_GCS_TIMEOUT_S) -> None:
    """Check W&B credentials, the output dir, the checkpoint dir and the dataset; raise UserError."""
    gcs = _Gcs(gcs_timeout_s)
    ckpt_setting = "run.checkpoint.dir" if config.run.checkpoint.dir else "run.root (or set run.checkpoint.dir)"
    if is_primary:
        check_wandb(config.run.wandb.mode)
        check_run_dir(output_dir, "output directory", "run.name (or run.root)", local_entries)
        check_nothing_in_the_way(output_dir, wandb=config.run.wandb.mode != "disabled")
        check_run_dir(checkpoint_dir, "checkpoint directory", ckpt_setting,
                      gcs.entries if checkpoint_dir.startswith("gs://") else local_entries, steps=True)
        check_output_dir(output_dir)
    if checkpoint_dir.startswith("gs://"):
        gcs.check_writable(checkpoint_dir, ckpt_setting)
    elif "://" in checkpoint_dir:
        raise UserError(f"checkpoint directory {checkpoint_dir}: only local paths and gs://bucket/prefix are "
                        f"supported; change {ckpt_setting}")
    else:
        check_local_writable(checkpoint_dir, "checkpoint directory", ckpt_setting)
    # here, not at the top: the launcher imports this module (via runtime.lease), and the registry brings jax
    from runtime.registry import dataset_kind

    dataset_kind(config.data.name).preflight(config.data, gcs)
    if config.train.init_params_from:
        check_init_params(config.train.init_params_from)


def check_init_params(path: str) -> None:
    """train.init_params_from must hold an imported parameter checkpoint (params/)."""
    import fsspec  # here, not at the top: the launcher imports this module (via runtime.lease)

    try:
        fs, base = fsspec.core.url_to_fs(path)
        ok = fs.exists(f"{base.rstrip('/')}/params")
    except Exception as e:
        raise UserError(f"cannot read train.init_params_from={path} ({one_line(e)[:200]}); check the path and "
                        "this worker's read access") from e
    if not ok:
        raise UserError(f"train.init_params_from={path} has no params/ checkpoint; point it at a directory written "
                        "by `python -m models.recursive_reasoning.import_reference --out DIR`")


# ----------------------------------------------------------------------------------- W&B


def wandb_credentials_present(environ: Optional[dict[str, str]] = None) -> bool:
    """WANDB_API_KEY (or an identity token file) in the env, or a netrc entry for the W&B host."""
    env = os.environ if environ is None else environ
    if env.get("WANDB_API_KEY", "").strip() or env.get("WANDB_IDENTITY_TOKEN_FILE", "").strip():
        return True
    host = urlparse(env.get("WANDB_BASE_URL") or f"https://{WANDB_DEFAULT_HOST}").hostname or WANDB_DEFAULT_HOST
    if env.get("NETRC"):
        candidates = [Path(env["NETRC"]).expanduser()]
    else:
        candidates = [Path("~/.netrc").expanduser(), Path("~/_netrc").expanduser()]
    for path in candidates:
        try:
            entry = netrc.netrc(str(path)).authenticators(host)
        except (OSError, netrc.NetrcParseError):
            continue
        if entry and entry[2]:
            return True
    return False


def check_wandb(mode: str) -> None:
    if mode == "online" and not wandb_credentials_present():
        raise UserError(WANDB_MISSING)
    if mode == "online":
        check_wandb_key_shape(os.environ.get("WANDB_API_KEY", ""))
    # offline writes under the output directory (checked separately); disabled writes nothing.


def check_wandb_key_shape(key: str) -> None:
    """A WANDB_API_KEY that W&B itself would reject by its shape (wandb's own offline check:
    length, characters, whitespace) is one line here, never the key itself; its validity with
    the server is W&B's to say (runtime/metrics_sinks.py)."""
    if not key:
        return  # an identity token file or ~/.netrc entry: W&B checks those
    try:
        from wandb.sdk.lib.wbauth.validation import check_api_key  # optional heavy (wandb: over 1 s to import)
    except ImportError:  # another wandb version: only the whitespace check below
        def check_api_key(key: str) -> str | None:
            return None
    problem = "it has leading or trailing whitespace." if key != key.strip() else check_api_key(key)
    if problem:
        raise UserError(f"WANDB_API_KEY is malformed ({problem.rstrip('.')}); copy the key again from "
                        "https://wandb.ai/authorize (or your W&B host's /authorize page), or use run.wandb.mode=offline")


# ------------------------------------------------------------------------- run directories

# What says a folder is a run directory of this project: the marker process 0 writes when it takes
# the lease (runtime/lease.py), or what earlier runs left (the manifest, a lease record, a probe).
RUN_MARKER = ".podrunner-run"
_RUN_FILES = (RUN_MARKER, "run_manifest.json", ".lease.json", ".lease.json.lock", PROBE_DIR)
# What an Orbax step folder holds (a damaged one at least one of them).
_STEP_ITEMS = {"_CHECKPOINT_METADATA", "commit_success.txt", "state", "meta"}


def _checkpoint_entry(name: str) -> bool:
    """A name Orbax or the quarantine gives a checkpoint directory's entries (runtime/checkpointing.py)."""
    return name.isdigit() or name.startswith("quarantined-") or ".orbax-checkpoint-tmp" in name


def local_entries(directory: str) -> dict[str, bool]:
    """name -> is a folder, of what `directory` holds ({} when it does not exist)."""
    try:
        with os.scandir(directory) as it:
            return {e.name: e.is_dir() for e in it}
    except (FileNotFoundError, NotADirectoryError):
        return {}
    except OSError as e:  # a symlink loop, no permission
        raise UserError(f"cannot list {directory} ({os_reason(e)}); fix the path or its permissions") from e


def is_project_step(directory: str, name: str, is_dir: bool, entries) -> bool:
    """Whether the entry `name` of a checkpoint directory is a step folder this project wrote (it
    holds an Orbax step's items); `entries` lists a folder as name -> is a folder."""
    return is_dir and bool(_STEP_ITEMS & set(entries(f"{directory.rstrip('/')}/{name}")))


def check_run_dir(directory: str, what: str, setting: str, entries, *, steps: bool = False) -> None:
    """A run directory is written only when it is new, empty or an earlier run's (RUN_MARKER or
    the files earlier runs left); any other folder is someone's and is refused before anything is
    written. `steps`: in a checkpoint directory, every step-named entry must be a step folder this
    project wrote: Orbax replaces a file `20` with step 20, and deletes old steps past keep."""
    def listed(path: str) -> dict[str, bool]:
        # Write probes are this project's and short-lived: another process of the pod may be
        # probing the same folder (or the checkpoint folder inside it) right now.
        return {n: d for n, d in entries(path).items() if not n.startswith(PROBE_DIR)}

    names = listed(directory)
    # Empty folders hold nothing to lose (an earlier attempt that stopped before writing left them).
    names = {n: d for n, d in names.items() if not (d and not n.isdigit() and not listed(f"{directory.rstrip('/')}/{n}"))}
    if steps:
        for name, is_dir in sorted(names.items()):
            if name.isdigit() and not is_project_step(directory, name, is_dir, entries):
                kind = "folder" if is_dir else "file"
                raise UserError(f"{what} {directory} holds a {kind} {name} that is no checkpoint step of this project, "
                                "and a run would replace or delete it; move it out of that directory, or choose "
                                f"another {setting}")
    if not names or set(names) & set(_RUN_FILES) or (steps and all(map(_checkpoint_entry, names))):
        return
    shown = ", ".join(sorted(names)[:4]) + (", ..." if len(names) > 4 else "")
    raise UserError(f"{what} {directory} already holds files ({shown}) and no {RUN_MARKER} marker of an earlier run, "
                    f"so nothing is written there; choose another {setting}, or empty that folder first")


# What process 0 writes in the output directory: name -> written as a folder (W&B's) or a file.
_OUTPUT_ENTRIES = {"metrics.jsonl": False, "run.log": False, "run_manifest.json": False, "wandb": True}


def check_nothing_in_the_way(output_dir: str, *, wandb: bool) -> None:
    """A folder where the run writes a file (metrics.jsonl, run.log, the manifest), or a file
    where it writes a folder (W&B's, when W&B is on), would fail the run mid-way: a storage fault
    (exit 6), said in one line before anything is written."""
    for name, is_dir in local_entries(output_dir).items():
        if name in _OUTPUT_ENTRIES and is_dir != _OUTPUT_ENTRIES[name] and (wandb or name != "wandb"):
            stands, goes = ("a file", "folder") if _OUTPUT_ENTRIES[name] else ("a folder", "file")
            raise OutputDirError(f"cannot write {os.path.join(output_dir, name)}: {stands} stands where the run writes "
                                 f"its {goes}; move it out of the output directory and relaunch the same command")


# --------------------------------------------------------------------------- local paths


def os_reason(e: OSError) -> str:
    return e.strerror or one_line(e)


def check_output_dir(output_dir: str) -> None:
    if "://" in output_dir:
        raise UserError(f"output directory {output_dir} is not a local path: metrics.jsonl, W&B files and the "
                        "manifest are written locally; set run.root to a local directory (put checkpoints on "
                        "GCS with run.checkpoint.dir=gs://...)")
    check_local_writable(output_dir, "output directory", "run.root")


def check_local_writable(directory: str, what: str, setting: str) -> None:
    """Create `directory` (parents too) and write, read back and remove a probe file in it."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create {what} {directory} ({os_reason(e)}); choose another {setting} "
                        "or fix the path") from e
    if not os.path.isdir(directory):
        raise UserError(f"{what} {directory} exists but is not a directory; choose another {setting}")
    probe = os.path.join(directory, f"{PROBE_DIR}-{_probe_name()}")
    token = secrets.token_bytes(16)
    try:
        with open(probe, "wb") as f:
            f.write(token)
        with open(probe, "rb") as f:
            ok = f.read() == token
        os.remove(probe)
    except OSError as e:
        raise UserError(f"no write permission on {what} {directory} ({os_reason(e)}); make it writable for this "
                        f"user (chmod/chown) or choose another {setting}") from e
    if not ok:
        raise UserError(f"{what} {directory} does not read back what was written; choose another {setting}")


def _probe_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


# ---------------------------------------------------------------------------------- GCS


def split_gs(url: str) -> tuple[str, str]:
    """gs://bucket/a/b/ -> ("bucket", "a/b")."""
    rest = url[len("gs://"):]
    bucket, _, prefix = rest.partition("/")
    return bucket, prefix.strip("/")


_NETWORK_PHRASES = ("Connection refused", "Read timed out", "Connect timeout", "Name or service not known",
                    "Temporary failure in name resolution", "No route to host", "Network is unreachable",
                    "Connection reset", "timed out")
_PRINCIPAL = re.compile(r"([A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+)\s+does not have")


def principal_in(error: BaseException) -> Optional[str]:
    m = _PRINCIPAL.search(one_line(error))
    return m.group(1) if m else None


class _Gcs:
    """google-cloud-storage with bounded timeouts and retries, one client per preflight."""

    # google.* is imported in the methods: optional heavy (0.8 s), needed only for gs:// paths

    def __init__(self, timeout_s: float):
        self.timeout_s = float(timeout_s)
        self._client = None
        self._checked: dict[str, Any] = {}

    # timeouts: (connect, read) per request; retries (transient errors, connection refused)
    # stop after timeout_s in all.
    def _kw(self) -> dict[str, Any]:
        from google.cloud.storage.retry import DEFAULT_RETRY

        retry = DEFAULT_RETRY.with_timeout(self.timeout_s).with_delay(initial=0.2, maximum=2.0, multiplier=2.0)
        return {"timeout": (min(5.0, self.timeout_s), self.timeout_s), "retry": retry}

    def client(self, url: str):
        if self._client is None:
            from google.auth.exceptions import DefaultCredentialsError
            from google.cloud import storage

            try:
                try:
                    self._client = storage.Client()
                except OSError:  # no default project: not needed for bucket and object calls
                    self._client = storage.Client(project=None)
            except DefaultCredentialsError as e:
                raise UserError(f"no Google Cloud credentials on this worker for {url} ({one_line(e)[:150]}); run "
                                "`gcloud auth application-default login`, set GOOGLE_APPLICATION_CREDENTIALS, or "
                                "give the TPU VM a service account") from e
        return self._client

    def principal(self, error: BaseException) -> Optional[str]:
        """Who was refused: GCS names it in the 403 message; else the credentials' service account."""
        who = principal_in(error)
        if who:
            return who
        email = getattr(getattr(self._client, "_credentials", None), "service_account_email", None)
        return email if email and email != "default" else None

    def _unreachable(self, url: str, e: BaseException) -> UserError:
        endpoint = os.environ.get("STORAGE_EMULATOR_HOST") or "storage.googleapis.com"
        text = one_line(e)
        detail = next((p for p in _NETWORK_PHRASES if p.lower() in text.lower()), text[:160])
        return UserError(f"cannot reach GCS ({endpoint}) for {url} within {self.timeout_s:g}s ({detail}); check "
                         "this worker's network and credentials (gcloud auth application-default login)")

    def _unauthenticated(self, url: str, e: BaseException) -> UserError:
        # 401, or credentials that cannot be refreshed (anonymous, expired, revoked).
        return UserError(f"GCS rejected this worker's credentials for {url} ({one_line(e)[:150]}); run "
                         "`gcloud auth application-default login` or give the TPU VM a service account")

    def bucket(self, url: str, setting: str, *, need_metadata: bool):
        """The bucket of `url` (checked once). A missing bucket is one line; so is a 403 when
        `need_metadata` (Orbax reads the bucket's metadata before listing checkpoints)."""
        from google.api_core import exceptions as gexc
        from google.auth.exceptions import GoogleAuthError, TransportError

        name, _ = split_gs(url)
        if not name:
            raise UserError(f"{url} has no bucket name; use gs://<bucket>/<prefix> for {setting}")
        if name in self._checked:
            return self._checked[name]
        client = self.client(url)
        try:
            bucket = client.get_bucket(name, **self._kw())
        except gexc.NotFound:
            raise UserError(f"bucket gs://{name} does not exist; create it (gcloud storage buckets create "
                            f"gs://{name}) or point {setting} at an existing bucket") from None
        except TransportError as e:  # the token endpoint (metadata server) did not answer
            raise self._unreachable(url, e) from e
        except (gexc.Unauthorized, GoogleAuthError) as e:
            raise self._unauthenticated(url, e) from e
        except gexc.Forbidden as e:
            if need_metadata:
                who = self.principal(e) or "this worker's account (gcloud auth list)"
                raise UserError(f"no permission to read bucket gs://{name} (storage.buckets.get, needed by Orbax) "
                                f"as {who}: grant roles/storage.legacyBucketReader (or roles/storage.admin) on "
                                f"gs://{name} to {who} or choose another {setting}") from e
            bucket = client.bucket(name)  # readers may lack buckets.get; the object reads decide
        except gexc.GoogleAPICallError as e:
            raise UserError(f"GCS refused to look up bucket gs://{name} for {url} ({one_line(e)[:200]}); check "
                            f"{setting} and this worker's credentials") from e
        except Exception as e:  # connection refused, timeouts, retry deadline, auth refresh failures
            raise self._unreachable(url, e) from e
        self._checked[name] = bucket
        return bucket

    def entries(self, url: str) -> dict[str, bool]:
        """name -> is a folder, of the objects and prefixes directly under `url` ({} when none)."""
        bucket = self.bucket(url, "run.checkpoint.dir", need_metadata=True)
        _, prefix = split_gs(url)
        prefix = f"{prefix}/" if prefix else ""
        try:
            listing = bucket.client.list_blobs(bucket, prefix=prefix, delimiter="/", **self._kw())
            names = {blob.name[len(prefix):]: False for blob in listing}
            names.update({p[len(prefix):].rstrip("/"): True for p in listing.prefixes})
        except Exception:  # noqa: BLE001 - refused or unreachable: check_writable, next, says which in one line
            return {}
        names.pop("", None)
        return names

    def check_writable(self, url: str, setting: str) -> None:
        """Write, read back and delete `<prefix>/.preflight/<host>-<pid>`."""
        from google.api_core import exceptions as gexc
        from google.auth.exceptions import GoogleAuthError, TransportError

        bucket = self.bucket(url, setting, need_metadata=True)
        _, prefix = split_gs(url)
        name = "/".join(p for p in (prefix, PROBE_DIR, _probe_name()) if p)
        blob = bucket.blob(name)
        token = secrets.token_hex(16)
        step = "write"
        try:
            blob.upload_from_string(token, content_type="text/plain", **self._kw())
            step = "read"
            back = blob.download_as_bytes(**self._kw()).decode(errors="replace")
            step = "delete"
            try:
                blob.delete(**self._kw())
            except gexc.NotFound:  # a retried delete whose first attempt went through
                pass
        except TransportError as e:  # the token endpoint (metadata server) did not answer
            raise self._unreachable(url, e) from e
        except (gexc.Unauthorized, GoogleAuthError) as e:
            raise self._unauthenticated(url, e) from e
        except gexc.Forbidden as e:
            who = self.principal(e) or "this worker's account (see gcloud auth list)"
            verb = "write" if step == "write" else f"{step} (after write)"
            raise UserError(f"no {verb} permission on {url}: grant roles/storage.objectAdmin to {who} or choose "
                            f"another {setting}") from e
        except gexc.GoogleAPICallError as e:
            raise UserError(f"cannot {step} a probe object under {url} ({one_line(e)[:200]}); choose another "
                            f"{setting}") from e
        except Exception as e:
            raise self._unreachable(url, e) from e
        if back != token:
            raise UserError(f"a probe object written under {url} read back different content; choose another {setting}")


# ------------------------------------------------------- helpers for the dataset kinds' checks


def check_npy_readable(path: str) -> None:
    try:
        with open(path, "rb") as f:
            magic = f.read(6)
    except OSError as e:
        raise UserError(f"cannot read {path} ({os_reason(e)}); make the dataset readable for this user or point "
                        "data.path at another copy") from e
    if magic != b"\x93NUMPY":
        raise UserError(f"{path} is not a .npy file; rebuild the dataset")


def check_buildable(root: str) -> None:
    """The nearest existing ancestor of `root` must be a writable directory."""
    p = Path(root).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    if not p.is_dir():
        raise UserError(f"data.path={root} is missing and cannot be built there: {p} is a file; choose another "
                        "data.path")
    if not os.access(p, os.W_OK | os.X_OK):
        raise UserError(f"data.path={root} is missing and cannot be built there: no write permission on {p}; "
                        "choose a writable data.path")
