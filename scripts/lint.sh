#!/usr/bin/env bash
# ruff (ruff.toml) and mypy (mypy.ini) over the repository; non-zero on any finding. .ci/run runs
# it before the tests; `pre-commit install` runs the same on every commit.
source "$(dirname "$0")/venv.sh"
ruff check .
mypy
