#!/usr/bin/env bash
# Set up, then run the whole test suite on CPU. Extra args go to pytest (e.g. -k pod, -m "not slow").
# Two pytest workers, one file each at a time (module fixtures run once), in the order conftest.py
# gives (files with slow tests first; xdist's own reorder by test count is off); PYTEST_WORKERS=0
# runs in this process only.
source "$(dirname "$0")/venv.sh"
python -m pytest -q -n "${PYTEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
