"""On-disk puzzle dataset format, compatible with the TinyRecursiveModels builders.

Layout of a dataset root::

    <root>/identifiers.json                 # puzzle identifier id -> name
    <root>/<split>/dataset.json             # PuzzleDatasetMetadata
    <root>/<split>/<set>__inputs.npy        # [N, seq_len] token ids (uint8 when vocab fits)
    <root>/<split>/<set>__labels.npy        # [N, seq_len] target ids, ignore_label_id = no loss
    <root>/<split>/<set>__puzzle_identifiers.npy  # [P] int32, one per PUZZLE
    <root>/<split>/<set>__puzzle_indices.npy      # [P + 1] int32 example offsets per puzzle
    <root>/<split>/<set>__group_indices.npy       # [G + 1] int32 puzzle offsets per group

A group is an original puzzle together with its augmentations. Roots may be
local paths or fsspec URLs such as ``gs://bucket/prefix``.
"""

from __future__ import annotations

import functools
import io
import json
import os
import sys
from dataclasses import asdict, dataclass, fields
from typing import Callable, Mapping, Sequence

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from runtime.errors import EXIT_INTERRUPTED, EXIT_USER_ERROR, end_progress_bars, interrupted, one_line
from runtime.task import IGNORE_LABEL

FIELDS = ("inputs", "labels", "puzzle_identifiers", "puzzle_indices", "group_indices")
_INDEX_FIELDS = ("puzzle_identifiers", "puzzle_indices", "group_indices")
BUILD_HINT = "python -m data_pipeline.build_sudoku --output-dir {root} --generate 1000"


class DatasetError(ValueError):
    """A dataset is missing or malformed; the message names the path and the fix."""


def builder_cli(main: Callable[..., None]) -> Callable[..., None]:
    """A dataset builder's `main`: bad input (a missing or malformed source file, an output folder
    that is not the builder's, a number out of range) is one `error:` line on stderr and exit 2,
    not a traceback; a progress bar the failure cut short is ended first, so that the line
    starts a line of its own."""

    @functools.wraps(main)
    def wrapped(argv: list[str] | None = None) -> None:
        try:
            main(argv)
        except (ValueError, OSError) as e:  # DatasetError is a ValueError; FileNotFoundError an OSError
            end_progress_bars()
            print(f"error: {one_line(e)}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USER_ERROR)
        except KeyboardInterrupt:  # Ctrl-C: one line and 130, no traceback; the folder keeps the marker it claimed
            end_progress_bars()
            print(f"error: {interrupted('the build stopped; its folder holds its marker, so the same command builds it')}",
                  file=sys.stderr, flush=True)
            sys.exit(EXIT_INTERRUPTED)

    return wrapped


@dataclass(frozen=True)
class PuzzleDatasetMetadata:
    pad_id: int
    ignore_label_id: int | None
    blank_identifier_id: int
    vocab_size: int
    seq_len: int
    num_puzzle_identifiers: int
    total_groups: int
    mean_puzzle_examples: float
    total_puzzles: int
    sets: tuple[str, ...]

    def to_json(self) -> str:
        d = asdict(self)
        d["sets"] = list(self.sets)
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> PuzzleDatasetMetadata:
        d = json.loads(text)
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in d]
        if missing:
            raise DatasetError(f"dataset.json lacks fields {missing}")
        d = {n: d[n] for n in names}  # extra keys from other writers are ignored
        check_whole_numbers(d, {"vocab_size": 1, "seq_len": 1, "num_puzzle_identifiers": 1, "total_groups": 0,
                                "total_puzzles": 0, "pad_id": 0, "blank_identifier_id": 0}, optional=("ignore_label_id",))
        if not isinstance(d["sets"], list) or not all(isinstance(n, str) and n for n in d["sets"]):
            raise DatasetError(f"sets={d['sets']!r} must be a list of set names")
        d["sets"] = tuple(d["sets"])
        try:
            d["mean_puzzle_examples"] = float(d["mean_puzzle_examples"])
        except (TypeError, ValueError):
            raise DatasetError(f"mean_puzzle_examples={d['mean_puzzle_examples']!r} is not a number") from None
        return cls(**d)


