"""Steps compiled ahead of time (`run.executables`): the train and eval steps that `launch.py plan
--executables FOLDER` compiled for the slice's topology, loaded by a run instead of compiled.

A TPU compile needs no TPU, so the plan, which compiles every variant's steps for the topology to
price them, can keep what it compiled: serialized executables (jax.experimental.serialize_executable,
the route of MaxText's ahead-of-time compilation: compile on a CPU host for a topology, load on the
slice). A run that finds its step there skips the compile: its program start-up is a read.

The file is named by `program_key`: the lowered program itself (StableHLO, literals and shardings
included), the mesh's devices in order (kind, id and host: an executable is bound to them; a
program compiled for one process is not one for a pod), the jax, jaxlib
and libtpu versions and the compiler's flags. A run lowers its step as before, which is cheap, and
loads the file of that key only: a program that differs in anything the compile depends on is a
miss, and a miss compiles as before (the persistent compilation cache still applies).

Loading a serialized executable unpickles it, and the folder may be a bucket others can write to,
so nothing in it is unpickled unless the user's own config vouches for it: the plan writes a
manifest of {key: sha256 of the file} named by its own sha256, and the run is given that digest
(`run.executables_digest`, which the plan prints and writes in its CSV, and `programme submit
--plan` passes with the folder). A run reads the manifest of its digest and checks its bytes, then
each file's JSON header (the key it holds) and its sha256 against the manifest, all before any
unpickling. Anything that does not match (another program's file copied over the name, a file
changed, a manifest changed) is one warning naming it and a compile: never the wrong program, never
the run's failure.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pickle
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
from etils import epath
from jax.experimental import serialize_executable

from runtime.atomic import write_whole
from runtime.errors import one_line
from runtime.goodput import Category, Timing

log = logging.getLogger("runtime")

FORMAT = "2"  # of the files: bump when what they hold changes
SUFFIX = ".jaxexe"
DIGEST = "sha256:"  # how a manifest's digest is written (run.executables_digest)
FLAG_VARIABLES = ("LIBTPU_INIT_ARGS", "XLA_FLAGS")  # the compiler's options from the environment


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return ""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def program_key(lowered_text: str, devices: Sequence[Any]) -> str:
    """The name of a compiled program's file: what the compile's result depends on (see above)."""
    parts = [FORMAT, jax.__version__, _version("jaxlib"), _version("libtpu"),
             *(f"{name}={os.environ.get(name, '')}" for name in FLAG_VARIABLES),
             ",".join(f"{d.platform}:{d.device_kind}:{d.id}:{d.process_index}" for d in devices), lowered_text]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def key_of(lowered, mesh) -> str:
    """The key of a step lowered for `mesh`."""
    return program_key(lowered.as_text(), list(mesh.devices.flat))


def save(compiled, folder: str, key: str, written: Path) -> str:
    """Write the compiled step as `<folder>/<key>.jaxexe` (a JSON header line naming its key, then
    the pickled executable), whole or not at all, and note its sha256 in `written` (the plan's own
    record); the sha256, or "" where the backend cannot serialize it (a step with constants
    captured, say): that step compiles at start."""
    try:
        payload, in_tree, out_tree = serialize_executable.serialize(compiled)
    except (ValueError, NotImplementedError) as e:
        log.info("not kept ahead (%s)", one_line(e)[:200])
        return ""
    data = json.dumps({"format": FORMAT, "key": key}).encode() + b"\n" + pickle.dumps((payload, in_tree, out_tree))
    write_whole(f"{folder.rstrip('/')}/{key}{SUFFIX}", data)
    digest = _sha256(data)
    written.mkdir(parents=True, exist_ok=True)
    (written / f"{key}-{digest}").touch()
    return digest


def kept_already(folder: str, key: str, written: Path) -> str:
    """The sha256 of `<folder>/<key>.jaxexe` where that file is one this machine's plan wrote (its
    record `written` says so), else "": a file someone else put there is compiled and written again,
    never vouched for unread."""
    path = epath.Path(folder) / f"{key}{SUFFIX}"
    if not path.exists():
        return ""
    digest = _sha256(path.read_bytes())
    return digest if (written / f"{key}-{digest}").exists() else ""


def write_manifest(folder: str, programs: dict[str, str]) -> str:
    """`<folder>/manifest-<its sha256>.json` of {key: the file's sha256}; its digest, `sha256:...`,
    for the runs' `run.executables_digest`. Named by its digest: plans that share a folder keep theirs."""
    data = json.dumps({"format": FORMAT, "programs": dict(sorted(programs.items()))}, indent=1).encode()
    digest = _sha256(data)
    write_whole(f"{folder.rstrip('/')}/manifest-{digest}.json", data)
    return DIGEST + digest


def read_manifest(folder: str, digest: str) -> dict[str, str]:
    """{key: sha256} of the manifest `digest` names, its bytes checked against it (ValueError: they
    differ; OSError: it cannot be read)."""
    want = digest.removeprefix(DIGEST)
    path = epath.Path(folder) / f"manifest-{want}.json"
    data = path.read_bytes()
    if _sha256(data) != want:
        raise ValueError(f"{path} was changed after the plan wrote it (its sha256 is not the {digest} given)")
    return json.loads(data)["programs"]


def load(folder: str, key: str, digest: str):
    """The compiled step of `key` from `folder`, its file checked first against what the manifest
    says (`digest`, its sha256) and its header (the key it holds); None where it does not match or
    does not load (said as a warning)."""
    path = epath.Path(folder) / f"{key}{SUFFIX}"
    try:
        data = path.read_bytes()
        header, _, payload = data.partition(b"\n")
        try:
            held = json.loads(header)  # JSON: what the file says it holds, read without running anything of it
        except ValueError:
            held = None
        if not isinstance(held, dict) or held.get("format") != FORMAT:
            raise ValueError(f"no header of format {FORMAT}: not a file this version of `plan --executables` wrote")
        if held.get("key") != key:
            raise ValueError(f"it holds the program {held.get('key')}, not {key}: another program's file under this name")
        if _sha256(data) != digest:
            raise ValueError("its sha256 is not the one the plan's manifest holds: changed since the plan wrote it")
        payload, in_tree, out_tree = pickle.loads(payload)  # only bytes the pinned manifest vouches for
        return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
    except Exception as e:  # noqa: BLE001 - a file we cannot use is a compile, not the run's end
        log.warning("run.executables: %s is refused (%s); compiling the step instead", path, one_line(e)[:300])
        return None


class Ahead:
    """A run's folder of steps compiled ahead and the digest of its plan's manifest (None: no folder)."""

    def __init__(self, folder: str | None, mesh, timing: Timing | None = None, digest: str | None = None):
        self.folder, self.mesh, self.timing, self.digest = folder, mesh, timing, digest
        self.manifest: dict[str, str] | None = None  # {key: sha256}, read at the first step

    def _manifest(self, folder: str) -> dict[str, str]:
        if self.manifest is None:
            try:
                self.manifest = read_manifest(folder, self.digest or "")
            except Exception as e:  # noqa: BLE001 - a folder we cannot trust is a compile, not the run's end
                log.warning("run.executables: the manifest %s in %s is refused (%s); compiling every step instead",
                            self.digest, self.folder, one_line(e)[:300])
                self.manifest = {}
                self.folder = None  # said once: the steps after it compile without a word
        return self.manifest

    def compile(self, lowered, what: str):
        """`lowered` compiled: read from the folder when its manifest names it, else compiled."""
        if self.folder:
            key = key_of(lowered, self.mesh)
            with self.timing.measure(Category.PROGRAM_STARTUP) if self.timing else contextlib.nullcontext():
                programs = self._manifest(self.folder)
                compiled = load(self.folder, key, programs[key]) if key in programs else None
            if compiled is not None:
                log.info("%s: loaded the executable compiled ahead (%s)", what, key)
                return compiled
            if self.folder and key not in programs:
                log.info("%s: no executable compiled ahead in %s (%s); compiling it", what, self.folder, key)
        return lowered.compile()

    def wrap(self, jitted: Callable, what: str) -> Callable:
        """`jitted`, called through `compile` for each distinct set of argument types (shapes,
        dtypes, shardings); `jitted` itself when there is no folder."""
        if not self.folder:
            return jitted
        programs: dict = {}

        def call(*args):
            leaves, tree = jax.tree.flatten(args)
            signature = (tree, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves))
            if signature not in programs:
                programs[signature] = self.compile(jitted.lower(*args), what)
            return programs[signature](*args)

        return call
