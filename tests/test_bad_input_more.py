"""The bad-input battery: every bad input is one line naming the fix, its documented exit code,
no traceback, nothing compiled, and an existing run (checkpoints, metrics, manifest) and its
dataset byte-identical afterwards.

One tiny run is trained once (`trained`); every case targets the same run.root / run.name /
data.path and hashes the run directory and the dataset before and after. Cases run in process
(conftest.train, with Hydra's composing errors turned into their line as pretrain_jax.py does);
the script and launcher themselves run as subprocesses only where the command line is the point.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, Trained, base_overrides, child_env, cli_refused, run_pretrain, train, tree_hash
from runtime.hydra_compose import config_error

NOT_OURS = "holds no .podrunner-generated marker"


@pytest.fixture(scope="module")
def trained(sudoku_dir, tmp_path_factory) -> Path:
    """run.root of a finished 2-step run (checkpoints at steps 1 and 2) on the session's dataset."""
    root = tmp_path_factory.mktemp("bad-input")
    train(base_overrides(sudoku_dir, root, steps=2))
    assert sorted(p.name for p in (root / "test" / "t" / "checkpoints").iterdir() if p.name.isdigit()) == ["1", "2"]
    return root


def run_in_process(overrides: list[str]) -> Trained:
    """`pretrain_jax.py <overrides>` in this process: a UserError, or a composing error (Hydra,
    OmegaConf, YAML) turned into its line by `config_error` as the script's main() does."""
    try:
        return train(overrides, check=False)
    except Exception as e:
        error = config_error(e)
        if error is None:
            raise
        return Trained(error.exit_code, "", str(error))


def refused(root: Path, data: Path, extra: list[str], *needles: str, code: int = 2, arch: bool = True) -> str:
    """Run the trained run's overrides + `extra`: exit `code` with one line holding `needles`,
    before any compile, the run's directory and `data` unchanged. `arch=False` drops the tiny
    model's arch.* overrides (for another family's arch group)."""
    overrides = [o for o in base_overrides(data, root, steps=2) if arch or not o.startswith("arch.")] + extra
    run_dir = root / "test" / "t"
    before = tree_hash(run_dir), tree_hash(data)
    result = run_in_process(overrides)
    assert result.code == code and result.error, (result.code, result.error, result.log[-2000:])
    assert "\n" not in result.error and "Traceback" not in result.error, result.error
    assert "compiled train step" not in result.log, result.log[-2000:]
    for needle in needles:
        assert needle in result.error, result.error
    assert (tree_hash(run_dir), tree_hash(data)) == before
    return result.error


GEMMA = ["arch=gemma_tiny"]

