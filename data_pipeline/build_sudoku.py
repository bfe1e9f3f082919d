"""Build a Sudoku dataset in the reference on-disk format.

Sources: the CSV files users download (columns source,q,a,rating; '.' = blank;
a folder holding train.csv and test.csv, or one CSV that is split here), or
puzzles generated on the fly with a unique solution.

    python -m data_pipeline.build_sudoku --output-dir data/sudoku-small --generate 1000
    python -m data_pipeline.build_sudoku --output-dir data/sudoku-extreme-1k-aug-1000 \\
        --source-csv downloads/sudoku-extreme --subsample-size 1000 --num-aug 1000
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data_pipeline.marker import build_target, claim, finish
from data_pipeline.puzzle_format import DatasetError, PuzzleDatasetMetadata, builder_cli, write_identifiers, write_split
from data_pipeline.sources import choose, load_splits, read_qa_rows
from data_pipeline.sudoku import DEFAULT_MIN_GIVENS, augment, generate_puzzle
from runtime.ranges import Rule, at_least, check_args, within

SEQ_LEN = 81
VOCAB_SIZE = 11  # pad 0, blank 1, digits 1..9 -> 2..10

# Ranges of the command line's numbers (as runtime/config.py's _RULES for a run's settings).
_RULES: dict[str, Rule] = {
    "--generate": (at_least(2), "at least one train and one test puzzle"), "--test-size": (at_least(1), ""),
    "--subsample-size": (at_least(1), ""), "--num-aug": (at_least(0), "0 = no augmentation"),
    "--min-givens": (within(17, 81), "fewer than 17 givens never have a unique solution"), "--seed": (at_least(0), ""),
}

# ASCII byte -> digit (0 = blank); 255 flags a character that is not allowed.
_CHAR_TO_DIGIT = np.full(256, 255, dtype=np.uint8)
_CHAR_TO_DIGIT[ord(".")] = 0
_CHAR_TO_DIGIT[ord("0") : ord("9") + 1] = np.arange(10)


def _row_problem(q: str, a: str) -> str | None:
    """What is wrong with one CSV row's puzzle `q` and answer `a`, or None."""
    for column, grid in (("q", q), ("a", a)):
        if len(grid) != SEQ_LEN:
            return f"'{column}' has {len(grid)} characters, expected {SEQ_LEN}"
        if not set(grid) <= set(".0123456789"):
            return f"'{column}' may hold only '.' and '0'-'9'"
    if "." in a or "0" in a:
        return "the answer ('a') must be a complete grid"
    return None


def _parse_grids(strings: list[str]) -> np.ndarray:
    digits = _CHAR_TO_DIGIT[np.frombuffer("".join(strings).encode("ascii"), dtype=np.uint8)]
    return digits.reshape(len(strings), SEQ_LEN)


