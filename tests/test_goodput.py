"""Where a run's time goes and what it costs: the time account by category (runtime/goodput.py,
with an injected clock), the persistent compilation cache (runtime/compile_cache.py), the
evaluation protocol (a seeded subset of whole units between the whole set at the end) and the
time-based checkpoint cadence; then one run stopped and resumed end to end."""

from __future__ import annotations

import json
import math
import shutil

import jax
import numpy as np
import pytest

from helpers import base_overrides, compose_config, read_jsonl, saved_steps, train, train_losses
from data_pipeline.arc_eval import ARCEvaluator
from data_pipeline.batching import capped_units, eval_subset_rows
from data_pipeline.build_arc import grid_to_tokens
from data_pipeline.kinds.arc import ArcVoting
from runtime import compile_cache, goodput
from runtime.checkpointing import SaveClock
from runtime.config import derive
from runtime.data_feed import BatchFeeder, EvalSelection
from runtime.errors import UserError
from runtime.evaluation import binomial_stderr, subset_figures
from runtime.goodput import CATEGORIES, Timing
from runtime.sharding import batch_sharding, make_mesh


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float) -> None:
        self.now += seconds


# ------------------------------------------------------------------------------ the account


def test_each_category_is_counted_once_and_they_add_up_to_the_wall_time():
    clock = Clock()
    t = Timing(clock=clock, started=990.0, cache_counts=lambda: (0, 0))  # the process began 10 s ago
    with t.measure("runtime_startup", since=t.started):
        clock.tick(2)
    with t.measure("data_loading"):
        clock.tick(3)
    clock.tick(1)  # measured by nothing: other
    with t.measure("train"):
        clock.tick(4)
        with t.measure("data_loading"):  # a batch the loop waited for: not train time
            clock.tick(0.5)
        t.compiled(clock.now, clock.now + 6)  # a compile inside the loop (a curriculum stage)
        clock.tick(6)
        with t.measure("eval"):
            clock.tick(1.5)
            t.compiled(clock.now, clock.now + 2)  # the eval step's first compile is not evaluation
            clock.tick(2)
        with t.measure("checkpoint_save"):
            clock.tick(0.25)
        with t.measure("other"):  # a log row
            clock.tick(0.75)
        t.step_done(1)
    with t.measure("checkpoint_restore"):
        clock.tick(1)
    seconds = t.snapshot()
    assert list(seconds) == list(CATEGORIES)
    assert seconds == {"runtime_startup": 12.0, "data_loading": 3.5, "program_startup": 8.0, "checkpoint_save": 0.25,
                       "checkpoint_restore": 1.0, "eval": 1.5, "train": 4.0, "other": 1.75}
    assert sum(seconds.values()) == pytest.approx(clock.now - 990.0)
    assert (t.step, t.steps_run) == (1, 1)


def test_nested_compile_spans_count_once_and_open_blocks_count_up_to_now():
    clock = Clock(0.0)
    t = Timing(clock=clock, started=0.0, cache_counts=lambda: (0, 0))
    t.compiled(1.0, 2.0)  # an inner jit traced inside the outer one ends first...
    t.compiled(3.0, 3.5)
    t.compiled(0.5, 4.0)  # ...then the outer trace, which holds both
    t.compiled(5.0, 6.0)  # a later one of its own
    clock.tick(7.0)
    assert t.snapshot()["program_startup"] == pytest.approx(4.5)
    with t.measure("train"):
        clock.tick(2.0)
        with t.measure("checkpoint_save"):
            clock.tick(1.0)
            seconds = t.snapshot()  # a `checkpoint` commit's event, inside the save that waits for it
    assert (seconds["train"], seconds["checkpoint_save"]) == (2.0, 1.0)
    assert sum(seconds.values()) == pytest.approx(10.0)
    assert t.snapshot() == seconds  # the same account once the blocks closed


def test_the_timing_event_and_the_totals(monkeypatch):
    clock, counts = Clock(100.0), [3, 5]
    t = Timing(clock=clock, started=100.0, cache_counts=lambda: tuple(counts))
    counts[:] = [7, 6]  # this run: 4 hits, 1 miss (the process had counted some before it)
    with t.measure("train"):
        clock.tick(6)
    with t.measure("eval"):
        clock.tick(2)
    clock.tick(2)
    emitted = []
    monkeypatch.setattr(goodput.events, "emit", lambda event, **fields: emitted.append((event, fields)))
    t.emit()
    assert emitted == []  # not before the run's event stream is attached
    t.live = True
    t.emit()
    t.finish()
    t.finish()  # the last account is said once
    assert len(emitted) == 2 and emitted[0][0] == "timing"
    record = emitted[-1][1]
    assert (record["hits"], record["misses"], record["wall"]) == (4, 1, 10.0)
    assert record["seconds"]["other"] == 2.0
    totals = t.totals()
    assert totals["time/goodput"] == pytest.approx(0.8)  # train and eval: the productive time
    assert (totals["time/wall_s"], totals["time/train_s"], totals["time/compile_cache_hits"]) == (10.0, 6.0, 4)


