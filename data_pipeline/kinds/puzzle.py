"""Puzzle sets in the reference on-disk format (data_pipeline/puzzle_format.py): the shared
base of the sudoku, maze and arc kinds.

The reference's epoch: one augmented copy of each original puzzle (total_groups x
mean_puzzle_examples examples), not a pass over every augmented row. An evaluation's unit is a
group too: an original puzzle with its augmented copies (`unit_offsets`), which an intermediate
evaluation's subset keeps together (train.eval_subset).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import fsspec
import numpy as np

from data_pipeline.marker import build_note, check_generated, remove_generated, run_build_target
from data_pipeline.puzzle_format import FIELDS, DatasetError, load_metadata, load_split
from runtime.errors import UserError, one_line
from runtime.preflight import check_buildable, check_npy_readable, os_reason, principal_in
from runtime.data_feed import BatchFeeder
from runtime.registry import DatasetKind
from runtime.task import DataShape

log = logging.getLogger("runtime")


def epoch_examples(metadata: Any) -> int:
    """The reference's epoch of a puzzle split: total_groups x mean_puzzle_examples."""
    return max(1, round(metadata.total_groups * metadata.mean_puzzle_examples))


def unit_offsets(split: Any) -> np.ndarray:
    """Row offsets [G + 1] of a split's groups (an original puzzle and its augmented copies)."""
    return np.asarray(split.puzzle_indices)[np.asarray(split.group_indices)]


def stored_rows(path: str, split: str) -> int:
    """Rows of a split, from the inputs' .npy header only (no array is read)."""
    with fsspec.open(f"{path.rstrip('/')}/{split}/all__inputs.npy", "rb") as f:
        version = np.lib.format.read_magic(f)
        header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        return int(header(f)[0][0])


