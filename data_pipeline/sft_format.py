"""On-disk format of tokenized SFT splits and their loader (local path or gs://).

Layout of a dataset root::

    <root>/<split>/sft.json              # SFTMetadata
    <root>/<split>/inputs.npy            # [N, seq_len] int32: tokens[:-1], right-padded with pad_id
    <root>/<split>/labels.npy            # [N, seq_len] int32: next token where the loss mask is on, else -100
    packed splits (several examples per row):
    <root>/<split>/segment_ids.npy       # [N, seq_len] int32: 1, 2, ... per example, 0 = padding
    <root>/<split>/positions.npy         # [N, seq_len] int32: restart at 0 for every example
    unpacked splits (one example per row):
    <root>/<split>/prompt_lengths.npy    # [N] int32: prompt tokens up to and including `<start_of_turn>model\\n`
    <root>/<split>/answers.json          # [N] reference answer strings, for eval scoring

The splits are "train" and "test"; `python -m data_pipeline.build_sft` writes them.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields

import fsspec
import numpy as np

from data_pipeline.puzzle_format import (DatasetError, _fs, _join, check_token_values, check_whole_numbers,
                                         read_split_metadata)
from runtime.task import IGNORE_LABEL

BUILD_HINT = ("python -m data_pipeline.build_sft --jsonl TRAIN.jsonl --tokenizer MODEL --seq-len 256 --output-dir {root}"
              " (or --generate-arithmetic 1000 instead of --jsonl/--tokenizer for a synthetic set)")
PACKED_FIELDS = ("inputs", "labels", "segment_ids", "positions")
UNPACKED_FIELDS = ("inputs", "labels", "prompt_lengths")


@dataclass(frozen=True)
class SFTMetadata:
    vocab_size: int
    seq_len: int
    pad_id: int
    eos_id: int
    end_of_turn_id: int
    packed: bool
    num_rows: int  # N, rows of the arrays
    num_examples: int  # examples kept (several per row when packed)
    num_truncated: int  # examples whose response was cut at seq_len
    num_dropped: int  # examples whose prompt alone did not fit
    tokenizer: str  # path of the tokenizer model used
    source: str  # the JSONL the examples came from
    ignore_label_id: int = IGNORE_LABEL
    num_puzzle_identifiers: int = 1  # the trainer's puzzle-table size; SFT has none

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> SFTMetadata:
        d = json.loads(text)
        if not isinstance(d, dict):
            raise DatasetError("sft.json is not a JSON object")
        required = [f.name for f in fields(cls) if f.name not in ("ignore_label_id", "num_puzzle_identifiers")]
        missing = [n for n in required if n not in d]
        if missing:
            raise DatasetError(f"sft.json lacks fields {missing}")
        check_whole_numbers(d, {"vocab_size": 1, "seq_len": 2, "pad_id": 0, "eos_id": 0, "end_of_turn_id": 0,
                                "num_rows": 0, "num_examples": 0, "num_truncated": 0, "num_dropped": 0})
        if not isinstance(d["packed"], bool):
            raise DatasetError(f"packed={d['packed']!r} must be true or false")
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    @property
    def array_names(self) -> tuple[str, ...]:
        return PACKED_FIELDS if self.packed else UNPACKED_FIELDS


class SFTSplit:
    """One split, ready for batching. Arrays stay as stored (memory-mapped for local roots);
    `rows(idx)` reads just the requested examples."""

    def __init__(self, metadata: SFTMetadata, arrays: Mapping[str, np.ndarray], answers: Sequence[str] | None):
        self.metadata = metadata
        self.arrays = dict(arrays)
        self._answers = None if answers is None else list(answers)

    def __len__(self) -> int:
        return int(self.arrays["inputs"].shape[0])

    def rows(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        """Rows `idx` (any order) as int32: inputs, labels (+ segment_ids, positions when packed)."""
        idx = np.asarray(idx)
        names = ("inputs", "labels", "segment_ids", "positions") if self.metadata.packed else ("inputs", "labels")
        return {n: np.asarray(self.arrays[n][idx], dtype=np.int32) for n in names}

    def _unpacked(self, what: str) -> None:
        if self.metadata.packed:
            raise DatasetError(f"a packed split has no {what} (rows hold several examples); "
                               "evaluate on an unpacked split (build_sft never packs the test split)")

    def prompts(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(prompt tokens [n, seq_len] right-padded with pad_id, prompt lengths [n]): generation
        starts after `<start_of_turn>model\\n`."""
        self._unpacked("prompts")
        idx = np.asarray(idx)
        tokens = np.asarray(self.arrays["inputs"][idx], dtype=np.int32)
        lengths = np.asarray(self.arrays["prompt_lengths"][idx], dtype=np.int32)
        tokens[np.arange(tokens.shape[1])[None, :] >= lengths[:, None]] = self.metadata.pad_id
        return tokens, lengths

    def answers(self, idx: Sequence[int] | np.ndarray) -> list[str]:
        """Reference answer strings of examples `idx`."""
        self._unpacked("answers")
        return [self._answers[int(i)] for i in np.asarray(idx).reshape(-1)]


