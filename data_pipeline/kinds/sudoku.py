"""data.name=sudoku: Sudoku sets (Sudoku-Extreme builds, or puzzles generated here)."""

from __future__ import annotations

import logging
from typing import Any

from data_pipeline import build_sudoku
from data_pipeline.kinds.puzzle import PuzzleKind
from runtime.registry import register_dataset_kind
from runtime.task import DataShape

log = logging.getLogger("runtime")


class SudokuKind(PuzzleKind):
    name = "sudoku"
    can_generate = True
    builder = "build_sudoku"
    mixable = True  # may be a task of data.name=multitask

    def build(self, data: Any) -> None:
        build_sudoku.build_sudoku_dataset(data.path, **{k: v for k, (v, _) in self.build_parameters(data).items()})

    def build_parameters(self, data: Any) -> dict[str, tuple[Any, str]]:
        return self.generated_split(data) | {"num_aug": (data.generate_num_aug, "data.generate_num_aug"),
                                             "min_givens": (data.generate_min_givens, "data.generate_min_givens")}

    def generated_shape(self, data: Any) -> DataShape:
        return DataShape(examples=data.generate_puzzles * (1 + data.generate_num_aug),
                         vocab_size=build_sudoku.VOCAB_SIZE, seq_len=build_sudoku.SEQ_LEN,
                         epoch_examples=data.generate_puzzles, source="Sudoku to be generated, not built yet")


register_dataset_kind(SudokuKind())
