"""Run commands on every worker of a Cloud TPU VM slice through ONE `gcloud ... ssh --worker=all`.

Why one ssh: a per-worker loop can leave some workers unstarted (one ssh fails, the loop is
interrupted), and a JAX job with a missing process hangs at the coordinator. gcloud starts the
command on all workers at once and fails if any of them fails; the launcher exits with its code.

Operations (CLI in experiments/launch.py):
  pod     run pretrain_jax.py on all workers with one shared run id; log per worker and locally
  setup   run setup_tpu.sh on all workers (optionally after `git checkout REF`), then compare
          commit and package versions across workers: a mismatch is an error
  stop    kill this login's stale training processes and TPU holders, remove the libtpu lockfile
  status  per worker: training process alive, pid, elapsed, last step, newest log file

Quoting: gcloud hands --command to the worker's login shell (bash on TPU VMs), so every user
value is quoted exactly once with shlex.quote; `~/...` paths become "$HOME"/... so they still
expand there.

Secrets (WANDB_API_KEY, --forward-env NAME) never appear on a command line: gcloud writes its
whole argv to its own log file, and a remote `bash -c` command line is world-readable in
/proc/<pid>/cmdline for the whole run. Nor on ssh's stdin: with --worker=all gcloud runs one ssh
per worker, all reading gcloud's one stdin, so only one worker would get the bytes. Instead
`gcloud ... scp --worker=all` copies a 0600 file (written in a private temporary directory here,
deleted right after) to ~/.podrunner-secrets-<random> on every worker; the run's command sources
it in the subshell that then execs python, removes it at once (and at exit, whatever happens),
so the values live only in python's environment (/proc/<pid>/environ: the user's own). Every
print, the dry run and the local logs name the secrets, never their values. `stop` removes the
file a failed launch left behind.

Run ids: `--run-id ID` (or a run.id= override) is fixed: passed as run.id=ID, so the trainer
refuses to resume a checkpoint written under another id (exit 2). Without one, a new id is only
proposed (PODRUNNER_RUN_ID): a fresh run takes it, a resumed run keeps its checkpoint's id. The
trainer prints the id it uses (`run id X (why)`); when that is not the launch's id the launcher
says so and writes it to <log-dir>/<launch id>/run_id. Logs (here and on the workers) are filed
under the launch's id.

Shipping (`pod --ship`, experiments/ship.py): the local working tree is packed, copied with one
`scp --worker=all`, unpacked once per tree in ~/podrunner-shipped/<tree hash> on each worker and
run there with the repo's .venv (`shipped_steps`); PODRUNNER_SHIPPED_TREE carries the tree hash
and its diff from HEAD to the run's manifest. Without it the workers run their checkout and the
launcher warns when their commits differ.

gcloud's `--worker=all` output is interleaved; the remote helpers of `setup` and `status` print
one tagged line per worker (`podrunner-versions {json}`, `podrunner-status {json}`), found
anywhere in a line so that a prefix added by gcloud does not matter.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import os
import re
import secrets
import shlex
import signal
import string
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence, TextIO

from experiments.ship import DEFAULT_MAX_MB, Pack, ShipError, pack_tree
from runtime.errors import EXIT_FAILURE, EXIT_INTERRUPTED
from runtime.run_ids import PROPOSED_RUN_ID_ENV, RUN_ID

DEFAULT_REPO_DIR = "~/podrunner"
DEFAULT_LOG_DIR = Path("outputs/launch-logs")
SECRET_ENV = ("WANDB_API_KEY",)  # forwarded from the local environment when set, never printed
SECRETS_PREFIX = ".podrunner-secrets-"  # + a random token: the secrets file in each worker's home
SHIPPED_TREE_ENV = "PODRUNNER_SHIPPED_TREE"  # read by runtime/manifest.py: JSON of what --ship sent
SHIP_DIR = "~/podrunner-shipped"  # + /<tree hash>: a shipped tree, unpacked once per worker
REPO_ROOT = Path(__file__).resolve().parent.parent  # what --ship packs by default

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_RUN_ID_OVERRIDE = re.compile(r"^\+{0,2}run\.id=(.*)$")
STATUS_TAG = "podrunner-status "
VERSIONS_TAG = "podrunner-versions "
START_TAG = "podrunner-start "
_TRAINER_RUN_ID = re.compile(r"\bINFO run id (\S+) \(([^)]*)\)")  # runtime/trainer.py choose_run_id's line


class PodError(Exception):
    """A user error, reported as one line (exit 2)."""


@dataclass(frozen=True)
class Target:
    tpu: str
    zone: str
    project: str | None = None


def _where(target: Target) -> list[str]:
    return ["--zone", target.zone, *(["--project", target.project] if target.project else []), "--worker=all"]


def gcloud_argv(target: Target, command: str) -> list[str]:
    """The single ssh that runs `command` on every worker of the slice."""
    return ["gcloud", "compute", "tpus", "tpu-vm", "ssh", target.tpu, *_where(target), "--command", command]


def gcloud_scp_argv(target: Target, local: str, remote: str) -> list[str]:
    """Copy the local file to `remote` (relative: in the home directory) on every worker."""
    return ["gcloud", "compute", "tpus", "tpu-vm", "scp", local, f"{target.tpu}:{remote}", *_where(target)]


def remote_path(path: str) -> str:
    """`path` quoted for the worker's shell; a leading `~` becomes "$HOME" so it still expands."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        rest = path[2:]
        return '"$HOME"' + ("/" + shlex.quote(rest) if rest else "")
    return shlex.quote(path)


