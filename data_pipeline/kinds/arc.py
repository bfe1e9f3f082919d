"""data.name=arc: ARC-AGI sets (data_pipeline/build_arc.py). Every evaluation votes over the
augmented test inputs on all processes and adds pass@k; one of the whole test set also writes a
Kaggle submission.json. An intermediate evaluation on a subset (train.eval_subset) holds whole
puzzles (a puzzle's augmented copies are one unit, data_pipeline/kinds/puzzle.py), and its pass@k
is over the puzzles it evaluated."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from data_pipeline.arc_eval import ARCEvaluator
from data_pipeline.build_arc import parse_identifier
from data_pipeline.kinds.puzzle import PuzzleKind
from runtime.evaluation import gather_objects, local_rows
from runtime.registry import register_dataset_kind
from runtime.task import IGNORE_LABEL, Evaluator


class ArcVoting(Evaluator):
    """Every process votes with the rows it holds; process 0 merges all votes, adds pass@k and,
    when every test puzzle was evaluated, writes the submission (`<output_dir>/submission.json`)."""

    wants_rows = True

    def __init__(self, template: Any, submission_path: str):
        self.template = template  # the dataset's identifiers and test puzzles, read once per run
        self.submission_path = submission_path
        self.arc: ARCEvaluator | None = None
        self.seen: set[str] = set()  # the original puzzles this process's rows belong to

    def start(self) -> None:
        self.arc = ARCEvaluator(self.template.identifiers, self.template.test_puzzles)
        self.seen = set()

    def update(self, batch, outputs) -> None:
        mine = local_rows({k: batch[k] for k in ("inputs", "labels", "puzzle_identifiers")} | dict(outputs))
        real = (mine["labels"] != IGNORE_LABEL).any(-1)  # padding rows of the last batch have no labels
        ids = mine["puzzle_identifiers"][real]
        self.seen.update(parse_identifier(self.template.identifiers[int(i)])[0]
                         for i in np.unique(ids) if i != self.arc.blank_identifier_id)
        self.arc.update(mine["inputs"][real], mine["preds"][real], ids, mine["q_halt_logits"][real])

    def finish(self, params) -> dict[str, float]:
        states = gather_objects((self.arc.state(), sorted(self.seen)))
        if jax.process_index() != 0:
            return {}
        for other, seen in states[1:]:
            self.arc.merge(other)
            self.seen.update(seen)
        tests = self.template.test_puzzles
        if set(tests) <= self.seen:
            return dict(self.arc.result(self.submission_path))
        evaluated = ARCEvaluator(self.template.identifiers, {name: tests[name] for name in tests if name in self.seen})
        evaluated.merge(self.arc.state())
        return dict(evaluated.result()) if evaluated.test_puzzles else {}


class ArcKind(PuzzleKind):
    name = "arc"
    mixable = True

    def evaluators(self, data: Any, context: Any) -> list[Evaluator]:
        return [ArcVoting(ARCEvaluator.from_dataset(data.path), f"{context.output_dir}/submission.json")]


register_dataset_kind(ArcKind())
