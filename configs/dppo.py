"""DPPO: Divergence Proximal Policy Optimization (Qi et al., arXiv 2602.04879).

The paper replaces PPO's ratio clip by a trust region on a divergence between π_old and π_θ
at the sampled token, approximated on the binary distribution {y_t, not y_t} ("Binary-TV",
"Binary-KL"): with p = π_θ(y_t), p_old = π_old(y_t),

    L_t = −Â · sg(min(r_t, w_max)) · log π_θ(y_t) · m_t
    TV:  m_t = 0 if (Â > 0 and p − p_old > δ_high) or (Â < 0 and p − p_old < −δ_low)
    KL:  m_t = 0 if KL(p_old ‖ p) > δ and p moved in Â's direction

so a low-probability token may change its ratio a lot (a small change in probability) while
a high-probability one may not; the paper argues that PPO's ratio clip does the reverse.
Thresholds: the paper's δ = 0.15 (TV) and 0.05 (KL); w_max = dppo_max_weight = 5 (our choice:
the weight cap is a stability guard, not a published setting). On the default task:

  python -m gspo_jax.main --config=configs/dppo.py --workdir=/tmp/dppo_tv
  python -m gspo_jax.main --config=configs/dppo.py:variant=kl --workdir=/tmp/dppo_kl

Measured on the default task (TV, 250 steps): it learns on one seed of three at this learning
rate (docs/objectives.md).
"""

from configs import common, default

VARIANTS = {"tv": ("dppo_tv", 0.15), "kl": ("dppo_kl", 0.05)}


def get_config(arg: str | None = None):
    args = common.parse_arg(arg, variant="tv")
    if args["variant"] not in VARIANTS:
        raise ValueError(
            f"configs/dppo.py: variant={args['variant']!r} is not one of {list(VARIANTS)}"
        )
    mode, delta = VARIANTS[args["variant"]]
    c = default.get_config()
    c.loss_mode = mode
    c.importance_sampling = "token"
    c.dppo_delta_low = delta
    c.dppo_delta_high = delta
    c.dppo_max_weight = 5.0
    c.loss_agg_mode = "token-mean"
    c.num_mini_batches = 4
    return c
