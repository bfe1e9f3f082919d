"""A resident trainer (opt-in: `programme submit --resident`): one trainer process per worker that
runs a slice's variants back to back, paying the imports, the backend's start and the join of
`jax.distributed` once per slice (docs/RUNNING.md, "Resident trainers").

A cold launch's guard (once.py) `start`s one; its command line names pretrain_jax.py, so
`launch.py stop` and the worker's status treat it as a trainer. It listens on a Unix socket in
~/.podrunner-resident/ (0700: this login's only). Every job, the first included, comes in one
message (`hand_over`): its overrides, environment and session, the next job's overrides, and the
launch's log as a file descriptor (SCM_RIGHTS). The resident runs it (runtime/job.py `run_job`)
with its output on that log and writes its exit code into the launch's `done` file; once its
first step ran, the next job's steps compile in a thread into the compilation cache.

All or none: before a job runs, the pod's residents vote through JAX's key-value store (`go`, or
why not: another session, other code, another environment than the one it started with). One
`no`, or a worker that does not answer in time, and every resident exits with `resident-lost` and
leaves; so does one after a job that did not exit 0, and one idle for `--idle-s`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from experiments.launcher.worker import procs
from runtime import events  # standard library only, like this module's top level
from runtime.atomic import write_atomic
from runtime.errors import EXIT_PREEMPTED, EXIT_RESIDENT_LOST
from runtime.run_ids import PROPOSED_RUN_ID_ENV

MODULE = "experiments.launcher.worker.resident"
STATE_DIR = os.path.join(os.path.expanduser("~"), ".podrunner-resident")
STATE_FILE, SOCKET_NAME = "state.json", "socket"
IDLE_S = 900.0  # a resident with no job for this long leaves (its slice is kept with nothing queued)
VOTE_S_ENV = "PODRUNNER_RESIDENT_VOTE_S"  # tests: the vote's time (default VOTE_S)
VOTE_S = 120.0  # the workers' guards of one launch start within seconds; gcloud's ssh may stagger them
# What JAX, libtpu and the imports read once, when the process started.
START_PREFIXES = ("JAX_", "XLA_", "TPU_", "LIBTPU", "PJRT_", "TF_CPP_")
START_NAMES = ("PYTHONPATH", "PATH", "VIRTUAL_ENV")


def job_environment(env, names=()) -> dict:
    """What a job needs of `env`: the variables read at a process's start (START_PREFIXES,
    START_NAMES) and the launch's own, `names` (its --env variables and secrets)."""
    return {k: v for k, v in env.items() if k in names or k.startswith(START_PREFIXES) or k in START_NAMES}


def _short(name: str) -> tuple[str, int]:
    """(`name` in STATE_DIR as a path short enough for a Unix socket (108 bytes) however long HOME
    is, the descriptor of STATE_DIR it goes through: close it after use)."""
    fd = os.open(STATE_DIR, os.O_RDONLY | os.O_DIRECTORY)
    return f"/proc/self/fd/{fd}/{name}", fd


def in_tree(root: str) -> bool:
    """Whether the code at `root` (the repo, or a shipped tree) has this module: a tree shipped from
    before it runs its trainer in a process of its own."""
    return os.path.exists(os.path.join(root, *MODULE.split(".")) + ".py")


def describe() -> dict | None:
    """This worker's resident trainer, {session, pid, started}, when one is alive; else None."""
    try:
        with open(os.path.join(STATE_DIR, STATE_FILE)) as f:
            state = json.load(f)
        pid = int(state["pid"])
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            alive = MODULE.encode() in f.read()
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return {"session": state.get("session"), "pid": pid, "started": state.get("started")} if alive else None


def end(wait_s: float = 30.0) -> int | None:
    """End this worker's resident trainer, if there is one (SIGKILL: once jax.distributed is up,
    SIGTERM only tells JAX's preemption service); its pid, else None."""
    found = describe()
    if found is None:
        return None
    with contextlib.suppress(ProcessLookupError):
        os.kill(found["pid"], signal.SIGKILL)
    procs.wait_gone([found["pid"]], wait_s)
    with contextlib.suppress(OSError):
        os.remove(os.path.join(STATE_DIR, STATE_FILE))
    return found["pid"]


# ----------------------------------------------------------------------------- the guard's side


class Gone(Exception):
    """No resident trainer answers here."""


