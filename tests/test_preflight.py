"""Preflight: every path the run touches is checked before compile; each failure is one line.

gs:// cases run against gcp-storage-emulator on loopback (a real GCS endpoint). The emulator
has no IAM, so permission failures come from a tiny loopback HTTP server that answers in the
GCS JSON API's error format, as GCS does for a principal without the role.
"""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from helpers import REPO, raises_one_line
from gcs_emulator import reset_gcs_client_caches, start_gcs_emulator
from runtime.config import register_schemas, validate
from runtime.errors import UserError
from runtime.preflight import WANDB_MISSING, preflight

register_schemas()

SA = "runner@my-proj.iam.gserviceaccount.com"


def make_config(data_path, root, *, wandb="disabled", ckpt=None, generate=False):
    overrides = [f"data.path={data_path}", f"data.generate_if_missing={str(generate).lower()}", f"run.root={root}",
                 f"run.wandb.mode={wandb}", "run.group=pf", "run.name=t"]
    if ckpt:
        overrides.append(f"run.checkpoint.dir={ckpt}")
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return validate(compose(config_name="config", overrides=overrides))


def run_preflight(config, tmp_path, *, ckpt=None, out=None, primary=True, timeout=5.0):
    out = str(out or tmp_path / "out")
    preflight(config, checkpoint_dir=str(ckpt or config.run.checkpoint.dir or f"{out}/checkpoints"), output_dir=out,
              is_primary=primary, gcs_timeout_s=timeout)


def fails(config, tmp_path, *needles, **kw) -> str:
    return raises_one_line(UserError, lambda: run_preflight(config, tmp_path, **kw), *needles)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    from data_pipeline.build_sudoku import build_sudoku_dataset

    return build_sudoku_dataset(tmp_path_factory.mktemp("pfdata") / "sudoku", generate=24, test_size=8, seed=0)


@pytest.fixture(scope="module")
def emulator(tmp_path_factory, dataset):
    from google.cloud import storage

    with start_gcs_emulator(tmp_path_factory.mktemp("pfgcs")) as emu:
        emu.apply_env()
        emu.create_bucket("ckpt")
        emu.create_bucket("data")
        bucket = storage.Client().bucket("data")
        for f in sorted(p for p in dataset.rglob("*") if p.is_file()):
            rel = f.relative_to(dataset).as_posix()
            bucket.blob(f"sudoku/{rel}").upload_from_filename(str(f))
            if rel != "test/all__labels.npy":  # a damaged copy
                bucket.blob(f"broken/{rel}").upload_from_filename(str(f))
        yield emu
    reset_gcs_client_caches()


@pytest.fixture(autouse=True)
def no_wandb_credentials(monkeypatch, tmp_path):
    for k in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))


# ---------------------------------------------------------------------- local paths


def test_local_everything_passes_and_leaves_nothing(dataset, tmp_path):
    run_preflight(make_config(dataset, tmp_path), tmp_path)
    assert sorted(os.listdir(tmp_path / "out")) == ["checkpoints"]
    assert os.listdir(tmp_path / "out" / "checkpoints") == []


def test_output_dir_under_a_file_fails(dataset, tmp_path):
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "out"
    fails(make_config(dataset, tmp_path), tmp_path, f"cannot create output directory {out}", "run.root", out=out)


def test_checkpoint_dir_under_a_file_fails(dataset, tmp_path):
    (tmp_path / "file").write_text("x")
    ckpt = tmp_path / "file" / "ckpt"
    fails(make_config(dataset, tmp_path, ckpt=ckpt), tmp_path, f"cannot create checkpoint directory {ckpt}",
          "choose another run.checkpoint.dir")


