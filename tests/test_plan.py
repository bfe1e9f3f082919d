"""`launch.py plan`: fits, estimated step time and the whole bill of a group at full scale, from
train and eval steps compiled for a TPU topology (libtpu's compile-only devices), cached by their
HLO; the bill's formulas (experiments/plan/bill.py) on small made-up inputs, its calibration from a
ledger the test writes, the CSV the queue reads; and the pieces of the estimate
(runtime/compile_only.py) on hand-written HLO (loops, collectives in them and custom kernels:
test_hlo_cost.py)."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import re
import threading
from pathlib import Path

import pytest

from experiments.plan import bill, calibrate, planner, price, report
from experiments.plan.bill import Program, Start
from experiments.compose import compose
from experiments.launcher.account import launch_timing
from experiments.launcher.ledger import (LaunchRecord, LaunchTiming, Ledger, Outcome, SliceRecord, SupervisionRecord,
                                         VariantRecord, VariantState, to_text)
from experiments.launcher.queue_state import read_plan, with_executables
from helpers import launch_in_process
from runtime.compile_only import TOPOLOGIES, CompiledStep, StepEstimate, estimate_step, optimal_seconds, wire_bytes
from runtime.config import derive, validate
from runtime import executables
from runtime.errors import UserError
from runtime.goodput import Category

V1 = Path(__file__).resolve().parent / "data" / "programme-v1"  # a ledger of schema 1

# exp08 (EMA rates, and EMA off) shrunk: 5 variants, 2 distinct train steps. One layer and one
# cycle of each kind: each variant's train step is traced for its cache key, and tracing time
# grows with the unrolled cycles (the plan costs 15 CPU-s instead of 26 with 2 layers x 2 x 2).
TINY = ["arch.hidden=64", "arch.heads=2", "arch.puzzle_emb_ndim=64", "arch.L_layers=1", "arch.H_cycles=1",
        "arch.L_cycles=1", "train.global_batch_size=64"]


def run_plan(*args: str) -> tuple[int, str, str]:
    r = launch_in_process(["plan", *args])
    return r.returncode, r.stdout, r.stderr


@pytest.mark.parametrize("args,needle", [
    (["nosuchgroup", "--topology", "v4-64"], "unknown group(s) ['nosuchgroup']"),
    (["exp08", "--topology", "v9-8"], "--topology v9-8 is not a known TPU topology"),
    (["exp08", "--topology", "v4-64", "--mtbf", "soon"], "--mtbf soon is not a duration; give e.g. 8h"),
    (["exp08", "--topology", "v4-64", "--slices", "0"], "--slices"),
    (["exp08", "--topology", "v4-64", "--calibrate-from", "/nonexistent"], "no ledger.json there"),
])
def test_bad_group_or_topology_is_one_line(args, needle):
    code, out, err = run_plan(*args)
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("error: ") and needle in err, err


def test_hlo_key_blanks_values_but_not_trip_counts_or_special_values():
    def hlo(lr="1.000000e-04", warmup="2000", trips="6", one="1.000000e+00", init='"0x893F78BF"',
            index='"0x0000000001000000"'):
        return f"""func.func public @main(%arg0: tensor<i32>) -> tensor<f32> {{
    %cst = stablehlo.constant dense<{lr}> : tensor<f32>
    %c = stablehlo.constant dense<{warmup}> : tensor<i32>
    %cst_0 = stablehlo.constant dense<{one}> : tensor<f32>
    %cst_1 = stablehlo.constant dense<{init}> : tensor<2xf16>
    %c_1 = stablehlo.constant dense<{index}> : tensor<2xi32>
    %0:2 = stablehlo.while(%iterArg = %arg0, %iterArg_1 = %cst) : tensor<i32>, tensor<f32>
    cond {{
      %c_2 = stablehlo.constant dense<{trips}> : tensor<i32>
      %1 = stablehlo.compare LT, %iterArg, %c_2, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %1 : tensor<i1>
    }} do {{
      %c_3 = stablehlo.constant dense<1> : tensor<i32>
      stablehlo.return %iterArg, %iterArg_1 : tensor<i32>, tensor<f32>
    }}
    return %cst_0 : tensor<f32>
  }}"""

    base = planner.hlo_key(hlo(), "v4-64")
    assert planner.hlo_key(hlo(lr="3.000000e-04", warmup="500", init='"0x2C3E01BF"'), "v4-64") == base
    assert planner.hlo_key(hlo(index='"0x0100000000000000"'), "v4-64") != base  # integer array data (indices) stays
    assert planner.hlo_key(hlo(trips="12"), "v4-64") != base  # a loop's trip count
    assert planner.hlo_key(hlo(one="9.900000e-01"), "v4-64") != base  # x * 1.0 simplifies away; x * 0.99 does not
    assert planner.hlo_key(hlo(), "v5e-8") != base


def test_optimal_seconds_adds_back_unmodelled_ops_and_refuses_non_times():
    calls = lambda *targets: "".join(f'custom_call_target="{t}"\n' for t in targets)  # noqa: E731
    concat = calls("ConcatBitcast", "ConcatBitcast")
    assert optimal_seconds({"optimal_seconds": -1.99, "flops": 1e9}, concat, 275e12) == pytest.approx(0.01)
    # 1.5 s of ops beside the two known -1s: never taken for 0.5 s with one unmodelled op more
    assert optimal_seconds({"optimal_seconds": -0.5, "flops": 1e9}, concat + calls("Other"), 275e12) == pytest.approx(1.5)
    # one known -1 leaves -0.99: the other custom call must be unmodelled too
    assert optimal_seconds({"optimal_seconds": -1.99, "flops": 1e9}, calls("ConcatBitcast", "Other"),
                           275e12) == pytest.approx(0.01)
    assert optimal_seconds({"optimal_seconds": 1e-6, "flops": 1e12}, "", 275e12) is None  # faster than peak
    assert optimal_seconds({"flops": 1e12}, "", 275e12) is None


def test_wire_bytes_by_ring_over_each_group():
    hlo = """ENTRY %main (p: f32[256]) -> f32[256] {
  %p = f32[256]{0} parameter(0)
  %ar = f32[256]{0} all-reduce(%p), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  %ag = f32[1024]{0} all-gather(%p), channel_id=2, replica_groups=[2,4]<=[8], dimensions={0}
  %rs = f32[64]{0} reduce-scatter(%p), channel_id=3, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, dimensions={0}
  ROOT %all = f32[256]{0} all-reduce(%p), channel_id=4, replica_groups={}, to_apply=%add
}
"""
    expected = 2 * 3 / 4 * 1024 + 3 / 4 * 4096 + 1 / 2 * 1024 + 2 * 7 / 8 * 1024
    assert wire_bytes(hlo, devices=8) == pytest.approx(expected)


def test_step_estimate_of_a_looped_step():
    gen = TOPOLOGIES["v4"]
    step = CompiledStep(hbm_bytes=1.0, total_bytes=0.5, xla_flops=1e12, optimal_s=0.01, has_loops=True,
                        loop_weight=3.0, wire_bytes=gen.ici_gbytes_s * 1e9 * 0.01)
    est = estimate_step(step, gen, model_flops=2.75e12)
    assert est.compute_s == pytest.approx(0.03) and est.collective_s == pytest.approx(0.01)
    assert est.total_s == pytest.approx(0.04) and est.mfu == pytest.approx(2.75e12 / (0.04 * 275e12))
    unreadable = estimate_step(dataclasses.replace(step, loop_weight=None), gen, model_flops=2.75e12)
    assert unreadable.compute_s == pytest.approx(0.01 * 2.75e12 / 1e12) and "formula" in unreadable.compute_from


# ------------------------------------------------------------------ compiled for a topology


@pytest.fixture(scope="module")
def tiny_group(tmp_path_factory):
    """`plan exp08 --topology v5e-8 -- TINY`, run twice on one cache; the CSV rows. The first
    run compiles in two processes, in a new pool after every two compiles (as a long plan renews
    its pool)."""
    tmp = tmp_path_factory.mktemp("plan")
    args = ["exp08", "--topology", "v5e-8", "--mtbf", "8h", "--cache-dir", str(tmp / "cache"), "--csv",
            str(tmp / "plan.csv"), "--", *TINY]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(planner, "COMPILES_PER_PROCESS", 1)
        first = run_plan("--jobs", "2", *args)
    second = run_plan("--jobs", "1", *args)
    with open(tmp / "plan.csv") as f:
        return first, second, list(csv.DictReader(f)), tmp / "cache"


@pytest.mark.slow
def test_group_plan_table_and_csv(tiny_group):
    (code, out, err), (code2, out2, err2), rows, _ = tiny_group
    assert code == 0 and code2 == 0, err
    # 5 variants, 2 distinct train steps (EMA on, at any rate, and off) and 2 eval steps (EMA weights or not)
    assert len(re.findall(r"compiled \[\d\] train exp08/", err)) == 2
    assert len(re.findall(r"compiled \[\d\] eval exp08/", err)) == 2
    assert "compiled [" not in err2 and out2 == out  # the second run is all from the cache
    variants = [r for r in rows if r["variant"] != "TOTAL"]
    assert [r["variant"] for r in variants] == ["ema0.99", "ema0.995", "ema0.999", "ema0.9995", "off"]
    assert len({r["key"] for r in variants}) == 2
    for r in variants:
        assert r["fits"] == "True" and 0 < float(r["total_gib"]) < float(r["hbm_gib"]) == 15.75
        compute, step, steps = float(r["compute_s"]), float(r["step_s"]), int(r["steps"])
        assert step >= compute > 0 and step == pytest.approx(compute + float(r["collective_s"]))
        assert float(r["train_h"]) == pytest.approx(steps * step / 3600)
        batches = (int(r["evaluations"]) - 1) * int(r["eval_batches"]) + int(r["final_eval_batches"])
        eval_step = float(r["eval_step_s"])
        assert eval_step > 0 and float(r["eval_h"]) == pytest.approx(eval_step * batches / 3600)
        assert float(r["compile_s"]) > 0 and float(r["eval_compile_s"]) > 0 and float(r["recovery_h"]) > 0
        parts = sum(float(r[c]) for c in ("train_h", "eval_h", "startup_h", "checkpoint_h", "recovery_h"))
        assert float(r["pod_hours"]) == pytest.approx(parts) == pytest.approx(float(r["total_h"]))
        assert f"| exp08/{r['variant']} | yes {float(r['total_gib']):.2f} |" in out
    group = next(r for r in rows if r["group"] == "exp08" and r["variant"] == "TOTAL")
    total = sum(float(r["pod_hours"]) for r in variants)
    assert float(group["pod_hours"]) == pytest.approx(total)
    assert float(next(r for r in rows if r["group"] == "ALL")["pod_hours"]) == pytest.approx(total)
    line = next(x for x in out.splitlines() if x.startswith("| **exp08 total** |"))
    assert f"| **{total:.3f}** | **{100 * float(group['goodput']):.1f}%** |" in line
    assert f"**Programme: {total:.2f} pod-hours all in" in out


@pytest.mark.slow
def test_step_time_floor_and_model_flops(tiny_group):
    """The estimated step time is more than the model's FLOPs take at peak: the MFU it implies is below 1."""
    _, _, rows, _ = tiny_group
    for r in (r for r in rows if r["variant"] != "TOTAL"):
        assert 0 < float(r["mfu"]) < 1


