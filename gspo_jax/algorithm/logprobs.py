"""Per-token and per-sequence log-probabilities, chunked so that [B, T, V] logits never exist.

Where it sits: the train step (and the old/ref log-prob pass) runs the model trunk to get
final hidden states, then calls `token_logprobs(hidden_BTD, unembed_DV, targets_BT)` instead
of `log_softmax(forward(...))`. The sampler, which only ever holds one position's [B, V]
logits, calls `logprobs_from_logits` on them. Both paths share `_logprob_and_entropy`, so the
sampler's and the trainer's numbers go through the same f32 arithmetic (divide by τ, then a
max-shifted log-softmax). Sequence-level reductions for GSPO (paper §4, the 1/|y_i| length
normalisation of the sequence log-ratio) live at the bottom.

Why chunks (docs/architecture.md, performance rules): with Qwen's vocabulary V = 151,936 one 4k-token response is 2.5 GB
of f32 logits, and autodiff would keep that plus its cotangent alive. Here the forward pass
runs over chunks of about `chunk_size` tokens and keeps only per-token scalars (log p, the
logsumexp, the entropy); the backward pass is a hand-written `custom_vjp` that recomputes the
logits once, one vocabulary slice at a time, and forms their cotangent (onehot − softmax)
directly. Neither pass holds more than about chunk_size·V f32 logit values at once. See
`_core_bwd` for why the backward slices the vocabulary, and `benchmarks/logprobs_memory.py`
for the measurements against full logits, `jax.checkpoint` of a chunk, and a token-chunked
backward.

Contract a caller must know:
  * The caller shifts. `hidden_BTD[b, t]` is the hidden state whose logits predict
    `targets_BT[b, t]` (for a causal LM, the trunk's output at position p predicts the token
    at p + 1; slice both before calling). Nothing here shifts.
  * `targets_BT` must hold valid ids in [0, V) everywhere, padded positions included (use
    the pad id and mask the result). Under jit a bad id cannot raise; it gives a NaN
    log-prob, so it is loud rather than silently wrong.
  * `temperature` is a static Python float > 0 (greedy decoding has no log-probs to match).
  * Reverse-mode only (`custom_vjp`): `jax.grad`/`vjp`/`vmap` work, `jax.jvp` does not.

Shape letters: B batch (responses), T tokens per response, D model width, V vocabulary,
J number of chunks (or vocabulary slices), I token positions per chunk (per row), Vc columns
per vocabulary slice of the backward pass.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from gspo_jax.algorithm.masked import row_mean

__all__ = [
    "logprobs_from_logits",
    "sequence_logprob_mean",
    "sequence_logprob_sum",
    "token_logprobs",
    "token_logprobs_naive",
]


# ----------------------------------------------------------------------------- validation


def _check_temperature(temperature) -> float:
    """Returns `temperature` as a Python float, or raises naming the argument."""
    if isinstance(temperature, jax.core.Tracer):
        raise TypeError(
            "temperature must be a static Python number, got a traced value; pass it as a "
            "static argument (it selects the distribution, it is not data)."
        )
    try:
        value = float(temperature)
    except (TypeError, ValueError) as e:
        raise TypeError(f"temperature must be a number, got {temperature!r}") from e
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(
            f"temperature must be a finite number > 0 for log-probabilities, got {temperature!r} "
            "(temperature=0 is greedy decoding, which has no log-probabilities to match)."
        )
    return value


def _check_chunk_size(chunk_size) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    return chunk_size


def _check_shapes(hidden_BTD, unembed_DV, targets_BT) -> None:
    if hidden_BTD.ndim != 3:
        raise ValueError(f"hidden_BTD must be [B, T, D], got shape {hidden_BTD.shape}")
    if unembed_DV.ndim != 2 or unembed_DV.shape[0] != hidden_BTD.shape[2]:
        raise ValueError(
            f"unembed_DV must be [D, V] with D = hidden_BTD.shape[2] = {hidden_BTD.shape[2]}, "
            f"got shape {unembed_DV.shape}"
        )
    if targets_BT.shape != hidden_BTD.shape[:2]:
        raise ValueError(
            f"targets_BT must be [B, T] = {hidden_BTD.shape[:2]} (same as hidden_BTD), "
            f"got shape {targets_BT.shape}"
        )
    if not jnp.issubdtype(targets_BT.dtype, jnp.integer):
        raise TypeError(f"targets_BT must be an integer array, got dtype {targets_BT.dtype}")


# ----------------------------------------------------------------------------- shared math


def _scaled_logits(logits_V, temperature: float):
    """z = logits / τ in f32 — the one place the temperature enters."""
    return logits_V.astype(jnp.float32) / temperature


def _logprob_and_entropy(z_V, targets, want_entropy: bool):
    """log p(target) and entropy of softmax(z), over the last axis of `z_V` (already f32, /τ).

    log p(y) = (z_y − m) − log Σ_v exp(z_v − m)        (m = max_v z_v, for stability)
    H        = −Σ_v p_v log p_v,   log p_v = z_v − logsumexp(z)   (= logsumexp(z) − Σ_v p_v z_v)

    The target logit is gathered (a one-hot masked sum would materialise another [*, V]
    array); an id outside [0, V) gathers NaN, so a bad target is loud, never a silent
    −logsumexp. Also returns lse = logsumexp(z), the residual the backward pass needs.
    """
    # m only shifts for stability: no gradient flows through it (it cancels exactly).
    m = jax.lax.stop_gradient(jnp.max(z_V, axis=-1, keepdims=True))
    shifted_V = z_V - m
    exp_V = jnp.exp(shifted_V)
    sum_exp = jnp.sum(exp_V, axis=-1)
    log_sum_exp = jnp.log(sum_exp)
    z_target = jnp.take_along_axis(
        z_V,
        targets[..., None],
        axis=-1,
        mode="fill",
        fill_value=jnp.nan,
        wrap_negative_indices=False,
    )[..., 0]
    # (z_y − m) − log Σ exp(z − m): the same operations, in the same order, as log_softmax.
    logprob = (z_target - m[..., 0]) - log_sum_exp
    lse = log_sum_exp + m[..., 0]
    if not want_entropy:
        return logprob, None, lse
    # A separate pass from z and lse (one more exp) rather than reusing exp(z − m): each
    # reduction then fuses its elementwise work, and no second [*, V] array is materialised.
    logp_V = z_V - lse[..., None]
    entropy = -jnp.sum(jnp.exp(logp_V) * logp_V, axis=-1)
    return logprob, entropy, lse


def _chunk_logits(hidden_BID, unembed_DV, temperature: float):
    # preferred_element_type: bf16 inputs accumulate the D-sum in f32 (the "upcast to f32");
    # f32 inputs are unaffected.
    logits_BIV = jnp.einsum(
        "bid,dv->biv", hidden_BID, unembed_DV, preferred_element_type=jnp.float32
    )
    return _scaled_logits(logits_BIV, temperature)


# ----------------------------------------------------------------------------- chunked core

# Vocabulary slices of the backward pass are a multiple of this many columns (the TPU lane
# width), so the recomputed logit tiles stay lane-aligned.
_VOCAB_ALIGN = 128


def _to_chunks(hidden_BTD, targets_BT, chunk_size: int):
    """[B, T, ·] -> [J, B, I, ·] with I = positions per chunk, padding T up to J·I.

    Chunks are [B, I] slabs of the B·T tokens (I = chunk_size // B, at least 1, at most T), so
    a chunk holds about chunk_size tokens. Slicing along T rather than along the flattened
    B·T axis keeps a batch-sharded `hidden_BTD` sharded through the loop: each device
    computes its own rows of every chunk instead of one device holding a whole chunk.
    Padded positions get zero hidden states and target 0 and are sliced off afterwards.
    """
    B, T, D = hidden_BTD.shape
    I = min(T, max(1, chunk_size // max(B, 1)))
    J = -(-T // I)
    pad = J * I - T
    if pad:
        hidden_BTD = jnp.pad(hidden_BTD, ((0, 0), (0, pad), (0, 0)))
        targets_BT = jnp.pad(targets_BT, ((0, 0), (0, pad)))
    hidden_JBID = hidden_BTD.reshape(B, J, I, D).transpose(1, 0, 2, 3)
    targets_JBI = targets_BT.reshape(B, J, I).transpose(1, 0, 2)
    return hidden_JBID, targets_JBI


def _from_chunks(x_JBI, T: int):
    J, B, I = x_JBI.shape
    return x_JBI.transpose(1, 0, 2).reshape(B, J * I)[:, :T]


def _forward(temperature, chunk_size, want_entropy, hidden_BTD, unembed_DV, targets_BT):
    """Token-chunked forward: (logprob_BT, entropy_BT or None, lse_BT); one chunk's logits live."""
    T = hidden_BTD.shape[1]
    hidden_JBID, targets_JBI = _to_chunks(hidden_BTD, targets_BT, chunk_size)

    def one_chunk(xs):
        hidden_BID, targets_BI = xs
        z_BIV = _chunk_logits(hidden_BID, unembed_DV, temperature)
        return _logprob_and_entropy(z_BIV, targets_BI, want_entropy)

    logprob_JBI, entropy_JBI, lse_JBI = jax.lax.map(one_chunk, (hidden_JBID, targets_JBI))
    entropy_BT = _from_chunks(entropy_JBI, T) if want_entropy else None
    return _from_chunks(logprob_JBI, T), entropy_BT, _from_chunks(lse_JBI, T)


def _core_impl(temperature, chunk_size, want_entropy, hidden_BTD, unembed_DV, targets_BT):
    logprob_BT, entropy_BT, _ = _forward(
        temperature, chunk_size, want_entropy, hidden_BTD, unembed_DV, targets_BT
    )
    return logprob_BT, entropy_BT


_core = jax.custom_vjp(_core_impl, nondiff_argnums=(0, 1, 2))


def _core_fwd(temperature, chunk_size, want_entropy, hidden_BTD, unembed_DV, targets_BT):
    logprob_BT, entropy_BT, lse_BT = _forward(
        temperature, chunk_size, want_entropy, hidden_BTD, unembed_DV, targets_BT
    )
    # Residuals: the inputs plus two floats per token; no [*, V] array survives the forward.
    residuals = (hidden_BTD, unembed_DV, targets_BT, lse_BT, entropy_BT)
    return (logprob_BT, entropy_BT), residuals


def _vocab_slices(num_tokens: int, V: int, chunk_size: int):
    """(J, Vc): J slices of Vc columns covering [0, V), with num_tokens·Vc ≈ chunk_size·V / 2.

    Half a forward chunk, because a backward step keeps two such arrays alive (the recomputed
    logits and their cotangent) where a forward step keeps one: both passes then peak at
    about chunk_size·V f32 values.
    """
    J = max(1, -(-2 * num_tokens // chunk_size))
    Vc = -(-V // J)
    Vc = min(V, -(-Vc // _VOCAB_ALIGN) * _VOCAB_ALIGN)
    return -(-V // Vc), Vc


def _mesh_in_context() -> bool:
    """Whether the pass is traced under a mesh of several devices (`jax.set_mesh`).

    There the backward takes W whole, once, before its loop, and returns ∂L/∂W's column
    blocks as the loop's output, laid side by side after it (`_side_by_side`): with W and
    its gradient sharded along V (tensor parallelism), `dynamic_slice` of W and
    `dynamic_update_slice` into a gradient carry each made XLA gather the whole array at
    every slice, inside the loop. Each block is then one all-reduce over the batch axes:
    ∂L/∂W once per pass. Without a mesh the blocks are written in place into one carry
    (no second W-sized array); the values are the same either way.
    """
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and mesh.size > 1


def _side_by_side(blocks_JDVc, V: int):
    """[J, D, Vc] column blocks of slices [k·Vc, (k+1)·Vc), the last one shifted to end at
    V (`_core_bwd`) -> [D, V]: the last block's columns shared with the one before are
    dropped (their cotangent there was masked to zero)."""
    J, D, Vc = blocks_JDVc.shape
    head_DX = blocks_JDVc[:-1].transpose(1, 0, 2).reshape(D, (J - 1) * Vc)
    tail_DY = blocks_JDVc[-1][:, J * Vc - V :]
    return jnp.concatenate([head_DX, tail_DY], axis=1)


def _core_bwd(temperature, chunk_size, want_entropy, residuals, cotangents):
    """Vocab-sliced backward: recompute each slice of logits once, form ∂L/∂logits directly.

    With z = (h·W)/τ, log p = z − lse, p = exp(log p), and cotangents g (of log p(y)) and
    g_H (of H):
        ∂ log p(y) / ∂z = onehot(y) − p
        ∂ H / ∂z        = −p ⊙ (log p + H)          (from H = lse − Σ p z)
        ∂L/∂logits      = [g (onehot − p) − g_H p ⊙ (log p + H)] / τ
        ∂L/∂h = (∂L/∂logits) Wᵀ,   ∂L/∂W = hᵀ (∂L/∂logits)

    The loop runs over slices of the vocabulary, each with all B·T tokens ([B, T, Vc] logits,
    about chunk_size·V / 2 elements, see `_vocab_slices`), not over token chunks: then each
    column block of ∂L/∂W comes out of one matmul (f32 accumulation over all tokens inside it)
    and is written in place into the result. Accumulating ∂L/∂W over token chunks instead
    needs a [D, V] matmul result per step before the add, which XLA's CPU backend does not
    fuse: a temporary the size of W (measured in benchmarks/logprobs_memory.py). It also lets
    a bf16 W get a bf16 gradient without an f32 [D, V] accumulator. ∂L/∂h is accumulated in
    f32 over the slices. When V is not a multiple of Vc the last slice is shifted left to end
    at V; the columns it shares with the previous slice are masked to a zero cotangent, so
    nothing is counted twice. Compared with `jax.checkpoint` of a chunk, lse is a residual
    (no max/exp-sum recomputed) and autodiff's generic log-softmax transpose is skipped.
    """
    hidden_BTD, unembed_DV, targets_BT, lse_BT, entropy_BT = residuals
    g_BT, g_entropy_BT = cotangents
    B, T, _ = hidden_BTD.shape
    V = unembed_DV.shape[1]
    J, Vc = _vocab_slices(B * T, V, chunk_size)
    compute_dtype = jnp.result_type(hidden_BTD.dtype, unembed_DV.dtype)
    g_BT = g_BT.astype(jnp.float32)
    if want_entropy:
        g_entropy_BT = (
            jnp.zeros_like(lse_BT) if g_entropy_BT is None else g_entropy_BT.astype(jnp.float32)
        )

    def one_slice(carry, k):
        d_hidden_BTD, d_unembed_DV = carry
        first = k * Vc
        start = jnp.minimum(first, V - Vc)
        unembed_DVc = jax.lax.dynamic_slice_in_dim(unembed_DV, start, Vc, axis=1)
        z_BTVc = _chunk_logits(hidden_BTD, unembed_DVc, temperature)
        logp_BTVc = z_BTVc - lse_BT[..., None]
        p_BTVc = jnp.exp(logp_BTVc)
        column_BTVc = start + jax.lax.broadcasted_iota(jnp.int32, z_BTVc.shape, 2)
        onehot_BTVc = (column_BTVc == targets_BT[..., None]).astype(jnp.float32)
        d_z_BTVc = g_BT[..., None] * (onehot_BTVc - p_BTVc)
        if want_entropy:
            d_z_BTVc = d_z_BTVc - g_entropy_BT[..., None] * p_BTVc * (
                logp_BTVc + entropy_BT[..., None]
            )
        # Columns below `first` belong to the previous slice (only the shifted last slice).
        d_z_BTVc = jnp.where(column_BTVc >= first, d_z_BTVc, 0.0)
        d_logits_BTVc = (d_z_BTVc / temperature).astype(compute_dtype)
        d_hidden_BTD = d_hidden_BTD + jnp.einsum(
            "btv,dv->btd", d_logits_BTVc, unembed_DVc, preferred_element_type=jnp.float32
        )
        d_unembed_DVc = jnp.einsum(
            "btd,btv->dv", hidden_BTD, d_logits_BTVc, preferred_element_type=jnp.float32
        )
        if d_unembed_DV is None:  # under a mesh: the block is the loop's output
            return (d_hidden_BTD, None), d_unembed_DVc.astype(unembed_DV.dtype)
        # + the slice already there: zero, or (shifted last slice) the previous slice's
        # values on the shared columns, to which this slice adds exact zeros.
        d_unembed_DVc = d_unembed_DVc + jax.lax.dynamic_slice_in_dim(
            d_unembed_DV, start, Vc, axis=1
        ).astype(jnp.float32)
        d_unembed_DV = jax.lax.dynamic_update_slice_in_dim(
            d_unembed_DV, d_unembed_DVc.astype(unembed_DV.dtype), start, axis=1
        )
        return (d_hidden_BTD, d_unembed_DV), None

    sharded = _mesh_in_context()
    if sharded:
        unembed_DV = jax.lax.with_sharding_constraint(unembed_DV, jax.sharding.PartitionSpec())
    d_hidden_BTD = jnp.zeros(hidden_BTD.shape, jnp.float32)
    init = (d_hidden_BTD, None if sharded else jnp.zeros_like(unembed_DV))
    (d_hidden_BTD, d_unembed_DV), blocks_JDVc = jax.lax.scan(one_slice, init, jnp.arange(J))
    if sharded:
        d_unembed_DV = _side_by_side(blocks_JDVc, V)
    return d_hidden_BTD.astype(hidden_BTD.dtype), d_unembed_DV, None


_core.defvjp(_core_fwd, _core_bwd)


# ----------------------------------------------------------------------------- public API


def token_logprobs(
    hidden_BTD,
    unembed_DV,
    targets_BT,
    *,
    temperature: float = 1.0,
    chunk_size: int = 256,
    return_entropy: bool = False,
):
    """Per-token log π(y_t | ·) from final hidden states, never materialising [B, T, V] logits.

        z_t        = (h_t · W) / τ                         (f32, τ = temperature)
        log p(y_t) = z_t[y_t] − logsumexp(z_t)
        H_t        = logsumexp(z_t) − Σ_v softmax(z_t)_v · z_t[v]     (if return_entropy)

    These are the log π_θ(y_i,t | x, y_i,<t) of the GSPO sequence ratio (paper §4) and of the
    GRPO token ratio. The caller has already shifted: `hidden_BTD[:, t]` predicts
    `targets_BT[:, t]`. The forward runs over chunks of about `chunk_size` tokens (a [B, I]
    slab, I = chunk_size // B positions, at least one position per chunk) and keeps one
    chunk's [B, I, V] logits alive; the backward (a custom VJP) recomputes the logits once,
    in vocabulary slices of [B, T, Vc] with B·T·Vc ≈ chunk_size·V / 2. Peak temporary memory
    is therefore about chunk_size·V f32 values plus a [D, Vc] slice, not O(B·T·V).
    Gradients flow to `hidden_BTD` and `unembed_DV` (not to the integer targets); the
    gradient is exact, only the order of floating-point operations differs from autodiff.
    The backward's W-slices stay cheap when W is replicated or sharded along D; a W sharded
    along V is sliced across devices (XLA gathers it).

    Args:
      hidden_BTD: [B, T, D] final hidden states (after the last norm), f32 or bf16.
      unembed_DV: [D, V] output projection (the transposed embedding for tied models).
      targets_BT: [B, T] integer token ids in [0, V), padded positions included.
      temperature: static float > 0; the sampler's temperature, so that the log-probs are
        those of the distribution the tokens were drawn from.
      chunk_size: positive int, about how many tokens' worth of [V] logits exist at once
        (256 at V = 151,936: 0.15 GB of f32 per chunk).
      return_entropy: also return the per-token entropy (differentiable).

    Returns:
      logprobs_BT f32, or (logprobs_BT, entropy_BT) f32 if `return_entropy`.
    """
    temperature = _check_temperature(temperature)
    chunk_size = _check_chunk_size(chunk_size)
    _check_shapes(hidden_BTD, unembed_DV, targets_BT)
    logprobs_BT, entropy_BT = _core(
        temperature, chunk_size, bool(return_entropy), hidden_BTD, unembed_DV, targets_BT
    )
    if not return_entropy:
        return logprobs_BT
    return logprobs_BT, entropy_BT


def token_logprobs_naive(
    hidden_BTD,
    unembed_DV,
    targets_BT,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
):
    """Reference for `token_logprobs`: full [B, T, V] f32 logits, plain autodiff.

    Same formula and arithmetic as `token_logprobs`. It exists for tests and for
    `benchmarks/logprobs_memory.py`; never use it in the train step or the log-prob pass
    (at V = 151,936 it holds 0.6 MB of f32 logits per token, twice over in the
    backward pass).
    """
    temperature = _check_temperature(temperature)
    _check_shapes(hidden_BTD, unembed_DV, targets_BT)
    z_BTV = _chunk_logits(hidden_BTD, unembed_DV, temperature)
    logprobs_BT, entropy_BT, _ = _logprob_and_entropy(z_BTV, targets_BT, bool(return_entropy))
    if not return_entropy:
        return logprobs_BT
    return logprobs_BT, entropy_BT


def logprobs_from_logits(logits_V, targets, temperature: float = 1.0):
    """log softmax(logits / τ)[target] over the last axis of already-materialised logits.

        log p(y) = log_softmax(f32(logits) / τ)[y]

    For the sampler's [B, V] last-position logits (shape [..., V] with `targets` [...]). It
    runs the very same f32 arithmetic as `token_logprobs` (`_logprob_and_entropy`), so the
    sampler's log-probs and the trainer's recomputed ones agree to float rounding (~1e-6)
    when the logits themselves agree. `targets` must be valid ids in [0, V).
    """
    temperature = _check_temperature(temperature)
    if logits_V.shape[:-1] != targets.shape:
        raise ValueError(
            f"targets must have the shape of logits without its last (vocab) axis, "
            f"{logits_V.shape[:-1]}; got {targets.shape}"
        )
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise TypeError(f"targets must be an integer array, got dtype {targets.dtype}")
    logprobs, _, _ = _logprob_and_entropy(_scaled_logits(logits_V, temperature), targets, False)
    return logprobs


def sequence_logprob_sum(logprobs_BT, mask_BT):
    """log π(y_i | x) = Σ_t m_i,t · log π(y_i,t | ·)  ->  [B]   (the sequence likelihood, §4)."""
    if logprobs_BT.shape != mask_BT.shape:
        raise ValueError(
            f"logprobs_BT {logprobs_BT.shape} and mask_BT {mask_BT.shape} must have equal shapes"
        )
    mask_BT = mask_BT.astype(logprobs_BT.dtype)
    # where, not multiply: a masked -inf/NaN log-prob (e.g. a padded position) must not leak.
    return jnp.sum(jnp.where(mask_BT > 0, logprobs_BT * mask_BT, 0.0), axis=-1)


def sequence_logprob_mean(logprobs_BT, mask_BT):
    """(1/|y_i|) Σ_t m_i,t · log π(y_i,t | ·)  ->  [B], with |y_i| = Σ_t m_i,t.

    The length-normalised log-likelihood inside the GSPO ratio s_i(θ) (paper §4, eq. for
    s_i); `objectives` takes the same `masked.row_mean` of the token log-ratios. A row with
    no valid token gives 0, never NaN (its gradient is 0 too).
    """
    if logprobs_BT.shape != mask_BT.shape:
        raise ValueError(
            f"logprobs_BT {logprobs_BT.shape} and mask_BT {mask_BT.shape} must have equal shapes"
        )
    return row_mean(logprobs_BT, mask_BT)
