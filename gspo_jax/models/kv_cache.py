"""Cached decoding: the model's prefill and one-token decode step, for the sampler.

Where it sits: `sampling.py` calls `prefill_shared` once per prompt, then
`decode_step_shared` inside its `lax.while_loop` (the G samples of a prompt read one
copy of its KV cache); `init_cache` / `prefill` / `decode_step` / `repeat_cache` are
the plain per-row cache (chunked prefill, any batch) for other callers and tests. Both
run the one `transformer.Decoder` composition with a cache attention context
(`_CacheAttention`), and both attend with `layers.attend_cached`: nothing here re-states
the block.

Layout (both caches): per layer a separate buffer (a tuple over layers, never one
stacked [layers, …] array: writing one layer's token must not copy the others), keys
[rows, K, C, slots] and values [rows, K, slots, C], so a decode step's q·kᵀ and p·v
contract each cache in place, without the per-step transpose a [rows, slots, K, C]
layout costs. Writes are `dynamic_update_slice`s into these buffers; donate the cache
(or carry it through a while_loop) and they happen in place.

Shared-prefix decoding (`PromptCache` + `ResponseCache`):
    PromptCache    k [Q, K, C, P], v [Q, K, P, C] per layer; valid [Q, P]; length [Q]:
                   the prompts' keys, written once by `prefill_shared`, then read-only
    ResponseCache  k [B, K, C, W], v [B, K, W, C] per layer *and* per time segment
                   (`response_segments`): row b's own generated tokens, slot t = token t
    Row b of the B = Q·G decode rows continues prompt b // G (G contiguous rows per
    prompt; G = 1 when every row has its own prompt copy). A step at response slot t
    writes the new token's k/v into the segment holding t and attends to the prompt's
    valid slots plus response slots 0..t; segments after t's are not read, which is why
    the response cache is split in time (a step reads only what can hold tokens).

Per-row cache (`KVCache`):
    k, v   per layer [B, K, C, S] / [B, K, S, C]
    mask   [B, S] bool      slot holds a real token (left padding stays False)
    pos    [B] int32        next position id per row = number of real tokens so far
    index  [] int32         next slot to write; shared by all rows (prompts are
                            left-padded to a common length, so rows advance together)
    The query written at slot j sees slots s <= j with mask[s] True.

Writing past a buffer's end is not checked inside jit (dynamic_update_slice clamps):
size caches as prompt length + max new tokens.

Shape letters: Q prompt rows, G = B/Q rows per prompt, B decode rows, P prompt slots,
W slots of a response segment, S slots of a KVCache, L tokens of one call, K kv heads,
C head dim, H query heads, V vocab, X rows of a cache part (Q or B).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct

from gspo_jax.models.config import ModelConfig
from gspo_jax.models.layers import attend_cached
from gspo_jax.models.transformer import logits_from_hidden, merge, run_full

# ------------------------------------------------------------------ attention context


def _write(k_XKCW, v_XKWC, k_BLKC, v_BLKC, at):
    """This call's L keys/values written at slots [at, at + L) of one cache buffer."""
    k_new = k_BLKC.transpose(0, 2, 3, 1).astype(k_XKCW.dtype)  # [B, K, C, L]
    v_new = v_BLKC.transpose(0, 2, 1, 3).astype(v_XKWC.dtype)  # [B, K, L, C]
    return (
        jax.lax.dynamic_update_slice(k_XKCW, k_new, (0, 0, 0, at)),
        jax.lax.dynamic_update_slice(v_XKWC, v_new, (0, 0, at, 0)),
    )


