"""`python -m experiments.launcher.worker.once --key KEY --log LOG --host HOST --start TEXT [--secrets FILE]
[--env NAME=VALUE ...] [--ship TREE --pack FILE] -- python pretrain_jax.py ...`: a launch on one worker
(built by experiments/launcher/pod.py `pod_command`), run from the repo with its .venv active.

It starts the trainer once per launch, however often its command runs: gcloud re-runs an ssh
`--command` that ended with 255 (a dropped connection) up to 10 times, and a second trainer would
fight the first. The first run claims the launch (a directory `launch-KEY` beside LOG); a re-run
finds the claim, replays the launch's events, follows its log and exits with its exit code.

The first run reads and removes the secrets file (the values go into the trainer's environment
alone), unpacks --ship's tree (shipped.py), writes the start line into LOG and starts the trainer
with its output appended to LOG, not to this ssh: a dropped connection must not take the
trainer's stdout with it. It then copies LOG to stdout until the trainer ends and records its
exit code. It outlives SIGTERM and SIGHUP (a VM shutdown signals every process while the trainer
saves) and says the first SIGTERM at once as a `sigterm` event: earlier than the trainer's
`preempted`, for a launcher that counts READY time.

A worker where a trainer of this login runs another run is busy: the launch is refused
(`tpu-busy`). Whatever fails before the trainer starts is one line naming the worker
(`podrunner: HOST: ...`) and exit 2; the secrets file never outlives this command.
"""

import argparse
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time

from experiments.launcher.worker import procs, shipped, versions
from runtime.atomic import write_atomic  # standard library only, like this
from runtime.errors import EXIT_FAILURE, EXIT_SIGNAL_BASE, EXIT_USER_ERROR
from runtime import events, wire

POLL_S = 0.1
EXIT_FILE, PID_FILE, OFFSET_FILE = "exit", "pid", "offset"
_told: dict[str, float] = {}  # "sigterm": when the first SIGTERM came (the handler only notes it; `follow` says it)


def say(text):
    """Onto this ssh's stdout, which a dropped connection may have closed."""
    try:
        print(text, end="", flush=True)
        return True
    except (OSError, ValueError):
        return False


def read_secrets(path):
    """{NAME: value} of a secrets file (experiments/launcher/pod.py secrets_file_text), which is then removed."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    os.remove(path)
    values = {}
    for line in text.splitlines():
        for word in shlex.split(line):
            name, _, value = word.partition("=")
            values[name] = value
    return values


def follow(log, offset, done, replay_events_from=None, host=""):
    """Copy LOG from `offset` to stdout until `done()` and nothing more is written. A re-run first
    replays the launch's events from `replay_events_from` (what the launcher may have missed)."""
    if replay_events_from is not None:
        with open(log, "rb") as f:
            f.seek(replay_events_from)
            chunk = f.read(max(0, offset - replay_events_from)).decode(errors="replace")
        say("".join(line + "\n" for line in chunk.splitlines() if wire.replayed(line)))
    talking, said = True, False
    while True:
        if "sigterm" in _told and not said:
            said = True
            talking = say(wire.event_line({"event": events.Kind.SIGTERM, "time": round(_told["sigterm"], 3),
                                           "host": host}) + "\n") and talking
        finished = done()
        with open(log, "rb") as f:
            f.seek(offset)
            chunk = f.read()
        offset += len(chunk)
        if chunk and talking:
            talking = say(chunk.decode(errors="replace"))
        if finished and not chunk:
            return
        if not chunk:
            time.sleep(POLL_S)


