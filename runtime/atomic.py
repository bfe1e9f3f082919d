"""Whole or not at all: the one way this project replaces a local file (standard library only: the
worker tools import it under a TPU VM's system python3).

`write_atomic(path, data)` writes a temporary file beside `path`, flushes it to disk and renames it
over `path`. A reader sees the old file or the new one, never a torn one; a write that fails (a full
disk, no permission, a process killed mid-write) leaves the old file byte-identical and no
temporary behind; `write_whole(path, data)` does the same for a path that may be gs:// too. `replacing(path)` is the same for a writer that needs a path to write to (a
download, a library's own writer). `append_atomic(path, data)` adds to a log: the whole of `data`
or, when the write fails, the file cut back to its length before (a log is never rewritten whole).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from typing import Iterator


def write_atomic(path: str | os.PathLike, data: str | bytes, *, mode: int | None = None) -> None:
    """Replace `path` by `data` (str: UTF-8) whole or not at all; `mode`: the new file's permissions."""
    raw = data.encode() if isinstance(data, str) else data
    with replacing(path) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644 if mode is None else mode)
        try:
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)  # on disk before the rename: a crash leaves the old file or the new one
        finally:
            os.close(fd)


def write_whole(path: str, data: str | bytes) -> None:
    """`path` local or remote (gs://), its folder made first: a local file by `write_atomic`, a
    remote object by one upload (an object appears whole or not at all)."""
    if "://" not in path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write_atomic(path, data)
        return
    import fsspec  # remote paths only: the worker tools import this module under the system python3

    fs, _, (p,) = fsspec.get_fs_token_paths(path)
    fs.makedirs(p.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(p, data.encode() if isinstance(data, str) else data)


def append_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Append `data` (str: UTF-8) to `path` (created if missing): all of it, or, when the write fails
    part-way (a full disk), nothing: the file is cut back to the length it had."""
    raw = data.encode() if isinstance(data, str) else data
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


@contextlib.contextmanager
def replacing(path: str | os.PathLike) -> Iterator[str]:
    """Yields a temporary path beside `path`; once the block ends without an exception what was
    written there replaces `path`. On an exception it is removed and `path` stays as it was."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
