"""`python3 -m experiments.launcher.worker.checkout HOST REF` (`launch.py setup --git-ref REF`): fetch
origin, then check out origin/REF, detached, when it is a remote branch (not a stale local one),
else REF itself (a tag, a commit). A failure is one line naming the worker, and exit 2.
"""

import subprocess
import sys

from runtime.errors import EXIT_USER_ERROR  # standard library only, like this


def git(*args, quiet=False):
    """The exit code of `git ARGS` (its stderr dropped when `quiet`)."""
    return subprocess.run(["git", *args], stdin=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL if quiet else None).returncode


def checkout(host, ref):
    if git("fetch", "--quiet", "--tags", "origin") != 0:
        problem = "git fetch failed"
    elif (git("checkout", "--quiet", "--detach", f"origin/{ref}", quiet=True) != 0
          and git("checkout", "--quiet", "--detach", ref) != 0):
        problem = "cannot check out --git-ref"
    else:
        return 0
    print(f"podrunner: {host}: {problem}", file=sys.stderr, flush=True)
    return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(checkout(sys.argv[1], sys.argv[2]))
