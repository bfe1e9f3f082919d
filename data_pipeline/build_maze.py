"""Build a maze dataset in the reference on-disk format.

Sources: the Maze-Hard CSV files users download (header source,q,a,rating; q and a
are row-major strings over "# SGo" of a square grid; a folder holding train.csv
and test.csv, or one CSV that is split here), or mazes generated here with a
unique shortest path. Tokens: '#',' ','S','G','o' -> 1..5, pad 0, vocab 6.
With --aug every train maze also appears under the 7 other dihedral transforms
(one group per maze); the test set is never augmented.

    python -m data_pipeline.build_maze --output-dir data/maze-small --generate 1000
    python -m data_pipeline.build_maze --output-dir data/maze-30x30-hard-1k \\
        --source-csv downloads/maze-30x30-hard-1k --aug
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path
from typing import Sequence

import numpy as np
from tqdm import tqdm

from data_pipeline.dihedral import NUM_TRANSFORMS, dihedral_transform
from data_pipeline.maze import (
    CHARSET,
    DEFAULT_LOOP_FRACTION,
    DEFAULT_SIZE,
    VOCAB_SIZE,
    encode,
    from_string,
    generate_maze,
    path_length,
    to_string,
)
from data_pipeline.marker import build_target, claim, finish
from data_pipeline.puzzle_format import DatasetError, PuzzleDatasetMetadata, builder_cli, write_identifiers, write_split
from data_pipeline.sources import choose, load_splits, read_qa_rows
from runtime.ranges import Rule, at_least, check_args, within


def read_csv(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(questions, answers) as [N, n, n] uint8 ASCII grids from a source,q,a,rating CSV."""
    first: list[int] = []  # the first row's length: every maze of a file has the same size

    def problem(q: str, a: str) -> str | None:
        first[:] = first or [len(q)]
        if len(q) != first[0] or len(a) != first[0]:
            return f"'q' and 'a' have {len(q)} and {len(a)} characters, expected {first[0]} (the first row's)"
        return None

    rows = read_qa_rows(path, problem)
    try:
        questions = np.stack([from_string(q) for q, _ in rows])
        answers = np.stack([from_string(a) for _, a in rows])
        encode(questions), encode(answers)  # validates the charset
    except (ValueError, UnicodeEncodeError) as e:
        raise ValueError(f"{path}: {e} (mazes are square strings over {CHARSET!r})") from e
    return questions, answers