CONFIG_CASES = {
    # ranges (runtime/config.py _RULES)
    "keep=0": (["run.checkpoint.keep=0"], ["run.checkpoint.keep=0", ">= 1"]),
    "keep=-1": (["run.checkpoint.keep=-1"], ["run.checkpoint.keep=-1", ">= 1"]),
    "steps=-5": (["train.steps=-5"], ["train.steps=-5", "> 0"]),
    "steps=0": (["train.steps=0"], ["train.steps=0", "> 0"]),
    "epochs=-1": (["train.steps=null", "train.epochs=-1"], ["train.epochs=-1.0", "> 0"]),
    "epochs=0": (["train.steps=null", "train.epochs=0"], ["train.epochs=0.0"]),
    "steps and epochs": (["train.epochs=2"], ["exactly one of train.steps and train.epochs"]),
    "log_every=0": (["train.log_every=0"], ["train.log_every=0", ">= 1"]),
    "eval_every=-1": (["train.eval_every=-1"], ["train.eval_every=-1", "0 = only at the end"]),
    "checkpoint_every=-3": (["train.checkpoint_every=-3"], ["train.checkpoint_every=-3", ">= 0"]),
    "eval_every_epochs<0": (["train.eval_every_epochs=-0.5"], ["train.eval_every_epochs=-0.5"]),
    "checkpoint_every_epochs<0": (["train.checkpoint_every_epochs=-1"], ["train.checkpoint_every_epochs=-1.0"]),
    "profile_start_step<0": (["train.profile_start_step=-1"], ["train.profile_start_step=-1"]),
    "profile_steps=0": (["train.profile_start_step=1", "train.profile_steps=0"], ["train.profile_steps=0"]),
    "watchdog<0": (["train.watchdog_timeout_s=-1"], ["train.watchdog_timeout_s=-1.0", "0 = no watchdog"]),
    "batch<0": (["train.global_batch_size=-16"], ["train.global_batch_size=-16"]),
    "seed<0": (["train.seed=-1"], ["train.seed=-1"]),
    "lr<0": (["optim.lr=-1e-3"], ["optim.lr=-0.001"]),
    "b2>1": (["optim.b2=1.5"], ["optim.b2=1.5", "[0, 1)"]),
    "ema=1.5": (["optim.ema_rate=1.5"], ["optim.ema_rate=1.5", "null = no EMA"]),
    "clip=0": (["optim.grad_clip_norm=0"], ["optim.grad_clip_norm=0.0"]),
    "warmup<0": (["optim.warmup_steps=-1"], ["optim.warmup_steps=-1"]),
    "eval_max_examples=0": (["data.eval_max_examples=0"], ["data.eval_max_examples=0"]),
    "generate_puzzles=0": (["data.generate_puzzles=0"], ["data.generate_puzzles=0"]),
    "port=0": (["distributed.port=0"], ["distributed.port=0", "[1, 65535]"]),
    "init timeout=0": (["distributed.initialization_timeout_s=0"], ["distributed.initialization_timeout_s=0"]),
    "liveness port=0": (["distributed.liveness_port=0"], ["distributed.liveness_port=0", "[1, 65535]"]),
    "liveness port>65535": (["distributed.liveness_port=70000"], ["distributed.liveness_port=70000", "[1, 65535]"]),
    "liveness timeout=0": (["distributed.liveness_timeout_s=0"], ["distributed.liveness_timeout_s=0.0", "> 0"]),
    "liveness timeout>heartbeat/2": (["distributed.liveness_timeout_s=60"], [
        "distributed.liveness_timeout_s=60 must be at most half of distributed.heartbeat_timeout_s=100"]),
    # registries and option names
    "unknown data.name": (["data.name=sudokuu"], ["data.name='sudokuu'", "sudoku"]),
    "unknown optimizer": (["optim.name=adamx"], ["optim.name='adamx'", "adamw"]),
    "misspelt arch group": (["arch=tiny_transfomer"], ["arch/tiny_transfomer", "tiny_transformer"]),
    # model families: heads, dtypes
    "tiny heads": (["arch.heads=5"], ["arch.heads=5 does not divide arch.hidden=32"]),
    "tiny dtype": (["arch.dtype=float8"], ["arch.dtype='float8'", "bfloat16", "float32"]),
    "trm heads": (["arch=trm_att", "arch.hidden=48", "arch.heads=5"], ["arch.heads=5 does not divide arch.hidden=48"]),
    "trm dtype": (["arch=trm_mlp", "arch.forward_dtype=fp8"], ["arch.forward_dtype='fp8'", "float16"]),
    "hrm heads": (["arch=hrm", "arch.heads=3"], ["arch.heads=3 does not divide arch.hidden=32"]),
    "trm window": (["arch=trm_att", "arch.attention_window=4"], ["arch.attention_window=4", "odd"]),
    "trm mixer form": (["arch=trm_mlp", "arch.mixer=fused"], ["arch.mixer='fused'", "'auto', 'xla', 'pallas'"]),
    # wrong types, unknown keys
    "int as text": (["train.steps=abc"], ["train.steps", "abc"]),
    "keep as text": (["run.checkpoint.keep=two"], ["run.checkpoint.keep", "two"]),
    "unknown key": (["train.stepz=3"], ["train.stepz"]),
    "added unknown key": (["+run.colour=red"], ["unknown config key run.colour"]),
    "added misspelt key": (["+train.stepz=3"], ["unknown config key train.stepz", "did you mean train.steps?"]),
    # the machine: mesh and batch (a new run.name beside the trained one: its checkpoint's batch
    # size would be refused first)
    "mesh != devices": (["mesh.data=3"], ["3 devices, but this job has 8"]),
    "mesh axis 0": (["mesh.data=0"], ["mesh sizes data=0", "positive"]),
    "two -1 axes": (["mesh.fsdp=-1"], ["at most one -1"]),
    "batch does not divide": (["run.name=new", "train.global_batch_size=12"], ["global_batch_size=12", "multiple of 8"]),
    "batch > dataset": (["run.name=new", "train.global_batch_size=1024"], ["fewer than one global batch"]),
    "batch != checkpoint's": (["train.global_batch_size=32"], ["train.global_batch_size=16", "32", "run.name"]),
    # curriculum
    "ramp without end": (["arch=trm_mlp", "curriculum.L_cycles.start=2"], ["curriculum.L_cycles needs both"]),
    "ramp on a stateless arch": (["curriculum.L_cycles.start=2", "curriculum.L_cycles.end=3"], ["has no L_cycles"]),
    # the existing run
    "resume=false over checkpoints": (["run.checkpoint.resume=false"], ["already holds checkpoints", "run.name"]),
    "incompatible checkpoint": (["arch.hidden=48"], ["arch.hidden=32", "48", "run.name"]),
    "partial distributed values": (["distributed.coordinator_address=127.0.0.1:1234"], ["distributed.num_processes"]),
}


