#!/usr/bin/env bash
# The main job on one machine (README's first command): set up a fresh clone if needed, then
# run the default config (tiny model, synthetic task, GSPO) into WORKDIR.
#   bash launch/local.sh                           # workdirs/default
#   WORKDIR=/tmp/run bash launch/local.sh --config.num_steps=10
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/setup_env.sh
WORKDIR=${WORKDIR:-workdirs/default}
CONFIG=${CONFIG:-configs/default.py}
python -m gspo_jax.main --config="$CONFIG" --workdir="$WORKDIR" "$@"
