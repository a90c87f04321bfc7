"""Compile a run's every jitted function for a TPU slice, without the TPU: does it fit?

    python -m tools.aot --config=configs/gspo_paper.py --preset=Qwen3-8B \\
        --topology=v5p:4x4x4 --config.response_length=16384 --config.mesh.data=1 \\
        --config.mesh.fsdp=-1 --config.micro_batch_size=64

Run it before renting the slice. It needs libtpu importable (`pip install -r
requirements-tpu.txt`, docs/tpu.md) but no TPU and no weights: the model comes from
`--preset` (published Qwen3 / Qwen3.5 shapes), else the config's `model.hf_path` (its config.json
only), else the config's scratch model. For the topology's chips it builds the config's
mesh (`config.mesh`), the parameter / optimizer / batch shardings the trainer uses, and
lowers and compiles, as `jax.ShapeDtypeStruct`s carrying those shardings, the functions
one RL step calls:

    rollout reshard   sampling.RolloutLayout: the policy's rollout copy, once per RL step
                      (sampling.rollout_layout "tensor" only)
    sampler prefill   the run's engine (sampling.engine): continuous.prefill_pages (one
                      prefill per prompt, written into pages) or static.prefill (static)
    sampler decode    continuous.engine_loop (its loop, one replica per data-parallel chip
                      group) or static.decode (static), every response response_length
                      tokens long
    logprobs          train_step.make_logprobs_fn: π_old (and π_ref) recompute (padded
                      rows, every response response_length long, also with packing)
    advantages        rollout.make_advantage_fn (or the token-level-KL variant)
    train step        train_step.make_train_step: ppo_epochs × num_mini_batches updates

It prints one table, per chip: arguments, XLA's temporaries, outputs (donated buffers
counted once), what else stays resident while the function runs (the optimizer state
during sampling and log-probs; the reference params with a KL term), their total against
the chip's HBM, compile time, and the model FLOPs per chip of one call (analytic: XLA's
cost analysis counts a loop body once, so it undercounts scans). It exits 1 naming the
function and the shortfall when one does not fit (XLA:TPU itself refuses to compile a
program larger than HBM; that error is reported the same way).

Then an op-by-op roofline ESTIMATE per function and per RL step (tools/roofline.py): each
op of the optimised HLO with its executed matmul FLOPs (dots and convolutions x loop trip
counts; splash attention's added from its block sizes) and HBM bytes, timed as the larger
of its compute and HBM time at per-op-class efficiencies, summed; every collective's wire
bytes over the links of the torus axes its group spans, and a latency per ring step
(tools.hlo_stats reads them). Printed: seconds by phase (each pass of the RL
step once), the train step's MFU (model FLOPs, its own π_old pass included) beside its HFU
(executed FLOPs), decode tokens/s/chip. Estimates, not measurements; `--json=FILE` writes
them machine-readably (with each function's memory).
`--hbm_top=N` also prints, per function, the N largest contributors to its HBM bytes
(`hlo_stats.hbm_uses`: instruction, result shape, bytes per execution x executions, alike
instructions such as one per unrolled layer grouped, and the jax op they come from).

The rollout batch is taken at its worst case: every prompt at `prompt_length` (the largest
bucket the sampler can pick) and every response `response_length` long. With `config.packing`
the train step is compiled for the packed rows of a long-tailed batch instead
(`PACKED_LENGTHS`: lognormal, mean response_length / 4, sigma 1, capped), its model FLOPs
those of that batch's real tokens.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys

if __name__ == "__main__":  # the command line only: importing this module changes nothing
    from gspo_jax.notices import quiet_known_notices

    quiet_known_notices()

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from gspo_jax import advantages as advantages_lib
from gspo_jax import models
from gspo_jax import sharding as sharding_lib
from gspo_jax.config import specs
from gspo_jax.config import validate as config_lib
from gspo_jax.models import lora
from gspo_jax.models.attention import resolve_impl
from gspo_jax.rollout import stage as rollout
from gspo_jax.train_step import TrainState, batch_ndims, make_logprobs_fn, make_train_step, optim
from tools import aot_rollout, roofline
from tools.aot_common import (
    GiB,
    Report,
    _Abstract,
    _batch_sds,
    _compile,
    _forward_flops,
    _per_chip,
    _sds,
)
from tools.aot_report import describe, format_hbm_top, format_table, fsdp_traffic, shortfalls
from tools.presets import PRESETS

# HBM per chip, GiB (Google Cloud TPU system-architecture pages, cloud.google.com/tpu/docs/
# v4, /v5e, /v5p, /v6e): v4 32 GiB HBM2, v5e 16 GiB HBM2, v5p 95 GiB HBM2e, v6e 32 GiB.
HBM_GIB = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32}

FUNCTIONS = ("prefill", "decode", "logprobs", "advantages", "train_step")


# ------------------------------------------------------------------------------- set-up


def topology_devices(name: str, num_slices: int = 1):
    """The devices of a TPU topology such as "v5p:4x4x4" (libtpu, no TPU needed); with
    `num_slices` > 1, that many such slices (devices carry their `slice_index`)."""
    from jax.experimental import topologies

    kwargs = {"num_slices": num_slices} if num_slices > 1 else {}
    try:
        return topologies.get_topology_desc(topology_name=name, platform="tpu", **kwargs).devices
    except Exception as e:  # no libtpu, or a name libtpu does not know
        raise ValueError(
            f"cannot describe TPU topology {name!r}: {e}. Needs libtpu importable "
            "(pip install -r requirements-tpu.txt) and a name like v5e:2x4 or v5p:4x4x4"
        ) from e


def hbm_bytes(topology: str) -> int:
    generation = topology.split(":")[0]
    if generation not in HBM_GIB:
        raise ValueError(f"unknown TPU generation {generation!r}; known: {sorted(HBM_GIB)}")
    return HBM_GIB[generation] * GiB


def model_config_for(config, preset: str | None) -> models.ModelConfig:
    """The run's ModelConfig: a published preset, else what the trainer builds
    (`config.model_config`: the checkpoint's config.json, or the config's scratch model);
    numerics (dtypes, remat, MoE and attention kernels) from config.model."""
    m = config.model
    if preset:
        if preset not in PRESETS:
            raise ValueError(f"--preset={preset!r}: known presets {sorted(PRESETS)}")
        hf = PRESETS[preset]
        layers = hf.get("text_config", hf)["num_hidden_layers"]
        return models.ModelConfig.from_hf_config(hf, **specs.model_numerics(config, layers))
    if m.hf_path:
        return specs.model_config(config, tokenizer=None)
    import tempfile

    from gspo_jax import data

    with tempfile.TemporaryDirectory() as tmp:  # the scratch model's vocabulary
        return specs.model_config(config, data.make_char_tokenizer(tmp))


def _train_batch(step_config, mesh, B: int, L: int, T: int) -> dict:
    """The train batch as the trainer builds it: `train_step.batch_ndims`'s entries."""
    shapes = {
        "tokens": (B, L),
        "attention_mask": (B, L),
        "response_mask": (B, T),
        "sampler_logprobs": (B, T),
        "ref_logprobs": (B, T),
        "advantages": (B, T),  # [B] unless token-level advantages
    }
    ints = ("tokens", "attention_mask")
    return {
        name: _batch_sds(mesh, shapes[name][:ndim], jnp.int32 if name in ints else jnp.float32)
        for name, ndim in batch_ndims(step_config).items()
    }


