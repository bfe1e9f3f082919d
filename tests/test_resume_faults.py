"""Resuming from damaged checkpoints: an unreadable latest step is quarantined (moved aside, never
deleted) and the run resumes from the previous complete step with the losses of an uninterrupted
run; no readable step, a failure every step shares, or one with no sign of damage moves nothing;
a config that does not fit is refused and nothing is moved; a changed train.steps is logged and
recorded in the manifest.

One run of the shared reference config writes three steps (module fixture); each test
damages a copy of it and relaunches with the same overrides."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import (REFERENCE_EXTRA, REFERENCE_STEPS, REPO, assert_user_error, base_overrides, child_env, free_port,
                     resumed_step, train, train_losses, use_cpu_devices)

# A failed restore abandons Orbax's other reads; their late "Exception ignored" reports must not
# reach stderr (runtime.checkpointing drops them): any that does fails the test.
# Damaged checkpoints, not the mesh: one CPU device (resume across meshes is test_pod's).
pytestmark = [pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning"), pytest.mark.devices(1)]
CKPT = Path("test") / "t" / "checkpoints"
FIRST, SECOND, LAST = REFERENCE_STEPS // 3, 2 * REFERENCE_STEPS // 3, REFERENCE_STEPS  # the steps saved
SAVED = [str(FIRST), str(SECOND), str(LAST)]


def overrides(sudoku_dir: Path, root: Path, *extra: str) -> list[str]:
    return base_overrides(sudoku_dir, root, steps=REFERENCE_STEPS) + REFERENCE_EXTRA + [
        f"train.checkpoint_every={FIRST}", "run.checkpoint.keep=3", *extra]


@pytest.fixture(scope="module")
def trained(sudoku_dir, tmp_path_factory) -> Path:
    """A finished reference run with checkpoints at steps FIRST, SECOND and LAST (copy it before damaging it)."""
    root = tmp_path_factory.mktemp("trained")
    use_cpu_devices(1)  # set up before the first test's own devices
    train(overrides(sudoku_dir, root))
    assert sorted(p.name for p in (root / CKPT).iterdir() if p.name.isdigit()) == SAVED
    return root


def copy_run(trained: Path, tmp_path: Path) -> Path:
    root = tmp_path / "run"
    shutil.copytree(trained, root)
    return root


def files_under(path: Path) -> dict[str, int]:
    return {str(p.relative_to(path)): p.stat().st_size for p in path.rglob("*") if p.is_file()}


def largest_array_file(step: Path) -> Path:
    """The biggest chunk file of the step's state item (OCDBT data under state/ocdbt.process_*/d/)."""
    return max((step / "state").glob("ocdbt.process_*/d/*"), key=lambda p: p.stat().st_size)


def truncate_array_file(step: Path) -> None:
    path = largest_array_file(step)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def overwrite_array_file(step: Path) -> None:
    path = largest_array_file(step)
    path.write_bytes(os.urandom(path.stat().st_size))


def remove_state_item(step: Path) -> None:
    shutil.rmtree(step / "state")


def garble_meta(step: Path) -> None:
    (step / "meta" / "metadata").write_text(f'{{"step": {LAST}, "run_id": "t-')


def quarantined(ckpt: Path) -> list[Path]:
    return sorted(p for p in ckpt.iterdir() if p.name.startswith("quarantined-"))


@pytest.mark.slow
@pytest.mark.parametrize("damage", [truncate_array_file, remove_state_item, overwrite_array_file, garble_meta])
def test_unreadable_latest_step_is_quarantined_and_the_previous_one_resumed(
        damage, sudoku_dir, tmp_path, trained, reference_losses):
    root = copy_run(trained, tmp_path)
    damage(root / CKPT / str(LAST))
    damaged = files_under(root / CKPT / str(LAST))

    result = train(overrides(sudoku_dir, root))
    assert resumed_step(result.log) == SECOND
    warnings = [line for line in result.log.splitlines() if "is unreadable" in line]
    assert len(warnings) == 1 and warnings[0].startswith(f"checkpoint step {LAST} in {root / CKPT} is unreadable ("), result.log
    (moved,) = quarantined(root / CKPT)
    assert moved.name.startswith(f"quarantined-{LAST}-") and f"moved it to {moved}" in warnings[0]
    assert files_under(moved) == damaged  # kept as it was, every file
    assert sorted(p.name for p in (root / CKPT).iterdir() if p.name.isdigit()) == SAVED  # LAST saved again
    assert train_losses(root / "test" / "t") == pytest.approx(reference_losses, rel=1e-5)  # after SECOND retrained
    manifest = json.loads((root / "test" / "t" / "run_manifest.json").read_text())
    assert manifest["resumed_from_step"] == SECOND
    assert manifest["quarantined_checkpoints"] == [{"step": LAST, "moved_to": str(moved)}]


