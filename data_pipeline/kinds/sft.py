"""data.name=sft: tokenized chat sets for supervised fine-tuning (data_pipeline/sft_format.py),
built from JSONL traces or, for demos and tests, a generated arithmetic set."""

from __future__ import annotations

import logging
import os
from typing import Any

from data_pipeline.build_sft import BUILDER, DEFAULT_VOCAB_SIZE, build_generated_arithmetic
from data_pipeline.marker import build_note, check_generated, remove_generated, run_build_target
from data_pipeline.puzzle_format import DatasetError
from data_pipeline.sft_format import load_sft_metadata, load_sft_split
from runtime.errors import UserError, one_line
from runtime.preflight import check_buildable
from runtime.registry import DatasetKind, register_dataset_kind
from runtime.task import DataShape

log = logging.getLogger("runtime")

UNBUILT_ROWS = 1_000_000  # a plan without the set: only the schedule's length depends on it


class SFTKind(DatasetKind):
    name = "sft"

    def load_split(self, data: Any, split: str) -> Any:
        try:
            return load_sft_split(data.path, split)
        except DatasetError as e:
            raise UserError(str(e)) from e

    def shape(self, data: Any, train_split: Any) -> DataShape:
        m = train_split.metadata
        return DataShape(examples=len(train_split), vocab_size=m.vocab_size, seq_len=m.seq_len, packed=m.packed,
                         source=f"dataset {data.path}")

    def planned_shape(self, data: Any, config: Any) -> DataShape:
        try:
            m = load_sft_metadata(data.path, data.train_split)
            return DataShape(examples=m.num_rows, vocab_size=m.vocab_size, seq_len=m.seq_len, packed=m.packed,
                             source=f"dataset {data.path}")
        except (DatasetError, FileNotFoundError):
            vocab = getattr(config.arch, "vocab_in_use", None) or getattr(config.arch, "vocab_size", 0)  # not padding
            return DataShape(examples=UNBUILT_ROWS, vocab_size=vocab, seq_len=data.seq_len,
                             source=f"SFT set not built; data.seq_len={data.seq_len}", examples_exact=False)

    def is_built(self, data: Any) -> bool:
        return os.path.exists(os.path.join(data.path, data.train_split, "sft.json"))

    def ensure_built(self, data: Any) -> None:
        if not data.generate_if_missing or data.path.startswith("gs://"):
            return
        if self.differs_from_build(data):  # data.regenerate=true: the old build goes
            log.info("data.path=%s: replacing the generated set there (data.regenerate=true)", data.path)
            remove_generated(data.path, BUILDER)
        if self.is_built(data):
            return
        reason = self.build_target(data)
        log.info("data.path=%s %s: building a generated arithmetic reasoning set there (data.generate_if_missing=true)%s",
                 data.path, reason, build_note(reason))
        build_generated_arithmetic(data.path, data.generate_puzzles, data.generate_test_puzzles, data.seq_len,
                                   data.generate_seed)

    def differs_from_build(self, data: Any) -> bool:
        """As PuzzleKind.differs_from_build: the generated arithmetic set's parameters."""
        wanted = {"generate_arithmetic": (data.generate_puzzles + data.generate_test_puzzles,
                                          "data.generate_puzzles + data.generate_test_puzzles"),
                  "num_eval": (data.generate_test_puzzles, "data.generate_test_puzzles"),
                  "seq_len": (data.seq_len, "data.seq_len"), "seed": (data.generate_seed, "data.generate_seed"),
                  # what the run builds with, so that it never rebuilds a set of other options
                  "vocab_size": (DEFAULT_VOCAB_SIZE, "the builder's default"),
                  "tokenizer": (None, "a run trains its own tokenizer"),
                  "packing": (False, "a run builds unpacked rows")}
        return check_generated(data.path, BUILDER, wanted, data.regenerate)

    def build_target(self, data: Any) -> str:
        """Why the run may build at data.path; UserError for a folder that is not a generated set."""
        return run_build_target(data.path, BUILDER, f"{data.train_split}/sft.json")

    def preflight(self, data: Any, gcs: Any) -> None:
        """Each split's sft.json parses (the arrays are checked on load)."""
        root = str(data.path)
        if "://" not in root and data.generate_if_missing and (self.differs_from_build(data) or not self.is_built(data)):
            self.build_target(data)  # never over a folder that is not a generated set
            check_buildable(root)
            return
        if root.startswith("gs://"):
            gcs.bucket(root, "data.path", need_metadata=False)
        for split in dict.fromkeys([data.train_split, data.eval_split]):
            try:
                load_sft_metadata(root, split)
            except DatasetError as e:
                raise UserError(str(e)) from e
            except Exception as e:
                raise UserError(f"cannot read the dataset at {root}/{split} ({one_line(e)[:200]}); check data.path and "
                                "that this worker can read it (roles/storage.objectViewer for gs://)") from e


register_dataset_kind(SFTKind())
