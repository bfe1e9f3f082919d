"""Test helper: read back what offline W&B runs wrote under ``<output_dir>/wandb/``.

Each ``offline-run-*/run-<id>.wandb`` file is the transaction log that ``wandb sync``
uploads: a leveldb-style log of ``wandb.proto.wandb_internal_pb2.Record`` protobufs.
wandb 0.31 writes it from its Go core and no longer ships a Python reader
(``wandb.sdk.internal.datastore`` is gone), so the framing is decoded here; the
records themselves are parsed with wandb's own protobuf classes.

Log format (https://github.com/google/leveldb/blob/main/doc/log_format.md, W&B flavour):
file header ":W&B" + uint16 magic 0xBEE1 + uint8 version 0, then 32 KiB blocks
(counted from the start of the file) of chunks
``uint32 crc | uint16 length | uint8 type | data``, little-endian; type FULL=1,
FIRST=2, MIDDLE=3, LAST=4; crc is zlib CRC-32 of the type byte followed by the data.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2 as pb

_FILE_HEADER = struct.Struct("<4sHB")
_CHUNK_HEADER = struct.Struct("<IHB")
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


@dataclass
class OfflineRun:
    path: Path  # the offline-run-* directory
    run_id: str = ""
    project: str = ""
    group: str = ""
    name: str = ""
    tags: list[str] = field(default_factory=list)
    config: dict = field(default_factory=dict)  # without W&B's internal "_wandb" key
    history: list[dict] = field(default_factory=list)  # rows as logged, with _step
    summary: dict = field(default_factory=dict)
    files: list[str] = field(default_factory=list)  # paths relative to the run's files/
    exit_code: int | None = None  # None: the run never finished
    start_time: float = 0.0
    git_commit: str = ""  # the run's git metadata ("" when none was recorded)
    stats: list[dict] = field(default_factory=list)  # system-metrics samples ({"memory_percent": ...})


def iter_records(path: str | Path) -> Iterator[pb.Record]:
    """Yield the Record protobufs of one .wandb transaction log, in order."""
    data = Path(path).read_bytes()
    ident, magic, version = _FILE_HEADER.unpack_from(data, 0)
    if (ident, magic, version) != (b":W&B", 0xBEE1, 0):
        raise ValueError(f"{path}: not a W&B transaction log ({ident!r}, {magic:#x}, {version})")
    pos, pending = _FILE_HEADER.size, b""
    while pos + _CHUNK_HEADER.size <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _CHUNK_HEADER.size:  # block trailer padding
            pos += left_in_block
            continue
        crc, length, kind = _CHUNK_HEADER.unpack_from(data, pos)
        if kind == 0 and length == 0:  # zero padding up to the block end
            pos += left_in_block
            continue
        start = pos + _CHUNK_HEADER.size
        chunk = data[start : start + length]
        if len(chunk) < length:
            break  # truncated tail of a run that was killed mid-write
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != crc:
            raise ValueError(f"{path}: bad checksum at byte {pos}")
        pos = start + length
        pending = chunk if kind in (_FULL, _FIRST) else pending + chunk
        if kind in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def _key_path(item: Any) -> list[str]:
    return [item.key] if item.key else list(item.nested_key)


def _set(target: dict, keys: list[str], value: Any) -> None:
    for key in keys[:-1]:
        target = target.setdefault(key, {})
    target[keys[-1]] = value


def _remove(target: dict, keys: list[str]) -> None:
    for key in keys[:-1]:
        target = target.get(key, {})
    target.pop(keys[-1], None)


def _apply(target: dict, change) -> None:
    """A config or summary record's updates and removals, applied to `target`."""
    for item in change.update:
        _set(target, _key_path(item), json.loads(item.value_json))
    for item in change.remove:
        _remove(target, _key_path(item))


def _history_value(item: pb.HistoryItem) -> Any:
    kind = item.WhichOneof("value")  # typed values; otherwise value_json
    if kind == "none":
        return None
    if kind is not None:
        return getattr(item, kind)
    return json.loads(item.value_json)  # json accepts W&B's NaN / Infinity


def read_run_dir(run_dir: str | Path) -> OfflineRun:
    run_dir = Path(run_dir)
    logs = sorted(run_dir.glob("run-*.wandb"))
    if len(logs) != 1:
        raise FileNotFoundError(f"{run_dir}: expected one run-*.wandb, found {logs}")
    run = OfflineRun(path=run_dir)
    for record in iter_records(logs[0]):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            run.run_id, run.project = r.run_id, r.project
            run.group, run.name, run.tags = r.run_group, r.display_name, list(r.tags)
            run.start_time = r.start_time.seconds + r.start_time.nanos * 1e-9
            run.git_commit = r.git.commit
            for item in r.config.update:
                _set(run.config, _key_path(item), json.loads(item.value_json))
        elif kind == "config":
            _apply(run.config, record.config)
        elif kind == "history":
            row: dict = {}
            for item in record.history.item:
                _set(row, _key_path(item), _history_value(item))
            run.history.append(row)
        elif kind == "summary":
            _apply(run.summary, record.summary)
        elif kind == "files":
            run.files.extend(f.path for f in record.files.files if f.path not in run.files)
        elif kind == "stats":
            run.stats.append({item.key: json.loads(item.value_json) for item in record.stats.item})
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
    run.config.pop("_wandb", None)
    return run


def read_offline_runs(output_dir: str | Path) -> list[OfflineRun]:
    """All offline runs under ``<output_dir>/wandb/``, oldest first (a resume is a new dir)."""
    run_dirs = sorted(Path(output_dir, "wandb").glob("offline-run-*"))
    runs = [read_run_dir(d) for d in run_dirs if d.is_dir() and not d.is_symlink()]
    return sorted(runs, key=lambda r: r.start_time)  # stable: ties keep directory order
