"""Hardening, round two: operator mistakes and faults of each class are one `error:` line at the
start of a line, the documented exit code, no traceback, nothing compiled, and every file that
was there before byte-identical afterwards (helpers.tree_hash of the whole test folder).

Classes: a tool never writes into a folder it did not create; names that become paths;
ranges of every command's numbers and a dataset checked against its metadata; a generated set
reused only with its own parameters; storage faults (exit 6) and host resources. Everything runs
in this process and fails before any compile, but the SIGTERM case, where the signal is the point.
(Hugging Face config.json and export cases: tests/test_gemma_hf.py.)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import (PRETRAIN, REPO, assert_user_error, base_overrides, child_env, cli_refused, compose_config,
                     error_line, kill, raises_one_line, saved_steps, train, tree_hash, wait_for)
from runtime.errors import EXIT_PREEMPTED, EXIT_STORAGE, EXIT_USER_ERROR


def refused(tmp_path: Path, overrides: list[str], *needles: str, code: int = EXIT_USER_ERROR) -> str:
    """The run of `overrides` (in this process) ends with `code` and one line holding `needles`
    (pretrain_jax.py prints it as its one `error:` line), before any compile; what the script
    would print (the run's log, then that line) holds exactly one line starting `error:`, last,
    and no traceback; every file that was under `tmp_path` before is byte-identical afterwards,
    and no file was added to a folder that was there before (only to folders the run created)."""
    before, folders = tree_hash(tmp_path), {p for p in tmp_path.rglob("*") if p.is_dir()} | {tmp_path}
    result = train(overrides, check=False)
    assert result.code == code and result.error, (result.code, result.error, result.log[-2000:])
    assert len(result.error.splitlines()) == 1, result.error  # "\r" too: the line is one line on a console
    assert "compiled train step" not in result.log, result.log[-2000:]
    error_line(f"{result.log}\nerror: {result.error}\n", *needles, last=True)
    after = tree_hash(tmp_path)
    assert {name: after.get(name) for name in before} == before
    added = [name for name in after if name not in before and (tmp_path / name).parent in folders]
    assert not added, f"written into a folder the run did not create: {added}"
    return result.error


@pytest.fixture
def data(sudoku_dir, tmp_path) -> Path:
    """A copy of the session's generated Sudoku set (its marker included) inside the test folder."""
    copy = tmp_path / "data"
    shutil.copytree(sudoku_dir, copy)
    return copy


# ------------------------------------------------------------- 1. never into someone else's folder
def test_a_run_never_writes_into_a_folder_it_did_not_create(data, tmp_path):
    runs = tmp_path / "runs"
    mine = runs / "test" / "t"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("my notes")  # a folder of the user's where the run would go
    refused(tmp_path, base_overrides(data, runs, steps=2), f"output directory {mine} already holds files (notes.txt)",
            "no .podrunner-run marker", "run.name")

    ckpt = tmp_path / "ckpt"  # a checkpoint directory with a file named like a step: Orbax would replace it
    ckpt.mkdir()
    (ckpt / "20").write_text("my file")
    (ckpt / "run_manifest.json").write_text("{}")
    extra = [f"run.checkpoint.dir={ckpt}"]
    refused(tmp_path, base_overrides(data, tmp_path / "other", steps=2) + extra, f"checkpoint directory {ckpt} holds a "
            "file 20 that is no checkpoint step of this project", "run.checkpoint.dir")
    (ckpt / "20").unlink()
    (ckpt / "7").mkdir()  # a folder named like a step, holding no checkpoint: Orbax would delete it past keep
    (ckpt / "7" / "mine.txt").write_text("x")
    refused(tmp_path, base_overrides(data, tmp_path / "other", steps=2) + extra, "holds a folder 7")

    refused(tmp_path, base_overrides(data, tmp_path / "other", steps=2) + [f"run.checkpoint.dir={data}"],
            f"checkpoint directory {data} already holds files", "no .podrunner-run marker")


def test_an_empty_folder_left_by_a_failed_start_is_used(data, tmp_path):
    """What an attempt that stopped before writing leaves (empty folders) is no one's data."""
    out = tmp_path / "runs" / "test" / "t"
    (out / "checkpoints").mkdir(parents=True)
    result = train(base_overrides(data, tmp_path / "runs", steps=2) + ["data.train_split=nope"], check=False)
    assert_user_error(result, "split 'nope' not found")  # refused for the data, not for the folder


def test_another_processs_write_probe_is_no_ones_data(tmp_path):
    """On a pod, process 0 checks the run directory while the others probe the checkpoint folder
    inside it for write access (runtime/preflight.check_local_writable): their probes are the
    project's own, not a user's files (seen as a refused first launch of a 3-process pod)."""
    from runtime.preflight import PROBE_DIR, check_run_dir, local_entries

    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / f"{PROBE_DIR}-host-123").write_bytes(b"probe")
    (out / f"{PROBE_DIR}-host-124").write_bytes(b"probe")
    check_run_dir(str(out), "output directory", "run.name", local_entries)
    check_run_dir(str(out / "checkpoints"), "checkpoint directory", "run.checkpoint.dir", local_entries, steps=True)
    (out / "checkpoints" / "mine.txt").write_text("a user's file")  # beside a probe, still refused
    with pytest.raises(Exception, match="already holds files .checkpoints."):
        check_run_dir(str(out), "output directory", "run.name", local_entries)