# ---------------------------------------------------------------------------- compile


def _abstract_run(config, model_config, devices, num_processes) -> _Abstract:
    """The config validated for `devices`, and its mesh, shardings and abstract state."""
    c = config
    processes = num_processes or len({d.process_index for d in devices})
    config_lib.validate(c, num_devices=len(devices), num_processes=processes)
    mesh = sharding_lib.make_mesh(
        config_lib.mesh_shape(c, len(devices)), devices, dcn_data=c.mesh.dcn_data
    )
    cfg = dataclasses.replace(
        model_config,
        attention_impl=resolve_impl(
            model_config.attention_impl, dtype=model_config.dtype, platform="tpu"
        ),
    )
    tx = optim.make_optimizer(specs.optim_spec(c))
    abstract = models.abstract_params(cfg)
    param_sh = sharding_lib.tree_shardings(abstract, models.logical_axes(cfg), mesh)
    # With LoRA only the adapters train: the optimizer state is theirs alone.
    trained, trained_sh = lora.trainable(abstract), lora.trainable(param_sh)
    opt_sh = sharding_lib.optimizer_state_shardings(tx, trained, trained_sh, mesh)
    return _Abstract(
        c=c,
        cfg=cfg,
        mesh=mesh,
        chips=len(devices),
        N=c.rollout_batch_size,
        G=c.num_return_sequences_in_group,
        P=c.prompt_length,
        T=c.response_length,
        step_config=specs.step_config(c, cfg),
        tx=tx,
        abstract=abstract,
        param_sh=param_sh,
        opt_sh=opt_sh,
        params=_sds(abstract, param_sh),
        opt_state=_sds(jax.eval_shape(tx.init, trained), opt_sh),
        # LoRA's π_ref is the base itself (the adapters off): nothing more stays resident.
        needs_ref=bool(c.use_kl_loss or c.add_token_level_kl) and not cfg.lora_rank,
    )