def test_unwritable_output_dir_fails(dataset, tmp_path):
    """An existing directory that refuses new files: sysfs refuses them to every user, root included
    (chmod 500 would not stop root, and CI runs as root)."""
    # An empty one: a folder that holds someone's files is refused before any write is tried.
    empty = [p for p in sorted(Path("/sys/kernel").glob("*")) if p.is_dir() and not p.is_symlink() and not any(p.iterdir())]
    assert empty, "no empty folder in /sys/kernel (sysfs mounted at /sys has some, e.g. an unmounted debug or tracing)"
    unwritable = empty[0]
    msg = fails(make_config(dataset, tmp_path), tmp_path, f"no write permission on output directory {unwritable}",
                "chmod/chown", "run.root", out=unwritable)
    # sysfs refuses a new file with EACCES where it is mounted read-write, with EROFS where it is mounted
    # read-only (containers), ENOENT in a bare mount point: the message carries the system's own reason.
    assert any(f"({reason})" in msg for reason in ("Permission denied", "Read-only file system",
                                                    "No such file or directory")), msg


def test_non_primary_does_not_touch_output_dir(dataset, tmp_path):
    """Only process 0 writes the run's folder: another process neither checks nor creates it, so
    an output path that process 0 alone would refuse (under a file) passes, and nothing is made."""
    (tmp_path / "file").write_text("x")
    fails(make_config(dataset, tmp_path), tmp_path, "output directory", out=tmp_path / "file" / "out",
          ckpt=tmp_path / "ck")  # process 0 refuses it ...
    run_preflight(make_config(dataset, tmp_path), tmp_path, out=tmp_path / "file" / "out", ckpt=tmp_path / "ck",
                  primary=False)  # ... another process does not look
    assert (tmp_path / "file").read_text() == "x"


def test_gs_output_dir_fails(dataset, tmp_path):
    fails(make_config(dataset, tmp_path), tmp_path, "output directory gs://b/out is not a local path", "run.root",
          out="gs://b/out", ckpt=tmp_path / "ck")


def test_local_dataset_missing_fails_unless_generated(tmp_path):
    missing = tmp_path / "nodata"
    fails(make_config(missing, tmp_path), tmp_path, f"dataset not found at {missing}/train/dataset.json",
          "build_sudoku")
    run_preflight(make_config(missing, tmp_path, generate=True), tmp_path)  # the trainer will build it
    assert not missing.exists()
    (tmp_path / "file").write_text("x")
    fails(make_config(tmp_path / "file" / "d", tmp_path, generate=True), tmp_path, "is missing and cannot be built")


def test_local_dataset_missing_array_file_fails(dataset, tmp_path):
    import shutil

    copy = Path(shutil.copytree(dataset, tmp_path / "copy"))
    (copy / "train" / "all__inputs.npy").unlink()
    fails(make_config(copy, tmp_path), tmp_path, f"missing array file {copy}/train/all__inputs.npy")


# ---------------------------------------------------------------------------- W&B


def test_wandb_online_needs_credentials_on_primary_only(dataset, tmp_path, monkeypatch):
    config = make_config(dataset, tmp_path, wandb="online")
    assert fails(config, tmp_path) == WANDB_MISSING
    run_preflight(config, tmp_path, primary=False)  # only process 0 talks to W&B
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    run_preflight(config, tmp_path)
    run_preflight(make_config(dataset, tmp_path, wandb="offline"), tmp_path)


def test_wandb_netrc_entry_counts(dataset, tmp_path, monkeypatch):
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    monkeypatch.setenv("NETRC", str(netrc))
    run_preflight(make_config(dataset, tmp_path, wandb="online"), tmp_path)
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com")  # a self-hosted server: other entry
    assert fails(make_config(dataset, tmp_path, wandb="online"), tmp_path) == WANDB_MISSING


# ------------------------------------------------------------------- gs:// emulator


def test_gs_checkpoint_and_dataset_pass_and_leave_no_probe(emulator, tmp_path):
    from google.cloud import storage

    config = make_config("gs://data/sudoku", tmp_path, ckpt="gs://ckpt/exp/run1")
    run_preflight(config, tmp_path)
    assert list(storage.Client().list_blobs("ckpt")) == []
    run_preflight(make_config("gs://data/sudoku/", tmp_path, ckpt="gs://ckpt"), tmp_path)  # bucket root
    assert list(storage.Client().list_blobs("ckpt")) == []


