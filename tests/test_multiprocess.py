"""Real multi-process JAX (the TPU-pod code path) on one CPU machine.

Two processes with 4 CPU devices each, gloo collectives and jax.distributed.initialize, run
the main entry point on the tiny config: each reads its own prompt shard, they share one
orbax checkpoint, and a run stopped after step 2 and restarted matches the uninterrupted
two-process run at step 3.
"""

import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from tiny_flags import TINY_MODEL, metrics_by_step

TINY = [
    *TINY_MODEL,
    "--config.rollout_batch_size=8",  # 8 prompts: 4 per process, split over 8 devices
    "--config.num_return_sequences_in_group=2",
    "--config.num_mini_batches=2",
    "--config.eval.num_prompts=16",
    "--config.eval.batch_size=8",
    "--config.eval.every_steps=0",
    "--config.checkpoint.export_hf=false",
    "--config.reward.num_workers=0",
    "--config.log.plot=false",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_processes(workdir, data_dir, num_steps):
    port = _free_port()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    env["JAX_PLATFORMS"] = "cpu"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gspo_jax.main",
                "--config=configs/default.py",
                f"--workdir={workdir}",
                f"--config.data.data_dir={data_dir}",
                f"--config.num_steps={num_steps}",
                *TINY,
                f"--coordinator=127.0.0.1:{port}",
                "--num_processes=2",
                f"--process_id={i}",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-4000:]
    return outputs


@pytest.mark.slow
def test_two_processes_train_checkpoint_and_resume(tmp_path):
    data_dir = tmp_path / "data"
    ref, resumed = tmp_path / "ref", tmp_path / "resumed"
    _run_two_processes(ref, data_dir, 3)
    _run_two_processes(resumed, data_dir, 2)
    outputs = _run_two_processes(resumed, data_dir, 3)
    assert "starting at RL step 2 from checkpoint 2" in outputs[0]
    assert max(int(d) for d in os.listdir(resumed / "checkpoints") if d.isdigit()) == 3
    got, want = metrics_by_step(resumed)[3], metrics_by_step(ref)[3]
    assert want["policy/optimizer_step"] == 6  # 3 RL steps x 2 mini-batches
    for key, value in want.items():
        if key.startswith(("time/", "perf/")):
            continue
        np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-7, err_msg=key)
