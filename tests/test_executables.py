"""Steps compiled ahead (runtime/executables.py): what `plan --executables` keeps, a run reads
instead of compiling; anything else (another program, a damaged file) is a compile, and the run's
numbers are the same either way. The plan's side runs here on this process's CPU devices, the
run's "topology"; on a pod it is the slice's TPU topology (the same code, `plan._build`)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import jax
import pytest

from experiments import plan
from helpers import base_overrides, train, train_losses
from runtime import executables

EXPERIMENT = ("example", "small")


@pytest.fixture
def cpu_topology(monkeypatch):
    """`plan._build` for the name "cpu": this process's devices, one host."""
    real = plan._topology
    monkeypatch.setattr(plan, "_topology", lambda name: (None, jax.devices(), 1) if name == "cpu" else real(name))


def test_a_run_reads_the_steps_the_plan_kept_and_trains_the_same(sudoku_dir, tmp_path, cpu_topology):
    folder = tmp_path / "ahead"
    common = base_overrides(sudoku_dir, tmp_path / "runs", steps=4)
    run = ["+experiment=example/small", *common]
    compiled = train([*run, "run.name=compiled"])  # first: JAX's persistent cache now holds both programs

    job = plan.Job(*EXPERIMENT, tuple(common))
    assert plan.keep_job(job, "cpu", str(folder), plan.TRAIN) and plan.keep_job(job, "cpu", str(folder), plan.EVAL)
    kept = sorted(folder.glob(f"*{executables.SUFFIX}"))
    assert len(kept) == 2
    assert plan.keep_job(job, "cpu", str(folder), plan.TRAIN) and len(list(folder.iterdir())) == 2  # kept already

    ahead = train([*run, "run.name=ahead", f"run.executables={folder}"])
    assert compiled.code == 0 and ahead.code == 0
    assert sum("loaded the executable compiled ahead" in line for line in ahead.log.splitlines()) == 2, ahead.log
    assert "compiled ahead" not in compiled.log
    assert train_losses(tmp_path / "runs" / "test" / "ahead") == train_losses(tmp_path / "runs" / "test" / "compiled")

    # A damaged file is a warning and a compile; a program with no file (the other's key) a compile
    # said as such; the same numbers either way.
    kept[0].write_bytes(b"not an executable")
    kept[1].rename(kept[1].with_name("another-program" + executables.SUFFIX))
    damaged = train([*run, "run.name=damaged", f"run.executables={folder}"])
    assert damaged.code == 0 and damaged.log.count("does not load") == 1, damaged.log
    assert damaged.log.count("no executable compiled ahead") == 1, damaged.log
    assert train_losses(tmp_path / "runs" / "test" / "damaged") == train_losses(tmp_path / "runs" / "test" / "compiled")


def test_the_key_is_the_program_its_devices_and_the_compilers_flags(monkeypatch):
    devices = jax.devices()
    key = executables.program_key("module", devices)
    assert executables.program_key("module", devices) == key
    assert executables.program_key("module 2", devices) != key
    assert executables.program_key("module", devices[::-1]) != key  # an executable is bound to its devices' order
    one_host = [SimpleNamespace(platform="tpu", device_kind="TPU v4", id=i, process_index=0) for i in range(8)]
    two_hosts = [SimpleNamespace(platform="tpu", device_kind="TPU v4", id=i, process_index=i // 4) for i in range(8)]
    assert executables.program_key("module", one_host) != executables.program_key("module", two_hosts)
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_some_flag=true")
    assert executables.program_key("module", devices) != key


def test_plan_prices_a_step_kept_ahead_as_a_read():
    from experiments import bill

    v = bill.Variant(steps=1000, step_s=0.1, evaluations=2, eval_step_s=0.05, eval_batches=1, final_eval_batches=2,
                     compile_train_s=90.0, compile_eval_s=30.0)
    hit = bill.FIGURES["compile_cache_hit"].seconds
    cold = bill.price(v, bill.FIGURES, mtbf_s=8 * 3600)
    ahead = bill.price(dataclasses.replace(v, train_ahead=True, eval_ahead=True), bill.FIGURES, mtbf_s=8 * 3600)
    assert cold.seconds["program_startup"] == pytest.approx((90 + 30) * (1 + cold.preemptions))
    assert ahead.seconds["program_startup"] == pytest.approx(2 * hit * (1 + ahead.preemptions))

