# Sourced by launch/*.sh: create .venv if there is none and install the pinned stack and the
# package into it (only when requirements changed since the last install), then activate it.
# Needs only Python >= 3.11 and a package registry.
set -euo pipefail
PYTHON_BIN=${PYTHON:-python3}
"$PYTHON_BIN" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
  echo "gspo_jax needs Python >= 3.11 (found $("$PYTHON_BIN" --version 2>&1)); set PYTHON=..." >&2
  exit 1
}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating virtualenv .venv"
  "$PYTHON_BIN" -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
stamp=.venv/.gspo_jax_requirements
want=$(cat requirements.txt requirements-test.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[setup] installing pinned requirements (about a minute, 1.2 GB)"
  python -m pip install -q --upgrade pip
  python -m pip install -q -r requirements.txt -r requirements-test.txt
  python -m pip install -q --no-deps -e .
  echo "$want" >"$stamp"
fi
