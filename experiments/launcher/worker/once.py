"""`python -m experiments.launcher.worker.once --key KEY --log LOG --host HOST --start TEXT [--secrets FILE]
[--env NAME=VALUE ...] [--ship TREE --pack FILE] -- python pretrain_jax.py ...`: a launch on one worker
(the command experiments/launcher/pod.py `pod_command` builds), run from the repo with its .venv
active. It starts the trainer once per launch, however often its command runs.

gcloud re-runs an ssh `--command` that ended with 255 (a dropped connection), up to 10 times, on
that worker. The trainer started the first time is still running there (or has finished); a
second one would fight it, and the secrets file is gone already. So the first run claims the
launch (a directory `launch-KEY` beside LOG, created once; LOG's directory is made first) and a
re-run finds the claim: it says so, replays the launch's events, follows its log and exits with
its exit code.

The first run:
  - reads and removes the secrets file (KEY='value' lines, shell-quoted): the values go into the
    trainer's environment only (with the --env variables), never a command line or another
    process's environment;
  - with --ship: makes the shipped tree TREE (~/podrunner-shipped/<tree hash>) from the pack FILE
    that gcloud copied (shipped.py), warns when it pins other packages than the repo's .venv has,
    and runs the trainer there (PYTHONPATH=TREE: a subprocess's python imports the shipped code
    too);
  - writes the start line (`podrunner-start host=HOST commit=C TEXT log=LOG`; with --ship
    `tree=<tree hash>` instead of the commit) into LOG and starts the trainer with its output
    appended to LOG, not to this ssh: a dropped connection must not take the trainer's stdout
    (and its log) with it;
  - copies LOG to stdout as it grows until the trainer ends, records its exit code in the claim
    and exits with it. It outlives SIGTERM, SIGHUP and a stdout that is gone (a VM shutdown
    signals every process; the trainer saves its checkpoint meanwhile): the exit code is
    recorded whenever the trainer ends first. The first SIGTERM is said at once, as an event of
    the guard's own, `sigterm` (time, host): when the worker was told to stop (a preemption's
    shutdown, `launch.py stop`), earlier than the trainer can say it (its `preempted` event
    comes after the agreed step and the save), for a launcher that counts READY time.

With --resident (a programme's launches: resident.py), `cold` starts a resident trainer in a
session of its own with this launch's job, and the launch ends when that job has (its exit code
in `done` beside the claim), not when the process does; `warm:SESSION` hands the job to the
worker's resident of that session instead of starting a process (its log's descriptor, its
environment, secrets included), and follows it the same way. Without it, a resident on the
worker is ended first: it holds the TPU.

Whatever fails before the trainer starts is one line naming the worker (`podrunner: HOST: ...`)
and exit 2; the secrets file never outlives this command.
"""

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time

from experiments.launcher.worker import START_TAG, resident, shipped
from runtime.atomic import write_atomic  # standard library only, like this
from runtime.errors import EXIT_FAILURE, EXIT_RESIDENT_LOST, EXIT_SIGNAL_BASE, EXIT_USER_ERROR
from runtime import events
from runtime.events import TAG as EVENT_TAG

POLL_S = 0.1
EXIT_FILE, PID_FILE, OFFSET_FILE, DONE_FILE = "exit", "pid", "offset", "done"  # done: a resident's job
_told = {"sigterm": None}  # when the first SIGTERM came (the handler only notes it; `follow` says it)


def _note_sigterm(_sig, _frame):
    if _told["sigterm"] is None:
        _told["sigterm"] = time.time()


