"""`python3 -m experiments.launcher.worker.checkout HOST REF`: check out REF, detached, in the repo (the
working directory) for `launch.py setup --git-ref REF`: fetch origin with its tags, then check out
origin/REF when that is a fetched remote branch (a branch name means the remote's branch, not a
stale local one), else REF itself (a tag, a commit). Runs with the system python3, before
setup_tpu.sh has made the .venv. A failure is one line naming the worker, and exit 2.
"""

import subprocess
import sys

from runtime.errors import EXIT_USER_ERROR  # standard library only, like this


def git(*args, quiet=False):
    """The exit code of `git ARGS` (its stderr dropped when `quiet`)."""
    return subprocess.run(["git", *args], stdin=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL if quiet else None).returncode


def checkout(host, ref):
    problem = None
    if git("fetch", "--quiet", "--tags", "origin") != 0:
        problem = "git fetch failed"
    elif (git("checkout", "--quiet", "--detach", f"origin/{ref}", quiet=True) != 0
          and git("checkout", "--quiet", "--detach", ref) != 0):
        problem = "cannot check out --git-ref"
    if problem:
        print(f"podrunner: {host}: {problem}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(checkout(sys.argv[1], sys.argv[2]))