@dataclasses.dataclass(frozen=True)
class _CacheAttention:
    """Attention context of a cached call (see transformer.Decoder): every layer writes
    this call's k/v into time segment `segment` of its own buffers at offset `at`, then
    attends to [shared prefix ‖ segments 0..segment] with `layers.attend_cached`.

    prefix   PromptCache or None: keys read by groups of rows, never written
    k, v     per layer, a tuple over segments of [B, K, C, W] / [B, K, W, C]
    allowed  bool [B|1, L|1, W] over the written segment's slots (after the write);
             earlier segments are full and wholly visible, later ones are not read
    The cache entry a layer returns is its (k segments, v segments) tuples, updated.
    """

    prefix: PromptCache | None
    k: tuple
    v: tuple
    segment: int
    at: jax.Array
    allowed: jax.Array

    def __call__(self, layer: int, q_BLHC, k_BLKC, v_BLKC):
        ks, vs = list(self.k[layer]), list(self.v[layer])
        m = self.segment
        # Only segment m changes, and attention reads the updated buffer whole (a slice
        # of an updated loop carry made XLA copy the entire cache every step).
        ks[m], vs[m] = _write(ks[m], vs[m], k_BLKC, v_BLKC, self.at)
        parts = []
        if self.prefix is not None:
            valid = self.prefix.valid[:, None, :]
            parts.append((self.prefix.k[layer], self.prefix.v[layer], valid))
        parts += [(ks[j], vs[j], None) for j in range(m)]
        parts.append((ks[m], vs[m], self.allowed))
        return attend_cached(q_BLHC, parts), (tuple(ks), tuple(vs))


# ------------------------------------------------------------- shared-prefix decoding


@struct.dataclass
class PromptCache:
    """Keys/values of Q (left-padded) prompts, read-only while decoding.

    k       tuple over layers of [Q, K, C, P]
    v       tuple over layers of [Q, K, P, C]
    valid   bool [Q, P]   slot holds a real prompt token
    length  int32 [Q]     real prompt tokens = position id of the first response token
    """

    k: tuple
    v: tuple
    valid: jax.Array
    length: jax.Array


@struct.dataclass
class ResponseCache:
    """Keys/values of the B decode rows' generated tokens, in time segments.

    k   tuple over layers of a tuple over segments of [B, K, C, W_m]
    v   tuple over layers of a tuple over segments of [B, K, W_m, C]
    Segment m holds response slots [start_m, start_m + W_m) (`segments`).
    """

    k: tuple
    v: tuple

    @property
    def segments(self) -> tuple[tuple[int, int], ...]:
        """(start, width) of each time segment (static: read from the shapes)."""
        out, start = [], 0
        for k_BKCW in self.k[0]:
            out.append((start, k_BKCW.shape[-1]))
            start += k_BKCW.shape[-1]
        return tuple(out)

    @property
    def max_len(self) -> int:
        return sum(width for _, width in self.segments)


def response_segments(max_len: int, segments: int) -> tuple[tuple[int, int], ...]:
    """(start, width) of `max_len` response slots split into `segments` equal runs
    (width ⌈max_len / segments⌉, the last one shorter; fewer runs if that covers it)."""
    if max_len < 1 or segments < 1:
        raise ValueError(f"need max_len >= 1 and segments >= 1, got {max_len}, {segments}")
    width = -(-max_len // min(int(segments), max_len))
    return tuple((s, min(width, max_len - s)) for s in range(0, max_len, width))


def init_response_cache(
    model_config: ModelConfig, batch_size: int, max_len: int, *, segments: int = 1, dtype=None
) -> ResponseCache:
    """Zeroed response cache of `max_len` slots in `response_segments(max_len, segments)`;
    k/v in `dtype` (default: the compute dtype)."""
    cfg = model_config
    dtype = jnp.dtype(dtype or cfg.dtype)
    B, K, C = batch_size, cfg.num_kv_heads, cfg.head_dim
    widths = [w for _, w in response_segments(max_len, segments)]
    return ResponseCache(
        k=tuple(
            tuple(jnp.zeros((B, K, C, w), dtype) for w in widths) for _ in range(cfg.num_layers)
        ),
        v=tuple(
            tuple(jnp.zeros((B, K, w, C), dtype) for w in widths) for _ in range(cfg.num_layers)
        ),
    )


@functools.partial(jax.jit, static_argnums=0, static_argnames=("dtype", "return_routing"))
def prefill_shared(
    model_config: ModelConfig,
    params,
    tokens_QP,
    attention_mask_QP,
    *,
    dtype=None,
    return_routing: bool = False,
):
    """Runs Q LEFT-padded prompts once (the full-sequence pass, `forward`'s arithmetic).

    Returns (PromptCache, logits of every prompt's last token [Q, V] float32)
    (+ routing [M, Q, P, X]). The cache's k/v are in `dtype` (default: compute dtype).
    Any number of decode rows may then share one prompt row (`decode_step_shared`).
    """
    cfg = model_config
    hidden_QPD, kv, routing = run_full(cfg, params, tokens_QP, attention_mask_QP)
    dtype = jnp.dtype(dtype or cfg.dtype)
    mask = attention_mask_QP.astype(bool)
    cache = PromptCache(
        k=tuple(k.transpose(0, 2, 3, 1).astype(dtype) for k, _ in kv),  # [Q, K, C, P]
        v=tuple(v.transpose(0, 2, 1, 3).astype(dtype) for _, v in kv),  # [Q, K, P, C]
        valid=mask,
        length=jnp.sum(mask, axis=1, dtype=jnp.int32),
    )
    logits = logits_from_hidden(cfg, params, hidden_QPD[:, -1])
    return (cache, logits, routing) if return_routing else (cache, logits)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("segment", "return_routing"))
