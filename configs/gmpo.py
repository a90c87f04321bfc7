"""GMPO: Geometric-Mean Policy Optimization (Zhao et al., arXiv 2507.20673).

The paper's objective maximises the geometric mean of the token-level rewards, clipped in
log space token by token:

    J(θ) = E[ (1/G) Σ_i Â_i · Π_t { sgn(Â_i) · min( sgn(Â_i) r_t, sgn(Â_i) clip(r_t, e^−ε_low,
           e^ε_high) ) }^{sgn(Â_i) / |o_i|} ]

i.e. log ρ_i = mean_t sgn(Â)·min(sgn(Â)·log r_t, sgn(Â)·clip(log r_t, −ε_low, ε_high)) and
the loss −Â_i·ρ_i. An outlier token moves the geometric mean far less than the arithmetic
one, so the range can be wider than GRPO's: the paper's (e^−0.4, e^0.4), i.e.
clip_low = clip_high = 0.4 here (log space). Token ratios are required
(importance_sampling="token"). On the default task:

  python -m gspo_jax.main --config=configs/gmpo.py --workdir=/tmp/gmpo

No result is recorded for this preset yet.
"""

from configs import common, default


def get_config(arg: str | None = None):
    common.no_arg(arg, "configs/gmpo.py")
    c = default.get_config()
    c.loss_mode = "gmpo"
    c.importance_sampling = "token"
    c.clip_low = 0.4  # log space: log r_t >= -0.4
    c.clip_high = 0.4  # log r_t <= 0.4
    c.loss_agg_mode = "seq-mean-token-mean"  # every token of a sequence carries -A_i·rho_i
    c.num_mini_batches = 4
    return c
