#!/usr/bin/env bash
# The main job on one machine (README's first command): set up a fresh clone if needed, then
# run the default config (tiny model, synthetic task, GSPO) into WORKDIR.
#   bash launch/local.sh                                    # workdirs/default
#   CONFIG=configs/grpo_paper.py bash launch/local.sh       # workdirs/grpo_paper
#   WORKDIR=/tmp/run bash launch/local.sh --config.num_steps=10
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/setup_env.sh
CONFIG=${CONFIG:-configs/default.py}
# One workdir per config by default (a config's arguments after ':' do not change it).
config_file=${CONFIG%%:*}
WORKDIR=${WORKDIR:-workdirs/$(basename "$config_file" .py)}
# Errors about the workdir name the variable this script takes, not main's --workdir flag.
export GSPO_WORKDIR_FLAG="WORKDIR="
python -m gspo_jax.main --config="$CONFIG" --workdir="$WORKDIR" "$@"
