#!/usr/bin/env bash
# Run gspo_jax on a Cloud TPU VM slice (create, setup, run, logs, status, stop, ssh, delete):
#   bash launch/tpu_pod.sh --help        # every command and option
#   bash launch/tpu_pod.sh --dry-run ... # print the gcloud commands instead of running them
# The launcher is launch/tpu_pod.py (standard library only, Python >= 3.9); the guide is
# docs/tpu_pods.md.
set -euo pipefail
exec "${LAUNCH_PYTHON:-python3}" "$(dirname "$0")/tpu_pod.py" "$@"
