# Sourced by setup_tpu.sh: `find_python` prints an interpreter that fits pyproject's requires-python
# (>= 3.11). The TPU VM images' python3 is 3.10, so when no python3.1x on PATH fits, uv installs
# its managed CPython (uv itself from pip, or its installer) and that one is used.
fits() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; }

find_python() {
  local p
  for p in ${PYTHON:-} python3.13 python3.12 python3.11 python3; do
    if command -v "$p" >/dev/null 2>&1 && fits "$p"; then command -v "$p"; return 0; fi
  done
  export PATH="$HOME/.local/bin:$PATH"  # where `pip install --user` and uv's installer put uv
  if ! command -v uv >/dev/null 2>&1; then
    python3 -m pip install --user --quiet uv >&2 || curl -LsSf https://astral.sh/uv/install.sh | sh >&2 || return 1
  fi
  uv python install 3.11 >&2 && uv python find 3.11
}
