"""Running the experiment: the warm starts (dense, and the MoE upcycled from it), one
training run per arm and seed, the noise-floor measurement, and the ledger of wall times
(<root>/seconds.json) every phase adds to as it runs."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time

import numpy as np

from experiments.gspo_vs_grpo.arms import ARMS, Arm, Budget, arm_config, run_dir

log = logging.getLogger("experiments")

# The repository's test fixtures (the noise floor runs on the Qwen3 one).
FIXTURES = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "tests",
    "fixtures",
)
# π_old sources the noise floor compares (see `noise_floor`).
PI_OLD_SOURCES = ("recompute", "whole_batch", "sampler")


def warm_start(model: str, budget: Budget, root: str, seed: int | None = None) -> str:
    """The model's warm start, made once and exported in Hugging Face format; returns its
    directory. Dense: configs/default.py's supervised warm start. MoE: the dense warm start
    upcycled as `budget.moe` says (`upcycle`, then its supervised specialisation steps:
    `specialise`): configs/moe_tiny.py's own from-scratch warm start (1200 steps) solved
    too few held-out problems for RL to act on within this budget (docs/results.md's Task
    line says how few); the upcycled one starts near where the dense model does.
    seed None: the one warm start every seed shares (trained with seed 0, in
    <root>/warm_start_<model>); seed k: seed k's own (--independent_warm_starts), trained
    with seed k (initial weights, teacher noise, data order; the MoE's upcycling noise and
    router drawn with seed k), in <root>/warm_start_<model>_seed<k> (the specialised MoE:
    warm_start_moe_specialised_seed<k>)."""
    from gspo_jax.trainer import loop, setup
    from gspo_jax.trainer.io import checkpoint

    bed = budget.moe
    kind = _warm_start_kind(model, budget)
    workdir = warm_start_dir(model, budget, root, seed)
    hf = os.path.join(workdir, "hf")
    phase = f"warm_start/{kind}" + ("" if seed is None else f"/seed{seed}")
    if model == "moe" and not os.path.exists(os.path.join(hf, "config.json")):
        t0 = time.perf_counter()
        dense = warm_start("dense", budget, root, seed)
        up = os.path.join(workdir, "upcycled") if bed.specialise_steps else hf
        upcycle(
            dense, up, num_experts=bed.num_experts, top_k=bed.top_k, noise=bed.noise, seed=seed or 0
        )
        if bed.specialise_steps:
            specialise(up, hf, budget, root, seed or 0)
        record_seconds(root, phase, time.perf_counter() - t0)
    if not os.path.exists(os.path.join(hf, "config.json")):
        t0 = time.perf_counter()
        arm = next(a for a in ARMS if a.model == model)
        trainer = setup.setup(arm_config(arm, seed or 0, budget, root), workdir)
        try:
            params = loop.init_or_restore(trainer).train.params  # the warm start
            checkpoint.export_hf(trainer.model_config, trainer.tokenizer, params, hf)
        finally:
            trainer.close()
        seconds = time.perf_counter() - t0
        record_seconds(root, phase, seconds)
        log.info("%s: %.0f s", phase, seconds)
    return hf


def _warm_start_kind(model: str, budget: Budget) -> str:
    bed = budget.moe
    if model == "moe" and bed.specialise_steps:
        return "moe_specialised" if bed.name == "specialised" else f"moe_{bed.name}"
    if model == "dense" and bed.dense_model:  # another dense model: another directory
        return f"dense_{bed.name}"
    return model


def warm_start_dir(model: str, budget: Budget, root: str, seed: int | None = None) -> str:
    """Where `warm_start` keeps the model's warm start (its hf/ and, specialised, its
    measures): <root>/warm_start_<kind>[_seed<k>]."""
    name = f"warm_start_{_warm_start_kind(model, budget)}"
    return os.path.join(root, name + ("" if seed is None else f"_seed{seed}"))


SPECIALISATION = "specialisation.json"  # beside the specialised MoE's hf/: its measures


def specialise(upcycled: str, hf: str, budget: Budget, root: str, seed: int) -> dict:
    """The upcycled MoE (`upcycled`, a Hugging Face directory) trained by
    `budget.moe.specialise_steps` supervised steps on the warm start's demonstrations
    (router and experts), exported to `hf`; the experts' specialisation
    (`specialisation.measure`) before and after, on 256 demonstrations, is written to
    <hf>/../specialisation.json and returned."""
    from experiments.gspo_vs_grpo import specialisation
    from gspo_jax import models
    from gspo_jax.trainer import loop, setup
    from gspo_jax.trainer import warm_start as warm_start_lib
    from gspo_jax.trainer.io import checkpoint

    arm = next(a for a in ARMS if a.model == "moe")
    config = arm_config(arm, seed, budget, root, warm=upcycled)
    config.warm_start.steps = budget.moe.specialise_steps if not budget.quick else 3
    config.warm_start.on_checkpoint = True
    config.warm_start.target_accuracy = None
    workdir = os.path.dirname(hf)
    trainer = setup.setup(config, os.path.join(workdir, "specialise"))
    try:
        it = warm_start_lib.demonstrations(  # the warm start's own, from a fixed seed
            trainer.sft_source,
            trainer.tokenizer,
            trainer.warm_start,
            trainer.prompt,
            trainer.data_spec,
        )
        batches = [next(it) for _ in range(max(1, 256 // trainer.warm_start.batch_size))]
        _, before = models.load_pretrained(upcycled, dtype=trainer.schedule.param_dtype)
        measures = {"before": specialisation.measure(trainer.model_config, before, batches)}
        params = loop.init_or_restore(trainer).train.params
        measures["after"] = specialisation.measure(trainer.model_config, params, batches)
        measures["steps"] = int(config.warm_start.steps)
        checkpoint.export_hf(trainer.model_config, trainer.tokenizer, params, hf)
    finally:
        trainer.close()
    with open(os.path.join(workdir, SPECIALISATION), "w") as f:
        json.dump(measures, f, indent=1)
    log.info("specialised MoE (seed %d): %s", seed, measures)
    return measures


def upcycle(
    dense_dir: str,
    out_dir: str,
    *,
    num_experts: int = 8,
    top_k: int = 2,
    noise: float = 0.02,
    seed: int = 0,
) -> str:
    """A Qwen3-MoE Hugging Face checkpoint from a dense Qwen3 one (sparse upcycling,
    Komatsuzaki et al. 2022): every layer's MLP becomes `num_experts` copies of it, each
    weight scaled elementwise by (1 + noise·N(0, 1)) so the experts can diverge, and a
    router drawn from N(0, 0.02²); top-k gates are renormalised (norm_topk_prob), so with
    noise 0 the MoE computes exactly the dense model's function. Everything else (attention,
    norms, embeddings, tokenizer files) is copied."""
    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(seed)
    with open(os.path.join(dense_dir, "config.json")) as f:
        cfg = json.load(f)
    if cfg.get("model_type") != "qwen3":
        raise ValueError(
            f"{dense_dir}/config.json: model_type {cfg.get('model_type')!r}, not 'qwen3'"
        )
    tensors = {}
    for name in sorted(os.listdir(dense_dir)):  # one file or shards
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(dense_dir, name)))
    out = {}
    for name, w in tensors.items():
        if ".mlp." not in name:
            out[name] = w
            continue
        prefix, proj = name.split(".mlp.")  # model.layers.{i}, {gate,up,down}_proj.weight
        for e in range(num_experts):
            scale = 1.0 + noise * rng.standard_normal(w.shape).astype(w.dtype)
            out[f"{prefix}.mlp.experts.{e}.{proj}"] = w * scale
        gate = f"{prefix}.mlp.gate.weight"
        if gate not in out:
            out[gate] = (0.02 * rng.standard_normal((num_experts, cfg["hidden_size"]))).astype(
                w.dtype
            )
    cfg.update(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        num_experts=num_experts,
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=cfg["intermediate_size"],
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    for key in ("layer_types", "max_window_layers"):
        cfg.pop(key, None)
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(dense_dir):
        if name != "config.json" and not name.startswith("model"):  # tokenizer, generation
            shutil.copy(os.path.join(dense_dir, name), out_dir)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    save_file(out, os.path.join(out_dir, "model.safetensors"))
    return out_dir


def finished(workdir: str) -> bool:
    """Whether a run's workdir holds a finished run (the trainer writes summary.json last)."""
    return os.path.exists(os.path.join(workdir, "summary.json"))


