"""compile_only=<topology>: the real train step compiled for a TPU slice on this CPU machine (libtpu's
compile-only devices), its memory/FLOPs/collectives printed, exit 0 if it fits and 5 if not."""

from __future__ import annotations

import re

import pytest

from helpers import assert_exit_one_line, child_env, run_pretrain
from runtime import wire
from runtime.compile_only import collective_bytes, slice_shape, TOPOLOGIES
from runtime.errors import EXIT_DOES_NOT_FIT, EXIT_USER_ERROR


def compile_only(tmp_path, topology: str, *extra: str):
    # generate_if_missing (the default data config) with no dataset: shapes come from the builder's constants.
    # Its events on stdout, as a launch guard asks for them (runtime/wire.py EVENTS_ENV).
    return run_pretrain([f"compile_only={topology}", f"run.root={tmp_path}/runs", f"data.path={tmp_path}/data",
                         *extra], check=False, timeout=180, env=child_env(**{wire.EVENTS_ENV: "1"}))


def table(stdout: str) -> dict[str, str]:
    return dict(re.findall(r"^  (\S+) +(.+)$", stdout, re.M))


def to_bytes(text: str) -> float:
    value, unit = re.match(r"([\d.]+) (GiB|MiB|KiB|B)\b", text).groups()
    return float(value) * {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}[unit]


def step_seconds(rows: dict[str, str]) -> tuple[float, float]:
    """(estimated step time, its compute part) from the step_time row, in seconds."""
    (total, unit), (compute, unit2) = re.findall(r"([\d.e+-]+) (ms|s)\b", rows["step_time"])[:2]
    return float(total) * (1e-3 if unit == "ms" else 1), float(compute) * (1e-3 if unit2 == "ms" else 1)


def assert_refused(proc, *needles: str) -> None:
    assert_exit_one_line(proc, EXIT_USER_ERROR, *needles)
    assert "compile_s" not in proc.stdout  # failed before compiling


@pytest.mark.slow
@pytest.mark.parametrize("topology,devices,hosts,hbm", [("v4-64", 32, 8, "30.75 GiB"), ("v5e-8", 8, 1, "15.75 GiB")])
def test_default_config_fits(tmp_path, topology, devices, hosts, hbm):
    proc = compile_only(tmp_path, topology)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(proc.stdout)
    rows = table(proc.stdout)
    assert rows["devices"] == str(devices)
    assert rows["hosts"].startswith(f"{hosts} ({devices // hosts} chips each)")
    assert rows["mesh"] == f"data={devices} fsdp=1 tensor=1"
    for key in ("arguments", "outputs", "temporaries", "total"):
        assert to_bytes(rows[key]) > 0, rows
    assert 0 < to_bytes(rows["aliased"]) <= to_bytes(rows["arguments"])  # the state is donated
    assert f"of {hbm} HBM" in rows["total"]
    assert float(rows["flops_per_step"].split()[0]) > 0 and "(no loops)" in rows["xla_flops"]
    ops, size = re.match(r"(\d+) ops, (.+) per chip", rows["all-reduce"]).groups()  # data parallel: gradient all-reduce
    assert int(ops) >= 1 and to_bytes(size) > 0
    total, compute = step_seconds(rows)
    assert total >= compute > 0 and "(estimate)" in rows["step_time"] and "(no loops)" in rows["step_time"]
    assert 0 < float(re.match(r"([\d.]+)%", rows["mfu_estimate"]).group(1)) < 100
    assert proc.stdout.rstrip().splitlines()[-1].startswith("fits: ")
    assert not (tmp_path / "data").exists()  # nothing built, nothing read


@pytest.mark.slow
def test_oversize_model_does_not_fit(tmp_path):
    # ~2.1e9 parameters replicated (data parallel): f32 params + Adam moments = 24 GiB per chip before activations.
    proc = compile_only(tmp_path, "v5e-8", "arch.hidden=8192", "arch.layers=2", "arch.heads=64")
    assert proc.returncode == EXIT_DOES_NOT_FIT, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(proc.stdout)
    said = [l for l in proc.stdout.splitlines() if l.startswith("does not fit")]
    assert len(said) == 1, proc.stdout
    m = re.fullmatch(r"does not fit: ([\d.]+) GiB per chip > 15.75 GiB HBM of TPU v5e", said[0])
    assert m and float(m.group(1)) > 15.75, said
    failed = [e for e in map(wire.event, proc.stdout.splitlines()) if e and e["event"] == "failed"]
    assert [(e["exit_code"], e["failure"], e["line"]) for e in failed] == [(EXIT_DOES_NOT_FIT, "does-not-fit", said[0])]
    assert to_bytes(table(proc.stdout)["arguments"]) > 20 * 2**30


