"""LUSPO: length-unbiased GSPO (arXiv 2602.05261).

GSPO's per-sequence term, multiplied by the response's length and averaged over sequences:

    J(θ) = (1/G) Σ_i |y_i| · min( s_i Â_i, clip(s_i, 1 − ε_low, 1 + ε_high) Â_i ),
    s_i = exp( (1/|y_i|) Σ_t log π_θ(y_i,t)/π_old(y_i,t) )

GSPO's 1/|y_i| normalisation gives a long response as much weight as a short one in total,
hence less per token; LUSPO removes that length bias. Here that is exactly GSPO's ratio
(importance_sampling="seq") with loss_agg_mode="seq-mean-token-sum" (each of the |y_i| tokens
carries the sequence's term); config validation warns about that aggregation with other
sequence-level settings, not here. GSPO's clip range (3e-4 / 4e-4). On the default task:

  python -m gspo_jax.main --config=configs/luspo.py --workdir=/tmp/luspo

No result is recorded for this preset yet.
"""

from configs import common, default


def get_config(arg: str | None = None):
    common.no_arg(arg, "configs/luspo.py")
    c = default.get_config()
    c.loss_mode = "clip"
    c.importance_sampling = "seq"
    c.loss_agg_mode = "seq-mean-token-sum"
    c.clip_low, c.clip_high = 3e-4, 4e-4
    c.num_mini_batches = 4
    return c