def new_run_id() -> str:
    """Sortable and unique enough: 20250131-142501-k3x9 (starts with a digit run, but Hydra
    parses it as a string because of the dashes)."""
    suffix = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(4))
    return time.strftime("%Y%m%d-%H%M%S-") + suffix


def resolve_run_id(run_id: str | None, overrides: Sequence[str]) -> tuple[str, list[str], bool]:
    """(launch id, overrides, fixed). A given id (--run-id, or a run.id= override) is fixed: the
    overrides end in run.id=<id>, and the trainer refuses a checkpoint of another run. Else a new
    id, only proposed to the trainer (PODRUNNER_RUN_ID): a resumed run keeps its checkpoint's."""
    given = [m.group(1) for m in map(_RUN_ID_OVERRIDE.match, overrides) if m]
    if given and run_id is not None and given[-1] != run_id:
        raise PodError(f"--run-id {run_id} conflicts with the override run.id={given[-1]}; give one")
    fixed = bool(given) or run_id is not None
    run_id = given[-1] if given else (run_id or new_run_id())
    if not RUN_ID.fullmatch(run_id):
        raise PodError(f"run id {run_id!r}: use 1-64 letters, digits, '.', '_' or '-' (it names log "
                       "directories on the workers)")
    if given or not fixed:
        return run_id, list(overrides), fixed
    return run_id, [*overrides, f"run.id={run_id}"], fixed


def check_forwarded(forward: Iterable[str], environ: Mapping[str, str]) -> None:
    """Every --forward-env NAME is set here: a typo'd or unexported name would reach the workers
    as nothing at all, and the run would fail there (or worse, run without it)."""
    unset = [name for name in dict.fromkeys(forward) if not environ.get(name)]
    if unset:
        raise PodError(f"--forward-env {unset[0]}: {unset[0]} is not set in this environment, so there is nothing to "
                       f"forward; export it first, or drop --forward-env {unset[0]}")


