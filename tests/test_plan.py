"""`launch.py plan`: fits, estimated step time and pod-hours of a group at full scale, from train
steps compiled for a TPU topology (libtpu's compile-only devices), cached by their HLO; and the
pieces of the estimate (runtime/compile_only.py) on hand-written HLO (loops, collectives in them
and custom kernels: test_hlo_cost.py)."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import re

import pytest

from experiments import plan
from experiments.launch import main as launch
from runtime.compile_only import TOPOLOGIES, CompiledStep, estimate_step, optimal_seconds, wire_bytes

# exp08 (EMA rates, and EMA off) shrunk: 5 variants, 2 distinct train steps. One layer and one
# cycle of each kind: each variant's train step is traced for its cache key, and tracing time
# grows with the unrolled cycles (the plan costs 15 CPU-s instead of 26 with 2 layers x 2 x 2).
TINY = ["arch.hidden=64", "arch.heads=2", "arch.puzzle_emb_ndim=64", "arch.L_layers=1", "arch.H_cycles=1",
        "arch.L_cycles=1", "train.global_batch_size=64"]


def run_plan(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = launch(["plan", *args])
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("args,needle", [
    (["nosuchgroup", "--topology", "v4-64"], "unknown group(s) ['nosuchgroup']"),
    (["exp08", "--topology", "v9-8"], "--topology v9-8 is not a known TPU topology"),
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

    base = plan.hlo_key(hlo(), "v4-64")
    assert plan.hlo_key(hlo(lr="3.000000e-04", warmup="500", init='"0x2C3E01BF"'), "v4-64") == base
    assert plan.hlo_key(hlo(index='"0x0100000000000000"'), "v4-64") != base  # integer array data (indices) stays
    assert plan.hlo_key(hlo(trips="12"), "v4-64") != base  # a loop's trip count
    assert plan.hlo_key(hlo(one="9.900000e-01"), "v4-64") != base  # x * 1.0 simplifies away; x * 0.99 does not
    assert plan.hlo_key(hlo(), "v5e-8") != base


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
    run compiles in two processes, in a new pool for each compile (as a long plan renews its pool)."""
    tmp = tmp_path_factory.mktemp("plan")
    args = ["exp08", "--topology", "v5e-8", "--cache-dir", str(tmp / "cache"), "--csv", str(tmp / "plan.csv"),
            "--", *TINY]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plan, "COMPILES_PER_PROCESS", 0.5)
        first = run_plan("--jobs", "2", *args)
    second = run_plan("--jobs", "1", *args)
    with open(tmp / "plan.csv") as f:
        return first, second, list(csv.DictReader(f))


@pytest.mark.slow
def test_group_plan_table_and_csv(tiny_group):
    (code, out, err), (code2, out2, err2), rows = tiny_group
    assert code == 0 and code2 == 0, err
    assert len(re.findall(r"compiled \[\d\] exp08/", err)) == 2  # 5 variants, 2 distinct steps: EMA on (any rate) and off
    assert "compiled [" not in err2 and out2 == out  # the second run is all from the cache
    variants = [r for r in rows if r["variant"] != "TOTAL"]
    assert [r["variant"] for r in variants] == ["ema0.99", "ema0.995", "ema0.999", "ema0.9995", "off"]
    assert len({r["key"] for r in variants}) == 2
    for r in variants:
        assert r["fits"] == "True" and 0 < float(r["total_gib"]) < float(r["hbm_gib"]) == 15.75
        compute, step, steps = float(r["compute_s"]), float(r["step_s"]), int(r["steps"])
        assert step >= compute > 0 and step == pytest.approx(compute + float(r["collective_s"]))
        assert float(r["pod_hours"]) == pytest.approx(steps * step / 3600)
        assert f"| exp08/{r['variant']} | yes {float(r['total_gib']):.2f} |" in out
    group = next(r for r in rows if r["group"] == "exp08" and r["variant"] == "TOTAL")
    total = sum(float(r["pod_hours"]) for r in variants)
    assert float(group["pod_hours"]) == pytest.approx(total)
    assert float(next(r for r in rows if r["group"] == "ALL")["pod_hours"]) == pytest.approx(total)
    assert f"| **exp08 total** | | | | | **{total:.2f}** |" in out


