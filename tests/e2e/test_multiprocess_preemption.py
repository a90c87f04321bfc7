"""Preemption with real multi-process JAX: SIGTERM to ONE of two processes stops both after
the same RL step, with one checkpoint written together, and the same command resumes from
it (test_multiprocess.py checks that a two-process resume matches an uninterrupted run)."""

import os
import signal
import subprocess
import time

import pytest
from helpers import free_port, metrics_by_step, process_command, process_env, steps_written


def _start(workdir, data_dir, num_steps):
    """The two processes of test_multiprocess.py (its tiny flags and test rewards)."""
    port = free_port()
    return [
        subprocess.Popen(
            process_command(
                workdir,
                data_dir,
                num_steps,
                "--config.checkpoint.every_steps=0",
                f"--coordinator=127.0.0.1:{port}",
                "--num_processes=2",
                f"--process_id={i}",
            ),
            env=process_env(4),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]


def _finish(procs, status):
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == status, out[-4000:]
    return outputs


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_at_one_step_and_resumes(tmp_path):
    data_dir, resumed = tmp_path / "data", tmp_path / "resumed"
    procs = _start(resumed, data_dir, 100)
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and all(p.poll() is None for p in procs):
            if steps_written(resumed) >= 2:
                break
            time.sleep(0.1)
        procs[1].send_signal(signal.SIGTERM)  # process 0 is not signalled
        outputs = _finish(procs, 143)
    finally:
        for p in procs:
            p.kill()
    steps = sorted(int(d) for d in os.listdir(resumed / "checkpoints") if d.isdigit())
    stopped = steps[-1]
    assert stopped >= 3 and steps[:-1] == [0], steps  # 0: the warm start; then the signal's
    for out in outputs:  # both stopped after the same step
        assert f"SIGTERM: stopped after RL step {stopped}" in out, out[-3000:]
    outputs = _finish(_start(resumed, data_dir, stopped + 1), 0)
    assert f"starting at RL step {stopped} from checkpoint {stopped}" in outputs[0]
    rows = metrics_by_step(resumed)
    assert sorted(rows) == list(range(stopped + 2))
    assert rows[stopped + 1]["policy/optimizer_step"] == 2 * (stopped + 1)  # 2 mini-batches
