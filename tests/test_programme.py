"""The experiment programme's configs: every group folder is complete, every variant of every
group composes, validates and changes only the keys its group.yaml says the group varies; the
group files are checked; the listing; the scaled-down overrides."""

from __future__ import annotations

import itertools
import json
import math
import shutil
import subprocess
import sys

import pytest
import yaml

from helpers import REPO, child_env
from experiments import analyze, examples, launch, programme, sweep
from experiments.examples import tiny
from experiments.compose import changes, compose, flat, local_overrides, variants
from experiments.programme import GROUPS, GroupFileError, load_group
from runtime.config import validate

PRESETS = ("arch", "data", "optim", "mesh")  # a swapped config group shows up under its own name


def test_every_group_is_a_complete_folder():
    assert GROUPS, "no experiments/<group>/group.yaml found"
    for name, group in GROUPS.items():
        folder = programme.EXPERIMENTS_DIR / name
        assert (folder / "README.md").is_file(), f"{name}: write experiments/{name}/README.md"
        assert variants(name), name
        validate(compose(group.base), group.base)  # the base it varies is an experiment that composes
    readmes = {p.parent.name for p in programme.EXPERIMENTS_DIR.glob("*/README.md")}
    assert readmes == set(GROUPS), "a group folder without group.yaml (or the other way round)"


@pytest.mark.parametrize("group", list(GROUPS))
def test_each_variant_changes_only_what_its_group_varies(group):
    spec = GROUPS[group]
    got = {v: changes(group, v) for v in variants(group)}
    for variant, change in got.items():
        stray = sorted(set(change) - set(spec.varies_keys) - set(PRESETS))
        assert not stray, f"{group}/{variant} also changes {stray}; not in varies_keys {list(spec.varies_keys)}"
        validate(compose(f"{group}/{variant}"), f"{group}/{variant}")  # the typed schema accepts it
    changed = set().union(*got.values())
    unused = sorted(set(spec.varies_keys) - changed)
    assert not unused, f"{group}: no variant changes {unused}; drop them from varies_keys"
    for a, b in itertools.combinations(got, 2):
        assert got[a] != got[b], f"{group}/{a} and {group}/{b} run the same setting"
    for variant, change in got.items():
        assert (change == {}) == (variant == spec.baseline_variant), (
            f"{group}/{variant}: only the baseline variant ({spec.baseline_variant}) may change nothing")


def test_derived_values_follow_their_rules():
    """The rules EXPERIMENTS.md states, on every variant they apply to (interpolations resolved)."""
    for v in variants("exp06"):  # lr = 1e-4 * sqrt(batch / 6144)
        c = validate(compose(f"exp06/{v}"), v)
        assert c.optim.lr == pytest.approx(1e-4 * math.sqrt(c.train.global_batch_size / 6144), rel=1e-12), v
    for v in variants("exp01"):  # puzzle_emb_ndim follows the width
        c = validate(compose(f"exp01/{v}"), v)
        assert c.arch.puzzle_emb_ndim == c.arch.hidden, v
    for group in ("exp04a", "exp04b"):  # each variant reads its own set, named after its sizes
        for v in variants(group):
            d = validate(compose(f"{group}/{v}"), v).data
            assert d.path.endswith(f"sudoku-extreme-{d.generate_puzzles}-aug-{d.generate_num_aug}"), v
    for v in variants("gemma03"):  # alpha = 2 x rank
        a = validate(compose(f"gemma03/{v}"), v).arch
        assert a.lora_alpha == 2 * a.lora_rank, v


