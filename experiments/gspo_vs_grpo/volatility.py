"""§5.3 expert volatility at a matched update size (issue 43, item 2):

    python -m experiments.gspo_vs_grpo.volatility --publish   # docs/results_moe_volatility.md
    python -m experiments.gspo_vs_grpo.volatility --scale=gpu   # one GPU, ~10 min
    python -m experiments.gspo_vs_grpo.volatility --algos=grpo,gspo   # GSPO beside GRPO

The model: a dense Qwen3 warm start (configs/default.py's task and supervised warm start, the
scale's depth and widths) upcycled to `num_experts` noisy copies of its MLP, top-k routed
(the scale's `moe_impl`), then specialised by supervised steps of the MoE itself with the router
load-balancing loss on (`model.router_aux_loss_coef`, also on in RL): many experts, near-tied
by construction, kept in use by the balancing loss.

The measurement, per learning rate, from that one checkpoint and on the same rollouts (every
learning rate sees the same prompts and sampling stream):
- one update: the train step of `num_mini_batches` (4) mini-batches, where only the first
  mini-batch's update moves the weights (the learning rate is held in the optimizer state and
  set to 0 after the first update: `held_lr`). Updates 1..3 then read mini-batches 1..3 at
  the weights after exactly one update, so the step's own `updates/expert_change/u`,
  `updates/clipfrac/u`, `updates/approx_kl/u` (u = 1..3, averaged) are (a) the fraction of
  (token, layer, top-k) expert choices that changed and (b) the update's size, on rows that
  update did not train on. (c) `free_vs_replayed`: on those rows, the per-token
  |log π_θ1(free routing) − log π_θ1(π_old's routing replayed)|, what Routing Replay removes.
- a few RL steps at that learning rate (the paper's 4 updates per rollout): does the
  training reward hold up against the learning-rate-0 control on the same prompts and
  samples (`learns`)?

Shapes: B rows, L tokens, P prompt tokens, T response tokens, M MoE layers, X top-k.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gspo_jax import models

log = logging.getLogger("experiments")
RESULTS = "docs/results_moe_volatility.md"
PAPER = 0.10  # §5.3: ~10 % of activated experts change per update (48 layers, 128 experts)
THRESHOLD = 0.05  # the bar: >= 5 % while training still learns
# learns: last-half training reward >= max(control − LEARN_MARGIN, control / 2), control the
# lr-0 run's on the same prompts and samples (the half: a low control's margin is no bar)
LEARN_MARGIN = 0.05


@dataclasses.dataclass(frozen=True)
class Scale:
    num_layers: int
    hidden_size: int
    intermediate_size: int  # the dense MLP's width = every upcycled expert's
    num_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    noise: float  # upcycling: each expert weight times 1 + noise·N(0, 1)
    router_aux_loss_coef: float
    warm_max_steps: int  # dense warm start: to 30 % train accuracy, at most this many
    specialise_steps: int
    lrs: tuple[float, ...]  # 0 first: the control
    rl_steps: int  # RL steps per learning rate (learns?)
    measure_rollouts: int  # one-update measurements per learning rate (n)
    prompts: int  # per rollout (G = 8 responses each)
    moe_impl: str  # "ragged" (only the chosen experts) | "dense" (all, masked): exact both
    specialise_batch: int  # demonstrations per specialisation step


SCALES = {
    # What 2 shared CPU cores afford in ~30 min: on this CPU lax.ragged_dot ran a top-8 of 64
    # experts' forward+backward at ~2x the time of computing all 64 (18.5 s against 9.4 s
    # for 8 x 56 tokens, at load 7), so the MoE is shrunk to 16 full-width experts, top-4,
    # dense dispatch (exact either way: tests/models/test_models_moe.py), over the 8-layer,
    # hidden-64 dense warm start; 400 specialisation steps of 16 demonstrations, 8 prompts
    # per rollout, 6 RL steps per learning rate, n = 2 one-update measurements.
    "cpu": Scale(8, 64, 128, 4, 16, 16, 4, 0.1, 0.01, 2000, 400,
                 (0.0, 1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3), 6, 2, 8, "dense", 16),
    # A smoke test (--scale=smoke): it runs, no result.
    "smoke": Scale(2, 32, 32, 2, 16, 8, 2, 0.1, 0.01, 50, 5, (0.0, 1e-3), 2, 1, 4, "ragged", 8),
    # One GPU, ~10 min (not run: no GPU here): 24 layers, 128 experts top-8, ragged dispatch.
    "gpu": Scale(24, 128, 256, 4, 32, 128, 8, 0.1, 0.01, 3000, 600,
                 (0.0, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2), 20, 5, 32, "ragged", 64),
}  # fmt: skip


def _next_token_logprobs(logits_BLV, tokens_BL):
    """log softmax(logits)[next token] [B, L − 1]: entry l is token l + 1's log-prob."""
    logp_BLV = jax.nn.log_softmax(logits_BLV[:, :-1].astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp_BLV, tokens_BL[:, 1:, None], axis=-1)[..., 0]


