"""Where a grid-puzzle builder's (question, answer) pairs come from: the CSV layout users
download (`source,q,a,rating`), as one file or a folder with train.csv and test.csv, or a
generator. Shared by the Sudoku and Maze builders."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Callable

import numpy as np

DEFAULT_TEST_FRACTION = 0.1  # held out when the source is not already split
Pairs = tuple[np.ndarray, np.ndarray]


def read_qa_rows(path: Path, check: Callable[[str, str], str | None] | None = None,
                 lines: list[int] | None = None) -> list[tuple[str, str]]:
    """The (q, a) strings of a source,q,a,rating CSV. `check(q, a)` returns what is wrong with a
    row (or None); a bad row is a ValueError naming the file and its line. `lines`, when given,
    receives each row's line number (for checks made later on all rows at once)."""
    try:
        f = open(path, newline="")
    except FileNotFoundError:
        raise FileNotFoundError(f"source CSV {path} not found; pass an existing CSV file, or a folder holding "
                                "train.csv and test.csv") from None
    with f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or not {"q", "a"} <= set(reader.fieldnames):
            raise ValueError(f"{path}: expected a header with columns source,q,a,rating")
        rows = []
        for row in reader:
            q, a = row.get("q"), row.get("a")
            problem = "too few columns (expected source,q,a,rating)" if q is None or a is None else check and check(q, a)
            if problem:
                raise ValueError(f"{path} line {reader.line_num}: {problem}; fix or remove that row")
            rows.append((q, a))
            if lines is not None:
                lines.append(reader.line_num)
    if not rows:
        raise ValueError(f"{path}: no rows after the header; pass a CSV with at least one puzzle")
    return rows


def choose(rng: np.random.Generator, n: int, k: int | None) -> np.ndarray:
    """Sorted indices of k rows drawn without replacement (all rows when k is None or >= n)."""
    if k is None or k >= n:
        return np.arange(n)
    return np.sort(rng.choice(n, size=k, replace=False))


def load_splits(rng: np.random.Generator, *, source_csv: Path | None, generate: Callable[[], Pairs] | None,
                read: Callable[[Path], Pairs], test_size: int | None, what: str) -> dict[str, Pairs]:
    """{"train": pairs, "test": pairs}. A folder keeps its split (test_size rows of test.csv);
    one CSV or generated pairs are split here (test_size, default 10%, held out)."""
    if source_csv is not None and source_csv.is_dir():
        missing = [name for name in ("train.csv", "test.csv") if not (source_csv / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{source_csv} lacks {missing}; pass the folder holding train.csv and test.csv")
        train, test = read(source_csv / "train.csv"), read(source_csv / "test.csv")
        if train[0].shape[1:] != test[0].shape[1:]:
            raise ValueError(f"{source_csv}: train {what} are {train[0].shape[1:]}, test {what} {test[0].shape[1:]}")
        keep = choose(rng, len(test[0]), test_size)
        return {"train": train, "test": (test[0][keep], test[1][keep])}
    questions, answers = read(source_csv) if source_csv is not None else generate()
    n = len(questions)
    n_test = max(1, round(n * DEFAULT_TEST_FRACTION)) if test_size is None else test_size
    if not 0 < n_test < n:
        raise ValueError(f"test size {n_test} leaves no train or no test {what} out of {n}")
    order = rng.permutation(n)
    test_idx, train_idx = order[:n_test], order[n_test:]
    return {"train": (questions[train_idx], answers[train_idx]), "test": (questions[test_idx], answers[test_idx])}