def test_export_never_writes_into_a_folder_it_did_not_create(tmp_path, capsys):
    from runtime.export import main

    mine = tmp_path / "my-model"
    mine.mkdir()
    (mine / "config.json").write_text('{"mine": true}')
    (mine / "model.safetensors").write_bytes(b"my weights")
    (tmp_path / "a-file").write_text("x")
    before = tree_hash(tmp_path)
    ckpt = ["--checkpoint-dir", str(tmp_path / "no-run")]  # refused before the checkpoint is looked at
    cli_refused(capsys, main, [*ckpt, "--out", str(mine)], EXIT_USER_ERROR, f"--out {mine} already holds files",
                "config.json", "no .podrunner-export marker", "--overwrite")
    cli_refused(capsys, main, [*ckpt, "--out", str(tmp_path / "a-file")], EXIT_USER_ERROR, "is a file, not a folder")
    cli_refused(capsys, main, [*ckpt, "--out", str(tmp_path / "new"), "--step", "-1"], EXIT_USER_ERROR,
                "--step -1 is out of range")
    cli_refused(capsys, main, [*ckpt, "--out", str(tmp_path / "new")], EXIT_USER_ERROR,
                f"checkpoint directory {tmp_path / 'no-run'} does not exist")
    assert tree_hash(tmp_path) == before and not (tmp_path / "no-run").exists() and not (tmp_path / "new").exists()


# --------------------------------------------------------------------- 2. names that become paths
@pytest.mark.parametrize("override,needle", [
    ("run.name=../../x", "run.name='../../x' cannot name a folder"),
    ("run.name=", "run.name='' cannot name a folder: it is empty"),
    ("run.group=a/b", "without '/'"),
    ("run.name='x;rm -rf y'", "may hold only letters"),
    ("run.id=../elsewhere", "run.id='../elsewhere' is not a run id"),
    ("data.train_split=../../etc", "data.train_split='../../etc' cannot name a folder"),
])
def test_names_that_become_paths_are_checked(data, tmp_path, override, needle):
    runs = tmp_path / "r" / "runs"
    refused(tmp_path, base_overrides(data, runs, steps=2) + [override], needle)
    assert not runs.exists()