@pytest.mark.slow
def test_cache_key_merges_values_not_shapes(tmp_path):
    base = ("train.global_batch_size=64",)
    key = lambda *extra: planner.lower(planner.Job("example", "small", base + extra), "v5e-8").key  # noqa: E731
    same = key()  # (train.steps=5 would not merge: at or below the warmup a constant becomes exactly 1.0)
    assert same and key("optim.lr=0.123", "optim.b2=0.9", "train.seed=7", "train.steps=500") == same
    assert key("arch.hidden=96") != same
    assert key("train.global_batch_size=128") != same


@pytest.mark.slow
def test_compiles_run_in_fresh_pools_of_their_share(monkeypatch):
    """More compiles than one pool's share all run, each share in fresh processes. (With
    `max_tasks_per_child` the pool stops after the first share on Python 3.11 and waits forever,
    cpython gh-115634: `plan all --executables` keeps about a hundred programs.)"""
    monkeypatch.setattr(planner, "COMPILES_PER_PROCESS", 2)
    calls = [((os.getpid,), i) for i in range(5)]
    out: list[tuple[int, int]] = []
    run = threading.Thread(target=lambda: out.extend((tag, f.result()) for f, tag in planner.in_fresh_pools(calls, 1)),
                           daemon=True)
    run.start()
    run.join(600)  # a guard against the hang only: the five calls take seconds
    assert sorted(tag for tag, _ in out) == [0, 1, 2, 3, 4]
    assert len({pid for _, pid in out}) == 3  # a process for each share of 2


