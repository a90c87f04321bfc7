#!/usr/bin/env bash
# Run a config on every host of a Cloud TPU VM slice (multi-controller JAX: each host runs the
# same command; main.py calls jax.distributed.initialize(), which reads the TPU environment).
#
#   TPU=my-v5p-64 ZONE=us-east5-a PROJECT=my-proj \
#     bash launch/tpu_pod.sh setup                       # clone/copy + install on all hosts
#   TPU=... ZONE=... bash launch/tpu_pod.sh run configs/gspo_paper.py:hf_path=/ckpt/Qwen3-0.6B,manual_dir=/data/gsm8k \
#     /mnt/shared/runs/gspo_qwen3 --config.rollout_batch_size=256
#   TPU=... ZONE=... bash launch/tpu_pod.sh logs        # tail the run's log on worker 0
#   TPU=... ZONE=... bash launch/tpu_pod.sh kill        # stop the run on all hosts
#
# The workdir must be one directory visible to every host (Filestore/NFS, or a gcsfuse mount
# of a bucket): orbax writes one checkpoint from all hosts; metrics are written by host 0. A killed or preempted run restarted with the
# same `run` command resumes from its latest checkpoint. The model directory and GSM8K files
# must exist on every host (e.g. copy them with `gcloud ... scp --worker=all` or mount them).
set -euo pipefail
: "${TPU:?set TPU to the TPU VM name}"
: "${ZONE:?set ZONE}"
PROJECT_FLAG=${PROJECT:+--project=$PROJECT}
REPO_DIR=${REPO_DIR:-gspo_jax}
LOG=${LOG:-/tmp/gspo_jax.log}

on_all() {
  # shellcheck disable=SC2086
  gcloud compute tpus tpu-vm ssh "$TPU" --zone="$ZONE" $PROJECT_FLAG --worker=all --command="$1"
}

case "${1:-}" in
  setup)
    here=$(cd "$(dirname "$0")/.." && pwd)
    # shellcheck disable=SC2086
    gcloud compute tpus tpu-vm scp --recurse "$here" "$TPU:~/$REPO_DIR" --zone="$ZONE" $PROJECT_FLAG --worker=all
    # TPU hosts need jax[tpu] instead of the CPU jaxlib pinned for laptops and CI.
    on_all "cd ~/$REPO_DIR && python3 -m venv .venv && . .venv/bin/activate && pip install -q -U pip && pip install -q -r requirements.txt && pip install -q 'jax[tpu]==0.10.2' && pip install -q --no-deps -e ."
    ;;
  run)
    config=${2:?config path (with :args)}
    workdir=${3:?workdir (a path shared by all hosts)}
    shift 3
    extra=$(printf ' %q' "$@")
    on_all "cd ~/$REPO_DIR && . .venv/bin/activate && nohup python -m gspo_jax.main --config=$config --workdir=$workdir --distributed $extra > $LOG 2>&1 &"
    echo "started on all workers; logs: bash launch/tpu_pod.sh logs"
    ;;
  logs)
    # shellcheck disable=SC2086
    gcloud compute tpus tpu-vm ssh "$TPU" --zone="$ZONE" $PROJECT_FLAG --worker=0 --command="tail -f $LOG"
    ;;
  kill)
    on_all "pkill -f gspo_jax.main || true"
    ;;
  *)
    echo "usage: TPU=... ZONE=... bash launch/tpu_pod.sh {setup|run CONFIG WORKDIR [--config.x=y ...]|logs|kill}" >&2
    exit 2
    ;;
esac