def test_gs_missing_bucket_fails(emulator, tmp_path):
    fails(make_config("gs://data/sudoku", tmp_path, ckpt="gs://no-such-bucket/x"), tmp_path,
          "bucket gs://no-such-bucket does not exist", "gcloud storage buckets create gs://no-such-bucket",
          "run.checkpoint.dir")
    fails(make_config("gs://no-data-bucket/sudoku", tmp_path), tmp_path, "bucket gs://no-data-bucket does not exist",
          "point data.path at an existing bucket")


def test_gs_dataset_missing_or_incomplete_fails(emulator, tmp_path):
    fails(make_config("gs://data/nope", tmp_path), tmp_path, "dataset not found at gs://data/nope/train/dataset.json",
          "copy DIR to gs://data/nope")
    fails(make_config("gs://data/broken", tmp_path), tmp_path,
          "missing array file gs://data/broken/test/all__labels.npy")


class RetryClock:
    """An injected clock for google-api-core's retry loop: its sleeps advance this clock, not the
    machine's, so the test reads how long the retries would have waited, whatever the load."""

    def __init__(self):
        self.now, self.sleeps = 0.0, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_gs_unreachable_fails_within_the_retry_deadline(emulator, tmp_path, monkeypatch):
    from google.api_core.retry import retry_base, retry_unary

    clock = RetryClock()
    for module in (retry_base, retry_unary):
        monkeypatch.setattr(module, "time", clock)
    config = make_config("gs://data/sudoku", tmp_path, ckpt="gs://ckpt/exp/run1")
    emulator.stop()
    try:
        fails(config, tmp_path, "cannot reach GCS", emulator.url, "gs://ckpt/exp/run1", "within 2s", timeout=2.0)
        # Retried (connection refused is transient), and stopped at the 2 s deadline it was given:
        # unbounded, the default retry would go on for 120 s.
        assert len(clock.sleeps) >= 2 and clock.now <= 2.0, clock.sleeps
        clock.now, clock.sleeps = 0.0, []  # a gs:// dataset is checked with the same bounded client first
        fails(config, tmp_path, "cannot reach GCS", "gs://data/sudoku", ckpt=tmp_path / "ck", timeout=2.0)
        assert len(clock.sleeps) >= 2 and clock.now <= 2.0, clock.sleeps
    finally:
        emulator.start()


# --------------------------------------------------- permission errors (fake GCS on loopback)