# ------------------------------------------------------------------ 3. every number has a range
@pytest.mark.parametrize("argv,needle", [
    (["plan", "exp01", "--topology", "v4-8", "--jobs", "-1"], "--jobs -1 is out of range: it must be >= 1"),
    (["supervise", "--run-id", "r", "--max-restarts", "-1"], "--max-restarts -1 is out of range"),
    (["supervise", "--run-id", "r", "--poll-seconds", "0"], "--poll-seconds 0 is out of range: it must be > 0"),
    (["pod", "--tpu", "t", "--zone", "z", "--interrupt-grace", "-5"], "--interrupt-grace -5 is out of range"),
    (["stop", "--tpu", "t", "--zone", "z", "--grace", "-1"], "--grace -1 is out of range"),
    (["supervise", "--run-id", "r", "--stop-grace", "-1"], "--stop-grace -1 is out of range"),
    (["pod", "--tpu", "t", "--zone", "z", "--forward-env", "PODRUNNER_UNSET_SECRET"],
     "PODRUNNER_UNSET_SECRET is not set in this environment"),
])
def test_launcher_numbers_and_forwarded_names(capsys, monkeypatch, tmp_path, argv, needle):
    from experiments.launch import main

    monkeypatch.delenv("PODRUNNER_UNSET_SECRET", raising=False)
    monkeypatch.chdir(tmp_path)  # nothing may be written: the folder stays empty
    cli_refused(capsys, main, argv, EXIT_USER_ERROR, needle)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("builder,argv,needle", [
    ("build_sudoku", ["--generate", "20", "--num-aug", "-1"], "--num-aug -1 is out of range: it must be >= 0"),
    ("build_sudoku", ["--generate", "20", "--min-givens", "5"], "--min-givens 5 is out of range"),
    ("build_maze", ["--generate", "10", "--loop-fraction", "2"], "--loop-fraction 2 is out of range"),
    ("build_sft", ["--generate-arithmetic", "10", "--eval-fraction", "0"], "--eval-fraction 0 is out of range"),
])
def test_builder_numbers(capsys, tmp_path, builder, argv, needle):
    import importlib

    main = importlib.import_module(f"data_pipeline.{builder}").main
    cli_refused(capsys, main, ["--output-dir", str(tmp_path / "out"), *argv], EXIT_USER_ERROR, needle)
    assert not (tmp_path / "out").exists()


def test_a_partial_distributed_environment_is_refused(data, tmp_path, monkeypatch):
    from runtime.config import DistributedConfig
    from runtime.distributed import explicit_values
    from runtime.errors import UserError

    address = {"JAX_COORDINATOR_ADDRESS": "10.0.0.2:8482"}
    for env, missing in [(address, "JAX_NUM_PROCESSES, JAX_PROCESS_ID missing"),
                         ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}, "JAX_COORDINATOR_ADDRESS missing"),
                         (dict(address, JAX_PROCESS_ID="0"), "JAX_NUM_PROCESSES missing")]:
        raises_one_line(UserError, lambda: explicit_values(DistributedConfig(), env), missing, "or none",
                        code=EXIT_USER_ERROR)
    assert explicit_values(DistributedConfig(), {}) is None  # none of them: a single process
    # The run itself, the variable set in its environment: refused before it joins, writes or compiles.
    monkeypatch.setenv("JAX_PROCESS_ID", "1")
    refused(tmp_path, base_overrides(data, tmp_path / "runs", steps=2),
            "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES missing: give all three of", "or none")
    assert not (tmp_path / "runs").exists()


def test_run_numbers_and_nothing_to_evaluate(data, tmp_path):
    refused(tmp_path, base_overrides(data, tmp_path / "runs", steps=2) + [f"train.steps={2**31}"],
            f"train.steps={2**31} is out of range", "<= 2147483647")
    refused(tmp_path, base_overrides(data, tmp_path / "runs", steps=2) + ["data.generate_min_givens=5"],
            "data.generate_min_givens=5 is out of range")
    refused(tmp_path, base_overrides(data, tmp_path / "runs", steps=2) + ["train.eval_only=true"],
            "train.eval_only=true but there is nothing to evaluate", "train.init_params_from")


def _rewrite(root: Path, split: str, field: str, change) -> None:
    path = root / split / f"all__{field}.npy"
    np.save(path, change(np.load(path).astype(np.int32)))


def _metadata(root: Path, split: str, **changes) -> None:
    path = root / split / "dataset.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


