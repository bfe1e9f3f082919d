"""`launch.py pod --ship`: the working tree is packed (experiments/launcher/ship.py), copied to every worker
and run there. Packing is tested on temporary git repos; the launch on the fake gcloud with the
stub workers of conftest's `pod` fixture (their ~/repo holds the committed stub and the .venv)."""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from experiments.launcher.pod import Target, launch_pod
from experiments.launcher.ship import Pack, ShipError, pack_tree, tree_files
from helpers import target
from runtime import manifest

GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
PYPROJECT = '[project]\nname = "stub"\nversion = "0"\ndependencies = ["numpy"]\n'
MARKER = "only-in-the-working-tree-4d1e"
# The shipped trainer: imports a module that is not committed and records what it sees.
SHIPPED_STUB = """\
import json, os, sys
import shipped_only
info = {"marker": shipped_only.MARKER, "cwd": os.getcwd(), "argv": sys.argv[1:],
        "shipped": json.loads(os.environ["PODRUNNER_SHIPPED_TREE"]), "venv": os.environ.get("STUB_VENV")}
with open(os.path.join(os.environ["HOME"], "shipped_run.json"), "w") as f:
    json.dump(info, f)
print("shipped stub ran", shipped_only.MARKER, flush=True)
"""


def git(repo: Path, *args: str) -> str:
    return subprocess.run([*GIT, "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def make_repo(path: Path, files: dict[str, str]) -> Path:
    path.mkdir(parents=True)
    git(path, "init", "-q")
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "base")
    return path


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A repo whose working tree differs from HEAD in every way the shipped set cares about."""
    repo = make_repo(tmp_path / "repo", {"a.txt": "committed\n", "sub/b.txt": "b\n", "gone.txt": "x\n",
                                         "run.sh": "echo hi\n", ".gitignore": "*.log\nbuild/\n"})
    (repo / "run.sh").chmod(0o755)
    os.symlink("a.txt", repo / "link")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "exec bit and a symlink")
    (repo / "a.txt").write_text("changed in the working tree\n")  # modified, not staged
    (repo / "new.txt").write_text("untracked\n")
    (repo / "ignored.log").write_text("ignored\n")
    (repo / "build").mkdir()
    (repo / "build" / "out.bin").write_bytes(b"\0" * 10)
    (repo / "gone.txt").unlink()  # deleted, still in the index
    return repo


def test_the_shipped_set_is_tracked_plus_untracked_not_ignored_minus_deleted(tree, tmp_path):
    expected = [".gitignore", "a.txt", "link", "new.txt", "run.sh", "sub/b.txt"]
    assert tree_files(tree) == expected
    pack = pack_tree(tree, tmp_path)
    with tarfile.open(pack.path) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert sorted(members) == expected
        assert tar.extractfile("a.txt").read() == b"changed in the working tree\n"  # the disk, not HEAD
        assert members["link"].issym() and members["link"].linkname == "a.txt"
        assert members["run.sh"].mode == 0o755 and members["a.txt"].mode == 0o644
        assert {(m.mtime, m.uid, m.uname) for m in members.values()} == {(0, 0, "root")}
    assert pack.files == 6 and pack.size == pack.path.stat().st_size
    assert pack.summary["base_commit"] == git(tree, "rev-parse", "HEAD").strip()
    diff = pack.summary["diff_summary"]
    assert diff["changed"] == ["M a.txt", "D gone.txt"] and diff["untracked"] == ["new.txt"]
    assert diff["shortstat"].startswith("2 files changed")


def test_the_same_tree_gives_the_same_bytes_and_hash_anywhere(tree, tmp_path):
    first = pack_tree(tree, tmp_path)
    copy = tmp_path / "elsewhere" / "copy"
    shutil.copytree(tree, copy, symlinks=True)
    for path in copy.rglob("*"):  # other mtimes: not part of the tree
        if not path.is_symlink():
            os.utime(path, (1e9, 1e9))
    (tmp_path / "out").mkdir()
    again = pack_tree(copy, tmp_path / "out")
    assert again.tree_hash == first.tree_hash
    assert again.path.read_bytes() == first.path.read_bytes()

    (copy / "run.sh").chmod(0o644)  # the executable bit is part of the tree
    assert pack_tree(copy, tmp_path / "out").tree_hash != first.tree_hash
    (copy / "run.sh").chmod(0o755)
    (copy / "new.txt").write_text("untracked, edited\n")
    assert pack_tree(copy, tmp_path / "out").tree_hash != first.tree_hash


def test_a_huge_tree_or_no_git_repo_is_refused_in_one_line(tree, tmp_path):
    (tree / "stray.ckpt").write_bytes(os.urandom(300_000))
    with pytest.raises(ShipError) as e:
        pack_tree(tree, tmp_path, max_mb=0.25)
    assert "stray.ckpt (0.3 MB)" in str(e.value) and "--ship-max-mb 0.25" in str(e.value)
    assert "\n" not in str(e.value) and not list(tmp_path.glob("*.tar.gz"))
    (tmp_path / "plain").mkdir()
    with pytest.raises(ShipError, match="is not a git work tree"):
        pack_tree(tmp_path / "plain", tmp_path)


def test_the_manifest_records_the_shipped_tree(tree, tmp_path, monkeypatch):
    record = pack_tree(tree, tmp_path).shipped_record()
    checkout = manifest.new_manifest(config={}, plan={}, run_id="r", resumed_from=None)
    assert checkout["shipped"] is None and manifest.source_commit(checkout) == checkout["git_commit"]
    monkeypatch.setenv("PODRUNNER_SHIPPED_TREE", json.dumps(record))
    monkeypatch.setattr(manifest, "_git", lambda *args: None)  # a shipped tree has no .git
    shipped = manifest.new_manifest(config={}, plan={}, run_id="r", resumed_from=None)
    assert shipped["shipped"] == record and shipped["git_commit"] is None
    # W&B gets the shipped tree's base commit (runtime.metrics_sinks.wandb_settings)
    assert record["base_commit"] and manifest.source_commit(shipped) == record["base_commit"]


# --- launch.py pod --ship on the fake gcloud --------------------------------------------------

@pytest.fixture
def project(pod, tmp_path):
    """A local checkout whose working tree adds code the workers' commit does not have."""
    proj = make_repo(tmp_path / "proj", {"pretrain_jax.py": "print('committed code')\n",
                                         "pyproject.toml": PYPROJECT, "old.py": "", ".gitignore": "*.ckpt\n"})
    (proj / "pretrain_jax.py").write_text(SHIPPED_STUB)
    (proj / "shipped_only.py").write_text(f"MARKER = {MARKER!r}\n")
    (proj / "stray.ckpt").write_text("ignored: not shipped")
    (proj / "old.py").unlink()
    for home in pod.homes:
        (home / "repo" / "pyproject.toml").write_text(PYPROJECT)
    return proj


def ship_args(proj: Path, *extra: str) -> list[str]:
    return ["pod", *target("--repo-dir", "~/repo", "--run-id", "s1", "--ship", "--ship-from", str(proj), *extra),
            "--", "train.steps=5"]


def test_ship_runs_code_that_exists_only_in_the_working_tree(pod, project, tmp_path):
    r = pod.launch(*ship_args(project))
    assert r.returncode == 0, r.stdout + r.stderr
    (tmp_path / "mine").mkdir()
    pack = pack_tree(project, tmp_path / "mine")
    shipped_dir = lambda home: home / "podrunner-shipped" / pack.tree_hash  # noqa: E731
    launch_log = (tmp_path / "outputs" / "launch-logs" / "s1" / "launch.log").read_text()
    for i, home in enumerate(pod.homes):
        info = json.loads((home / "shipped_run.json").read_text())
        assert info["marker"] == MARKER and info["argv"] == ["train.steps=5", "run.id=s1"] and info["venv"] == "1"
        assert info["cwd"] == str(shipped_dir(home))
        assert info["shipped"] == pack.shipped_record()
        assert info["shipped"]["diff_summary"]["changed"] == ["D old.py", "M pretrain_jax.py"]
        assert info["shipped"]["diff_summary"]["untracked"] == ["shipped_only.py"]
        assert not (shipped_dir(home) / "stray.ckpt").exists() and not (shipped_dir(home) / "old.py").exists()
        assert (shipped_dir(home) / ".venv").resolve() == (home / "repo" / ".venv").resolve()
        assert not list(home.glob(".podrunner-ship-*"))  # the copied pack is removed once unpacked
        # Each worker's start line names the shipped tree: in the launch's log (a person's console
        # shows no tagged lines, runtime/wire.py for_people).
        start = f"podrunner-start host=t1v-n-my-tpu-w-{i} tree={pack.tree_hash} launch_id=s1"
        assert start in launch_log and start not in r.stdout
    assert "committed code" not in r.stdout and "WARNING" not in r.stdout + r.stderr
    calls = pod.gcloud_calls()  # the secrets' scp, the tree's, then the one ssh
    assert [c[4] for c in calls] == ["scp", "scp", "ssh"] and calls[1][6].startswith("my-tpu:.podrunner-ship-")

    # The same tree again: the unpacked directory is reused, not unpacked anew.
    (shipped_dir(pod.homes[0]) / "reused").write_text("")
    r = pod.launch(*ship_args(project))
    assert r.returncode == 0, r.stdout + r.stderr
    assert (shipped_dir(pod.homes[0]) / "reused").exists()


def test_ship_warns_when_the_pins_differ_from_the_workers_venv(pod, project):
    (project / "pyproject.toml").write_text(PYPROJECT.replace('"numpy"', '"numpy", "scipy"'))
    r = pod.launch(*ship_args(project))
    assert r.returncode == 0, r.stdout + r.stderr
    warnings = [line for line in r.stdout.splitlines() if "WARNING: the shipped pyproject.toml" in line]
    assert len(warnings) == len(pod.homes) and "run launch.py setup" in warnings[0]


def test_a_worker_without_the_repo_fails_naming_itself_and_keeps_no_copied_file(pod, project):
    r = pod.launch(*ship_args(project, "--repo-dir", "~/elsewhere"))
    assert r.returncode == 2, r.stdout + r.stderr
    for i, home in enumerate(pod.homes):
        assert f"podrunner: t1v-n-my-tpu-w-{i}: no repo at --repo-dir" in r.stdout
        assert not list(home.glob(".podrunner-*"))  # the pack and the secrets: the command's EXIT trap
        assert not (home / "podrunner-shipped").exists()


def test_ship_dry_run_shows_the_pack_and_runs_nothing(pod, project):
    del pod.env["WANDB_API_KEY"]  # no secrets' lines
    r = pod.launch(*ship_args(project, "--dry-run"))
    assert r.returncode == 0, r.stderr
    note, scp, ssh = r.stdout.splitlines()
    assert note.startswith("# ship: 4 files, ") and "(base " in note and "2 changed, 1 untracked" in note
    tree = re.search(r" tree ([0-9a-f]{64}) ", note).group(1)
    assert f" scp PACK.tar.gz my-tpu:.podrunner-ship-{tree[:16]}.tar.gz " in scp and "--worker=all" in scp
    command = shlex.split(ssh)[-1]  # the guard unpacks the pack into the tree's folder and runs it there
    assert f'--ship "$HOME"/podrunner-shipped/{tree} --pack "$HOME"/.podrunner-ship-{tree[:16]}.tar.gz' in command
    assert f'"tree_hash": "{tree}"' in command  # PODRUNNER_SHIPPED_TREE, for the run's manifest
    assert pod.gcloud_calls() == []


def test_ship_refuses_a_huge_tree_before_any_gcloud(pod, project):
    (project / "weights.npz").write_bytes(os.urandom(200_000))
    r = pod.launch(*ship_args(project, "--ship-max-mb", "0.1"))
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and "weights.npz" in r.stderr
    assert pod.gcloud_calls() == []
    r = pod.launch(*ship_args(project.parent))  # not a git repo
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "not a git work tree" in r.stderr


def test_launch_pod_accepts_a_prebuilt_pack(pod, project, tmp_path):
    """The supervisor packs once and hands the same Pack to every launch."""
    pack = pack_tree(project, tmp_path)
    assert isinstance(pack, Pack)
    out = io.StringIO()
    assert launch_pod(Target("my-tpu", "z"), [], repo_dir="~/repo", run_id="s2", ship=pack, dry_run=True,
                      stream=out) == 0
    assert f"tree {pack.tree_hash}" in out.getvalue()
