"""`python -m experiments.launcher.worker.pins SHIPPED REPO HOST`: warn (one line) when the shipped tree's
pyproject.toml pins other packages than the repo's, whose .venv the shipped tree runs with
(shipping installs nothing)."""

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


def same(shipped, repo):
    try:
        return pins(shipped) == pins(repo)
    except (OSError, ValueError):
        return False


if __name__ == "__main__":
    shipped, repo, host = sys.argv[1:4]
    if not same(shipped, repo):
        print(f"podrunner: {host}: WARNING: the shipped pyproject.toml pins other packages than the one in "
              "--repo-dir; the run uses the .venv there (shipping installs nothing): run launch.py setup",
              file=sys.stderr)
