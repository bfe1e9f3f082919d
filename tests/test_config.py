"""Config composition, validation into a frozen typed object, and derived numbers."""

from __future__ import annotations

import dataclasses

import pytest

from helpers import REPO, compose_config
from runtime.config import Config, derive, register_schemas, resolve_compute_dtype, resolve_mesh_shape, to_dict
from runtime.errors import UserError

register_schemas()



def test_defaults_validate_into_frozen_typed_config():
    config = compose_config([])
    assert isinstance(config, Config)
    assert config.arch.name == "tiny_transformer" and config.arch.hidden == 64
    assert config.run.group == "default" and config.run.name == "default"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.train.steps = 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.arch.hidden = 5


def test_auto_compute_dtype_is_the_platform_s_or_the_resumed_checkpoint_s():
    from runtime.trainer import check_resumable

    auto = compose_config(["arch=trm_mlp"])
    assert auto.arch.forward_dtype == "auto"
    on_cpu, on_tpu = resolve_compute_dtype(auto, "cpu"), resolve_compute_dtype(auto, "tpu")
    assert (on_cpu.arch.forward_dtype, on_tpu.arch.forward_dtype) == ("float32", "bfloat16")
    assert resolve_compute_dtype(auto, "cpu", {"forward_dtype": "bfloat16"}).arch.forward_dtype == "bfloat16"
    assert resolve_compute_dtype(on_tpu, "cpu") is on_tpu  # resolved or explicit: kept
    with pytest.raises(dataclasses.FrozenInstanceError):
        on_cpu.arch.forward_dtype = "float16"
    # A checkpoint written in bfloat16 (on a TPU, or before "auto" existed) resumes under "auto" on
    # any machine; an explicit dtype that differs from it is still refused.
    meta = {"config": to_dict(on_tpu), "data_position": {"train_examples": 100}}
    check_resumable(meta, auto, 100, "ckpt", 5)
    with pytest.raises(UserError, match="arch.forward_dtype='bfloat16', this run has 'float32'"):
        check_resumable(meta, compose_config(["arch=trm_mlp", "arch.forward_dtype=float32"]), 100, "ckpt", 5)


def test_overrides_and_experiment_naming():
    config = compose_config(["optim.lr=0.5", "+experiment=example/small"])
    assert config.train.steps == 100 and config.optim.lr == 0.5  # the variant's value, and the override's
    assert (config.run.group, config.run.name) == ("example", "small")
    config = compose_config(["train.steps=7", "+experiment=example/small"])
    assert config.train.steps == 7  # the command line wins over the variant file
    assert (config.run.group, config.run.name) == ("example", "small")


@pytest.mark.parametrize("override", ["train.stepz=3", "arch.hiden=3", "optim.lr=abc", "train.steps=1.5",
                                      "mesh.data=x", "arch=no_such_arch"])
def test_bad_overrides_raise(override):
    with pytest.raises(Exception):
        compose_config([override])


def test_steps_or_epochs_exactly_one():
    with pytest.raises(UserError, match="exactly one of train.steps and train.epochs"):
        compose_config(["train.epochs=2"])
    config = compose_config(["train.steps=null", "train.epochs=2.5"])
    plan = derive(config, num_processes=2, num_devices=8, train_examples=2000)
    assert plan.steps_per_epoch == 2000 / 64 and plan.total_steps == 79  # ceil(2.5 * 31.25)


@pytest.mark.parametrize("overrides", [["run.lease.renew_every_s=0"], ["run.lease.stale_after_s=-1"],
                                       ["run.lease.renew_every_s=60", "run.lease.stale_after_s=60"]])
def test_lease_periods_must_leave_room_for_missed_renewals(overrides):
    with pytest.raises(UserError, match="run.lease needs 0 < renew_every_s < stale_after_s"):
        compose_config([*overrides])
    assert compose_config([]).run.lease.renew_every_s == 30 and compose_config([]).run.lease.stale_after_s == 90


def test_puzzle_epochs_count_one_augmented_copy_per_puzzle():
    """The reference's epoch: total_groups x mean_puzzle_examples examples, so the baseline's
    50k epochs of 1000 puzzles x 1000 augmentations at batch 6144 are ~8.1k steps, not 8.1M;
    and evals every 5000 epochs (the baseline's cadence) come every 814 steps."""
    config = compose_config(["+experiment=baseline/trm_sudoku_extreme"])
    plan = derive(config, num_processes=8, num_devices=32, train_examples=1000 * 1001, epoch_examples=1000)
    assert plan.total_steps == 8139 and plan.eval_every == plan.checkpoint_every == 814  # ceil(5e7 / 6144); 5e6 / 6144
    assert plan.epoch_examples == 1000 and plan.epochs == pytest.approx(50000, rel=1e-3)
    whole = derive(config, num_processes=8, num_devices=32, train_examples=1000 * 1001)
    assert whole.total_steps == 1000 * 1001 * 50000 // 6144 + 1  # without it: passes over every augmented row