def compile_run(
    config, model_config, devices, *, functions=FUNCTIONS, num_processes=None
) -> list[Report]:
    """Lowers and compiles the RL step's functions for `devices` (a topology's); returns a
    Report per function (memory per chip, compile seconds, model FLOPs per chip).
    `num_processes` (default: the topology's hosts) only enters the config validation."""
    a = _abstract_run(config, model_config, devices, num_processes)
    reports: list[Report] = []
    if "prefill" in functions or "decode" in functions:
        reports += aot_rollout.compile_sampler(
            a, functions
        )  # sets its mesh (the rollout's may differ)
    with jax.set_mesh(a.mesh):
        if "logprobs" in functions:
            reports.append(_compile_logprobs(a))
        if "advantages" in functions:
            reports.append(_compile_advantages(a))
        if "train_step" in functions:
            reports.append(_compile_train_step(a))
    return reports


def _compile_logprobs(a: _Abstract) -> Report:
    tokens_BL = _batch_sds(a.mesh, (a.B, a.L), jnp.int32)
    report, _ = _compile(
        "logprobs",
        # padded: its packed rows (a bucket per batch) are data dependent
        make_logprobs_fn(dataclasses.replace(a.step_config, packing=False)),
        a.params,
        tokens_BL,
        tokens_BL,
        a.T,
        resident=a.idle,
        flops=_forward_flops(a.cfg, a.B, a.L, a.T) / a.chips,
        vocab=a.cfg.vocab_size,
    )
    return report


def _compile_advantages(a: _Abstract) -> Report:
    rewards = _batch_sds(a.mesh, (a.B,), jnp.float32)
    valid = _batch_sds(a.mesh, (a.B,), jnp.bool_)
    running = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=a.rep),
        jax.eval_shape(advantages_lib.init_running_moments),
    )
    args = [rewards, valid, running]
    if a.c.add_token_level_kl:
        args += [_batch_sds(a.mesh, (a.B, a.T), jnp.float32)] * 3
    fn = rollout.make_advantage_fn(specs.advantage_spec(a.c), a.mesh).jitted
    report, _ = _compile("advantages", fn, *args, resident=a.idle)
    return report


def train_step_model_flops(a: _Abstract) -> float:
    """Model FLOPs of one train step, all chips: 3 forwards (forward + backward) per update
    over ppo_epochs passes of the rollout, plus 1 forward for the step's own π_old pass
    when it runs one (old_policy.runs_pass: recomputed π_old, a rollout correction, MoE
    routing)."""
    forward = _forward_flops(a.cfg, a.B, a.L, a.T)
    return (3 * a.c.ppo_epochs + runs_old_pass(a.step_config)) * forward


def runs_old_pass(step_config) -> bool:
    from gspo_jax.algorithm import old_policy

    return old_policy.runs_pass(step_config)


def logprob_calls(config) -> int:
    """How often one RL step calls the log-prob function (rollout/stage.py): π_ref with a KL
    term, and π_old for the token-level KL reward when it is recomputed; the train step's
    own π_old pass is inside the train step."""
    needs_ref = bool(config.use_kl_loss or config.add_token_level_kl)
    old = bool(config.add_token_level_kl) and config.old_logprobs_source == "recompute"
    return int(needs_ref) + int(old)


# `config.packing`: the response lengths the packed train step is compiled for (its packed
# rows are data dependent): the rollout benchmark's long tail, lognormal of mean
# response_length / 4, sigma 1, capped at response_length (mean 2,048 at a cap of 8,192).
PACKED_LENGTHS = {"mean_fraction": 0.25, "sigma": 1.0, "seed": 0}


