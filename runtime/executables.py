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
miss, and a miss compiles as before (the persistent compilation cache still applies). A file that
does not load (damaged, another format) is a warning and a compile, never the run's failure.

Loading unpickles: the folder must be the user's own (like the checkpoints next to it).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pickle
from importlib import metadata
from typing import Any, Callable, Sequence

import jax
from etils import epath
from jax.experimental import serialize_executable

from runtime.atomic import write_whole
from runtime.errors import one_line
from runtime.goodput import PROGRAM_STARTUP, Timing

log = logging.getLogger("runtime")

FORMAT = "1"  # of the files: bump when what they hold changes
SUFFIX = ".jaxexe"
FLAG_VARIABLES = ("LIBTPU_INIT_ARGS", "XLA_FLAGS")  # the compiler's options from the environment


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return ""


def program_key(lowered_text: str, devices: Sequence[Any]) -> str:
    """The name of a compiled program's file: what the compile's result depends on (see above)."""
    parts = [FORMAT, jax.__version__, _version("jaxlib"), _version("libtpu"),
             *(f"{name}={os.environ.get(name, '')}" for name in FLAG_VARIABLES),
             ",".join(f"{d.platform}:{d.device_kind}:{d.id}:{d.process_index}" for d in devices), lowered_text]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def key_of(lowered, mesh) -> str:
    """The key of a step lowered for `mesh`."""
    return program_key(lowered.as_text(), list(mesh.devices.flat))


def save(compiled, folder: str, key: str) -> bool:
    """Write the compiled step as `<folder>/<key>.jaxexe`, whole or not at all; False where the
    backend cannot serialize it (a step with constants captured, say): that step compiles at start."""
    try:
        payload, in_tree, out_tree = serialize_executable.serialize(compiled)
    except (ValueError, NotImplementedError) as e:
        log.info("not kept ahead (%s)", one_line(e)[:200])
        return False
    write_whole(f"{folder.rstrip('/')}/{key}{SUFFIX}", pickle.dumps((FORMAT, payload, in_tree, out_tree)))
    return True


def exists(folder: str, key: str) -> bool:
    return (epath.Path(folder) / f"{key}{SUFFIX}").exists()


def load(folder: str, key: str):
    """The compiled step of `key` from `folder`, or None where its file does not load (said as a
    warning)."""
    path = epath.Path(folder) / f"{key}{SUFFIX}"
    try:
        fmt, payload, in_tree, out_tree = pickle.loads(path.read_bytes())
        if fmt != FORMAT:
            raise ValueError(f"format {fmt}, not {FORMAT}")
        return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
    except Exception as e:  # noqa: BLE001 - a file we cannot use is a compile, not the run's end
        log.warning("run.executables: %s does not load (%s); compiling the step instead", path, one_line(e)[:300])
        return None


class Ahead:
    """A run's folder of steps compiled ahead (None: no folder)."""

    def __init__(self, folder: str | None, mesh, timing: Timing | None = None):
        self.folder, self.mesh, self.timing = folder, mesh, timing

    def compile(self, lowered, what: str):
        """`lowered` compiled: read from the folder when it is there, else compiled."""
        if self.folder:
            key = key_of(lowered, self.mesh)
            with self.timing.measure(PROGRAM_STARTUP) if self.timing else contextlib.nullcontext():
                try:
                    there = exists(self.folder, key)
                except Exception as e:  # noqa: BLE001 - a folder we cannot read is a compile, not the run's end
                    log.warning("run.executables: cannot read %s (%s); compiling the step instead", self.folder,
                                one_line(e)[:300])
                    there = None
                compiled = load(self.folder, key) if there else None
            if compiled is not None:
                log.info("%s: loaded the executable compiled ahead (%s)", what, key)
                return compiled
            if there is False:
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
