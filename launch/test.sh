#!/usr/bin/env bash
# The test command (README): set up a fresh clone if needed, check formatting, run the tests.
#   bash launch/test.sh                  the whole suite (what CI runs)
#   bash launch/test.sh --fast           the fast tier: no end-to-end runs, no whole-step compiles
#   bash launch/test.sh tests/algorithm  extra arguments go to pytest (a folder, -k objectives, ...)
set -euo pipefail
cd "$(dirname "$0")/.."
tier=()
if [ "${1:-}" = "--fast" ]; then
  shift
  tier=(-m "not e2e and not slow")
fi
source launch/setup_env.sh
# libtpu, for the test that compiles the tiny config's RL step for a TPU slice
# (tests/tools/test_aot.py): installed beside .venv, not into it, so that plain CPU runs never
# load a TPU plugin; the test puts .libtpu/ on its subprocess's PYTHONPATH.
stamp=.libtpu/.gspo_jax_requirements
want=$(sha256sum requirements-tpu.txt | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[setup] installing libtpu into .libtpu/ (about 700 MB)"
  rm -rf .libtpu
  python -m pip install -q --no-deps --target .libtpu -r requirements-tpu.txt
  echo "$want" >"$stamp"
fi
export GSPO_REQUIRE_LIBTPU=1
export JAX_PLATFORMS=cpu
ruff format --check .
ruff check .
# --dist loadfile: a file's tests run in one worker, so a module's shared fixtures (a whole
# tiny run, compiled train steps) are built once, not once per worker. --no-loadscope-reorder:
# files go out in collection order, the longest first (tests/conftest.py: LONGEST_FIRST), so no
# long file is left for last. --durations=15: the slowest tests, to keep the suite in budget.
# Paths among the arguments (a folder, a file, file::test) replace the default `tests`.
where=(tests)
for arg in "$@"; do
  if [ -e "${arg%%::*}" ]; then
    where=()
    break
  fi
done
python -m pytest -n 2 --dist loadfile --no-loadscope-reorder -q -p no:cacheprovider --durations=15 \
  "${tier[@]}" "${where[@]}" "$@"