@pytest.mark.slow
def test_step_time_floor_and_model_flops(tiny_group):
    """The estimated step time is more than the model's FLOPs take at peak: the MFU it implies is below 1."""
    _, _, rows = tiny_group
    for r in (r for r in rows if r["variant"] != "TOTAL"):
        assert 0 < float(r["mfu"]) < 1


@pytest.mark.slow
def test_cache_key_merges_values_not_shapes(tmp_path):
    base = ("train.global_batch_size=64",)
    key = lambda *extra: plan.lower(plan.Job("example", "small", base + extra), "v5e-8").key  # noqa: E731
    same = key()  # (train.steps=5 would not merge: at or below the warmup a constant becomes exactly 1.0)
    assert same and key("optim.lr=0.123", "optim.b2=0.9", "train.seed=7", "train.steps=500") == same
    assert key("arch.hidden=96") != same
    assert key("train.global_batch_size=128") != same


@pytest.mark.slow
def test_does_not_fit_names_a_change_a_compile_shows_to_fit(tmp_path):
    """1.6e9 parameters replicated on each v5e chip (f32 weights and Adam moments, 24 GiB): XLA
    stops at its memory check; FSDP over the 8 chips fits, by a second compile. (One wide layer:
    the cheapest such model to compile; 2 rows per chip, too few to try a smaller batch per chip,
    each such try costing 10-20 s of compile: the search through candidates that do not fit is
    test_the_search_tries_each_change_until_one_fits.)"""
    planner = plan.Planner("v5e-8", tmp_path, workers=1, progress=lambda line: None)
    job = plan.Job("example", "small", ("arch.hidden=11584", "arch.layers=1", "arch.heads=8",
                                        "train.global_batch_size=16"))
    (row,) = planner.plan([job])
    assert row.fits is False and row.total_gib > 15.75 and planner.compiled(job).stopped
    tried = [j for j in planner.lowered if j != job]
    assert [j.overrides[len(job.overrides):] for j in tried] == [("mesh.data=1", "mesh.fsdp=-1")]
    assert plan.fix_candidates(planner.lowered[job], planner.compiled(job)) == [("mesh.data=1", "mesh.fsdp=-1")]
    fix = plan.Job(job.group, job.variant, job.overrides + tuple(row.change.split()))
    assert fix == tried[-1] and planner.compiled(fix).fits
    assert row.pod_hours == pytest.approx(planner.lowered[fix].steps * row.estimate.total_s / 3600)


def test_the_search_tries_each_change_until_one_fits(tmp_path, monkeypatch):
    """Compiles stood in for: remat does not fit, 4 or 8 micro-batches do not, FSDP does. The
    row names FSDP, with its figures; each candidate was compiled once, in order, none after it."""
    gib = 2**30
    sizes = {(): 40, ("arch.remat=true",): 30, ("train.grad_accum_steps=4",): 20, ("train.grad_accum_steps=8",): 18,
             ("mesh.data=1", "mesh.fsdp=-1"): 10}
    compiled: list[tuple[str, ...]] = []

    def lower(job, topology):
        return plan.Lowered(key=f"k{len(job.overrides)}{job.overrides[-1:]}".replace(" ", ""), steps=100,
                            global_batch=64, per_device_batch=8, remat=False, fsdp_over_all=False)

    def compile_job(job, topology):
        change = job.overrides[1:]
        compiled.append(change)
        return CompiledStep(hbm_bytes=15.75 * gib, total_bytes=sizes[change] * gib, optimal_s=0.5)

    monkeypatch.setattr(plan, "lower", lower)
    monkeypatch.setattr(plan, "compile_job", compile_job)
    monkeypatch.setattr(plan, "grad_accum_in_schema", lambda: True)
    planner = plan.Planner("v5e-8", tmp_path, workers=1, progress=lambda line: None)
    (row,) = planner.plan([plan.Job("g", "v", ("x=1",))])
    assert compiled == list(sizes)  # the job, then each change in order until one fits
    assert row.fits is False and row.change == "mesh.data=1 mesh.fsdp=-1" and row.total_gib == 40
    assert row.estimate.total_s == pytest.approx(0.5) and row.pod_hours == pytest.approx(100 * 0.5 / 3600)


