"""RLOO: REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al., "Back to Basics",
arXiv 2402.14740).

Each response's baseline is the mean reward of the other G − 1 responses to its prompt:

    Â_i = R_i − (1/(G − 1)) Σ_{j≠i} R_j

an unbiased baseline (R_i never enters its own). With the policy gradient here the loss is
GRPO's clipped token-level surrogate (ε = 0.2 / 0.27, 4 mini-batches) with RLOO's
advantages in place of the group z-score. On the default task:

  python -m gspo_jax.main --config=configs/rloo.py --workdir=/tmp/rloo

No result is recorded for this preset yet.
"""

from configs import common, default


def get_config(arg: str | None = None):
    common.no_arg(arg, "configs/rloo.py")
    c = default.get_config()
    c.adv_estimator = "rloo"
    c.loss_mode = "clip"
    c.importance_sampling = "token"
    c.clip_low, c.clip_high = 0.2, 0.27
    c.loss_agg_mode = "seq-mean-token-mean"
    c.num_mini_batches = 4
    return c