@pytest.mark.parametrize("extra,needles", list(CONFIG_CASES.values()), ids=list(CONFIG_CASES))
def test_config_refused(trained, sudoku_dir, extra, needles):
    refused(trained, sudoku_dir, extra, *needles)


GEMMA_CASES = {
    "kv heads do not divide heads": (["arch.num_kv_heads=3"], ["arch.num_kv_heads=3 does not divide arch.num_heads=4",
                                                                "[1, 2, 4]"]),
    "no heads": (["arch.num_heads=0"], ["arch.num_heads=0", ">= 1"]),
    "param dtype": (["arch.param_dtype=float64"], ["arch.param_dtype='float64'", "float32"]),
    "remat policy": (["arch.remat=sometimes"], ["arch.remat='sometimes'", "dots"]),
    "version": (["arch.version=4"], ["arch.version=4"]),
}


@pytest.mark.parametrize("extra,needles", list(GEMMA_CASES.values()), ids=list(GEMMA_CASES))
def test_gemma_head_config_refused(trained, sudoku_dir, extra, needles):
    refused(trained, sudoku_dir, GEMMA + extra, *needles, arch=False)


@pytest.mark.parametrize("key,problem", [("bad", "40+ characters"), ("x" * 39 + "!", "may only contain"),
                                         (" " + "a" * 40, "whitespace")])
def test_malformed_wandb_key(trained, sudoku_dir, monkeypatch, key, problem):
    monkeypatch.setenv("WANDB_API_KEY", key)
    error = refused(trained, sudoku_dir, ["run.wandb.mode=online"], "WANDB_API_KEY is malformed", problem)
    assert key.strip() not in error  # never the key itself