def remote_env(extra: Mapping[str, str], forward: Iterable[str],
               environ: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(plain, secret) variables for the workers. Secrets: SECRET_ENV plus `forward`, taken from
    `environ` when set there."""
    for name in [*extra, *forward]:
        if not _ENV_NAME.fullmatch(name):
            raise PodError(f"{name!r} is not an environment variable name")
    check_forwarded(forward, environ)
    secret = {k: environ[k] for k in dict.fromkeys([*SECRET_ENV, *forward]) if environ.get(k)}
    return dict(extra), secret


def _fail(message: str, code: int = 2) -> str:
    """`|| <this>`: say on which worker and why, then end that worker's command. `message` is
    ours (no user values: it sits inside double quotes)."""
    return f'{{ echo "podrunner: $(hostname): {message}" >&2; exit {code}; }}'


def secrets_file_text(secret_env: Mapping[str, str]) -> str:
    """The secrets file the workers source (with `set -a`): one KEY='value' line each."""
    return "".join(f"{k}={shlex.quote(v)}\n" for k, v in secret_env.items())


def pod_command(repo_dir: str, run_id: str, overrides: Sequence[str], env: Mapping[str, str],
                secrets_file: str | None = None, ship: Pack | None = None) -> str:
    """Worker command: cd, activate, export, then `python pretrain_jax.py ...` tee'd to
    ~/podrunner-logs/<run_id>/worker-<hostname>.log. pipefail makes python's code the exit code.
    `secrets_file` (in the home directory, copied there by `send_secrets`): sourced in the
    subshell that execs python, so only python's environment holds the values; removed right
    after, and by the EXIT trap if the command ends before. `ship`: run from the shipped tree
    (`shipped_steps`) instead of the repo, and report its hash instead of the commit."""
    exports = ["PYTHONUNBUFFERED=1", f"{PROPOSED_RUN_ID_ENV}={shlex.quote(run_id)}"]
    if ship:  # PYTHONPATH: a subprocess's python imports the shipped code too
        exports += [f"{SHIPPED_TREE_ENV}={shlex.quote(json.dumps(ship.shipped_record(), sort_keys=True))}",
                    'PYTHONPATH="$SHIP"']
    exports += [f"{k}={shlex.quote(v)}" for k, v in env.items()]
    rid = shlex.quote(run_id)
    train = " ".join(["python", "pretrain_jax.py", *map(shlex.quote, overrides)])
    steps = ["set -o pipefail"]
    if secrets_file:
        steps.append(f"SECRETS={remote_path('~/' + secrets_file)}; trap 'rm -f \"$SECRETS\"' EXIT")
        train = ('( { set -a && . "$SECRETS" && set +a && rm -f "$SECRETS"; } || '
                 + _fail("the secrets file did not arrive (gcloud scp)") + f"; exec {train}; )")
    if ship:
        steps += shipped_steps(repo_dir, ship)
        version = f"tree={ship.tree_hash}"
    else:
        steps += [f"cd {remote_path(repo_dir)} || " + _fail("no repo at --repo-dir"),
                  ". .venv/bin/activate || " + _fail("no .venv in the repo (run launch.py setup)")]
        version = "commit=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)"
    return "; ".join([
        *steps,
        "export " + " ".join(exports),
        f'LOG="$HOME"/podrunner-logs/{rid}/worker-"$(hostname)".log',
        'mkdir -p "${LOG%/*}" || ' + _fail("cannot create the log directory"),
        f'{{ echo "{START_TAG}host=$(hostname) {version} launch_id={run_id} log=$LOG"; {train}; }} 2>&1 '
        '| tee -a "$LOG"',
    ])


def ship_remote_name(pack: Pack) -> str:
    """The pack's name in each worker's home while it is copied there."""
    return f".podrunner-ship-{pack.tree_hash[:16]}.tar.gz"


# Warns when the shipped pyproject.toml pins other packages than the repo's (whose .venv runs).
_PINS_CHECK = r'''
import sys
def pins(path):
    try:
        import tomllib
    except ImportError:  # python < 3.11: the whole file
        return open(path, "rb").read()
    with open(path, "rb") as f:
        data = tomllib.load(f)
    project = data.get("project", {})
    return project.get("dependencies"), project.get("optional-dependencies"), data.get("build-system")
try:
    same = pins(sys.argv[1]) == pins(sys.argv[2])
except (OSError, ValueError):
    same = False
if not same:
    print(f"podrunner: {sys.argv[3]}: WARNING: the shipped pyproject.toml pins other packages than the one in "
          "--repo-dir; the run uses the .venv there (shipping installs nothing): run launch.py setup", file=sys.stderr)
'''


def shipped_steps(repo_dir: str, pack: Pack) -> list[str]:
    """Worker steps for --ship: unpack the copied pack into ~/podrunner-shipped/<tree hash> unless
    it is there already (into a temporary directory renamed into place, so a half-unpacked tree is
    never used), link the repo's .venv into it (setup installs the packages; shipping code installs
    nothing), cd there and activate; warn when pyproject.toml's pins differ from the repo's."""
    repo = remote_path(repo_dir if repo_dir.startswith(("/", "~")) else "~/" + repo_dir)  # the link's target
    unpack = ('T="$SHIP.tmp-$$"; rm -rf "$T" && mkdir -p "$T" && tar -xzf "$PACK" -C "$T" && '
              '{ mv -T "$T" "$SHIP" || rm -rf "$T"; }')
    return [
        f"SHIP={remote_path(SHIP_DIR + '/' + pack.tree_hash)}; PACK={remote_path('~/' + ship_remote_name(pack))}",
        f'{{ [ -d "$SHIP" ] || {{ {unpack}; }}; }} || ' + _fail("cannot unpack the shipped tree (gcloud scp)"),
        'rm -f "$PACK"',
        f'ln -sfn {repo}/.venv "$SHIP"/.venv || ' + _fail("cannot link the .venv of --repo-dir into the shipped tree"),
        'cd "$SHIP" || ' + _fail("the shipped tree is missing"),
        ". .venv/bin/activate || " + _fail("no .venv in the repo at --repo-dir (run launch.py setup)"),
        f'python -c {shlex.quote(_PINS_CHECK)} pyproject.toml {repo}/pyproject.toml "$(hostname)"',
    ]


def remove_secrets_command(secrets_file: str) -> str:
    return f"rm -f {remote_path('~/' + secrets_file)}"


_VERSIONS_SCRIPT = r'''
import json, subprocess, sys
from importlib import metadata
def version(p):
    try:
        return metadata.version(p)
    except metadata.PackageNotFoundError:
        return None
try:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
except OSError:
    commit = None
info = {"host": sys.argv[1], "commit": commit, "python": sys.version.split()[0]}
info.update({p: version(p) for p in ("jax", "jaxlib", "libtpu", "flax", "orbax-checkpoint")})
print("podrunner-versions " + json.dumps(info), flush=True)
'''


def setup_command(repo_dir: str, git_ref: str | None = None, clone_url: str | None = None) -> str:
    """Worker command: [git clone URL when the repo is missing (a re-created TPU has fresh disks)],
    [git fetch + checkout REF], bash setup_tpu.sh, then one versions line."""
    steps = ["set -o pipefail"]
    if clone_url:
        steps.append(f"{{ [ -d {remote_path(repo_dir)} ] || git clone --quiet {shlex.quote(clone_url)} "
                     f"{remote_path(repo_dir)}; }} || " + _fail("git clone of --clone-url failed"))
    steps.append(f"cd {remote_path(repo_dir)} || " + _fail("no repo at --repo-dir"))
    if git_ref:
        # A branch name means the fetched remote branch, not a stale local one.
        steps += ["git fetch --quiet --tags origin || " + _fail("git fetch failed"),
                  f"{{ git checkout --quiet --detach {shlex.quote('origin/' + git_ref)} 2>/dev/null || "
                  f"git checkout --quiet --detach {shlex.quote(git_ref)}; }} || "
                  + _fail("cannot check out --git-ref")]
    steps += ["bash setup_tpu.sh || exit $?",
              f'.venv/bin/python -c {shlex.quote(_VERSIONS_SCRIPT)} "$(hostname)"']
    return "; ".join(steps)


# Runs on each worker with the system python3 (works even when the repo's venv is broken).
# Which processes: "ours" = started in a session of this user with this HOME, i.e. the ones
# this login may kill; others are reported with a `sudo kill` hint. Overridable for tests:
# PODRUNNER_LIBTPU_LOCKFILE, PODRUNNER_TPU_DEVICES (':'-separated globs); `~` expands.
_REMOTE_TOOL = r'''
import glob, json, os, pwd, re, signal, sys, time
from fnmatch import fnmatch

TRAINING = re.compile(r"pretrain_jax[.]py")  # written so that it does not match this command line
mode, host = sys.argv[1], sys.argv[2]
home = os.path.realpath(os.path.expanduser("~"))


def stat(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()  # [0] state, [1] ppid, [19] start time


def alive(pid):
    try:
        return stat(pid)[0] not in "ZX"  # a zombie has released the TPU
    except (OSError, IndexError):
        return False


def ancestors():
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            pid = int(stat(pid)[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def processes(with_fds):
    """(pid, argv, ours, holds_tpu) of every live process except this one and its ancestors."""
    devices = [os.path.expanduser(p) for p in
               os.environ.get("PODRUNNER_TPU_DEVICES", "/dev/accel*:/dev/vfio/[0-9]*").split(":") if p]
    skip = ancestors()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in skip:
            continue
        pid = int(name)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:  # gone
            continue
        if not argv:  # kernel thread or zombie
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
            proc_home = env.get(b"HOME", b"").decode(errors="replace")
            ours = bool(proc_home) and os.path.realpath(proc_home) == home
        except OSError:  # environ is private to the process owner
            ours = False
        holds = False
        if with_fds and ours:
            try:
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    try:
                        target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    except OSError:
                        continue
                    if any(fnmatch(target, d) for d in devices):
                        holds = True
                        break
            except OSError:
                pass
        yield pid, argv, ours, holds


def owner(pid):
    try:
        return pwd.getpwuid(os.stat(f"/proc/{pid}").st_uid).pw_name
    except (OSError, KeyError):
        return "?"


def open_by(path):
    """Pids (that we may look at) with `path` open."""
    real, pids = os.path.realpath(path), []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{name}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{name}/fd/{fd}") == real:
                    pids.append(int(name))
                    break
            except OSError:
                pass
    return pids


def wait_gone(pids, seconds):
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def stop(grace):
    targets, foreign = [], []
    for pid, argv, ours, holds in processes(True):
        cmd = " ".join(argv)
        if TRAINING.search(cmd) or holds:
            (targets if ours else foreign).append((pid, cmd, holds))
    pids = [t[0] for t in targets]
    if grace > 0 and pids:  # SIGTERM first: the trainer checkpoints on preemption
        for p in pids:
            try:
                os.kill(p, signal.SIGTERM)
            except ProcessLookupError:
                pass
        wait_gone(pids, grace)
    for pid, cmd, holds in targets:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        note = " (held the TPU)" if holds else ""
        print(f"[{host}] killed pid {pid}{note}: {cmd[:300]}", flush=True)
    left = wait_gone(pids, 10)
    for pid, cmd, _ in foreign:
        print(f"[{host}] not killed: pid {pid} of user {owner(pid)} (another login): {cmd[:300]}; "
              f"`sudo kill -9 {pid}` if it is stale", flush=True)
    lock = os.path.expanduser(os.environ.get("PODRUNNER_LIBTPU_LOCKFILE", "/tmp/libtpu_lockfile"))
    code = 1 if left else 0
    users = open_by(lock)
    if users:  # a live libtpu still holds it: the lock is not stale, and removing it would hurt
        lock_note, code = f"kept {lock}: still open by pid {users}", 1
    else:
        try:
            os.remove(lock)
            lock_note = f"removed {lock}"
        except FileNotFoundError:
            lock_note = f"no {lock}"
        except OSError as e:
            lock_note, code = f"could not remove {lock} ({e}); `sudo rm -f {lock}`", 1
    summary = f"killed {len(targets)} process(es)" if targets else "nothing running"
    if left:
        summary += f", still alive: {left}"
    print(f"[{host}] {summary}; {lock_note}{remove_secrets()}", flush=True)
    return code


def remove_secrets():
    """The secrets files of launches that never started (a run removes its own at once)."""
    removed = 0
    for path in glob.glob(os.path.join(glob.escape(home), ".podrunner-secrets-*")):
        try:
            os.remove(path)
            removed += 1
        except OSError:
            pass
    return f"; removed {removed} leftover secrets file(s)" if removed else ""


def newest(paths):
    stamped = []
    for p in paths:
        try:
            stamped.append((os.path.getmtime(p), p))
        except OSError:
            pass
    return max(stamped)[1] if stamped else None


def tail(path, size=65536):
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - size))
        return f.read().decode(errors="replace")


PROGRESS = re.compile(r"(\d+)/\d+ \[|\bstep[ =:]+(\d+)")  # tqdm "45/100 [" or "step 45"


def last_step(metrics, log):
    if metrics:
        for line in reversed(tail(metrics).splitlines()):
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                return row["step"], "metrics"
    if log:
        for line in reversed(re.split(r"[\r\n]", tail(log))):
            found = PROGRESS.findall(line)
            if found:
                a, b = found[-1]
                return int(a or b), "log"
    return None, None


def status(repo, outputs, run_id):
    tick, uptime = os.sysconf("SC_CLK_TCK"), float(open("/proc/uptime").read().split()[0])
    procs = []
    for pid, argv, ours, _ in processes(False):
        if ours and TRAINING.search(" ".join(argv)) and os.path.basename(argv[0]).startswith("python"):
            try:
                procs.append([pid, int(uptime - int(stat(pid)[19]) / tick)])
            except (OSError, ValueError, IndexError):
                pass
    metrics = newest(glob.glob(os.path.join(repo, outputs, "**", "metrics.jsonl"), recursive=True))
    log = newest(glob.glob(os.path.join(home, "podrunner-logs", glob.escape(run_id) if run_id else "*",
                                        "worker-*.log")))
    step, source = last_step(metrics, log)
    found = re.search(r"-w-(\d+)$", host)
    worker = os.environ.get("TPU_WORKER_ID") or (found.group(1) if found else None)
    print("podrunner-status " + json.dumps({"host": host, "worker": worker, "processes": procs, "step": step,
                                            "step_from": source, "metrics": metrics, "log": log}), flush=True)
    return 0


if mode == "stop":
    sys.exit(stop(float(sys.argv[3])))
sys.exit(status(sys.argv[3], sys.argv[4], sys.argv[5]))
'''


def stop_command(grace: float = 0.0) -> str:
    return f'python3 -c {shlex.quote(_REMOTE_TOOL)} stop "$(hostname)" {grace:g}'


def status_command(repo_dir: str, outputs: str = "outputs", run_id: str | None = None) -> str:
    return (f'python3 -c {shlex.quote(_REMOTE_TOOL)} status "$(hostname)" {remote_path(repo_dir)} '
            f'{shlex.quote(outputs)} {shlex.quote(run_id or "")}')


# --- running gcloud locally -----------------------------------------------------------------

class _Lines:
    """Feeds complete lines (split at \\n or \\r: tqdm redraws with \\r) to a callback."""

    def __init__(self, on_line: Callable[[str], None] | None) -> None:
        self._on_line, self._buf = on_line, ""

    def feed(self, text: str) -> None:
        if self._on_line is None:
            return
        *lines, self._buf = re.split(r"[\r\n]", self._buf + text)
        for line in lines:
            self._on_line(line)

    def close(self) -> None:
        if self._on_line is not None and self._buf:
            self._on_line(self._buf)
        self._buf = ""


def run_gcloud(argv: Sequence[str], *, stream: TextIO | None = None, log_path: Path | None = None,
               on_line: Callable[[str], None] | None = None) -> int:
    """Run gcloud, passing its merged output through unchanged (so a progress bar still redraws)
    to `stream` and `log_path`; return its exit code. On Ctrl-C gcloud is stopped and
    KeyboardInterrupt re-raised (the remote processes may live on: the caller decides)."""
    try:
        proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    except FileNotFoundError:
        raise PodError(f"{argv[0]} not found on PATH; install the Google Cloud CLI") from None
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    lines = _Lines(on_line)
    log = open(log_path, "a", encoding="utf-8") if log_path else None

    def emit(text: str) -> None:
        for sink in (stream, log):
            if sink is not None and text:
                try:
                    sink.write(text)
                    sink.flush()
                except (OSError, ValueError):
                    pass  # our stdout went away (`| head`): keep draining gcloud
        lines.feed(text)

    try:
        fd = proc.stdout.fileno()
        while chunk := os.read(fd, 65536):
            emit(decoder.decode(chunk))
        emit(decoder.decode(b"", final=True))
        lines.close()
        return proc.wait()
    except KeyboardInterrupt:
        # In a terminal gcloud got the SIGINT too; send it anyway (a `kill -INT` of us alone).
        _end(proc)
        raise
    finally:
        proc.stdout.close()
        if log:
            log.close()


def _end(proc: subprocess.Popen, grace: float = 10.0) -> None:
    try:
        proc.send_signal(signal.SIGINT)
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    except (ProcessLookupError, KeyboardInterrupt):
        proc.kill()
        proc.wait()


def _say(stream: TextIO, message: str) -> None:
    stream.write(f"[launch] {message}\n")
    stream.flush()


def _tagged(line: str, tag: str) -> dict | None:
    """The JSON after `tag` anywhere in the line (gcloud may prefix worker output)."""
    i = line.find(tag)
    if i < 0:
        return None
    try:
        return json.loads(line[i + len(tag):])
    except ValueError:
        return None


# --- the operations -------------------------------------------------------------------------

def launch_pod(target: Target, overrides: Sequence[str], *, repo_dir: str = DEFAULT_REPO_DIR,
               run_id: str | None = None, log_dir: Path = DEFAULT_LOG_DIR,
               env: Mapping[str, str] | None = None, forward_env: Iterable[str] = (),
               dry_run: bool = False, interrupt_grace: float = 30.0, leave_running: bool = False,
               ship: bool | Pack = False, ship_from: Path | str | None = None,
               ship_max_mb: float = DEFAULT_MAX_MB,
               environ: Mapping[str, str] | None = None, stream: TextIO | None = None) -> int:
    """Run pretrain_jax.py on all workers; exit code = gcloud's (130 after Ctrl-C). With secrets,
    first copy them (`send_secrets`); if that fails, nothing is started and its code is returned.
    `ship`: True packs the working tree of `ship_from` (default: this checkout) now; a Pack (e.g.
    one a supervisor packed once for all its relaunches) is sent as it is; either is copied to
    every worker and the run starts from it. Run ids and secrets: see the module docstring."""
    stream = stream or sys.stdout
    environ = os.environ if environ is None else environ
    run_id, overrides, fixed = resolve_run_id(run_id, overrides)
    plain, secret = remote_env(env or {}, forward_env, environ)
    packing = ship is True  # a temporary directory only then: a Pack given is the caller's to delete
    with (tempfile.TemporaryDirectory(prefix="podrunner-ship-") if packing else contextlib.nullcontext()) as tmp:
        pack = ship if isinstance(ship, Pack) else None
        if packing:
            try:
                pack = pack_tree(ship_from or REPO_ROOT, tmp, max_mb=ship_max_mb)
            except ShipError as e:
                raise PodError(str(e)) from None
        secrets_file = SECRETS_PREFIX + secrets.token_hex(8) if secret else None
        command = pod_command(repo_dir, run_id, overrides, plain, secrets_file, pack)
        shown = shown_commands(target, command, secret, secrets_file, pack)
        if dry_run:
            stream.write(shown)
            return 0
        run_dir = Path(log_dir) / run_id
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "command.txt").write_text(shown)
        how = ("fixed: a checkpoint of another run is refused" if fixed else
               "proposed: a fresh run takes it, a resumed run keeps its checkpoint's")
        _say(stream, f"run id {run_id} ({how}); output also in {run_dir / 'launch.log'}; on the workers in "
                     f"~/podrunner-logs/{run_id}/worker-<hostname>.log")
        return _run_pod(target, command, secret, secrets_file, pack, run_id, run_dir, stream=stream,
                        interrupt_grace=interrupt_grace, leave_running=leave_running)


def _run_pod(target: Target, command: str, secret: Mapping[str, str], secrets_file: str | None,
             pack: Pack | None, run_id: str, run_dir: Path, *, stream: TextIO, interrupt_grace: float,
             leave_running: bool) -> int:
    """Copy the secrets and the shipped tree, then run `command` on every worker (launch_pod)."""
    log_path, watch = run_dir / "launch.log", _PodWatch(stream, run_id, run_dir)
    try:
        if secrets_file:
            _say(stream, f"secrets {', '.join(secret)}: sent as a 0600 file, read and removed on each worker "
                         "before python starts (never on a command line)")
            code = send_secrets(target, secret, secrets_file, stream=stream, log_path=log_path)
            if code != 0:
                _say(stream, f"copying the secrets to the workers failed (gcloud exit code {code}); nothing was started")
                _remove_secrets(target, secrets_file, stream, log_path)
                return code
        if pack:
            _say(stream, f"shipping the working tree: {_pack_line(pack)}")
            code = run_gcloud(gcloud_scp_argv(target, str(pack.path), ship_remote_name(pack)),
                              stream=stream, log_path=log_path)
            if code != 0:
                _say(stream, f"copying the tree to the workers failed (gcloud exit code {code}); nothing was started")
                if secrets_file:
                    _remove_secrets(target, secrets_file, stream, log_path)
                return code
        code = run_gcloud(gcloud_argv(target, command), stream=stream, log_path=log_path, on_line=watch.line)
    except KeyboardInterrupt:
        return _interrupted(target, stream, interrupt_grace, leave_running)
    if code in (EXIT_INTERRUPTED, -signal.SIGINT):
        # gcloud alone took the Ctrl-C (a launcher started with SIGINT ignored, e.g. by `&` in a
        # script, or `kill -INT` of gcloud): the ssh sessions are gone, the workers may not be.
        return _interrupted(target, stream, interrupt_grace, leave_running)
    if code != 0:
        hint = ("a stale process holds the TPU: run `launch.py stop` first" if watch.tpu_busy else
                "other workers may still be running: check with `launch.py status`, end them with "
                "`launch.py stop`")
        _say(stream, f"gcloud exited with code {code}; {hint}")
        if secrets_file:  # a worker whose command never started still holds the file
            _remove_secrets(target, secrets_file, stream, log_path)
    return code


def _interrupted(target: Target, stream: TextIO, grace: float, leave_running: bool) -> int:
    """After Ctrl-C: stop the run on every worker (they checkpoint on SIGTERM), unless told not to."""
    if leave_running:
        _say(stream, "interrupted; the workers may still be running (launch.py status / stop)")
        return EXIT_INTERRUPTED
    _say(stream, f"interrupted: stopping the run on all workers (SIGTERM, SIGKILL after {grace:g} s)")
    try:
        stop_pod(target, grace=grace, stream=stream)  # also removes a leftover secrets file
    except KeyboardInterrupt:
        _say(stream, "stop interrupted; run `launch.py stop` to make sure the TPU is free")
    return EXIT_INTERRUPTED


def _pack_line(pack: Pack) -> str:
    diff = pack.summary["diff_summary"]
    base = (pack.summary["base_commit"] or "no commit")[:12]
    return (f"{pack.files} files, {pack.size / 1024:.0f} KiB packed, tree {pack.tree_hash} (base {base}, "
            f"{len(diff['changed'])} changed, {len(diff['untracked'])} untracked); on each worker in "
            f"{SHIP_DIR}/{pack.tree_hash}, run with the repo's .venv")


def shown_commands(target: Target, command: str, secret: Mapping[str, str], secrets_file: str | None,
                   pack: Pack | None = None) -> str:
    """What `pod` runs, as printed by --dry-run and kept in command.txt: names, never values."""
    lines = []
    if secrets_file:
        lines += [f"# secrets {', '.join(secret)}: a 0600 file of KEY='value' lines, copied, never on a command line",
                  shlex.join(gcloud_scp_argv(target, "SECRETS-FILE", secrets_file))]
    if pack:
        lines += [f"# ship: {_pack_line(pack)}",
                  shlex.join(gcloud_scp_argv(target, "PACK.tar.gz", ship_remote_name(pack)))]
    return "".join(line + "\n" for line in [*lines, shlex.join(gcloud_argv(target, command))])


def send_secrets(target: Target, secret_env: Mapping[str, str], secrets_file: str, *,
                 stream: TextIO, log_path: Path | None = None) -> int:
    """Copy the secrets to ~/<secrets_file> on every worker (one `gcloud ... scp --worker=all`;
    its exit code). The local copy: a 0600 file in a private temporary directory, deleted as soon
    as gcloud returns; scp creates the remote one with the same 0600 mode."""
    with tempfile.TemporaryDirectory(prefix="podrunner-") as tmp:
        local = os.path.join(tmp, secrets_file)
        with os.fdopen(os.open(local, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w", encoding="utf-8") as f:
            f.write(secrets_file_text(secret_env))
        return run_gcloud(gcloud_scp_argv(target, local, secrets_file), stream=stream, log_path=log_path)


def _remove_secrets(target: Target, secrets_file: str, stream: TextIO, log_path: Path | None) -> None:
    _say(stream, "removing the secrets file from the workers")
    code = run_gcloud(gcloud_argv(target, remove_secrets_command(secrets_file)), stream=stream, log_path=log_path)
    if code != 0:
        _say(stream, f"could not reach every worker (gcloud exit code {code}); `launch.py stop` removes the "
                     f"file ~/{secrets_file} too")


class _PodWatch:
    """Reads the pod's output as it streams: warns once when workers run different commits (or trees),
    remembers whether a worker found the TPU busy, and records the run id the trainer says it
    uses in <run_dir>/run_id (said here when it is not the launch's, i.e. a resumed run)."""

    _START = re.compile(re.escape(START_TAG) + r"host=(\S+) (?:commit|tree)=(\S+)")
    _BUSY = re.compile(r"TPU.*(already in use|busy)|libtpu_lockfile", re.IGNORECASE)

    def __init__(self, stream: TextIO, launch_id: str | None = None, run_dir: Path | None = None) -> None:
        self.stream, self.commits, self.warned, self.tpu_busy = stream, {}, False, False
        self.launch_id, self.run_dir, self.run_id = launch_id, run_dir, None

    def line(self, line: str) -> None:
        if self._BUSY.search(line):
            self.tpu_busy = True
        used = _TRAINER_RUN_ID.search(line)
        if used and self.run_id is None and self.run_dir is not None:
            self.run_id = used.group(1)
            (self.run_dir / "run_id").write_text(self.run_id + "\n")
            if self.run_id != self.launch_id:
                _say(self.stream, f"the run's id is {self.run_id} ({used.group(2)}); this launch's logs stay "
                                  f"under {self.launch_id}")
        m = self._START.search(line)
        if m:
            self.commits[m.group(1)] = m.group(2)
            if len(set(self.commits.values())) > 1 and not self.warned:
                self.warned = True
                _say(self.stream, f"WARNING: workers run different commits {self.commits}; "
                                  "sync them (launch.py setup --git-ref REF)")


def setup_pod(target: Target, *, repo_dir: str = DEFAULT_REPO_DIR, git_ref: str | None = None,
              clone_url: str | None = None, dry_run: bool = False, stream: TextIO | None = None,
              on_versions: Callable[[dict], None] | None = None) -> int:
    """setup_tpu.sh on all workers, then a version check: non-zero if workers differ.
    `on_versions` gets each worker's versions row."""
    stream = stream or sys.stdout
    argv = gcloud_argv(target, setup_command(repo_dir, git_ref, clone_url))
    if dry_run:
        stream.write(shlex.join(argv) + "\n")
        return 0
    rows: list[dict] = []

    def take(line: str) -> None:
        if (row := _tagged(line, VERSIONS_TAG)) is not None:
            rows.append(row)
            if on_versions:
                on_versions(row)

    code = run_gcloud(argv, stream=stream, on_line=take)
    if code != 0:
        _say(stream, f"setup failed on at least one worker (gcloud exit code {code})")
        return code
    return check_versions(rows, stream)


def check_versions(rows: Sequence[dict], stream: TextIO) -> int:
    """0 when every worker reports the same commit and versions, else EXIT_FAILURE (1) with the differences."""
    if not rows:
        _say(stream, "no worker reported its versions")
        return EXIT_FAILURE
    keys = [k for k in rows[0] if k != "host"]
    distinct = {tuple(r.get(k) for k in keys) for r in rows}
    if len(distinct) == 1:
        same = ", ".join(f"{k}={rows[0].get(k)}" for k in keys)
        _say(stream, f"{len(rows)} workers set up, all identical: {same}")
        return 0
    differing = [k for k in keys if len({r.get(k) for r in rows}) > 1]
    _say(stream, f"MISMATCH across workers in {', '.join(differing)}:")
    for r in sorted(rows, key=lambda r: r["host"]):
        _say(stream, f"  {r['host']}: " + ", ".join(f"{k}={r.get(k)}" for k in differing))
    return EXIT_FAILURE


def stop_pod(target: Target, *, grace: float = 0.0, dry_run: bool = False,
             stream: TextIO | None = None) -> int:
    """Kill stale training processes / TPU holders of this login and remove the lockfile."""
    stream = stream or sys.stdout
    argv = gcloud_argv(target, stop_command(grace))
    if dry_run:
        stream.write(shlex.join(argv) + "\n")
        return 0
    return run_gcloud(argv, stream=stream)


@dataclass(frozen=True)
class WorkerStatus:
    host: str
    worker: str | None
    processes: list[list[int]]  # [pid, elapsed seconds]
    step: int | None
    step_from: str | None
    metrics: str | None
    log: str | None

    @property
    def alive(self) -> bool:
        return bool(self.processes)


def _hms(seconds: int) -> str:
    h, rest = divmod(int(seconds), 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}"


def status_table(rows: Sequence[WorkerStatus]) -> str:
    def order(r: WorkerStatus) -> tuple:
        return (0, int(r.worker), r.host) if (r.worker or "").isdigit() else (1, 0, r.host)

    table = [("worker", "host", "alive", "pid", "elapsed", "last step", "log file")]
    for r in sorted(rows, key=order):
        pids = ",".join(str(p) for p, _ in r.processes) or "-"
        elapsed = _hms(r.processes[0][1]) if r.processes else "-"
        step = f"{r.step} ({r.step_from})" if r.step is not None else "-"
        table.append((r.worker or "?", r.host, "yes" if r.alive else "no", pids, elapsed, step, r.log or "-"))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(row, widths)), row[-1]]).rstrip() for row in table)


def pod_status(target: Target, *, repo_dir: str = DEFAULT_REPO_DIR, outputs: str = "outputs",
               run_id: str | None = None, dry_run: bool = False, stream: TextIO | None = None,
               err: TextIO | None = None) -> int:
    """Print the per-worker table; other output of gcloud goes to `err` (stderr)."""
    stream, err = stream or sys.stdout, err or sys.stderr
    argv = gcloud_argv(target, status_command(repo_dir, outputs, run_id))
    if dry_run:
        stream.write(shlex.join(argv) + "\n")
        return 0
    rows: list[WorkerStatus] = []

    def on_line(line: str) -> None:
        data = _tagged(line, STATUS_TAG)
        if data is not None:
            rows.append(WorkerStatus(**{k: data.get(k) for k in WorkerStatus.__dataclass_fields__}))
        elif line.strip():
            err.write(line + "\n")

    code = run_gcloud(argv, on_line=on_line)
    if rows:
        stream.write(status_table(rows) + "\n")
        stream.flush()
    if code != 0:
        _say(err, f"gcloud exited with code {code}: some workers did not answer")
    return code
