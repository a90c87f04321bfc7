"""The pod launcher's default LIBTPU_INIT_ARGS are flags the pinned libtpu knows.

libtpu aborts at start-up on a flag it does not know ("Unknown command line flag"), so a
stale flag would stop every host of a pod run before the first step. Here libtpu's
compile-only client is created with the flags (a TPU topology described on this CPU): the
launcher's default flags pass, and a made-up flag fails the same way (the control)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIBTPU_DIR = ROOT / ".libtpu"
# Creating the topology initialises libtpu, which parses LIBTPU_INIT_ARGS.
PROBE = (
    "from jax.experimental import topologies; "
    "topologies.get_topology_desc(platform='tpu', topology_name='v5e:2x2'); print('ok')"
)


def _launcher():
    spec = importlib.util.spec_from_file_location("tpu_pod", ROOT / "launch" / "tpu_pod.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _probe(flags: str) -> subprocess.CompletedProcess:
    if not LIBTPU_DIR.is_dir():
        message = "libtpu is not installed in .libtpu (pip install -r requirements-tpu.txt)"
        if os.environ.get("GSPO_REQUIRE_LIBTPU") == "1":
            pytest.fail(message)
        pytest.skip(message)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(
        PYTHONPATH=str(LIBTPU_DIR), LIBTPU_INIT_ARGS=flags, TPU_ACCELERATOR_TYPE="v5litepod-4"
    )
    return subprocess.run(
        [sys.executable, "-c", PROBE],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_the_launchers_default_flags_are_known_to_the_pinned_libtpu():
    out = _probe(_launcher().DEFAULT_LIBTPU_INIT_ARGS)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_an_unknown_flag_stops_libtpu():
    out = _probe("--xla_tpu_no_such_flag_in_any_libtpu=true")
    assert out.returncode != 0
    assert "xla_tpu_no_such_flag_in_any_libtpu" in out.stderr
