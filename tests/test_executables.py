"""Steps compiled ahead (runtime/executables.py): what `plan --executables` keeps, a run reads
instead of compiling, where the plan's manifest (pinned by the digest the run is given) vouches for
the file; anything else (another program's file under the name, a crafted file, a changed manifest)
is one warning and a compile, nothing of it unpickled, and the run's numbers are the same either
way. The plan's side runs here on this process's CPU devices, the run's "topology"; on a pod it is
the slice's TPU topology (the same code, `planner._build`)."""

from __future__ import annotations

import dataclasses
import json
import logging
import pickle
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.plan import planner
from helpers import base_overrides, compose_config, train, train_losses
from runtime import compile_cache, executables
from runtime.errors import UserError

EXPERIMENT = ("example", "small")


def mesh_and_input():
    """The test's mesh over this process's devices and an input on it. Made per test, not at
    import: a test before this one in the process may have started the CPU backend anew with
    another device count (the devices(n) mark), which leaves arrays made earlier on old devices."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    return mesh, jax.device_put(jnp.arange(4.0), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def step(factor: float):
    """A step; another factor is another program (as a variant with another learning rate)."""
    return jax.jit(lambda x: x * factor)


@pytest.fixture
def kept(tmp_path):
    """A folder as the plan leaves it (the steps of factor 2 and 3, and its manifest): (the
    folder, the two keys, the manifest's digest)."""
    folder, programs = str(tmp_path / "ahead"), {}
    mesh, x = mesh_and_input()
    for factor in (2.0, 3.0):
        lowered = step(factor).lower(x)
        key = executables.key_of(lowered, mesh)
        with compile_cache.off():
            programs[key] = executables.save(lowered.compile(), folder, key, tmp_path / "written")
    return folder, list(programs), executables.write_manifest(folder, programs)


def run(folder: str, digest: str, caplog) -> tuple[list, list[str], list[str]]:
    """The step of factor 2, then of factor 3, through a run's `Ahead`: their outputs, the
    warning lines, the lines that say a step was loaded."""
    caplog.clear()
    mesh, x = mesh_and_input()
    ahead = executables.Ahead(folder, mesh, digest=digest)
    with caplog.at_level(logging.INFO, logger="runtime"):
        outs = [ahead.wrap(step(f), "step")(x).tolist() for f in (2.0, 3.0)]
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    return outs, warned, [r.getMessage() for r in caplog.records if "loaded the executable" in r.getMessage()]


RIGHT = [[0.0, 2.0, 4.0, 6.0], [0.0, 3.0, 6.0, 9.0]]


def test_a_healthy_folder_loads_every_step(kept, caplog):
    folder, keys, digest = kept
    assert run(folder, digest, caplog) == (RIGHT, [], [f"step: loaded the executable compiled ahead ({k})" for k in keys])


@pytest.mark.parametrize("relabel", [False, True], ids=["copied", "relabelled"])
def test_another_programs_file_under_the_name_is_refused_and_compiled(kept, caplog, relabel):
    """The file of factor 3 copied over the name of factor 2's (and, relabelled, with its header
    claiming the key of the name): one warning naming the file and what differs; the step compiled."""
    folder, (two, three), digest = kept
    data = (executables.epath.Path(folder) / f"{three}{executables.SUFFIX}").read_bytes()
    if relabel:
        data = data.replace(three.encode(), two.encode(), 1)
    (executables.epath.Path(folder) / f"{two}{executables.SUFFIX}").write_bytes(data)
    outs, warned, loaded = run(folder, digest, caplog)
    assert outs == RIGHT and len(loaded) == 1 and len(warned) == 1, warned
    assert f"{two}{executables.SUFFIX} is refused" in warned[0] and "compiling the step instead" in warned[0]
    assert (f"it holds the program {three}, not {two}" if not relabel else "its sha256 is not the one") in warned[0]


class Touch:
    """Unpickled, it creates `marker` (what a crafted file could do instead)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "x")


@pytest.mark.parametrize("form", ["pickle", "with a header", "and a manifest that names it"])
def test_a_crafted_file_runs_nothing_and_the_step_compiles(kept, caplog, tmp_path, form):
    folder, (two, three), digest = kept
    marker = tmp_path / "ran"
    header = json.dumps({"format": executables.FORMAT, "key": two}).encode() + b"\n"
    data = (header if form != "pickle" else b"") + pickle.dumps(Touch(marker))
    (executables.epath.Path(folder) / f"{two}{executables.SUFFIX}").write_bytes(data)
    if form == "and a manifest that names it":  # written over the pinned manifest
        manifest = executables.epath.Path(folder) / f"manifest-{digest.removeprefix('sha256:')}.json"
        manifest.write_text(json.dumps({"format": executables.FORMAT, "programs": {
            two: executables._sha256(data), three: json.loads(manifest.read_text())["programs"][three]}}))
    outs, warned, loaded = run(folder, digest, caplog)
    assert not marker.exists() and outs == RIGHT and len(warned) == 1, warned
    assert len(loaded) == (0 if form == "and a manifest that names it" else 1)


def test_a_changed_or_unknown_manifest_is_refused_and_every_step_compiles(kept, caplog, tmp_path):
    folder, keys, digest = kept
    manifest = executables.epath.Path(folder) / f"manifest-{digest.removeprefix('sha256:')}.json"
    for case, given in (("changed", digest), ("another digest", "sha256:" + "0" * 64)):
        if case == "changed":
            manifest.write_text(manifest.read_text().replace(keys[0], keys[0][::-1]))
        outs, warned, loaded = run(folder, given, caplog)
        assert outs == RIGHT and loaded == [] and len(warned) == 1, (case, warned)
        assert warned[0].startswith(f"run.executables: the manifest {given} in {folder} is refused (")
        assert warned[0].endswith("; compiling every step instead")
    assert "was changed after the plan wrote it" in run(folder, digest, caplog)[1][0]


def test_the_plan_vouches_only_for_the_files_it_wrote(kept, tmp_path):
    """A file in the folder that this machine's plan did not write (its record says which) is
    compiled and written again by the next plan, never put in its manifest unread."""
    folder, (two, three), digest = kept
    written, planted = tmp_path / "written", executables.epath.Path(folder) / f"{two}{executables.SUFFIX}"
    assert executables.kept_already(folder, two, written) == executables.read_manifest(folder, digest)[two]
    planted.write_bytes((executables.epath.Path(folder) / f"{three}{executables.SUFFIX}").read_bytes())
    assert executables.kept_already(folder, two, written) == ""
    assert executables.kept_already(folder, "0" * 32, written) == ""  # none there


def test_a_folder_without_its_manifests_digest_is_one_line():
    with pytest.raises(UserError) as e:
        compose_config(["run.executables=gs://b/exe"])
    assert str(e.value).startswith("run.executables_digest=None: give the sha256:... that `plan --executables` "
                                   "printed") and "\n" not in str(e.value)


@pytest.fixture
def cpu_topology(monkeypatch):
    """`planner._build` for the name "cpu": this process's devices, one host."""
    real = planner._topology
    monkeypatch.setattr(planner, "_topology", lambda name: (None, jax.devices(), 1) if name == "cpu" else real(name))


@pytest.mark.slow
def test_a_run_reads_the_steps_the_plan_kept_and_trains_the_same(sudoku_dir, tmp_path, cpu_topology):
    folder = tmp_path / "ahead"
    common = base_overrides(sudoku_dir, tmp_path / "runs", steps=4)
    run_ = ["+experiment=example/small", *common]
    compiled = train([*run_, "run.name=compiled"])  # first: JAX's persistent cache now holds both programs

    job = planner.Job(*EXPERIMENT, tuple(common))
    programs = dict(planner.keep_job(job, "cpu", str(folder), kind, tmp_path / "cache")
                    for kind in (planner.TRAIN, planner.EVAL))
    assert len(programs) == 2 and len(list(folder.glob(f"*{executables.SUFFIX}"))) == 2
    files = {p.name: p.stat().st_ino for p in folder.iterdir()}
    assert planner.keep_job(job, "cpu", str(folder), planner.TRAIN, tmp_path / "cache") in programs.items()
    assert {p.name: p.stat().st_ino for p in folder.iterdir()} == files  # kept already: not written again
    digest = executables.write_manifest(str(folder), programs)

    ahead = train([*run_, "run.name=ahead", f"run.executables={folder}", f"run.executables_digest={digest}"])
    assert compiled.code == 0 and ahead.code == 0
    assert sum("loaded the executable compiled ahead" in line for line in ahead.log.splitlines()) == 2, ahead.log
    assert "compiled ahead" not in compiled.log
    assert train_losses(tmp_path / "runs" / "test" / "ahead") == train_losses(tmp_path / "runs" / "test" / "compiled")


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
    from experiments.plan import bill

    v = bill.Variant(steps=1000, step_s=0.1, evaluations=2, eval_step_s=0.05, eval_batches=1, final_eval_batches=2,
                     compile_train_s=90.0, compile_eval_s=30.0)
    hit = bill.FIGURES["compile_cache_hit"].seconds
    cold = bill.price(v, bill.FIGURES, mtbf_s=8 * 3600)
    kept = dataclasses.replace(v, train=bill.Program.AHEAD, eval=bill.Program.AHEAD)
    ahead = bill.price(kept, bill.FIGURES, mtbf_s=8 * 3600)
    assert cold.seconds["program_startup"] == pytest.approx((90 + 30) * (1 + cold.preemptions))
    assert ahead.seconds["program_startup"] == pytest.approx(2 * hit * (1 + ahead.preemptions))
