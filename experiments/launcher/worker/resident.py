"""A resident trainer: one trainer process per worker that runs a slice's variants back to back.

Every launch of a fresh trainer pays Python's and JAX's imports, the TPU backend's start and
`jax.distributed`'s join before its first step: about a minute on a TPU VM (docs/OPERATIONS.md,
"Resident trainers"), paid again by every variant of a programme. A resident trainer pays it
once per slice: the launch guard (once.py) of a *cold* launch starts

    python -m experiments.launcher.worker.resident --session KEY --done FILE --host HOST -- python pretrain_jax.py ARGS

instead of the trainer. It runs that first job in this process, as `pretrain_jax.py` would, and
then stays, listening on a Unix socket in ~/.podrunner-resident/. The guard of a *warm* launch
(`--resident warm:KEY`) hands it the next job: its argv, its environment (secrets included) and
the launch's log, whose file descriptor travels over the socket (SCM_RIGHTS); the job's output
goes there as a fresh trainer's would. How each job ended reaches the guard as a message and in
FILE (the launch's claim directory): the guard exits with it as it would with a trainer's.

All or none: in a pod every process of a job must be in it, or the first collective hangs. The
supervisor launches warm only when every worker reported a resident of the same session (the
versions check before each launch, `describe()`). Before a warm job runs, the residents vote
through JAX's distributed key-value store: each says `go`, or `no` with why (another session,
other code or another start-up environment: what JAX read when it started cannot change). One
`no`, or a worker that does not answer within the vote's time, and every resident says one line,
exits with `resident-lost` (runtime/events.py) and leaves: the supervisor relaunches cold.

A resident leaves after any job that did not end with exit 0 (a failure, a preemption), so a
retry always starts in a fresh process; and after `--idle-s` without a job (the slice kept with
nothing to run must not hold its TPU). `launch.py stop` ends it like any trainer (its command
line names pretrain_jax.py); a cold launch, and a launch that is not resident, ends it first.

The socket and the state file live in ~/.podrunner-resident (0700): only this login reaches them.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import socket
import sys
import threading
import time

from runtime import events  # standard library only, like this module's top level
from runtime.atomic import write_atomic
from runtime.errors import EXIT_FAILURE, EXIT_RESIDENT_LOST

MODULE = "experiments.launcher.worker.resident"
STATE_DIR = os.path.join(os.path.expanduser("~"), ".podrunner-resident")
STATE_FILE, SOCKET_NAME = "state.json", "socket"
IDLE_S = 900.0  # a resident with no job for this long leaves (its slice is kept with nothing queued)
VOTE_S_ENV = "PODRUNNER_RESIDENT_VOTE_S"  # tests: the vote's time (default VOTE_S)
VOTE_S = 120.0  # the workers' guards of one launch start within seconds; gcloud's ssh may stagger them
# What JAX, libtpu and the imports read once, when the process started: a job that needs other
# values needs a fresh process.
START_PREFIXES = ("JAX_", "XLA_", "TPU_", "LIBTPU", "PJRT_", "TF_CPP_")
START_NAMES = ("PYTHONPATH", "PATH", "VIRTUAL_ENV")


def start_environment(env) -> dict:
    """The variables of `env` a running process cannot take up again (START_PREFIXES, START_NAMES)."""
    return {k: v for k, v in env.items() if k.startswith(START_PREFIXES) or k in START_NAMES}


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
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{found['pid']}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in "ZX":
                    break
        except OSError:
            break
        time.sleep(0.05)
    with contextlib.suppress(OSError):
        os.remove(os.path.join(STATE_DIR, STATE_FILE))
    return found["pid"]


# ----------------------------------------------------------------------------- the guard's side


class Gone(Exception):
    """No resident trainer answers here."""


def hand_over(session: str, key: str, argv: list, env: dict, cwd: str, log_fd: int, done: str,
              next_job: list | None = None):
    """Give this worker's resident of `session` the job; (the resident's pid, a function that
    waits for the job's exit code: the message, else FILE `done`, else EXIT_FAILURE: the resident
    died under the job without saying how, e.g. killed)."""
    found = describe()
    if found is None:
        raise Gone("no resident trainer runs here")
    request = {"session": session, "key": key, "argv": argv, "env": env, "cwd": cwd, "done": done, "next": next_job}
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        path, fd = _short(SOCKET_NAME)
        try:
            sock.connect(path)
        finally:
            os.close(fd)
        socket.send_fds(sock, [(json.dumps(request) + "\n").encode()], [log_fd])
    except OSError as e:
        sock.close()
        raise Gone(f"it does not answer ({e.strerror or e})") from None

    def wait() -> int:
        buffer = b""
        with sock:
            while b"\n" not in buffer:
                try:
                    chunk = sock.recv(4096)
                except OSError:
                    chunk = b""
                if not chunk:
                    break
                buffer += chunk
        if b"\n" in buffer:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                return int(json.loads(buffer.split(b"\n", 1)[0])["exit"])
        with contextlib.suppress(OSError, ValueError):
            with open(done) as f:
                return int(f.read())
        print(f"podrunner: the resident trainer (pid {found['pid']}) ended during the job without an exit code "
              "(killed?)", flush=True)
        return EXIT_FAILURE

    return found["pid"], wait


# ----------------------------------------------------------------------------- the resident's side


class Resident:
    def __init__(self, session: str, host: str, idle_s: float):
        self.session, self.host, self.idle_s = session, host, idle_s
        self.start_env = start_environment(os.environ)
        self.cwd = os.getcwd()
        self.done, self.conn = None, None  # the job under way: its FILE, the guard's connection
        self.own: dict = {}  # what the trainer's import set in the environment (kept for every job)
        self.next_config = None  # the next job's config, its steps being compiled ahead (`prepare_next`)
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
        """The job under way ended with `code`: FILE, then the guard (pretrain_jax.BEFORE_EXIT too)."""
        if self.done is not None:
            with contextlib.suppress(OSError):
                write_atomic(self.done, str(code))
            self.done = None
        if self.conn is not None:
            with contextlib.suppress(OSError):
                self.conn.sendall((json.dumps({"exit": code}) + "\n").encode())
                self.conn.close()
            self.conn = None

    def job(self, trainer, argv: list) -> int:
        """One job, as `python pretrain_jax.py ARGS` would run it: its exit code when it ended
        with 0 (a failure leaves through pretrain_jax._exit, which calls `finished` first)."""
        sys.argv = list(argv)
        sys.stdout.flush()
        try:
            trainer.main()
        except SystemExit as e:  # composing the config failed: pretrain_jax.main's own exit
            return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        return 0

    def prepare_next(self, overrides: list | None) -> None:
        """The job the controller will hand over next (its overrides: --next, a request's `next`):
        its config composed now, between jobs (Hydra's state is the process's), and its train and
        eval steps compiled in a thread once this job's first step ran, so that its own start finds
        them in the compilation cache instead of compiling while the slice waits."""
        from runtime import loop  # noqa: PLC0415 - the trainer's (JAX); the guard imports this module
        from runtime.hydra_compose import composed

        loop.TRAINING_STARTED.clear()
        self.next_config = self.ahead = None
        if not overrides:
            return
        try:
            self.next_config = composed(list(overrides))
        except Exception as e:  # noqa: BLE001 - the job itself will say what is wrong with it
            print(f"podrunner: resident: the next job's config does not compose ({str(e)[:200]}); its steps are not "
                  "compiled ahead", flush=True)
            return

        def start() -> None:
            self.ahead = threading.Thread(target=compile_ahead, args=(self.next_config,), name="compile-next",
                                          daemon=True)
            self.ahead.start()

        loop.TRAINING_STARTED.append(start)

    def after_job(self) -> None:
        """Wait for the next job's steps compiled ahead, its compilation cache in use meanwhile (the
        job that just ended configured its own: JAX writes an entry when a compile ends); then let
        go of what the job left in memory."""
        from runtime import compile_cache, loop  # noqa: PLC0415 - the trainer's (JAX)
        from runtime.config import run_dirs

        loop.TRAINING_STARTED.clear()
        if self.ahead is not None and self.next_config is not None:
            run = self.next_config.run
            with compile_cache.configured(run.compile_cache, run_dirs(self.next_config)[1], run.root):
                self.ahead.join()
        self.ahead = None
        # Nothing of the job may hold the chips' memory into the next one: its steps' in-memory
        # caches (and what they captured) and any cycle still holding its arrays.
        import jax  # noqa: PLC0415 - the trainer's

        jax.clear_caches()
        gc.collect()

    def vote(self, request: dict) -> str:
        """'go', or why not, agreed by every process of the pod (one: its own verdict)."""
        mine = self.verdict(request)
        import jax  # noqa: PLC0415 - loaded by the first job already; this module's top stays standard library
        from jax._src import distributed

        client = distributed.global_state.client
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
        changed = sorted(k for k in set(self.start_env) | set(start_environment(request["env"]))
                         if self.start_env.get(k) != request["env"].get(k))
        if changed:
            return f"the start-up environment differs ({', '.join(changed)[:200]})"
        return "go"

    def serve(self, server: socket.socket, trainer) -> None:
        """Jobs, one at a time, until one fails or none comes for idle_s."""
        server.settimeout(self.idle_s)
        while True:
            try:
                conn, _ = server.accept()
            except socket.timeout:
                leave(0, f"no job for {self.idle_s:g} s")
            conn.settimeout(30)
            try:
                request, fd = read_request(conn)
            except (OSError, ValueError) as e:
                print(f"podrunner: resident: an unreadable request ({e}); ignored", flush=True)
                conn.close()
                continue
            conn.settimeout(None)
            self.conn, self.done = conn, request.get("done")
            redirect(fd)
            verdict = self.vote(request)
            if verdict != "go":
                line = f"podrunner: {self.host}: the resident trainer cannot run this launch: {verdict}; it leaves, " \
                       "and the next launch starts cold"
                print(line, flush=True)
                events.failed(EXIT_RESIDENT_LOST, line, events.Failure.RESIDENT_LOST)
                self.finished(EXIT_RESIDENT_LOST)
                leave(EXIT_RESIDENT_LOST, verdict)
            # The job's environment, but for what the process read at its start: as its first job
            # left it (the trainer adds its XLA flags before the backend starts; JAX's cache keys hold them).
            started = start_environment(os.environ)
            os.environ.clear()
            os.environ.update({k: v for k, v in request["env"].items() if k not in start_environment(request["env"])})
            os.environ.update(started | self.own)
            self.run_one(trainer, request["argv"][1:], request.get("next"))

    def run_one(self, trainer, argv: list, next_job: list | None) -> None:
        """A job to its end (leaving after one that did not exit 0), the next one's steps compiled
        meanwhile, stdout and stderr back on the resident's own log."""
        self.prepare_next(next_job)
        code = self.job(trainer, argv)
        self.finished(code)
        if code:
            leave(code, f"the job ended with {code}")
        self.after_job()
        redirect(None)


