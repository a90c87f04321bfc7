#!/usr/bin/env bash
# The test command (README): set up a fresh clone if needed, check formatting, run the tests.
# Extra arguments go to pytest, e.g. `bash launch/test.sh -k objectives`.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/setup_env.sh
export JAX_PLATFORMS=cpu
ruff format --check .
ruff check .
python -m pytest -n 2 -q -p no:cacheprovider tests "$@"
