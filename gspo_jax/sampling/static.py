"""The static engine (`sampling.engine="static"`): one prefill per prompt, then a
`lax.while_loop` that decodes every row until the last one ends. Faster than the continuous
engine on CPU for small models and short, even lengths; the same tokens for the same rng
(both draw token t of sequence b with `draw.row_keys`).

The response cache is cut into time segments (`decode_segments`): the decode step of
segment k attends only to segments 0..k, so early steps do not read the whole cache.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from gspo_jax import models
from gspo_jax.sampling import replicas as replicas_lib
from gspo_jax.sampling.draw import next_token, row_keys
from gspo_jax.sampling.layout import traced_under_layout
from gspo_jax.sampling.output import SampleOutput

F32 = jnp.float32


@struct.dataclass
class SamplerState:
    """The decode loop's carry (donated into `decode`).

    step      int32 []        tokens generated so far = column written next
    tokens    int32 [B, T]    pad_id where nothing (or padding after the end) was generated
    logprobs  f32 [B, T]
    done      bool [B]        the row has emitted an end token
    length    int32 [B]       generated tokens up to and including the end token
    last      int32 [B]       token fed to the next decode step (response slot step − 1,
                              position = real prompt length + step − 1)
    rng       key             the call's key; token t of row b draws with
                              fold_in(fold_in(rng, b), t) (`draw.row_keys`)
    cache     models.ResponseCache: the rows' response keys/values in time segments
    """

    step: jax.Array
    tokens: jax.Array
    logprobs: jax.Array
    done: jax.Array
    length: jax.Array
    last: jax.Array
    rng: jax.Array
    cache: models.ResponseCache


# ------------------------------------------------------------------------ cache schedule


def cache_segments(T: int, segments: int) -> list[tuple[int, int]]:
    """(start, width) of the response-cache segments: T slots in `segments` equal runs."""
    return list(models.response_segments(T, segments))


def auto_segment_count(T: int) -> int:
    """Default segment count: about one per 32 response slots, at most 4 (each segment is
    one more compiled copy of the decode step)."""
    return max(1, min(4, T // 32))


# ------------------------------------------------------------------------- jitted stages


@functools.partial(
    jax.jit,
    static_argnames=(
        "model_config",
        "num_samples",
        "share_prefix",
        "max_new_tokens",
        "segments",
        "layout",
        "kv_dtype",
    ),
)
@traced_under_layout
def prefill(
    model_config,
    params,
    tokens_NP,
    mask_NP,
    rng,
    *,
    num_samples,
    share_prefix,
    max_new_tokens,
    segments=1,
    layout="trainer",
    kv_dtype="auto",
):
    """Prompt cache, initial state (nothing generated yet) and the first-token logits
    ([N, V] shared, [B, V] not shared), plus the prompts repeated G times. `layout`: the
    rules the stage is traced under (`sharding.layout_rules`); `kv_dtype`: the caches'
    float dtype ("auto": the compute dtype)."""
    if layout == "tensor":
        params = models.for_decoding(model_config, params)  # a no-op on rollout_params
    cfg, G, T = model_config, num_samples, max_new_tokens
    B = tokens_NP.shape[0] * G
    tokens_BP = jnp.repeat(tokens_NP, G, axis=0)
    mask_BP = jnp.repeat(mask_NP, G, axis=0)
    tokens_QP, mask_QP = (tokens_NP, mask_NP) if share_prefix else (tokens_BP, mask_BP)
    dtype = None if kv_dtype == "auto" else kv_dtype
    prompt, logits_QV, _ = models.prefill_shared(cfg, params, tokens_QP, mask_QP, dtype=dtype)
    state = SamplerState(
        step=jnp.zeros((), jnp.int32),
        tokens=jnp.zeros((B, T), jnp.int32),
        logprobs=jnp.zeros((B, T), F32),
        done=jnp.zeros((B,), bool),
        length=jnp.zeros((B,), jnp.int32),
        last=jnp.zeros((B,), jnp.int32),
        rng=rng,
        cache=models.init_response_cache(cfg, B, T, segments=segments, dtype=dtype),
    )
    return prompt, state, logits_QV, tokens_BP, mask_BP.astype(jnp.int32)


@functools.partial(
    jax.jit,
    static_argnames=("model_config", "temperature", "top_k", "top_p", "layout"),
    donate_argnames=("state",),
)
@traced_under_layout
def decode(
    model_config,
    params,
    prompt,
    state,
    first_logits_QV,
    eos_ids_E,
    pad_id,
    *,
    temperature,
    top_k,
    top_p,
    layout="trainer",
):
    """First token from the prefill logits, then the while_loop; returns (final state,
    response mask [B, T], truncated [B]). `layout`: as `prefill`'s."""
    cfg = model_config
    B, T = state.tokens.shape
    params = models.for_decoding(cfg, params)  # weights gathered once, not once per token

    def emit(state, logits_BV):
        """Draws token `step` for every row, writes it (pad / 0 for finished rows)."""
        keys = row_keys(state.rng, jnp.arange(B, dtype=jnp.int32), jnp.full((B,), state.step))
        token, logprob = next_token(logits_BV, keys, temperature, top_k, top_p)
        live = ~state.done
        token = jnp.where(live, token, pad_id)
        col = (jnp.zeros((), jnp.int32), state.step)
        is_end = jnp.any(token[:, None] == eos_ids_E[None, :], axis=-1) & live
        return state.replace(
            step=state.step + 1,
            tokens=jax.lax.dynamic_update_slice(state.tokens, token[:, None], col),
            logprobs=jax.lax.dynamic_update_slice(
                state.logprobs, jnp.where(live, logprob, 0.0)[:, None], col
            ),
            done=state.done | is_end,
            length=state.length + live.astype(jnp.int32),
            last=token,
        )

    first_BV = jnp.repeat(first_logits_QV, B // first_logits_QV.shape[0], axis=0)
    state = emit(state, first_BV)
    layers = models.split_layers(cfg, params)  # once: slicing inside the loop copies weights

    def run_segment(state, seg: int, start: int, width: int):
        """Decode steps writing response slots [start, start + width) (slot = step − 1)."""

        def cond(state):
            return (state.step < T) & (state.step <= start + width) & ~jnp.all(state.done)

        def body(state):
            logits_BV, cache, _ = models.decode_step_shared(
                cfg,
                params,
                prompt,
                state.cache,
                state.last,
                state.step - 1,
                segment=seg,
                layer_params=layers,
            )
            return emit(state.replace(cache=cache), logits_BV)

        return jax.lax.while_loop(cond, body, state)

    # One while_loop per cache segment (Python-unrolled, each compiled once): early steps
    # attend over the first segments only, so the response cache is read ~(S+1)/2S as much.
    for seg, (start, width) in enumerate(state.cache.segments):
        state = run_segment(state, seg, start, width)
    mask_BT = (jnp.arange(T)[None, :] < state.length[:, None]).astype(jnp.int32)
    # Columns never reached (every row ended early) still hold the buffer's initial value.
    state = state.replace(tokens=jnp.where(mask_BT > 0, state.tokens, pad_id))
    # The whole final state is returned so that every donated buffer is aliased to an output
    # (the response caches are updated in place from the first step to the last).
    return state, mask_BT, ~state.done


def sample_static(cfg, params, tokens_NP, mask_NP, rng, eos_E, pad_id, options, segments):
    """The static engine: `prefill`, then `decode` until every row has ended."""
    prompt, state, first_logits, tokens_BP, mask_BP = prefill(
        cfg,
        params,
        tokens_NP,
        mask_NP,
        rng,
        num_samples=options.num_samples,
        share_prefix=options.share_prefix,
        max_new_tokens=options.max_new_tokens,
        segments=segments,
        layout=options.layout,
        kv_dtype=options.kv_dtype,
    )
    state, mask, truncated = decode(
        cfg,
        params,
        prompt,
        state,
        first_logits,
        eos_E,
        np.int32(pad_id),
        temperature=options.temperature,
        top_k=options.top_k,
        top_p=options.top_p,
        layout=options.layout,
    )
    tokens, logprobs, lengths = state.tokens, state.logprobs, state.length
    rows = replicas_lib.row_sharding(tokens_NP)
    if rows is not None and options.layout == "tensor":  # rows came out replicated
        tokens, mask, logprobs, lengths, truncated, tokens_BP, mask_BP = replicas_lib.place(
            rows, (tokens, mask, logprobs, lengths, truncated, tokens_BP, mask_BP)
        )
    return SampleOutput(
        tokens=tokens,
        mask=mask,
        logprobs=logprobs,
        lengths=lengths,
        truncated=truncated,
        prompt_tokens=tokens_BP,
        prompt_mask=mask_BP,
        num_steps=state.step,
        row_steps=state.step * jnp.int32(state.tokens.shape[0]),
        preemptions=jnp.zeros((), jnp.int32),
    )


def segment_count(max_new_tokens: int, decode_segments) -> int:
    """How many time segments the response cache has (`decode_segments` checked; None: the
    automatic choice, see the module docstring)."""
    if decode_segments is not None and (
        isinstance(decode_segments, bool)
        or not isinstance(decode_segments, (int, np.integer))
        or decode_segments < 1
    ):
        raise ValueError(f"decode_segments must be None or an int >= 1, got {decode_segments!r}")
    return len(
        cache_segments(max_new_tokens, decode_segments or auto_segment_count(max_new_tokens))
    )
