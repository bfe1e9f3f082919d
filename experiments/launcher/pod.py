"""Run commands on every worker of a Cloud TPU VM slice through ONE `gcloud ... ssh --worker=all`.

Why one ssh: a per-worker loop can leave some workers unstarted, and a JAX job with a missing
process hangs at the coordinator. The operations, secrets, run ids and `--ship`: docs/OPERATIONS.md.
gcloud hands --command to the worker's login shell, so every user value is quoted exactly once
(shlex.quote; `~/...` as "$HOME"/... so it still expands).
"""

from __future__ import annotations

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
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence, TextIO

from experiments.launcher import gcloud
from experiments.launcher.gcloud import PodError, Target
from experiments.launcher.ship import DEFAULT_MAX_MB, Pack, ShipError, pack_tree
from experiments.launcher.worker import SECRETS_PREFIX, shipped
from runtime import events, wire
from runtime.errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_PREEMPTED, EXIT_USER_ERROR
from runtime.run_ids import PROPOSED_RUN_ID_ENV, RUN_ID

__all__ = ["PodError", "Target", "Pack", "ShipError", "pack_tree", "DEFAULT_MAX_MB"]

DEFAULT_REPO_DIR = "~/podrunner"
DEFAULT_LOG_DIR = Path("outputs/launch-logs")
SECRET_ENV = ("WANDB_API_KEY",)  # forwarded from the local environment when set, never printed
SHIPPED_TREE_ENV = "PODRUNNER_SHIPPED_TREE"  # read by runtime/manifest.py: JSON of what --ship sent
REPO_ROOT = Path(__file__).resolve().parents[2]  # what --ship packs by default

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_RUN_ID_OVERRIDE = re.compile(r"^\+{0,2}run\.id=(.*)$")


def run_gcloud(argv: Sequence[str], **kw) -> int:
    return gcloud.run_streaming(argv, **kw)


def remote_path(path: str) -> str:
    """`path` quoted for the worker's shell; a leading `~` becomes "$HOME" so it still expands."""
    if path == "~" or path.startswith("~/"):
        rest = path[2:]
        return '"$HOME"' + ("/" + shlex.quote(rest) if rest else "")
    return shlex.quote(path)


def new_run_id() -> str:
    """Sortable and unique enough: 20250131-142501-k3x9 (a string to Hydra, for its dashes)."""
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
    """Every --forward-env NAME is set here: else the run would fail on the workers, or run without it."""
    unset = [name for name in dict.fromkeys(forward) if not environ.get(name)]
    if unset:
        raise PodError(f"--forward-env {unset[0]}: {unset[0]} is not set in this environment, so there is nothing to "
                       f"forward; export it first, or drop --forward-env {unset[0]}")


