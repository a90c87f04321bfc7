"""What happens when... (docs/failures.md): signals, verifiers that always fail, bad weights,
and the entry point's one-line errors. The end-to-end ones run `python -m gspo_jax.main`
on the tiny model of tests/helpers.py."""

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import (
    TINY_RUN,
    fill_disk,
    main_command,
    metrics_by_step,
    small_tmpfs,
    steps_written,
    tiny_config,
)

from gspo_jax.config.validate import ConfigError
from gspo_jax.rewards import build_reward
from gspo_jax.rollout import stage as rollout
from gspo_jax.trainer import loop

# ----------------------------------------------------------------------------- signals


def test_first_signal_asks_to_stop_the_second_stops_at_once():
    from gspo_jax.trainer import preemption

    previous = signal.getsignal(signal.SIGTERM)
    previous_int = signal.getsignal(signal.SIGINT)  # SIG_IGN in a pytest-xdist worker
    with preemption.StopOnSignal() as stop:
        assert stop.requested() == 0
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # the handler runs between bytecodes of the main thread
        assert stop.requested() == signal.SIGTERM  # noted, nothing raised
        with pytest.raises(SystemExit) as exit_:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        assert exit_.value.code == 143
    assert signal.getsignal(signal.SIGTERM) == previous
    with preemption.StopOnSignal() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
        assert stop.requested() == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    assert signal.getsignal(signal.SIGINT) == previous_int  # the handlers are restored


@pytest.mark.parametrize("name", ["SIGHUP", "SIGUSR1", "SIGUSR2", "SIGXCPU"])
def test_every_signal_that_ends_a_job_asks_to_stop_at_the_step_boundary(name):
    """A dropped SSH connection (SIGHUP), Slurm's --signal warning (SIGUSR1 / SIGUSR2) and a
    CPU-time limit (SIGXCPU) used to kill the run at once, losing every step since the last
    checkpoint. Now each is handled like SIGTERM: noted, then a second one exits 128+N."""
    from gspo_jax.rewards import pool
    from gspo_jax.trainer import preemption

    sig = signal.Signals[name]
    assert sig in preemption.SIGNALS  # else the kill below would end this test process
    assert set(pool.WORKER_IGNORED_SIGNALS) == set(preemption.SIGNALS)
    previous = signal.getsignal(sig)
    with preemption.StopOnSignal() as stop:
        os.kill(os.getpid(), sig)
        time.sleep(0.01)
        assert stop.requested() == sig
        with pytest.raises(SystemExit) as exit_:
            os.kill(os.getpid(), sig)
            time.sleep(1)
        assert exit_.value.code == 128 + sig == preemption.exit_status(sig)
    assert signal.getsignal(sig) == previous


# ---------------------------------------------------------------------------- verifiers


def test_a_verifier_that_always_raises_stops_the_run_with_its_error(caplog):
    """It used to score 0 everywhere, train nothing and exit 0, the exception logged nowhere.
    Now each distinct message is logged once, and `max_failed_batches` batches in a row with
    every call failed stop the run quoting it (batches with a success reset the count)."""
    import gspo_jax.rewards.testing  # noqa: F401  (registers test_raise / test_chaos)
    from gspo_jax.rewards import RewardError

    scorer = rollout.Scorer(build_reward("test_chaos"), "mask", max_failed_batches=2)
    args = ([""] * 3, [""] * 3)
    with caplog.at_level(logging.WARNING, logger="gspo_jax.rewards.scoring"):
        scorer.score(args[0], ["raise", "nan", "str"], args[1])  # all failed: 1 in a row
        _, valid, _ = scorer.score(args[0], ["ok:1", "raise", "nan"], args[1])  # resets
        np.testing.assert_array_equal(valid, [True, False, False])
        scorer.score(args[0], ["raise", "raise", "nan"], args[1])  # 1 in a row
        with pytest.raises(
            RewardError, match=r"every response of 2 batch\(es\) in a row.*deliberate failure"
        ):
            scorer.score(args[0], ["raise", "raise", "raise"], args[1])
    logged = [r.getMessage() for r in caplog.records if "test_chaos" in r.getMessage()]
    assert sum("RuntimeError: deliberate failure" in m for m in logged) == 1, logged
    assert sum("non-finite" in m for m in logged) == 1, logged
    assert sum("non-numeric" in m for m in logged) == 1, logged
    never = rollout.Scorer(build_reward("test_raise"), "zero")  # the accuracy scorer's setting
    for _ in range(3):
        never.score(args[0], ["a", "b", "c"], args[1])


# ------------------------------------------------------------------ weights and tokens


