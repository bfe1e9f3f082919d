"""Experiment launcher CLI.

    python experiments/launch.py local --processes 2 --devices-per-process 4 -- model=trm run.name=x

Everything after the first `--` is passed to the training script untouched
(Hydra `key=value` overrides). One function per subcommand (`cmd_<name>`),
registered in `build_parser`; the logic itself lives in importable modules.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make `experiments.*` importable
    sys.path.insert(0, str(REPO_ROOT))

from experiments.local_pod import run_local_pod  # noqa: E402


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
    return run_local_pod(
        args.processes,
        args.devices_per_process,
        args.overrides,
        script=args.script,
        port=args.port,
        log_dir=args.log_dir,
        extra_env=dict(args.env),
        timeout=args.timeout,
        grace_period=args.grace_period,
    )


def _add_local(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("local", help="run a multi-process CPU pod on this machine",
                       description=cmd_local.__doc__)
    p.add_argument("--processes", "-n", type=int, required=True, help="number of processes (hosts)")
    p.add_argument("--devices-per-process", "-m", type=int, default=1,
                   help="fake CPU devices per process (default: 1)")
    p.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    p.add_argument("--script", default=str(REPO_ROOT / "pretrain_jax.py"),
                   help="training script (default: pretrain_jax.py at the repo root)")
    p.add_argument("--log-dir", type=Path, default=None,
                   help="also write each process's output to DIR/process_<i>.log")
    p.add_argument("--env", type=_env_pair, action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment variable for every process (repeatable)")
    p.add_argument("--timeout", type=float, default=None,
                   help="kill everything after this many seconds (exit 124)")
    p.add_argument("--grace-period", type=float, default=60.0,
                   help="seconds between forwarding SIGTERM and SIGKILL on Ctrl-C/SIGTERM "
                        "(default: 60)")
    p.set_defaults(func=cmd_local)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="launch.py", description="Launch experiments locally or on a TPU pod.",
        epilog="Training-script overrides go after `--`.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_local(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    ours, overrides = split_overrides(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(ours)
    args.overrides = overrides
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
