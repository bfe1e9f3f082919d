"""Pack the local working tree for `launch.py pod --ship`.

The set shipped is what `git ls-files --cached --others --exclude-standard` sees, minus deleted
files. The tar.gz has sorted names, mtime 0, owner root and modes 0644/0755 (as git), so the same
tree gives the same bytes wherever it is packed.

The tree hash is sha256 over (path, kind, content hash) of every file, not `git write-tree` on a
temporary index, which would write every changed and untracked file (a stray multi-GB file
included) into the user's object store just to name the tree.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import stat
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MAX_MB = 50.0  # a user's stray checkpoint or dataset in the tree is refused, not shipped
SUMMARY_LIST_MAX = 20  # changed / untracked files named in the summary (it travels on a command line)


class ShipError(Exception):
    """A one-line reason the tree cannot be shipped."""


@dataclass(frozen=True)
class Pack:
    path: Path  # the tar.gz
    tree_hash: str  # sha256 hex of the file set (see the module docstring)
    summary: dict  # base_commit, diff_summary: {shortstat, changed, untracked}
    files: int
    size: int  # bytes of the tar.gz

    def shipped_record(self) -> dict:
        """What the run's manifest records (runtime/manifest.py, `shipped`)."""
        return {"tree_hash": self.tree_hash, **self.summary}


def _git(repo: Path, *args: str, check: bool = True) -> str:
    try:
        out = subprocess.run(["git", "-C", str(repo), *args], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ShipError(f"cannot run git in {repo} ({e}); --ship needs git") from None
    if check and out.returncode != 0:
        raise ShipError(f"git {args[0]} failed in {repo}: {(out.stderr.strip().splitlines() or ['?'])[-1]}")
    return out.stdout if out.returncode == 0 else ""


def _null_list(text: str) -> list[str]:
    return [p for p in text.split("\0") if p]


def tree_files(repo: Path) -> list[str]:
    """The shipped set, sorted (submodules not followed)."""
    repo = Path(repo)
    if not repo.is_dir() or _git(repo, "rev-parse", "--is-inside-work-tree", check=False).strip() != "true":
        raise ShipError(f"{repo} is not a git work tree; --ship packs what `git ls-files` sees (use --ship-from DIR)")
    top = Path(_git(repo, "rev-parse", "--show-toplevel").strip())
    listed = _null_list(_git(top, "ls-files", "-z", "--cached", "--others", "--exclude-standard"))
    deleted = set(_null_list(_git(top, "ls-files", "-z", "--deleted")))
    return sorted(name for name in dict.fromkeys(listed)  # a file with merge conflicts is listed once per stage
                  if name not in deleted and stat.S_IFMT(os.lstat(top / name).st_mode) in (stat.S_IFREG, stat.S_IFLNK))


def _check_size(top: Path, names: list[str], max_mb: float) -> None:
    sizes = sorted(((os.lstat(top / n).st_size, n) for n in names), reverse=True)
    total = sum(s for s, _ in sizes)
    if total > max_mb * 2**20:
        biggest = ", ".join(f"{n} ({s / 2**20:.1f} MB)" for s, n in sizes[:3])
        raise ShipError(f"the tree to ship is {total / 2**20:.1f} MB, over --ship-max-mb {max_mb:g}: biggest "
                        f"{biggest}; delete or git-ignore what should not go to the pod, or raise the limit")


def _entry(top: Path, name: str) -> tuple[tarfile.TarInfo, bytes | None, bytes]:
    """(tar header, content or None for a symlink, the bytes hashed for the tree hash)."""
    path = top / name
    info = tarfile.TarInfo(name)
    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "root", "root"
    if path.is_symlink():
        info.type, info.linkname, info.mode = tarfile.SYMTYPE, os.readlink(path), 0o777
        return info, None, b"link\0" + info.linkname.encode()
    data = path.read_bytes()
    executable = os.stat(path).st_mode & 0o100
    info.mode, info.size = (0o755 if executable else 0o644), len(data)
    kind = b"exec\0" if executable else b"file\0"
    return info, data, kind + hashlib.sha256(data).digest()


def pack_tree(repo: Path | str, out_dir: Path | str, *, max_mb: float = DEFAULT_MAX_MB) -> Pack:
    """Write <out_dir>/tree-<hash>.tar.gz of the working tree of `repo` (see the module docstring)."""
    repo = Path(repo)
    names = tree_files(repo)
    top = Path(_git(repo, "rev-parse", "--show-toplevel").strip())
    _check_size(top, names, max_mb)
    tree, buf = hashlib.sha256(), io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in names:
            info, data, hashed = _entry(top, name)
            tree.update(name.encode() + b"\0" + hashed + b"\0")
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    tree_hash = tree.hexdigest()
    path = Path(out_dir) / f"tree-{tree_hash[:16]}.tar.gz"
    path.write_bytes(buf.getvalue())
    return Pack(path, tree_hash, diff_summary(top), len(names), len(buf.getvalue()))


def _capped(items: list[str]) -> list[str]:
    if len(items) <= SUMMARY_LIST_MAX:
        return items
    return [*items[:SUMMARY_LIST_MAX], f"... and {len(items) - SUMMARY_LIST_MAX} more"]


def diff_summary(top: Path) -> dict:
    """base_commit (HEAD, None before the first commit) and the tree's difference from it (lists capped)."""
    base = _git(top, "rev-parse", "--verify", "--quiet", "HEAD", check=False).strip() or None
    against = base or _git(top, "hash-object", "-t", "tree", "--stdin").strip()  # the empty tree
    changed = [line.replace("\t", " ", 1) for line in
               _git(top, "diff", "--name-status", "--no-renames", against).splitlines()]
    untracked = _null_list(_git(top, "ls-files", "-z", "--others", "--exclude-standard"))
    return {"base_commit": base, "diff_summary": {
        "shortstat": _git(top, "diff", "--shortstat", against).strip(),
        "changed": _capped(changed), "untracked": _capped(sorted(untracked))}}
