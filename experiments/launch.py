"""Experiment launcher CLI: `python experiments/launch.py COMMAND --help`; the commands at work
in docs/OPERATIONS.md.

Everything after the first `--` is passed to the training script untouched (Hydra `key=value`
overrides). One function per subcommand (`cmd_<name>`), registered in `build_parser`; the logic
itself lives in importable modules. A subcommand that needs JAX or Hydra (seconds to import)
imports its modules when it runs, so `stop`, `status` and `programme status` answer at once.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make `experiments.*` importable
    sys.path.insert(0, str(REPO_ROOT))

from experiments.launcher import pod  # noqa: E402
from experiments.launcher.local_pod import run_local_pod  # noqa: E402
from runtime.errors import (EXIT_INTERRUPTED, EXIT_STORAGE, EXIT_TIMEOUT, EXIT_USER_ERROR,  # noqa: E402
                            UserError, interrupted)
from runtime.lease import LeaseHeld  # noqa: E402
from runtime.ranges import Rule, above, at_least, check_args, check_given, name_error, name_problem, within  # noqa: E402
from runtime.run_log import console_logging  # noqa: E402

# Ranges of every subcommand's numeric options (as runtime/config.py's _RULES for the Hydra
# settings), checked before anything starts: `plan --jobs -1` would plan in-process and hang,
# a negative grace would kill workers before they checkpoint. (A budget's range is queue_state.BUDGET:
# a budget request's value is checked against it too.)
_RULES: dict[str, dict[str, Rule]] = {
    "local": {"--processes": (at_least(1), ""), "--devices-per-process": (at_least(1), ""),
              "--port": (within(1, 65534), "the start-up barrier listens on the port above it"),
              "--timeout": (above(0), "seconds"), "--grace-period": (at_least(0), "0 = SIGKILL at once")},
    "pod": {"--interrupt-grace": (at_least(0), "0 = SIGKILL at once"), "--ship-max-mb": (above(0), "")},
    "stop": {"--grace": (at_least(0), "0 = SIGKILL at once")},
    "supervise": {"--max-restarts": (at_least(0), "0 = stop at the first failure"),
                  "--poll-seconds": (above(0), ""), "--storage-backoff-seconds": (at_least(0), ""),
                  "--stop-grace": (at_least(0), "0 = SIGKILL at once"), "--ship-max-mb": (above(0), "")},
    "plan": {"--jobs": (at_least(1), "compile processes"), "--slices": (at_least(1), "slices running the queue")},
    "doctor": {"--port": (within(1, 65534), "the liveness port is the one above it"), "--port-wait": (above(0), ""),
               "--checkpoint-mb": (above(0), ""), "--measure-budget": (above(10), ""), "--disk-need-gb": (at_least(0), ""), "--measure-steps": (at_least(1), "")},
    "programme": {"--max-restarts": (at_least(0), "0 = stop at the first failure"), "--poll-seconds": (above(0), ""),
                  "--backoff-seconds": (at_least(0), ""), "--stop-grace": (at_least(0), "0 = SIGKILL at once"),
                  "--create-attempts": (at_least(1), ""), "--infra-streak": (at_least(1), "")},
}


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split at the first `--`: (launcher args, overrides for the training script)."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def cmd_local(args: argparse.Namespace) -> int:
    """N processes on this machine, each with M fake CPU devices, joined as one JAX pod."""
    return run_local_pod(args.processes, args.devices_per_process, args.overrides, script=args.script, port=args.port,
                         log_dir=args.log_dir, extra_env=dict(args.env), timeout=args.timeout,
                         grace_period=args.grace_period)


def _add_local(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("local", help="run a multi-process CPU pod on this machine",
                       description=cmd_local.__doc__)
    p.add_argument("--processes", "-n", type=int, required=True, help="number of processes (hosts)")
    p.add_argument("--devices-per-process", "-m", type=int, default=1, help="fake CPU devices per process (default: 1)")
    p.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    p.add_argument("--script", default=str(REPO_ROOT / "pretrain_jax.py"),
                   help="training script (default: pretrain_jax.py at the repo root)")
    p.add_argument("--log-dir", type=Path, default=None, help="also write each process's output to DIR/process_<i>.log")
    p.add_argument("--env", type=_env_pair, action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment variable for every process (repeatable; export secrets instead)")
    p.add_argument("--timeout", type=float, default=None, help=f"kill all after N seconds (exit {EXIT_TIMEOUT})")
    p.add_argument("--grace-period", type=float, default=60.0,
                   help="seconds between SIGTERM and SIGKILL on Ctrl-C/SIGTERM (default: 60)")
    p.set_defaults(func=_user_errors(cmd_local))  # (defined below, with the pod commands)


# --- TPU VM slice: every command is ONE `gcloud compute tpus tpu-vm ssh --worker=all` ---------

def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tpu", required=True, help="TPU VM name")
    p.add_argument("--zone", required=True, help="its zone, e.g. us-central2-b")
    p.add_argument("--project", default=None, help="GCP project (default: gcloud's configured one)")
    p.add_argument("--repo-dir", default=pod.DEFAULT_REPO_DIR,
                   help="the repo on every worker (default: %(default)s; `~` is the worker's home)")
    p.add_argument("--dry-run", action="store_true", help="print the gcloud command line and exit")


def _target(args: argparse.Namespace) -> pod.Target:
    return pod.Target(args.tpu, args.zone, args.project)


def _no_overrides(args: argparse.Namespace) -> None:
    if args.overrides:
        raise pod.PodError(f"`{args.command}` takes no training overrides (got {args.overrides})")


def _user_errors(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """PodError or UserError (e.g. a state file that cannot be read) -> one `error:` line on stderr, exit 2."""
    @functools.wraps(func)
    def wrapped(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except (pod.PodError, UserError) as e:
            print(f"error: {e}", file=sys.stderr)
            return getattr(e, "exit_code", EXIT_USER_ERROR)  # a state file that cannot be written: 6
    return wrapped


@_user_errors
def cmd_pod(args: argparse.Namespace) -> int:
    """Run pretrain_jax.py on ALL workers of a TPU VM slice through one `gcloud ... ssh --worker=all`,
    one run id for every worker; secrets never on a command line; exit code: gcloud's; Ctrl-C stops
    the run everywhere. Run ids, secrets, logs and --ship: docs/OPERATIONS.md, "Launch"."""
    return pod.launch_pod(
        _target(args), args.overrides, repo_dir=args.repo_dir, run_id=args.run_id, log_dir=args.log_dir,
        env=dict(args.env), forward_env=args.forward_env, dry_run=args.dry_run,
        interrupt_grace=args.interrupt_grace, leave_running=args.leave_running,
        ship=args.ship, ship_from=args.ship_from, ship_max_mb=args.ship_max_mb)


def _add_env(p: argparse.ArgumentParser) -> None:
    p.add_argument("--env", type=_env_pair, action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment variable on every worker (repeatable; value shown)")
    p.add_argument("--forward-env", action="append", default=[], metavar="NAME",
                   help="also send this local variable as a secret, like WANDB_API_KEY (repeatable, e.g. HF_TOKEN)")


def _add_ship_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ship", action="store_true", help="run this working tree (uncommitted changes included) on "
                                                        "the workers instead of their checkout")
    p.add_argument("--ship-from", type=Path, default=None, metavar="DIR",
                   help="with --ship: the git work tree to ship (default: this checkout)")
    p.add_argument("--ship-max-mb", type=float, default=pod.DEFAULT_MAX_MB,
                   help="with --ship: refuse a tree larger than this many MB (default: %(default)s)")


def _add_pod(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pod", help="run pretrain_jax.py on every worker of a TPU VM slice",
                       description=cmd_pod.__doc__, epilog="Training-script overrides go after `--`.")
    _add_target(p)
    p.add_argument("--run-id", default=None, help="fixed run id (default: a new one, proposed: a resumed run keeps "
                                                   "its checkpoint's)")
    p.add_argument("--log-dir", type=Path, default=pod.DEFAULT_LOG_DIR,
                   help="local directory for <run_id>/launch.log (default: %(default)s)")
    _add_env(p)
    p.add_argument("--interrupt-grace", type=float, default=30.0,
                   help="on Ctrl-C: seconds between SIGTERM and SIGKILL on the workers (default: %(default)s)")
    p.add_argument("--leave-running", action="store_true", help="on Ctrl-C, leave the workers' processes running")
    _add_ship_options(p)
    p.set_defaults(func=cmd_pod)


@_user_errors
def cmd_setup(args: argparse.Namespace) -> int:
    """`bash setup_tpu.sh` in the repo (--repo-dir, already cloned) on ALL workers, then check that
    all report the same commit and package versions (exit 1 if not); --git-ref checks out REF first."""
    _no_overrides(args)
    return pod.setup_pod(_target(args), repo_dir=args.repo_dir, git_ref=args.git_ref, dry_run=args.dry_run)


def _add_setup(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("setup", help="install/check the stack on every worker (setup_tpu.sh)",
                       description=cmd_setup.__doc__)
    _add_target(p)
    p.add_argument("--git-ref", default=None, help="git fetch, then check out this branch/tag/commit first")
    p.set_defaults(func=cmd_setup)


@_user_errors
def cmd_stop(args: argparse.Namespace) -> int:
    """On ALL workers: kill this login's training processes and its TPU holders, then remove the
    libtpu lockfile; exit 0 also when nothing ran. After a crash or "TPU already in use"."""
    _no_overrides(args)
    return pod.stop_pod(_target(args), grace=args.grace, dry_run=args.dry_run, repo_dir=args.repo_dir)


def _add_stop(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("stop", help="kill stale training processes on every worker, free the TPU",
                       description=cmd_stop.__doc__)
    _add_target(p)
    p.add_argument("--grace", type=float, default=0.0, help="seconds between SIGTERM and SIGKILL (default: 0)")
    p.set_defaults(func=cmd_stop)


@_user_errors
def cmd_status(args: argparse.Namespace) -> int:
    """Per worker: is the trainer alive (pid, elapsed), its last step and its log file. With the
    --run-id of a supervised run, its supervision history first (from <log-dir>/<run-id>)."""
    _no_overrides(args)
    if args.run_id and not args.dry_run:
        from experiments.launcher import supervise  # here: JAX, Hydra take seconds to import

        history = supervise.status_text(args.log_dir, args.run_id)
        if history is not None:
            sys.stdout.write(history)
    return pod.pod_status(_target(args), repo_dir=args.repo_dir, outputs=args.outputs, run_id=args.run_id,
                          dry_run=args.dry_run)


def _add_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="per-worker table: alive, pid, last step, log file",
                       description=cmd_status.__doc__)
    _add_target(p)
    p.add_argument("--outputs", default="outputs",
                   help="run.root on the workers, relative to --repo-dir (default: %(default)s)")
    p.add_argument("--run-id", default=None, help="only this launch's worker logs (and a supervised run's history)")
    p.add_argument("--log-dir", type=Path, default=pod.DEFAULT_LOG_DIR,
                   help="local directory of supervised runs' records (default: %(default)s)")
    p.set_defaults(func=cmd_status)


@_user_errors
def cmd_supervise(args: argparse.Namespace) -> int:
    """Keep one run going on a (preemptible) TPU VM slice until it completes: (re-)create the TPU,
    set up the workers, launch with the fixed --run-id, relaunch after a preemption or a failure
    that a relaunch may fix (docs/OPERATIONS.md, "Running a multi-week run unattended"). Ctrl-C or
    SIGTERM stops the supervisor AND the run (the workers checkpoint first). Exit code: 0 when the
    run completed, the run's code when it failed for good, 1 when the supervisor gave up, 130 when
    stopped."""
    from experiments.launcher import supervise  # here: JAX, Hydra take seconds to import

    if args.status:
        text = supervise.status_text(args.log_dir, args.run_id)
        if text is None:
            raise pod.PodError(f"no supervision record for run {args.run_id} under {args.log_dir}")
        sys.stdout.write(text)
        return 0
    if not (args.tpu and args.zone):
        raise pod.PodError("supervise needs --tpu NAME and --zone ZONE (or --status)")
    if not (args.accelerator_type and args.runtime_version):
        raise pod.PodError("supervise needs --accelerator-type and --runtime-version (to re-create the TPU)")
    pod.resolve_run_id(args.run_id, args.overrides)  # a bad id is an error before any gcloud call
    spec = supervise.Spec(
        pod.Target(args.tpu, args.zone, args.project), args.run_id, args.overrides,
        accelerator_type=args.accelerator_type, runtime_version=args.runtime_version, tier=args.tier,
        queued_resource=args.queued_resource, max_restarts=args.max_restarts, repo_dir=args.repo_dir,
        log_dir=args.log_dir, env=dict(args.env), forward_env=args.forward_env, poll_s=args.poll_seconds,
        storage_backoff_s=args.storage_backoff_seconds, stop_grace_s=args.stop_grace, clone_url=args.clone_url,
        at_end=args.at_end)
    with tempfile.TemporaryDirectory(prefix="podrunner-ship-") as tmp:
        if args.ship:  # packed once: every relaunch runs the same tree, whatever is edited meanwhile
            try:
                spec.ship = pod.pack_tree(args.ship_from or pod.REPO_ROOT, tmp, max_mb=args.ship_max_mb)
            except pod.ShipError as e:
                raise pod.PodError(str(e)) from None
        if args.dry_run:
            sys.stdout.write(supervise.dry_run(spec))
            return 0
        spec.state_mirror = supervise.state_mirror(args.overrides)
        if spec.state_mirror:  # the trainer's events beside the checkpoints: when a preemption hit, if it did
            spec.events_file = spec.state_mirror.rsplit("/", 1)[0] + "/run_files/events.jsonl"
        return supervise.run_until_done(spec)


def _add_slice(p: argparse.ArgumentParser, *, required: bool = False) -> None:
    """Where the slices a command creates go and what they are; --spot / --reserved (neither: on demand)."""
    p.add_argument("--zone", required=required, default=None)
    p.add_argument("--project", default=None)
    p.add_argument("--repo-dir", default=pod.DEFAULT_REPO_DIR)
    p.add_argument("--accelerator-type", required=required, default=None, help="e.g. v4-64 (to (re-)create a slice)")
    p.add_argument("--runtime-version", required=required, default=None,
                   help="TPU software version, e.g. tpu-ubuntu2204-base (to (re-)create a slice)")
    tier = p.add_mutually_exclusive_group()
    tier.add_argument("--spot", dest="tier", action="store_const", const="spot", help="create a Spot TPU")
    tier.add_argument("--reserved", dest="tier", action="store_const", const="reserved",
                      help="create it in a reservation")


def _add_supervise(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("supervise", help="keep a run going on a preemptible TPU until it completes",
                       description=cmd_supervise.__doc__, epilog="Training-script overrides go after `--`.")
    p.add_argument("--tpu", default=None, help="TPU VM name")
    p.add_argument("--run-id", required=True, help="the run's fixed id (the same one to carry on after a restart)")
    _add_slice(p)
    p.add_argument("--queued-resource", default=None, metavar="ID",
                   help="create the TPU through this queued resource (waits while ACCEPTED/PROVISIONING)")
    p.add_argument("--max-restarts", type=int, default=10,
                   help="stop after this many restarts for failures (preemptions are not counted; default: %(default)s)")
    p.add_argument("--log-dir", type=Path, default=pod.DEFAULT_LOG_DIR,
                   help="local directory for <run-id>/supervision.json, supervise.log, launch.log (default: %(default)s)")
    _add_env(p)
    p.add_argument("--poll-seconds", type=float, default=30.0,
                   help="first wait while the TPU is CREATING or queued; grows x1.5 to 300 s (default: %(default)s)")
    p.add_argument("--storage-backoff-seconds", type=float, default=120.0,
                   help=f"wait after a storage failure (exit {EXIT_STORAGE}) before relaunching (default: %(default)s)")
    p.add_argument("--stop-grace", type=float, default=30.0,
                   help="seconds between SIGTERM and SIGKILL when stopping workers (default: %(default)s)")
    p.add_argument("--clone-url", default=None, metavar="URL",
                   help="setup clones the repo from URL into --repo-dir where it is missing: a TPU re-created after "
                        "a preemption has fresh disks (default: none; the repo must already be there)")
    p.add_argument("--at-end", choices=("delete", "keep"), default=None,
                   help="when the run has ended (completed, failed for good, given up): delete the TPU or keep it "
                        "(default: delete when the checkpoints are on gs://, where nothing is lost with the VM, else "
                        "keep)")
    _add_ship_options(p)
    p.add_argument("--status", action="store_true", help="print the run's supervision history and exit")
    p.add_argument("--dry-run", action="store_true", help="print the gcloud commands for each TPU state and exit")
    p.set_defaults(func=cmd_supervise)


# --- the experiment programme (experiments/programme.py, conf/experiment/<group>/) ---------------

@_user_errors
def cmd_list(args: argparse.Namespace) -> int:
    """Every group of the programme (or the named ones): its variants and what each changes
    against the baseline, from the composed configs (* = the baseline's own setting)."""
    from experiments.compose import changes, describe, variants  # here: it imports Hydra or JAX
    from experiments.programme import GROUPS, groups_named

    for name in groups_named(args.groups):
        g = GROUPS[name]
        print(f"{name}: {g.title} -- varies {g.varies} (from {g.base})")
        for v in variants(name):
            mark = "*" if v == g.baseline_variant else " "
            print(f"  {mark} {name}/{v:<20} {describe(changes(name, v))}")
    return 0


def _add_list(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("list", help="list the experiment groups, their variants and what each changes",
                       description=cmd_list.__doc__)
    p.add_argument("groups", nargs="*", metavar="GROUP")
    p.set_defaults(func=cmd_list)


@_user_errors
def cmd_sweep(args: argparse.Namespace) -> int:
    """Run every variant of GROUP (or --variants) scaled down on this machine, as one Hydra multirun
    (experiments/sweep.py); each is its own run (<run.root>/<group>/<variant>). A failed variant does
    not stop the others; the exit code is the first non-zero one. Overrides after `--` go to every
    variant. On TPU slices: `launch.py programme submit NAME GROUP --slice TPU ...`. Then:
    `launch.py analyze GROUP`."""
    from experiments import sweep  # here: it imports Hydra or JAX
    from experiments.compose import variants
    from experiments.programme import GROUPS

    if not args.local:
        raise pod.PodError(f"sweep runs scaled down here (--local); on a TPU slice: `launch.py programme submit "
                           f"NAME {args.group} --slice TPU --zone ZONE ...`")
    if args.group not in GROUPS:  # (a bad group.yaml: GroupFileError, one line too)
        raise pod.PodError(f"unknown group {args.group!r}; `python experiments/launch.py list` shows the groups")
    known = variants(args.group)
    chosen = args.variants.split(",") if args.variants else known
    bad = [v for v in chosen if v not in known]
    if bad:
        raise pod.PodError(f"{args.group} has no variant(s) {bad}; it has {known}")
    jobs = sweep.run_local(args.group, chosen, Path(args.root), args.overrides, dry_run=args.dry_run)
    if not args.dry_run:
        print("\n".join(f"  {args.group}/{job.run:<20} exit {job.code}" for job in jobs))
    return next((job.code for job in jobs if job.code), 0)


def _add_sweep(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="run a group's variants scaled down here, as a Hydra multirun",
                       description=cmd_sweep.__doc__, epilog="Extra overrides for every variant go after `--`.")
    p.add_argument("group", metavar="GROUP")
    p.add_argument("--variants", default=None, help="comma-separated subset (default: all)")
    p.add_argument("--local", action="store_true", help="scaled down on this machine (the only place)")
    p.add_argument("--root", default="outputs/local", help="run.root of the runs (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="print the commands only")
    p.set_defaults(func=cmd_sweep)


def cmd_analyze(args: argparse.Namespace) -> int:
    from experiments import analyze  # here: it imports Hydra or JAX

    return analyze.main([args.group, *args.rest])


def _add_analyze(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("analyze", help="a group's table and plots (experiments/analyze.py)", add_help=False)
    p.add_argument("group", metavar="GROUP")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_analyze)


def _add_dashboard(sub: argparse._SubParsersAction) -> None:
    from experiments import dashboard  # light: it imports wandb only when it runs

    p = sub.add_parser("dashboard", help="each group's W&B workspace and report, made or updated in place",
                       description=dashboard.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    dashboard.add_arguments(p)
    p.set_defaults(func=dashboard.main_args)


def cmd_plan(args: argparse.Namespace) -> int:
    """Before spending pod time: for each variant of the groups (all: the whole programme), at
    full scale on --topology, whether its train step fits, its step time and MFU, and its whole
    bill in pod-hours and goodput, at the figures' low and high ends (experiments/plan/bill.py);
    a markdown table on stdout and a CSV file (what `programme --budget` reads). What each column
    means: docs/OPERATIONS.md, "`launch.py plan`" and "Reading the bill". Exit 0 (a variant that
    does not fit is a row)."""
    from experiments import doctor
    from experiments.compose import variants  # here: it imports Hydra or JAX
    from experiments.plan import bill, calibrate, planner, price, report
    from experiments.programme import groups_named
    from runtime.compile_only import parse_topology
    from runtime.config import check_folder

    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # planning compiles for the topology, never on a local device
    try:
        parse_topology(args.topology, "--topology ")
        check_folder("--executables", args.executables, "or leave it out")
        mtbf_s = bill.parse_hours(args.mtbf) if args.mtbf else None
        source = Path(args.calibrate_from) if args.calibrate_from else None
        calibration = None if source is None else doctor.read_calibration(
            source, allow_platform_mismatch=args.allow_platform_mismatch) if source.is_file() else calibrate.calibrate(source)
        jobs = [planner.Job(g, v, tuple(args.overrides)) for g in groups_named(args.groups) for v in variants(g)]
        rows = planner.Planner(args.topology, Path(args.cache_dir or planner.CACHE_DIR), workers=args.jobs).plan(jobs)
        if calibration is not None:  # what moved, said above the table
            from experiments.compose import family

            print("\n".join(calibrate.moved(bill.FIGURES, calibration.figures)
                             + doctor.scale_steps(rows, calibration, args.topology, family)) or
                  "calibrated: no figure moved", flush=True)
        ahead = planner.keep_ahead(jobs, rows, args.topology, args.executables, workers=args.jobs,
                                   progress=lambda line: print(line, file=sys.stderr, flush=True),
                                   cache_root=Path(args.cache_dir or planner.CACHE_DIR)) if (
            args.executables) else frozenset()
        programme = price.price_programme(
            rows, calibration.figures if calibration else bill.FIGURES, mtbf_s=mtbf_s, slices=args.slices,
            ahead=ahead, compiles=calibration.program_startup if calibration else {})
        command = "python experiments/launch.py plan " + " ".join(
            args.groups + ["--topology", args.topology] + (["--mtbf", args.mtbf] if args.mtbf else [])
            + (["--slices", str(args.slices)] if args.slices != 1 or args.mtbf else [])
            + (["--calibrate-from", args.calibrate_from] if args.calibrate_from else [])
            + (["--allow-platform-mismatch"] if args.allow_platform_mismatch else [])
            + (["--executables", args.executables] if args.executables else [])
            + (["--", *args.overrides] if args.overrides else []))
        ledger = args.calibrate_from if source is not None and not source.is_file() else ""  # a doctor file has no compiles
        text = report.markdown(programme, args.topology, command, ledger)  # prices the high end too
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    sys.stdout.write(text)
    csv_path = Path(args.csv or planner.CSV_DIR / f"{'_'.join(args.groups)}_{args.topology}.csv")
    try:
        report.write_csv(rows, csv_path)
    except OSError as e:
        print(f"error: cannot write the CSV {csv_path} ({e.strerror}); the table is above, give --csv a writable path",
              file=sys.stderr)
        return EXIT_USER_ERROR
    print(f"\n(CSV: {csv_path})")
    return 0


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="fits, step time and the whole bill (pod-hours, goodput) of groups on a topology",
                       description=cmd_plan.__doc__, epilog="Overrides for every variant go after `--`.")
    p.add_argument("groups", nargs="+", metavar="GROUP", help="group names, or all")
    p.add_argument("--topology", required=True, help="TPU slice to plan for, e.g. v4-64, v5e-8")
    p.add_argument("--mtbf", default=None, metavar="DURATION",
                   help="price preemptions at one per this much paid time, e.g. 8h (default: none)")
    p.add_argument("--slices", type=int, default=1, help="slices running the queue: the wall-clock days (default 1)")
    p.add_argument("--calibrate-from", default=None, metavar="STATE_DIR|FILE",
                   help="a programme's state directory (the start-up figures from its ledger's medians), or a "
                        "`launch.py doctor` file (its measured figures, and its step times scale the estimates)")
    p.add_argument("--allow-platform-mismatch", action="store_true",
                   help="with --calibrate-from FILE: use figures measured on CPU workers for a TPU topology")
    p.add_argument("--csv", default=None, help="CSV file (default: outputs/plan/<groups>_<topology>.csv)")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="compile in this many processes (default: %(default)s)")
    p.add_argument("--cache-dir", default=None, help="compile results by HLO key (default: outputs/plan/cache)")
    p.add_argument("--executables", default=None, metavar="FOLDER",
                   help="also keep every planned program compiled for the topology in FOLDER (local or gs://), "
                        "for runs given run.executables=FOLDER to read instead of compiling; priced so")
    p.set_defaults(func=cmd_plan)


def _add_doctor(sub: argparse._SubParsersAction) -> None:
    from experiments import doctor  # light: the checks import JAX on the workers only

    p = sub.add_parser("doctor", help="check every worker of a slice and measure the plan's figures there",
                       description=doctor.main_args.__doc__, epilog="Overrides for every measured variant go after `--`.")
    _add_target(p)
    doctor.add_arguments(p)
    p.set_defaults(func=_user_errors(lambda args: doctor.main_args(args, _target(args))))


# --- the whole programme, unattended (experiments/launcher/queue_state.py, controller.py) ----------------

def cmd_programme(args: argparse.Namespace) -> int:
    """A durable queue of the programme's variants on one or more preemptible TPU slices, each run
    supervised, with a ledger of pod-hours, results and status. The verbs: `programme VERB --help`;
    at work: docs/OPERATIONS.md, "Running the whole programme unattended". A damaged state file is
    one `error:` line naming it (exit 2), one that cannot be written one too (exit 6)."""
    from experiments.launcher import controller, queue_state, queue_status  # here: JAX, Hydra take seconds to import
    from experiments.launcher.ledger import StateWriteError, Verb, write_text

    try:
        check_args(args, {"--budget": queue_state.BUDGET, "hours": queue_state.BUDGET}, UserError)
        _check_programme_names(args)
        directory = Path(args.state_dir) / args.name
        if args.verb == "submit":
            return _programme_submit(args, directory)
        if args.verb == "run":
            return controller.run(directory, args.mirror)
        if args.verb == "repair":
            print(queue_state.repair(directory, args.mirror))
            return 0
        state = queue_state.State(directory)
        state.load(args.mirror)
        if args.verb == "status":
            from experiments import dashboard

            links = dashboard.links(directory)  # W&B pages: with submit --dashboards
            sys.stdout.write(queue_status.text(state.sub, state.ledger, links=links))
            page = Path(args.html) if args.html else directory / "status.html"
            try:
                write_text(page, queue_status.page(state.sub, state.ledger, links=links), "status page")
            except StateWriteError as e:
                raise StateWriteError(page, e.error, "status page", also="or give --html a writable path (the "
                                                                        "table is above)") from None
            print(f"(the picture: {page})")
            return 0
        if args.verb in (Verb.RETRY, Verb.SKIP) and args.variant not in state.ledger.variants:
            raise UserError(f"programme {args.name} has no variant {args.variant!r}; `programme status {args.name}` "
                            "lists them")
        release, slices = queue_state.stop_choice(state.sub, getattr(args, "release", None)) if (
            args.verb == Verb.STOP) else (None, "")
        state.command(Verb(args.verb), getattr(args, "variant", None), getattr(args, "hours", None),
                      mirror=args.mirror, release=release)
        what = " ".join(str(x) for x in (args.verb, getattr(args, "variant", None), getattr(args, "hours", None)) if x)
        print(f"{what}: asked; the running controller does it now, or the next `programme run` when none runs{slices}")
        return 0
    except LeaseHeld as e:  # (any other UserError: one `error:` line from _user_errors)
        print(f"error: another controller runs programme {args.name}: {e}", file=sys.stderr)
        return EXIT_USER_ERROR


def _variant_problem(value: str, *, group: bool) -> str | None:
    """Why `value` names no variant (GROUP/VARIANT, or with `group` False also VARIANT), or None."""
    parts = value.split("/")
    if len(parts) > 2 or (group and len(parts) != 2):
        return "a variant is GROUP/VARIANT" + ("" if group else " or VARIANT")
    return next((f"{part!r}: {name_problem(part)}" for part in parts if name_problem(part)), None)


def _check_programme_names(args: argparse.Namespace) -> None:
    """The programme's name, its slices and the variants named are safe folder names, by the rules
    the trainer checks run.name with (runtime/ranges.py), before anything is read or written."""
    slices = getattr(args, "slice", None) or []
    for label, name in [("programme NAME", args.name), *(("--slice", name) for name in slices)]:
        problem = name_error(label, name)
        if problem:
            raise UserError(problem)
    twice = sorted({name for name in slices if slices.count(name) > 1})
    if twice:
        raise UserError(f"--slice {twice[0]} is given twice: a slice runs one variant at a time, so give each slice "
                        "once (several slices: --slice A --slice B)")
    only = getattr(args, "variants", None)
    if only is not None and not only.strip():
        raise UserError(f"--variants {only!r} names no variant: give group/variant or variant names, comma-separated, "
                        "or leave --variants out for every variant of the groups")
    for item in only.split(",") if only else []:
        problem = _variant_problem(item, group=False)
        if problem:
            raise UserError(f"--variants {only[:80]!r} holds {item[:80]!r}, which names no variant ({problem}); give "
                            "group/variant or variant names, comma-separated")
    variant = getattr(args, "variant", None)
    if variant is not None:
        problem = _variant_problem(variant, group=True)
        if problem:
            raise UserError(f"{variant[:80]!r} names no variant ({problem}); `programme status {args.name}` lists "
                            "them")


def _programme_submit(args: argparse.Namespace, directory: Path) -> int:
    from experiments import dashboard
    from experiments.launcher import controller, queue_state  # here: JAX, Hydra take seconds to import

    state = queue_state.State(directory)
    state.check_layout()
    held = [name for name in ("programme.json", "ledger.json") if (directory / name).exists()]
    if held:
        raise pod.PodError(f"programme {args.name} exists at {directory} ({', '.join(held)}); `programme run "
                           f"{args.name}` carries it on (or submit under another name)")
    if not args.slice:
        raise pod.PodError("give the slices to run on: --slice NAME (one or more)")
    if args.mirror and queue_state.read_mirror(args.mirror):
        raise UserError(f"the mirror {args.mirror} already holds a programme's state: `programme run {args.name} "
                        f"--mirror {args.mirror}` takes it over, or give another --mirror")
    state.check_writable()  # before the preflight, which composes every variant
    variants = queue_state.choose_variants(args.groups, args.variants.split(",") if args.variants else [])
    planned = queue_state.read_plan(Path(args.plan)) if args.plan else {}
    args.overrides = queue_state.with_executables(args.overrides, planned, variants)
    if args.order == "cheapest":
        variants.sort(key=lambda v: (planned.get(v) or {}).get("pod_hours") or float("inf"))
    sub = queue_state.Submission(
        name=args.name, variants=variants, slices=args.slice, zone=args.zone, project=args.project,
        accelerator_type=args.accelerator_type, runtime_version=args.runtime_version, tier=args.tier,
        queued=args.queued, budget=args.budget, planned=planned, overrides=args.overrides, env=dict(args.env),
        forward_env=args.forward_env, repo_dir=args.repo_dir, clone_url=args.clone_url, mirror=args.mirror,
        max_restarts=args.max_restarts, poll_s=args.poll_seconds, backoff_s=args.backoff_seconds,
        stop_grace_s=args.stop_grace, create_attempts=args.create_attempts, infra_streak=args.infra_streak)
    sub.data_on_every_slice = args.data_on_every_slice
    queue_state.check_run_ids(sub)
    problems = queue_state.preflight(sub)
    for line in problems:  # each problem one `error:` line
        print(f"error: {line}", file=sys.stderr)
    if problems:
        return EXIT_USER_ERROR
    views = dashboard.programme_settings(controller.Alerts.runs_wandb(sub)) if args.dashboards else None
    state.create(sub)  # a write that fails: exit 6, nothing left half-submitted
    if views:  # each group's W&B workspace and report, made when its first variant starts
        dashboard.opt_in(directory, views)
    return controller.run(directory, args.mirror) if args.run else 0


def _add_programme(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("programme", help="run the whole programme unattended: a queue of variants on TPU slices",
                       description=cmd_programme.__doc__)
    verbs = p.add_subparsers(dest="verb", required=True, metavar="VERB")

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("name", metavar="NAME", help="the programme's name (its state: <state-dir>/NAME)")
        q.add_argument("--state-dir", default=str(pod.REPO_ROOT / "outputs" / "programmes"),
                       help="where programmes keep their state (default: %(default)s)")
        q.add_argument("--mirror", default=None, metavar="URI",
                       help="the state's copy, e.g. gs://BUCKET/programmes/NAME (submit: kept in sync; run, status: "
                            "read from it when this machine has no state, i.e. to take over)")

    q = verbs.add_parser("submit", help="queue groups' variants (a preflight first)", epilog="Overrides go after `--`.")
    common(q)
    q.add_argument("groups", nargs="+", metavar="GROUP", help="group names, or all")
    q.add_argument("--variants", default=None, help="only these (group/variant or variant, comma-separated)")
    q.add_argument("--slice", action="append", default=[], metavar="TPU",
                   help="a TPU VM slice to run on (repeatable: one variant per slice at a time, in parallel)")
    _add_slice(q, required=True)
    q.add_argument("--queued", action="store_true", help="create each slice through a queued resource <slice>-qr")
    q.add_argument("--budget", type=float, default=None, help="pod-hours: no variant starts past it (needs --plan)")
    q.add_argument("--plan", default=None, metavar="CSV", help="the CSV of `launch.py plan` (planned pod-hours)")
    q.add_argument("--order", choices=("plan", "cheapest"), default="plan",
                   help="plan: the groups and variants in order (default); cheapest: fewest planned pod-hours first")
    q.add_argument("--clone-url", default=None, metavar="URL", help="as supervise: the repo for fresh disks")
    _add_env(q)
    q.add_argument("--max-restarts", type=int, default=10, help="per variant (default: %(default)s)")
    q.add_argument("--poll-seconds", type=float, default=30.0)
    q.add_argument("--backoff-seconds", type=float, default=120.0)
    q.add_argument("--stop-grace", type=float, default=30.0)
    q.add_argument("--create-attempts", type=int, default=3,
                   help="refused creates in a row before a variant gives its slice up (default: %(default)s)")
    q.add_argument("--infra-streak", type=int, default=3,
                   help="the same infrastructure failure ending this many variants in a row stops the controller "
                        "(default: %(default)s)")
    q.add_argument("--data-on-every-slice", action="store_true",
                   help="with --spot: the variants' data paths on the workers' disks are on every slice the programme "
                        "creates (its boot image or setup puts them there; default: refused, as a slice re-created "
                        "after a preemption has empty disks)")
    q.add_argument("--run", action="store_true", help="then run the controller here")
    q.add_argument("--dashboards", action="store_true",
                   help="make each group's W&B workspace and report when its first variant starts (needs the runs "
                        "online and a key); status links them")
    for verb, text in (("run", "run the controller (until nothing is left; again to carry on)"),
                       ("status", "the table, and the status page with its picture"),
                       ("stop", "the running variants stop (each saves its step within --stop-grace), the "
                                "controller ends, and the slices are deleted or kept (--release / --keep)")):
        common(verbs.add_parser(verb, help=text))
    choice = verbs.choices["stop"].add_mutually_exclusive_group()
    choice.add_argument("--release", dest="release", action="store_const", const=True, default=None,
                        help="then delete the slices (the default when every variant's checkpoints are on gs://)")
    choice.add_argument("--keep", dest="release", action="store_const", const=False,
                        help="keep the slices READY, billing (the default when checkpoints are on the workers' disks)")
    verbs.choices["status"].add_argument("--html", default=None, help="the page (default: <state>/status.html)")
    common(verbs.add_parser("repair", help="a state directory with a damaged file: restore it from the mirror "
                                           "(--mirror, or programme.json's); what was in the way is kept beside it"))
    for verb, text in (("retry", "queue a failed or skipped variant again"), ("skip", "do not run a variant")):
        q = verbs.add_parser(verb, help=text)
        common(q)
        q.add_argument("variant", metavar="GROUP/VARIANT")
    q = verbs.add_parser("budget", help="set the budget (pod-hours); a budget-stopped queue goes on")
    common(q)
    q.add_argument("hours", type=float, metavar="HOURS")
    p.set_defaults(func=_user_errors(cmd_programme))


class _Parser(argparse.ArgumentParser):
    """argparse, but a mistake on the command line (an unknown option, a value that is not a number,
    a missing argument) is one `error:` line, exit 2, as every other refusal; not usage plus a line."""

    def error(self, message: str):
        self.exit(EXIT_USER_ERROR, f"error: {self.prog}: {' '.join(message.split())} (`{self.prog} --help` shows the "
                                   "usage)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="launch.py", description="Launch experiments locally or on a TPU pod.",
        epilog="Training-script overrides go after `--`.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_local, _add_pod, _add_setup, _add_stop, _add_status, _add_supervise, _add_list, _add_sweep,
                _add_analyze, _add_dashboard, _add_plan, _add_doctor, _add_programme):
        add(sub)
    return parser


# Options that take a path or a name: the empty string names nothing (as a path, the working directory).
_NAMED = ("--accelerator-type", "--bucket", "--cache-dir", "--calibrate-from", "--clone-url", "--csv", "--git-ref", "--html",
          "--log-dir", "--mirror", "--outputs", "--plan", "--project", "--queued-resource", "--repo-dir", "--root",
          "--run-id", "--runtime-version", "--script", "--ship-from", "--slice", "--state-dir", "--topology", "--tpu",
          "--zone")


@_user_errors
def check_options(args: argparse.Namespace) -> int:
    """The numbers in range (_RULES) and every --forward-env name set, before anything starts."""
    check_args(args, _RULES.get(args.command, {}), pod.PodError)
    check_given(args, _NAMED, pod.PodError)
    pod.check_forwarded(getattr(args, "forward_env", None) or (), os.environ)
    return 0


def main(argv: list[str] | None = None) -> int:
    ours, overrides = split_overrides(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(ours)
    args.overrides = overrides
    try:
        return check_options(args) or args.func(args)
    except KeyboardInterrupt:  # a command that does not stop its own way on Ctrl-C (plan...): one line, no traceback
        print(f"error: {interrupted(f'launch.py {args.command} stopped before it finished')}", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    console_logging(logging.WARNING, "%(message)s")  # the process's (libraries one line each), not an in-process caller's
    sys.exit(main())