def test_a_compile_error_is_its_rows_note_and_the_plan_goes_on(tmp_path, monkeypatch):
    """A kernel that fails to compile (Mosaic raises its own exception type, not XLA's) ends that
    variant's row with the error's first line; the other variants are planned."""
    class MosaicError(Exception):
        pass

    def lower(job, topology):
        return plan.Lowered(key=job.variant, steps=10, global_batch=8, per_device_batch=1, remat=False)

    def compile_job(job, topology):
        if job.variant == "bad":
            raise MosaicError("INTERNAL: Mosaic failed to compile TPU kernel: Invalid vector type for load\nmore")
        return CompiledStep(hbm_bytes=16 * 2**30, total_bytes=2**30, optimal_s=0.1)

    monkeypatch.setattr(plan, "lower", lower)
    monkeypatch.setattr(plan, "compile_job", compile_job)
    planner = plan.Planner("v5e-8", tmp_path, workers=1, progress=lambda line: None)
    bad, good = planner.plan([plan.Job("g", "bad"), plan.Job("g", "good")])
    assert bad.note == ("compile failed: MosaicError: INTERNAL: Mosaic failed to compile TPU kernel: Invalid vector "
                        "type for load") and bad.pod_hours is None
    assert good.fits and good.pod_hours == pytest.approx(10 * 0.1 / 3600)


def test_fix_candidates_in_order(monkeypatch):
    """remat, then the batch per chip divided by the power of two that covers the overshoot (and
    twice that), as gradient accumulation where the schema has it, else a smaller global batch;
    then FSDP."""
    low = plan.Lowered(key="k", global_batch=64, per_device_batch=8, remat=False, fsdp_over_all=False)
    step = CompiledStep(hbm_bytes=15.75 * 2**30, total_bytes=40 * 2**30, stopped=True)
    fsdp = ("mesh.data=1", "mesh.fsdp=-1")
    monkeypatch.setattr(plan, "grad_accum_in_schema", lambda: False)
    assert plan.fix_candidates(low, step) == [("arch.remat=true",), ("train.global_batch_size=16",),
                                              ("train.global_batch_size=8",), fsdp]
    monkeypatch.setattr(plan, "grad_accum_in_schema", lambda: True)
    assert plan.fix_candidates(low, step)[1:3] == [("train.grad_accum_steps=4",), ("train.grad_accum_steps=8",)]
    done = dataclasses.replace(low, remat=None, per_device_batch=1, fsdp_over_all=True)
    assert plan.fix_candidates(done, step) == []  # no knob, one example per chip, already FSDP


@pytest.mark.slow
def test_steps_of_an_epoch_schedule_over_a_set_not_here_are_unknown(tmp_path):
    """An SFT set that is not on this machine has no size, so train.epochs gives no step count
    (and the row no pod-hours) until data.path points at the built set; train.steps always does."""
    job = plan.Job("gemma_sft", "tiny_cpu", (f"data.path={tmp_path}/absent", "train.global_batch_size=8"))
    by_epochs = plan.lower(dataclasses.replace(job, overrides=job.overrides + ("train.steps=null", "train.epochs=2")),
                           "v5e-8")
    assert by_epochs.key and by_epochs.steps == 0 and "steps unknown" in by_epochs.note
    assert plan.lower(job, "v5e-8").steps == 600
    assert not (tmp_path / "absent").exists()