def run_arm(arm: Arm, seed: int, budget: Budget, root: str, warm: str) -> dict:
    """One training run from the warm start (skipped if its workdir holds a finished run)."""
    from gspo_jax.trainer import loop
    from gspo_jax.trainer.io import workdir as workdir_lib

    workdir = run_dir(root, arm, seed)
    config = arm_config(arm, seed, budget, root, warm)
    if finished(workdir):
        diffs, _ = workdir_lib.config_differences(config, workdir)
        # Any field, even one free on resume (num_steps): another budget's run would be
        # reported as this one's. A field the code added or removed since is no setting.
        other = {k: v for k, v in diffs.items() if "<absent>" not in v}
        if other:
            listing = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in other.items())
            raise ValueError(
                f"{workdir} holds a finished run of other settings ({listing}): use another "
                "--workdir for this budget, or delete that run"
            )
        log.info("%s seed %d: already done (%s)", arm.key, seed, workdir)
        return {"seconds": None}
    t0 = time.perf_counter()
    loop.run(config, workdir)
    seconds = time.perf_counter() - t0
    record_seconds(root, f"run/{arm.key}/seed{seed}", seconds)
    log.info("%s seed %d: %.0f s", arm.key, seed, seconds)
    return {"seconds": seconds}


def record_seconds(root: str, phase: str, seconds: float) -> None:
    """Add a phase's wall time to <root>/seconds.json: the ledger of every phase as it ran,
    so a rerun that reuses cached pieces (warm starts, noise floor, finished runs) still
    reports what the whole experiment cost."""
    import fcntl

    path = os.path.join(root, "seconds.json")
    # Locked: invocations on disjoint arms may share a workdir (and its ledger).
    with open(os.path.join(root, "seconds.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ledger = {}
        if os.path.exists(path):
            with open(path) as f:
                ledger = json.load(f)
        ledger[phase] = seconds
        with open(path, "w") as f:
            json.dump(ledger, f, indent=1)


def read_ledger(root: str) -> dict:
    """<root>/seconds.json ({} before any phase ran)."""
    path = os.path.join(root, "seconds.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


# --------------------------------------------------------------------------- noise floor


def noise_floor(root: str, quick: bool) -> list[dict]:
    """max |s_i − 1| and the clipped fraction of sequences at learning rate 0 (the policy
    never changes) for GSPO at the paper's ε, per compute dtype and π_old source:
      recompute    π_old from the train step's own pass (this codebase)
      whole_batch  π_old from one pass over the whole batch (other shapes: the old way)
      sampler      the sampler's log-probs (paper §5.4)
    On the Qwen3 test fixture (2 layers, d=32, random weights), 2 rollouts of 64 rows.
    Cached in <root>/noise_floor.json."""
    cached = os.path.join(root, "noise_floor.json")
    if os.path.exists(cached):
        with open(cached) as f:
            return json.load(f)
    t0 = time.perf_counter()
    rows = []
    for dtype in ("bfloat16", "float32"):
        rows += _noise_floor_rows(dtype, root, rollouts=1 if quick else 2)
    with open(cached, "w") as f:
        json.dump(rows, f, indent=1)
    record_seconds(root, "noise_floor", time.perf_counter() - t0)
    return rows


def _noise_floor_config(dtype: str, root: str):
    """configs/gspo_paper.py on the Qwen3 fixture at learning rate 0, `dtype` compute, with
    the checksum reward (non-zero advantages, so clipping can act), 64 rows per rollout in
    4 mini-batches of 2 micro-batches."""
    from configs import gspo_paper

    c = gspo_paper.get_config()
    c.model.hf_path = os.path.join(FIXTURES, "models", "qwen3")
    c.model.tokenizer_path = os.path.join(FIXTURES, "models", "tokenizer")
    c.model.param_dtype, c.model.dtype, c.model.remat = "float32", dtype, "full"
    c.data.data_dir = os.path.join(root, "noise_floor", "data")
    c.rollout_batch_size, c.num_return_sequences_in_group = 16, 4
    c.num_mini_batches, c.micro_batch_size = 4, 8
    c.prompt_length, c.response_length = 24, 16
    c.sampling.prompt_buckets = (24,)
    c.reward.spec = c.reward.accuracy = "test_checksum"
    c.reward.num_workers = 0
    c.optim.learning_rate = 0.0
    c.warm_start.steps = 0
    c.checkpoint.async_save = False
    c.log.progress_bar = c.log.plot = c.log.tensorboard = False
    return c


def _noise_floor_rows(dtype: str, root: str, rollouts: int) -> list[dict]:
    """One row per π_old source: the same `rollouts` rollouts, each trained on at lr 0."""
    import gspo_jax.rewards.testing  # noqa: F401  (registers test_checksum)
    from gspo_jax.trainer import loop, setup

    c = _noise_floor_config(dtype, root)
    workdir = os.path.join(root, "noise_floor", f"{dtype}_{time.time_ns()}")
    trainer = setup.setup(c, workdir)
    rows = []
    try:
        state = loop.init_or_restore(trainer)
        outs = [trainer.rollouts.collect(state, next(trainer.train_iter)) for _ in range(rollouts)]
        for source in PI_OLD_SOURCES:
            rows.append(
                {"dtype": dtype, "pi_old": source, **_at_lr_0(trainer, state, outs, source)}
            )
            log.info("noise floor: %s", rows[-1])
    finally:
        trainer.close()
    return rows


def _at_lr_0(trainer, state, outs, source: str) -> dict:
    """The largest |s_i − 1|, clipped fraction of sequences and train/given log-prob gap
    over the rollouts `outs`, each trained on from `state` with π_old taken from `source`."""
    import jax
    import jax.numpy as jnp

    from gspo_jax.train_step import make_train_step
    from gspo_jax.trainer import loop

    sc = dataclasses.replace(
        trainer.step_config,
        old_logprobs_source="recompute" if source == "recompute" else "sampler",
    )
    step = make_train_step(
        sc, trainer.tx, state_shardings=trainer.state_shardings.train, mesh=trainer.mesh
    )
    r = dataclasses.replace(trainer, step_config=sc, train_step=step)
    dev, clip, gap = [], [], []
    for out in outs:
        if source == "whole_batch":
            out = _with_whole_batch_logprobs(trainer, state, out)
        fresh = state.replace(train=jax.tree.map(jnp.copy, state.train))
        _, m = loop.train_on(r, fresh, out)
        m = jax.device_get({k: v for k, v in m.items() if not isinstance(v, float)})
        dev.append(max(np.max(m["updates/ratio_max"]) - 1, 1 - np.min(m["updates/ratio_min"])))
        clip.append(float(np.max(m["updates/clipfrac_seq"])))
        gap.append(float(m["sampler/logprob_gap_max"]))
    return {
        "max_abs_s_minus_1": float(max(dev)),
        "max_clipfrac_seq": float(max(clip)),
        "sampler_gap_max": float(max(gap)),
    }


def _with_whole_batch_logprobs(trainer, state, out):
    """The rollout with its sampler log-probs replaced by one pass over the whole batch
    (how π_old was computed before the train step recomputed it)."""
    b = out.batch
    whole = trainer.rollouts.logprobs_fn(
        state.train.params, b["tokens"], b["attention_mask"], trainer.rollouts.spec.response_length
    )[0]
    return dataclasses.replace(out, batch={**b, "sampler_logprobs": whole})
