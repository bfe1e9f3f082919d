"""MetricsSinks: JSONL, offline W&B (read back from its transaction log) and no-op workers.

Starts three offline W&B runs in total (about 0.5 s for the first, much less after).
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # jax scalars only; never probe for a TPU

import jax.numpy as jnp
import numpy as np
import pytest

from runtime.metrics_sinks import JSONL_NAME, MetricsSinks, human_line

try:
    from wandb_offline import read_offline_runs  # tests/ on sys.path (rootdir-style tests)
except ImportError:  # tests/ imported as a package
    from tests.wandb_offline import read_offline_runs


@pytest.fixture(autouse=True)
def _isolated_wandb_env(monkeypatch, tmp_path_factory):
    # A WANDB_* variable from the developer's shell or CI must not change the run under test,
    # and W&B's own config/cache must not land in the home directory.
    for var in [v for v in os.environ if v.startswith("WANDB_")]:
        monkeypatch.delenv(var)
    home = tmp_path_factory.mktemp("wandb_home")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / "config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(home / "cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(home / "data"))


def make_sinks(output_dir, *, mode="offline", is_primary=True, start_step=0, config=None,
               total_steps=10, **options):
    return MetricsSinks(
        is_primary=is_primary,
        output_dir=output_dir,
        wandb_mode=mode,
        wandb_project="podrunner-tests",
        wandb_entity=None,
        group="sweep-a",
        name="trm-seed0",
        run_id="runid0123",
        config=config if config is not None else {"model": {"depth": 2}, "lr": 3e-4},
        total_steps=total_steps,
        start_step=start_step,
        tags=["test"],
        **options,
    )


def strict_json_lines(path):
    def reject(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    with open(path, encoding="utf-8") as f:
        return [json.loads(line, parse_constant=reject) for line in f]


def user_keys(row):
    return {k: v for k, v in row.items() if not k.startswith("_")}


def test_offline_run_round_trip(tmp_path, capsys):
    config = {"model": {"depth": 2, "hidden": 64}, "lr": 3e-4, "data": ["a", "b"]}
    logged = {
        0: {"train/loss": jnp.float32(2.5), "train/lr": np.float64(1e-4), "train/tokens": np.int32(7)},
        1: {"train/loss": 2.0, "train/lr": 2e-4, "train/examples_per_sec": 1234.5},
        2: {"train/loss": float("nan"), "eval/exact_accuracy": jnp.asarray(0.25)},
    }
    manifest = tmp_path / "run_manifest.json"
    manifest.write_text('{"git": "abc"}')
    out = tmp_path / "out"

    sinks = make_sinks(out, config=config)
    for step, metrics in logged.items():
        sinks.log(step, metrics)
        # Flushed per call: a crash or preemption must not lose rows already logged.
        assert len(strict_json_lines(out / JSONL_NAME)) == step + 1
    sinks.set_summary({"eval/exact_accuracy": np.float32(0.25), "final/status": "ok"})
    sinks.save_file(manifest)
    sinks.close(exit_code=0)
    sinks.close(exit_code=3)  # idempotent: must not finish twice or change the exit code
    import wandb

    wandb.teardown()  # the W&B service writes the offline log asynchronously: let it finish before reading

    # JSONL: one strict-JSON row per log call, jax/numpy scalars as Python numbers, NaN as "nan".
    rows = strict_json_lines(out / JSONL_NAME)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(isinstance(r["time"], float) for r in rows)
    assert {k: v for k, v in rows[0].items() if k not in ("step", "time")} == {
        "train/loss": 2.5, "train/lr": 1e-4, "train/tokens": 7}
    assert isinstance(rows[0]["train/tokens"], int)
    assert rows[2]["train/loss"] == "nan" and rows[2]["eval/exact_accuracy"] == 0.25

    # W&B: the offline transaction log holds exactly what was logged.
    (run,) = read_offline_runs(out)
    assert (run.run_id, run.group, run.name, run.project) == (
        "runid0123", "sweep-a", "trm-seed0", "podrunner-tests")
    assert run.tags == ["test"]
    assert run.config == config
    assert [r["_step"] for r in run.history] == [0, 1, 2]
    assert user_keys(run.history[0]) == {"train/loss": 2.5, "train/lr": 1e-4, "train/tokens": 7}
    assert user_keys(run.history[1]) == {
        "train/loss": 2.0, "train/lr": 2e-4, "train/examples_per_sec": 1234.5}
    assert math.isnan(run.history[2]["train/loss"])  # W&B keeps the real NaN
    assert run.history[2]["eval/exact_accuracy"] == 0.25
    assert run.summary["eval/exact_accuracy"] == 0.25
    assert run.summary["final/status"] == "ok"
    assert "run_manifest.json" in run.files
    assert (run.path / "files" / "run_manifest.json").read_text() == '{"git": "abc"}'
    assert run.exit_code == 0

    # Off a terminal (pytest captures it): one human line per row on stdout, no bar on stderr.
    captured = capsys.readouterr()
    assert captured.out.splitlines() == ["step 0/10  loss 2.5", "step 1/10  loss 2",
                                         "step 2/10  loss nan  exact_accuracy 0.25"]
    assert "step" not in captured.err


def test_a_row_is_one_human_line_under_100_columns():
    values = {"train/loss": 1.23456, "perf/steps_per_sec": 25.0, "perf/examples_per_sec": 400.0,
              "perf/mfu": 0.123, "train/lr": 1e-4}
    line = human_line(120, 200, values, ("eval/exact_accuracy", 0.512))
    assert line == "step 120/200  loss 1.2346  exact_accuracy 0.512  0.04 s/step  400 ex/s  MFU 12.3%  ETA 0:03"
    slow = human_line(10, 1_000_000, {"train/loss": 1e6, "perf/steps_per_sec": 0.01, "perf/examples_per_sec": 0.5,
                                      "perf/mfu": 0.5}, ("eval/token_accuracy", 0.123456))
    assert len(slow) < 100 and slow.endswith("100 s/step  0.5 ex/s  MFU 50.0%  ETA 1157d09h"), slow  # 999,990 x 100 s
    assert human_line(3, 3, {"train/loss": 0.5, "perf/steps_per_sec": 2.0}, None) == "step 3/3  loss 0.5  0.5 s/step"


def test_resume_appends_and_keeps_run_id(tmp_path):
    # 400 rows make the first transaction log span several 32 KiB blocks, so the reader's
    # block-boundary path (records split FIRST/MIDDLE/LAST) is exercised too.
    out, split, total = tmp_path / "out", 400, 405
    first = make_sinks(out, total_steps=total)
    for step in range(split):
        first.log(step, {"train/loss": 1.0 / (step + 1), "train/lr": step * 1e-6})
    first.close(exit_code=1)  # e.g. preempted

    second = make_sinks(out, start_step=split, total_steps=total)
    for step in range(split, total):
        second.log(step, {"train/loss": 1.0 / (step + 1), "train/lr": step * 1e-6})
    second.close()
    import wandb

    wandb.teardown()  # flush the offline logs before reading them

    rows = strict_json_lines(out / JSONL_NAME)
    assert [r["step"] for r in rows] == list(range(total))  # appended, not truncated
    assert [r["train/loss"] for r in rows] == [1.0 / (s + 1) for s in range(total)]

    runs = read_offline_runs(out)
    assert [r.run_id for r in runs] == ["runid0123", "runid0123"]
    assert runs[0].path != runs[1].path  # offline: each resume is its own run directory
    assert next(runs[0].path.glob("run-*.wandb")).stat().st_size > 2 * 32768
    assert [[h["_step"] for h in r.history] for r in runs] == [
        list(range(split)), list(range(split, total))]
    assert [h["train/loss"] for r in runs for h in r.history] == [
        1.0 / (s + 1) for s in range(total)]
    assert [r.exit_code for r in runs] == [1, 0]


def test_system_metrics_console_and_commit(tmp_path, monkeypatch):
    """Process 0's run carries W&B's system metrics, the console (our log lines as written, and
    nothing once the run is closed: the `error:` line comes after) and the code's commit; each
    part off when configured off."""
    # wandb-core samples every 15 s by default (and once more as the run finishes, which a busy
    # machine may cut short): this run samples every 0.1 s and stays open for 2 s, so that it holds
    # samples whatever the load. The time is what sampling needs, not a wait for another process.
    monkeypatch.setenv("WANDB_X_STATS_SAMPLING_INTERVAL", "0.1")
    commit = "0123abcd" * 5
    log = logging.getLogger("runtime.test_console")
    handler = logging.StreamHandler()  # sys.stderr, as the trainer's logging.basicConfig
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        for name, options in [("on", dict(git_commit=commit)), ("off", dict(system_metrics=False, console="off"))]:
            sinks = make_sinks(tmp_path / name, **options)
            opened = time.monotonic()
            for step in range(3):
                sinks.log(step, {"train/loss": 1.0 / (step + 1)})
                log.info("%s: log line at step %d", name, step)
            print(f"{name}: a line on stdout")
            if name == "on":
                time.sleep(max(0.0, 2.0 - (time.monotonic() - opened)))
            sinks.close()
            print(f"error: {name}: after the run", file=sys.stderr)
    finally:
        log.removeHandler(handler)
    import wandb

    wandb.teardown()  # flush the offline logs before reading them

    (on,) = read_offline_runs(tmp_path / "on")
    assert on.git_commit == commit
    assert on.stats and all(0 <= s["memory_percent"] <= 100 for s in on.stats)
    console = (on.path / "files" / "output.log").read_text()
    assert [f"on: log line at step {step}" in console for step in range(3)] == [True] * 3
    assert "on: a line on stdout" in console and "error:" not in console

    (off,) = read_offline_runs(tmp_path / "off")
    assert (off.git_commit, off.stats) == ("", [])
    assert not (off.path / "files" / "output.log").exists()
    assert [h["train/loss"] for h in off.history] == [1.0, 0.5, 1 / 3]


def test_non_primary_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    manifest = tmp_path / "manifest.json"
    manifest.write_text("{}")
    for mode in ("offline", "online"):  # "online" must not even try to reach W&B
        sinks = make_sinks(out, mode=mode, is_primary=False)
        sinks.log(0, {"train/loss": 1.0})
        sinks.set_summary({"eval/exact_accuracy": 1.0})
        sinks.save_file(manifest)
        sinks.close()
    assert list(out.iterdir()) == []
    assert capsys.readouterr() == ("", "")  # no progress bar on other workers


def test_disabled_mode_writes_only_jsonl(tmp_path):
    out = tmp_path / "out"
    with make_sinks(out, mode="disabled") as sinks:
        sinks.log(0, {"train/loss": 1.0})
        sinks.set_summary({"eval/exact_accuracy": 1.0})
        sinks.save_file(__file__)
    assert sorted(p.name for p in out.iterdir()) == [JSONL_NAME]
    assert [r["step"] for r in strict_json_lines(out / JSONL_NAME)] == [0]


def test_non_finite_values_are_strict_json(tmp_path):
    out = tmp_path / "out"
    with make_sinks(out, mode="disabled") as sinks:
        sinks.log(5, {
            "a": float("nan"), "b": float("inf"), "c": -math.inf,
            "d": np.float32("nan"), "e": jnp.asarray(jnp.inf), "f": 1.5,
        })
    (row,) = strict_json_lines(out / JSONL_NAME)
    assert {k: row[k] for k in "abcdef"} == {
        "a": "nan", "b": "inf", "c": "-inf", "d": "nan", "e": "inf", "f": 1.5}
    assert math.isnan(float(row["a"])) and float(row["c"]) == -math.inf  # round-trips


def test_rejects_non_scalar_metrics(tmp_path):
    with make_sinks(tmp_path, mode="disabled") as sinks:
        with pytest.raises(ValueError, match="scalar"):
            sinks.log(0, {"train/loss": np.ones(3)})
        with pytest.raises(ValueError, match="reserved"):
            sinks.log(0, {"step": 1})


def test_jsonl_holds_whole_lines_only(tmp_path, monkeypatch):
    """A torn last line (an old writer's crash) is dropped on open; a row whose write fails
    half-way (the disk filled up) is cut back, and the failure is one line (exit 6)."""
    from runtime.errors import OutputDirError

    out = tmp_path / "out"
    out.mkdir()
    (out / JSONL_NAME).write_text('{"step": 1}\n{"step": 2, "train/lo')
    with make_sinks(out, mode="disabled") as sinks:
        assert (out / JSONL_NAME).read_text() == '{"step": 1}\n'
        sinks.log(2, {"train/loss": 1.0})
        real_write = os.write

        def short_then_full(fd, data):
            if len(data) > 10:
                return real_write(fd, bytes(data[:10]))
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "write", short_then_full)
        with pytest.raises(OutputDirError, match=r"metrics.jsonl at step 3 \(no space left on device\); free space"):
            sinks.log(3, {"train/loss": 0.5})
        monkeypatch.undo()
    assert [r["step"] for r in strict_json_lines(out / JSONL_NAME)] == [1, 2]


def test_wandb_killed_mid_run_is_one_warning_and_metrics_go_on(tmp_path, caplog):
    """A VM shutdown signals every process, W&B's service (wandb-core, a session of its own) too: the
    next log must not fail the run (it failed with "Connection lost"), and metrics.jsonl goes on."""
    import signal

    from helpers import pid_alive, wait_for

    sinks = make_sinks(tmp_path, progress_bar=False)
    sinks.log(1, {"train/loss": 1.0})
    service = wandb_core()
    os.kill(service, signal.SIGTERM)
    wait_for(lambda: not pid_alive(service), timeout=30, what="wandb-core to end")
    with caplog.at_level(logging.WARNING, logger="runtime.metrics_sinks"):
        for step in (2, 3):
            sinks.log(step, {"train/loss": float(step)})
        sinks.set_summary({"train/loss": 3.0})
        sinks.close(0)
    warnings = [r.getMessage() for r in caplog.records if "W&B stopped working" in r.getMessage()]
    assert len(warnings) == 1 and "metrics.jsonl goes on" in warnings[0], caplog.text
    assert [r["step"] for r in strict_json_lines(tmp_path / JSONL_NAME)] == [1, 2, 3]


def test_run_files_go_beside_the_checkpoints_and_come_back_on_a_fresh_disk(tmp_path):
    """metrics.jsonl, events.jsonl and W&B's files are copied beside the checkpoints; a disk without
    them (a re-created VM) gets them back, the metrics cut at the step the run resumes from."""
    from runtime.run_files import RunFiles

    out, ckpt = tmp_path / "out", tmp_path / "bucket" / "ckpt"
    out.mkdir()
    (out / JSONL_NAME).write_text("".join(json.dumps({"step": s, "train/loss": 1.0 / s}) + "\n" for s in range(1, 11)))
    (out / "events.jsonl").write_text('{"event": "checkpoint", "step": 6}\n')
    (out / "wandb" / "offline-run-x" / "files").mkdir(parents=True)
    (out / "wandb" / "offline-run-x" / "run-x.wandb").write_bytes(b"\0wandb")
    RunFiles(str(out), str(ckpt)).flush()
    fresh = tmp_path / "fresh"
    RunFiles(str(fresh), str(ckpt)).restore(6)
    assert [r["step"] for r in strict_json_lines(fresh / JSONL_NAME)] == [1, 2, 3, 4, 5, 6]
    assert (fresh / "events.jsonl").read_text() == (out / "events.jsonl").read_text()
    assert (fresh / "wandb" / "offline-run-x" / "run-x.wandb").read_bytes() == b"\0wandb"
    RunFiles(str(out), str(ckpt)).restore(6)  # a disk that has its metrics keeps them
    assert len(strict_json_lines(out / JSONL_NAME)) == 10


def wandb_core() -> int:
    """The pid of this process's W&B service (wandb-core, a child of ours in a session of its own)."""
    for entry in os.listdir("/proc"):
        try:
            ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            if ppid == os.getpid() and b"wandb-core" in open(f"/proc/{entry}/cmdline", "rb").read():
                return int(entry)
        except (OSError, ValueError, IndexError):
            continue
    raise AssertionError("no wandb-core child process")