def packed_step_config(a: _Abstract):
    """(the step config with the packed rows `make_train_step` would pick for a batch of
    PACKED_LENGTHS responses and full-length prompts, the fraction of the padded batch's
    tokens that are real). Unchanged (and 1.0) without `packing`."""
    sc = a.step_config
    if not sc.packing or sc.pack_rows:
        return sc, 1.0
    from gspo_jax.sharding.split import num_micro
    from gspo_jax.train_step import packing, step

    mean = PACKED_LENGTHS["mean_fraction"] * a.T
    sigma = PACKED_LENGTHS["sigma"]
    rng = np.random.default_rng(PACKED_LENGTHS["seed"])
    draw = rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, a.B)
    lengths = np.clip(np.round(draw), 1, a.T).astype(np.int32)
    mask = np.ones((a.B, a.L), np.int32)
    mask[:, a.P :] = np.arange(a.T)[None] < lengths[:, None]
    mini = a.B // sc.num_mini_batches
    splits = sc.num_mini_batches * num_micro(sc.micro_batch_size, mini)
    _, group = step._micro_batching(sc, mini)
    cpu = jax.devices("cpu")[0]  # the count runs here, off the TPU mesh being compiled for
    auto = (jax.sharding.AxisType.Auto,)
    with jax.set_mesh(jax.make_mesh((1,), ("host",), axis_types=auto, devices=[cpu])):
        needed, _ = packing.rows_needed(sc, jax.device_put(mask, cpu), a.T, splits, group)
    shards = sharding_lib.data_parallel_size(a.mesh)
    rows = packing.bucket_rows(int(needed), a.B // splits, shards)
    return dataclasses.replace(sc, pack_rows=rows), float(mask.sum() / mask.size)


def _compile_train_step(a: _Abstract) -> Report:
    """The train step on a train state whose params and optimizer state it donates; π_ref
    (a KL term) is what else stays resident. With `packing`, its packed rows are those of
    PACKED_LENGTHS (`packed_step_config`) and its model FLOPs those of the real tokens."""
    rep = a.rep
    state_sh = TrainState(step=rep, params=a.param_sh, opt_state=a.opt_sh)
    state = TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
        params=a.params,
        opt_state=a.opt_state,
    )
    batch = _train_batch(a.step_config, a.mesh, a.B, a.L, a.T)
    step_config, real = packed_step_config(a)
    flops = train_step_model_flops(a) * real / a.chips
    report, _ = _compile(
        "train step",
        make_train_step(step_config, a.tx, state_shardings=state_sh, mesh=a.mesh),
        state,
        batch,
        resident=_per_chip(a.params) if a.needs_ref else 0,
        flops=flops,
        vocab=a.cfg.vocab_size,
    )
    return report


_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/default.py", "Experiment config file.", lock_config=True
)
_TOPOLOGY = flags.DEFINE_string("topology", None, "TPU topology, e.g. v5e:2x4 or v5p:4x4x4.")
_PRESET = flags.DEFINE_enum(
    "preset", None, list(PRESETS), "Published model shapes (no checkpoint needed)."
)
_FUNCTIONS = flags.DEFINE_list("functions", list(FUNCTIONS), f"Subset of {FUNCTIONS}.")
_JSON = flags.DEFINE_string("json", None, "Also write the reports to this JSON file.")
_HBM_TOP = flags.DEFINE_integer(
    "hbm_top",
    0,
    "Also print the N largest HBM contributors of each compiled function (instruction, "
    "result shape, bytes x executions; hlo_stats.hbm_uses), and write them to --json.",
    lower_bound=0,
)
_SLICES = flags.DEFINE_integer(
    "num_slices",
    1,
    "TPU slices of --topology each, joined by the data-center network (multi-slice); needs "
    "--config.mesh.dcn_data equal to it. Collectives across slices are estimated at ICI "
    "speed: DCN bandwidth is not modelled.",
    lower_bound=1,
)
_PROCESSES = flags.DEFINE_integer(
    "num_processes",
    None,
    "JAX processes of the run, for the config's batch checks (default: the topology's "
    "hosts as libtpu describes them, e.g. 2 for v5e:2x4; a single-host v5litepod-8 runs 1).",
)