@functools.partial(jax.jit, static_argnums=0)
def free_vs_replayed(model_config, params, tokens_BL, mask_BL, old_routing_MBLX):
    """(log π free [B, L − 1], log π replayed [B, L − 1], free routing [M, B, L, X]) at
    `params`: each next token's log-prob with the router choosing (free) and with
    `old_routing_MBLX` forced (Routing Replay: π_old's experts, the current router's gates
    at them). Where the router's choice equals the replayed one at every layer of every
    position a token reads, the two are equal; entry l covers token l + 1."""
    logits_free, routing_MBLX = models.forward_with_routing(
        model_config, params, tokens_BL, mask_BL
    )
    logits_replay, _ = models.forward_with_routing(
        model_config, params, tokens_BL, mask_BL, routing=old_routing_MBLX
    )
    return (
        _next_token_logprobs(logits_free, tokens_BL),
        _next_token_logprobs(logits_replay, tokens_BL),
        routing_MBLX,
    )


def gap_stats(free_BT, replay_BT, mask_BT) -> dict:
    """Mean, 99th percentile (numpy's linear interpolation) and max of
    |free − replayed| over the valid tokens (mask > 0)."""
    valid = np.asarray(mask_BT) > 0
    if not valid.any():
        raise ValueError("gap_stats: the mask has no valid token")
    d = np.abs(np.asarray(free_BT, np.float64) - np.asarray(replay_BT, np.float64))[valid]
    return {"mean": float(d.mean()), "p99": float(np.percentile(d, 99)), "max": float(d.max())}


class HeldLR(NamedTuple):
    """`held_lr`'s state: updates applied, the learning rate, whether only the first counts."""

    count: jax.Array  # int32
    lr: jax.Array  # f32
    first_only: jax.Array  # bool


def held_lr():
    """Scale updates by −lr, lr held in the state (one compiled step serves every learning
    rate); with `first_only`, every update after the first is scaled by 0."""
    import optax

    def init(params):
        del params
        return HeldLR(jnp.zeros([], jnp.int32), jnp.zeros([], jnp.float32), jnp.zeros([], bool))

    def update(updates, state, params=None):
        del params
        lr = jnp.where(state.first_only & (state.count > 0), 0.0, state.lr)
        updates = jax.tree.map(lambda u: (-lr * u).astype(u.dtype), updates)
        return updates, state._replace(count=state.count + 1)

    return optax.GradientTransformation(init, update)


def make_tx(optim):
    """The config's AdamW (`optim.*`: b1, b2, eps, weight decay, clip) with `held_lr` in
    place of its learning-rate schedule (constant, no warm-up)."""
    import optax

    parts = [optax.clip_by_global_norm(optim.max_grad_norm)] if optim.max_grad_norm else []
    parts.append(optax.scale_by_adam(b1=optim.b1, b2=optim.b2, eps=optim.eps))
    if optim.weight_decay:
        parts.append(optax.add_decayed_weights(optim.weight_decay))
    return optax.chain(*parts, held_lr())


