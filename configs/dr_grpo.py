"""Dr. GRPO: GRPO done right (Liu et al., "Understanding R1-Zero-Like Training: A Critical
Perspective", arXiv 2503.20783).

The paper removes GRPO's two normalisations that bias it: the 1/|o_i| length normalisation
(longer wrong answers are penalised less per token) and the division by the group's reward
std (easy and hard questions weigh more). Its objective:

    J(θ) = E[ (1/G) Σ_i Σ_t min( r_i,t Â_i,t, clip(r_i,t, 1 − ε, 1 + ε) Â_i,t ) ] / L_max,
    Â_i,t = R_i − mean({R_1, ..., R_G})

Here: norm_adv_by_std_in_grpo=False (mean-centred advantages) and loss_agg_mode
"seq-mean-token-sum-norm" (the sum over tokens divided by a constant, the configured
response_length), GRPO's token ratio and ε = 0.2. On the default task:

  python -m gspo_jax.main --config=configs/dr_grpo.py --workdir=/tmp/dr_grpo

No result is recorded for this preset yet.
"""

from configs import common, default


def get_config(arg: str | None = None):
    common.no_arg(arg, "configs/dr_grpo.py")
    c = default.get_config()
    c.adv_estimator = "grpo"
    c.norm_adv_by_std_in_grpo = False
    c.loss_agg_mode = "seq-mean-token-sum-norm"
    c.loss_mode = "clip"
    c.importance_sampling = "token"
    c.clip_low, c.clip_high = 0.2, 0.2
    c.num_mini_batches = 4
    return c