def compile_ahead(config) -> None:
    """`config`'s train and eval steps compiled on this process's devices as its run will compile
    them (runtime/builder.py `planned_steps`: the same programs), through the compilation cache
    in use; a failure is one line (the job compiles them itself)."""
    import jax  # noqa: PLC0415 - the trainer's; the guard imports this module

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
    from runtime import liveness  # noqa: PLC0415 - JAX-free, but not wanted by the guard's import

    print(f"podrunner: resident: leaving ({why})", flush=True)
    if (describe() or {}).get("pid") == os.getpid():  # not a newer resident's (a re-created VM's, in tests)
        with contextlib.suppress(OSError):
            os.remove(os.path.join(STATE_DIR, STATE_FILE))
    liveness.leave(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def parse(argv):
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    parser.add_argument("--session", required=True, help="the cold launch's key: warm launches name it")
    parser.add_argument("--done", required=True, help="where the first job's exit code goes")
    parser.add_argument("--host", default="")
    parser.add_argument("--idle-s", type=float, default=IDLE_S)
    parser.add_argument("--next", default=None, metavar="JSON",
                        help="the overrides of the job the controller will hand over next (a JSON list)")
    parser.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    args.argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if len(args.argv) < 2 or os.path.basename(args.argv[1]) != "pretrain_jax.py":
        parser.error("give the trainer's command after --: python pretrain_jax.py ARGS")
    return args


def main(argv) -> None:
    args = parse(argv)
    for sig in (signal.SIGHUP, signal.SIGINT):  # the ssh session that started it ends; it stays
        signal.signal(sig, signal.SIG_IGN)
    resident = Resident(args.session, args.host, args.idle_s)
    server = resident.listen()
    script = os.path.abspath(args.argv[1])
    sys.path.insert(0, os.path.dirname(script))
    sys.argv = [script, *args.argv[2:]]
    before = dict(os.environ)
    import pretrain_jax  # noqa: PLC0415 - the trainer's imports (JAX, Hydra) are this process's start-up

    resident.own = {k: v for k, v in os.environ.items() if before.get(k) != v}
    resident.done = args.done
    if not hasattr(pretrain_jax, "BEFORE_EXIT"):  # a script that ran its job as it was imported (a stand-in)
        resident.finished(0)
        leave(0, f"{script} is no trainer a resident can run again: its import was the job")
    pretrain_jax.BEFORE_EXIT.append(resident.finished)
    resident.run_one(pretrain_jax, sys.argv, json.loads(args.next) if args.next else None)
    resident.serve(server, pretrain_jax)


if __name__ == "__main__":
    main(sys.argv[1:])