@pytest.mark.parametrize("case,needle", [
    ("vocab_size 0", "vocab_size=0 must be an integer >= 1"),
    ("vocab_size string", "vocab_size='11' must be an integer >= 1"),
    ("input outside the vocabulary", "inputs hold 11, outside [0, vocab_size=11)"),
    ("negative label", "labels hold -5, outside [0, vocab_size=11) or the ignore id 0"),
    ("every label ignored", "every label is the ignore id 0"),
    ("labels of another shape", "labels has shape (320, 80), expected [N, seq_len=81]"),
])
def test_a_dataset_is_checked_against_its_metadata_when_opened(data, tmp_path, case, needle):
    if case == "vocab_size 0":
        _metadata(data, "train", vocab_size=0)
    elif case == "vocab_size string":
        _metadata(data, "test", vocab_size="11")
    elif case == "input outside the vocabulary":
        _rewrite(data, "train", "inputs", lambda a: np.where(np.arange(a.size).reshape(a.shape) == 100, 11, a))
    elif case == "negative label":
        _rewrite(data, "test", "labels", lambda a: np.where(np.arange(a.size).reshape(a.shape) == 7, -5, a))
    elif case == "every label ignored":
        _rewrite(data, "train", "labels", np.zeros_like)
    else:
        _rewrite(data, "train", "labels", lambda a: a[:, :80])
    refused(tmp_path, base_overrides(data, tmp_path / "runs", steps=2), needle, str(data))


def test_a_sudoku_csv_whose_answers_are_no_solutions_is_refused(capsys, tmp_path):
    from data_pipeline.build_sudoku import main
    from data_pipeline.sudoku import random_solution

    solution = "".join(map(str, random_solution(np.random.default_rng(0))))
    puzzle = solution[:40] + "." * 41
    changed = puzzle[:3] + str(int(puzzle[3]) % 9 + 1) + puzzle[4:]  # one given the answer does not keep
    swapped = solution[1] + solution[0] + solution[2:]  # two digits swapped in a row: columns repeat
    for rows, needle in [([(puzzle, solution), (changed, solution)], "line 3: its answer ('a') changes a given digit"),
                         ([("." * 81, swapped)], "line 2: its answer ('a') repeats a digit")]:
        source = tmp_path / "in.csv"
        source.write_text("source,q,a,rating\n" + "".join(f"x,{q},{a},0\n" for q, a in rows))
        before = tree_hash(tmp_path)
        cli_refused(capsys, main, ["--output-dir", str(tmp_path / "out"), "--source-csv", str(source)],
                    EXIT_USER_ERROR, str(source), needle, "fix or remove")
        assert tree_hash(tmp_path) == before and not (tmp_path / "out").exists()


# ----------------------------------------------- 4. a generated set only with its own parameters
def test_a_generated_set_is_reused_only_with_its_own_parameters(data, tmp_path):
    """The session's set was generated with 360 puzzles (40 held out), seed 0."""
    run = [o for o in base_overrides(data, tmp_path / "runs", steps=2) if "generate_if_missing" not in o]
    run.append("data.generate_if_missing=true")
    refused(tmp_path, run + ["data.generate_puzzles=2000", "data.generate_test_puzzles=40"],
            "generate=360 there, 2040 here", "data.generate_puzzles + data.generate_test_puzzles", "data.regenerate=true")
    refused(tmp_path, run + ["data.generate_puzzles=100", "data.generate_test_puzzles=40"],  # fewer over more, too
            "generate=360 there, 140 here", "data.regenerate=true")
    refused(tmp_path, run + ["data.generate_puzzles=320", "data.generate_test_puzzles=40", "data.generate_seed=3"],
            "seed=0 there, 3 here (data.generate_seed)")
    (data / "train" / "dataset.json").unlink()  # an incomplete generated set: never rebuilt with other sizes
    refused(tmp_path, run + ["data.generate_puzzles=350", "data.generate_test_puzzles=10"], "test_size=40 there, 10 here")

    from data_pipeline.kinds.sudoku import SudokuKind
    from data_pipeline.marker import read_marker

    config = compose_config(run + ["data.generate_puzzles=16", "data.generate_test_puzzles=4", "data.regenerate=true"])
    SudokuKind().ensure_built(config.data)  # asked for: the old build replaced
    assert read_marker(str(data))["parameters"]["generate"] == 20 and (data / "train" / "dataset.json").exists()


