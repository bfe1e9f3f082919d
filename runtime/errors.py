"""Errors a user acts on, and every exit code of the project's commands (pretrain_jax.py, the
launchers in experiments/, the data and weight tools): the one place their numbers live.

Anything a user can fix (an override, a dataset path, a mesh, a coordinator, a bucket,
a checkpoint) raises `UserError` with one line that names the problem and the fix.
`pretrain_jax.py` prints it as `error: ...` and exits with its `exit_code` (2 for bad input,
found before any long compile; 6 for a storage failure during the run).
"""

import errno

EXIT_FAILURE = 1  # anything else: a crash, or a check that found a problem (e.g. workers that differ)
EXIT_USER_ERROR = 2  # bad input, said in one `error:` line
EXIT_NONFINITE = 3  # the loss or the gradients became NaN/inf
EXIT_HANG = 4  # the watchdog saw no step for train.watchdog_timeout_s
EXIT_DOES_NOT_FIT = 5  # compile_only=<topology>: the train step does not fit in the chips' HBM
EXIT_STORAGE = 6  # a checkpoint, metrics or manifest write failed (outage, full disk, permissions), or the run lost its lease
EXIT_PEER_LOST = 7  # another process of the pod died, went silent or failed; this one stopped too (runtime/liveness.py)
EXIT_PREEMPTED = 8  # stopped on SIGTERM (preemption, maintenance, launch.py stop) with its checkpoint saved: relaunch
EXIT_CHECK_FAILED = 10  # launch.py doctor: a check failed or overran its budget, or a worker did not answer (one line each)
# Shell conventions, used by the launchers (experiments/launcher/local_pod.py, experiments/launcher/pod.py):
EXIT_TIMEOUT = 124  # an overall timeout expired (as coreutils `timeout`)
EXIT_SIGNAL_BASE = 128  # killed by (or shut down on) signal s: 128 + s
EXIT_INTERRUPTED = EXIT_SIGNAL_BASE + 2  # SIGINT (Ctrl-C): 130


def interrupted(what: str) -> str:
    """The one line a command prints on Ctrl-C (SIGINT) before it exits EXIT_INTERRUPTED, as it
    ends on SIGTERM: no traceback. `what`: what stopped, and what of it is left."""
    return f"interrupted (SIGINT): {what}"


class UserError(Exception):
    """Bad input the user can fix; the message is one line naming the fix."""

    exit_code = EXIT_USER_ERROR

    def __init__(self, message: str):
        super().__init__(" ".join(message.split()))


class StorageError(UserError):
    """A checkpoint save failed mid-run; the message names the last complete step."""

    exit_code = EXIT_STORAGE


class OutputDirError(StorageError):
    """A write to the output directory (metrics.jsonl, manifest, W&B files) failed mid-run."""


# (errno, the phrase C++ libraries such as tensorstore print for it, what the error line says)
_STORAGE_FAULTS = ((errno.ENOSPC, "No space left on device", "no space left on device"),
                   (errno.EDQUOT, "Disk quota exceeded", "disk quota exceeded"),
                   (errno.EACCES, "Permission denied", "permission denied"),
                   (errno.EROFS, "Read-only file system", "read-only file system"),
                   # what stands where the run writes: a folder named like its file, or a file on its path
                   (errno.EISDIR, "Is a directory", "a folder stands where a file goes"),
                   (errno.ENOTDIR, "Not a directory", "a file stands where a folder goes"))


def storage_fault(exc: BaseException | None) -> str | None:
    """"no space left on device" (or a quota, permission or read-only fault) when that is what
    `exc` or its causes come down to, else None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        for code, phrase, name in _STORAGE_FAULTS:
            if (isinstance(exc, OSError) and exc.errno == code) or phrase in str(exc):
                return name
        exc = exc.__cause__ or exc.__context__
    return None


def storage_fix(fault: str | None, where: str) -> str:
    """What the operator does about `fault` on `where`."""
    if fault in ("no space left on device", "disk quota exceeded"):
        return f"free space on {where}"
    if fault in ("permission denied", "read-only file system"):
        return f"make {where} writable for this user"
    if fault in ("a folder stands where a file goes", "a file stands where a folder goes"):
        return f"move what is in the way out of {where}"
    return f"restore access to {where}"


_OMEGACONF_TEMPLATES = ("$VALUE", "$KEY", "$FULL_KEY", "$OBJECT_TYPE", "$REF_TYPE")


def end_progress_bars() -> None:
    """Close the tqdm bars still open (each ends its line): an `error:` line printed next starts a line."""
    from tqdm import tqdm  # here: this module is standard library only at its top

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def one_line(exc: BaseException | None) -> str:
    """Collapse an exception (and its cause chain) to one readable line."""
    parts: list[str] = []
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc).split("Config search path:")[0]  # Hydra appends its search path
        text = text.split("full_key:")[0]  # OmegaConf appends key/object details
        text = " ".join(text.split())
        unformatted = any(t in text for t in _OMEGACONF_TEMPLATES)  # the raw copy of a message already said
        if text and not unformatted and all(text not in p for p in parts):
            parts.append(text)
        exc = exc.__cause__ or exc.__context__
    return ": ".join(parts) if parts else "unknown error"