def test_the_baseline_is_the_reference_setting():
    config = validate(compose("baseline/trm_sudoku_extreme"), "baseline/trm_sudoku_extreme")
    a, o, t = config.arch, config.optim, config.train
    assert (a.name, a.mlp_t, a.pos_encodings, a.forward_dtype) == ("trm", True, "none", "auto")  # bf16 on TPU
    assert (a.L_layers, a.H_cycles, a.L_cycles, a.hidden, a.heads, a.expansion) == (2, 3, 6, 512, 8, 4.0)
    assert (a.halt_max_steps, a.halt_exploration_prob, a.puzzle_emb_ndim) == (16, 0.1, 512)
    assert (o.name, o.lr, o.lr_min_ratio, o.warmup_steps, o.weight_decay, o.b1, o.b2, o.ema_rate) == (
        "adam_atan2", 1e-4, 1.0, 2000, 1.0, 0.9, 0.95, 0.999)
    assert (t.global_batch_size, t.epochs, t.eval_every_epochs, t.checkpoint_every_epochs) == (6144, 50000, 5000, 5000)
    assert (config.data.generate_puzzles, config.data.generate_num_aug) == (1000, 1000)


def test_listing_shows_every_group_and_variant(capsys):
    assert launch.main(["list"]) == 0
    out = capsys.readouterr().out
    for group in GROUPS:
        assert f"{group}: {GROUPS[group].title}" in out
        for variant in variants(group):
            line = next(l for l in out.splitlines() if f" {group}/{variant} " in l)
            assert ("the baseline" in line) == (changes(group, variant) == {})
            assert line.lstrip().startswith("*") == (variant == GROUPS[group].baseline_variant)
    assert "exp06/batch1536" in out and "optim.lr=5e-05 train.global_batch_size=1536" in out
    assert launch.main(["list", "exp99"]) == 2


# ---------------------------------------------------------------------------- group.yaml


def _group_file(tmp_path, edit) -> "object":
    """A copy of exp01's folder with `edit` applied to its group.yaml (a dict -> a dict or text)."""
    folder = tmp_path / "exp01"
    shutil.copytree(programme.EXPERIMENTS_DIR / "exp01", folder)
    raw = yaml.safe_load((folder / "group.yaml").read_text())
    new = edit(raw)
    (folder / "group.yaml").write_text(new if isinstance(new, str) else yaml.safe_dump(new))
    return folder


def test_the_group_file_is_what_groups_holds(tmp_path):
    assert load_group(_group_file(tmp_path, lambda raw: raw)) == GROUPS["exp01"]


@pytest.mark.parametrize("edit, says", [
    (lambda r: r | {"colour": "red"}, "unknown key(s) ['colour']"),
    (lambda r: {k: v for k, v in r.items() if k != "varies_keys"}, "missing key(s) ['varies_keys']"),
    (lambda r: r | {"baseline_variant": "hidden999"}, "no variant file(s) ['hidden999'] in conf/experiment/exp01/"),
    (lambda r: r | {"smoke_variants": ["hidden256", "nope"]}, "no variant file(s) ['nope']"),
    (lambda r: r | {"plots": [{"y": "eval/exact_accuracy"}]}, "plots[0] must be a mapping with y, x"),
    (lambda r: r | {"plots": []}, "plots must be a non-empty list"),
    (lambda r: r | {"example_variants": [False]}, 'quote a name YAML reads as another type, e.g. "off"'),
    (lambda r: r | {"varies_keys": []}, "varies_keys is empty"),
    (lambda r: r | {"target": "high"}, "target must be a number"),
    (lambda r: r | {"title": None}, "title must be a non-empty string"),
    (lambda r: "- just\n- a list\n", "expected a mapping"),
    (lambda r: "title: [unclosed\n", "cannot read it"),
])
def test_a_bad_group_file_is_one_line_naming_it(tmp_path, edit, says):
    with pytest.raises(GroupFileError) as e:
        load_group(_group_file(tmp_path, edit))
    message = str(e.value)
    assert message.startswith("experiments/exp01/group.yaml: ") and says in message and "\n" not in message