class FakeGcs(ThreadingHTTPServer):
    """Answers the GCS JSON API the way GCS answers a principal without the role."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.bucket_status = 200
        self.object_status = 403
        self.requests: list[str] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _answer(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        srv: FakeGcs = self.server
        srv.requests.append(f"{self.command} {self.path}")
        if self.path.startswith("/storage/v1/b/") and "/o" not in self.path:  # bucket metadata
            status, perm = srv.bucket_status, "storage.buckets.get"
        else:
            status = srv.object_status
            perm = {"GET": "storage.objects.get", "DELETE": "storage.objects.delete"}.get(self.command,
                                                                                          "storage.objects.create")
        if status == 200:
            body = {"kind": "storage#bucket", "name": "locked", "id": "locked"}
        elif status == 401:
            err = {"message": "Invalid Credentials", "domain": "global", "reason": "authError"}
            body = {"error": {"code": 401, "message": "Invalid Credentials", "errors": [err]}}
        else:
            text = (f"{SA} does not have {perm} access to the Google Cloud Storage object. "
                    f"Permission '{perm}' denied on resource (or it may not exist).")
            body = {"error": {"code": 403, "message": text,
                              "errors": [{"message": text, "domain": "global", "reason": "forbidden"}]}}
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=UTF-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _answer


@pytest.fixture
def fake_gcs(monkeypatch, tmp_path):
    srv = FakeGcs()
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    for k, v in {"STORAGE_EMULATOR_HOST": srv.url, "NO_GCE_CHECK": "true", "GOOGLE_CLOUD_PROJECT": "test-project",
                 "CLOUDSDK_CONFIG": str(tmp_path / "gcloud"), "NO_PROXY": "127.0.0.1,localhost",
                 "no_proxy": "127.0.0.1,localhost"}.items():
        monkeypatch.setenv(k, v)
    yield srv
    srv.shutdown()
    srv.server_close()


def test_gs_no_write_permission_names_principal_and_role(dataset, tmp_path, fake_gcs):
    fails(make_config(dataset, tmp_path, ckpt="gs://locked/runs/a"), tmp_path,
          f"no write permission on gs://locked/runs/a: grant roles/storage.objectAdmin to {SA} "
          "or choose another run.checkpoint.dir")
    assert any("/upload/storage/v1/b/locked/o" in r for r in fake_gcs.requests), fake_gcs.requests
    assert len([r for r in fake_gcs.requests if "/upload/" in r]) == 1  # a 403 is not retried


def test_gs_bucket_metadata_forbidden_fails(dataset, tmp_path, fake_gcs):
    fake_gcs.bucket_status = 403
    fails(make_config(dataset, tmp_path, ckpt="gs://locked/runs/a"), tmp_path,
          "no permission to read bucket gs://locked (storage.buckets.get", f"to {SA}", "run.checkpoint.dir")


def test_gs_rejected_credentials_fail(dataset, tmp_path, fake_gcs):
    fake_gcs.object_status = 401
    fails(make_config(dataset, tmp_path, ckpt="gs://locked/runs/a"), tmp_path,
          "GCS rejected this worker's credentials for gs://locked/runs/a", "gcloud auth application-default login")


def test_gs_dataset_not_readable_fails(tmp_path, fake_gcs):
    fake_gcs.object_status = 403
    fails(make_config("gs://locked/sudoku", tmp_path), tmp_path,
          f"no read permission on gs://locked/sudoku/train: grant roles/storage.objectViewer to {SA}",
          ckpt=tmp_path / "ck")
    reads = [r for r in fake_gcs.requests if "/b/locked/o" in r and "/upload/" not in r]
    # The event: each read refused with 403 was asked once, not retried.
    assert reads and len(reads) == len(set(reads)), fake_gcs.requests


def test_programme_preflight_names_each_variants_missing_gs_dataset_and_the_budget(emulator):
    """`programme submit`'s preflight (experiments/launcher/queue_state.py), against the emulator: one line
    per variant whose dataset is not on gs://, per variant without planned pod-hours under a
    budget, and one when the first variant alone exceeds the budget."""
    from google.cloud import storage

    from experiments.launcher import queue_state

    storage.Client().bucket("data").blob("sudoku-extreme-1000-aug-1000/train/dataset.json").upload_from_string("{}")
    present, absent = "exp08/ema0.99", "exp04a/puzzles100"  # exp04a's 100-puzzle set was never copied
    sub = queue_state.Submission(name="p", variants=[present, absent], slices=["s1"], zone="z",
                                   accelerator_type="v4-8", runtime_version="v", env={"PODRUNNER_DATA": "gs://data"},
                                   budget=1.0,
                                   planned={present: {"pod_hours": 1.5, "steps": 10}})
    problems = queue_state.preflight(sub)
    assert problems == [
        f"{absent}: dataset gs://data/sudoku-extreme-100-aug-1000 does not exist",
        f"{absent}: no planned pod-hours for the budget: give --plan with the CSV of `launch.py plan` for these groups",
        f"{present}: its planned 1.500 pod-hours exceed the budget 1: raise --budget"], problems
    assert sub.checkpoint_dirs.keys() == {present, absent} and sub.total_steps == {present: 10}
    sub.planned[absent], sub.budget = {"pod_hours": 0.5, "steps": 10}, 2.0
    storage.Client().bucket("data").blob("sudoku-extreme-100-aug-1000/train/dataset.json").upload_from_string("{}")
    assert queue_state.preflight(sub) == []
