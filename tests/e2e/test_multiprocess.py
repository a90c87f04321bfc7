"""Real multi-process JAX (the TPU-pod code path) on one CPU machine.

Two processes with 4 CPU devices each, gloo collectives and jax.distributed.initialize, run
the main entry point on the tiny config for 3 RL steps: each feeds its own rows of every
global prompt batch and they write one orbax checkpoint per step together. A copy of that
workdir without checkpoint 3 (and without step 3's metrics) is a run killed right after
saving step 2. Resumed by the same two processes, step 3 matches the uninterrupted run's;
resumed by one process with 8 devices and another mesh (fsdp 8 instead of data 8), it
matches within float rounding: the global prompt batch and the data position do not depend
on the process count, and orbax reshards the state into the new mesh.

The processes run `gspo_jax.main` with the test rewards registered: `test_checksum`, a
function of the response text that varies within a group even for a barely trained model, so
step 3 has non-zero advantages, loss and gradients to compare.
"""

import contextlib
import json
import os
import shutil
import subprocess
import time

import numpy as np
import pytest
from helpers import free_port, metrics_by_step, process_command, process_env


def _run_two_processes(workdir, data_dir, num_steps, *extra, timeout_s=600):
    """Both processes' output. If one fails, the other (blocked in a collective) is killed
    at once rather than at the timeout."""
    port = free_port()
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(open(f"{workdir}.process{i}.log", "w+")) for i in range(2)]
        procs = [
            subprocess.Popen(
                process_command(
                    workdir,
                    data_dir,
                    num_steps,
                    f"--coordinator=127.0.0.1:{port}",
                    "--num_processes=2",
                    f"--process_id={i}",
                    *extra,
                ),
                env=process_env(4),
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for i, log in enumerate(logs)
        ]
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):
            if any(p.returncode for p in procs) or time.monotonic() > deadline:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                break
            time.sleep(0.2)
        for p in procs:
            p.wait()
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i} of {workdir}: exit {p.returncode}\n{out[-4000:]}"
    return outputs


def _compare_step(got: dict, want: dict, **tolerance) -> dict[str, float]:
    """Assert every metric of a step but wall-time ones is close; return |differences|."""
    diffs = {}
    for key, value in want.items():
        if key.startswith(("time/", "perf/")):
            continue
        np.testing.assert_allclose(got[key], value, err_msg=key, **tolerance)
        diffs[key] = abs(got[key] - value)
    return diffs


def _killed_after_step_2(src, dst):
    """A copy of workdir `src` as a run killed right after saving RL step 2 would leave it."""
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "checkpoints" / "3")
    lines = (dst / "metrics.jsonl").read_text().splitlines(keepends=True)
    (dst / "metrics.jsonl").write_text("".join(x for x in lines if json.loads(x)["step"] <= 2))


@pytest.mark.slow
def test_two_processes_train_checkpoint_and_resume(tmp_path):
    data_dir = tmp_path / "data"
    ref, resumed, moved = tmp_path / "ref", tmp_path / "resumed", tmp_path / "one_process"
    regrouped = tmp_path / "rollout_mesh"
    _run_two_processes(ref, data_dir, 3)
    want = metrics_by_step(ref)[3]
    assert want["policy/optimizer_step"] == 6  # 3 RL steps x 2 mini-batches
    assert want["policy/grad_norm"] > 0 and want["reward/std"] > 0  # a step worth comparing
    _killed_after_step_2(ref, resumed)
    _killed_after_step_2(ref, moved)
    _killed_after_step_2(ref, regrouped)

    outputs = _run_two_processes(resumed, data_dir, 3)
    assert "starting at RL step 2 from checkpoint 2" in outputs[0]
    assert max(int(d) for d in os.listdir(resumed / "checkpoints") if d.isdigit()) == 3
    _compare_step(metrics_by_step(resumed)[3], want, rtol=1e-5, atol=1e-7)

    # One process x 8 devices, FSDP over all of them instead of data parallelism.
    mesh = ["--config.mesh.data=1", "--config.mesh.fsdp=-1"]
    proc = subprocess.run(
        process_command(moved, data_dir, 3, *mesh),
        env=process_env(8),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "process 0/1, 8 local / 8 global devices" in proc.stderr
    assert "starting at RL step 2 from checkpoint 2" in proc.stderr
    # Another mesh adds float rounding: the tolerance of tests/e2e/test_mesh_equality.py.
    diffs = _compare_step(metrics_by_step(moved)[3], want, rtol=1e-5, atol=1e-5)
    print({k: f"{v:.1e}" for k, v in sorted(diffs.items(), key=lambda kv: -kv[1])[:8]})

    # The same two processes with a rollout mesh of their own (tensor groups of 2 within each
    # process's 4 devices): each process's prompts are sampled on its own replicas and come
    # back to it, so step 3's rewards, advantages and update match the trainer-mesh rollout.
    _run_two_processes(regrouped, data_dir, 3, "--config.sampling.rollout_mesh.tensor=2")
    _compare_step(metrics_by_step(regrouped)[3], want, rtol=1e-5, atol=1e-5)