def test_nan_weights_in_a_hugging_face_checkpoint_are_named(tmp_path):
    """NaN weights: NaN losses, every update skipped, exit 0 (before)."""
    from safetensors.numpy import load_file, save_file

    src = "tests/fixtures/models/qwen3"
    ckpt = tmp_path / "qwen3_nan"
    shutil.copytree(src, ckpt)
    shard = min(ckpt.glob("model-*.safetensors"))
    tensors = load_file(shard)
    name = min(tensors)
    tensors[name] = tensors[name].copy()
    tensors[name].flat[0] = np.nan
    save_file(tensors, shard)
    manual = tmp_path / "gsm8k"
    manual.mkdir()
    for split in ("train", "test"):
        (manual / f"{split}.jsonl").write_text(
            json.dumps({"question": "1 + 1?", "answer": "#### 2"}) + "\n"
        )
    from configs import gspo_paper

    c = gspo_paper.get_config(f"hf_path={ckpt},manual_dir={manual}")
    c.model.tokenizer_path = "tests/fixtures/models/tokenizer"
    c.model.dtype, c.model.remat = "float32", "none"
    c.data.data_dir = str(tmp_path / "data")
    c.rollout_batch_size, c.num_return_sequences_in_group = 4, 2
    c.num_mini_batches, c.micro_batch_size = 1, None
    c.prompt_length, c.response_length = 192, 6
    c.sampling.prompt_buckets = (192,)
    c.reward.num_workers = 0
    c.log.progress_bar = c.log.plot = c.log.tensorboard = False
    with pytest.raises(ValueError, match=r"Hugging Face checkpoint .*qwen3_nan holds NaN or inf"):
        loop.run(c, str(tmp_path / "run"))


def test_a_tokenizer_larger_than_the_model_stops_before_the_data(tmp_path):
    from gspo_jax import data

    tokenizer = data.make_char_tokenizer(tmp_path / "tok")
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(200)])
    tokenizer.save_pretrained(tmp_path / "tok")
    c = tiny_config(tmp_path / "data")
    c.model.hf_path = "tests/fixtures/models/qwen3"
    c.model.tokenizer_path = str(tmp_path / "tok")
    c.warm_start.steps = 0
    with pytest.raises(ConfigError, match=r"token ids up to 299.*vocab_size=256"):
        loop.run(c, str(tmp_path / "run"))
    assert not (tmp_path / "data").exists()  # stopped before the dataset was built


# ------------------------------------------------------------------ the entry point


