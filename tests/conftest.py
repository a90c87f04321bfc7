"""Test set-up: 8 fake CPU devices so sharding tests run anywhere (costs nothing), CPU
programs compiled at LLVM -O0 (helpers.CPU_TEST_FLAGS), one XLA compilation cache shared
by every process of this test run, and the longest test files first (LONGEST_FIRST).

The cache: most of the suite's time is XLA compiling the same tiny programs again in other
processes (the end-to-end tests run `python -m gspo_jax.main` and notebooks in subprocesses,
two pytest-xdist workers, two-process JAX runs). JAX's persistent compilation cache, in a
fresh temporary directory made by the first process of the run (the xdist controller) and
inherited by the workers and every subprocess through the environment, compiles each program
once per run. The directory is removed when that process exits: never shared across runs, so
a stale entry cannot hide a bug. Keys hold the program, the backend and the compile options;
not its source locations (JAX's default: a test process calls `loop.run` from another stack
than `gspo_jax.main` does, and would otherwise miss every entry), so an executable read back
may carry another process's line numbers in its HLO metadata (op names are the same: the same
code). A size limit turns on JAX's file lock, so that no reader sees a half-written entry.
`GSPO_TESTS_XLA_CACHE=off` runs without it (every process compiles everything).
"""

import atexit
import glob
import os
import shutil
import tempfile

import pytest
from helpers import CPU_TEST_FLAGS

os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {CPU_TEST_FLAGS}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TFDS_DISABLE_GCS", "1")


_PREFIX = "gspo_jax_tests_xla_cache_"


def _remove_orphans() -> None:
    """Delete the caches of earlier runs whose process is gone without its atexit (killed by
    a signal, e.g. `timeout`): the directory name holds the pid of the run that made it."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{_PREFIX}*_*")):
        pid = os.path.basename(path)[len(_PREFIX) :].split("_")[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:  # alive, another user's
            pass


# Only programs that took at least this long to compile are written to the cache. Writing
# costs more than compiling for the thousands of one-op programs that eager jax.numpy calls in
# the unit tests compile (each write takes the cache's file lock): tests/algorithm's files ran
# faster without them (test_objectives.py alone: 37 s with every program cached, 26.5-26.9 s
# with a threshold of 0.3-1 s, 25.7 s with no cache at all; the whole suite 22 min 49 s ->
# 15 min 35 s at 0.5 s). The programs worth sharing between processes (a train step, a
# sampler, a model's forward) take seconds. `GSPO_TESTS_MIN_COMPILE_S` overrides it.
MIN_COMPILE_S = float(os.environ.get("GSPO_TESTS_MIN_COMPILE_S", "0.5"))


def _share_compilation_cache() -> None:
    """Point this process and its children at the run's cache (made here if not yet)."""
    cache = os.environ.get("GSPO_TESTS_XLA_CACHE", "")
    if cache == "off":
        os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
        return
    if not cache:  # the run's first process: a fresh directory, removed when it exits
        _remove_orphans()
        cache = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}_")
        os.environ["GSPO_TESTS_XLA_CACHE"] = cache
        atexit.register(shutil.rmtree, cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = str(MIN_COMPILE_S)
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(16 * 2**30)  # > 0: locked reads/writes


_share_compilation_cache()


# The files that take longest, longest first (seconds of one worker, measured with
# `--durations=0` in a full `-n 2 --dist loadfile` run on the 2-core VM, idle, 2026-12-06:
# their order is what counts, not the sizes). Run first (launch/test.sh passes
# --no-loadscope-reorder, so xdist hands files out in this order rather than by how many
# tests they hold): one of these coming last left one worker alone with it for minutes.
# Every other file keeps its place after them.
LONGEST_FIRST = (
    "test_multiprocess.py",  # 101
    "test_aot.py",  # 87
    "test_family_presets.py",  # 84
    "test_user_code.py",  # 71
    "test_checkpoint.py",  # 71
    "test_benchmarks.py",  # 69
    "test_rollout_layout.py",  # 65
    "test_packing.py",  # 63
    "test_mesh_equality.py",  # 62
    "test_failures.py",  # 58
    "test_lora_learns.py",  # 57
    "test_multiprocess_preemption.py",  # 52
    "test_train.py",  # 52
    "test_loop.py",  # 51
    "test_experiment.py",  # 48
    "test_notebooks.py",  # 47
    "test_qwen35.py",  # 41
    "test_train_step.py",  # 40
    "test_objectives.py",  # 37
    "test_routing_replay.py",  # 34
    "test_models_params.py",  # 34
    "test_loss_modes.py",  # 33
    "test_noise_length.py",  # 28
    "test_sampling_continuous.py",  # 27
    "test_outcomes.py",  # 26
    "test_your_task.py",  # 25
)


_TESTS = os.path.dirname(__file__)
_FILES = {
    os.path.basename(f) for f in glob.glob(os.path.join(_TESTS, "**", "test_*.py"), recursive=True)
}
_missing = [f for f in LONGEST_FIRST if f not in _FILES]
assert not _missing, f"conftest.LONGEST_FIRST names files that do not exist: {_missing}"

# The tiers (docs/tests.md). `bash launch/test.sh --fast` runs `-m "not e2e and not slow"`:
# e2e is every test under tests/e2e/ (whole runs: `python -m gspo_jax.main`, several
# processes, notebooks, meshes); slow is a test marked so in its file, or one named here
# because it took more than SLOW_S seconds of one worker in the measured full run (its
# compiles, not its logic: a whole train step, a model through the sampler). Everything
# else is the fast tier. CI runs every tier.
SLOW_S = 3.0


def _slow_tests() -> frozenset[str]:
    path = os.path.join(_TESTS, "slow_tests.txt")
    with open(path, encoding="utf-8") as f:
        return frozenset(line.rsplit(None, 1)[0] for line in f if line.strip() and line[0] != "#")


SLOW = _slow_tests()


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order kept
    e2e = os.path.join(_TESTS, "e2e") + os.sep
    for item in items:
        if str(item.path).startswith(e2e):
            item.add_marker(pytest.mark.e2e)
        if item.nodeid in SLOW:
            item.add_marker(pytest.mark.slow)
    ids = {item.nodeid for item in items}
    # files collected whole (a test named on the command line, file::test, leaves the rest out)
    partial = {os.path.normpath(a.split("::")[0]) for a in config.args if "::" in a}
    files = {n.split("::")[0] for n in ids if os.path.normpath(n.split("::")[0]) not in partial}
    stale = sorted(s for s in SLOW if s.split("::")[0] in files and s not in ids)
    assert not stale, f"tests/slow_tests.txt names tests that do not exist: {stale}"