def test_commands_report_a_bad_group_file_as_one_error_line(tmp_path, monkeypatch, capsys):
    _group_file(tmp_path, lambda r: r | {"colour": "red"})
    monkeypatch.setattr(programme, "EXPERIMENTS_DIR", tmp_path)
    monkeypatch.setattr(GROUPS, "_groups", None)  # load again, from tmp_path
    for command in (lambda: launch.main(["list"]), lambda: launch.main(["sweep", "exp01", "--local", "--dry-run"]),
                    lambda: analyze.main(["exp01"])):
        assert command() == 2
        err = capsys.readouterr().err
        assert err.startswith("error: experiments/exp01/group.yaml: unknown key(s) ['colour']") and err.count("\n") == 1
    for argv in (["exp01"], ["--smoke"]):
        assert examples.main([*argv, "--root", str(tmp_path / "out")]) == 2
        assert capsys.readouterr().err.startswith("error: experiments/exp01/group.yaml:")


# ----------------------------------------------------------------------------- scaled down


def _as_dict(overrides: list[str]) -> dict[str, str]:
    return dict(o.split("=", 1) for o in overrides)


def test_scaled_down_runs_keep_each_group_s_ratios():
    o = _as_dict(local_overrides("exp01", "hidden256"))
    assert (o["arch.hidden"], o["arch.heads"], o["train.global_batch_size"]) == ("32", "1", "64")
    o = _as_dict(local_overrides("exp01", "hidden512"))
    assert (o["arch.hidden"], o["arch.heads"]) == ("64", "2")
    o = _as_dict(local_overrides("exp06", "batch1536"))
    assert o["train.global_batch_size"] == "16" and float(o["optim.lr"]) == pytest.approx(1e-3 * 0.5)
    o = _as_dict(local_overrides("exp08", "ema0.9995"))  # 1 - rate keeps its ratio: 0.0005/0.001 of 0.01
    assert float(o["optim.ema_rate"]) == pytest.approx(0.995)
    assert _as_dict(local_overrides("exp08", "off"))["optim.ema_rate"] == "null"
    o = _as_dict(local_overrides("exp02a", "L12"))  # not a scaled key: the variant's value stays
    assert "arch.L_cycles" not in o and o["arch.hidden"] == "64"
    local = validate(compose("exp02a/L12", tuple(local_overrides("exp02a", "L12"))), "exp02a/L12")
    assert (local.arch.L_cycles, local.arch.hidden, local.arch.puzzle_emb_ndim, local.train.steps) == (12, 64, 64, 300)
    o = _as_dict(local_overrides("gemma03", "rank64"))
    assert (o["arch"], o["arch.lora_rank"], o["arch.lora_alpha"]) == ("gemma_tiny", "64", "128")
    local = validate(compose("gemma01/gemma2_2b_lora", tuple(local_overrides("gemma01", "gemma2_2b_lora"))), "x/y")
    assert (local.arch.name, local.arch.lora_rank, local.data.name) == ("gemma_tiny", 16, "sft")


# ------------------------------------------------------------------------------ sweep --local


def _experiment_of(cmd: list[str]) -> list[str]:
    return next(c for c in cmd if c.startswith("+experiment=")).split("=", 1)[1].split(",")


def test_local_sweep_is_one_multirun_and_goes_on_after_a_failed_job(tmp_path, capsys):
    """A multirun stops at a failed job; the sweep starts another with the variants after it and
    reads every job's exit code from its manifest (the process's code where it left none)."""
    outcome = {"hidden256": ("completed", 0), "hidden384": ("failed", 3), "hidden512": None,  # died, no manifest
               "hidden768": ("completed", 0)}
    calls = []

    def fake_multirun(cmd):
        calls.append(cmd)
        assert cmd[2] == "-m" and cmd[1].endswith("pretrain_jax.py")
        for experiment in _experiment_of(cmd):
            variant = experiment.rsplit("/", 1)[1]
            if outcome[variant] is None:
                return 7
            status, code = outcome[variant]
            (tmp_path / "exp01" / variant).mkdir(parents=True, exist_ok=True)
            (tmp_path / "exp01" / variant / "run_manifest.json").write_text(
                json.dumps({"status": status, "exit_code": code}))
            if code:
                return code
        return 0

    jobs = sweep.run_local("exp01", list(outcome), tmp_path, ["train.seed=1"], call=fake_multirun)
    assert [(j.run, j.code) for j in jobs] == [("hidden256", 0), ("hidden384", 3), ("hidden512", 7), ("hidden768", 0)]
    assert [_experiment_of(c) for c in calls] == [[f"local/exp01/{v}" for v in vs] for vs in (
        list(outcome), ["hidden512", "hidden768"], ["hidden768"])]
    assert all(c[-1] == "train.seed=1" and f"run.root={tmp_path}" in c and "run.group=exp01" in c for c in calls)