# ------------------------------------------------------------ 5. storage faults and host resources
@pytest.mark.parametrize("entry,needle", [
    ("metrics.jsonl", "a folder stands where the run writes its file"),
    ("run.log", "a folder stands where the run writes its file"),
    ("run_manifest.json", "a folder stands where the run writes its file"),
    ("wandb", "a file stands where the run writes its folder"),
])
def test_something_in_the_way_of_the_output_files_is_exit_6(data, tmp_path, entry, needle):
    out = tmp_path / "runs" / "test" / "t"
    out.mkdir(parents=True)
    (out / ".podrunner-run").write_text("{}")  # an earlier run's folder
    if entry == "wandb":
        (out / entry).write_text("x")
    else:
        (out / entry).mkdir()
        (out / entry / "kept.txt").write_text("x")
    refused(tmp_path, base_overrides(data, tmp_path / "runs", steps=2, wandb="offline"), f"cannot write {out / entry}",
            needle, code=EXIT_STORAGE)


def _tiny_gemma_run():
    """(config, params) of a tiny Gemma run, as runtime.builder.load_run_params returns them."""
    import jax

    from models.gemma.model import init_params

    config = compose_config(["arch=gemma_tiny", "data=sft_arithmetic", "arch.dtype=float32"])
    shapes = jax.eval_shape(lambda: init_params(config.arch, jax.random.key(0)))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: rng.standard_normal(x.value.shape).astype(np.float32), shapes,
                          is_leaf=lambda x: hasattr(x, "value"))
    return config, params


def test_an_export_that_cannot_be_written_is_exit_6(tmp_path, capsys, monkeypatch):
    import runtime.builder
    from runtime.export import main

    config, params = _tiny_gemma_run()
    monkeypatch.setattr(runtime.builder, "load_run_params", lambda directory, step: (config, 3, params))
    (tmp_path / "a-file").write_text("x")
    earlier = tmp_path / "earlier"  # an earlier export's folder where a folder now stands in the way
    (earlier / "model.safetensors").mkdir(parents=True)
    (earlier / "model.safetensors" / "kept").write_text("x")
    (earlier / ".podrunner-export").write_text(json.dumps({"files": ["model.safetensors", "config.json"]}))
    before = tree_hash(tmp_path)
    for out, needle in [(tmp_path / "a-file" / "model", "a file stands where a folder goes"),
                        (earlier, "a folder stands where a file goes")]:
        cli_refused(capsys, main, ["--checkpoint-dir", "ckpt", "--out", str(out)], EXIT_STORAGE,
                    f"cannot write the export to {out}", needle)
    assert tree_hash(tmp_path) == before


def test_a_model_too_big_for_host_memory_is_one_line(data, tmp_path):
    refused(tmp_path, base_overrides(data, tmp_path / "runs", steps=2) + ["arch.hidden=65536", "arch.heads=1"],
            "the train state needs", "GiB of host memory", "GiB is available", "a smaller model")


def test_a_truncated_supervision_record_is_one_line(capsys, tmp_path):
    from experiments.launch import main

    record = tmp_path / "logs" / "r1" / "supervision.json"
    record.parent.mkdir(parents=True)
    record.write_text('{"run_id": "r1", "launches": [{"started": 1')
    before = tree_hash(tmp_path)
    cli_refused(capsys, main, ["supervise", "--status", "--run-id", "r1", "--log-dir", str(tmp_path / "logs")],
                EXIT_USER_ERROR, f"supervision record {record} is truncated or garbled", "move it away")
    assert tree_hash(tmp_path) == before
    record.write_text('["not", "a", "record"]')
    before = tree_hash(tmp_path)
    cli_refused(capsys, main, ["supervise", "--status", "--run-id", "r1", "--log-dir", str(tmp_path / "logs")],
                EXIT_USER_ERROR, "is not a supervision record")
    assert tree_hash(tmp_path) == before