def trainer_env(args, secrets):
    """The trainer's environment: this one unbuffered (its lines reach LOG as printed; its events
    too, `main`), the --env variables, the secrets, and with --ship the shipped tree on PYTHONPATH."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **dict(args.env), **secrets}
    if args.ship:
        env["PYTHONPATH"] = args.ship
    return env


def first_run(args, claim):
    for sig in (signal.SIGHUP, signal.SIGINT):  # see the module docstring
        signal.signal(sig, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda _sig, _frame: _told.setdefault("sigterm", time.time()))
    secrets = {}
    if args.secrets:
        try:
            secrets = read_secrets(args.secrets)
        except OSError:
            return record(claim, EXIT_USER_ERROR, f"podrunner: {args.host}: the secrets file did not arrive (gcloud scp)\n")
    this_run = procs.run_of(None, args.start.split())
    busy = [t for t in procs.trainers_of_ours() if t[1] != this_run]  # this run's own: the run's lease decides
    if busy:  # one TPU, one job: another's trainer would fail at the backend's start, or on CPU run beside it
        pid, run, cmd = busy[0]
        line = (f"podrunner: {args.host}: the TPU is busy: pid {pid} trains {f'run {run}' if run else 'a run'} here "
                f"({cmd[:160]}); wait for it to end, or end it: `python experiments/launch.py stop --tpu NAME --zone ZONE`")
        events.failed(EXIT_USER_ERROR, line, events.Failure.TPU_BUSY)
        return record(claim, EXIT_USER_ERROR, line + "\n")
    if args.ship:
        try:
            shipped.prepare(args.pack, args.ship, os.path.abspath(".venv"))
        except shipped.ShipFailed as e:
            return record(claim, EXIT_USER_ERROR, f"podrunner: {args.host}: {e}\n")
        shipped.warn_if_pins_differ(args.ship, os.getcwd(), args.host)
    with open(args.log, "ab") as log:
        offset = log.tell()
        write_atomic(os.path.join(claim, OFFSET_FILE), str(offset))
        made = {"tree": os.path.basename(args.ship)} if args.ship else {"commit": (versions.commit() or "unknown")[:12]}
        log.write((wire.Start(args.host, args.log, launch=args.start, **made).line() + "\n").encode())
        log.flush()
        try:
            trainer = subprocess.Popen(args.argv, cwd=args.ship or None, env=trainer_env(args, secrets),
                                       stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                       preexec_fn=_default_signals)
        except OSError as e:
            return record(claim, EXIT_USER_ERROR, f"podrunner: {args.host}: cannot start {args.argv[0]} ({e.strerror})\n")
    write_atomic(os.path.join(claim, PID_FILE), str(trainer.pid))
    follow(args.log, offset, lambda: trainer.poll() is not None, host=args.host)
    code = trainer.returncode  # as a shell says it: a signal N is EXIT_SIGNAL_BASE + N
    return record(claim, code if code >= 0 else EXIT_SIGNAL_BASE - code)


def _read_code(path):
    """The number a claim's file holds (an exit code, a pid, an offset); None if it holds none yet."""
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _default_signals():
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)


def record(claim, code, line=""):
    say(line)
    write_atomic(os.path.join(claim, EXIT_FILE), str(code))
    return code


def rerun(args, claim):
    """This launch ran here already: follow it to its end and exit with its code."""
    exit_file, offset_file = (os.path.join(claim, name) for name in (EXIT_FILE, OFFSET_FILE))
    say(f"podrunner: {args.host}: this launch started here already (gcloud re-ran its command after an ssh "
        "drop); following it instead of starting a second trainer\n")

    def ended():
        if os.path.exists(exit_file):
            return True
        pid = _read_code(os.path.join(claim, PID_FILE))
        if pid is None or procs.alive(pid):
            return False  # the first run is still starting, or its trainer runs
        deadline = time.monotonic() + 5  # the trainer is gone: its guard records the code at once
        while not os.path.exists(exit_file) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return True

    while not os.path.exists(offset_file) and not os.path.exists(exit_file):
        time.sleep(POLL_S)
    if os.path.exists(args.log):
        follow(args.log, os.path.getsize(args.log), ended, replay_events_from=_read_code(offset_file) or 0)
    code = _read_code(exit_file)
    if code is None:
        say(f"podrunner: {args.host}: the first run of this launch ended without recording its exit code\n")
        return EXIT_FAILURE
    return code


def _variable(text):
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE")
    return name, value


def parse(argv):
    parser = argparse.ArgumentParser(prog="python -m experiments.launcher.worker.once")
    parser.add_argument("--key", required=True, help="this launch's token (the same in every re-run)")
    parser.add_argument("--log", required=True, help="the worker's log of this launch")
    parser.add_argument("--host", required=True)
    parser.add_argument("--start", required=True, help="the start line's fields after the host and version")
    parser.add_argument("--secrets", default=None, help="the secrets file to read and remove")
    parser.add_argument("--env", type=_variable, action="append", default=[], metavar="NAME=VALUE",
                        help="a variable of the trainer's environment (repeatable)")
    parser.add_argument("--ship", default=None, metavar="TREE", help="run the shipped tree at TREE (named by its hash)")
    parser.add_argument("--pack", default=None, help="with --ship: the copied pack to unpack when TREE is not there")
    parser.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    args.argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if args.ship and not args.pack:
        parser.error("--ship needs --pack")
    return args


def main(argv):
    args = parse(argv)
    os.environ[wire.EVENTS_ENV] = "1"  # the launcher reads the events, the trainer's and this guard's own
    claim = os.path.join(os.path.dirname(os.path.abspath(args.log)), f"launch-{args.key}")
    try:
        os.makedirs(os.path.dirname(claim), exist_ok=True)
    except OSError as e:
        if args.secrets:  # this launch will not start its trainer: its secrets file goes now
            with contextlib.suppress(OSError):
                os.remove(args.secrets)
        say(f"podrunner: {args.host}: cannot create the log directory ({e.strerror})\n")
        return EXIT_USER_ERROR
    try:
        os.mkdir(claim)
    except FileExistsError:
        return rerun(args, claim)
    return first_run(args, claim)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