def test_derived_numbers():
    config = compose_config(["mesh=fsdp", "train.global_batch_size=32", "optim.warmup_steps=1000"])
    plan = derive(config, num_processes=2, num_devices=8, train_examples=1000)
    assert plan.mesh_shape == {"data": 1, "fsdp": 8, "tensor": 1}
    assert plan.per_process_batch_size == 16 and plan.per_device_batch_size == 4
    assert plan.warmup_steps == plan.total_steps == 200  # warmup is capped at the run length
    assert plan.checkpoint_dir == "outputs/default/default/checkpoints"


@pytest.mark.parametrize("mesh,devices,message", [
    ((3, 1, 1), 8, "3 devices, but this job has 8"),
    ((-1, 3, 1), 8, "not divisible by 3"),
    ((2, 2, 1), 8, "4 devices, but this job has 8"),
])
def test_mesh_mismatch_is_user_error(mesh, devices, message):
    from runtime.config import MeshConfig

    with pytest.raises(UserError, match=message):
        resolve_mesh_shape(MeshConfig(*mesh), devices)


def test_batch_must_divide_over_data_and_fsdp():
    config = compose_config(["train.global_batch_size=12", "mesh.data=-1"])
    with pytest.raises(UserError, match="does not divide over data x fsdp = 8"):
        derive(config, num_processes=1, num_devices=8, train_examples=100)
    # tensor-parallel replicas share a batch shard: 12 divides over data x fsdp = 4
    config = compose_config(["train.global_batch_size=12", "mesh.data=-1", "mesh.tensor=2"])
    assert derive(config, num_processes=1, num_devices=8, train_examples=100).per_device_batch_size == 3


def test_cfg_job_prints_the_composed_config():
    from helpers import run_pretrain

    proc = run_pretrain(["--cfg", "job", "train.steps=3", "+experiment=example/small"])
    assert "global_batch_size: 64" in proc.stdout and "  steps: 3\n" in proc.stdout and "hidden: 64" in proc.stdout


def test_option_fields_read_one_list():
    """optim.name takes the keys of runtime.optimizers.OPTIMIZERS (what make_optimizer builds
    from); the closed option sets are Enums in the schema, refused while composing with a line
    that names the choices; the resolved dict holds them as plain strings."""
    from runtime.config import to_dict
    from runtime.errors import one_line
    from runtime.optimizers import OPTIMIZERS

    for name in OPTIMIZERS:
        assert compose_config([f"optim.name={name}"]).optim.name == name
    with pytest.raises(UserError, match=r"optim.name='sgd' is not one of \['adafactor', 'adam_atan2', 'adamw', 'lion'\]"):
        compose_config(["optim.name=sgd"])
    for override, choices in (("optim.state_dtype=bf16", "[float32, bfloat16]"),
                              ("run.wandb.mode=onine", "[online, offline, disabled]"),
                              ("distributed.mode=mpi", "[auto, single, cluster, explicit]")):
        with pytest.raises(Exception) as err:
            compose_config([override])
        line = one_line(err.value)
        assert override in line and f"expected one of {choices}" in line and "$VALUE" not in line, line
    config = compose_config(["optim.state_dtype=bfloat16", "run.wandb.mode=disabled", "distributed.mode=single"])
    assert (config.optim.state_dtype, config.run.wandb.mode, config.distributed.mode) == ("bfloat16", "disabled", "single")
    plain = to_dict(config)
    assert [type(v) for v in (plain["optim"]["state_dtype"], plain["run"]["wandb"]["mode"])] == [str, str]


# Sizes of released models are spelled out in their presets even where they equal the schema's
# (tiny) defaults: the preset is where the model's facts are read.
SPELLED_OUT = {("arch/gemma2_2b", "version"), ("arch/gemma3_1b", "num_heads")}


def test_group_options_hold_only_what_differs_from_the_schema():
    """Each conf/<group>/<option>.yaml sets only keys whose value differs from the schema
    default it extends (one place for each default); interpolations are links, not copies."""
    from omegaconf import OmegaConf

    from runtime.config import DataConfig, MeshConfig, OptimConfig, RunConfig
    from runtime.registry import arch_schemas

    bases = {"base_data": DataConfig, "base_optim": OptimConfig, "base_mesh": MeshConfig, "base_run": RunConfig}
    bases |= {f"base_{name}": schema for name, schema in arch_schemas().items()}
    copies = []
    for path in sorted((REPO / "conf").glob("*/*.yaml")):
        raw = OmegaConf.load(path)
        schema = OmegaConf.structured(bases[raw.defaults[0]])
        option = f"{path.parent.name}/{path.stem}"
        for key in raw:
            if key == "defaults" or OmegaConf.is_interpolation(raw, key) or (option, key) in SPELLED_OUT:
                continue
            if OmegaConf.to_container(raw)[key] == OmegaConf.to_container(schema)[key]:
                copies.append(f"{option}: {key}")
    assert not copies, f"keys equal to the schema default (delete them from the yaml): {copies}"
    assert "train" not in OmegaConf.load(REPO / "conf" / "config.yaml")  # train defaults live in TrainConfig
