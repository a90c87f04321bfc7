"""Entry point: flags -> (distributed JAX) -> train.run(config, workdir).

  python -m gspo_jax.main --config=configs/default.py --workdir=/tmp/run [--config.x=y ...]

The config file is locked: an unknown `--config.foo=` is an error. On a TPU pod every host
runs this same command (launch/tpu_pod.sh); `--distributed` (default: on when the TPU or
cluster environment says there are several processes) calls jax.distributed.initialize().
For multi-process runs on one CPU machine (tests), pass --coordinator, --num_processes and
--process_id explicitly.
"""

from __future__ import annotations

import logging
import os

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/default.py", "Experiment config file.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics, plots.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator", None, "host:port of process 0 (explicit multi-process set-up)."
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of JAX processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
log = logging.getLogger("gspo_jax.main")

_DISTRIBUTED = flags.DEFINE_bool(
    "distributed",
    None,
    "Call jax.distributed.initialize() (default: auto-detect a TPU pod / SLURM cluster).",
)


def _init_distributed() -> None:
    import jax

    if _COORDINATOR.value:
        # CPU processes need gloo for cross-process collectives (it only affects the CPU
        # backend). Querying the backend here would initialise it too early.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=_COORDINATOR.value,
            num_processes=_NUM_PROCESSES.value,
            process_id=_PROCESS_ID.value,
        )
        return
    wanted = _DISTRIBUTED.value
    if wanted is None:  # a multi-host TPU slice or a SLURM job sets these
        wanted = bool(os.environ.get("TPU_WORKER_HOSTNAMES") or os.environ.get("SLURM_NTASKS"))
    if wanted:
        jax.distributed.initialize()


def main(argv) -> None:
    del argv
    if not _WORKDIR.value:
        raise app.UsageError("--workdir is required")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    # Orbax and TFDS log every file they touch at INFO through absl; keep ours readable.
    logging.getLogger("absl").setLevel(logging.WARNING)
    _init_distributed()
    import jax

    from gspo_jax import train

    log.info(
        "JAX %s: process %d/%d, %d local / %d global devices (%s)",
        jax.__version__,
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
        jax.devices()[0].platform,
    )
    summary = train.run(_CONFIG.value, _WORKDIR.value)
    if jax.process_index() == 0:
        log.info("done: %s", summary)


if __name__ == "__main__":
    app.run(main)
