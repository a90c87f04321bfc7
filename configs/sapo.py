"""SAPO: Soft Adaptive Policy Optimization (Gao et al., Qwen team, arXiv 2511.20347).

The paper's objective replaces the clip by a temperature-controlled soft gate on the ratio:

    J(θ) = E[ (1/G) Σ_i (1/|y_i|) Σ_t f_i,t(r_i,t(θ)) · Â_i ],
    f(r) = (4/τ) · σ(τ (r − 1)),   τ = τ_pos (Â > 0) or τ_neg (Â ≤ 0)

whose gradient weight is sech²(τ (r − 1) / 2): 1 on policy, decaying smoothly off policy,
faster for negative advantages (τ_neg = 1.05 > τ_pos = 1.0, the paper's settings). Nothing
is cut: `policy/weight_mean` is the mean gate, `policy/limited_frac` the tokens it halves.
The default task (configs/default.py) with GRPO's token ratio, as published:

  python -m gspo_jax.main --config=configs/sapo.py --workdir=/tmp/sapo
  # sequence-level SAPO (GSPO's s_i inside the gate):
  python -m gspo_jax.main --config=configs/sapo.py:level=seq --workdir=/tmp/sapo_seq

Measured once (seed 0, 2-core Intel CPU shared with other jobs, 9 min 42 s): held-out greedy
accuracy 33.6% at the start of RL -> 35.4% after 250 steps (39.8% at step 150; README's
configs/default.py GSPO run of seed 0, from the same 33.6%: -> 41.4%). The gate stayed near 1
(policy/weight_mean 0.9995 on average): at this learning rate the ratios stay close to 1 and
SAPO acts almost as the plain policy gradient. One seed is not a comparison: run the
experiment's arms (docs/objectives.md, "Comparing them").
"""

from configs import common, default

LEVELS = {"token": "token", "seq": "seq"}


def get_config(arg: str | None = None):
    args = common.parse_arg(arg, level="token")
    if args["level"] not in LEVELS:
        raise ValueError(f"configs/sapo.py: level={args['level']!r} is not one of {list(LEVELS)}")
    c = default.get_config()
    c.loss_mode = "sapo"
    c.importance_sampling = LEVELS[args["level"]]
    c.sapo_tau_pos = 1.0
    c.sapo_tau_neg = 1.05
    c.loss_agg_mode = "seq-mean-token-mean"
    c.num_mini_batches = 4
    return c
