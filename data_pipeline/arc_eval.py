"""ARC evaluation: vote over augmented predictions, pass@k and a Kaggle submission.

Each prediction is a [900] token grid of one test example of one (possibly
augmented) puzzle. It is cropped to the top-left grid bounded by EOS, mapped back
through the inverse of the augmentation named by its puzzle identifier, and
counted as one vote for that grid for (original puzzle, test input), where the
test input is recognised by the content hash of the equally inverted input grid.
Every vote carries the score sigmoid(q_halt_logit). Candidates are ranked by
(votes, mean score), highest first; pass@k counts a test input solved when the
true output is among the top k, averaged per puzzle and then over puzzles.

    ev = ARCEvaluator.from_dataset("data/arc1-aug-1000")
    for batch, out in ...:  # test split batches
        ev.update(batch["inputs"], out["preds"], batch["puzzle_identifiers"], out["q_halt_logits"])
    metrics = ev.result(submission_path="run/submission.json")  # {"ARC/pass@1": ..., ...}

Hosts of a pod each `update` with their shard; gather `state()` from all of them
and `merge` into one evaluator before `result`.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

import fsspec
import numpy as np

from data_pipeline.build_arc import Task, as_grid, crop_tokens, grid_hash, parse_identifier

PASS_KS = (1, 2, 5, 10, 100, 1000)
SUBMISSION_K = 2


def sigmoid(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # overflow-free logistic


class ARCEvaluator:
    def __init__(
        self,
        identifiers: Sequence[str],
        test_puzzles: Mapping[str, Task],
        *,
        blank_identifier_id: int = 0,
        pass_ks: Sequence[int] = PASS_KS,
        submission_k: int = SUBMISSION_K,
    ):
        self.identifiers = list(identifiers)
        self.test_puzzles = dict(test_puzzles)
        self.blank_identifier_id = blank_identifier_id
        self.pass_ks = tuple(pass_ks)
        self.submission_k = submission_k
        # puzzle -> input hash -> index of that test pair (first one when inputs repeat)
        self._test_index: dict[str, dict[str, int]] = {}
        for name, task in self.test_puzzles.items():
            index: dict[str, int] = {}
            for i, pair in enumerate(task["test"]):
                index.setdefault(grid_hash(as_grid(pair["input"])), i)
            self._test_index[name] = index
        self._grids: dict[str, np.ndarray] = {}  # prediction hash -> grid
        self._votes: dict[tuple[str, int], dict[str, list[float]]] = {}  # (puzzle, test idx) -> hash -> [votes, score sum]
        self.skipped = {"blank": 0, "empty": 0, "unmatched": 0}

    @classmethod
    def from_dataset(cls, root: str, **kwargs: Any) -> ARCEvaluator:
        """Evaluator for a dataset written by build_arc (identifiers.json, test_puzzles.json; local or fsspec URL)."""
        base = str(root).rstrip("/")
        with fsspec.open(f"{base}/identifiers.json", "r") as f:
            identifiers = json.load(f)
        with fsspec.open(f"{base}/test_puzzles.json", "r") as f:
            test_puzzles = json.load(f)
        return cls(identifiers, test_puzzles, **kwargs)

    def update(
        self,
        inputs: np.ndarray,
        predictions: np.ndarray,
        puzzle_identifiers: np.ndarray,
        q_halt_logits: np.ndarray,
    ) -> None:
        """Add a batch: token grids [N, 900] (inputs and predictions), identifiers [N], q_halt logits [N]."""
        inputs, predictions = np.asarray(inputs), np.asarray(predictions)
        ids = np.asarray(puzzle_identifiers).reshape(-1)
        scores = sigmoid(np.asarray(q_halt_logits).reshape(-1))
        if not (len(inputs) == len(predictions) == len(ids) == len(scores)):
            raise ValueError("inputs, predictions, puzzle_identifiers and q_halt_logits need the same length")
        for tokens_in, tokens_pred, pid, score in zip(inputs, predictions, ids, scores):
            if pid == self.blank_identifier_id:  # batch padding
                self.skipped["blank"] += 1
                continue
            puzzle, aug = parse_identifier(self.identifiers[int(pid)])
            pair = self._test_index.get(puzzle, {}).get(grid_hash(aug.invert(crop_tokens(tokens_in))))
            if pair is None:
                self.skipped["unmatched"] += 1  # not a test input of a test puzzle
                continue
            pred = crop_tokens(tokens_pred)
            if pred.size == 0:
                self.skipped["empty"] += 1
                continue
            pred = aug.invert(pred)
            h = grid_hash(pred)
            self._grids.setdefault(h, pred)
            stats = self._votes.setdefault((puzzle, pair), {}).setdefault(h, [0, 0.0])
            stats[0] += 1
            stats[1] += float(score)

    # -- multi-host -------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Picklable accumulated votes, for gathering across hosts."""
        return {"grids": self._grids, "votes": self._votes, "skipped": self.skipped}

    def merge(self, state: Mapping[str, Any]) -> None:
        for h, grid in state["grids"].items():
            self._grids.setdefault(h, grid)
        for key, candidates in state["votes"].items():
            mine = self._votes.setdefault(key, {})
            for h, (votes, total) in candidates.items():
                stats = mine.setdefault(h, [0, 0.0])
                stats[0] += votes
                stats[1] += total
        for k, v in state["skipped"].items():
            self.skipped[k] = self.skipped.get(k, 0) + v

    # -- results ------------------------------------------------------------------

    def ranking(self, puzzle: str, test_index: int) -> list[tuple[np.ndarray, int, float]]:
        """Candidates for one test input as (grid, votes, mean score), best first."""
        candidates = self._votes.get((puzzle, test_index), {})
        order = sorted(candidates.items(), key=lambda kv: (kv[1][0], kv[1][1] / kv[1][0]), reverse=True)
        return [(self._grids[h], int(v), s / v) for h, (v, s) in order]

    def result(self, submission_path: str | None = None) -> dict[str, float]:
        """pass@k metrics ("ARC/pass@k"); also writes the top-2 submission JSON when a path is given."""
        if not self.test_puzzles:
            raise ValueError("no test puzzles to evaluate")
        solved = np.zeros(len(self.pass_ks))
        submission: dict[str, list[dict[str, list[list[int]]]]] = {}
        for name, task in self.test_puzzles.items():
            per_pair = np.zeros(len(self.pass_ks))
            attempts = []
            for i, pair in enumerate(task["test"]):
                ranked = self.ranking(name, i)
                truth = grid_hash(as_grid(pair["output"])) if "output" in pair else None
                hashes = [grid_hash(g) for g, _, _ in ranked]
                for j, k in enumerate(self.pass_ks):
                    per_pair[j] += truth is not None and truth in hashes[:k]
                grids = [g.tolist() for g, _, _ in ranked[: self.submission_k]] or [[[0]]]
                grids += [grids[0]] * (self.submission_k - len(grids))  # Kaggle wants every attempt
                attempts.append({f"attempt_{a + 1}": g for a, g in enumerate(grids)})
            solved += per_pair / len(task["test"])
            submission[name] = attempts
        if submission_path is not None:
            with fsspec.open(submission_path, "w") as f:
                json.dump(submission, f)
        return {f"ARC/pass@{k}": float(solved[j] / len(self.test_puzzles)) for j, k in enumerate(self.pass_ks)}
