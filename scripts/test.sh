#!/usr/bin/env bash
# Set up, then run the whole test suite on CPU. Extra args go to pytest (e.g. -k pod, -m "not slow").
source "$(dirname "$0")/venv.sh"
python -m pytest -q "$@"