def set_lr(opt_state, lr: float, first_only: bool):
    """`make_tx`'s state with its learning rate set (the held_lr state is the last part)."""
    held = HeldLR(jnp.zeros([], jnp.int32), jnp.float32(lr), jnp.asarray(first_only))
    return (*opt_state[:-1], held)


def _common(c, scale: Scale, root: str) -> None:
    c.data.data_dir = os.path.join(root, "data")
    c.rollout_batch_size = scale.prompts
    c.checkpoint.every_steps = 0
    c.checkpoint.async_save = False
    c.log.progress_bar = False
    c.reward.num_workers = 0
    c.eval.num_prompts = c.eval.batch_size = 64  # never run: RL steps only
    c.model.scan_layers = True


def dense_config(scale: Scale, root: str):
    """configs/default.py (task, teacher, warm start to 30 %) at the scale's shape."""
    from configs import default

    c = default.get_config()
    _common(c, scale, root)
    c.model.num_layers, c.model.hidden_size = scale.num_layers, scale.hidden_size
    c.model.intermediate_size, c.model.num_heads = scale.intermediate_size, scale.num_heads
    c.model.num_kv_heads, c.model.head_dim = max(scale.num_heads // 2, 1), scale.head_dim
    c.warm_start.max_steps = scale.warm_max_steps
    c.warm_start.steps = min(c.warm_start.steps, scale.warm_max_steps)
    return c


def moe_config(scale: Scale, root: str, hf: str, algo: str):
    """configs/moe_tiny.py's `algo` on the checkpoint `hf`: the scale's dispatch, the
    load-balancing loss on, no warm start."""
    from configs import moe_tiny

    c = moe_tiny.get_config(f"algo={algo}")
    _common(c, scale, root)
    c.model.hf_path = hf
    c.model.moe_impl = scale.moe_impl
    c.model.router_aux_loss_coef = scale.router_aux_loss_coef
    c.warm_start.steps = 0
    c.num_steps = scale.rl_steps
    return c


def _export(c, workdir: str, hf: str):
    """Run `c`'s warm start (in init_or_restore) and export the result to `hf`."""
    from gspo_jax.trainer import loop, setup
    from gspo_jax.trainer.io import checkpoint

    trainer = setup.setup(c, workdir)
    try:
        params = loop.init_or_restore(trainer).train.params
        checkpoint.export_hf(trainer.model_config, trainer.tokenizer, params, hf)
        return trainer.model_config, params, trainer
    finally:
        trainer.close()


def dense_warm_start(scale: Scale, root: str) -> str:
    """The dense warm start's Hugging Face directory (made once, in <root>/dense/hf)."""
    hf = os.path.join(root, "dense", "hf")
    if not os.path.exists(os.path.join(hf, "config.json")):
        _export(dense_config(scale, root), os.path.join(root, "dense", "run"), hf)
    return hf


def specialised(scale: Scale, root: str, dense_hf: str) -> tuple[str, dict]:
    """The upcycled MoE after `specialise_steps` supervised steps (router, experts, the
    balancing loss on): its directory and the specialisation measures before and after
    (experiments/gspo_vs_grpo/specialisation.py), cached in <root>/moe/."""
    from experiments.gspo_vs_grpo import run, specialisation
    from gspo_jax.trainer import warm_start as warm_start_lib

    out = os.path.join(root, "moe")
    hf, cached = os.path.join(out, "hf"), os.path.join(out, "specialisation.json")
    if os.path.exists(cached) and os.path.exists(os.path.join(hf, "config.json")):
        with open(cached) as f:
            return hf, json.load(f)
    up = run.upcycle(
        dense_hf, os.path.join(out, "upcycled"), num_experts=scale.num_experts,
        top_k=scale.top_k, noise=scale.noise, seed=0,
    )  # fmt: skip
    c = moe_config(scale, root, up, "grpo")
    c.warm_start.steps = scale.specialise_steps
    c.warm_start.batch_size = scale.specialise_batch
    c.warm_start.on_checkpoint = True
    c.warm_start.target_accuracy = None
    cfg, after, trainer = _export(c, os.path.join(out, "specialise"), hf)
    it = warm_start_lib.demonstrations(
        trainer.sft_source, trainer.tokenizer, trainer.warm_start, trainer.prompt,
        trainer.data_spec,
    )  # fmt: skip
    batches = [next(it) for _ in range(max(1, 256 // trainer.warm_start.batch_size))]
    _, before = models.load_pretrained(up)
    measures = {
        "before": specialisation.measure(cfg, before, batches),
        "after": specialisation.measure(cfg, after, batches),
        "steps": scale.specialise_steps,
    }
    with open(cached, "w") as f:
        json.dump(measures, f, indent=1)
    return hf, measures


def _fresh(state0, tx, lr: float, first_only: bool):
    """A copy of the starting state (the step donates it) with a new optimizer state."""
    params = jax.tree.map(jnp.copy, state0.train.params)
    opt = set_lr(tx.init(params), lr, first_only)
    train = state0.train.replace(params=params, opt_state=opt, step=jnp.zeros([], jnp.int32))
    return state0.replace(train=train)


PER_UPDATE = ("expert_change", "clipfrac", "clipfrac_range", "approx_kl")
OWN = ("expert_change_own", "kl_k3", "abs_log_ratio")


def one_update(trainer, state0, tx, rollout, start, lr: float) -> dict:
    """One update (mini-batch 0) at `lr` from state0, read on the other mini-batches: the
    step's per-update metrics at updates 1.. (weights after exactly one update), and on
    those rows our own expert change (pooled over the rows), |log π free − log π replayed|
    (`free_vs_replayed`) and the update's size, k3 KL and mean |log π − log π_old|, over
    the response tokens. `start`: (routing [M, B, L, X], next-token log π [B, L − 1]) of
    the rollout at the starting weights."""
    from gspo_jax.train_step.metrics import routing_changes
    from gspo_jax.trainer import loop

    state1, m = loop.train_on(trainer, _fresh(state0, tx, lr, True), rollout)
    m = jax.device_get({k: v for k, v in m.items() if k.startswith("updates/")})
    out = {k: float(np.mean(np.asarray(m[f"updates/{k}"])[1:])) for k in PER_UPDATE}
    b = jax.device_get(rollout.batch)
    U = trainer.step_config.num_mini_batches
    rows = np.arange(b["tokens"].shape[0]) % U != 0  # mini-batch m: rows m, m + U, ...
    tokens, mask = jnp.asarray(b["tokens"][rows]), jnp.asarray(b["attention_mask"][rows])
    old = jnp.asarray(np.asarray(start[0])[:, rows])
    free, replay, routing = free_vs_replayed(
        trainer.model_config, state1.train.params, tokens, mask, old
    )
    T = b["response_mask"].shape[1]
    resp = b["response_mask"][rows]
    out["gap"] = gap_stats(free[:, -T:], replay[:, -T:], resp)
    d = np.asarray(start[1])[rows][:, -T:] - np.asarray(free)[:, -T:]  # log π_old − log π
    valid = resp > 0
    out["kl_k3"] = float(np.mean((np.exp(d) - d - 1)[valid]))
    out["abs_log_ratio"] = float(np.mean(np.abs(d)[valid]))
    changed, total = routing_changes(old, routing, mask)
    out["expert_change_own"] = float(changed / total)
    return out


def rl_curve(trainer, state0, tx, prompts, lr: float, steps: int) -> dict:
    """`steps` RL steps at `lr` (every update moves the weights): the training reward per
    step and the step's update-1 expert change, clip fraction and approx KL."""
    from gspo_jax.trainer import loop

    state = _fresh(state0, tx, lr, False)
    curve = {"reward": [], "expert_change": [], "clipfrac": [], "approx_kl": []}
    for k in range(steps):
        rollout = trainer.rollouts.collect(state, prompts[k])
        state, m = loop.train_on(trainer, state, rollout)
        m = jax.device_get({k: v for k, v in m.items() if not isinstance(v, str)})
        curve["reward"].append(float(m["reward/mean"]))
        for key in ("expert_change", "clipfrac", "approx_kl"):
            curve[key].append(float(np.asarray(m[f"updates/{key}"])[1]))
    return curve


def measure_algo(scale: Scale, root: str, hf: str, algo: str) -> list[dict]:
    """Every learning rate's one-update measurements (`measure_rollouts` rollouts of the
    starting checkpoint, shared by all learning rates) and RL curve (same prompts and
    sampling stream for all), `algo`'s objective; one row per learning rate."""
    from gspo_jax.train_step import make_train_step
    from gspo_jax.trainer import loop, setup

    c = moe_config(scale, root, hf, algo)
    trainer = setup.setup(c, os.path.join(root, f"rl_{algo}_{time.time_ns()}"))
    try:
        if trainer.step_config.ppo_epochs != 1:
            raise ValueError("volatility: updates 1.. must read unseen mini-batches (ppo_epochs=1)")
        state0 = loop.init_or_restore(trainer)
        tx = make_tx(c.optim)
        trainer = dataclasses.replace(
            trainer, tx=tx, train_step=make_train_step(trainer.step_config, tx)
        )
        prompts = [
            next(trainer.train_iter) for _ in range(max(scale.rl_steps, scale.measure_rollouts))
        ]
        p0 = state0.train.params
        rollouts, starts = [], []
        for i in range(scale.measure_rollouts):
            r = trainer.rollouts.collect(state0.replace(step=i), prompts[i])
            b = r.batch
            _, routing = models.forward_with_routing(
                trainer.model_config, p0, b["tokens"], b["attention_mask"]
            )
            logp0, _, _ = free_vs_replayed(
                trainer.model_config, p0, b["tokens"], b["attention_mask"], routing
            )
            rollouts.append(r)
            starts.append((np.asarray(routing), np.asarray(logp0)))
        rows = []
        for lr in scale.lrs:
            t0 = time.perf_counter()
            ones = [one_update(trainer, state0, tx, r, g, lr) for r, g in zip(rollouts, starts)]
            curve = rl_curve(trainer, state0, tx, prompts, lr, scale.rl_steps)
            rows.append({"lr": lr, "one_update": ones, "curve": curve})
            log.info(
                "%s lr %g (%.0f s): %s", algo, lr, time.perf_counter() - t0, summarise(rows[-1])
            )
        return rows
    finally:
        trainer.close()


def _cached_rows(scale: Scale, root: str, hf: str, algo: str) -> list[dict]:
    """`measure_algo`'s rows, cached in <root>/rows_<algo>.json."""
    path = os.path.join(root, f"rows_{algo}.json")
    if not os.path.exists(path):
        rows = measure_algo(scale, root, hf, algo)
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)
    with open(path) as f:
        return json.load(f)


def summarise(row: dict, control: dict | None = None) -> dict:
    """A row's numbers: means over the one-update measurements (n, min, max of the expert
    change), the RL curve's reward (first step, last half) and `learns` against the
    lr-0 control's last half (LEARN_MARGIN's rule; absent without a control)."""
    ones = row["one_update"]
    ec = [o["expert_change"] for o in ones]
    out = {k: float(np.mean([o[k] for o in ones])) for k in (*PER_UPDATE, *OWN)}
    out.update(n=len(ones), expert_change_min=min(ec), expert_change_max=max(ec))
    for k in ("mean", "p99", "max"):
        out[f"gap_{k}"] = float(np.mean([o["gap"][k] for o in ones]))
    r = row["curve"]["reward"]
    half = r[len(r) // 2 :]
    out.update(reward_first=r[0], reward_last_half=float(np.mean(half)))
    out["rl_expert_change"] = float(np.mean(row["curve"]["expert_change"]))
    if control is not None:
        c_half = control["curve"]["reward"][len(r) // 2 :]
        out["control_last_half"] = float(np.mean(c_half))
        floor = max(out["control_last_half"] - LEARN_MARGIN, out["control_last_half"] / 2)
        out["learns"] = bool(out["reward_last_half"] >= floor)
    return out


def _tables(rows: dict) -> dict:
    """Each algorithm's summarised rows, `learns` against its lr-0 row."""
    tables = {}
    for algo, rs in rows.items():
        control = next(r for r in rs if r["lr"] == 0)
        tables[algo] = [{"lr": r["lr"], **summarise(r, control)} for r in rs]
    return tables


def run(scale_name: str, root: str, algos: tuple[str, ...], command: str) -> dict:
    """The whole measurement: warm start, upcycling and specialisation (cached under root),
    then every algorithm's learning rates; returns the result (written to <root>/result.json)."""
    import subprocess

    t0 = time.perf_counter()
    scale = SCALES[scale_name]
    os.makedirs(root, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", os.path.join(root, "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    dense = dense_warm_start(scale, root)
    hf, spec = specialised(scale, root, dense)
    log.info("specialised: %s", spec)
    rows = {algo: _cached_rows(scale, root, hf, algo) for algo in algos}
    tables = _tables(rows)
    _, params = models.load_pretrained(hf)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    result = {
        "command": command,
        "scale": {"name": scale_name, **dataclasses.asdict(scale)},
        "parameters": int(sum(np.size(x) for x in jax.tree.leaves(params))),
        "specialisation": spec,
        "tables": tables,
        "raw": rows,
        "seconds": time.perf_counter() - t0,
        "machine": f"{os.cpu_count()} CPU cores (shared), load average "
        f"{os.getloadavg()[2]:.1f} over 15 min, {jax.devices()[0].platform}",
        "commit": commit,
    }
    with open(os.path.join(root, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", choices=sorted(SCALES), default="cpu")
    p.add_argument("--workdir", default=None, help="default /tmp/moe_volatility_<scale>")
    p.add_argument("--algos", default="grpo", help="comma-separated: grpo, gspo")
    p.add_argument("--publish", action="store_true", help=f"write {RESULTS} and its .json")
    p.add_argument("--report_only", action="store_true", help="rewrite from <workdir>'s result")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)
    algos = tuple(a for a in args.algos.split(",") if a)
    if not algos or set(algos) - {"grpo", "gspo"}:
        raise ValueError(f"--algos={args.algos!r}: name grpo and/or gspo")
    root = args.workdir or f"/tmp/moe_volatility_{args.scale}"
    argv = sys.argv[1:] if argv is None else list(argv)
    command = "python -m experiments.gspo_vs_grpo.volatility " + " ".join(argv)
    if args.report_only:
        with open(os.path.join(root, "result.json")) as f:
            result = json.load(f)
        result["tables"] = _tables(result["raw"])  # this code's summaries of the raw rows
    else:
        result = run(args.scale, root, algos, command.strip())
    from experiments.gspo_vs_grpo.volatility_report import markdown

    out = RESULTS if args.publish else os.path.join(root, os.path.basename(RESULTS))
    with open(out, "w") as f:
        f.write(markdown(result))
    with open(out.replace(".md", ".json"), "w") as f:
        json.dump(result, f, indent=1)  # raw: every measurement, to recompute from
    log.info("wrote %s", out)
    return result


if __name__ == "__main__":
    main()
