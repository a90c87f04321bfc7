"""Shared by the end-to-end tests: the `python -m gspo_jax.main` command line, flags
shrinking configs/default.py to a 2-layer d=32 model, and the reader of a run's
metrics.jsonl, and a small filesystem to fill."""

import contextlib
import errno
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

# XLA flags of every CPU test process (conftest.py; the two-process runs). The tests' programs
# are tiny, so compiling them is most of the suite's time:
# - LLVM at -O0 (tests/models/test_models_params.py: 56 s -> 37 s);
# - the CPU backend's older elemental emitters instead of its fusion emitters (one train step
#   of the Qwen3 fixture, 2 mini-batches: XLA compile 27-33 s -> 9-13 s on the 2-core VM at
#   load ~13, the tracing's 5-7 s unchanged).
# The floats differ from the default build's in the last bits only, as between two CPU types,
# which every tolerance here already allows: a 6-step tiny run through `gspo_jax.main` at -O0
# logged the same rewards, clipped fractions and policy loss; 9 of its 307 metrics differed,
# e.g. entropy 4.5958438 vs 4.5958433.
CPU_TEST_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def main_command(workdir, *flags, config="configs/default.py") -> list[str]:
    """argv of `python -m gspo_jax.main --config=CONFIG --workdir=WORKDIR FLAGS...`."""
    return [
        sys.executable,
        "-m",
        "gspo_jax.main",
        f"--config={config}",
        f"--workdir={workdir}",
        *flags,
    ]


TINY_MODEL = [
    "--config.response_length=12",
    "--config.model.hidden_size=32",
    "--config.model.intermediate_size=64",
    "--config.model.num_layers=2",
    "--config.model.num_heads=2",
    "--config.model.num_kv_heads=1",
    "--config.model.head_dim=16",
    "--config.warm_start.steps=3",
    "--config.warm_start.target_accuracy=0",  # exactly 3 steps, not to default.py's target
    "--config.warm_start.batch_size=16",
    "--config.checkpoint.every_steps=1",
    "--config.log.progress_bar=false",
]


def metrics_by_step(workdir) -> dict[int, dict]:
    """metrics.jsonl of a run as {step: merged row} (a step may span several lines)."""
    rows = {}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            rows.setdefault(row["step"], {}).update(row)
    return rows


def steps_written(workdir) -> int:
    """The newest step of a run's metrics.jsonl that is completely written, -1 if none: safe
    to call while the run (another process) is still writing the file. A line counts once
    its newline is there; the file may not exist yet, or be empty."""
    try:
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            text = f.read()
    except FileNotFoundError:
        return -1
    complete = text[: text.rfind("\n") + 1].splitlines()  # a line still being written waits
    return max((json.loads(line)["step"] for line in complete if line.strip()), default=-1)


@contextlib.contextmanager
def small_tmpfs(directory, size: str):
    """A tmpfs of `size` (e.g. "4m") mounted at `directory` for the block, unmounted after:
    a real filesystem to fill. Root only: the test is skipped where mount is not permitted."""
    directory = Path(directory)
    directory.mkdir()
    tried = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
        check=False,
        capture_output=True,
        text=True,
    )
    if tried.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {tried.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


def fill_disk(directory) -> None:
    """Fill the filesystem holding `directory` to the last byte (a file named `filler`)."""
    fd = os.open(os.path.join(directory, "filler"), os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"x" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)


def apply_flags(config, flags) -> None:
    """Set `--config.a.b=value` flags on a ConfigDict in place, parsed to each field's type
    (as the command line would)."""
    for flag in flags:
        key, value = flag[len("--config.") :].split("=")
        node = config
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        current = node[leaf]
        node[leaf] = value.lower() == "true" if isinstance(current, bool) else type(current)(value)


# The tiny end-to-end run: the tiny model, 4 RL steps of 4 prompts x 4 responses.
TINY_RUN = [
    *TINY_MODEL,
    "--config.num_steps=4",
    "--config.rollout_batch_size=4",
    "--config.num_return_sequences_in_group=4",
    "--config.num_mini_batches=2",
    "--config.eval.num_prompts=8",
    "--config.eval.batch_size=8",
    "--config.eval.every_steps=2",
    "--config.reward.num_workers=1",
]


def tiny_config(data_dir):
    """configs/default.py with TINY_RUN applied, its data in `data_dir`."""
    from configs import default

    c = default.get_config()
    apply_flags(c, TINY_RUN)
    c.data.data_dir = str(data_dir)
    return c


# The tiny run of the multi-process tests (two processes x 4 CPU devices).
TWO_PROCESS_RUN = [
    *TINY_MODEL,
    "--config.rollout_batch_size=8",  # 8 prompts: 4 per process, split over 8 devices
    "--config.num_return_sequences_in_group=2",
    "--config.num_mini_batches=2",
    "--config.reward.spec=test_checksum",
    "--config.eval.num_prompts=16",
    "--config.eval.batch_size=8",
    "--config.eval.every_steps=0",
    "--config.checkpoint.export_hf=false",
    "--config.reward.num_workers=0",
    "--config.log.plot=false",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# `python -m gspo_jax.main`, after importing the module that registers the test rewards.
MAIN = (
    "import runpy, gspo_jax.rewards.testing; runpy.run_module('gspo_jax.main', run_name='__main__')"
)


def process_command(workdir, data_dir, num_steps, *extra, flags=TWO_PROCESS_RUN):
    """`python -m gspo_jax.main` (with the test rewards registered) for one process of a
    multi-process run, on the default config with `flags`."""
    return [
        sys.executable,
        "-c",
        MAIN,
        "--config=configs/default.py",
        f"--workdir={workdir}",
        f"--config.data.data_dir={data_dir}",
        f"--config.num_steps={num_steps}",
        *flags,
        *extra,
    ]


def process_env(num_devices: int) -> dict:
    """The environment of one JAX process with `num_devices` CPU devices."""
    devices = f"--xla_force_host_platform_device_count={num_devices}"
    env = dict(os.environ, XLA_FLAGS=f"{devices} {CPU_TEST_FLAGS}")
    env["JAX_PLATFORMS"] = "cpu"
    return env