def say(text):
    """Onto this ssh's stdout, which a dropped connection may have closed."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
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


def discard(path):
    """Remove the secrets file of a launch that will not start its trainer."""
    if path:
        with contextlib.suppress(OSError):
            os.remove(path)


def commit():
    """The repo's commit (12 digits) as the start line names it; `unknown` without git or a commit."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], stdin=subprocess.DEVNULL,
                             capture_output=True, text=True)
    except OSError:
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def follow(log, offset, done, replay_events_from=None, host=""):
    """Copy LOG from `offset` to stdout until `done()` and nothing more is written. A re-run first
    replays the launch's events from `replay_events_from` (what the launcher may have missed)."""
    if replay_events_from is not None:
        with open(log, "rb") as f:
            f.seek(replay_events_from)
            chunk = f.read(max(0, offset - replay_events_from)).decode(errors="replace")
        say("".join(line + "\n" for line in chunk.splitlines() if EVENT_TAG in line or START_TAG in line))
    talking, said = True, False
    while True:
        if _told["sigterm"] is not None and not said:
            said = True
            talking = say(EVENT_TAG + json.dumps({"event": "sigterm", "time": round(_told["sigterm"], 3),
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
    """The trainer's environment: this one unbuffered (its lines reach LOG as printed), the --env
    variables, the secrets, and with --ship the shipped tree on PYTHONPATH."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.update(args.env)
    env.update(secrets)
    if args.ship:
        env["PYTHONPATH"] = args.ship
    return env


def first_run(args, claim):
    for sig in (signal.SIGHUP, signal.SIGINT):  # see the module docstring
        signal.signal(sig, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _note_sigterm)
    secrets = {}
    if args.secrets:
        try:
            secrets = read_secrets(args.secrets)
        except OSError:
            return record(claim, EXIT_USER_ERROR, f"podrunner: {args.host}: the secrets file did not arrive (gcloud scp)\n")
    if args.ship:
        try:
            shipped.prepare(args.pack, args.ship, os.path.abspath(".venv"))
        except shipped.ShipFailed as e:
            return record(claim, EXIT_USER_ERROR, f"podrunner: {args.host}: {e}\n")
        shipped.warn_if_pins_differ(args.ship, os.getcwd(), args.host)
    version = f"tree={os.path.basename(args.ship)}" if args.ship else f"commit={commit()}"
    warm = args.resident.partition(":")[2] if args.resident and args.resident.startswith("warm:") else None
    if warm is None:
        resident.end()  # a resident trainer holds the TPU: a launch that does not use it ends it first
    done_file = os.path.join(claim, DONE_FILE)
    with open(args.log, "ab") as log:
        offset = log.tell()
        write_atomic(os.path.join(claim, OFFSET_FILE), str(offset))
        log.write(f"{START_TAG}host={args.host} {version} {args.start} log={args.log}\n".encode())
        log.flush()
        if warm is not None:
            return warm_run(args, claim, warm, secrets, log.fileno(), offset, done_file)
        argv = args.argv
        if args.resident == "cold" and not resident.in_tree(args.ship or os.getcwd()):
            say(f"podrunner: {args.host}: the code run here has no resident trainer (older than it); a process of its "
                "own\n")
        elif args.resident == "cold":
            argv = [args.argv[0], "-m", resident.MODULE, "--session", args.key, "--done", done_file, "--host",
                    args.host, *(["--next", args.next] if args.next else []), "--", *args.argv]
        try:
            trainer = subprocess.Popen(argv, cwd=args.ship or None, env=trainer_env(args, secrets),
                                       stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                       preexec_fn=_default_signals, start_new_session=argv is not args.argv)
        except OSError as e:
            return record(claim, EXIT_USER_ERROR, f"podrunner: {args.host}: cannot start {args.argv[0]} ({e.strerror})\n")
    write_atomic(os.path.join(claim, PID_FILE), str(trainer.pid))
    follow(args.log, offset, lambda: os.path.exists(done_file) or trainer.poll() is not None, host=args.host)
    code = _read_code(done_file)
    if code is None:  # a trainer (or a resident whose first job ended it) that is gone
        trainer.wait()
        code = trainer.returncode if trainer.returncode >= 0 else EXIT_SIGNAL_BASE - trainer.returncode
    return record(claim, code)


def warm_run(args, claim, session, secrets, log_fd, offset, done_file):
    """Hand the job to this worker's resident trainer (resident.py) and follow it as a trainer."""
    cwd = os.path.abspath(args.ship or os.getcwd())
    try:
        pid, wait = resident.hand_over(session, args.key, args.argv, trainer_env(args, secrets), cwd, log_fd, done_file,
                                       json.loads(args.next) if args.next else None)
    except resident.Gone as e:
        line = (f"podrunner: {args.host}: no resident trainer of session {session} here ({e}); the next launch "
                "starts cold")
        events.failed(EXIT_RESIDENT_LOST, line, events.Failure.RESIDENT_LOST)
        return record(claim, EXIT_RESIDENT_LOST, line + "\n")
    write_atomic(os.path.join(claim, PID_FILE), str(pid))
    result = []
    waiter = threading.Thread(target=lambda: result.append(wait()), daemon=True)
    waiter.start()
    follow(args.log, offset, lambda: not waiter.is_alive(), host=args.host)
    return record(claim, result[0] if result else EXIT_RESIDENT_LOST)


def _read_code(path):
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _default_signals():
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)


def record(claim, code, line=""):
    if line:
        say(line)
    write_atomic(os.path.join(claim, EXIT_FILE), str(code))
    return code


def rerun(args, claim):
    """This launch ran here already: follow it to its end and exit with its code."""
    exit_file, pid_file = os.path.join(claim, EXIT_FILE), os.path.join(claim, PID_FILE)
    say(f"podrunner: {args.host}: this launch started here already (gcloud re-ran its command after an ssh "
        "drop); following it instead of starting a second trainer\n")

    def ended():
        if os.path.exists(exit_file) or os.path.exists(os.path.join(claim, DONE_FILE)):
            return True
        try:
            pid = int(open(pid_file).read())
        except (OSError, ValueError):
            return False  # the first run is still starting
        if _alive(pid):
            return False
        deadline = time.monotonic() + 5  # the trainer is gone: its guard records the code at once
        while not os.path.exists(exit_file) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return True

    while not os.path.exists(os.path.join(claim, OFFSET_FILE)) and not os.path.exists(exit_file):
        time.sleep(POLL_S)
    start = int(open(os.path.join(claim, OFFSET_FILE)).read()) if os.path.exists(os.path.join(claim, OFFSET_FILE)) else 0
    if os.path.exists(args.log):
        follow(args.log, os.path.getsize(args.log), ended, replay_events_from=start)
    if not os.path.exists(exit_file) and _read_code(os.path.join(claim, DONE_FILE)) is not None:
        return _read_code(os.path.join(claim, DONE_FILE))  # a resident's job whose guard is gone
    if not os.path.exists(exit_file):
        say(f"podrunner: {args.host}: the first run of this launch ended without recording its exit code\n")
        return EXIT_FAILURE
    return int(open(exit_file).read())


def _alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


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
    parser.add_argument("--resident", default=None, metavar="cold|warm:SESSION",
                        help="cold: start a resident trainer (resident.py) with this job; warm:SESSION: hand the job "
                             "to the one of SESSION; without: a trainer of its own (a resident is ended first)")
    parser.add_argument("--next", default=None, metavar="JSON",
                        help="with --resident: the overrides of the job the controller hands over next (a JSON list), "
                             "whose steps the resident compiles while this job trains")
    parser.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    args.argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if args.ship and not args.pack:
        parser.error("--ship needs --pack")
    if args.resident is not None and args.resident != "cold" and not args.resident.startswith("warm:"):
        parser.error(f"--resident {args.resident}: give cold or warm:SESSION")
    return args


def main(argv):
    args = parse(argv)
    claim = os.path.join(os.path.dirname(os.path.abspath(args.log)), f"launch-{args.key}")
    try:
        os.makedirs(os.path.dirname(claim), exist_ok=True)
    except OSError as e:
        discard(args.secrets)
        say(f"podrunner: {args.host}: cannot create the log directory ({e.strerror})\n")
        return EXIT_USER_ERROR
    try:
        os.mkdir(claim)
    except FileExistsError:
        return rerun(args, claim)
    return first_run(args, claim)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