@pytest.mark.slow
def test_executables_keeps_each_program_and_prices_it_as_a_read(tiny_group, tmp_path):
    """`plan --executables`: each distinct program of a variant that fits, compiled for the
    topology and kept (runtime/executables.py); the plan prices those steps as a read at every
    start. (One variant, on tiny_group's cache: only the keeping compiles.)"""
    *_, cache = tiny_group
    jobs = [planner.Job("exp08", "off", tuple(TINY))]
    rows = planner.Planner("v5e-8", cache, progress=lambda line: None).plan(jobs)
    assert rows[0].fits and rows[0].compile_s > 0
    lines: list[str] = []
    kept = planner.keep_ahead(jobs, rows, "v5e-8", str(tmp_path / "exe"), progress=lines.append, cache_root=cache)
    assert kept == {rows[0].lowered.exact, rows[0].lowered.eval_exact}, lines
    assert len(list((tmp_path / "exe").glob("*.jaxexe"))) == 2
    digest = rows[0].executables_digest
    assert digest and f"run.executables_digest={digest}" in lines[-1]
    assert len(executables.read_manifest(str(tmp_path / "exe"), digest)) == 2
    hit = bill.FIGURES["compile_cache_hit"].seconds
    compiled = price.price_programme(rows).rows[0].bill
    ahead = price.price_programme(rows, ahead=kept).rows[0].bill
    assert compiled.seconds["program_startup"] == pytest.approx(rows[0].compile_s + rows[0].eval_compile_s)
    assert ahead.seconds["program_startup"] == pytest.approx(2 * hit)
    assert ahead.total_s < compiled.total_s and ahead.train_s == compiled.train_s
    # The CSV names the folder, and a programme submitted with it runs with run.executables=FOLDER.
    report.write_csv(rows, tmp_path / "plan.csv")
    planned = read_plan(tmp_path / "plan.csv")
    folder = str(tmp_path / "exe")
    assert planned["exp08/off"]["executables"] == folder and planned["exp08/off"]["executables_digest"] == digest
    assert with_executables(["a=1"], planned, ["exp08/off"]) == [
        "a=1", f"run.executables={folder}", f"run.executables_digest={digest}"]
    assert with_executables(["run.executables=mine"], planned, ["exp08/off"]) == ["run.executables=mine"]
    code, out, err = run_plan("exp08", "--topology", "v5e-8", "--executables", "s3://b/exe")
    assert code == 2 and err.startswith("error: --executables='s3://b/exe': it can be a local folder or on gs:// only")
    with pytest.raises(UserError, match="in 2 folders"):
        with_executables([], planned | {"g/v": {"executables": "gs://c/exe", "executables_digest": digest}},
                         ["exp08/off", "g/v"])
    with pytest.raises(UserError, match="no digest of its manifest"):  # a plan's CSV of before the manifests
        with_executables([], {"g/v": {"executables": "gs://c/exe"}}, ["g/v"])


