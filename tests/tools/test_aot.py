"""The TPU path, compiled without a TPU: `python -m tools.aot` on the tiny config.

- the whole RL step of configs/default.py (sampler prefill and decode, log-probs,
  advantages, train step) compiles for v5e:2x2 (4 chips) with the splash kernel, fits,
  and the command prints its table and exits 0, with a roofline estimate for every
  function (`--json`: model and executed FLOPs, HBM and wire bytes, seconds) whose passes,
  each counted once, add up to the RL step's total (tools/roofline.py);
- full remat raises the train step's executed FLOPs and leaves its model FLOPs alone;
- a configuration that does not fit (the einsum attention at a 32k-token response) exits
  1 with a message naming the function and the shortfall.

The command runs in a subprocess with libtpu importable (launch/test.sh installs it into
.libtpu/; any environment with `pip install -r requirements-tpu.txt` works too). Without
libtpu these tests skip, unless GSPO_REQUIRE_LIBTPU=1 (set by launch/test.sh, so CI fails
rather than skips).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIBTPU_DIR = ROOT / ".libtpu"
GiB = 2**30
TINY = ["--config=configs/default.py", "--topology=v5e:2x2", "--config.warm_start.steps=0"]


@pytest.fixture(scope="module")
def env():
    env = dict(os.environ)
    paths = [str(ROOT)] + ([str(LIBTPU_DIR)] if LIBTPU_DIR.is_dir() else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    env.pop("XLA_FLAGS", None)  # conftest's fake CPU devices are not needed here
    # Nor the run's shared compilation cache: these compiles are for a TPU (libtpu's
    # compile-only client), each done once, and the CPU processes' entries stay CPU-only.
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    found = subprocess.run([sys.executable, "-c", "import libtpu"], env=env, check=False)
    if found.returncode:
        message = "libtpu is not importable (pip install -r requirements-tpu.txt)"
        if os.environ.get("GSPO_REQUIRE_LIBTPU") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return env


def _python(env, *argv, timeout=1200):
    """`python ARGV...` in the repository root with libtpu importable."""
    return subprocess.run(
        [sys.executable, *argv],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _aot(env, tmp_path, *args):
    out = tmp_path / "reports.json"
    out.unlink(missing_ok=True)
    proc = _python(env, "-m", "tools.aot", *args, f"--json={out}")
    reports = json.loads(out.read_text()) if out.exists() else None
    return proc, reports


def test_tiny_rl_step_compiles_for_a_tpu_slice(env, tmp_path):
    proc, out = _aot(env, tmp_path, *TINY, "--hbm_top=3")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert out["chip"] == "TPU v5e"
    functions = out["functions"]
    names = list(functions)
    assert names == ["sampler prefill", "sampler decode", "logprobs", "advantages", "train step"]
    for name, f in functions.items():
        assert f["error"] is None and f["compile_s"] > 0, f
        assert 0 < f["memory"]["total"] < 16 * GiB, f  # a v5e chip
        lo, hi = f["est_seconds"]
        assert 0 < lo <= hi, (name, f["est_seconds"])
        assert lo >= f["executed_flops"] / 197e12  # never faster than the peak allows
    train = functions["train step"]
    assert train["memory"]["alias"] > 0  # the train state is donated
    assert train["model_flops"] > 0 and train["executed_flops"] > 0 and train["hbm_bytes"] > 0
    assert "attention splash" in proc.stdout and "| train step |" in proc.stdout
    assert "fits: peak" in proc.stdout
    # splash attention's FLOPs are added analytically (XLA reports none for the kernel)
    assert train["by_class"]["attention kernel"]["flops"] > 0
    # mesh data=4: the train step all-reduces its gradients across the 4 chips
    assert train["ici_wire_bytes"] > 0
    # the RL step: each pass once; the log-prob function is not called (no KL term, π_old
    # recomputed by the train step itself)
    assert functions["logprobs"]["calls_per_rl_step"] == 0
    rl = out["rl_step"]
    for i in (0, 1):
        total = sum(f["calls_per_rl_step"] * f["est_seconds"][i] for f in functions.values())
        assert rl["est_seconds"][i] == pytest.approx(total)
    assert 0 < rl["train_step_mfu"][0] <= rl["train_step_mfu"][1] < 1
    assert rl["train_step_hfu"][1] > rl["train_step_mfu"][1]  # remat, π_old pass, ...
    assert rl["decode_tokens_per_s_per_chip"][0] > 0
    assert "ESTIMATED" in proc.stdout and "train step (est.): MFU" in proc.stdout
    # --hbm_top=3: each function's three largest HBM contributors, printed and in the JSON
    for name, f in functions.items():
        uses = f["hbm_uses"]
        assert 1 <= len(uses) <= 3 and sum(
            u["bytes"] * u["count"] * u["instructions"] for u in uses
        )
        if name != "sampler decode":  # the engine's bytes are analytic (aot.py:
            # `_engine_ops`), its HLO uses count the kernel's whole page pools
            top = uses[0]["bytes"] * uses[0]["count"] * uses[0]["instructions"]
            assert top <= f["hbm_bytes"], f
        assert f"HBM traffic of {name}: " in proc.stdout
    assert re.search(
        r"HBM traffic of sampler decode: \S+ GB per chip per call, \S+ GB per token", proc.stdout
    )


def test_remat_raises_executed_flops_not_model_flops(env, tmp_path):
    """Full remat recomputes each layer's forward in the backward pass: more executed
    FLOPs (read from the compiled HLO), the same model FLOPs; neither estimate is below
    executed FLOPs at peak."""
    train = {}
    for remat in ("none", "full"):
        proc, out = _aot(
            env, tmp_path, *TINY, "--functions=train_step", f"--config.model.remat={remat}"
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        train[remat] = out["functions"]["train step"]
        assert out["rl_step"]["est_seconds"][0] >= train[remat]["executed_flops"] / 197e12
    assert train["full"]["model_flops"] == train["none"]["model_flops"]
    # the layers' matmuls run once more forward (and splash's forward once more)
    assert train["full"]["executed_flops"] > 1.1 * train["none"]["executed_flops"]


def test_a_config_that_does_not_fit_names_function_and_shortfall(env, tmp_path):
    proc, _ = _aot(
        env,
        tmp_path,
        *TINY,
        "--functions=logprobs",
        "--config.model.attention_impl=xla",
        "--config.response_length=32768",
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "DOES NOT FIT: logprobs needs" in proc.stderr and "GiB short" in proc.stderr


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_the_tensor_layout_decode_keeps_its_page_pools_in_place(env, kv_dtype):
    """The continuous engine with the Pallas kernel, compiled for 8 v5e chips in the tensor
    rollout layout (one kv head per chip): its temporaries are the page pools and little
    else. Page copies written as whole pages made XLA keep two more copies of every pool
    (out of the kernel's layout and back, each decode step: 0.38 GiB here, not 0.17).
    int8 pages (pages of 128 tokens) go to our own kernel (`models.paged_int8_kernel`), no
    dequantised pool: an indexed token write into the head-major layout made XLA copy every
    pool twice per step (Qwen3-0.6B on v5e-8: 14.9 GiB of decode temporaries, not 3.9)."""
    int8 = ["--kv-dtype=int8", "--page-size=128"] if kv_dtype == "int8" else []
    proc = _python(
        env,
        "benchmarks/continuous_aot.py",
        "--topology=v5e:2x4",
        "--chips=8",
        "--layout=tensor",
        "--layers=2",
        *int8,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    pool = float(re.search(r"page pool per layer per chip: ([\d.]+) GiB", proc.stdout)[1])
    temp = float(re.search(r"temp_size_in_bytes\s+([\d.]+) GiB", proc.stdout)[1])
    assert "pallas kernel in the program: True" in proc.stdout
    assert f"int8 kernel in the program: {kv_dtype == 'int8'}" in proc.stdout
    # 2 layers' pools, plus the f32 logits and small state (< 0.05 GiB); int8: no more
    # (XLA lays out the int8 pools in less: 0.066 GiB for 2 x 0.044 here)
    low = 2 * pool if kv_dtype == "bfloat16" else pool
    assert low <= temp < 2 * pool + 0.05, (temp, pool)


MESH_BY_SLICE = """
from tools.aot import prepare_process, topology_devices
prepare_process()
from gspo_jax import sharding
devices = topology_devices("v5e:2x2", num_slices=2)
sizes = sharding.mesh_shape({"data": -1, "fsdp": 2, "tensor": 1, "expert": 1, "dcn_data": 2}, 8)
mesh = sharding.make_mesh(sizes, devices, dcn_data=2)
print(dict(mesh.shape), [[d.slice_index for d in row] for row in mesh.devices[:, :, 0, 0]])
"""


def test_two_slices_split_the_data_axis_and_compile(env, tmp_path):
    """Multi-slice (mesh.dcn_data): the data axis spans the slices in blocks, each slice
    holding whole fsdp groups, so only the data axis's collectives cross the data-center
    network; the tiny train step compiles for two v5e:2x2 slices."""
    proc = _python(env, "-c", MESH_BY_SLICE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shape, by_slice = proc.stdout.strip().splitlines()[-1].split(" [[", 1)
    assert "'data': 4, 'fsdp': 2" in shape
    assert "[[" + by_slice == "[[0, 0], [0, 0], [1, 1], [1, 1]]"
    args = [*TINY, "--num_slices=2", "--config.eval.batch_size=64", "--functions=train_step"]
    proc, out = _aot(env, tmp_path, *args, "--config.mesh.dcn_data=2")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "on v5e:2x2 x 2 slices: 8 chips" in proc.stdout and "(data: 2 slices x 4)" in proc.stdout
    train = out["functions"]["train step"]
    assert train["error"] is None and train["ici_wire_bytes"] > 0
    assert "DCN bandwidth is not modelled" in proc.stdout
    proc, _ = _aot(env, tmp_path, *args)  # two slices, but the config's mesh has one
    assert proc.returncode != 0 and "needs --config.mesh.dcn_data=2" in proc.stderr


def _hybrid_params(D, V, n, H, K, C, J, Hv, dk, dv, F, tied, E=0, Fe=0):
    """A Qwen3.5 model's parameter count from its config.json numbers, by hand: every
    fourth layer gated attention (q doubled for the gate, q/k norms), the others Gated
    DeltaNet (qkv, z, a, b, conv taps 4, dt_bias, A_log, gated norm, out); a SwiGLU MLP,
    or E experts of width Fe with a router and a shared expert of width Fe with its gate."""
    full, lin = n // 4, n - n // 4
    attn = D * 2 * H * C + 2 * D * K * C + H * C * D + 2 * C
    channels = 2 * J * dk + Hv * dv
    dnet = D * channels + D * Hv * dv + 2 * D * Hv + 4 * channels + 2 * Hv + dv + Hv * dv * D
    mlp = 3 * D * F if not E else E * 3 * D * Fe + D * E + 3 * D * Fe + D
    return full * attn + lin * dnet + n * (mlp + 2 * D) + D + V * D * (1 if tied else 2)


def test_the_qwen35_presets_build_their_published_shapes():
    """--preset=Qwen3.5-0.8B / Qwen3.5-35B-A3B (tools/qwen35_presets.py, the released
    vision-language config.json) read as the hybrid text models with the parameter counts
    their config numbers give by hand (text part: 0.75B; 34.7B, 3B-class active)."""
    import math

    import jax

    from configs import gspo_paper
    from gspo_jax import models
    from tools import aot

    c = gspo_paper.get_config()
    want = {
        "Qwen3.5-0.8B": _hybrid_params(1024, 248320, 24, 8, 2, 256, 16, 16, 128, 128, 3584, True),
        "Qwen3.5-35B-A3B": _hybrid_params(
            2048, 248320, 40, 16, 2, 256, 16, 32, 128, 128, 0, False, E=256, Fe=512
        ),
    }
    for preset, count in want.items():
        cfg = aot.model_config_for(c, preset)
        pattern = ("linear_attention",) * 3 + ("full_attention",)
        assert cfg.layer_types == pattern * (cfg.num_layers // 4) and cfg.rotary_dim == 64
        leaves = jax.tree.leaves(models.abstract_params(cfg))
        assert sum(math.prod(x.shape) for x in leaves) == count, preset
    assert aot.model_config_for(c, "Qwen3.5-35B-A3B").num_experts_per_tok == 8