def validate_sft(arrays: Mapping[str, np.ndarray], metadata: SFTMetadata, answers: Sequence[str] | None,
                 where: str) -> None:
    """Raise DatasetError unless shapes and dtypes agree with metadata and the ids with its
    vocabulary (check_token_values: a scan of inputs and labels, in chunks)."""
    def bad(msg: str) -> DatasetError:
        return DatasetError(f"{where}: {msg}; rebuild the split with `{BUILD_HINT.format(root='DIR')}`")

    missing = [n for n in metadata.array_names if n not in arrays]
    if missing:
        raise bad(f"missing arrays {missing}")
    n, seq_len = metadata.num_rows, metadata.seq_len
    for name in metadata.array_names:
        arr = arrays[name]
        if not np.issubdtype(arr.dtype, np.integer):
            raise bad(f"{name} has dtype {arr.dtype}, expected integers")
        want = (n,) if name == "prompt_lengths" else (n, seq_len)
        if tuple(arr.shape) != want:
            raise bad(f"{name} has shape {tuple(arr.shape)}, expected {list(want)} (num_rows, seq_len from sft.json)")
    if not metadata.packed and (answers is None or len(answers) != n):
        raise bad(f"answers.json holds {None if answers is None else len(answers)} answers for {n} rows")
    check_token_values(arrays["inputs"], arrays["labels"], metadata.vocab_size, metadata.ignore_label_id, where)


def write_sft_split(root: str, split: str, arrays: Mapping[str, np.ndarray], metadata: SFTMetadata,
                    answers: Sequence[str] | None = None) -> None:
    """Write one split: its arrays as int32 .npy, answers.json (unpacked) and sft.json (last,
    so a split with sft.json is complete)."""
    where = _join(root, split)
    validate_sft(arrays, metadata, answers, where)
    fs, base, _ = _fs(root)
    fs.makedirs(_join(base, split), exist_ok=True)
    for name in metadata.array_names:
        with fs.open(_join(base, split, f"{name}.npy"), "wb") as f:
            np.save(f, np.asarray(arrays[name]).astype(np.int32, copy=False))
    if not metadata.packed:
        with fs.open(_join(base, split, "answers.json"), "w") as f:
            json.dump(list(answers), f)
    with fs.open(_join(base, split, "sft.json"), "w") as f:
        f.write(metadata.to_json())


def load_sft_metadata(root: str, split: str) -> SFTMetadata:
    return read_split_metadata(root, split, "sft.json", SFTMetadata.from_json, BUILD_HINT, kind="SFT dataset",
                               misfit="dataset.json")


def _read(fs: fsspec.AbstractFileSystem, path: str, shown: str, local: bool, as_array: bool):
    if not fs.exists(path):
        raise DatasetError(f"missing file {shown}; rebuild the split with `{BUILD_HINT.format(root='DIR')}`")
    try:
        if as_array and local:
            return np.load(path, mmap_mode="r")  # page in lazily, no copy up front
        with fs.open(path, "rb") as f:
            data = f.read()
        return np.load(io.BytesIO(data)) if as_array else json.loads(data)
    except (ValueError, OSError) as e:
        raise DatasetError(f"unreadable {shown} ({' '.join(str(e).split())}); rebuild the split") from e


def load_sft_split(root: str, split: str) -> SFTSplit:
    """Load one SFT split from a local path or an fsspec URL (gs://...)."""
    metadata = load_sft_metadata(root, split)
    fs, base, local = _fs(root)
    arrays = {n: _read(fs, _join(base, split, f"{n}.npy"), _join(root, split, f"{n}.npy"), local, True)
              for n in metadata.array_names}
    answers = None
    if not metadata.packed:
        answers = _read(fs, _join(base, split, "answers.json"), _join(root, split, "answers.json"), local, False)
        if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
            raise DatasetError(f"{_join(root, split, 'answers.json')} must be a list of strings; rebuild the split")
    validate_sft(arrays, metadata, answers, _join(root, split))
    return SFTSplit(metadata, arrays, answers)