def _main(workdir, *flags, config="configs/default.py", timeout=300):
    return subprocess.run(
        main_command(workdir, *flags, config=config),
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _error_line(proc) -> str:
    lines = [x for x in proc.stderr.splitlines() if x.startswith("gspo_jax: error: ")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


CONFIG_WITH_A_REWARD = """
from configs import default
from gspo_jax.rewards import register_reward


@register_reward("reward_in_a_config_file")
def reward(prompt, completion, reference):
    return 1.0


def get_config(arg=None):
    c = default.get_config()
    c.reward.spec = "reward_in_a_config_file"
    return c
"""


@pytest.mark.parametrize(
    "case",
    [
        "nan_lr",
        "missing_config",
        "config_argument",
        "workdir_is_a_file",
        "checkpoints_is_a_file",
        "cfg_reward",
    ],
)
def test_start_up_errors_are_one_line_and_early(tmp_path, case):
    """Each used to print a 26-55 line traceback, a misleading message, fail late, or (the
    checkpoint directory) hang after the error. Now: one line naming the field / file, the
    exit status, before any data, model or compile work."""
    workdir, flags, config, status = tmp_path / "run", [], "configs/default.py", 2
    if case == "nan_lr":
        flags, want = ["--config.optim.learning_rate=nan"], r"config.optim.learning_rate=nan must"
    elif case == "missing_config":  # with an override, which used to fail at the override
        config, flags = "configs/no_such_config.py", ["--config.num_steps=3"]
        want = r"--config=configs/no_such_config.py: no such file"
    elif case == "config_argument":
        config = "configs/gspo_paper.py:hf_path=/ckpt"
        want = r"--config=configs/gspo_paper.py:hf_path=/ckpt: .*ValueError: .*needs manual_dir"
    elif case == "workdir_is_a_file":
        workdir.write_text("")
        status, want = 1, rf"--workdir {workdir} is a file, not a directory"
    elif case == "checkpoints_is_a_file":
        workdir.mkdir()
        (workdir / "checkpoints").write_text("")
        status, want = 1, rf"checkpoint directory {workdir}/checkpoints is a file"
    else:
        config = tmp_path / "cfg.py"
        config.write_text(CONFIG_WITH_A_REWARD)
        want = r"reward 'reward_in_a_config_file' is registered in module 'config_config'"
    start = time.monotonic()
    proc = _main(workdir, *flags, config=str(config), timeout=120)
    assert proc.returncode == status, proc.stderr[-3000:]
    assert re.search(want, _error_line(proc)), proc.stderr[-2000:]
    assert time.monotonic() - start < 60
    if workdir.is_dir():  # nothing was prepared
        assert not (workdir / "data").exists() and not (workdir / "tokenizer").exists()


def test_a_thread_left_running_cannot_keep_the_process_alive():
    """The entry point's last resort against hangs at exit (the orbax hang was one)."""
    code = (
        "import threading, time\n"
        "from gspo_jax import main\n"
        "main.SHUTDOWN_GRACE_S = 1.0\n"
        "threading.Thread(target=time.sleep, args=(600,)).start()  # not a daemon\n"
        "main._exit(3)\n"
    )
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 3 and time.monotonic() - start < 30
    assert "still shutting down after 1 s" in proc.stderr


SIGNAL_RUN = [
    *TINY_RUN,
    "--config.num_steps=200",  # far more than it will run
    "--config.checkpoint.every_steps=0",
    "--config.eval.every_steps=0",
    "--config.reward.num_workers=0",
    "--config.log.tensorboard=false",
    "--config.log.plot=false",
]


def test_a_hangup_to_the_process_group_checkpoints_the_step_and_the_same_command_resumes(
    tmp_path,
):
    """A signal that ends a job used to kill the run at once: every step since the last
    periodic checkpoint was lost (here: all of them, checkpoint.every_steps=0). A dropped SSH
    connection sends SIGHUP to the session's whole process group (the trainer and its
    verifier workers, which ignore it): the step boundary, a checkpoint, one line, 128 + 1,
    and the same command resumes. (SIGTERM / SIGINT and the other job-ending signals take the
    same path: the in-process tests above; SIGTERM end to end: test_multiprocess_preemption.)"""
    workdir, data_dir = tmp_path / "run", tmp_path / "data"
    cmd = main_command(
        workdir,
        f"--config.data.data_dir={data_dir}",
        *SIGNAL_RUN,
        "--config.reward.num_workers=1",  # a worker process in the group
    )
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:  # wait for RL step 3
            if steps_written(workdir) >= 2:
                break
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGHUP)
        out = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    assert proc.returncode == 129, out[-3000:]
    steps = sorted(int(d) for d in os.listdir(workdir / "checkpoints") if d.isdigit())
    stopped = steps[-1]
    assert stopped >= 3 and f"SIGHUP: stopped after RL step {stopped}" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert sorted(metrics_by_step(workdir)) == list(range(stopped + 1))
    assert not (workdir / "hf").exists()  # not finished: no export
    resumed = subprocess.run(
        [*cmd, f"--config.num_steps={stopped + 2}"],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"starting at RL step {stopped} from checkpoint {stopped}" in resumed.stderr
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == list(range(stopped + 3))  # one row each
    assert (workdir / "hf" / "model.safetensors").exists()


def test_a_second_run_on_a_held_workdir_refuses_in_seconds_naming_the_holder(tmp_path):
    """Two runs on one workdir both used to run to the end (exit 0), writing every metrics
    row twice and the same checkpoints. Now the second stops before any work, exit 1."""
    workdir = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time\n"
                "from gspo_jax.trainer.io import workdir\n"
                f"held = workdir.lock({str(workdir)!r})\n"
                "print('held', flush=True)\n"
                "time.sleep(600)\n"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        workdir.mkdir()
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        proc = _main(workdir, *SIGNAL_RUN, timeout=120)
        took = time.monotonic() - start
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = _error_line(proc)
    assert re.search(
        rf"--workdir {workdir} is in use by another run: pid {holder.pid} on host \S+, "
        r"started \S+ \(.*-c\)",
        line,
    ), line
    assert took < 60 and not (workdir / "data").exists() and not (workdir / "config.json").exists()


def test_a_full_disk_mid_run_ends_with_one_line_and_the_same_command_resumes(tmp_path):
    """A disk that filled during an asynchronous checkpoint save printed ~240 lines of
    tracebacks, then left the run idle for minutes without an error line. Now one line
    names the directory and the cause, exit 1, within seconds; the checkpoints before it
    restore (the same command resumes once there is room). A real tmpfs: root only."""
    with small_tmpfs(tmp_path / "small", "4m") as mount:
        workdir = mount / "run"
        cmd = main_command(
            workdir,
            f"--config.data.data_dir={tmp_path / 'data'}",
            *SIGNAL_RUN,
            "--config.checkpoint.every_steps=1",
        )
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 300
            ckpt = workdir / "checkpoints"
            while time.monotonic() < deadline and proc.poll() is None:
                if ckpt.is_dir() and any(d.isdigit() and int(d) >= 1 for d in os.listdir(ckpt)):
                    break
                time.sleep(0.2)
            filled = time.monotonic()
            fill_disk(mount)
            err = proc.communicate(timeout=120)[1]
            took = time.monotonic() - filled
        finally:
            proc.kill()
        assert proc.returncode == 1, err[-3000:]
        lines = [x for x in err.splitlines() if x.startswith("gspo_jax:")]
        assert len(lines) == 1, err[-3000:]
        assert "No space left on device" in lines[0] and str(workdir) in lines[0], lines[0]
        assert "Traceback" not in err and "Event loop is closed" not in err, err[-3000:]
        assert took < 60, took  # a step or two, then the error: no hang
        saved = max(int(d) for d in os.listdir(ckpt) if d.isdigit())
        os.remove(mount / "filler")
        # Up to the newest checkpoint: restored (digests checked), no step to compile.
        resumed = subprocess.run(
            [*cmd, f"--config.num_steps={saved}", "--config.checkpoint.export_hf=false"],
            check=False,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert f"starting at RL step {saved} from checkpoint {saved}" in resumed.stderr