def test_sweep_dry_run_prints_the_multirun(tmp_path, capsys):
    assert launch.main(["sweep", "exp01", "--local", "--variants", "hidden256,hidden512", "--root", str(tmp_path),
                        "--dry-run", "--", "train.seed=0,1"]) == 0
    out = capsys.readouterr().out
    assert out.count("$ ") == 1 and " -m " in out
    assert "+experiment=local/exp01/hidden256,local/exp01/hidden512 run.group=exp01" in out and "train.seed=0,1" in out
    assert launch.main(["sweep", "exp01", "--local", "--variants", "hidden999", "--dry-run"]) == 2


@pytest.mark.parametrize("group", list(GROUPS))
def test_the_generated_scaled_experiment_is_the_scaled_down_run(group, tmp_path):
    """What the multirun composes (the generated file) is what `local_overrides` gives."""
    spec = GROUPS[group]
    chosen = list(dict.fromkeys(spec.example_variants + spec.smoke_variants))
    searchpath = sweep.write_scaled(group, chosen, tmp_path)
    for v in chosen:
        got = flat(compose(f"{sweep.SCALED}/{group}/{v}", (f"hydra.searchpath=[file://{searchpath}]",)))
        want = flat(compose(f"{group}/{v}", tuple(local_overrides(group, v))))
        assert got == want, f"{group}/{v}: {set(got.items()) ^ set(want.items())}"


@pytest.mark.slow
def test_local_sweep_runs_each_variant_in_its_own_run(tmp_path, capsys):
    data = tmp_path / "data"
    env = child_env(1, PODRUNNER_LOCAL_DATA=str(data))
    code = subprocess.call([sys.executable, "experiments/launch.py", "sweep", "exp02a", "--local", "--variants",
                            "L2,L6", "--root", str(tmp_path), "--", *tiny(1), "data.generate_puzzles=20",
                            "train.global_batch_size=8"],  # the local scale's 64 costs 10 s a step at -O0
                           cwd=REPO, env=env, stdout=open(tmp_path / "sweep.log", "w"), stderr=subprocess.STDOUT)
    log = (tmp_path / "sweep.log").read_text()
    assert code == 0, log[-3000:]
    assert log.count("$ ") == 1 and "exp02a/L2                   exit 0" in log and "exp02a/L6" in log
    for variant, cycles in (("L2", 2), ("L6", 6)):
        manifest = json.loads((tmp_path / "exp02a" / variant / "run_manifest.json").read_text())
        assert (manifest["status"], manifest["config"]["arch"]["L_cycles"]) == ("completed", cycles)
        assert manifest["config"]["arch"]["hidden"] == 64  # scaled down


def test_a_sweep_without_local_points_at_programme_submit(capsys):
    """A group's variants on a slice are a programme of one group (`programme submit`): one way."""
    assert launch.main(["sweep", "exp02a", "--variants", "L2,L6", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "programme submit NAME exp02a --slice TPU" in err[0]


def test_natural_order_by_value_and_never_by_the_order_found():
    """One sort key for variant files, group folders and analysed runs (experiments/programme.py)."""
    names = ["lr2", "hidden1024", "lr0.5", "hidden256_train.seed=1", "x01", "hidden256", "10x", "x1", "a"]
    want = ["10x", "a", "hidden256", "hidden256_train.seed=1", "hidden1024", "lr0.5", "lr2", "x01", "x1"]
    for order in (names, names[::-1]):
        assert sorted(order, key=programme.natural_key) == want