def test_process_start_is_before_now():
    started = goodput.process_start()
    assert started is not None and started <= goodput.time.time()


# ------------------------------------------------------------------------------ the cache


def test_the_cache_folder_a_run_uses(tmp_path):
    assert compile_cache.resolve(None, "gs://b/runs/x", "outputs")[0] is None
    assert compile_cache.resolve(str(tmp_path / "c"), "gs://b/runs/x", "outputs")[0] == str(tmp_path / "c")
    assert compile_cache.resolve("gs://other/cache", "ckpt", "outputs")[0] == "gs://other/cache"
    own = jax.config.jax_compilation_cache_dir  # the test session's cache (conftest.py)
    assert own and compile_cache.resolve("auto", "gs://b/runs/x", str(tmp_path))[0] == own
    jax.config.update("jax_compilation_cache_dir", None)  # a process without one (nothing compiles meanwhile)
    try:
        assert compile_cache.resolve("auto", "gs://bkt/runs/exp01/a", "outputs")[0] == "gs://bkt/compile_cache"
        assert compile_cache.resolve("auto", str(tmp_path / "ckpt"), str(tmp_path))[0] == str(tmp_path / "compile_cache")
    finally:
        jax.config.update("jax_compilation_cache_dir", own)


def test_a_run_puts_the_process_cache_back(tmp_path):
    own = jax.config.jax_compilation_cache_dir
    with compile_cache.configured(str(tmp_path / "mine"), "ckpt", "outputs") as path:
        assert jax.config.jax_compilation_cache_dir == path == str(tmp_path / "mine") and (tmp_path / "mine").is_dir()
    assert jax.config.jax_compilation_cache_dir == own
    with compile_cache.configured(None, "ckpt", "outputs") as path:
        assert path is None and not jax.config.jax_enable_compilation_cache
    assert jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir == own
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match=r"^run.compile_cache: cannot create the folder .*file/c .*run.compile_cache=null"):
        with compile_cache.configured(str(tmp_path / "file" / "c"), "ckpt", "outputs"):
            pass
    assert jax.config.jax_compilation_cache_dir == own


@pytest.mark.parametrize("key", ["run.compile_cache", "run.executables"])
@pytest.mark.parametrize("value, needle", [("", "it is empty (null turns it off)"), ("~/cache", "'~' is not expanded"),
                                           ("s3://b/c", "it can be a local folder or on gs:// only"),
                                           ("gs:///c", "it names no bucket")])
def test_a_bad_cache_setting_is_one_line(key, value, needle):
    with pytest.raises(UserError) as e:
        compose_config([f"{key}='{value}'"])
    assert str(e.value).startswith(f"{key}={value!r}: {needle}; ") and "\n" not in str(e.value)


# ------------------------------------------------------------------------------ evaluation


def test_the_subset_keeps_units_whole_and_is_the_same_every_time():
    offsets = np.array([0, 3, 4, 8, 9, 12, 13, 20])  # 7 units of 3, 1, 4, 1, 3, 1, 7 rows
    rows, units = eval_subset_rows(offsets, 3)
    again, _ = eval_subset_rows(offsets, 3)
    assert units == 3 and np.array_equal(rows, again) and np.all(np.diff(rows) > 0)
    starts = set(offsets[:-1].tolist())
    chosen = [u for u in range(7) if offsets[u] in rows]
    assert len(chosen) == 3 and rows.tolist() == [r for u in chosen for r in range(offsets[u], offsets[u + 1])]
    assert starts & set(rows.tolist()) == {offsets[u] for u in chosen}
    assert eval_subset_rows(offsets, 7)[0].tolist() == list(range(20))  # as many as there are: all of them
    spread, _ = eval_subset_rows(np.arange(10_001), 100)  # drawn over the whole set (it may be ordered), by the seed
    assert spread.min() < 1000 and spread.max() > 9000
    assert not np.array_equal(spread, eval_subset_rows(np.arange(10_001), 100, seed=1)[0])
    assert eval_subset_rows(offsets, None)[1] == 7
    assert capped_units(offsets, 10).tolist() == [0, 3, 4, 8, 9, 10]  # data.eval_max_examples=10: the last unit cut
    assert capped_units(None, 3).tolist() == [0, 1, 2, 3]  # each row a unit