def start(python: str, session: str, host: str, *, env: dict, cwd: str | None, log) -> subprocess.Popen:
    """A resident trainer of `session`, in a session of its own (the ssh's end leaves it), its
    output on `log` until its first job's; returned once it listens, or has exited."""
    resident = subprocess.Popen([python, "-m", MODULE, "--session", session, "--host", host, "pretrain_jax.py"],
                                cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    while resident.poll() is None and (describe() or {}).get("pid") != resident.pid:
        time.sleep(0.05)
    return resident


def hand_over(log_fd: int, **job) -> int:
    """Give this worker's resident the `job` (session, key, overrides, env, cwd, next, and `done`:
    the file its exit code goes to), with the log `log_fd`; the resident's pid."""
    found = describe()
    if found is None:
        raise Gone("no resident trainer runs here")
    try:
        path, fd = _short(SOCKET_NAME)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            try:
                sock.connect(path)
            finally:
                os.close(fd)
            socket.send_fds(sock, [(json.dumps(job) + "\n").encode()], [log_fd])
    except OSError as e:
        raise Gone(f"it does not answer ({e.strerror or e})") from None
    return found["pid"]


# ----------------------------------------------------------------------------- the resident's side


class Resident:
    def __init__(self, session: str, host: str, idle_s: float):
        self.session, self.host, self.idle_s = session, host, idle_s
        self.env = dict(os.environ)  # as the process started: every job's must agree (`verdict`)
        self.cwd = os.getcwd()
        self.fresh = True  # no job ran yet: the first one's time account starts with the process
        self.done = None  # the job under way's `done` file
        self.next_config = None  # the next job's config, its steps being compiled ahead (`start_ahead`)
        self.ahead: threading.Thread | None = None

    def listen(self) -> socket.socket:
        os.makedirs(STATE_DIR, mode=0o700, exist_ok=True)
        path, fd = _short(SOCKET_NAME)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.bind(path)
        finally:
            os.close(fd)
        server.listen(4)
        write_atomic(os.path.join(STATE_DIR, STATE_FILE), json.dumps(
            {"session": self.session, "pid": os.getpid(), "started": round(time.time(), 3), "host": self.host}))
        return server

    def finished(self, code: int) -> None:
        """The job under way ended with `code`: its `done` file says so to the guard."""
        if self.done is not None:
            with contextlib.suppress(OSError):
                write_atomic(self.done, str(code))

    def vote(self, request: dict) -> str:
        """'go', or why not, agreed by every process of the pod (one: its own verdict)."""
        mine = self.verdict(request)
        import jax

        from runtime.jax_internals import distributed_client

        client = distributed_client()
        if client is None or jax.process_count() == 1:
            return mine
        me, wait_ms = jax.process_index(), int(1000 * float(os.environ.get(VOTE_S_ENV, VOTE_S)))
        client.key_value_set(f"podrunner-resident/{request['key']}/{me}", mine)
        for other in range(jax.process_count()):
            if other == me:
                continue
            try:
                said = client.blocking_key_value_get(f"podrunner-resident/{request['key']}/{other}", wait_ms)
            except Exception:  # noqa: BLE001 - a timeout (the worker has no resident) is the finding
                said = f"process {other} did not join within {wait_ms / 1000:g} s (no resident trainer there?)"
            if said != "go":
                return said if mine == "go" else mine
        return mine

    def verdict(self, request: dict) -> str:
        if request.get("session") != self.session:
            return f"the resident here is of session {self.session}, not {request.get('session')}"
        if request.get("cwd") != self.cwd:
            return f"the job runs in {request.get('cwd')}, the resident in {self.cwd} (other code)"
        env = request["env"]
        changed = sorted(k for k in set(job_environment(self.env)) | set(env)
                         if k != PROPOSED_RUN_ID_ENV and self.env.get(k) != env.get(k))  # the run id: run_job's
        if changed:
            return f"the job's environment differs from the resident's ({', '.join(changed)[:200]})"
        return "go"

    def serve(self, server: socket.socket) -> None:
        """Jobs, one at a time, until one fails or none comes for idle_s."""
        server.settimeout(self.idle_s)
        while True:
            try:
                conn, _ = server.accept()
            except socket.timeout:
                leave(0, f"no job for {self.idle_s:g} s")
            conn.settimeout(30)
            try:
                with conn:
                    request, fd = read_request(conn)
            except (OSError, ValueError) as e:
                print(f"podrunner: resident: an unreadable request ({e}); ignored", flush=True)
                continue
            self.done = request.get("done")
            redirect(fd)
            verdict = self.vote(request)
            if verdict != "go":
                line = f"podrunner: {self.host}: the resident trainer cannot run this launch: {verdict}; it leaves, " \
                       "and the next launch starts cold"
                print(line, flush=True)
                events.failed(EXIT_RESIDENT_LOST, line, events.Failure.RESIDENT_LOST)
                self.finished(EXIT_RESIDENT_LOST)
                leave(EXIT_RESIDENT_LOST, verdict)
            self.run_one(request)

    def run_one(self, request: dict) -> None:
        """A job to its end (leaving after one that did not exit 0), the next one's steps compiled
        meanwhile, stdout and stderr back on the resident's own log."""
        from runtime.goodput import process_start
        from runtime.hydra_compose import composed
        from runtime.job import run_job

        env, overrides = request["env"], request["overrides"]
        self.next_config = self.ahead = None
        if request.get("next"):  # composed now, between jobs: Hydra's state is the process's
            try:
                self.next_config = composed(request["next"], env=env)
            except Exception as e:  # noqa: BLE001 - the job itself will say what is wrong with it
                print(f"podrunner: resident: the next job's config does not compose ({str(e)[:200]}); its steps are "
                      "not compiled ahead", flush=True)
        started, self.fresh = process_start() if self.fresh else None, False
        sys.stdout.flush()
        code = run_job(lambda: composed(overrides, env=env), started=started, environ=env,
                       on_first_step=self.start_ahead)
        self.finished(code)
        if code:
            leave(code, f"the job ended with {code}")
        self.after_job()
        redirect(None)

    def start_ahead(self) -> None:
        if self.next_config is not None:
            self.ahead = threading.Thread(target=compile_ahead, args=(self.next_config,), name="compile-next",
                                          daemon=True)
            self.ahead.start()

    def after_job(self) -> None:
        """Wait for the next job's steps compiled ahead, its compilation cache in use meanwhile (the
        job that just ended configured its own: JAX writes an entry when a compile ends); then let
        go of what the job left in memory."""
        import jax

        from runtime import compile_cache
        from runtime.config import run_dirs

        if self.ahead is not None:
            run = self.next_config.run
            with compile_cache.configured(run.compile_cache, run_dirs(self.next_config)[1], run.root):
                self.ahead.join()
        # Nothing of the job may hold the chips' memory into the next one: its steps' in-memory
        # caches (and what they captured) and any cycle still holding its arrays.
        jax.clear_caches()
        gc.collect()


def compile_ahead(config) -> None:
    """`config`'s train and eval steps compiled on this process's devices as its run will compile
    them (runtime/builder.py `planned_steps`: the same programs), through the compilation cache
    in use; a failure is one line (the job compiles them itself)."""
    import jax

    from runtime.builder import eval_step_args, planned_steps

    started = time.monotonic()
    try:
        _, plan, mesh, steps, batch, data = planned_steps(config, devices=jax.devices(),
                                                          num_processes=jax.process_count())
        steps.train.lower(steps.abstract_state, batch).compile()
        step, args = eval_step_args(plan, mesh, steps, data.seq_len)
        step.lower(*args).compile()
    except Exception as e:  # noqa: BLE001 - ahead of time is a bonus: the job compiles what is missing
        print(f"podrunner: resident: the next job's steps were not compiled ahead ({str(e)[:200]})", flush=True)
        return
    print(f"podrunner: resident: the next job's steps compiled ahead in {time.monotonic() - started:.1f} s "
          f"({config.run.group}/{config.run.name})", flush=True)


def read_request(conn: socket.socket) -> tuple[dict, int]:
    message, fds, _, _ = socket.recv_fds(conn, 1 << 16, 1)
    while not message.endswith(b"\n"):
        more = conn.recv(1 << 16)
        if not more:
            raise ValueError("cut short")
        message += more
    if not fds:
        raise ValueError("no log file descriptor")
    return json.loads(message), fds[0]


def redirect(fd: int | None) -> None:
    """stdout and stderr onto the job's log `fd`; None: onto the resident's own log between jobs."""
    sys.stdout.flush()
    sys.stderr.flush()
    if fd is None:
        fd = os.open(os.path.join(STATE_DIR, "resident.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def leave(code: int, why: str) -> None:
    """Leave the pod (runtime/liveness.py) and exit at once: a normal exit would wait in JAX's
    shutdown barrier for peers that may be gone."""
    from runtime import liveness

    print(f"podrunner: resident: leaving ({why})", flush=True)
    if (describe() or {}).get("pid") == os.getpid():  # not a newer resident's (a re-created VM's, in tests)
        with contextlib.suppress(OSError):
            os.remove(os.path.join(STATE_DIR, STATE_FILE))
    liveness.leave(0 if code == EXIT_PREEMPTED else code)  # as pretrain_jax.py's: a preempted peer is no failure
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    parser.add_argument("--session", required=True, help="the cold launch's key: warm launches name it")
    parser.add_argument("--host", default="")
    parser.add_argument("--idle-s", type=float, default=IDLE_S)
    parser.add_argument("trainer", choices=["pretrain_jax.py"], help="the trainer whose jobs it runs")
    args = parser.parse_args(argv)
    for sig in (signal.SIGHUP, signal.SIGINT):  # the ssh session that started it ends; it stays
        signal.signal(sig, signal.SIG_IGN)
    resident = Resident(args.session, args.host, args.idle_s)
    resident.serve(resident.listen())


if __name__ == "__main__":
    main(sys.argv[1:])
