"""Every gcloud command line the launchers run, built here and nowhere else, and how they are run:
`run_quiet` for a short call whose output is read, `run_streaming` for an ssh whose output passes
through as it comes. gcloud's failures that no waiting fixes are recognised here, from its
documented messages: missing or expired credentials (`auth_failure`), a refused request (`refused`).
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import os
import re
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence, TextIO

from runtime import wire

NOT_FOUND = ("NOT_FOUND", "not found")
# What gcloud says of an expired, revoked or missing login.
AUTH_SIGNS = ("gcloud auth login", "refreshing your current auth tokens", "do not currently have an active account")
# Requests GCP refuses for good, by their status in gcloud's error line; QUOTA is waited on, then
# counted as an infrastructure failure (a programme stops when it repeats across variants).
REFUSED = ("INVALID_ARGUMENT", "PERMISSION_DENIED", "unrecognized arguments", "Invalid value")
QUOTA = ("RESOURCE_EXHAUSTED", "Quota", "quota")
OWNER_LABEL = "launcher-owner"  # on every slice a programme creates: whose it is (its release deletes only its own)


class PodError(Exception):
    """A user error, reported as one line (exit 2)."""


@dataclass(frozen=True)
class Target:
    """A TPU VM slice by name, zone and (optionally) project."""
    tpu: str
    zone: str
    project: str | None = None


@dataclass(frozen=True)
class Shape:
    """What `create` makes; tier: spot, reserved or None (on demand)."""
    accelerator_type: str | None = None
    runtime_version: str | None = None
    tier: str | None = None
    queued_resource: str | None = None
    owner: str | None = None  # labelled on the slice as OWNER_LABEL (None: no label)


def owner_label(owner: str) -> str:
    """`owner` as a GCE label value (lowercase letters, digits, _ and -, a letter first, 63 at most);
    one that had to be changed ends in a hash of `owner`, so that two owners never share a value."""
    value = re.sub(r"[^a-z0-9_-]", "-", owner.lower())
    value = value if re.match("[a-z]", value) else "o-" + value
    if value == owner and len(value) <= 63:
        return value
    return f"{value[:54]}-{hashlib.sha256(owner.encode()).hexdigest()[:8]}"


def _at(t: Target) -> list[str]:
    return ["--zone", t.zone, *(["--project", t.project] if t.project else [])]


def _tier_owner(shape: Shape) -> list[str]:
    """The tier and the owner's label (a queued resource gives its node the label)."""
    return [*([f"--{shape.tier}"] if shape.tier else []),
            *([f"--labels={OWNER_LABEL}={owner_label(shape.owner)}"] if shape.owner else [])]


def _tpu_vm(t: Target, verb: str, *flags: str) -> list[str]:
    return ["gcloud", "compute", "tpus", "tpu-vm", verb, t.tpu, *_at(t), *flags]


def ssh_argv(t: Target, command: str) -> list[str]:
    """The single ssh that runs `command` on every worker of the slice."""
    return _tpu_vm(t, "ssh", "--worker=all", "--command", command)


def scp_argv(t: Target, local: str, remote: str) -> list[str]:
    """Copy the local file to `remote` (relative: in the home directory) on every worker."""
    return ["gcloud", "compute", "tpus", "tpu-vm", "scp", local, f"{t.tpu}:{remote}", *_at(t), "--worker=all"]


def describe_argv(t: Target) -> list[str]:
    return _tpu_vm(t, "describe", "--format=json")


def create_argv(t: Target, shape: Shape) -> list[str]:
    return _tpu_vm(t, "create", f"--accelerator-type={shape.accelerator_type}", f"--version={shape.runtime_version}",
                   *_tier_owner(shape))


def delete_argv(t: Target) -> list[str]:
    return _tpu_vm(t, "delete", "--quiet")


def queued_describe_argv(t: Target, shape: Shape) -> list[str]:
    return ["gcloud", "compute", "tpus", "queued-resources", "describe", shape.queued_resource, *_at(t),
            "--format=json"]