def test_does_not_fit_names_a_change_a_compile_shows_to_fit(tmp_path, monkeypatch):
    """1.6e9 parameters replicated on each v5e chip (f32 weights and Adam moments, 24 GiB): XLA
    stops at its memory check; FSDP over the 8 chips fits, by a second compile. (One wide layer:
    the cheapest such model to compile; 2 rows per chip, too few to try a smaller batch per chip,
    each such try costing 10-20 s of compile: the search through candidates that do not fit is
    test_the_search_tries_each_change_until_one_fits. The search is of train steps only, so the
    eval step, 8 s of compile, is left out here: tiny_group's rows price theirs.)"""
    lower = planner.lower
    monkeypatch.setattr(planner, "lower", lambda job, topology: dataclasses.replace(lower(job, topology), eval_key=""))
    planning = planner.Planner("v5e-8", tmp_path, workers=1, progress=lambda line: None)
    job = planner.Job("example", "small", ("arch.hidden=11584", "arch.layers=1", "arch.heads=8",
                                        "train.global_batch_size=16"))
    (row,) = planning.plan([job])
    assert row.fits is False and row.total_gib > 15.75 and planning.compiled(job).stopped
    tried = [j for j in planning.lowered if j != job]
    assert [j.overrides[len(job.overrides):] for j in tried] == [("mesh.data=1", "mesh.fsdp=-1")]
    assert planner.fix_candidates(planning.lowered[job], planning.compiled(job)) == [("mesh.data=1", "mesh.fsdp=-1")]
    fix = planner.Job(job.group, job.variant, job.overrides + tuple(row.change.split()))
    assert fix == tried[-1] and planning.compiled(fix).fits
    assert row.train_h == pytest.approx(planning.lowered[fix].steps * row.estimate.total_s / 3600)


def test_the_search_tries_each_change_until_one_fits(tmp_path, monkeypatch):
    """Compiles stood in for: remat does not fit, 4 or 8 micro-batches do not, FSDP does. The
    row names FSDP, with its figures; each candidate was compiled once, in order, none after it."""
    gib = 2**30
    sizes = {(): 40, ("arch.remat=true",): 30, ("train.grad_accum_steps=4",): 20, ("train.grad_accum_steps=8",): 18,
             ("mesh.data=1", "mesh.fsdp=-1"): 10}
    compiled: list[tuple[str, ...]] = []

    def lower(job, topology):
        return planner.Lowered(key=f"k{len(job.overrides)}{job.overrides[-1:]}".replace(" ", ""), steps=100,
                            per_device_batch=8, remat=False, fsdp_over_all=False)

    def compile_job(job, topology, kind=planner.TRAIN):
        change = job.overrides[1:]
        compiled.append(change)
        return CompiledStep(hbm_bytes=15.75 * gib, total_bytes=sizes[change] * gib, optimal_s=0.5)

    monkeypatch.setattr(planner, "lower", lower)
    monkeypatch.setattr(planner, "compile_job", compile_job)
    planning = planner.Planner("v5e-8", tmp_path, workers=1, progress=lambda line: None)
    (row,) = planning.plan([planner.Job("g", "v", ("x=1",))])
    assert compiled == list(sizes)  # the job, then each change in order until one fits
    assert row.fits is False and row.change == "mesh.data=1 mesh.fsdp=-1" and row.total_gib == 40
    assert row.estimate.total_s == pytest.approx(0.5) and row.train_h == pytest.approx(100 * 0.5 / 3600)


def test_a_compile_error_is_its_rows_note_and_the_plan_goes_on(tmp_path, monkeypatch):
    """A kernel that fails to compile (Mosaic raises its own exception type, not XLA's) ends that
    variant's row with the error's first line; the other variants are planned."""
    class MosaicError(Exception):
        pass

    def lower(job, topology):
        return planner.Lowered(key=job.variant, steps=10, per_device_batch=1, remat=False)

    def compile_job(job, topology, kind=planner.TRAIN):
        if job.variant == "bad":
            raise MosaicError("INTERNAL: Mosaic failed to compile TPU kernel: Invalid vector type for load\nmore")
        return CompiledStep(hbm_bytes=16 * 2**30, total_bytes=2**30, optimal_s=0.1)

    monkeypatch.setattr(planner, "lower", lower)
    monkeypatch.setattr(planner, "compile_job", compile_job)
    planning = planner.Planner("v5e-8", tmp_path, workers=1, progress=lambda line: None)
    bad, good = planning.plan([planner.Job("g", "bad"), planner.Job("g", "good")])
    assert bad.note == ("compile failed: MosaicError: INTERNAL: Mosaic failed to compile TPU kernel: Invalid vector "
                        "type for load") and bad.train_h is None
    assert good.fits and good.train_h == pytest.approx(10 * 0.1 / 3600)


def test_fix_candidates_in_order():
    """remat, then the batch per chip divided by the power of two that covers the overshoot (and
    twice that) as gradient accumulation; then FSDP."""
    low = planner.Lowered(key="k", per_device_batch=8, remat=False, fsdp_over_all=False)
    step = CompiledStep(hbm_bytes=15.75 * 2**30, total_bytes=40 * 2**30, stopped=True)
    fsdp = ("mesh.data=1", "mesh.fsdp=-1")
    assert planner.fix_candidates(low, step) == [("arch.remat=true",), ("train.grad_accum_steps=4",),
                                                 ("train.grad_accum_steps=8",), fsdp]
    done = dataclasses.replace(low, remat=None, per_device_batch=1, fsdp_over_all=True)
    assert planner.fix_candidates(done, step) == []  # no knob, one example per chip, already FSDP


