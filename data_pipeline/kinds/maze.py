"""data.name=maze: maze path-finding sets (the Maze-Hard build, or mazes generated here)."""

from __future__ import annotations

import logging
from typing import Any

from data_pipeline import maze
from data_pipeline.build_maze import build_maze_dataset
from data_pipeline.kinds.puzzle import PuzzleKind
from runtime.registry import register_dataset_kind
from runtime.task import DataShape

log = logging.getLogger("runtime")


class MazeKind(PuzzleKind):
    name = "maze"
    can_generate = True
    builder = "build_maze"
    mixable = True

    def build(self, data: Any) -> None:
        side = data.generate_grid_size or maze.DEFAULT_SIZE
        if data.generate_num_aug not in (0, 7):
            log.warning("maze augmentation adds the 7 other dihedral images of each maze (generate_num_aug=7); "
                        "generate_num_aug=%d is treated as 7", data.generate_num_aug)
        log.info("building a generated %dx%d maze dataset at %s", side, side, data.path)
        build_maze_dataset(data.path, **{k: v for k, (v, _) in self.build_parameters(data).items()})

    def build_parameters(self, data: Any) -> dict[str, tuple[Any, str]]:
        return self.generated_split(data) | {
            "aug": (data.generate_num_aug > 0, "data.generate_num_aug"),
            "size": (data.generate_grid_size or maze.DEFAULT_SIZE, "data.generate_grid_size"),
            "loop_fraction": (maze.DEFAULT_LOOP_FRACTION, "the builder's default")}

    def generated_shape(self, data: Any) -> DataShape:
        side = data.generate_grid_size or maze.DEFAULT_SIZE
        examples = data.generate_puzzles * (8 if data.generate_num_aug > 0 else 1)  # aug: all 8 dihedral images
        return DataShape(examples=examples, vocab_size=maze.VOCAB_SIZE, seq_len=side * side,
                         epoch_examples=data.generate_puzzles,
                         source=f"{side}x{side} mazes to be generated, not built yet")


register_dataset_kind(MazeKind())
