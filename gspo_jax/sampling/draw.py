"""Token draws: which distribution a sampled token comes from, and its log-prob.

`static.decode` and `continuous.engine_loop` call `next_token` once per decode step (inside
their while_loops), every row with its own key (`row_keys`: sequence index, token index):
temperature τ, then top-k, then top-p on the logits (`filter_logits`), then one
categorical draw per row by inverse CDF (`draw_categorical`); greedy (τ = 0) is argmax.
The log-prob reported with each token is always of the *unfiltered* softmax(logits / τ),
computed by the trainer's own `logprobs_from_logits` so that sampler and trainer
log-probs run the same arithmetic (paper §5.4: sampler likelihoods as π_old). To try
another sampling rule (min-p, typical sampling, ...), this is the module to change.

Shape letters: B rows, V vocab.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from gspo_jax.algorithm.logprobs import logprobs_from_logits
from gspo_jax.models import partition

F32 = jnp.float32


def filter_logits(z_BV, *, top_k: int | None = None, top_p: float | None = None):
    """Top-k then top-p (nucleus) filtering of already tempered logits z = logits / τ.

    top-k keeps z_v ≥ (k-th largest z); top-p then keeps, of what is left, the most likely
    tokens whose probability mass before them is < top_p (the smallest set with mass ≥ top_p;
    the most likely token always stays), with probabilities renormalised over the top-k set —
    the order of transformers' TopK then TopP warpers. Everything else becomes −inf. Ties at a
    threshold are all kept. Top-k uses `lax.top_k`; top-p sorts the top-k values (or all V
    logits without top-k).
    """
    V = z_BV.shape[-1]
    threshold = None
    sorted_desc = None
    if top_k is not None and top_k < V:
        sorted_desc, _ = jax.lax.top_k(z_BV, top_k)
        threshold = sorted_desc[..., -1:]
    if top_p is not None and top_p < 1.0:
        if sorted_desc is None:
            sorted_desc = -jnp.sort(-z_BV, axis=-1)
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        count = jnp.sum(mass_before < top_p, axis=-1, keepdims=True)  # ≥ 1
        threshold_p = jnp.take_along_axis(sorted_desc, jnp.maximum(count, 1) - 1, axis=-1)
        threshold = threshold_p if threshold is None else jnp.maximum(threshold, threshold_p)
    if threshold is None:
        return z_BV
    return jnp.where(z_BV >= threshold, z_BV, -jnp.inf)


def _argmax(x_BV):
    """argmax over the last axis, ties -> lowest index (as jnp.argmax / torch.argmax).

    Two plain reductions: XLA:CPU runs the variadic (value, index) reduce of jnp.argmax
    several times slower over a [B, V] row than a max and a min.
    """
    top = jnp.max(x_BV, axis=-1, keepdims=True)
    index = jnp.arange(x_BV.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(x_BV == top, index, x_BV.shape[-1]), axis=-1).astype(jnp.int32)


def _block_size(V: int) -> int:
    """Inverse-CDF block width: a power of two near √V (two short scans instead of one long)."""
    return int(min(512, max(16, 2 ** round(math.log2(math.sqrt(V))))))


def row_keys(rng, sequence_B, position_B):
    """Per-row keys fold_in(fold_in(rng, sequence), position): the key of a response token
    depends only on which sequence it belongs to and its index in the response, never on
    the decode row (slot) or the step it was drawn at — the static and continuous samplers
    draw the same tokens from the same rng."""

    def one(s, t):
        return jax.random.fold_in(jax.random.fold_in(rng, s), t)

    return jax.vmap(one)(sequence_B, position_B)


def row_uniforms(keys_B):
    """One f32 uniform in [0, 1) per row from its own key: [B, 1]."""
    return jax.vmap(lambda k: jax.random.uniform(k, (1,), F32))(keys_B)


def draw_categorical(z_BV, key=None, *, u_B1=None, shards: int = 1):
    """One draw per row from softmax(z) (z may hold −inf), by inverse CDF: one f32 uniform
    per row (from `key`, or given as `u_B1`, e.g. `row_uniforms` of per-row keys), u·Σp
    located first among the vocabulary's `shards` slices, then among the chosen slice's
    block sums, then inside the chosen block.

        p = exp(z − max z),  token = min{i : Σ_{j≤i} p_j > u·Σ_j p_j}

    Costs one exp pass over [B, V] plus [B, V/blk] and [B, blk] scans — far cheaper on CPU
    than Gumbel-max, which needs B·V random numbers per step. Tokens with p = 0 are never
    drawn (each index is clamped to the last positive entry, against rounding); u has 2⁻²³
    resolution, so probabilities below ~1e-7 are resolved only to that grain.

    `shards` (dividing V): the vocabulary slices the logits are split over (the rollout's
    tensor layout, `next_token`). Every slice runs the block search locally with the
    position u falls at within the slice chosen from the [B, shards] slice masses, and the
    chosen slice's token is kept: what crosses chips is a row max, the [B, shards] masses
    and one int per row, never the [B, V] logits. With shards = 1 it is the plain two-level
    search, to the bit.
    """
    B, V = z_BV.shape
    X = int(shards)
    if X < 1 or V % X:
        raise ValueError(f"shards={shards} must divide the vocabulary ({V})")
    Vx = V // X
    blk = _block_size(Vx)
    nb = -(-Vx // blk)
    z = z_BV.astype(F32)
    p_BXv = jnp.exp(z - jnp.max(z, axis=-1, keepdims=True)).reshape(B, X, Vx)
    if X > 1:
        p_BXv = partition.constrain(p_BXv, ("batch", "vocab", None))
    if nb * blk != Vx:  # exp(−inf) = 0: padding with zeros is padding z with −inf
        p_BXv = jnp.pad(p_BXv, ((0, 0), (0, 0), (0, nb * blk - Vx)))
    p_BXNb = p_BXv.reshape(B, X, nb, blk)
    mass_BXN = jnp.sum(p_BXNb, axis=-1)
    cdf_BXN = jnp.cumsum(mass_BXN, axis=-1)
    slice_cdf_BX = jnp.cumsum(cdf_BXN[..., -1], axis=-1)
    if u_B1 is None:
        u_B1 = jax.random.uniform(key, (B, 1), F32)
    u_B1 = u_B1 * slice_cdf_BX[:, -1:]
    # Which slice: as the block search below, one level up.
    x_index = jnp.arange(X, dtype=jnp.int32)
    last_slice = jnp.max(jnp.where(cdf_BXN[..., -1] > 0, x_index, 0), axis=-1, keepdims=True)
    x_B1 = jnp.minimum(jnp.sum(slice_cdf_BX <= u_B1, axis=-1, keepdims=True), last_slice)
    before_B1 = jnp.where(
        x_B1 > 0, jnp.take_along_axis(slice_cdf_BX, jnp.maximum(x_B1 - 1, 0), axis=-1), 0.0
    )
    u_BX1 = (u_B1 - before_B1)[:, None, :]  # where u falls within its slice, on every slice
    block_index = jnp.arange(nb, dtype=jnp.int32)
    last_block = jnp.max(jnp.where(mass_BXN > 0, block_index, 0), axis=-1, keepdims=True)
    j_BX1 = jnp.minimum(jnp.sum(cdf_BXN <= u_BX1, axis=-1, keepdims=True), last_block)
    before_BX1 = jnp.where(
        j_BX1 > 0, jnp.take_along_axis(cdf_BXN, jnp.maximum(j_BX1 - 1, 0), axis=-1), 0.0
    )
    p_BXb = jnp.take_along_axis(p_BXNb, j_BX1[..., None], axis=2)[:, :, 0]
    in_index = jnp.arange(blk, dtype=jnp.int32)
    last_in = jnp.max(jnp.where(p_BXb > 0, in_index, 0), axis=-1, keepdims=True)
    t_BX1 = jnp.sum(jnp.cumsum(p_BXb, axis=-1) <= u_BX1 - before_BX1, axis=-1, keepdims=True)
    token_BX = x_index * Vx + (j_BX1 * blk + jnp.minimum(t_BX1, last_in))[..., 0]
    return jnp.sum(jnp.where(x_index == x_B1, token_BX, 0), axis=-1).astype(jnp.int32)


def next_token(logits_BV, keys_B, temperature: float, top_k, top_p):
    """(token [B], log-prob [B]) for one step: one categorical draw per row from the
    filtered tempered distribution (`draw_categorical`), row b's uniform from its own key
    keys_B[b] (`row_keys`); greedy is argmax. The log-prob is always of the unfiltered
    softmax(logits / τ) (τ = 1 for greedy), via the trainer's `logprobs_from_logits`."""
    if temperature == 0.0:
        token = _argmax(logits_BV)
        return token, logprobs_from_logits(logits_BV, token, 1.0)
    z = logits_BV.astype(F32) / temperature
    u_B1 = row_uniforms(keys_B)
    if partition.rows_whole():
        # Rows whole (the rollout layout): left alone, GSPMD split the keys' threefry over
        # the chips and all-to-all'ed it back, 6 collectives per decoded token.
        u_B1 = partition.constrain(u_B1, ("batch", None))
    # Vocabulary-sharded logits (the rollout's tensor layout) are drawn from where they are.
    shards = partition.shards("vocab", z.shape[-1])
    token = draw_categorical(filter_logits(z, top_k=top_k, top_p=top_p), u_B1=u_B1, shards=shards)
    return token, logprobs_from_logits(logits_BV, token, temperature)