def decode_step_shared(
    model_config: ModelConfig,
    params,
    prompt: PromptCache,
    response: ResponseCache,
    tokens_B,
    slot,
    *,
    segment: int | None = None,
    return_routing: bool = False,
):
    """One token per row at response slot `slot`; returns (next-token logits [B, V]
    float32, updated ResponseCache) (+ routing [M, B, 1, X]).

    Row b continues prompt b // G (G = B / Q) from position prompt.length + slot; its
    token's keys/values go to response slot `slot` (int32 [], the same for all rows =
    tokens already in the response cache) and it attends to its prompt's valid slots
    and its own response slots 0..slot. `segment` (static) is the index of the time
    segment holding `slot` (`response.segments`); it may be None with one segment. A
    slot outside that segment is not checked inside jit. Donate `response` (or carry it
    in a while_loop) so the writes happen in place.
    """
    cfg = model_config
    B = tokens_B.shape[0]
    Q = prompt.valid.shape[0]
    bounds = response.segments
    if B % Q or response.k[0][0].shape[0] != B:
        raise ValueError(
            f"decode_step_shared: {B} token rows, response cache of "
            f"{response.k[0][0].shape[0]} rows and {Q} prompt rows: need the same row "
            "count for tokens and response cache, a multiple of the prompt rows"
        )
    if segment is None:
        if len(bounds) != 1:
            raise ValueError(
                f"decode_step_shared: the response cache has {len(bounds)} segments "
                f"{list(bounds)}: pass segment= (the one holding slot)"
            )
        segment = 0
    if not 0 <= segment < len(bounds):
        raise ValueError(f"segment={segment} outside the cache's {len(bounds)} segments")
    start, width = bounds[segment]
    offset = jnp.asarray(slot, jnp.int32) - start
    positions_B1 = (jnp.repeat(prompt.length, B // Q) + slot)[:, None]
    context = _CacheAttention(
        prefix=prompt,
        k=response.k,
        v=response.v,
        segment=segment,
        at=offset,
        allowed=(jnp.arange(width) <= offset)[None, None, :],
    )
    model = merge(cfg, params)
    hidden_B1D, entries, routing = model(tokens_B[:, None], positions_B1, context)
    new = ResponseCache(k=tuple(k for k, _ in entries), v=tuple(v for _, v in entries))
    logits = logits_from_hidden(cfg, params, hidden_B1D[:, 0])
    return (logits, new, routing) if return_routing else (logits, new)


# ------------------------------------------------------------------- per-row KVCache


@struct.dataclass
class KVCache:
    """Per-row cache of S slots (see the module docstring for the fields' meaning)."""

    k: tuple  # per layer [B, K, C, S]
    v: tuple  # per layer [B, K, S, C]
    mask: jax.Array  # [B, S] bool
    pos: jax.Array  # [B] int32
    index: jax.Array  # [] int32

    @property
    def max_len(self) -> int:
        return self.k[0].shape[-1]


def init_cache(model_config: ModelConfig, batch_size: int, max_len: int, dtype=None) -> KVCache:
    """Empty cache with `max_len` slots; k/v in `dtype` (default: the compute dtype)."""
    cfg = model_config
    dtype = jnp.dtype(dtype or cfg.dtype)
    B, K, C, S = batch_size, cfg.num_kv_heads, cfg.head_dim, max_len
    return KVCache(
        k=tuple(jnp.zeros((B, K, C, S), dtype) for _ in range(cfg.num_layers)),
        v=tuple(jnp.zeros((B, K, S, C), dtype) for _ in range(cfg.num_layers)),
        mask=jnp.zeros((batch_size, max_len), bool),
        pos=jnp.zeros((batch_size,), jnp.int32),
        index=jnp.zeros((), jnp.int32),
    )


def _extend(cfg: ModelConfig, params, tokens_BL, mask_BL, cache: KVCache, routing):
    """Writes L tokens at slots [index, index + L) and returns (last hidden [B, D], cache,
    routing [M, B, L, X]). Positions continue from cache.pos: pos + cumsum(mask) − 1."""
    _B, L = tokens_BL.shape
    mask = mask_BL.astype(bool)
    step = jnp.cumsum(mask.astype(jnp.int32), axis=1)
    positions_BL = jnp.maximum(cache.pos[:, None] + step - 1, 0)
    new_mask_BS = jax.lax.dynamic_update_slice(cache.mask, mask, (0, cache.index))
    slots_S = jnp.arange(cache.max_len)
    query_slot_L = cache.index + jnp.arange(L)
    allowed_BLS = new_mask_BS[:, None, :] & (slots_S[None, :] <= query_slot_L[:, None])[None]
    # The per-row cache is the one-segment case of the shared-prefix context, no prefix.
    context = _CacheAttention(
        prefix=None,
        k=tuple((k,) for k in cache.k),
        v=tuple((v,) for v in cache.v),
        segment=0,
        at=cache.index,
        allowed=allowed_BLS,
    )
    model = merge(cfg, params)
    hidden, entries, routing_out = model(tokens_BL, positions_BL, context, routing)
    new_cache = KVCache(
        k=tuple(k[0] for k, _ in entries),
        v=tuple(v[0] for _, v in entries),
        mask=new_mask_BS,
        pos=cache.pos + step[:, -1],
        index=cache.index + L,
    )
    return hidden[:, -1], new_cache, routing_out


@functools.partial(jax.jit, static_argnums=0, static_argnames=("return_routing",))
def prefill(
    model_config: ModelConfig,
    params,
    tokens_BL,
    attention_mask_BL,
    cache: KVCache,
    *,
    routing=None,
    return_routing: bool = False,
):
    """Runs a (left-)padded prompt batch into the cache.

    Returns (logits of the last position [B, V] float32, cache) (+ routing [M, B, L, X]).
    With left padding the last position is every row's last real token.
    """
    hidden_BD, cache, routing_out = _extend(
        model_config, params, tokens_BL, attention_mask_BL, cache, routing
    )
    logits = logits_from_hidden(model_config, params, hidden_BD)
    return (logits, cache, routing_out) if return_routing else (logits, cache)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("return_routing",))
def decode_step(
    model_config: ModelConfig,
    params,
    tokens_B,
    cache: KVCache,
    *,
    routing=None,
    return_routing: bool = False,
):
    """Appends one token per row; returns (next-token logits [B, V] float32, cache)
    (+ routing [M, B, 1, X])."""
    tokens_B1 = tokens_B[:, None]
    hidden_BD, cache, routing_out = _extend(
        model_config, params, tokens_B1, jnp.ones_like(tokens_B1, bool), cache, routing
    )
    logits = logits_from_hidden(model_config, params, hidden_BD)
    return (logits, cache, routing_out) if return_routing else (logits, cache)


def repeat_cache(cache: KVCache, n: int) -> KVCache:
    """Repeats every row n times contiguously (row i -> rows i·n … i·n+n−1). This copies
    the prompt's keys n times; `prefill_shared` + `decode_step_shared` share them instead."""
    return KVCache(
        k=tuple(jnp.repeat(k, n, axis=0) for k in cache.k),
        v=tuple(jnp.repeat(v, n, axis=0) for v in cache.v),
        mask=jnp.repeat(cache.mask, n, axis=0),
        pos=jnp.repeat(cache.pos, n, axis=0),
        index=cache.index,
    )
