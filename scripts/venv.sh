# Sourced by demo.sh and test.sh: create ./.venv with the pinned stack (once; again when
# pyproject.toml changes) and activate it. Needs only python3 (3.11+) with venv and pip.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$REPO/.venv}"
PYTHON="${PYTHON:-python3}"
stamp="$VENV/.installed-$(sha256sum "$REPO/pyproject.toml" | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "setting up $VENV (pinned versions from pyproject.toml)..."
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  # torch by pip, first: its CPU build may be a local wheel that only pip's configuration names
  # (uv reads none of it). Then the rest by uv (pinned), 6 s where pip takes 45 s; pip if uv is not
  # at hand. Both give the same packages at the same versions (pip list compared).
  torch_pin="$(grep -o '"torch==[^"]*"' "$REPO/pyproject.toml" | tr -d '"')"
  # No bytecode compiled here (most of torch and the rest is never imported): each module's is
  # written when it is first imported (PYTHONDONTWRITEBYTECODE is unset below).
  "$VENV/bin/python" -m pip install --quiet --no-compile "$torch_pin"
  if "$VENV/bin/python" -m pip install --quiet uv==0.13.9; then
    "$VENV/bin/python" -m uv pip install --quiet --python "$VENV/bin/python" -e "$REPO[test]"
  else
    "$VENV/bin/python" -m pip install --quiet --no-compile -e "$REPO[test]"
  fi
  rm -f "$VENV"/.installed-* && touch "$stamp"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"  # CPU devices unless told otherwise (libtpu may be present)
# The runs and the suite start hundreds of Python processes: with PYTHONDONTWRITEBYTECODE set (as on
# CI machines) none would cache its bytecode and every import of jax, orbax, ... compiles it again
# (3.4 s instead of 1.3 s a process). Unset here, the first import of each module writes it.
unset PYTHONDONTWRITEBYTECODE
cd "$REPO"
