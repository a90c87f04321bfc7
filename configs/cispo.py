"""CISPO: Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv 2506.13585).

The paper's objective clips the importance-sampling weight, never the gradient path:

    J(θ) = E[ (1 / Σ_i |o_i|) Σ_i Σ_t sg(r̂_i,t(θ)) · Â_i,t · log π_θ(o_i,t | ·) ],
    r̂ = clip(r, 1 − ε_low, 1 + ε_high)

so every token keeps a gradient −r̂·Â·∇log π (PPO's clip drops the tokens whose ratio left
the range; CISPO only bounds their weight). MiniMax sets no lower bound (ε_low large) and
tunes ε_high; peers differ on the cap 1 + ε_high: verl's example 1.2, ScaleRL and slime 5,
NeMo-RL 6 (docs/objectives.md). This preset: clip_low = 1.0 (no lower bound), clip_high = 4.0
(a cap of 5), the token mean over the batch (the 1 / Σ|o_i| above), on the default task:

  python -m gspo_jax.main --config=configs/cispo.py --workdir=/tmp/cispo

No result is recorded for this preset yet.
"""

from configs import common, default


def get_config(arg: str | None = None):
    common.no_arg(arg, "configs/cispo.py")
    c = default.get_config()
    c.loss_mode = "cispo"
    c.importance_sampling = "token"
    c.clip_low = 1.0  # 1 − clip_low = 0: no lower bound on the weight
    c.clip_high = 4.0  # the weight is capped at 5
    c.loss_agg_mode = "token-mean"
    c.num_mini_batches = 4
    return c