@pytest.mark.slow
def test_no_readable_step_left_is_one_line_and_moves_nothing(sudoku_dir, tmp_path, trained):
    root = copy_run(trained, tmp_path)
    ckpt = root / CKPT
    truncate_array_file(ckpt / str(LAST))  # found when restoring the state, after the model is built
    garble_meta(ckpt / str(SECOND))  # found when reading the metadata again
    remove_state_item(ckpt / str(FIRST))
    before = files_under(ckpt)

    result = train(overrides(sudoku_dir, root), check=False)
    assert_user_error(result, f"no checkpoint step in {ckpt} can be read: steps {LAST}, {SECOND}, {FIRST} (step {LAST}: state: OUT_OF_RANGE",
                      "nothing was moved", "backup", "new run.name")
    assert files_under(ckpt) == before and not quarantined(ckpt)

    # Every step moved aside (as an earlier version did): refused, never started over.
    for step in SAVED:
        (ckpt / step).rename(ckpt / f"quarantined-{step}-20250101T000000Z")
    again = train(overrides(sudoku_dir, root), check=False)
    assert_user_error(again, f"no readable checkpoint is left in {ckpt}", f"quarantined-{LAST}-")


@pytest.mark.slow
@pytest.mark.parametrize("failure,needles", ids=["same-damage-every-step", "no-sign-of-damage"], argvalues=[
    # looks like damage, but every step fails so: a common cause, stop at the second step
    (lambda: ValueError('DATA_LOSS: Error reading "params" in OCDBT database'),
     [f"checkpoint steps {LAST}, {SECOND} in", "fail to read in the same way", f"(step {LAST}: state: DATA_LOSS"]),
    # no sign of damage at all (a code bug): stop at the first step
    (lambda: TypeError("restore() got an unexpected keyword argument 'args'"),
     [f"cannot read checkpoint step {LAST} in", "unexpected keyword argument", "nothing says its files are damaged"]),
])
def test_a_restore_failure_on_every_step_moves_nothing(failure, needles, sudoku_dir, tmp_path, trained, monkeypatch):
    import orbax.checkpoint as ocp

    def restore(*args, **kwargs):
        raise failure()

    root = copy_run(trained, tmp_path)
    before = files_under(root / CKPT)
    monkeypatch.setattr(ocp.StandardCheckpointHandler, "restore", restore)
    result = train(overrides(sudoku_dir, root), check=False)
    assert_user_error(result, *needles)
    assert files_under(root / CKPT) == before and not quarantined(root / CKPT)


@pytest.mark.slow
def test_config_mismatch_is_refused_and_nothing_is_moved(sudoku_dir, tmp_path, trained):
    root = copy_run(trained, tmp_path)
    ckpt = root / CKPT
    before = files_under(ckpt)
    result = train(overrides(sudoku_dir, root, "arch.hidden=48"), check=False)
    assert_user_error(result, "arch.hidden=32", "48", "run.name")
    assert files_under(ckpt) == before

    # A state that does not fit although the saved config agrees (e.g. the model code changed):
    # still a mismatch, not corruption.
    meta_file = ckpt / str(LAST) / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["config"]["arch"]["hidden"] = 48
    meta_file.write_text(json.dumps(meta))
    before = files_under(ckpt)
    result = train(overrides(sudoku_dir, root, "arch.hidden=48"), check=False)
    assert_user_error(result, f"checkpoint step {LAST}", "does not fit this run's state", "shape (", "config")
    assert files_under(ckpt) == before and not quarantined(ckpt)


@pytest.mark.slow
def test_changed_train_steps_is_logged_and_recorded(sudoku_dir, tmp_path, trained):
    root = copy_run(trained, tmp_path)
    more = LAST + 10
    result = train(overrides(sudoku_dir, root, f"train.steps={more}"))
    assert resumed_step(result.log) == LAST
    lines = [line for line in result.log.splitlines() if "changed from" in line]
    assert len(lines) == 1 and lines[0].startswith(f"train.steps changed from {LAST} to {more} at step {LAST}: the cosine "
                                                   f"schedule now ends at step {more} (lr at step {LAST + 1}: "), result.log
    out = root / "test" / "t"
    change = json.loads((out / "run_manifest.json").read_text())["schedule_change"]
    assert change["at_step"] == LAST and change["total_steps_before"] == LAST and change["total_steps"] == more
    rows = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "train/lr" in r}
    assert change["lr_next_step"] == pytest.approx(rows[LAST + 1]["train/lr"], rel=1e-5)  # the lr it trained with
    assert change["lr_last_step"] == pytest.approx(rows[more]["train/lr"], rel=1e-5)
    assert change["lr_next_step_before"] < change["lr_next_step"]  # the old schedule had reached its floor


