"""Hardening, round two, where tests/test_hardening.py does not reach: storage faults that appear
while a run goes, one case from the command line, and a checkpoint folder on GCS that holds
someone else's objects. Each: one `error:` line, the documented exit code, no traceback, and what
was there before (the committed checkpoints, the user's files and objects) byte-identical.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from helpers import (REFERENCE_EXTRA, REFERENCE_STEPS, base_overrides, error_line, raises_one_line, resumed_step,
                     run_pretrain, saved_steps, train, tree_hash)
from runtime.errors import EXIT_STORAGE
from test_hardening import data, refused  # noqa: F401 - data: a fixture


# ---------------------------------------------------------------- 1. storage faults mid-run
def _in_the_way(path: Path) -> None:
    """What an operator (or a stray script) does mid-run: the run's file or folder moved aside
    and something of the other kind put at its path."""
    path.rename(path.with_name(path.name + ".moved"))
    if path.name == "wandb":
        path.write_text("a file where W&B's folder was")
    else:
        path.mkdir()
        (path / "kept.txt").write_text("a folder where the run's file was")


def _put_back(path: Path) -> None:
    """The fix the error line names: what stood in the way moved out, the run's own moved back."""
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    path.with_name(path.name + ".moved").rename(path)


@pytest.mark.slow
@pytest.mark.devices(1)  # storage faults, not the mesh (and the reference run's compiled step)
def test_storage_faults_mid_run_stop_with_one_line_and_keep_the_checkpoints(data, tmp_path, monkeypatch):
    """Each launch resumes where the one before failed, and a fault appears as soon as it commits
    its first checkpoint (the trainer's on-commit hook): the run's metrics.jsonl, run.log, W&B
    folder, a step's place in the checkpoint directory, the manifest. Each stops the run with
    exit 6 and one line naming the path and the fix, and every checkpoint committed so far stays
    byte-identical and is resumed from by the next launch."""
    import runtime.trainer
    from runtime.checkpointing import newest_committed

    out, ckpt = tmp_path / "runs" / "test" / "t", tmp_path / "ckpt"
    run = base_overrides(data, tmp_path / "runs", steps=REFERENCE_STEPS) + REFERENCE_EXTRA + [
        "train.checkpoint_every=2", "run.checkpoint.keep=100", f"run.checkpoint.dir={ckpt}"]
    kept: dict[int, dict] = {}  # step -> its files' hashes, once committed
    faults: list = []  # what the next launch's first commit does
    seen: dict[str, dict] = {}  # what stood in the way, and the run's file moved aside, right after the fault

    real = runtime.trainer.committed

    def steps() -> list[int]:
        return [s for s in saved_steps(ckpt) if (ckpt / str(s)).is_dir()]

    def committed(step, files):
        real(step, files)
        kept.update({s: tree_hash(ckpt / str(s)) for s in steps() if s not in kept})
        if faults:
            faults.pop()(step)
            seen["after"] = tree_hash(tmp_path / "runs")

    monkeypatch.setattr(runtime.trainer, "committed", committed)  # ckpt's on_commit looks it up at each commit

    def launch(fault, *extra: str, resumes: int | None) -> tuple[str, int, int]:
        """(error line, its step, the last complete checkpoint) of a launch that must fail with exit 6."""
        faults[:] = [fault]
        result = train(run + list(extra), check=False)
        assert result.code == EXIT_STORAGE and result.error, (result.code, result.error, result.log[-3000:])
        assert "\n" not in result.error and "Traceback" not in result.log, result.error
        if resumes is not None:
            assert resumed_step(result.log) == resumes
        last = int(re.search(r"the last complete checkpoint: step (\d+)", result.error).group(1))
        assert last == max(steps()) and last in kept
        assert {s: tree_hash(ckpt / str(s)) for s in kept} == kept  # nothing committed was touched
        step = re.search(r" at step (\d+) | of step (\d+) ", result.error)
        return result.error, int(next(g for g in step.groups() if g)) if step else REFERENCE_STEPS, last

    def untouched(*names: str) -> None:
        """The user's things in the way, and the run's own file moved aside, as they were after the fault."""
        def under(hashes: dict, name: str) -> dict:
            return {k: v for k, v in hashes.items() if k == f"test/t/{name}" or k.startswith(f"test/t/{name}/")}

        after = tree_hash(tmp_path / "runs")
        for name in names:
            assert under(after, name) == under(seen["after"], name) and under(after, name), name

    # metrics.jsonl (it used to go on into the file moved aside, and the run ended "completed")
    error, step, last = launch(lambda step: _in_the_way(out / "metrics.jsonl"), resumes=None)
    assert error == (f"cannot write {out / 'metrics.jsonl'} at step {step} (a folder stands where a file goes); move "
                     f"what is in the way out of the output directory {out} and relaunch the same command to resume; "
                     f"the last complete checkpoint: step {last}")
    untouched("metrics.jsonl", "metrics.jsonl.moved")
    _put_back(out / "metrics.jsonl")

    # run.log (the same: its lines went on into the file moved aside)
    error, step, last = launch(lambda step: _in_the_way(out / "run.log"), resumes=last)
    assert error.startswith(f"cannot write {out / 'run.log'} at step {step} (a folder stands where a file goes); move "
                            "what is in the way out of the output directory"), error
    untouched("run.log", "run.log.moved")
    _put_back(out / "run.log")

    # W&B's folder (the run used to end in a traceback, copying the manifest into W&B's files)
    error, step, last = launch(lambda step: _in_the_way(out / "wandb"), "run.wandb.mode=offline", resumes=last)
    assert error.startswith(f"cannot write W&B files under {out / 'wandb'} at step {step} (a file stands where a "
                            f"folder goes: {out / 'wandb'}); move it out of the output directory"), error
    untouched("wandb")  # (W&B's service writes on into its folder moved aside, until the run finishes it)
    _put_back(out / "wandb")

    # a file named like the next step in the checkpoint directory (Orbax used to delete it, to save there)
    error, step, last = launch(lambda step: (ckpt / str(step + 2)).write_text("my file"), resumes=last)
    assert error == (f"checkpoint save of step {step} to {ckpt} failed: {ckpt / str(step)} is a file that is no "
                     f"checkpoint step of this project, and saving the step would delete it; the last complete "
                     f"checkpoint: step {last}. Move it out of {ckpt} and relaunch the same command to resume")
    assert (ckpt / str(step)).read_text() == "my file" and last == step - 2
    (ckpt / str(step)).rename(tmp_path / "my-file")

    # the manifest, written again when the run ends (the line used to lack the last complete checkpoint);
    # fewer saves on the way there, for a shorter test
    error, _, last = launch(lambda step: _in_the_way(out / "run_manifest.json"), "train.checkpoint_every=8",
                            resumes=last)
    assert error == (f"cannot write run_manifest.json in {out} (a folder stands where a file goes); move what is in "
                     f"the way out of {out} and relaunch the same command to resume; the last complete checkpoint: "
                     f"step {REFERENCE_STEPS}")
    untouched("run_manifest.json", "run_manifest.json.moved")
    assert newest_committed(str(ckpt))[0] == REFERENCE_STEPS  # what a relaunch resumes from (and finds done)