def prepare_process() -> None:
    """Settings of an aot process (its entry point calls this first, before any jax backend
    starts; importing this module changes nothing): compiling needs libtpu, never a TPU, so
    jax's runtime stays on the CPU (a TPU VM's chips stay free for a run); several compile
    processes may load libtpu at once (it otherwise holds a lockfile); and libtpu does not
    probe the host's TPU metadata."""
    jax.config.update("jax_platforms", os.environ.get("JAX_PLATFORMS") or "cpu")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")


def main(argv) -> int:
    del argv
    if not _TOPOLOGY.value:
        raise app.UsageError("--topology is required (e.g. --topology=v5p:4x4x4)")
    unknown = sorted(set(_FUNCTIONS.value) - set(FUNCTIONS))
    if unknown:
        raise app.UsageError(f"--functions: unknown {unknown}; known {list(FUNCTIONS)}")
    config = _CONFIG.value
    if importlib.util.find_spec("libtpu") is None and not os.environ.get("TPU_LIBRARY_PATH"):
        print(
            "tools.aot: error: libtpu is not installed, and compiling for a TPU needs it "
            "(not a TPU): pip install -r requirements-tpu.txt, or pip install "
            f'"jax[tpu]=={jax.__version__}" (docs/tpu.md)',
            file=sys.stderr,
        )
        return 2
    if _SLICES.value != config.mesh.dcn_data:
        raise app.UsageError(
            f"--num_slices={_SLICES.value} needs --config.mesh.dcn_data={_SLICES.value} "
            f"(it is {config.mesh.dcn_data}): the batch splits over the slices first"
        )
    devices = topology_devices(_TOPOLOGY.value, _SLICES.value)
    capacity = hbm_bytes(_TOPOLOGY.value)
    cfg = model_config_for(config, _PRESET.value)
    print(describe(config, cfg, _TOPOLOGY.value, devices), flush=True)
    reports = compile_run(
        config,
        cfg,
        devices,
        functions=tuple(_FUNCTIONS.value),
        num_processes=_PROCESSES.value,
    )
    print(format_table(reports, capacity))
    decoded = config.rollout_batch_size * config.num_return_sequences_in_group
    decoded *= config.response_length / len(devices)
    chip = roofline.chip_for(_TOPOLOGY.value)
    dims = roofline.torus_dims(_TOPOLOGY.value)
    calls = logprob_calls(config)
    step_config = specs.step_config(config, cfg)
    notes = [
        "train step model FLOPs: 3 forwards per update x ppo_epochs"
        + (" + 1 forward for its own π_old pass" if runs_old_pass(step_config) else "")
        + f"; the log-prob function runs {calls} time(s) per RL step"
        + (" (π_old is the train step's own pass)" if not calls else "")
    ]
    if _SLICES.value > 1:
        notes.append(
            f"{_SLICES.value} slices: the data axis's collectives cross the data-center "
            "network, estimated here at ICI speed (DCN bandwidth is not modelled): a low bound"
        )
    kwargs = {"decoded_tokens": decoded, "logprob_calls": calls, "dims": dims}
    print("\n" + roofline.format_estimates(reports, chip, notes=notes, **kwargs))
    traffic = fsdp_traffic(config, cfg, reports)
    if traffic:
        print(traffic)
    if _HBM_TOP.value:
        tokens = {"sampler decode": config.response_length}
        print("\n" + format_hbm_top(reports, _HBM_TOP.value, tokens))
    if _JSON.value:
        out = roofline.json_summary(reports, chip, **kwargs)
        for r in reports:  # memory and where the HBM bytes go, beside the estimate
            row = out["functions"].setdefault(r.name, {"model_flops": r.flops})
            row["error"] = r.error
            row["compile_s"] = r.compile_s
            row["memory"] = {
                k: getattr(r, k) for k in ("args", "temp", "out", "alias", "resident", "total")
            }
            row["hbm_uses"] = [dataclasses.asdict(u) for u in r.hbm_uses[: _HBM_TOP.value]]
        with open(_JSON.value, "w") as f:
            json.dump(out, f, indent=2)
    problems = shortfalls(reports, capacity)
    for p in problems:
        print(f"DOES NOT FIT: {p}", file=sys.stderr)
    if not problems:
        peak = max(reports, key=lambda r: r.total)
        print(
            f"fits: peak {peak.total / GiB:.2f} GiB per chip ({peak.name}) of {capacity / GiB:.0f}"
        )
    return 1 if problems else 0


if __name__ == "__main__":
    prepare_process()
    app.run(lambda argv: sys.exit(main(argv)))