def queued_create_argv(t: Target, shape: Shape) -> list[str]:
    return ["gcloud", "compute", "tpus", "queued-resources", "create", shape.queued_resource, f"--node-id={t.tpu}",
            *_at(t), f"--accelerator-type={shape.accelerator_type}", f"--runtime-version={shape.runtime_version}",
            *_tier_owner(shape)]


def queued_delete_argv(t: Target, shape: Shape) -> list[str]:
    return ["gcloud", "compute", "tpus", "queued-resources", "delete", shape.queued_resource, *_at(t),
            "--quiet", "--force"]


# --- what gcloud said ----------------------------------------------------------------------------

def error_line(output: str) -> str:
    """gcloud's `ERROR: ...` line (the first), else the output's last non-empty line, as one line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    found = next((line for line in lines if line.startswith("ERROR:")), lines[-1] if lines else "(no output)")
    return " ".join(found.split())[:400]


def auth_failure(output: str) -> str | None:
    """gcloud's error line when its credentials are missing or expired, else None."""
    return error_line(output) if any(sign in output for sign in AUTH_SIGNS) else None


def not_found(output: str) -> bool:
    return any(sign in output for sign in NOT_FOUND)


def refused(output: str) -> bool:
    return any(sign in output for sign in REFUSED)


def quota(output: str) -> bool:
    return any(sign in output for sign in QUOTA)


# --- running gcloud ------------------------------------------------------------------------------

Runner = Callable[[Sequence[str]], "tuple[int, str]"]


def run_quiet(argv: Sequence[str]) -> tuple[int, str]:
    """(exit code, stdout + stderr) of a short gcloud call."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise PodError(f"{argv[0]} not found on PATH; install the Google Cloud CLI") from None
    return proc.returncode, proc.stdout + proc.stderr


def run_streaming(argv: Sequence[str], *, stream: TextIO | None = None, log_path: Path | None = None,
                  on_line: Callable[[str], None] | None = None,
                  started: Callable[[subprocess.Popen], None] | None = None) -> int:
    """gcloud's exit code; its merged output to `log_path` as it is and to `stream` the lines a
    person reads (wire.for_people). `started(proc)`: for a controller that must end it early. On
    Ctrl-C gcloud is stopped and KeyboardInterrupt re-raised (the remote processes may live on)."""
    try:
        proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    except FileNotFoundError:
        raise PodError(f"{argv[0]} not found on PATH; install the Google Cloud CLI") from None
    if started:
        started(proc)
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    log = open(log_path, "a", encoding="utf-8") if log_path else None

    def write(sink: TextIO | None, text: str) -> None:
        if sink is not None:
            with contextlib.suppress(OSError, ValueError):  # our stdout went away (`| head`): keep draining gcloud
                print(text, end="", file=sink, flush=True)

    def line(text: str) -> None:
        if text and wire.for_people(text):  # "" between \r and \n
            write(stream, text + "\n")
        if on_line:
            on_line(text)

    partial = ""
    try:
        fd = proc.stdout.fileno()
        while True:
            chunk = os.read(fd, 65536)
            text = decoder.decode(chunk, final=not chunk)
            write(log, text)
            *complete, partial = re.split(r"[\r\n]", partial + text)  # lines end at \n or \r (tqdm redraws with \r)
            for each in complete:
                line(each)
            if not chunk:
                if partial:
                    line(partial)
                return proc.wait()
    except KeyboardInterrupt:
        # In a terminal gcloud got the SIGINT too; send it anyway (a `kill -INT` of us alone).
        end(proc)
        raise
    finally:
        proc.stdout.close()
        if log:
            log.close()


def end(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """Stop a gcloud process as Ctrl-C would (its ssh sessions end; the workers' processes may not)."""
    try:
        proc.send_signal(signal.SIGINT)
        proc.wait(grace)
    except (subprocess.TimeoutExpired, ProcessLookupError, KeyboardInterrupt):
        proc.kill()
        proc.wait()