def test_a_run_file_moved_mid_run_is_written_again_at_its_path(tmp_path):
    """metrics.jsonl and run.log, moved aside or deleted while the run writes them: the next row
    (log line) starts a new file at the path instead of going on into one nobody reads; a folder
    put there instead is the run's exit 6 (above)."""
    import logging

    from runtime.errors import OutputDirError
    from runtime.metrics_sinks import LineFile
    from runtime.run_log import library_logs_to

    metrics = LineFile(tmp_path / "metrics.jsonl")
    metrics.append("1\n", "at step 1")
    (tmp_path / "metrics.jsonl").rename(tmp_path / "moved.jsonl")
    metrics.append("2\n", "at step 2")
    (tmp_path / "metrics.jsonl").unlink()
    metrics.append("3\n", "at step 3")
    assert (tmp_path / "moved.jsonl").read_text() == "1\n" and (tmp_path / "metrics.jsonl").read_text() == "3\n"
    (tmp_path / "metrics.jsonl").rename(tmp_path / "moved.jsonl")
    (tmp_path / "metrics.jsonl").mkdir()
    raises_one_line(OutputDirError, lambda: metrics.append("4\n", "at step 4"), "at step 4 (a folder stands where")
    metrics.close()

    log, path = logging.getLogger("orbax"), tmp_path / "run.log"  # a library's logger: to the file only
    with library_logs_to(str(path)) as check:
        log.warning("one")
        path.rename(tmp_path / "run.log.1")
        log.warning("two")
        check("at step 2")
        path.rename(tmp_path / "run.log.2")
        path.mkdir()
        log.warning("three")  # dropped: nowhere to write it
        raises_one_line(OutputDirError, lambda: check("at step 3"), f"cannot write {path} at step 3 (a folder stands")
    assert [(tmp_path / f"run.log.{i}").read_text().split()[-1] for i in (1, 2)] == ["one", "two"]