def test_quarantine_on_gcs_copies_everything_then_unlists_the_step(tmp_path):
    """gs://: the step's objects are copied under the new name before any is deleted, and Orbax no
    longer lists the step."""
    import jax
    import jax.numpy as jnp
    from gcs_emulator import start_gcs_emulator
    from google.cloud import storage

    from runtime.checkpointing import Checkpoints

    with start_gcs_emulator(tmp_path) as emu:
        emu.apply_env()
        emu.create_bucket("ckpts")
        ckpt = Checkpoints("gs://ckpts/run", keep=5, async_save=False)
        for step in (1, 2):
            ckpt.save(step, {"w": jnp.full((4, 8), step, jnp.float32)}, {"step": step})
        ckpt.wait()
        bucket = storage.Client().bucket("ckpts")
        before = {b.name[len("run/2/"):]: b.size for b in bucket.list_blobs(prefix="run/2/")}

        ckpt.quarantine(2, "test")
        (step, moved), = ckpt.quarantined
        assert step == 2 and moved.startswith("gs://ckpts/run/quarantined-2-")
        prefix = moved[len("gs://ckpts/"):] + "/"
        assert {b.name[len(prefix):]: b.size for b in bucket.list_blobs(prefix=prefix)} == before
        assert not list(bucket.list_blobs(prefix="run/2/"))
        assert ckpt.all_steps() == [1] and Checkpoints("gs://ckpts/run", keep=5, async_save=False).all_steps() == [1]
        restored = ckpt.restore_state(1, {"w": jax.ShapeDtypeStruct((4, 8), jnp.float32)})
        assert float(restored["w"][0, 0]) == 1.0
        ckpt.close()


def test_storage_access_errors_are_not_corruption():
    from runtime.checkpointing import is_access_error

    assert is_access_error(PermissionError("denied"))
    assert is_access_error(ValueError('PERMISSION_DENIED: Error reading "x" in OCDBT database'))
    try:
        try:
            raise ConnectionError("reset")
        except ConnectionError as e:
            raise RuntimeError("restore failed") from e
    except RuntimeError as wrapped:
        assert is_access_error(wrapped)
    assert not is_access_error(ValueError("FAILED_PRECONDITION: ZSTD_decompressStream() failed"))
    assert not is_access_error(FileNotFoundError("Requested directory for restore does not exist"))
    with pytest.raises(json.JSONDecodeError) as bad_json:
        json.loads("{garbled")
    assert not is_access_error(bad_json.value)


def test_only_a_sign_of_damage_makes_a_step_corrupt():
    from runtime.checkpointing import damage_sign

    assert damage_sign(ValueError('OUT_OF_RANGE: Error reading "w/0.0" in OCDBT database')) == "OUT_OF_RANGE"
    assert damage_sign(ValueError('FAILED_PRECONDITION: Error reading "w/0.0" in OCDBT database')) == "Error reading"
    assert damage_sign(FileNotFoundError("Metadata file (named _METADATA) does not exist")) == "FileNotFoundError"
    try:
        try:
            json.loads("")
        except json.JSONDecodeError as e:
            raise StopIteration(0) from e  # how Orbax wraps an empty JSON file
    except StopIteration as wrapped:
        assert damage_sign(wrapped) == "JSONDecodeError"
    assert damage_sign(TypeError("restore() got an unexpected keyword argument 'args'")) is None
    assert damage_sign(ValueError("FAILED_PRECONDITION: unsupported manifest version")) is None