# The 27 units (rows, columns, boxes) of a grid, as cell indices [27, 9].
_UNITS = np.array([[r * 9 + c for c in range(9)] for r in range(9)] + [[r * 9 + c for r in range(9)] for c in range(9)]
                  + [[(b // 3 * 3 + i // 3) * 9 + b % 3 * 3 + i % 3 for i in range(9)] for b in range(9)])


def unsolved_rows(puzzles: np.ndarray, solutions: np.ndarray, chunk: int = 65536) -> tuple[np.ndarray, np.ndarray]:
    """(rows whose solution changes a given, rows whose solution breaks the rules: a digit twice
    in a row, column or box), as indices; checked in chunks (a million rows at once would take
    gigabytes)."""
    contradicts = np.flatnonzero(((puzzles != 0) & (puzzles != solutions)).any(axis=1))
    invalid = []
    for start in range(0, len(solutions), chunk):
        digits = solutions[start:start + chunk][:, _UNITS].astype(np.uint16)  # [n, 27, 9]
        seen = np.bitwise_or.reduce(np.left_shift(1, digits - 1, dtype=np.uint16), axis=2)
        invalid.append(start + np.flatnonzero((seen != 0x1FF).any(axis=1)))
    return contradicts, np.concatenate(invalid) if invalid else np.zeros(0, np.int64)


def read_csv(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(puzzles, solutions) as [N, 81] uint8 digits from a source,q,a,rating CSV; a row whose
    answer is not a solution of its puzzle is a ValueError naming its line."""
    lines: list[int] = []
    rows = read_qa_rows(path, _row_problem, lines)
    puzzles, solutions = _parse_grids([q for q, _ in rows]), _parse_grids([a for _, a in rows])
    contradicts, invalid = unsolved_rows(puzzles, solutions)
    for bad, what in ((contradicts, "its answer ('a') changes a given digit of its puzzle ('q')"),
                      (invalid, "its answer ('a') repeats a digit in a row, column or box")):
        if len(bad):
            raise ValueError(f"{path} line {lines[bad[0]]}: {what}, so it is no solution ({len(bad)} such rows); fix "
                             "or remove those rows")
    return puzzles, solutions


def _load_sources(
    rng: np.random.Generator, generate: int | None, source_csv: Path | None, test_size: int | None, min_givens: int
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    def generated():
        pairs = [generate_puzzle(rng, min_givens) for _ in tqdm(range(generate), desc="generating sudoku")]
        return np.stack([p for p, _ in pairs]).astype(np.uint8), np.stack([s for _, s in pairs]).astype(np.uint8)

    return load_splits(rng, source_csv=source_csv, generate=generated, read=read_csv, test_size=test_size,
                       what="puzzles")


def _encode_split(
    puzzles: np.ndarray, solutions: np.ndarray, num_aug: int, rng: np.random.Generator, desc: str
) -> tuple[dict[str, np.ndarray], PuzzleDatasetMetadata]:
    """Each original + its num_aug augmentations = one group of single-example puzzles."""
    n, per_group = len(puzzles), 1 + num_aug
    inputs = np.empty((n * per_group, SEQ_LEN), dtype=np.uint8)
    labels = np.empty((n * per_group, SEQ_LEN), dtype=np.uint8)
    row = 0
    for puzzle, solution in zip(tqdm(puzzles, desc=desc), solutions):
        inputs[row], labels[row] = puzzle, solution  # the first of a group is the original
        for k in range(1, per_group):
            inputs[row + k], labels[row + k] = augment(puzzle, solution, rng)
        row += per_group
    total = n * per_group
    arrays = {
        "inputs": inputs + 1,  # blank 0 -> 1, digit d -> d + 1
        "labels": labels + 1,
        "puzzle_identifiers": np.zeros(total, dtype=np.int32),  # all share the blank identifier
        "puzzle_indices": np.arange(total + 1, dtype=np.int32),
        "group_indices": np.arange(0, total + 1, per_group, dtype=np.int32),
    }
    metadata = PuzzleDatasetMetadata(
        pad_id=0,
        ignore_label_id=0,  # pad; Sudoku labels are full grids so nothing is ignored
        blank_identifier_id=0,
        vocab_size=VOCAB_SIZE,
        seq_len=SEQ_LEN,
        num_puzzle_identifiers=1,
        total_groups=n,
        mean_puzzle_examples=1.0,
        # The reference Sudoku builder writes the group count here; we write the true
        # puzzle count (as its ARC builder does) so it agrees with puzzle_indices.
        total_puzzles=total,
        sets=("all",),
    )
    return arrays, metadata


def build_sudoku_dataset(
    output_dir: str | Path,
    *,
    generate: int | None = None,
    source_csv: str | Path | None = None,
    test_size: int | None = None,
    subsample_size: int | None = None,
    num_aug: int = 0,
    min_givens: int = DEFAULT_MIN_GIVENS,
    seed: int = 0,
    rebuild: bool = False,
) -> Path:
    """Write <output_dir>/{train,test} and identifiers.json; returns output_dir.

    Exactly one of `generate` (number of puzzles to create, split into train and
    test) or `source_csv` (folder with train.csv/test.csv, or one CSV to split).
    test_size: test puzzles to hold out or, for a folder, to keep from test.csv
    (default: 10% held out / the whole test.csv). subsample_size: train puzzles
    kept before augmentation. num_aug: augmented copies per train puzzle; the
    test set is never augmented. rebuild: replace an earlier build in output_dir
    made with other parameters (else refused).
    """
    if (generate is None) == (source_csv is None):
        raise ValueError("pass exactly one of generate or source_csv")
    if num_aug < 0:
        raise ValueError(f"num_aug must be >= 0, got {num_aug}")
    output_dir = Path(output_dir)
    wanted = {"generate": (generate, "--generate"), "source_csv": (source_csv, "--source-csv"),
              "test_size": (test_size, "--test-size"), "subsample_size": (subsample_size, "--subsample-size"),
              "num_aug": (num_aug, "--num-aug"), "min_givens": (min_givens, "--min-givens"), "seed": (seed, "--seed")}
    # A folder that is not ours, or our set built with other options: refused before any work.
    build_target(str(output_dir), "build_sudoku", wanted=wanted, rebuild=rebuild)
    rng = np.random.default_rng(seed)
    sources = _load_sources(rng, generate, None if source_csv is None else Path(source_csv), test_size, min_givens)
    claim(str(output_dir), "build_sudoku", wanted, rebuild=rebuild)

    train_puzzles, train_solutions = sources["train"]
    keep = choose(rng, len(train_puzzles), subsample_size)
    sources["train"] = (train_puzzles[keep], train_solutions[keep])

    for split, (puzzles, solutions) in sources.items():
        aug = num_aug if split == "train" else 0
        arrays, metadata = _encode_split(puzzles, solutions, aug, rng, desc=f"encoding {split}")
        write_split(str(output_dir), split, arrays, metadata)
    write_identifiers(str(output_dir), ["<blank>"])
    finish(str(output_dir))
    return output_dir


@builder_cli
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", required=True)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--source-csv", help="folder with train.csv and test.csv, or one CSV file to split")
    source.add_argument("--generate", type=int, metavar="N", help="generate N unique-solution puzzles")
    parser.add_argument("--test-size", type=int, help="test puzzles (default: 10%% held out, or all of test.csv)")
    parser.add_argument("--subsample-size", type=int, help="keep this many train puzzles")
    parser.add_argument("--num-aug", type=int, default=0, help="augmented copies per train puzzle")
    parser.add_argument("--min-givens", type=int, default=DEFAULT_MIN_GIVENS, help="givens left in generated puzzles")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rebuild", action="store_true", help="replace a set built in --output-dir with other options")
    args = parser.parse_args(argv)
    check_args(args, _RULES, DatasetError)
    out = build_sudoku_dataset(
        args.output_dir,
        generate=args.generate,
        source_csv=args.source_csv,
        test_size=args.test_size,
        subsample_size=args.subsample_size,
        num_aug=args.num_aug,
        min_givens=args.min_givens,
        seed=args.seed,
        rebuild=args.rebuild,
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
