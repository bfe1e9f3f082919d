"""`python -m experiments.launcher.worker.versions HOST [--imports]`: one versions line
(runtime/wire.py): this worker's commit, Python, the versions the workers must agree on, and
whether the .venv fits pyproject.toml (its Python, every pin installed and importable).

Without --imports, "importable" means found (cheap: asked before every launch); with it
(setup_tpu.sh) each module is imported, and a .venv that does not fit is exit 1.
"""

import importlib
import importlib.util
import subprocess
import sys
from importlib import metadata

try:
    import tomllib
except ImportError:  # Python 3.10: such a .venv does not fit (`project` says so)
    tomllib = None

from runtime import wire
from runtime.errors import EXIT_FAILURE  # standard library only, like this

COMPARED = ("jax", "jaxlib", "libtpu", "flax", "orbax-checkpoint")  # what the workers must agree on


def version(dist):
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def commit():
    """The repo's commit, None without git or a commit (also the start line's: once.py)."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], stdin=subprocess.DEVNULL, capture_output=True,
                              text=True).stdout.strip() or None
    except OSError:
        return None


def project(path="pyproject.toml"):
    """(pins {distribution: version}, minimum Python (major, minor)) from pyproject.toml."""
    if tomllib is None:
        raise ImportError("reading it needs Python >= 3.11 (tomllib)")
    with open(path, "rb") as f:
        data = tomllib.load(f).get("project", {})
    pins = {}
    for requirement in data.get("dependencies", []):
        name, sep, pinned = requirement.partition("==")
        if sep:
            pins[name.split("[")[0].strip()] = pinned.split(";")[0].strip()
    low = data.get("requires-python", ">=3").lstrip(">=").split(".")
    return pins, tuple(int(x) for x in low[:2]) + (0,) * (2 - len(low[:2]))


def modules_of(dist):
    """The top-level modules a distribution provides (from its installed RECORD)."""
    names = set()
    for f in metadata.files(dist) or []:
        top = f.parts[0]
        if f.suffix == ".py" or top.endswith((".py", ".so")) or len(f.parts) > 1:
            top = top.split(".")[0]
            if top.isidentifier() and not top.endswith(("-info", "_libs")) and top != "__pycache__":
                names.add(top)
    return sorted(names)


def problems(importing):
    """What does not fit, one phrase each (empty: the .venv is good)."""
    try:
        pins, python = project()
    except (OSError, ValueError, ImportError) as e:
        return [f"cannot read pyproject.toml ({e})"]
    found = []
    if sys.version_info[:2] < python:
        found.append(f"Python {sys.version.split()[0]} < {'.'.join(map(str, python))} (setup_tpu.sh brings one)")
    for dist, pinned in sorted(pins.items()):
        have = version(dist)
        if have is None:
            found.append(f"{dist} not installed")
        elif have != pinned:
            found.append(f"{dist} {have} instead of {pinned}")
        else:
            for module in modules_of(dist):
                try:
                    if importing:
                        importlib.import_module(module)
                    elif importlib.util.find_spec(module) is None:
                        raise ImportError("not found")
                except Exception as e:  # noqa: BLE001 - any failure to import is the finding
                    found.append(f"{dist}: import {module} failed ({type(e).__name__}: {str(e)[:120]})")
                    break
    return found


def main(argv):
    host, importing = argv[0], "--imports" in argv[1:]
    info = {"host": host, "commit": commit(), "python": sys.version.split()[0]}
    info.update({p: version(p) for p in COMPARED})
    found = problems(importing)
    info.update(ok=not found, problem="; ".join(found)[:600] or None)
    print(wire.versions_line(info), flush=True)
    return EXIT_FAILURE if found and importing else 0  # after setup (setup_tpu.sh): a .venv that does not fit fails it


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
