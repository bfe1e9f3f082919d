"""The worker-side pieces of a launch and a setup, in this process: the shipped tree's unpack
(experiments/launcher/worker/shipped.py: never half a tree, the pack removed, the .venv linked) and
setup_tpu.sh's check (experiments/launcher/worker/tpu_check.py). Their runs through the fake
gcloud: tests/test_ship.py, tests/test_launcher_pod.py."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from experiments.launcher.worker import shipped, tpu_check
from helpers import MetadataServer
from runtime.errors import EXIT_FAILURE


def make_pack(path: Path, files: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
        link = tarfile.TarInfo("link")
        link.type, link.linkname = tarfile.SYMTYPE, "a.txt"
        tar.addfile(link)
    return path


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name)


def test_a_shipped_tree_is_unpacked_once_and_its_pack_removed(tmp_path):
    venv = tmp_path / "repo" / ".venv"
    venv.mkdir(parents=True)
    tree = tmp_path / "shipped" / "abc123"
    pack = make_pack(tmp_path / "pack.tar.gz", {"a.txt": "one\n", "sub/b.txt": "two\n"})
    shipped.prepare(str(pack), str(tree), str(venv))
    assert (tree / "sub" / "b.txt").read_text() == "two\n" and os.readlink(tree / "link") == "a.txt"
    assert (tree / ".venv").resolve() == venv.resolve()
    assert not pack.exists() and leftovers(tree.parent) == []

    # The same tree again: reused as it is (the pack is only removed), the .venv linked anew.
    (tree / "reused").write_text("")
    other = tmp_path / "other-venv"
    other.mkdir()
    pack = make_pack(tmp_path / "pack.tar.gz", {"a.txt": "changed\n"})
    shipped.prepare(str(pack), str(tree), str(other))
    assert (tree / "reused").exists() and (tree / "a.txt").read_text() == "one\n"
    assert (tree / ".venv").resolve() == other.resolve() and not pack.exists()


@pytest.mark.parametrize("damage", ["cut short", "not a pack", "missing"])
def test_a_pack_that_does_not_unpack_leaves_no_tree(tmp_path, damage):
    """Never half a tree: the unpack goes to a temporary folder that is renamed into place whole."""
    pack = make_pack(tmp_path / "pack.tar.gz", {f"f{i}.txt": os.urandom(2048).hex() for i in range(20)})
    if damage == "cut short":
        pack.write_bytes(pack.read_bytes()[: pack.stat().st_size // 2])
    elif damage == "not a pack":
        pack.write_text("garbage")
    else:
        pack.unlink()
    tree = tmp_path / "shipped" / "abc123"
    with pytest.raises(shipped.ShipFailed, match=r"^cannot unpack the shipped tree \(gcloud scp\): "):
        shipped.prepare(str(pack), str(tree), str(tmp_path / ".venv"))
    assert not tree.exists() and leftovers(tree.parent) == [] and not pack.exists()


def test_pins_that_differ_are_one_warning(tmp_path, capsys):
    for side, deps in (("tree", '["numpy"]'), ("repo", '["numpy"]')):
        (tmp_path / side).mkdir()
        (tmp_path / side / "pyproject.toml").write_text(f"[project]\nname = '{side}'\ndependencies = {deps}\n")
    shipped.warn_if_pins_differ(str(tmp_path / "tree"), str(tmp_path / "repo"), "w-0")
    assert capsys.readouterr().err == ""  # another name, the same pins
    (tmp_path / "tree" / "pyproject.toml").write_text("[project]\ndependencies = ['numpy', 'scipy']\n")
    shipped.warn_if_pins_differ(str(tmp_path / "tree"), str(tmp_path / "repo"), "w-0")
    assert capsys.readouterr().err.startswith("podrunner: w-0: WARNING: the shipped pyproject.toml pins other")


def test_tpu_check_names_what_is_wrong():
    assert tpu_check.problem("tpu", 4, "v4-64") is None
    assert tpu_check.problem("tpu", 8, None) is None  # no slice type known: any count
    assert "a v4-64 worker has 4" in tpu_check.problem("tpu", 2, "v4-64")
    assert tpu_check.problem("cpu", 8, "v4-64").startswith("jax sees cpu, not TPU devices")


def test_tpu_check_asks_the_metadata_server_for_the_slice_type(capsys, monkeypatch):
    server = MetadataServer({"accelerator-type": "v5litepod-8"})
    try:
        assert tpu_check.accelerator_type({"GCE_METADATA_IP": server.address}) == "v5litepod-8"
        assert tpu_check.accelerator_type({"GCE_METADATA_IP": server.address, "TPU_ACCELERATOR_TYPE": "v4-8"}) == "v4-8"
    finally:
        server.close()
    closed = MetadataServer({})
    closed.close()
    closed.server.server_close()
    assert tpu_check.accelerator_type({"GCE_METADATA_IP": closed.address}) is None  # nobody answers

    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v4-8")
    assert tpu_check.main() == EXIT_FAILURE  # the suite's CPU devices: the check fails in one line
    out, err = capsys.readouterr()
    assert out.startswith("platform=cpu ") and " accelerator=v4-8 " in out and " jax=" in out
    assert err == "setup_tpu.sh: jax sees cpu, not TPU devices; is another process holding the TPU " \
                  "(`python experiments/launch.py stop`) or is libtpu missing?\n"
