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
  "$VENV/bin/python" -m pip install --quiet -e "$REPO[test]"
  rm -f "$VENV"/.installed-* && touch "$stamp"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"  # CPU devices unless told otherwise (libtpu may be present)
cd "$REPO"
