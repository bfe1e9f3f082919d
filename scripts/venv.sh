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
  "$VENV/bin/python" -m pip install --quiet "$torch_pin"
  if "$VENV/bin/python" -m pip install --quiet uv==0.13.9; then
    "$VENV/bin/python" -m uv pip install --quiet --compile-bytecode --python "$VENV/bin/python" -e "$REPO[test]"
  else
    "$VENV/bin/python" -m pip install --quiet -e "$REPO[test]"
  fi
  rm -f "$VENV"/.installed-* && touch "$stamp"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"  # CPU devices unless told otherwise (libtpu may be present)
cd "$REPO"