@pytest.mark.slow
def test_steps_of_an_epoch_schedule_over_a_set_not_here_are_unknown(tmp_path):
    """An SFT set that is not on this machine has no size, so train.epochs gives no step count
    (and the row no pod-hours) until data.path points at the built set; train.steps always does."""
    job = planner.Job("gemma_sft", "tiny_cpu", (f"data.path={tmp_path}/absent", "train.global_batch_size=8"))
    by_epochs = planner.lower(dataclasses.replace(job, overrides=job.overrides + ("train.steps=null", "train.epochs=2")),
                           "v5e-8")
    assert by_epochs.key and by_epochs.steps == 0 and "steps unknown" in by_epochs.note
    assert planner.lower(job, "v5e-8").steps == 600
    assert not (tmp_path / "absent").exists()


# ------------------------------------------------------------------ the bill (experiments/plan/bill.py)


def figures(**seconds: float) -> dict[str, bill.Figure]:
    """Every figure at 0 s but those given, so each formula can be checked alone."""
    return {name: bill.Figure(seconds.get(name, 0.0), f.category, f.paid, "test") for name, f in bill.FIGURES.items()}


def test_every_figure_is_a_measurement_or_a_public_figure_and_no_bound_is_central():
    """Each source (and each high end's) is a command with its date, or an address with the number
    it quotes; a low end (the table's figure) never rests on a bound."""
    kinds = re.compile(r"^(measured: `[^`]+` \(\d{4}-\d\d-\d\d|public: https://\S+ .*\d)")
    for name, f in bill.FIGURES.items():
        for source in (f.source, f.high_source) if f.high is not None else (f.source,):
            assert kinds.match(source), (name, source)
            assert "public: https://" not in source or re.search(r"public: https://\S+\s[^;]*?\d", source), name
        assert not re.search(r"upper bound|at most", f.source, re.IGNORECASE), name
        assert f.high is None or f.high > f.seconds, name
    low, high = bill.ends(bill.FIGURES)
    assert low["runtime_init"].seconds == 7.3 and high["runtime_init"].seconds == 14.5
    assert high["runtime_init"].source == bill.FIGURES["runtime_init"].high_source and high["launch"] == low["launch"]


# 1000 steps of 0.1 s; 4 evaluations (3 on 2 batches, the last on 10) of a 0.5 s eval step;
# a save every 250 steps: train 100 s + eval 0.5 x (3 x 2 + 10) = 8 s, 4 saves 27 s apart.
VARIANT = bill.Variant(steps=1000, step_s=0.1, evaluations=4, eval_step_s=0.5, eval_batches=2, final_eval_batches=10,
                       checkpoint_every=250, compile_train_s=30.0, compile_eval_s=20.0)


def test_train_eval_and_the_first_starts_costs():
    f = figures(setup_check=1, setup_fresh=100, launch=2, runtime_init=3, data_load=4, other=5, final_save=6,
                between_variants=7, save=0.5, compile_cache_hit=0.25)
    b = bill.price(VARIANT, f)
    assert b.train_s == pytest.approx(100) and b.eval_s == pytest.approx(8)
    assert b.saves == 4 and b.checkpoint_interval_s == pytest.approx(27)
    assert b.checkpoint_s == pytest.approx(3 * 0.5)  # the saves before the last
    # a fresh slice's setup, launch, runtime, data, other, both compiles (missed), final save, idle
    assert b.startup_s == pytest.approx(100 + 2 + 3 + 4 + 5 + 30 + 20 + 6 + 7)
    assert b.recovery_s == 0 and b.preemptions == 0 and b.young_interval_s is None
    assert b.total_s == pytest.approx(sum(b.seconds.values()))
    assert b.total_s == pytest.approx(b.train_s + b.eval_s + b.startup_s + b.checkpoint_s)
    assert b.goodput == pytest.approx(108 / b.total_s)
    assert b.seconds[Category.SETUP] == pytest.approx(102) and b.seconds[Category.PROGRAM_STARTUP] == pytest.approx(50)
    later = bill.price(dataclasses.replace(VARIANT, start=Start.COLD), f)  # the slice is set up: the check only
    assert later.startup_s == pytest.approx(b.startup_s - 100 + 1)
    hit = bill.price(dataclasses.replace(VARIANT, train=Program.CACHED, eval=Program.AHEAD), f)
    assert hit.seconds[Category.PROGRAM_STARTUP] == pytest.approx(0.5)  # both steps read, not compiled
    no_eval = bill.price(dataclasses.replace(VARIANT, evaluations=0), f)
    assert no_eval.seconds[Category.PROGRAM_STARTUP] == pytest.approx(30)  # no evaluation: no eval step


def test_evaluation_counts_and_unknown_sizes():
    assert dataclasses.replace(VARIANT, evaluations=1).eval_s == pytest.approx(0.5 * 10)  # only the last, whole set
    assert dataclasses.replace(VARIANT, evaluations=0).eval_s == 0
    unknown = bill.price(dataclasses.replace(VARIANT, eval_step_s=None), figures())
    assert not unknown.eval_known and unknown.eval_s == 0


def test_checkpoint_interval_by_steps_or_minutes_whichever_first():
    assert bill.save_count(VARIANT) == (4, pytest.approx(27))
    by_time = dataclasses.replace(VARIANT, checkpoint_minutes=0.25)  # 15 s < 27 s
    assert bill.save_count(by_time) == (8, pytest.approx(15))  # ceil(108 / 15)
    assert bill.save_count(dataclasses.replace(VARIANT, checkpoint_every=0)) == (1, pytest.approx(108))
    assert bill.save_count(dataclasses.replace(VARIANT, checkpoint_every=0, checkpoint_minutes=60))[0] == 1