POD_SCRIPT = r"""
import json, os, sys
from pathlib import Path
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P
jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"], 2, int(os.environ["JAX_PROCESS_ID"]))
from runtime.checkpointing import Checkpoints

directory = sys.argv[1]
sharding = NamedSharding(jax.make_mesh((4,), ("d",)), P("d"))
ckpt = Checkpoints(directory, keep=5, async_save=False)
for step in (1, 2):
    ckpt.save(step, {"w": jax.device_put(jnp.arange(8192.0) + step, sharding)}, {"step": step})
ckpt.wait()
if jax.process_index() == 0:  # damage the array data only process 1 wrote, and reads back
    for chunk in Path(directory, "2", "state").glob("ocdbt.process_1/d/*"):
        chunk.write_bytes(b"")
multihost_utils.sync_global_devices("damaged")
step, state = ckpt.first_readable(lambda s: ckpt.restore_state(s, {"w": jax.ShapeDtypeStruct((8192,), jnp.float32, sharding=sharding)}))
values = multihost_utils.process_allgather(state["w"], tiled=True)
print("RESULT", json.dumps({"step": step, "steps": ckpt.all_steps(), "quarantined": ckpt.quarantined,
                            "w_is_step_1": bool(np.array_equal(values, np.arange(8192.0) + 1))}), flush=True)
"""


@pytest.mark.slow
def test_processes_agree_when_only_one_sees_the_damage(tmp_path):
    """2 processes: step 2's array data that only process 1 reads is damaged; process 0 quarantines
    the step and both restore step 1."""
    port, directory = free_port(), tmp_path / "ckpt"
    logs = [tmp_path / f"p{i}.log" for i in range(2)]  # files, not pipes: a full pipe would stall the pair
    procs = []
    for i, log in enumerate(logs):
        with log.open("w") as out:
            procs.append(subprocess.Popen([sys.executable, "-c", POD_SCRIPT, str(directory)], cwd=REPO, stdout=out,
                                          stderr=subprocess.STDOUT, env=child_env(
                                              2, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_PROCESS_ID=str(i))))
    try:
        codes = [p.wait(timeout=180) for p in procs]
    finally:
        for p in procs:
            p.kill()
    outputs = [log.read_text() for log in logs]
    assert codes == [0, 0], outputs
    results = [json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]) for out in outputs]
    assert [r["step"] for r in results] == [1, 1] and [r["steps"] for r in results] == [[1], [1]]
    assert results[0]["w_is_step_1"] and results[1]["w_is_step_1"]
    (moved,) = quarantined(directory)
    assert results[0]["quarantined"] == [[2, str(moved)]] and results[1]["quarantined"] == [[2, None]]
    assert "unreadable on process 1" in outputs[0] and "process 1: checkpoint step 2" in outputs[1]


def test_dropped_unraisable_reports_stay_dropped_after_the_run(tmp_path):
    """A filter registered during a run (the reads Orbax abandons after a failed restore) still
    drops those reports after the run's log file is closed: they are collected later."""
    import sys
    from types import SimpleNamespace

    from runtime import run_log

    marker = object()
    seen, before = [], sys.unraisablehook
    try:
        sys.unraisablehook = seen.append
        with run_log.library_logs_to(str(tmp_path / "run.log")):
            run_log.drop_unraisable(lambda u: u.object is marker)
        report = dict(exc_type=RuntimeError, exc_value=RuntimeError("late"), exc_traceback=None, err_msg=None)
        dropped, kept = SimpleNamespace(object=marker, **report), SimpleNamespace(object=None, **report)
        sys.unraisablehook(dropped)
        sys.unraisablehook(kept)
    finally:
        sys.unraisablehook = before
    assert seen == [kept]


def test_late_event_loop_callbacks_go_to_the_run_log_never_the_console(tmp_path):
    """tensorstore's callbacks that land on Orbax's closed event loop after a failed save reach
    sys.excepthook with only asyncio's frames (seen under load: a stray traceback before the one
    error line). During the run they go to run.log, after it nowhere; any other exception, and
    the same error raised from our own code, still reach the previous hook."""
    import asyncio
    import sys

    from runtime import run_log

    loop = asyncio.new_event_loop()
    loop.close()
    try:
        loop.call_soon_threadsafe(print)
    except RuntimeError as e:
        ours = e
    late = (RuntimeError, ours, ours.__traceback__.tb_next)  # called from C++: asyncio's frames only
    other = (ValueError, ValueError("x"), None)
    seen, before = [], sys.excepthook
    try:
        sys.excepthook = lambda *exc: seen.append(exc)
        with run_log.library_logs_to(str(tmp_path / "run.log")):
            sys.excepthook(*late)
            sys.excepthook(*other)
        sys.excepthook(*late)
        sys.excepthook(RuntimeError, ours, ours.__traceback__)  # raised by this test's own frame
    finally:
        sys.excepthook = before
    assert seen == [other, (RuntimeError, ours, ours.__traceback__)]
    assert "Event loop is closed" in (tmp_path / "run.log").read_text()
