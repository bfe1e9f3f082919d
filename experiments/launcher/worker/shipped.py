"""A shipped tree on a worker (`launch.py pod --ship`): the copied pack, unpacked once per tree into
~/podrunner-shipped/<tree hash> and run there with the repo's .venv (shipping installs nothing).

`prepare` unpacks into a temporary directory and renames it into place, so a half-unpacked tree is
never used, and of two launches unpacking the same tree at once one rename wins.
"""

import contextlib
import os
import shutil
import sys
import tarfile
import tempfile
import zlib

from runtime.atomic import replacing  # standard library only, like this

try:
    import tomllib
except ImportError:  # Python 3.10 (a TPU VM's system python3): pins are compared as whole files
    tomllib = None

SHIP_DIR = "~/podrunner-shipped"  # + /<tree hash>: a shipped tree, unpacked once per worker
PACK_PREFIX = ".podrunner-ship-"  # + the tree hash's first 16 digits + .tar.gz: the pack in the home directory
# GNU tar's rules (no absolute paths, no links out of the tree) where this Python has extraction
# filters (3.10.12, 3.11.4 and later); before them, tarfile's own behaviour.
_FILTER = {"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}


class ShipFailed(Exception):
    """One line: what went wrong with the shipped tree on this worker."""


def pack_name(tree_hash):
    """The pack's name in each worker's home while it is copied there."""
    return f"{PACK_PREFIX}{tree_hash[:16]}.tar.gz"


def tree_dir(tree_hash):
    """Where the tree is unpacked (`~` unexpanded: the launcher passes it to the worker's shell)."""
    return f"{SHIP_DIR}/{tree_hash}"


def unpack(pack, tree):
    """Unpack the tar.gz `pack` into the directory `tree` unless it is there (module docstring)."""
    if os.path.isdir(tree):
        return
    parent = os.path.dirname(os.path.abspath(tree))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(tree) + ".tmp-", dir=parent)
    try:
        with tarfile.open(pack, "r:gz") as tar:
            tar.extractall(tmp, **_FILTER)
        try:
            os.rename(tmp, tree)
        except OSError:
            if not os.path.isdir(tree):  # else another launch's rename won: its tree is the same
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def prepare(pack, tree, venv):
    """The shipped tree at `tree`, ready to run with `venv`; ShipFailed says which step failed."""
    try:
        unpack(pack, tree)
    except (OSError, EOFError, tarfile.TarError, zlib.error) as e:  # EOFError, zlib.error: a pack cut short
        raise ShipFailed(f"cannot unpack the shipped tree (gcloud scp): {e}") from None
    finally:
        with contextlib.suppress(OSError):
            os.remove(pack)
    try:  # `tree`/.venv -> `venv`, replacing a link that is there (a new link renamed over it)
        with replacing(os.path.join(tree, ".venv")) as tmp:
            os.symlink(venv, tmp)
    except OSError as e:
        raise ShipFailed(f"cannot link the .venv of --repo-dir into the shipped tree: {e}") from None


def _pins(path):
    """What a pyproject.toml pins: its dependencies and build system (the whole file without tomllib)."""
    with open(path, "rb") as f:
        if tomllib is None:
            return f.read()
        data = tomllib.load(f)
    project = data.get("project", {})
    return project.get("dependencies"), project.get("optional-dependencies"), data.get("build-system")


def warn_if_pins_differ(tree, repo, host):
    """One line on stderr when the shipped pyproject.toml pins other packages than the repo's (whose
    .venv runs it); one that cannot be read counts as different."""
    try:
        same = _pins(os.path.join(tree, "pyproject.toml")) == _pins(os.path.join(repo, "pyproject.toml"))
    except (OSError, ValueError):
        same = False
    if not same:
        print(f"podrunner: {host}: WARNING: the shipped pyproject.toml pins other packages than the one in "
              "--repo-dir; the run uses the .venv there (shipping installs nothing): run launch.py setup",
              file=sys.stderr, flush=True)