def test_recovery_at_an_mtbf_and_youngs_rule():
    """Each preemption: half an interval replayed + a restart (fresh setup, launch, runtime, data,
    restore, both steps compiled again without the cache); expected preemptions = total / MTBF,
    the total including the recoveries: total = base / (1 - cost / MTBF)."""
    f = figures(setup_fresh=100, launch=2, runtime_init=3, data_load=4, restore=5, save=2, compile_cache_hit=1,
                other=6)
    mtbf = 3600.0
    base = bill.price(VARIANT, f)
    b = bill.price(VARIANT, f, mtbf)
    restart = 100 + 2 + 3 + 4 + 5 + 6 + 30 + 20
    cost = restart + 27 / 2
    assert b.restart_s == pytest.approx(restart)
    assert b.total_s == pytest.approx(base.total_s / (1 - cost / mtbf))
    assert b.preemptions == pytest.approx(b.total_s / mtbf)
    assert b.recovery_s == pytest.approx(b.preemptions * cost) == pytest.approx(b.total_s - base.total_s)
    assert b.seconds[Category.WASTED_PROGRESS] == pytest.approx(b.preemptions * 13.5)
    assert b.seconds[Category.CHECKPOINT_RESTORE] == pytest.approx(b.preemptions * 5)
    assert b.young_interval_s == pytest.approx(math.sqrt(2 * 2 * 3600))
    cached = bill.price(dataclasses.replace(VARIANT, compile_cache=True), f, mtbf)
    assert cached.restart_s == pytest.approx(restart - 50 + 2)  # a restart loads both steps from the cache
    ahead = bill.price(dataclasses.replace(VARIANT, train=Program.AHEAD), f, mtbf)
    assert ahead.restart_s == pytest.approx(restart - 30 + 1)  # kept ahead: read at every start
    with pytest.raises(UserError, match="more than --mtbf"):
        bill.price(VARIANT, f, mtbf_s=100.0)


@pytest.mark.parametrize("text,seconds", [("8h", 28800), ("90m", 5400), ("2d", 172800), ("1.5", 5400), ("30s", 30)])
def test_parse_hours(text, seconds):
    assert bill.parse_hours(text) == seconds



def trainer_event(*, saves=0, hits=0, misses=1, **seconds) -> dict:
    """The trainer's `timing` event (runtime/goodput.py) as the supervisor reads it from the run's events."""
    return {"event": "timing", "time": 100.0, "step": 10, "steps_run": 10, "seconds": seconds, "saves": saves,
            "hits": hits, "misses": misses, "wall": sum(seconds.values())}


def write_ledger(root, launches: dict[str, list[LaunchTiming]], gaps: dict[str, list[float]] | None = None) -> None:
    """A programme's ledger.json as the controller writes it (the launcher's records, serialised), each
    launch with its timing, each slice with its idle stretches before a variant (`gaps`)."""
    book = Ledger(variants={v: VariantRecord(state=VariantState.COMPLETED, supervision=SupervisionRecord(launches=[
        LaunchRecord(started=0.0, ended=1.0, code=0, outcome=Outcome.COMPLETED, cause="completed",
                     timing=t)
        for t in timings])) for v, timings in launches.items()},
        slices={s: SliceRecord(gaps=g) for s, g in (gaps or {}).items()})
    (root / "ledger.json").write_text(to_text(book))


def test_calibration_takes_the_ledgers_medians(tmp_path):
    """Each launch's timing as the supervisor records it (account.launch_timing of the trainer's
    `timing` events, with the setup it measured and whether setup ran), and the slices' idle
    stretches before a variant: the figures are their medians, setup split by setup_ran."""
    write_ledger(tmp_path, {
        "g/a": [launch_timing([trainer_event(runtime_startup=20, data_loading=3, program_startup=40,
                                             checkpoint_save=8, saves=4)], setup=190, setup_ran=True),
                launch_timing([trainer_event(runtime_startup=30, data_loading=5, program_startup=4,
                                             checkpoint_restore=6, hits=2, misses=0)],  # a restart: both steps cached
                              setup=8)],
        "g/b": [launch_timing([trainer_event(runtime_startup=50, program_startup=60, checkpoint_save=3, saves=1)],
                              setup=4),
                launch_timing([trainer_event(runtime_startup=70, program_startup=50)], setup=210, setup_ran=True)],
        "g/c": [launch_timing([trainer_event(train=100)]), launch_timing([])],  # measured nothing else; said nothing
        "g/d": [launch_timing([trainer_event(runtime_startup=60, program_startup=4, hits=2, misses=0)], setup=3),
                launch_timing([trainer_event(runtime_startup=80, program_startup=4, hits=2, misses=0)], setup=3)],
    }, gaps={"s1": [2.0, 9.0], "s2": [4.0]})
    cal = calibrate.calibrate(tmp_path)
    assert cal.launches == 8
    f = cal.figures
    assert f["runtime_init"].seconds == 55 and "median of 6 launches' runtime_startup" in f["runtime_init"].source
    assert f["data_load"].seconds == 4  # median of 3 and 5
    assert f["setup_check"].seconds == 3.5 and f["setup_fresh"].seconds == 200  # 8, 4, 3, 3; 190 and 210
    assert f["restore"].seconds == 6
    assert f["between_variants"].seconds == 4 and "median of 3 idle stretches" in f["between_variants"].source
    assert f["save"].seconds == pytest.approx((8 / 4 + 3 / 1) / 2)
    assert f["compile_cache_hit"].seconds == 2  # 4 s for 2 hits, in every launch that only hit
    assert f["launch"] == bill.FIGURES["launch"]  # not measured: the plan's own
    assert cal.program_startup == {"g/a": 40, "g/b": 55}  # launches that compiled
    # a row of g/a is priced with its own measured start-up, split as the plan's compiles are
    row = planner.Row("g", "a", estimate=StepEstimate(0.1, "", 0.0, None, 1.0), steps=1000, compile_s=30.0,
                   eval_compile_s=10.0, lowered=planner.Lowered(protocol=planner.Protocol(evaluations=1)))
    costs = price.variant_costs(row, cal.program_startup)
    assert costs.compile_train_s == pytest.approx(40 * 0.75) and costs.compile_eval_s == pytest.approx(40 * 0.25)