def test_the_feeder_reads_the_subset_in_padded_batches():
    mesh = make_mesh({"data": 4, "fsdp": 1, "tensor": 1}, jax.devices()[:4])
    feeder = BatchFeeder(_Rows(40), batch_sharding(mesh, 1), 8, 0, prefetch=False, units=np.arange(0, 41, 2))  # 20 x 2 rows
    subset = feeder.eval_selection(None, 5)
    assert (subset.units, subset.whole, subset.rows.size) == (5, False, 10) and feeder.eval_selection(None, 5) is subset
    assert all(r % 2 == 0 and r + 1 in subset.rows for r in subset.rows[::2])  # whole puzzles
    batches = [{k: np.asarray(v) for k, v in b.items()} for b in feeder.eval_batches(None, 5)]
    assert len(batches) == 2  # 10 rows in batches of 8, the second padded
    labels = np.concatenate([b["labels"][:, 0] for b in batches])
    assert labels[labels != -100].tolist() == subset.rows.tolist() and (labels == -100).sum() == 6
    whole = feeder.eval_selection(None, 50)
    assert whole.whole and whole.units == 20 and feeder.eval_count(None, 50) == (40, 5)


class _Rows:
    """A split whose row i holds i."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def rows(self, idx):
        idx = np.asarray(idx)
        return {"inputs": np.repeat(idx[:, None], 3, 1).astype(np.int32), "labels": np.repeat(idx[:, None], 3, 1).astype(np.int32)}


def test_standard_errors_of_a_subset():
    assert binomial_stderr(0.87, 8192) == pytest.approx(0.0037, abs=5e-5)  # the example: about +-0.4%
    one = {"": EvalSelection(np.arange(100), 100, False)}
    figures = subset_figures({"eval_subset/exact_accuracy": 0.5, "eval_subset/loss": 1.0, "eval_subset/ARC/pass@2": 0.2}, one)
    assert figures == {"eval_subset/units": 100, "eval_subset/examples": 100, "eval_subset/exact_accuracy_stderr": 0.05,
                       "eval_subset/ARC/pass@2_stderr": pytest.approx(0.04)}
    tasks = {"sudoku/": EvalSelection(np.arange(400), 400, False), "maze/": EvalSelection(np.arange(50), 100, False)}
    metrics = {"eval_subset/sudoku/exact_accuracy": 0.5, "eval_subset/maze/exact_accuracy": 0.5, "eval_subset/exact_accuracy": 0.5}
    figures = subset_figures(metrics, tasks)
    assert figures["eval_subset/sudoku/exact_accuracy_stderr"] == 0.025
    assert figures["eval_subset/maze/exact_accuracy_stderr"] == 0.05
    assert figures["eval_subset/exact_accuracy_stderr"] == pytest.approx(math.hypot(0.025, 0.05) / 2)  # a mean of two
    assert (figures["eval_subset/units"], figures["eval_subset/examples"]) == (500, 450)


def test_arc_voting_on_a_subset_scores_the_puzzles_it_evaluated(tmp_path):
    grid = np.array([[1, 2], [3, 4]], np.uint8)
    tests = {name: {"train": [], "test": [{"input": grid.tolist(), "output": grid.tolist()}]} for name in ("a", "b")}
    voting = ArcVoting(ARCEvaluator(["<blank>", "a", "b"], tests), str(tmp_path / "submission.json"))
    tokens = grid_to_tokens(grid)[None]
    voting.start()
    voting.arc.update(tokens, tokens, np.array([1]), np.array([3.0]))  # puzzle a solved; b not in the subset
    voting.seen = {"a"}
    assert voting.finish(None)["ARC/pass@1"] == 1.0 and not (tmp_path / "submission.json").exists()
    voting.start()
    voting.arc.update(tokens, tokens, np.array([1]), np.array([3.0]))
    voting.seen = {"a", "b"}  # the whole set: b evaluated and not solved
    assert voting.finish(None)["ARC/pass@1"] == 0.5 and (tmp_path / "submission.json").exists()


def test_the_eval_batch_size_divides_over_the_batch_devices():
    config = compose_config(["train.eval_batch_size=12", "train.global_batch_size=16"])
    with pytest.raises(UserError, match=r"^train.eval_batch_size=12 does not divide over data x fsdp = 8 devices"):
        derive(config, num_processes=1, num_devices=8, train_examples=1000)
    assert derive(compose_config(["train.eval_batch_size=64"]), num_processes=2, num_devices=8,
                  train_examples=1000).eval_batch_size == 64
    assert derive(compose_config([]), num_processes=1, num_devices=8, train_examples=1000).eval_batch_size == 64


# ------------------------------------------------------------------------------ time-based saves


def test_saves_by_time_are_decided_by_process_0_for_all():
    clock = Clock(0.0)
    saves = SaveClock(2.0, clock=clock, agree=lambda mine: mine)
    clock.tick(119)
    assert not saves.due()
    clock.tick(1)
    assert saves.due()
    saves.saved()
    assert not saves.due()
    assert not SaveClock(None, clock=clock).due()

    # Two processes whose clocks differ: both take process 0's answer (a broadcast at log rows).
    clocks = [Clock(0.0), Clock(0.0)]
    answers: list[bool] = []

    def broadcast(process: int):
        def agree(mine: bool) -> bool:
            if process == 0:
                answers.append(mine)
            return answers[-1]
        return agree

    procs = [SaveClock(1.0, clock=c, agree=broadcast(i)) for i, c in enumerate(clocks)]
    clocks[0].tick(59)
    clocks[1].tick(61)  # process 1's clock runs ahead: alone it would save now
    assert [p.due() for p in procs] == [False, False]
    clocks[0].tick(2)
    clocks[1].tick(0)
    assert [p.due() for p in procs] == [True, True]


# ------------------------------------------------------------------------------ end to end


@pytest.mark.slow
@pytest.mark.devices(1)  # the account and the cache, not the mesh
def test_a_resume_hits_the_cache_and_every_start_accounts_its_time(sudoku_dir, tmp_path):
    from wandb_offline import read_offline_runs

    out = tmp_path / "test" / "t"
    overrides = base_overrides(sudoku_dir, tmp_path, steps=8, wandb="offline") + [
        f"run.compile_cache={tmp_path / 'cache'}", "train.log_every=2", "train.checkpoint_every=4", "train.eval_every=4",
        "train.eval_subset=8", "train.eval_batch_size=32", "train.checkpoint_every_minutes=1e-9", "optim.ema_rate=0.9"]
    train(overrides)
    assert saved_steps(out / "checkpoints") == [4, 6, 8]  # 6: by time (at a log row), 2 too (keep=3 dropped it)
    first = train_losses(out)
    for step in (6, 8):  # as if the first start had been preempted after step 4's commit
        shutil.rmtree(out / "checkpoints" / str(step))
    assert "resumed from step 4" in train(overrides).log
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows if "train/loss" in r] == [2, 4, 6, 8, 6, 8]  # log rows; the resume's from step 5
    assert train_losses(out) == first  # its own (the last of each step) are the first start's: the subset
    # evaluations and the time-based saves change no number

    subset = next(r for r in rows if "eval_subset/exact_accuracy" in r)
    assert subset["step"] == 4 and subset["eval_subset/units"] == 8 and "eval_subset/exact_accuracy_stderr" in subset
    assert not any("eval/loss" in r for r in rows if r["step"] != 8)  # the whole set only at the end
    whole = [r for r in rows if "eval/exact_accuracy" in r]
    assert [r["step"] for r in whole] == [8, 8] and not any("eval_subset/units" in r for r in whole)

    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    starts = [i for i, e in enumerate(events) if e["event"] == "started"]
    runs = [events[starts[0]:starts[1]], events[starts[1]:]]
    last = [[e for e in run if e["event"] == "timing"][-1] for run in runs]
    for record in last:
        assert list(record["seconds"]) == list(CATEGORIES)
        assert sum(record["seconds"].values()) == pytest.approx(record["wall"], abs=0.01)
    assert {2, 4, 6, 8} <= {e["step"] for e in runs[0] if e["event"] == "timing"}  # every log row
    assert all(runs[0][i - 1]["event"] == "timing" for i, e in enumerate(runs[0]) if e["event"] == "checkpoint")  # commits
    (a, b) = last
    assert (a["step"], a["steps_run"], b["step"], b["steps_run"]) == (8, 8, 8, 4)
    assert a["hits"] == 0 and a["misses"] > 0  # a fresh cache
    # The resume finds its programs (the event: the cache's own hit and miss counts, not how long
    # the start-up took, which depends on the machine's load).
    assert b["hits"] > 0 and b["misses"] < a["misses"]
    for category in ("data_loading", "program_startup", "checkpoint_save", "eval", "train", "other"):
        assert a["seconds"][category] > 0, category
    assert any((tmp_path / "cache").iterdir())  # the run's own cache, not the test session's
    assert b["seconds"]["checkpoint_restore"] > 0 and a["seconds"]["checkpoint_restore"] == 0
    assert a["saves"] == 4  # steps 2, 4, 6, 8

    manifest = json.loads((out / "run_manifest.json").read_text())
    summary = read_offline_runs(out)[-1].summary
    for totals in (manifest["final_metrics"], summary):
        assert totals["time/wall_s"] == pytest.approx(b["wall"], abs=0.5)
        assert totals["time/goodput"] == pytest.approx((totals["time/train_s"] + totals["time/eval_s"]) / totals["time/wall_s"])
        assert totals["time/compile_cache_hits"] == b["hits"]
    assert jax.config.jax_compilation_cache_dir != str(tmp_path / "cache")  # the session's own cache is back