def test_online_without_credentials(trained, sudoku_dir, monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    refused(trained, sudoku_dir, ["run.wandb.mode=online"], "no W&B credentials")


# ------------------------------------------------------------------------------ datasets


@pytest.fixture
def dataset_copy(sudoku_dir, tmp_path) -> Path:
    copy = tmp_path / "sudoku"
    shutil.copytree(sudoku_dir, copy)
    return copy


@pytest.mark.parametrize("keep_bytes,needles", [(0.5, ["is truncated", "mmap length"]), (100, ["is truncated", "EOF"]),
                                                (3, ["is not a .npy file"])], ids=["half", "header", "magic"])
def test_truncated_npy(trained, dataset_copy, keep_bytes, needles):
    array = dataset_copy / "train" / "all__inputs.npy"
    data = array.read_bytes()
    array.write_bytes(data[:int(len(data) * keep_bytes) if keep_bytes < 1 else keep_bytes])
    error = refused(trained, dataset_copy, [], str(array), *needles)
    assert "rebuild" in error


def test_incomplete_dataset_without_marker_is_never_built_over(trained, dataset_copy):
    (dataset_copy / "train" / "dataset.json").unlink()
    (dataset_copy / ".podrunner-generated").unlink()  # a set from elsewhere (or an older version)
    refused(trained, dataset_copy, ["data.generate_if_missing=true"], str(dataset_copy), "train/dataset.json is missing",
            NOT_OURS, "point data.path")


def test_another_builders_folder_is_never_built_over(trained, dataset_copy):
    (dataset_copy / "train" / "dataset.json").unlink()
    refused(trained, dataset_copy, ["data.name=maze", "data.generate_if_missing=true"], "a build_sudoku build, not build_maze")


def test_data_path_that_is_a_file(trained, tmp_path):
    (tmp_path / "data").write_text("not a dataset")
    refused(trained, tmp_path, ["data.generate_if_missing=true", f"data.path={tmp_path / 'data'}"], "is a file")


def test_missing_dataset_without_generation(trained, tmp_path):
    refused(trained, tmp_path, [f"data.path={tmp_path}/nope"], f"{tmp_path}/nope", "build_sudoku")


def test_generation_claims_only_its_own_folders(tmp_path, caplog):
    """A run builds a missing set (saying where), rebuilds over its own unfinished build, and
    never writes into a folder without its marker."""
    from data_pipeline.marker import read_marker
    from runtime.config import DataConfig
    from runtime.errors import UserError
    from runtime.registry import dataset_kind

    kind, root = dataset_kind("sudoku"), tmp_path / "typo"
    data = DataConfig(name="sudoku", path=str(root), generate_if_missing=True, generate_puzzles=30,
                      generate_test_puzzles=10)
    with caplog.at_level("INFO", logger="runtime"):
        kind.ensure_built(data)
    assert f"data.path={root} does not exist: building" in caplog.text and "fix data.path" in caplog.text
    marker = read_marker(str(root))
    assert marker["builder"] == "build_sudoku" and marker["parameters"]["generate"] == 40 and marker["finished"]

    (root / "train" / "dataset.json").unlink()  # an interrupted build of ours: built again
    kind.ensure_built(data)
    assert (root / "train" / "dataset.json").is_file()

    (root / "train" / "dataset.json").unlink()
    (root / ".podrunner-generated").unlink()
    before = tree_hash(root)
    with pytest.raises(UserError, match=NOT_OURS):
        kind.ensure_built(data)
    assert tree_hash(root) == before


# ------------------------------------------------------------------------ command lines


def test_yaml_syntax_error_in_an_experiment(trained, sudoku_dir, tmp_path):
    """In process and through the script: the file, line and column, exit 2."""
    broken = tmp_path / "conf" / "experiment" / "broken" / "x.yaml"
    broken.parent.mkdir(parents=True)
    broken.write_text("train:\n  steps: [1, 2\n  log_every: : 3\n")
    extra = [f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "+experiment=broken/x"]
    refused(trained, sudoku_dir, extra, f"invalid YAML in {broken} line 3 column 12", "fix the file")

    proc = run_pretrain(base_overrides(sudoku_dir, trained, steps=2) + extra, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [f"error: invalid YAML in {broken} line 3 column 12: while parsing a "
                                                "flow sequence; expected ',' or ']', but got ':'; fix the file's syntax"]


@pytest.mark.parametrize("argv,needle", [(["--processes", "0"], "--processes 0"), (["-n", "-2"], "--processes -2"),
                                         (["-n", "1", "-m", "0"], "--devices-per-process 0"),
                                         (["-n", "1", "--timeout", "0"], "--timeout 0")])
def test_local_launcher_counts(argv, needle):
    proc = subprocess.run([sys.executable, str(REPO / "experiments" / "launch.py"), "local", *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=60, env=child_env())
    assert proc.returncode == 2 and proc.stderr.splitlines() == [proc.stderr.strip()], proc.stderr
    assert proc.stderr.startswith("error: ") and needle in proc.stderr and "Traceback" not in proc.stderr


def builder_error(capsys, main, argv: list[str]) -> str:
    """A builder's main(argv) refused: exit 2 and one `error:` line on stderr, which is returned."""
    return cli_refused(capsys, main, argv, 2)


SUDOKU_ROW = "." * 80 + "1"
SOLVED_ROW = "123456789" * 9

CSV_CASES = {
    "empty": ("", ["expected a header"]),
    "header only": ("source,q,a,rating\n", ["no rows after the header"]),
    "short row": (f"source,q,a,rating\nx,{SUDOKU_ROW},{SOLVED_ROW},0\ny,{SUDOKU_ROW}\n", ["line 3", "too few columns"]),
    "short grid": (f"source,q,a,rating\nx,{SUDOKU_ROW},{SOLVED_ROW},0\ny,123,{SOLVED_ROW},0\n",
                   ["line 3", "'q' has 3 characters, expected 81"]),
    "unsolved answer": (f"source,q,a,rating\nx,{SUDOKU_ROW},{SUDOKU_ROW},0\n", ["line 2", "complete grid"]),
}


@pytest.mark.parametrize("text,needles", list(CSV_CASES.values()), ids=list(CSV_CASES))
def test_sudoku_builder_bad_csv(tmp_path, capsys, text, needles):
    from data_pipeline.build_sudoku import main

    source = tmp_path / "in.csv"
    source.write_text(text)
    err = builder_error(capsys, main, ["--output-dir", str(tmp_path / "out"), "--source-csv", str(source)])
    assert str(source) in err and all(n in err for n in needles), err
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_builders_missing_inputs(tmp_path, capsys):
    from data_pipeline import build_arc, build_maze, build_sudoku

    err = builder_error(capsys, build_sudoku.main, ["--output-dir", str(tmp_path / "o"), "--source-csv",
                                                    str(tmp_path / "missing.csv")])
    assert f"source CSV {tmp_path / 'missing.csv'} not found" in err
    (tmp_path / "maze.csv").write_text("source,q,a,rating\nx,#S#G,#oo#,1\ny,#S#\n")
    err = builder_error(capsys, build_maze.main, ["--output-dir", str(tmp_path / "o"), "--source-csv",
                                                  str(tmp_path / "maze.csv")])
    assert f"{tmp_path / 'maze.csv'} line 3" in err and "too few columns" in err
    (tmp_path / "arc").mkdir()
    err = builder_error(capsys, build_arc.main, ["--output-dir", str(tmp_path / "o"), "--kaggle-dir", str(tmp_path / "arc")])
    assert "holds no *_challenges.json" in err
    (tmp_path / "arc" / "arc-agi_training_challenges.json").write_text('{"a": {"train": [')
    err = builder_error(capsys, build_arc.main, ["--output-dir", str(tmp_path / "o"), "--kaggle-dir", str(tmp_path / "arc")])
    assert "arc-agi_training_challenges.json is not valid JSON" in err
    assert not (tmp_path / "o").exists()


def test_builder_never_writes_into_a_folder_it_did_not_build(dataset_copy, capsys):
    from data_pipeline.build_sudoku import main

    (dataset_copy / ".podrunner-generated").unlink()
    before = tree_hash(dataset_copy)
    err = builder_error(capsys, main, ["--output-dir", str(dataset_copy), "--generate", "20"])
    assert "already holds files" in err and "no .podrunner-generated marker" in err
    assert tree_hash(dataset_copy) == before


def test_boundary_values_keep_their_meaning():
    """The smallest accepted values (_RULES) are accepted, and cadence 0 (steps or epochs) means
    only at the end."""
    from helpers import compose_config
    from runtime.config import derive

    config = compose_config(["train.steps=10", "train.eval_every=0", "train.checkpoint_every_epochs=0",
                             "train.watchdog_timeout_s=0", "run.checkpoint.keep=1", "train.global_batch_size=8"])
    plan = derive(config, num_processes=1, num_devices=8, train_examples=80)
    assert (plan.eval_every, plan.checkpoint_every) == (10, 10)
    assert config.train.watchdog_timeout_s == 0 and config.run.checkpoint.keep == 1