def test_calibration_of_a_ledger_without_timings_changes_nothing(tmp_path):
    """A ledger of schema 1 (no timings, no idle stretches) calibrates nothing; a damaged one is one line."""
    (tmp_path / "ledger.json").write_bytes((V1 / "ledger.json").read_bytes())
    cal = calibrate.calibrate(tmp_path)
    assert cal.figures == bill.FIGURES and cal.launches == 0 and cal.program_startup == {}
    (tmp_path / "ledger.json").write_text("{half")
    with pytest.raises(UserError, match=r"--calibrate-from .*: the ledger .* is truncated or garbled"):
        calibrate.calibrate(tmp_path)
    (tmp_path / "ledger.json").write_text(json.dumps({"schema": 3, "variants": {"g/a": {"supervision": {
        "launches": [{"timing": {"setup": 1.0}}]}}}}))
    with pytest.raises(UserError, match=r"launches\[0\]\.started: missing"):
        calibrate.calibrate(tmp_path)


def priced_rows() -> list[planner.Row]:
    """Three made-up rows: a and b the same program (a cache hit for b), c another, d unplanned."""
    def row(variant, exact, steps=1000):
        low = planner.Lowered(key="k", exact=exact, eval_exact=exact + "e", protocol=planner.Protocol(
            evaluations=2, eval_batch=64, batches=1, final_batches=3, examples=150, checkpoint_every=500,
            compile_cache=True))
        return planner.Row("g", variant, fits=True, total_gib=1.0, hbm_gib=16.0, steps=steps, compile_s=30.0,
                        estimate=StepEstimate(0.1, "", 0.0, None, 1.0),
                        eval_estimate=StepEstimate(0.5, "", 0.0, None, 1.0),
                        eval_compile_s=20.0, lowered=low)
    return [row("a", "p1"), row("b", "p1"), row("c", "p2", steps=2000), planner.Row("h", "d", note="not planned")]


def test_programme_cache_hits_first_on_slice_and_wall_clock():
    f = figures(setup_check=1, setup_fresh=100, compile_cache_hit=2)
    rows = priced_rows()
    prog = price.price_programme(rows, f, slices=2)  # the cache alone (no steps kept ahead)
    a, b, c, d = (r.bill for r in rows)
    assert d is None  # not planned: no bill
    assert a.seconds[Category.PROGRAM_STARTUP] == 50 and b.seconds[Category.PROGRAM_STARTUP] == 4  # b: a's programs
    assert c.seconds[Category.PROGRAM_STARTUP] == 50
    assert a.seconds[Category.SETUP] == 100 and b.seconds[Category.SETUP] == 100 and c.seconds[Category.SETUP] == 1
    hours = [a.total_s / 3600, b.total_s / 3600, c.total_s / 3600]
    assert hours[1] < hours[0]  # b's compiles came from the cache: its slice frees first, and c runs there
    assert prog.slice_hours == pytest.approx([hours[0], hours[1] + hours[2]])
    assert prog.wall_days == pytest.approx(max(prog.slice_hours) / 24)
    one = price.price_programme(rows, f, slices=1)
    assert rows[1].bill.seconds[Category.SETUP] == 1 and one.slice_hours == pytest.approx([sum(
        r.bill.total_s for r in rows[:3]) / 3600])


def test_csv_carries_every_column_and_the_queue_reads_the_all_in_total(tmp_path):
    rows = priced_rows()
    price.price_programme(rows, figures(setup_fresh=100), mtbf_s=8 * 3600)
    path = tmp_path / "plan.csv"
    report.write_csv(rows, path)
    with open(path) as f:
        lines = list(csv.DictReader(f))
    assert set(report.CSV_FIELDS) <= set(lines[0])
    a = lines[0]
    parts = sum(float(a[c]) for c in ("train_h", "eval_h", "startup_h", "checkpoint_h", "recovery_h"))
    assert float(a["total_h"]) == pytest.approx(parts) == pytest.approx(float(a["pod_hours"]))
    assert float(a["train_h"]) == pytest.approx(1000 * 0.1 / 3600)
    assert float(a["eval_h"]) == pytest.approx(0.5 * (1 * 1 + 3) / 3600)  # eval step x (1 x 1 + 3) batches
    assert sum(float(a[f"{c}_h"]) for c in Category) == pytest.approx(float(a["total_h"]))
    assert float(a["goodput"]) == pytest.approx((float(a["train_h"]) + float(a["eval_h"])) / float(a["total_h"]))
    assert a["evaluations"] == "2" and a["eval_examples"] == "150" and float(a["preemptions"]) > 0
    total = next(r for r in lines if r["group"] == "ALL")
    assert float(total["pod_hours"]) == pytest.approx(sum(float(r["pod_hours"]) for r in lines[:3]))
    assert lines[3]["pod_hours"] == ""  # not planned
    planned = read_plan(path)
    assert planned["g/a"]["pod_hours"] == pytest.approx(float(a["total_h"])) and planned["h/d"]["pod_hours"] is None
    out = report.markdown(price.price_programme(rows, figures(), slices=1), "v5e-8", "cmd")
    assert "| **programme total** |" in out and "goodput" in out and "| figure | seconds (low-high) | paid | source |" in out