class PuzzleKind(DatasetKind):
    """Loading, checks and shapes of a reference-format puzzle set. Subclasses that can
    generate their set implement `build` and `generated_shape`."""

    can_generate = False
    builder = ""  # with can_generate: the data_pipeline module that builds the set (its marker's name)
    metadata_file = "dataset.json"

    # ------------------------------------------------------------------ hooks

    def load_split(self, data: Any, split: str) -> Any:
        try:
            return load_split(data.path, split)
        except DatasetError as e:
            raise UserError(str(e)) from e

    def shape(self, data: Any, train_split: Any) -> DataShape:
        m = train_split.metadata
        return DataShape(examples=len(train_split), vocab_size=m.vocab_size, seq_len=m.seq_len,
                         num_puzzle_identifiers=m.num_puzzle_identifiers, epoch_examples=epoch_examples(m),
                         source=f"dataset {data.path}")

    def planned_shape(self, data: Any, config: Any) -> DataShape:
        try:
            m = load_metadata(data.path, data.train_split)
            return DataShape(examples=stored_rows(data.path, data.train_split), vocab_size=m.vocab_size,
                             seq_len=m.seq_len, num_puzzle_identifiers=m.num_puzzle_identifiers,
                             epoch_examples=epoch_examples(m), source=f"dataset {data.path}")
        except (DatasetError, FileNotFoundError) as e:
            if not self.can_generate:
                raise UserError(str(e)) from e
        # The shape follows from the config's sizes: plan before the set is built or copied here
        # (a pod's data is usually only on GCS or the workers).
        log.info("no dataset at %s: planning from the config's sizes", data.path)
        return self.generated_shape(data)

    def make_feeder(self, split: Any, sharding: Any, global_batch: int, seed: int, prefetch: bool = True) -> Any:
        return BatchFeeder(split, sharding, global_batch, seed, prefetch=prefetch, units=unit_offsets(split))

    def ensure_built(self, data: Any) -> None:
        if not self.can_generate or not data.generate_if_missing or data.path.startswith("gs://"):
            return
        if self.differs_from_build(data):  # data.regenerate=true: the old build goes
            log.info("data.path=%s: replacing the generated set there (data.regenerate=true)", data.path)
            remove_generated(data.path, self.builder)
        if not self.is_built(data):
            reason = self.build_target(data)
            log.info("data.path=%s %s: building a generated %s set there (data.generate_if_missing=true)%s",
                     data.path, reason, self.name, build_note(reason))
            self.build(data)

    def differs_from_build(self, data: Any) -> bool:
        """Whether the generated set at data.path (its marker) was built with other parameters than
        data.generate_* ask for and data.regenerate allows replacing it; a UserError naming the
        difference when it does not. (Built or half-built: a set whose dataset.json went missing
        is never rebuilt silently with other sizes.)"""
        return check_generated(data.path, self.builder, self.build_parameters(data), data.regenerate)

    def build_target(self, data: Any) -> str:
        """Why the run may build at data.path; UserError for a folder that is not a generated set."""
        return run_build_target(data.path, self.builder, f"{data.train_split}/{self.metadata_file}")

    def preflight(self, data: Any, gcs: Any) -> None:
        root = str(data.path)
        remote = "://" in root
        if not remote and self.can_generate and data.generate_if_missing:
            if self.differs_from_build(data) or not self.is_built(data):
                self.build_target(data)  # never over a folder that is not a generated set
                check_buildable(root)  # the run builds it; only where it goes is checked
                return
        if root.startswith("gs://"):
            gcs.bucket(root, "data.path", need_metadata=False)  # fast, bounded
        for split in dict.fromkeys([data.train_split, data.eval_split]):
            self.check_split(root, split, remote)

    # ------------------------------------------------------------ for subclasses

    def is_built(self, data: Any) -> bool:
        return os.path.exists(os.path.join(data.path, data.train_split, self.metadata_file))

    def build(self, data: Any) -> None:
        """Build the set at data.path: the builder called with `build_parameters`."""
        raise NotImplementedError

    def build_parameters(self, data: Any) -> dict[str, tuple[Any, str]]:
        """The builder's parameters for data.generate_*, as its marker records them, each with
        the setting it comes from: parameter -> (value, setting)."""
        raise NotImplementedError

    @staticmethod
    def generated_split(data: Any) -> dict[str, tuple[Any, str]]:
        """The parameters every grid builder (build_sudoku, build_maze) gets from a run: how many
        puzzles, generated, how many held out, none subsampled, the seed."""
        return {"generate": (data.generate_puzzles + data.generate_test_puzzles,
                             "data.generate_puzzles + data.generate_test_puzzles"),
                "source_csv": (None, "a run generates its puzzles"),
                "test_size": (data.generate_test_puzzles, "data.generate_test_puzzles"),
                "subsample_size": (None, "a run keeps every generated puzzle"),
                "seed": (data.generate_seed, "data.generate_seed")}

    def generated_shape(self, data: Any) -> DataShape:
        raise NotImplementedError

    def check_split(self, root: str, split: str, remote: bool) -> None:
        """dataset.json parses and every array file it promises exists (and is a .npy locally)."""
        split_dir = f"{root.rstrip('/')}/{split}"
        try:
            metadata = load_metadata(root, split)
            fs, base = fsspec.core.url_to_fs(split_dir)
            present = {os.path.basename(str(p).rstrip("/")) for p in fs.ls(base, detail=False, refresh=True)}
        except DatasetError as e:
            raise UserError(str(e)) from e
        except PermissionError as e:
            raise UserError(f"no read permission on {split_dir} ({os_reason(e)}); make the dataset readable for this "
                            "user or point data.path at another copy") from e
        except Exception as e:  # permission, network, a path that is a file
            if getattr(e, "code", None) in (401, 403) or str(e).startswith("Forbidden"):  # gcsfs: OSError on 403
                who = principal_in(e) or "this worker's account (see gcloud auth list)"
                raise UserError(f"no read permission on {split_dir}: grant roles/storage.objectViewer to {who} or "
                                "point data.path at a readable copy") from e
            raise UserError(f"cannot read the dataset at {split_dir} ({one_line(e)[:200]}); check data.path and "
                            "that this worker can read it (roles/storage.objectViewer for gs://)") from e
        for set_name in metadata.sets:
            for field in FIELDS:
                file = f"{set_name}__{field}.npy"
                if file not in present:
                    raise UserError(f"missing array file {split_dir}/{file} (listed by {split_dir}/dataset.json); "
                                    "rebuild the dataset or point data.path at a complete one")
                if not remote:
                    check_npy_readable(os.path.join(split_dir, file))