@pytest.mark.slow
def test_recursive_model_flops_formula_and_unrolled_compile(tmp_path):
    """TRM recurses under loops, and with gradient accumulation scans over micro-batches: XLA's
    count of the compiled step (each loop body once) is below the formula (which counts the whole
    global batch); the analysis compile with the loops unrolled agrees with it within 10%."""
    proc = compile_only(tmp_path, "v5e-8", "arch=trm_att", "arch.hidden=128", "arch.H_cycles=3", "arch.L_cycles=2",
                        "arch.L_layers=1", "train.global_batch_size=16", "train.grad_accum_steps=2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = table(proc.stdout)
    assert rows["grad_accum"].startswith("2 micro-batches of 8 (1 per device) per step")
    formula, looped, unrolled = (float(rows[k].split()[0])
                                 for k in ("flops_per_step", "xla_flops", "xla_flops_unrolled"))
    assert "model FLOPs by formula" in rows["flops_per_step"] and "each loop body once" in rows["xla_flops"]
    assert rows["compute_dtype"] == "bfloat16"  # "auto" on the TPU, though this host is a CPU
    assert looped < 0.75 * formula and abs(formula - unrolled) <= 0.1 * unrolled, rows
    total, compute = step_seconds(rows)  # every iteration of the loops counted, by the compiler's cycle estimates
    assert total >= compute > 0 and "for its loops' iterations" in rows["step_time"], rows["step_time"]
    assert "xla_time_unrolled" in rows


def test_mesh_that_does_not_match_topology(tmp_path):
    assert_refused(compile_only(tmp_path, "v5e-8", "mesh.data=3"), "3 devices, but this job has 8")


def test_batch_that_does_not_divide_over_hosts(tmp_path):
    # v5e-16 is 4 hosts x 4 chips; data=2 x tensor=8 puts 2 batch shards over 4 hosts.
    proc = compile_only(tmp_path, "v5e-16", "mesh.data=2", "mesh.tensor=8", "train.global_batch_size=6")
    assert_refused(proc, "global_batch_size=6", "does not divide over 4 processes")


@pytest.mark.parametrize("name", ["v5e-7", "v9-8", "tpu", "v4-6"])
def test_unknown_topology(tmp_path, name):
    assert_refused(compile_only(tmp_path, name), f"compile_only={name} is not a known TPU topology",
                          "v4-{8,16,32,64,", "v5e-{1,4,8,16,")


def test_slice_shapes():
    shapes = {n: slice_shape(TOPOLOGIES[n.split("-")[0]], int(n.split("-")[1]) // TOPOLOGIES[n.split("-")[0]].cores_per_name_unit)
              for n in ("v4-8", "v4-32", "v4-64", "v4-128", "v5p-8", "v5e-1", "v5e-8", "v5e-32", "v6e-256")}
    assert shapes == {"v4-8": [2, 2, 1], "v4-32": [2, 2, 4], "v4-64": [2, 4, 4], "v4-128": [4, 4, 4],
                      "v5p-8": [2, 2, 1], "v5e-1": [1, 1], "v5e-8": [2, 4], "v5e-32": [4, 8], "v6e-256": [16, 16]}


def test_collective_bytes_counts_each_channel_once():
    hlo = """HloModule m

%all-reduce-scatter.1 (input_0: f32[64,8]) -> f32[8,8] {
  %input_0 = f32[64,8]{1,0} parameter(0)
  %all-reduce.3 = f32[64,8]{1,0:T(8,128)} all-reduce(%input_0), channel_id=7, replica_groups={}, to_apply=%add
}

%fused_computation.1 (param_0.1: bf16[4,16]) -> bf16[32,16] {
  %param_0.1 = bf16[4,16]{1,0} parameter(0)
  ROOT %all-gather.1 = bf16[32,16]{1,0} all-gather(%param_0.1), channel_id=3, dimensions={0}
}

%async_collective_fusion.2 (param_0.2: bf16[4,16]) -> bf16[32,16] {
  %param_0.2 = bf16[4,16]{1,0} parameter(0)
  ROOT %all-gather.2 = bf16[32,16]{1,0} all-gather(%param_0.2), channel_id=3, dimensions={0}
}

ENTRY %main.1 (p0: f32[128], p1: s32[2]) -> f32[128] {
  %p0 = f32[128]{0} parameter(0)
  %p1 = s32[2]{0} parameter(1)
  %all-reduce.1 = (f32[128]{0:T(128)}, /*index=1*/s32[2]{0}) all-reduce(%p0, /*index=1*/%p1), channel_id=1, to_apply=%add
  %collective-permute-start = (f32[128]{0}, f32[128]{0}, u32[], u32[]) collective-permute-start(%p0), channel_id=2
  %collective-permute-done = f32[128]{0} collective-permute-done(%collective-permute-start)
  ROOT %r = f32[128]{0} add(%p0, %collective-permute-done)
}
"""
    assert collective_bytes(hlo) == {"all-reduce": (1, 128 * 4 + 2 * 4), "all-gather": (1, 32 * 16 * 2),
                                     "reduce-scatter": (1, 64 * 8 * 4), "all-to-all": (0, 0),
                                     "collective-permute": (1, 128 * 4)}


def test_expected_local_devices_per_worker():
    from runtime.compile_only import expected_local_devices

    # one host up to 4 (v4/v5p) or 8 (v5e/v6e) chips, else 4 chips per host
    assert [expected_local_devices(t) for t in ("v4-8", "v4-64", "v5p-8", "v5litepod-8", "v5litepod-16", "v6e-4")] == \
        [4, 4, 4, 8, 4, 4]