@dataclass(frozen=True, eq=False)
class PuzzleSplit:
    """One set of one split, ready for batching.

    The token arrays stay as stored (memory-mapped, usually uint8): a 1000-augmentation ARC
    split is ~2.8M x 900 tokens, 20 GB if widened to int32 up front. `rows(idx)` reads just
    the requested examples as int32 with ignored labels as IGNORE_LABEL (-100); the
    `inputs`/`labels` properties give whole arrays that way (small data, tests, tools).
    ``puzzle_identifiers`` is per EXAMPLE (expanded through puzzle_indices).
    """

    metadata: PuzzleDatasetMetadata
    raw_inputs: np.ndarray  # [N, seq_len] as stored
    raw_labels: np.ndarray  # [N, seq_len] as stored (ignore_label_id not yet mapped)
    puzzle_identifiers: np.ndarray  # [N] int32
    puzzle_indices: np.ndarray  # [P + 1] int32, as stored
    group_indices: np.ndarray  # [G + 1] int32, as stored

    def __len__(self) -> int:
        return int(self.raw_inputs.shape[0])

    def _labels(self, raw: np.ndarray) -> np.ndarray:
        labels = np.asarray(raw, dtype=np.int32)
        ignore = self.metadata.ignore_label_id
        if ignore is not None and ignore != IGNORE_LABEL:
            labels = np.where(labels == ignore, IGNORE_LABEL, labels).astype(np.int32)
        return labels

    def rows(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        """Examples `idx` (any order) as int32 arrays: inputs, labels, puzzle_identifiers."""
        return {"inputs": np.asarray(self.raw_inputs[idx], dtype=np.int32),
                "labels": self._labels(self.raw_labels[idx]),
                "puzzle_identifiers": self.puzzle_identifiers[idx]}

    @property
    def inputs(self) -> np.ndarray:
        return np.asarray(self.raw_inputs, dtype=np.int32)

    @property
    def labels(self) -> np.ndarray:
        return self._labels(self.raw_labels)


def check_whole_numbers(fields: Mapping[str, object], minimum: Mapping[str, int], optional: Sequence[str] = ()) -> None:
    """Each of `minimum`'s fields an integer (not a bool, a float or a string) at least its
    minimum, each of `optional` an integer or null; else a DatasetError naming the field."""
    for name in (*minimum, *optional):
        value = fields[name]
        if value is None and name in optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum.get(name, value):
            bound = f" >= {minimum[name]}" if name in minimum else " or null"
            raise DatasetError(f"{name}={value!r} must be an integer{bound}")


def check_token_values(inputs: np.ndarray, labels: np.ndarray, vocab_size: int, ignore: int | None, where: str,
                       chunk: int = 1 << 16) -> None:
    """Every input id in [0, vocab_size), every label there too or the ignore id, and at least one
    label not ignored; else a DatasetError. Read in chunks of rows (memory-mapped arrays stay
    mapped). An id outside the vocabulary would gather NaN or garbage on the device, an
    all-ignored set trains on nothing."""
    def first_bad(arr: np.ndarray, skip: int | None) -> int | None:
        for start in range(0, arr.shape[0], chunk):
            a = np.asarray(arr[start:start + chunk])
            bad = (a < 0) | (a >= vocab_size)
            if skip is not None:
                bad &= a != skip
            if bad.any():
                return int(a[bad][0])
        return None

    for name, arr, skip in (("inputs", inputs, None), ("labels", labels, ignore)):
        value = first_bad(arr, skip)
        if value is not None:
            other = f" or the ignore id {ignore}" if skip is not None else ""
            raise DatasetError(f"{where}: {name} hold {value}, outside [0, vocab_size={vocab_size}){other}; rebuild the "
                               "dataset with the vocabulary its metadata names")
    if labels.size and ignore is not None and not any(
            (np.asarray(labels[start:start + chunk]) != ignore).any() for start in range(0, labels.shape[0], chunk)):
        raise DatasetError(f"{where}: every label is the ignore id {ignore}, so there is nothing to learn; rebuild the "
                           "dataset with its targets")


def _join(root: str, *parts: str) -> str:
    return "/".join([str(root).rstrip("/"), *parts])


def _fs(root: str) -> tuple[fsspec.AbstractFileSystem, str, bool]:
    """(filesystem, root without its protocol, is local) for a path or URL."""
    fs, base = fsspec.core.url_to_fs(str(root))
    return fs, base, isinstance(fs, LocalFileSystem)


def _token_dtype(vocab_size: int) -> np.dtype:
    # The reference builders store tokens as uint8; keep that whenever the vocab fits.
    return np.dtype(np.uint8) if vocab_size <= 256 else np.dtype(np.int32)


def validate_arrays(arrays: Mapping[str, np.ndarray], metadata: PuzzleDatasetMetadata, where: str) -> None:
    """Raise DatasetError unless the arrays form a consistent set under metadata."""
    missing = [k for k in FIELDS if k not in arrays]
    if missing:
        raise DatasetError(f"{where}: missing arrays {missing}")

    def bad(msg: str) -> DatasetError:
        return DatasetError(f"{where}: {msg}; rebuild the dataset")

    inputs, labels = arrays["inputs"], arrays["labels"]
    for name in FIELDS:
        if not np.issubdtype(arrays[name].dtype, np.integer):
            raise bad(f"{name} has dtype {arrays[name].dtype}, expected integers")
    for name, arr in (("inputs", inputs), ("labels", labels)):
        if arr.ndim != 2 or arr.shape[1] != metadata.seq_len:
            raise bad(f"{name} has shape {arr.shape}, expected [N, seq_len={metadata.seq_len}]")
    if labels.shape != inputs.shape:
        raise bad(f"labels shape {labels.shape} != inputs shape {inputs.shape}")
    pidx, gidx, pids = arrays["puzzle_indices"], arrays["group_indices"], arrays["puzzle_identifiers"]
    for name in _INDEX_FIELDS:
        if arrays[name].ndim != 1:
            raise bad(f"{name} has shape {arrays[name].shape}, expected 1-D")
    if pidx.size < 1 or pidx[0] != 0 or pidx[-1] != inputs.shape[0] or np.any(np.diff(pidx) < 0):
        raise bad(f"puzzle_indices must rise from 0 to {inputs.shape[0]} examples")
    if pids.shape[0] != pidx.size - 1:
        raise bad(f"{pids.shape[0]} puzzle_identifiers for {pidx.size - 1} puzzles")
    if gidx.size < 1 or gidx[0] != 0 or gidx[-1] != pidx.size - 1 or np.any(np.diff(gidx) < 0):
        raise bad(f"group_indices must rise from 0 to {pidx.size - 1} puzzles")
    if pids.size and (pids.min() < 0 or pids.max() >= metadata.num_puzzle_identifiers):
        raise bad(f"puzzle_identifiers outside [0, {metadata.num_puzzle_identifiers})")
    check_token_values(inputs, labels, metadata.vocab_size, metadata.ignore_label_id, where)


def write_split(
    root: str,
    split: str,
    arrays: Mapping[str, np.ndarray],
    metadata: PuzzleDatasetMetadata,
    set_name: str = "all",
) -> None:
    """Write one set of a split (reference dtypes) plus its dataset.json."""
    validate_arrays(arrays, metadata, _join(root, split))
    fs, base, _ = _fs(root)
    where = _join(base, split)
    fs.makedirs(where, exist_ok=True)
    token_dtype = _token_dtype(metadata.vocab_size)
    for name in FIELDS:
        arr = np.asarray(arrays[name])
        dtype = np.int32 if name in _INDEX_FIELDS else token_dtype
        with fs.open(_join(where, f"{set_name}__{name}.npy"), "wb") as f:
            np.save(f, arr.astype(dtype, copy=False))
    with fs.open(_join(where, "dataset.json"), "w") as f:
        f.write(metadata.to_json())


def write_identifiers(root: str, names: Sequence[str]) -> None:
    """Write identifiers.json: names[i] is the name of puzzle identifier i (0 = "<blank>")."""
    fs, base, _ = _fs(root)
    fs.makedirs(base, exist_ok=True)
    with fs.open(_join(base, "identifiers.json"), "w") as f:
        json.dump(list(names), f)


def read_split_metadata(root: str, split: str, filename: str, parse, hint: str, kind: str = "dataset",
                        misfit: str | None = None):
    """`parse(text of <root>/<split>/<filename>)`, or a DatasetError naming the path and the fix
    (`hint`: the build command, with {root}). `kind` names the format in messages; `misfit`, a
    file whose presence means the root holds the other format (a one-line pointer to `hint`)."""
    fs, base, local = _fs(root)
    path = _join(root, split, filename)  # as the user wrote it, for messages
    if local:
        for where in (base, _join(base, split), _join(base, split, filename)):
            if os.path.lexists(where) and not os.path.exists(where):
                raise DatasetError(f"{where} is a symbolic link that leads nowhere (a loop, or its target is missing); "
                                   "fix the link, or point the data path at a real dataset folder")
    if not fs.exists(_join(base, split, filename)):
        if misfit and fs.exists(_join(base, split, misfit)):
            raise DatasetError(f"{_join(root, split)} holds {misfit}, not a {kind} split ({filename}); build one "
                               f"with `{hint.format(root='DIR')}`")
        exists = fs.exists(base)
        what = f"split '{split}'" if exists else kind
        if local:  # a builder writes only into a new folder (or its own earlier build: data_pipeline/marker.py)
            fix = f"build it with `{hint.format(root='NEW_DIR' if exists else root)}`"
        else:  # the builder writes locally; remote roots are uploaded copies
            fix = f"build it locally with `{hint.format(root='DIR')}` and copy DIR to {root}"
        raise DatasetError(f"{what} not found at {path}; {fix}, or point the data path at an existing dataset root")
    with fs.open(_join(base, split, filename), "r") as f:
        text = f.read()
    try:
        return parse(text)
    except (json.JSONDecodeError, TypeError) as e:
        raise DatasetError(f"{path}: unreadable metadata ({e}); rebuild the {kind}") from e
    except DatasetError as e:
        raise DatasetError(f"{path}: {e}; rebuild the {kind}") from e


def load_metadata(root: str, split: str) -> PuzzleDatasetMetadata:
    return read_split_metadata(root, split, "dataset.json", PuzzleDatasetMetadata.from_json, BUILD_HINT)


def _load_array(fs: fsspec.AbstractFileSystem, local: bool, path: str, shown: str, root: str) -> np.ndarray:
    if not fs.exists(path):
        raise DatasetError(f"missing array file {shown}; rebuild the dataset")
    try:
        if local:
            return np.load(path, mmap_mode="r")  # page in lazily, no copy up front
        with fs.open(path, "rb") as f:
            return np.load(io.BytesIO(f.read()))
    except (ValueError, EOFError, OSError) as e:  # a truncated file: short header or data
        from data_pipeline.marker import rebuild_hint  # a cycle: data_pipeline.marker imports this module

        raise DatasetError(f"{shown} is truncated or not a .npy array ({' '.join(str(e).split())[:120]}); "
                           f"{rebuild_hint(root)}") from e


def load_split(root: str, split: str, set_name: str = "all") -> PuzzleSplit:
    """Load one set of one split from a local path or an fsspec URL (gs://...)."""
    metadata = load_metadata(root, split)
    if set_name not in metadata.sets:
        raise DatasetError(f"{_join(root, split)} has sets {list(metadata.sets)}, not '{set_name}'")
    fs, base, local = _fs(root)
    raw = {}
    for name in FIELDS:
        file = f"{set_name}__{name}.npy"
        raw[name] = _load_array(fs, local, _join(base, split, file), _join(root, split, file), root)
    validate_arrays(raw, metadata, _join(root, split))

    puzzle_indices = np.array(raw["puzzle_indices"], dtype=np.int32)
    per_puzzle_ids = np.array(raw["puzzle_identifiers"], dtype=np.int32)
    return PuzzleSplit(
        metadata=metadata,
        raw_inputs=raw["inputs"],
        raw_labels=raw["labels"],
        puzzle_identifiers=np.repeat(per_puzzle_ids, np.diff(puzzle_indices)),
        puzzle_indices=puzzle_indices,
        group_indices=np.array(raw["group_indices"], dtype=np.int32),
    )