@pytest.mark.parametrize("case", ["root", "split", "file"])
def test_a_symlink_loop_under_the_data_path_is_one_line(data, tmp_path, case):
    if case == "root":
        os.symlink(tmp_path / "b", tmp_path / "a")
        os.symlink(tmp_path / "a", tmp_path / "b")
        target, gen, needle = tmp_path / "a", "true", "is a symbolic link that leads nowhere"
    elif case == "split":
        shutil.rmtree(data / "test")
        os.symlink(data / "test", data / "test")
        target, gen, needle = data, "false", "test is a symbolic link that leads nowhere"
    else:
        npy = data / "train" / "all__labels.npy"
        npy.unlink()
        os.symlink(npy, npy)
        target, gen, needle = data, "false", "Too many levels of symbolic links"
    overrides = [o for o in base_overrides(target, tmp_path / "runs", steps=2) if "generate_if_missing" not in o]
    refused(tmp_path, overrides + [f"data.generate_if_missing={gen}"], needle)


def _fail_on_third(real):
    calls = []

    def fail(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("the generator gave up")
        return real(*args, **kwargs)

    return fail


def test_a_builder_error_starts_its_line_after_a_progress_bar(capsys, monkeypatch, tmp_path):
    """A failure while a progress bar is drawn: the bar ends its line first."""
    from data_pipeline import build_arc, build_maze, build_sudoku

    monkeypatch.setattr(build_sudoku, "generate_puzzle", _fail_on_third(build_sudoku.generate_puzzle))
    cli_refused(capsys, build_sudoku.main, ["--output-dir", str(tmp_path / "s"), "--generate", "10"], EXIT_USER_ERROR,
                "the generator gave up")
    monkeypatch.setattr(build_maze, "generate_maze", _fail_on_third(build_maze.generate_maze))
    cli_refused(capsys, build_maze.main, ["--output-dir", str(tmp_path / "m"), "--generate", "10", "--size", "7"],
                EXIT_USER_ERROR, "the generator gave up")
    grid = [[1, 2], [3, 4]]
    tasks = {f"p{i}": {"train": [{"input": grid, "output": grid}], "test": [{"input": grid}]} for i in range(4)}
    tasks["p2"]["train"][0]["output"] = [[12]]  # a colour ARC does not have, met while the bar is drawn
    (tmp_path / "arc").mkdir()
    (tmp_path / "arc" / "x_training_challenges.json").write_text(json.dumps(tasks))
    before = tree_hash(tmp_path)
    cli_refused(capsys, build_arc.main, ["--output-dir", str(tmp_path / "a"), "--kaggle-dir", str(tmp_path / "arc"),
                                         "--num-aug", "0"], EXIT_USER_ERROR, "puzzle 'p2': ARC grid colours must be 0..9")
    after = tree_hash(tmp_path)
    assert {name: after.get(name) for name in before} == before  # its source, and the sets the others left


def test_sigterm_before_the_first_step_ends_cleanly(data, tmp_path):
    """The signal during start-up (dataset, plan, the first compiles) is a preemption like any
    other: exit 8 (preempted), one warning, no traceback; nothing was trained, so no checkpoint."""
    log, before = tmp_path / "out.txt", tree_hash(data)
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, str(PRETRAIN), *base_overrides(data, tmp_path / "runs", steps=1000)],
                                cwd=REPO, env=child_env(), stdout=f, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "INFO run id " in log.read_text(), timeout=120, what="the run's start", procs=[proc])
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=180)
    finally:
        kill([proc])
    out = log.read_text()
    assert proc.returncode == EXIT_PREEMPTED and "Traceback" not in out, out[-3000:]
    # A preemption is no error: its line is a warning (docs/OPERATIONS.md), no `error:` line at all.
    assert not [line for line in out.replace("\r", "\n").splitlines() if line.startswith("error:")], out[-3000:]
    assert tree_hash(data) == before  # the dataset it read, byte for byte
    saved = saved_steps(tmp_path / "runs" / "test" / "t" / "checkpoints")
    # The signal comes as soon as the run names itself, before its compiles; but a compile the
    # session's cache already holds is quick, so under load the first step may have begun by then.
    # Both are clean preemptions: before the first step nothing is saved; after it, its step is.
    if "preempted (SIGTERM) before the first step" in out:
        print("SIGTERM came before the first step")
        assert saved == [], saved
    else:
        print("SIGTERM came after the first step had begun")
        assert "preempted (SIGTERM): checkpoint saved at step" in out and len(saved) == 1, out[-3000:]