def write_csv(path: str | Path, questions: Sequence[np.ndarray], answers: Sequence[np.ndarray]) -> None:
    """Write mazes in the downloadable CSV layout (rating = shortest path length)."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["source", "q", "a", "rating"])
        for i, (q, a) in enumerate(zip(questions, answers)):
            writer.writerow([f"generated{i}", to_string(q), to_string(a), path_length(a)])


def generate_mazes(
    n: int, rng: np.random.Generator, size: int = DEFAULT_SIZE, loop_fraction: float = DEFAULT_LOOP_FRACTION
) -> tuple[np.ndarray, np.ndarray]:
    pairs = [generate_maze(rng, size, loop_fraction) for _ in tqdm(range(n), desc="generating mazes")]
    return np.stack([q for q, _ in pairs]), np.stack([a for _, a in pairs])


def _load_sources(
    rng: np.random.Generator,
    generate: int | None,
    source_csv: Path | None,
    test_size: int | None,
    size: int,
    loop_fraction: float,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    return load_splits(rng, source_csv=source_csv, generate=lambda: generate_mazes(generate, rng, size, loop_fraction),
                       read=read_csv, test_size=test_size, what="mazes")


def _encode_split(questions: np.ndarray, answers: np.ndarray, aug: bool) -> tuple[dict[str, np.ndarray], PuzzleDatasetMetadata]:
    """Each maze and (with aug) its 7 other dihedral images = one group of single-example puzzles."""
    n, side = len(questions), questions.shape[1]
    per_group = NUM_TRANSFORMS if aug else 1
    q_tokens, a_tokens = encode(questions), encode(answers)
    # [n, per_group, side, side] -> rows ordered maze by maze, transform 0 (the original) first.
    inputs = np.stack([dihedral_transform(q_tokens, t) for t in range(per_group)], axis=1)
    labels = np.stack([dihedral_transform(a_tokens, t) for t in range(per_group)], axis=1)
    total = n * per_group
    arrays = {
        "inputs": inputs.reshape(total, side * side),
        "labels": labels.reshape(total, side * side),
        "puzzle_identifiers": np.zeros(total, dtype=np.int32),
        "puzzle_indices": np.arange(total + 1, dtype=np.int32),
        "group_indices": np.arange(0, total + 1, per_group, dtype=np.int32),
    }
    metadata = PuzzleDatasetMetadata(
        pad_id=0,
        ignore_label_id=0,
        blank_identifier_id=0,
        vocab_size=VOCAB_SIZE,
        seq_len=side * side,
        num_puzzle_identifiers=1,
        total_groups=n,
        mean_puzzle_examples=1.0,
        total_puzzles=total,  # true puzzle count, as the Sudoku builder writes
        sets=("all",),
    )
    return arrays, metadata


def build_maze_dataset(
    output_dir: str | Path,
    *,
    generate: int | None = None,
    source_csv: str | Path | None = None,
    test_size: int | None = None,
    subsample_size: int | None = None,
    aug: bool = False,
    size: int = DEFAULT_SIZE,
    loop_fraction: float = DEFAULT_LOOP_FRACTION,
    seed: int = 0,
    rebuild: bool = False,
) -> Path:
    """Write <output_dir>/{train,test} and identifiers.json; returns output_dir.

    Exactly one of `generate` (mazes of side `size` to create, split into train and
    test) or `source_csv` (folder with train.csv/test.csv, or one CSV to split).
    test_size: test mazes held out, or kept from test.csv (default 10% / all).
    subsample_size: train mazes kept before augmentation. aug: add the 7 other
    dihedral images of each train maze. rebuild: replace an earlier build in
    output_dir made with other parameters (else refused).
    """
    if (generate is None) == (source_csv is None):
        raise ValueError("pass exactly one of generate or source_csv")
    output_dir = Path(output_dir)
    wanted = {"generate": (generate, "--generate"), "source_csv": (source_csv, "--source-csv"),
              "test_size": (test_size, "--test-size"), "subsample_size": (subsample_size, "--subsample-size"),
              "aug": (aug, "--aug"), "size": (size, "--size"), "loop_fraction": (loop_fraction, "--loop-fraction"),
              "seed": (seed, "--seed")}
    # A folder that is not ours, or our set built with other options: refused before any work.
    build_target(str(output_dir), "build_maze", wanted=wanted, rebuild=rebuild)
    rng = np.random.default_rng(seed)
    sources = _load_sources(rng, generate, None if source_csv is None else Path(source_csv), test_size, size, loop_fraction)
    claim(str(output_dir), "build_maze", wanted, rebuild=rebuild)
    questions, answers = sources["train"]
    keep = choose(rng, len(questions), subsample_size)
    sources["train"] = (questions[keep], answers[keep])

    for split, (questions, answers) in sources.items():
        arrays, metadata = _encode_split(questions, answers, aug and split == "train")
        write_split(str(output_dir), split, arrays, metadata)
    write_identifiers(str(output_dir), ["<blank>"])
    finish(str(output_dir))
    return output_dir


# Ranges of the command line's numbers (as runtime/config.py's _RULES for a run's settings).
_RULES: dict[str, Rule] = {
    "--generate": (at_least(2), "at least one train and one test maze"), "--test-size": (at_least(1), ""),
    "--subsample-size": (at_least(1), ""), "--size": (at_least(5), "the smallest maze with a path"),
    "--loop-fraction": (within(0, 1), "0 = a perfect maze"), "--seed": (at_least(0), ""),
}


@builder_cli
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", required=True)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--source-csv", help="folder with train.csv and test.csv, or one CSV file to split")
    source.add_argument("--generate", type=int, metavar="N", help="generate N mazes")
    parser.add_argument("--test-size", type=int, help="test mazes (default: 10%% held out, or all of test.csv)")
    parser.add_argument("--subsample-size", type=int, help="keep this many train mazes")
    parser.add_argument("--aug", action="store_true", help="add the 8 dihedral transforms of each train maze")
    parser.add_argument("--size", type=int, default=DEFAULT_SIZE, help="side of generated mazes")
    parser.add_argument("--loop-fraction", type=float, default=DEFAULT_LOOP_FRACTION,
                        help="share of leftover inner walls removed in generated mazes (0 = perfect maze)")
    parser.add_argument("--export-csv", metavar="PATH", help="with --generate: also write the mazes to this CSV")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rebuild", action="store_true", help="replace a set built in --output-dir with other options")
    args = parser.parse_args(argv)
    check_args(args, _RULES, DatasetError)
    if args.export_csv and args.generate is None:
        parser.error("--export-csv needs --generate")
    out = build_maze_dataset(
        args.output_dir,
        generate=args.generate,
        source_csv=args.source_csv,
        test_size=args.test_size,
        subsample_size=args.subsample_size,
        aug=args.aug,
        size=args.size,
        loop_fraction=args.loop_fraction,
        seed=args.seed,
        rebuild=args.rebuild,
    )
    if args.export_csv:  # same seed = the same mazes the dataset holds
        questions, answers = generate_mazes(args.generate, np.random.default_rng(args.seed), args.size, args.loop_fraction)
        write_csv(args.export_csv, questions, answers)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