# ------------------------------------------------------------- 2. from the command line
def test_the_command_line_says_a_storage_fault_in_one_line(data, tmp_path):
    """pretrain_jax.py itself: a folder where the run writes metrics.jsonl is exit 6, one `error:`
    line at the start of a line of everything it printed, no traceback, nothing compiled, and
    nothing under the test folder changed or added."""
    out = tmp_path / "runs" / "test" / "t"
    (out / "metrics.jsonl").mkdir(parents=True)
    (out / "metrics.jsonl" / "mine.txt").write_text("x")
    (out / ".podrunner-run").write_text("{}")  # an earlier run's folder
    before = tree_hash(tmp_path)
    proc: subprocess.CompletedProcess = run_pretrain(base_overrides(data, tmp_path / "runs", steps=2), check=False)
    printed = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_STORAGE, printed[-3000:]
    error_line(printed, f"error: cannot write {out / 'metrics.jsonl'}: a folder stands where the run writes its file",
               "move it out of the output directory")
    assert "compiled train step" not in printed and tree_hash(tmp_path) == before
    assert sorted(p.name for p in out.iterdir()) == [".podrunner-run", "metrics.jsonl"]


# ------------------------------------------------------- 3. someone else's checkpoint folder
# name -> (objects or files in it, the refusal): a user's file named like a step beside an earlier
# run's manifest (the folder is ours, the file is not: Orbax would replace it), a folder of
# someone's notes, a step-named folder holding no checkpoint (Orbax would delete it past keep).
FOREIGN = {"ckpt": ({"20": "my file", "run_manifest.json": "{}"}, "holds a file 20 that is no checkpoint step"),
           "mine": ({"notes.txt": "my notes"}, "already holds files (notes.txt) and no .podrunner-run marker"),
           "steps": ({"7/mine.txt": "x"}, "holds a folder 7 that is no checkpoint step")}


def _gcs_objects(bucket: str) -> dict[str, tuple]:
    from google.cloud import storage

    return {b.name: (b.generation, b.md5_hash) for b in storage.Client().list_blobs(bucket)}


@pytest.mark.parametrize("where", ["gs", "local"])
def test_a_checkpoint_folder_of_someone_elses_files_is_refused(request, data, tmp_path, where):
    """Before anything is compiled or written: every object (file) as it was, none added."""
    if where == "gs":
        request.getfixturevalue("gcs").create_bucket("runs")
        from google.cloud import storage

        bucket = storage.Client().bucket("runs")
        for name, (files, _) in FOREIGN.items():
            for path, text in files.items():
                bucket.blob(f"{name}/{path}").upload_from_string(text)
    else:
        for name, (files, _) in FOREIGN.items():
            for path, text in files.items():
                (tmp_path / "ckpts" / name / path).parent.mkdir(parents=True, exist_ok=True)
                (tmp_path / "ckpts" / name / path).write_text(text)
    objects = _gcs_objects("runs") if where == "gs" else None
    for name, (_, needle) in FOREIGN.items():
        directory = f"gs://runs/{name}" if where == "gs" else str(tmp_path / "ckpts" / name)
        refused(tmp_path, base_overrides(data, tmp_path / "runs", steps=2) + [f"run.checkpoint.dir={directory}"],
                f"checkpoint directory {directory} {needle}", "run.checkpoint.dir")
        if where == "gs":
            assert _gcs_objects("runs") == objects  # no probe, lease or step written; nothing rewritten
        assert not (tmp_path / "runs").exists()

    # The same put there while a run goes, where it saves next: Orbax would delete it to save the step.
    from runtime.checkpointing import Checkpoints
    from runtime.errors import StorageError

    before = tree_hash(tmp_path)
    for name, step, kind in [("ckpt", 20, "file"), ("steps", 7, "folder")]:
        directory = f"gs://runs/{name}" if where == "gs" else str(tmp_path / "ckpts" / name)
        ckpt = Checkpoints(directory, keep=3, async_save=False)
        raises_one_line(StorageError, lambda: ckpt.save(step, {"x": np.zeros(2)}, {}),
                        f"checkpoint save of step {step} to {directory} failed: {directory}/{step} is a {kind} that "
                        "is no checkpoint step of this project", f"Move it out of {directory}", code=EXIT_STORAGE)
        ckpt.close()
    assert tree_hash(tmp_path) == before and (_gcs_objects("runs") == objects if where == "gs" else True)


@pytest.fixture
def gcs(tmp_path):
    """gcp-storage-emulator on loopback, this process pointed at it (tests/gcs_emulator.py)."""
    from gcs_emulator import reset_gcs_client_caches, start_gcs_emulator

    with start_gcs_emulator(tmp_path / "gcs") as emu:
        emu.apply_env()
        yield emu
    reset_gcs_client_caches()  # no client of this emulator's port is reused by a later test
