"""The metrics of `objectives.policy_loss` (clip and limited fractions, ratio range, approx.
KL, log s_i by response length), computed from its intermediates, without gradient.
"""

import jax
import jax.numpy as jnp

from gspo_jax.algorithm.kl import kl_k3
from gspo_jax.algorithm.masked import masked_mean, safe_count

# Response-length buckets of the by_length/* metrics: [1, 4), [4, 8), ..., [256, inf).
LENGTH_EDGES = (1, 4, 8, 16, 32, 64, 128, 256)


def length_buckets() -> tuple[tuple[str, int, int | None], ...]:
    """(name, lo, hi) of each response-length bucket: lengths lo <= n < hi (hi None: no
    upper end); names "1-3", ..., "256+"."""
    ends = (*LENGTH_EDGES[1:], None)
    return tuple(
        (f"{lo}-{hi - 1}" if hi else f"{lo}+", lo, hi) for lo, hi in zip(LENGTH_EDGES, ends)
    )


def policy_metrics(sequence_level: bool, loss, logp_BT, old_BT, mask_BT, ratio_BT, flags, clamp):
    """The metrics `objectives.policy_loss` documents, from its intermediates (no gradient)."""
    sg = jax.lax.stop_gradient
    logp_BT, ratio_BT = sg(logp_BT), sg(ratio_BT)
    valid_BT = mask_BT > 0
    valid_B = jnp.any(valid_BT, axis=-1)
    n_tok = jnp.sum(mask_BT)
    n_seq = jnp.sum(valid_B.astype(jnp.float32))

    def tok_frac(flag_BT):
        return jnp.sum(flag_BT.astype(jnp.float32)) / safe_count(n_tok)

    def seq_frac(flag_BT):
        flag_B = jnp.any(flag_BT, axis=-1) & valid_B
        return jnp.sum(flag_B.astype(jnp.float32)) / safe_count(n_seq)

    if sequence_level:
        # One ratio per sequence: the max over its valid tokens is that value, exactly.
        values = jnp.max(jnp.where(valid_BT, ratio_BT, -jnp.inf), axis=-1)
        valid, count = valid_B, n_seq
        values = jnp.where(valid, values, 1.0)
    else:
        values, valid, count = ratio_BT, valid_BT, n_tok
    any_valid = count > 0
    token_log_ratio_BT = jnp.where(valid_BT, logp_BT - old_BT, 0.0)
    # k3 of KL(π_old ‖ π_θ) from samples of π_old: r − 1 − log r with r = π_θ / π_old.
    k3_BT = kl_k3(-jnp.clip(token_log_ratio_BT, -clamp, clamp))
    clipped_BT = flags["low"] | flags["high"]
    metrics = {
        "pg_loss": loss,
        "limited_frac": tok_frac(flags["limited"]),
        "limited_frac_seq": seq_frac(flags["limited"]),
        "weight_mean": masked_mean(sg(flags["weight"]), mask_BT),
        "clipfrac": tok_frac(clipped_BT),
        "clipfrac_low": tok_frac(flags["low"]),
        "clipfrac_high": tok_frac(flags["high"]),
        "clipfrac_range": tok_frac(flags["range"]),
        "clipfrac_seq": seq_frac(clipped_BT),
        "clipfrac_seq_low": seq_frac(flags["low"]),
        "clipfrac_seq_high": seq_frac(flags["high"]),
        "clipfrac_seq_range": seq_frac(flags["range"]),
        "dual_clipfrac": tok_frac(flags["dual"]),
        "ratio_min": jnp.where(any_valid, jnp.min(jnp.where(valid, values, jnp.inf)), 1.0),
        "ratio_mean": jnp.where(any_valid, masked_mean(values, valid.astype(jnp.float32)), 1.0),
        "ratio_max": jnp.where(any_valid, jnp.max(jnp.where(valid, values, -jnp.inf)), 1.0),
        "approx_kl": masked_mean(-token_log_ratio_BT, mask_BT),
        "approx_kl_k3": masked_mean(k3_BT, mask_BT),
        "num_valid_tokens": n_tok,
        "num_valid_seqs": n_seq,
    }
    n_B = jnp.sum(valid_BT, axis=-1)
    log_s_B = jnp.sum(token_log_ratio_BT, axis=-1) / jnp.maximum(n_B, 1)
    for name, lo, hi in length_buckets():
        in_B = valid_B & (n_B >= lo) & ((n_B < hi) if hi else True)
        metrics[f"by_length/log_s_sq_{name}"] = jnp.sum(jnp.where(in_B, log_s_B**2, 0.0))
        metrics[f"by_length/seqs_{name}"] = jnp.sum(in_B.astype(jnp.float32))
    return {k: sg(jnp.asarray(v, jnp.float32)) for k, v in metrics.items()}
