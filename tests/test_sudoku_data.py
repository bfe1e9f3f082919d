"""Sudoku solver/generator/augmentation, the puzzle on-disk format, and the builder."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
from pathlib import Path

# gcsfs reads this when first imported; without it, it probes the emulator over gRPC and stalls.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import numpy as np
import pytest

from data_pipeline.build_sudoku import build_sudoku_dataset, main
from data_pipeline.puzzle_format import (
    DatasetError,
    PuzzleDatasetMetadata,
    load_split,
    write_identifiers,
    write_split,
)
from data_pipeline.sudoku import augment, count_solutions, generate_puzzle, is_valid_solution, solve

from gcs_emulator import gs_bucket  # tests/ is on sys.path (conftest)

# A published puzzle with a known unique solution.
PUZZLE = "53..7....6..195....98....6.8...6...34..8.3..17...2...6.6....28....419..5....8..79"
SOLUTION = "534678912672195348198342567859761423426853791713924856961537284287419635345286179"


def _grid(s: str) -> np.ndarray:
    return np.array([0 if c == "." else int(c) for c in s])


def _string(grid: np.ndarray, blank: str = ".") -> str:
    return "".join(blank if v == 0 else str(int(v)) for v in grid)


@pytest.fixture(scope="module")
def generated() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(123)
    return [generate_puzzle(rng, min_givens=26) for _ in range(20)]


# ---- solver ---------------------------------------------------------------


def test_solver_solves_known_puzzle():
    assert count_solutions(_grid(PUZZLE)) == 1
    np.testing.assert_array_equal(solve(_grid(PUZZLE)), _grid(SOLUTION))


def test_count_solutions_detects_two_solutions():
    # Blanking a 2x2 rectangle of a solved grid whose corners hold a/b/b/a in two
    # boxes gives exactly two solutions (swap a and b).
    solution = _grid(SOLUTION).reshape(9, 9)
    for r1, r2, c1, c2 in _rectangles():
        a, b = solution[r1, c1], solution[r1, c2]
        if solution[r2, c1] == b and solution[r2, c2] == a and (r1 // 3 == r2 // 3) != (c1 // 3 == c2 // 3):
            grid = solution.copy()
            grid[[r1, r1, r2, r2], [c1, c2, c1, c2]] = 0
            assert count_solutions(grid.reshape(-1), limit=10) == 2
            assert count_solutions(grid.reshape(-1), limit=2) == 2
            assert count_solutions(grid.reshape(-1), limit=1) == 1
            return
    pytest.fail("no deadly rectangle in the fixture grid")


def _rectangles():
    for r1 in range(9):
        for r2 in range(r1 + 1, 9):
            for c1 in range(9):
                for c2 in range(c1 + 1, 9):
                    yield r1, r2, c1, c2


def test_solver_rejects_contradictions():
    grid = _grid(PUZZLE)
    grid[2] = 5  # row 0 already holds a 5
    assert count_solutions(grid) == 0
    assert solve(grid) is None
    assert count_solutions(np.zeros(81, dtype=int), limit=3) == 3


# ---- generator ------------------------------------------------------------


def test_generated_puzzles_are_unique_and_consistent(generated):
    for puzzle, solution in generated:
        assert is_valid_solution(solution)
        assert (puzzle > 0).sum() >= 26
        givens = puzzle > 0
        np.testing.assert_array_equal(puzzle[givens], solution[givens])
        assert count_solutions(puzzle, limit=2) == 1
        np.testing.assert_array_equal(solve(puzzle), solution)
    assert len({_string(p) for p, _ in generated}) == len(generated)


def test_generator_reaches_target_givens():
    rng = np.random.default_rng(7)
    counts = [(generate_puzzle(rng, min_givens=30)[0] > 0).sum() for _ in range(5)]
    assert counts == [30] * 5


# ---- augmentation ---------------------------------------------------------


def test_augment_preserves_validity_and_pairing(generated):
    rng = np.random.default_rng(0)
    changed = 0
    for puzzle, solution in generated:
        new_puzzle, new_solution = augment(puzzle, solution, rng)
        assert new_puzzle.shape == puzzle.shape and new_puzzle.dtype == puzzle.dtype
        assert is_valid_solution(new_solution)
        blanks = new_puzzle == 0
        assert blanks.sum() == (puzzle == 0).sum()
        np.testing.assert_array_equal(new_puzzle[~blanks], new_solution[~blanks])
        assert count_solutions(new_puzzle) == 1
        np.testing.assert_array_equal(solve(new_puzzle), new_solution)
        changed += not np.array_equal(new_solution, solution)
    assert changed == len(generated)


def test_augment_keeps_2d_shape():
    rng = np.random.default_rng(1)
    p, s = augment(_grid(PUZZLE).reshape(9, 9), _grid(SOLUTION).reshape(9, 9), rng)
    assert p.shape == s.shape == (9, 9)
    assert is_valid_solution(s)


# ---- on-disk format -------------------------------------------------------


def _random_split(rng: np.random.Generator) -> tuple[dict[str, np.ndarray], PuzzleDatasetMetadata]:
    puzzle_sizes = np.array([2, 1, 3, 1, 2])
    group_sizes = np.array([2, 1, 2])
    n = int(puzzle_sizes.sum())
    arrays = {
        "inputs": rng.integers(0, 12, size=(n, 16)),
        "labels": rng.integers(0, 12, size=(n, 16)),
        "puzzle_identifiers": np.array([1, 2, 3, 0, 4]),
        "puzzle_indices": np.concatenate([[0], np.cumsum(puzzle_sizes)]),
        "group_indices": np.concatenate([[0], np.cumsum(group_sizes)]),
    }
    metadata = PuzzleDatasetMetadata(
        pad_id=0,
        ignore_label_id=0,
        blank_identifier_id=0,
        vocab_size=12,
        seq_len=16,
        num_puzzle_identifiers=5,
        total_groups=3,
        mean_puzzle_examples=n / 5,
        total_puzzles=5,
        sets=("all",),
    )
    return arrays, metadata


def test_write_load_round_trip(tmp_path):
    arrays, metadata = _random_split(np.random.default_rng(0))
    write_split(str(tmp_path), "train", arrays, metadata)
    write_identifiers(str(tmp_path), ["<blank>", "a", "b", "c", "d"])

    split = load_split(str(tmp_path), "train")
    assert split.metadata == metadata
    assert json.loads((tmp_path / "identifiers.json").read_text()) == ["<blank>", "a", "b", "c", "d"]
    # Reference dtypes on disk.
    for name, dtype in [("inputs", np.uint8), ("labels", np.uint8), ("puzzle_indices", np.int32)]:
        assert np.load(tmp_path / "train" / f"all__{name}.npy").dtype == dtype
    for name in ("inputs", "labels", "puzzle_identifiers", "puzzle_indices", "group_indices"):
        assert getattr(split, name).dtype == np.int32, name
    np.testing.assert_array_equal(split.inputs, arrays["inputs"])
    np.testing.assert_array_equal(split.labels, np.where(arrays["labels"] == 0, -100, arrays["labels"]))
    np.testing.assert_array_equal(split.puzzle_identifiers, [1, 1, 2, 3, 3, 3, 0, 4, 4])
    np.testing.assert_array_equal(split.puzzle_indices, arrays["puzzle_indices"])
    np.testing.assert_array_equal(split.group_indices, arrays["group_indices"])
    assert len(split) == 9


def test_tokens_stay_memory_mapped_and_rows_are_widened(tmp_path):
    arrays, metadata = _random_split(np.random.default_rng(0))
    write_split(str(tmp_path), "train", arrays, metadata)  # uint8 on disk, as the reference stores it
    split = load_split(str(tmp_path), "train")
    for arr in (split.raw_inputs, split.raw_labels):  # nothing widened or copied at load
        assert isinstance(arr, np.memmap) and arr.filename is not None and arr.dtype == np.uint8
    rows = split.rows(np.array([4, 0, 4]))
    assert all(v.dtype == np.int32 for v in rows.values())
    np.testing.assert_array_equal(rows["inputs"], arrays["inputs"][[4, 0, 4]])
    np.testing.assert_array_equal(rows["labels"], np.where(arrays["labels"] == 0, -100, arrays["labels"])[[4, 0, 4]])
    np.testing.assert_array_equal(rows["puzzle_identifiers"], split.puzzle_identifiers[[4, 0, 4]])

    metadata = dataclasses.replace(metadata, vocab_size=300, ignore_label_id=None)  # too big for uint8
    write_split(str(tmp_path / "wide"), "train", arrays, metadata)
    split = load_split(str(tmp_path / "wide"), "train")
    assert isinstance(split.raw_inputs, np.memmap) and split.raw_inputs.dtype == np.int32
    np.testing.assert_array_equal(split.labels, arrays["labels"])  # no ignore id: labels untouched


def test_metadata_json_round_trip():
    _, metadata = _random_split(np.random.default_rng(0))
    none_ignore = dataclasses.replace(metadata, ignore_label_id=None, mean_puzzle_examples=1.8)
    for m in (metadata, none_ignore):
        assert PuzzleDatasetMetadata.from_json(m.to_json()) == m
    assert json.loads(metadata.to_json())["sets"] == ["all"]


def test_load_through_fsspec_url(tmp_path):
    arrays, metadata = _random_split(np.random.default_rng(1))
    write_split(str(tmp_path), "test", arrays, metadata)
    split = load_split(f"file://{tmp_path}", "test")
    np.testing.assert_array_equal(split.inputs, arrays["inputs"])


def test_remote_path_reads_bytes():
    # A non-local filesystem goes through fs.open + np.load on the bytes.
    arrays, metadata = _random_split(np.random.default_rng(2))
    write_split("memory://sudoku-test-ds", "train", arrays, metadata)
    split = load_split("memory://sudoku-test-ds", "train")
    assert not isinstance(split.raw_inputs, np.memmap)
    np.testing.assert_array_equal(split.inputs, arrays["inputs"])
    np.testing.assert_array_equal(split.puzzle_identifiers, [1, 1, 2, 3, 3, 3, 0, 4, 4])


def test_gcs_round_trip_against_emulator(tmp_path):
    arrays, metadata = _random_split(np.random.default_rng(3))
    write_split(str(tmp_path / "ds"), "train", arrays, metadata)
    with gs_bucket(tmp_path, "bkt") as gs:
        gs.put(str(tmp_path / "ds"), "bkt/ds", recursive=True)
        split = load_split("gs://bkt/ds", "train")
        np.testing.assert_array_equal(split.inputs, arrays["inputs"])
        np.testing.assert_array_equal(split.labels, np.where(arrays["labels"] == 0, -100, arrays["labels"]))
        with pytest.raises(DatasetError, match="gs://bkt/missing/train/dataset.json; build it locally"):
            load_split("gs://bkt/missing", "train")


def test_missing_dataset_error_names_path_and_fix(tmp_path):
    root = tmp_path / "sudoku-small"
    with pytest.raises(DatasetError) as err:
        load_split(str(root), "train")
    message = str(err.value)
    assert str(root / "train" / "dataset.json") in message
    assert "python -m data_pipeline.build_sudoku --output-dir" in message and "--generate" in message
    assert "\n" not in message

    arrays, metadata = _random_split(np.random.default_rng(0))
    write_split(str(root), "train", arrays, metadata)
    with pytest.raises(DatasetError, match="split 'test' not found"):
        load_split(str(root), "test")


def test_inconsistent_arrays_raise(tmp_path):
    arrays, metadata = _random_split(np.random.default_rng(0))
    with pytest.raises(DatasetError, match="seq_len"):
        write_split(str(tmp_path), "train", {**arrays, "inputs": arrays["inputs"][:, :8]}, metadata)
    with pytest.raises(DatasetError, match="puzzle_identifiers"):
        write_split(str(tmp_path), "train", {**arrays, "puzzle_identifiers": np.array([1, 2])}, metadata)
    with pytest.raises(DatasetError, match="dtype"):
        write_split(str(tmp_path), "train", {**arrays, "labels": arrays["labels"].astype(float)}, metadata)

    # A file corrupted after writing is caught at load time.
    write_split(str(tmp_path), "train", arrays, metadata)
    np.save(tmp_path / "train" / "all__group_indices.npy", np.array([0, 2], dtype=np.int32))
    with pytest.raises(DatasetError, match="group_indices"):
        load_split(str(tmp_path), "train")


# ---- builder --------------------------------------------------------------


def _write_csv(path: Path, pairs) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["source", "q", "a", "rating"])
        for i, (puzzle, solution) in enumerate(pairs):
            writer.writerow([f"gen{i}", _string(puzzle), _string(solution), i % 5])


def _decode(tokens: np.ndarray) -> np.ndarray:
    return tokens - 1  # token 1 = blank, d + 1 = digit d


def test_csv_folder_builds_matching_dataset(tmp_path, generated):
    src = tmp_path / "csv"
    src.mkdir()
    _write_csv(src / "train.csv", generated[:12])
    _write_csv(src / "test.csv", generated[12:])
    out = build_sudoku_dataset(tmp_path / "ds", source_csv=src)

    train, test = load_split(str(out), "train"), load_split(str(out), "test")
    for split, pairs in ((train, generated[:12]), (test, generated[12:])):
        np.testing.assert_array_equal(_decode(split.inputs), np.stack([p for p, _ in pairs]))
        np.testing.assert_array_equal(_decode(split.labels), np.stack([s for _, s in pairs]))
        m = split.metadata
        assert (m.seq_len, m.vocab_size, m.pad_id, m.ignore_label_id, m.blank_identifier_id) == (81, 11, 0, 0, 0)
        assert m.num_puzzle_identifiers == 1 and m.sets == ("all",)
        assert split.inputs.min() >= 1 and split.inputs.max() <= 10 and split.labels.min() >= 2
        assert not np.any(split.puzzle_identifiers)
    assert json.loads((out / "identifiers.json").read_text()) == ["<blank>"]


def test_single_csv_is_split_and_blank_zero_accepted(tmp_path, generated):
    path = tmp_path / "all.csv"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["source", "q", "a", "rating"])
        for puzzle, solution in generated:
            writer.writerow(["x", _string(puzzle, blank="0"), _string(solution), 0])
    out = build_sudoku_dataset(tmp_path / "ds", source_csv=path, test_size=5)
    train, test = load_split(str(out), "train"), load_split(str(out), "test")
    assert (len(train), len(test)) == (15, 5)
    seen = {_string(_decode(x)) for x in np.concatenate([train.inputs, test.inputs])}
    assert seen == {_string(p) for p, _ in generated}


def test_subsample_and_augmentation_counts(tmp_path, generated):
    src = tmp_path / "csv"
    src.mkdir()
    _write_csv(src / "train.csv", generated[:15])
    _write_csv(src / "test.csv", generated[15:])
    main(["--output-dir", str(tmp_path / "ds"), "--source-csv", str(src), "--subsample-size", "6", "--num-aug", "3"])

    train, test = load_split(str(tmp_path / "ds"), "train"), load_split(str(tmp_path / "ds"), "test")
    assert len(train) == 6 * 4 and train.metadata.total_groups == 6
    np.testing.assert_array_equal(train.group_indices, np.arange(0, 25, 4))
    np.testing.assert_array_equal(train.puzzle_indices, np.arange(25))
    assert train.metadata.total_puzzles == 24 and train.metadata.mean_puzzle_examples == 1.0
    assert len(test) == 5 and test.metadata.total_groups == 5  # test set is never augmented

    originals = {_string(p): s for p, s in generated[:15]}
    for g in range(6):
        rows = slice(4 * g, 4 * g + 4)
        puzzles, solutions = _decode(train.inputs[rows]), _decode(train.labels[rows])
        np.testing.assert_array_equal(solutions[0], originals[_string(puzzles[0])])  # original first
        for puzzle, solution in zip(puzzles, solutions):
            assert is_valid_solution(solution)
            givens = puzzle > 0
            np.testing.assert_array_equal(puzzle[givens], solution[givens])
            assert givens.sum() == (puzzles[0] > 0).sum()


def test_generate_builds_unique_puzzles(tmp_path):
    out = build_sudoku_dataset(tmp_path / "gen", generate=12, test_size=4, num_aug=1, min_givens=30, seed=3)
    train, test = load_split(str(out), "train"), load_split(str(out), "test")
    assert (len(train), len(test)) == (16, 4)
    for split in (train, test):
        for tokens, labels in zip(split.inputs, split.labels):
            puzzle = _decode(tokens)
            assert (puzzle > 0).sum() == 30
            assert count_solutions(puzzle) == 1
            np.testing.assert_array_equal(solve(puzzle), _decode(labels))
    again = build_sudoku_dataset(tmp_path / "gen2", generate=12, test_size=4, num_aug=1, min_givens=30, seed=3)
    np.testing.assert_array_equal(load_split(str(again), "train").inputs, train.inputs)  # seeded = reproducible


def test_builder_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="exactly one"):
        build_sudoku_dataset(tmp_path, generate=5, source_csv=tmp_path)
    with pytest.raises(FileNotFoundError, match="train.csv"):
        build_sudoku_dataset(tmp_path / "x", source_csv=tmp_path)