def test_protocol_of_the_baseline_from_its_config(sudoku_dir):
    """exp02a/L6 on a v4-64: 8,139 steps, an evaluation every 814 (9) and at the end, the last on
    the whole Sudoku-Extreme test set the config states (423,168: 69 batches of 6144), the others on
    the 8,192-puzzle subset (2 batches); a built set's own rows where it is here (40 test puzzles)."""
    def protocol(*overrides):
        config = validate(compose("exp02a/L6", overrides), "exp02a/L6")
        return planner.protocol(config, derive(config, num_processes=8, num_devices=32, train_examples=1_001_000,
                                            epoch_examples=1000))

    p = protocol()
    assert (p.evaluations, p.eval_batch, p.final_batches, p.examples) == (10, 6144, 69, 423_168)
    assert p.batches == 2 and p.subset == 8192  # the intermediate ones on the subset (train.eval_subset)
    assert p.checkpoint_every == 814 and "data.generate_test_puzzles" in p.source
    reference = protocol("train.eval_subset=null", "train.eval_batch_size=8192")  # the whole set every time
    assert (reference.batches, reference.final_batches, reference.eval_batch) == (52, 52, 8192)
    capped = protocol("data.eval_max_examples=10000")
    assert capped.batches == capped.final_batches == 2 and capped.examples == 10000
    built = protocol(f"data.path={sudoku_dir}")
    assert built.examples == 40 and built.final_batches == 1 and str(sudoku_dir) in built.source


def test_the_line_above_the_table_gives_the_programme_at_both_ends_and_what_each_lever_buys():
    """The table is priced at the figures' low end; the line above it also at the high end (the
    figures with a `high`), and what steps kept ahead would save at the low end."""
    f = figures(setup_check=1, setup_fresh=100, runtime_init=30, compile_cache_hit=2)
    f["runtime_init"] = dataclasses.replace(f["runtime_init"], high=90.0, high_source="test high")
    rows = priced_rows()
    prog = price.price_programme(rows, f, slices=1)
    top = prog.again(figures=bill.ends(f)[1])
    assert top.total_h == pytest.approx(prog.total_h + 3 * 60 / 3600)  # every start is cold: 60 s more each
    assert [r.bill.total_s for r in prog.rows[:3]] != [r.bill.total_s for r in top.rows[:3]]  # prog's rows untouched
    kept = prog.again(ahead=frozenset({"p1", "p1e", "p2", "p2e"}))
    line = report.both_ends(prog)
    assert line.startswith(f"**Programme: {prog.total_h:.2f} pod-hours all in, goodput {100 * prog.goodput:.1f}% at the "
                           f"figures' low end; {top.total_h:.2f} pod-hours, {100 * top.goodput:.1f}% at the high end** "
                           "(runtime_init 30-90 s)")
    saved = prog.total_h - kept.total_h
    assert f"the 4 programs kept ahead (`--executables`) would buy {saved:.2f} pod-hours, " \
           f"{100 * saved / prog.total_h:.2f}% of the paid time" in line
    out = report.markdown(prog, "v5e-8", "cmd")
    assert out.index(line) < out.index("| variant |") and "| runtime_init | 30-90 |" in out


def test_an_eval_step_that_does_not_fit_is_its_rows_note(tmp_path, monkeypatch):
    """The train step fits, the eval step (at its eval batch) does not: the row says so and how to
    fix it, and its eval_h is not priced (no figure rather than a wrong one)."""
    def lower(job, topology):
        return planner.Lowered(key="t", eval_key="e", exact="t", eval_exact="e", steps=100,
                            per_device_batch=1, protocol=planner.Protocol(evaluations=2, eval_batch=4096, batches=1,
                                                                        final_batches=2, examples=5000))

    def compile_job(job, topology, kind=planner.TRAIN):
        return CompiledStep(hbm_bytes=16 * 2**30, total_bytes=(40 if kind == planner.EVAL else 1) * 2**30, optimal_s=0.1)

    monkeypatch.setattr(planner, "lower", lower)
    monkeypatch.setattr(planner, "compile_job", compile_job)
    (row,) = planner.Planner("v5e-8", tmp_path, workers=1, progress=lambda line: None).plan([planner.Job("g", "v")])
    assert row.fits and row.eval_estimate is None
    assert "the eval step does not fit at 4096 rows (40.00 GiB per chip): lower train.eval_batch_size" in row.eval_note
    price.price_programme([row], figures())
    assert not row.bill.eval_known and row.bill.eval_s == 0 and row.bill.train_s == pytest.approx(10)
