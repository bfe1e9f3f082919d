"""data.name=arc: ARC-AGI sets (data_pipeline/build_arc.py). Every evaluation votes over the
augmented test inputs on all processes, adds pass@k and writes a Kaggle submission.json."""

from __future__ import annotations

from typing import Any

from data_pipeline.kinds.puzzle import PuzzleKind
from runtime.evaluation import gather_objects, local_rows
from runtime.registry import register_dataset_kind
from runtime.task import IGNORE_LABEL, Evaluator


class ArcVoting(Evaluator):
    """Every process votes with the rows it holds; process 0 merges all votes, adds pass@k and
    writes the submission (`<output_dir>/submission.json`)."""

    wants_rows = True

    def __init__(self, template: Any, submission_path: str):
        self.template = template  # the dataset's identifiers and test puzzles, read once per run
        self.submission_path = submission_path
        self.arc = None

    def start(self) -> None:
        from data_pipeline.arc_eval import ARCEvaluator

        self.arc = ARCEvaluator(self.template.identifiers, self.template.test_puzzles)

    def update(self, batch, outputs) -> None:
        mine = local_rows({k: batch[k] for k in ("inputs", "labels", "puzzle_identifiers")} | dict(outputs))
        real = (mine["labels"] != IGNORE_LABEL).any(-1)  # padding rows of the last batch have no labels
        self.arc.update(mine["inputs"][real], mine["preds"][real], mine["puzzle_identifiers"][real],
                        mine["q_halt_logits"][real])

    def finish(self, params) -> dict[str, float]:
        import jax

        states = gather_objects(self.arc.state())
        if jax.process_index() != 0:
            return {}
        for other in states[1:]:
            self.arc.merge(other)
        return dict(self.arc.result(self.submission_path))


class ArcKind(PuzzleKind):
    name = "arc"
    mixable = True

    def evaluators(self, data: Any, context: Any) -> list[Evaluator]:
        from data_pipeline.arc_eval import ARCEvaluator

        return [ArcVoting(ARCEvaluator.from_dataset(data.path), f"{context.output_dir}/submission.json")]


register_dataset_kind(ArcKind())