def remote_env(extra: Mapping[str, str], forward: Iterable[str],
               environ: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(plain, secret) variables for the workers; secrets: SECRET_ENV and `forward`, from `environ`."""
    for name in [*extra, *forward]:
        if not _ENV_NAME.fullmatch(name):
            raise PodError(f"{name!r} is not an environment variable name")
    check_forwarded(forward, environ)
    secret = {k: environ[k] for k in dict.fromkeys([*SECRET_ENV, *forward]) if environ.get(k)}
    return dict(extra), secret


HOST = '"$(hostname)"'  # the worker's name, as its shell says it (what tags every worker's line)


def _fail(message: str, code: int = EXIT_USER_ERROR) -> str:
    """`|| <this>`: say on which worker and why, then end its command (`message`: no user values)."""
    return f'{{ echo "podrunner: $(hostname): {message}" >&2; exit {code}; }}'


def secrets_file_text(secret_env: Mapping[str, str]) -> str:
    """The secrets file the workers source (with `set -a`): one KEY='value' line each."""
    return "".join(f"{k}={shlex.quote(v)}\n" for k, v in secret_env.items())


def pod_command(repo_dir: str, run_id: str, overrides: Sequence[str], env: Mapping[str, str],
                secrets_file: str | None = None, ship: Pack | None = None, key: str | None = None) -> str:
    """Worker command: cd to the repo, activate its .venv, then the launch guard (worker/once.py),
    which starts the trainer once per launch `key`. An EXIT trap removes the copied files should
    the command end before the guard starts."""
    plain = {PROPOSED_RUN_ID_ENV: run_id}
    if ship:
        plain[SHIPPED_TREE_ENV] = json.dumps(ship.shipped_record(), sort_keys=True)
    plain.update(env)
    log = remote_path(f"~/podrunner-logs/{run_id}/worker-") + HOST + ".log"
    guard = ["exec python -m experiments.launcher.worker.once", "--key", shlex.quote(key or secrets.token_hex(6)),
             "--log", log, "--host", HOST, "--start", shlex.quote(f"launch_id={run_id}"),
             *(f"--env {shlex.quote(f'{k}={v}')}" for k, v in plain.items())]
    copied = []
    if secrets_file:
        copied.append(remote_path("~/" + secrets_file))
        guard += ["--secrets", copied[-1]]
    if ship:
        copied.append(remote_path("~/" + shipped.pack_name(ship.tree_hash)))
        guard += ["--ship", remote_path(shipped.tree_dir(ship.tree_hash)), "--pack", copied[-1]]
    guard += ["--", "python", "pretrain_jax.py", *map(shlex.quote, overrides)]
    return "; ".join([
        *([f"trap {shlex.quote('rm -f ' + ' '.join(copied))} EXIT"] if copied else []),
        f"cd {remote_path(repo_dir)} || " + _fail("no repo at --repo-dir"),  # the guard runs from the repo
        ". .venv/bin/activate || " + _fail("no .venv in the repo (run launch.py setup)"),
        " ".join(guard),
    ])


def in_repo(repo_dir: str, module: str, *args: str, python: str = ".venv/bin/python", missing: str | None = None) -> str:
    """Worker command: a worker tool run from the repo; `missing`: what to say (exit 0) when there is none."""
    no_repo = _fail(missing, 0) if missing else _fail("no repo at --repo-dir")
    return f"cd {remote_path(repo_dir)} 2>/dev/null || {no_repo}; {worker_call(module, *args, python=python)}"


def worker_call(module: str, *args: str, python: str = ".venv/bin/python") -> str:
    """`python -m experiments.launcher.worker.<module> ARGS` (ARGS quoted for the worker's shell already)."""
    return " ".join([python, "-m", f"experiments.launcher.worker.{module}", *args])


def versions_command(repo_dir: str) -> str:
    """Each worker's versions line (experiments/launcher/worker/versions.py)."""
    return in_repo(repo_dir, "versions", HOST)


def setup_command(repo_dir: str, git_ref: str | None = None, clone_url: str | None = None) -> str:
    """Worker command: [git clone URL on fresh disks], [check out REF with the system python3: no
    .venv yet], bash setup_tpu.sh, then the versions line."""
    repo = remote_path(repo_dir)
    steps = []
    if clone_url:
        steps.append(f"[ -d {repo} ] || git clone --quiet {shlex.quote(clone_url)} {repo} || "
                     + _fail("git clone of --clone-url failed"))
    steps.append(f"cd {repo} || " + _fail("no repo at --repo-dir"))
    calls = [worker_call("checkout", HOST, shlex.quote(git_ref), python="python3")] if git_ref else []
    calls += ["bash setup_tpu.sh", worker_call("versions", HOST)]
    return "; ".join([*steps, " && ".join(calls)])


def stop_command(grace: float = 0.0, repo_dir: str = DEFAULT_REPO_DIR, run: str | None = None) -> str:
    """With the system python3 (the .venv may be broken); `run`: only that run's trainers (worker/stop.py)."""
    return in_repo(repo_dir, "stop", HOST, f"{grace:g}", *([shlex.quote(run)] if run else []), python="python3",
                   missing="no repo at --repo-dir: nothing of ours runs here")


def _say(stream: TextIO, message: str) -> None:
    stream.write(f"[launch] {message}\n")
    stream.flush()


# --- the operations -------------------------------------------------------------------------

def launch_pod(target: Target, overrides: Sequence[str], *, repo_dir: str = DEFAULT_REPO_DIR,
               run_id: str | None = None, log_dir: Path = DEFAULT_LOG_DIR,
               env: Mapping[str, str] | None = None, forward_env: Iterable[str] = (),
               dry_run: bool = False, interrupt_grace: float = 30.0, leave_running: bool = False,
               ship: bool | Pack = False, ship_from: Path | str | None = None,
               ship_max_mb: float = DEFAULT_MAX_MB,
               environ: Mapping[str, str] | None = None, stream: TextIO | None = None,
               on_line: Callable[[str], None] | None = None,
               on_gcloud: Callable[[subprocess.Popen], None] | None = None) -> int:
    """Run pretrain_jax.py on all workers; exit code = gcloud's (130 after Ctrl-C). `ship`: True
    packs `ship_from` now, a Pack (packed once by a supervisor) is sent as it is. `on_gcloud`
    gets the ssh's gcloud process (to end it early)."""
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
                        interrupt_grace=interrupt_grace, leave_running=leave_running, repo_dir=repo_dir,
                        on_line=on_line, on_gcloud=on_gcloud)


def _run_pod(target: Target, command: str, secret: Mapping[str, str], secrets_file: str | None,
             pack: Pack | None, run_id: str, run_dir: Path, *, stream: TextIO, interrupt_grace: float,
             leave_running: bool, repo_dir: str, on_line: Callable[[str], None] | None,
             on_gcloud: Callable[[subprocess.Popen], None] | None) -> int:
    """Copy the secrets and the shipped tree, then run `command` on every worker (launch_pod)."""
    log_path, watch = run_dir / "launch.log", _PodWatch(stream, run_id, run_dir, on_line)
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
            code = run_gcloud(gcloud.scp_argv(target, str(pack.path), shipped.pack_name(pack.tree_hash)),
                              stream=stream, log_path=log_path)
            if code != 0:
                _say(stream, f"copying the tree to the workers failed (gcloud exit code {code}); nothing was started")
                if secrets_file:
                    _remove_secrets(target, secrets_file, stream, log_path)
                return code
        code = run_gcloud(gcloud.ssh_argv(target, command), stream=stream, log_path=log_path, on_line=watch.line,
                          started=on_gcloud)
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    if code in (EXIT_INTERRUPTED, -signal.SIGINT):
        # Ctrl-C here, or gcloud alone took it (a launcher started with SIGINT ignored, e.g. by `&` in
        # a script, or `kill -INT` of gcloud): the ssh sessions are gone, the workers may not be.
        return _interrupted(target, stream, interrupt_grace, leave_running, repo_dir)
    if code == EXIT_PREEMPTED:
        _say(stream, "the run was preempted (SIGTERM) and saved its checkpoint; relaunch the same command to resume")
    elif code != 0:
        hint = ("a stale process holds the TPU: run `launch.py stop` first" if watch.tpu_busy else
                "other workers may still be running: check with `launch.py status`, end them with "
                "`launch.py stop`")
        _say(stream, f"gcloud exited with code {code}; {hint}")
        if secrets_file:  # a worker whose command never started still holds the file
            _remove_secrets(target, secrets_file, stream, log_path)
    return code


def _interrupted(target: Target, stream: TextIO, grace: float, leave_running: bool, repo_dir: str) -> int:
    """After Ctrl-C: stop the run on every worker (they checkpoint on SIGTERM), unless told not to."""
    if leave_running:
        _say(stream, "interrupted; the workers may still be running (launch.py status / stop)")
        return EXIT_INTERRUPTED
    _say(stream, f"interrupted: stopping the run on all workers (SIGTERM, SIGKILL after {grace:g} s)")
    try:
        stop_pod(target, grace=grace, stream=stream, repo_dir=repo_dir)  # also removes a leftover secrets file
    except KeyboardInterrupt:
        _say(stream, "stop interrupted; run `launch.py stop` to make sure the TPU is free")
    return EXIT_INTERRUPTED


def _pack_line(pack: Pack) -> str:
    diff = pack.summary["diff_summary"]
    base = (pack.summary["base_commit"] or "no commit")[:12]
    return (f"{pack.files} files, {pack.size / 1024:.0f} KiB packed, tree {pack.tree_hash} (base {base}, "
            f"{len(diff['changed'])} changed, {len(diff['untracked'])} untracked); on each worker in "
            f"{shipped.tree_dir(pack.tree_hash)}, run with the repo's .venv")


def shown_commands(target: Target, command: str, secret: Mapping[str, str], secrets_file: str | None,
                   pack: Pack | None = None) -> str:
    """What `pod` runs, as printed by --dry-run and kept in command.txt: names, never values."""
    lines = []
    if secrets_file:
        lines += [f"# secrets {', '.join(secret)}: a 0600 file of KEY='value' lines, copied, never on a command line",
                  shlex.join(gcloud.scp_argv(target, "SECRETS-FILE", secrets_file))]
    if pack:
        lines += [f"# ship: {_pack_line(pack)}",
                  shlex.join(gcloud.scp_argv(target, "PACK.tar.gz", shipped.pack_name(pack.tree_hash)))]
    return "".join(line + "\n" for line in [*lines, shlex.join(gcloud.ssh_argv(target, command))])


def send_secrets(target: Target, secret_env: Mapping[str, str], secrets_file: str, *,
                 stream: TextIO, log_path: Path | None = None) -> int:
    """Copy the secrets to ~/<secrets_file> on every worker (one scp --worker=all; its exit code).
    Not through ssh's stdin: gcloud's one ssh per worker all read it, so only one would get the
    bytes. The local copy is a 0600 file, deleted when gcloud returns; scp keeps the mode."""
    with tempfile.TemporaryDirectory(prefix="podrunner-") as tmp:
        local = os.path.join(tmp, secrets_file)
        with os.fdopen(os.open(local, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w", encoding="utf-8") as f:
            f.write(secrets_file_text(secret_env))
        return run_gcloud(gcloud.scp_argv(target, local, secrets_file), stream=stream, log_path=log_path)


def _remove_secrets(target: Target, secrets_file: str, stream: TextIO, log_path: Path | None) -> None:
    _say(stream, "removing the secrets file from the workers")
    code = run_gcloud(gcloud.ssh_argv(target, f"rm -f {remote_path('~/' + secrets_file)}"), stream=stream, log_path=log_path)
    if code != 0:
        _say(stream, f"could not reach every worker (gcloud exit code {code}); `launch.py stop` removes the "
                     f"file ~/{secrets_file} too")


class _PodWatch:
    """The pod's output as it streams: warns once when workers run different commits, notes a busy
    TPU, and records the trainer's run id (its `started` event) in <run_dir>/run_id."""

    def __init__(self, stream: TextIO, launch_id: str, run_dir: Path,
                 also: Callable[[str], None] | None) -> None:
        self.stream, self.commits, self.warned, self.tpu_busy = stream, {}, False, False
        self.launch_id, self.run_dir, self.run_id, self.also = launch_id, run_dir, None, also

    def line(self, line: str) -> None:
        if self.also:
            self.also(line)
        event = wire.event(line)
        if event and event["event"] == events.Kind.FAILED and event.get("failure") == events.Failure.TPU_BUSY:
            self.tpu_busy = True
        if event and event["event"] == "started" and self.run_id is None:
            self.run_id = str(event.get("run_id"))
            (self.run_dir / "run_id").write_text(self.run_id + "\n")
            if self.run_id != self.launch_id:
                why = "resumed from the checkpoint" if event.get("resumed") else "a fresh run"
                _say(self.stream, f"the run's id is {self.run_id} ({why}); this launch's logs stay under {self.launch_id}")
        started = wire.start(line)
        if started:
            self.commits[started.host] = started.version
            if len(set(self.commits.values())) > 1 and not self.warned:
                self.warned = True
                _say(self.stream, f"WARNING: workers run different commits {self.commits}; "
                                  "sync them (launch.py setup --git-ref REF)")


def setup_pod(target: Target, *, repo_dir: str = DEFAULT_REPO_DIR, git_ref: str | None = None,
              clone_url: str | None = None, dry_run: bool = False, stream: TextIO | None = None,
              on_versions: Callable[[dict], None] | None = None) -> int:
    """setup_tpu.sh on all workers, then a version check: non-zero if workers differ."""
    stream = stream or sys.stdout
    argv = gcloud.ssh_argv(target, setup_command(repo_dir, git_ref, clone_url))
    if dry_run:
        stream.write(shlex.join(argv) + "\n")
        return 0
    rows: list[dict] = []

    def take(line: str) -> None:
        if (row := wire.versions(line)) is not None:
            rows.append(row)
            if on_versions:
                on_versions(row)

    code = run_gcloud(argv, stream=stream, on_line=take)
    if code != 0:
        _say(stream, f"setup failed on at least one worker (gcloud exit code {code})")
        return code
    return check_versions(rows, stream)


VERDICT = ("host", "ok", "problem")  # a versions row's fields that are not versions


def compared(row: dict) -> dict:
    """The fields of a versions row the workers must agree on."""
    return {k: v for k, v in row.items() if k not in VERDICT}


def versions_agree(rows: Sequence[dict], hosts: int) -> bool:
    """Every one of `hosts` workers answered, each .venv fits the project, and all agree."""
    return (len(rows) == hosts and all(r.get("ok") for r in rows)
            and len({json.dumps(compared(r), sort_keys=True) for r in rows}) == 1)


def check_versions(rows: Sequence[dict], stream: TextIO) -> int:
    """0 when every worker's .venv fits and all report the same versions, else 1 with the differences."""
    if not rows:
        _say(stream, "no worker reported its versions")
        return EXIT_FAILURE
    bad = [r for r in rows if not r.get("ok")]
    for r in sorted(bad, key=lambda r: r["host"]):
        _say(stream, f"{r['host']}: the .venv does not fit the project: {r.get('problem')}")
    if bad:
        return EXIT_FAILURE
    keys = list(compared(rows[0]))
    differing = [k for k in keys if len({r.get(k) for r in rows}) > 1]
    if not differing:
        same = ", ".join(f"{k}={rows[0].get(k)}" for k in keys)
        _say(stream, f"{len(rows)} workers set up, all identical: {same}")
        return 0
    _say(stream, f"MISMATCH across workers in {', '.join(differing)}:")
    for r in sorted(rows, key=lambda r: r["host"]):
        _say(stream, f"  {r['host']}: " + ", ".join(f"{k}={r.get(k)}" for k in differing))
    return EXIT_FAILURE


def stop_pod(target: Target, *, grace: float = 0.0, dry_run: bool = False,
             stream: TextIO | None = None, repo_dir: str = DEFAULT_REPO_DIR, run: str | None = None) -> int:
    """Kill this login's stale trainers and TPU holders, remove the lockfile; `run`: spare other runs."""
    stream = stream or sys.stdout
    argv = gcloud.ssh_argv(target, stop_command(grace, repo_dir, run))
    if dry_run:
        stream.write(shlex.join(argv) + "\n")
        return 0
    return run_gcloud(argv, stream=stream)


def _hms(seconds: int) -> str:
    h, rest = divmod(int(seconds), 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}"


def status_table(rows: Sequence[wire.Status]) -> str:
    def order(r: wire.Status) -> tuple:
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
    argv = gcloud.ssh_argv(target, in_repo(repo_dir, "status", HOST, shlex.quote(outputs), shlex.quote(run_id or ""),
                                       python="python3", missing="no repo at --repo-dir"))
    if dry_run:
        stream.write(shlex.join(argv) + "\n")
        return 0
    rows: list[wire.Status] = []

    def on_line(line: str) -> None:
        if (row := wire.status(line)) is not None:
            rows.append(row)
        elif line.strip():
            err.write(line + "\n")

    code = run_gcloud(argv, on_line=on_line)
    if rows:
        stream.write(status_table(rows) + "\n")
        stream.flush()
    if code != 0:
        _say(err, f"gcloud exited with code {code}: some workers did not answer")
    return code
