"""Cached decoding: the model's prefill and one-token decode step, for the sampler.

Where it sits: `sampling/sampler.py` calls `prefill_shared` once per prompt, then
`decode_step_shared` inside its `lax.while_loop` (the G samples of a prompt read one
copy of its KV cache). Both run the one `decoder.Decoder` composition: the prefill is
the full-sequence pass (scanned over the stacked layers) keeping each layer's
keys/values; the decode step runs it on one token, unrolled over the layers, with a cache
attention context (`_CacheAttention`) that writes the token's key/value into its layer's
buffer and attends with `attention.attend_cached`. Nothing here re-states the block.

Layout: per layer a separate buffer (a tuple over layers, never one stacked [layers, …]
array: writing one layer's token must not copy the others, and the attention reads the
layer's whole updated buffer), keys [rows, K, C, slots] and values [rows, K, slots, C],
so a decode step's q·kᵀ and p·v contract each cache in place, without the per-step
transpose a [rows, slots, K, C] layout costs. Writes are `dynamic_update_slice`s into
these buffers; donate the cache (or carry it through a while_loop) and they happen in
place. The decode step runs its layers unrolled (layer_stack.py): scanned over stacked
weights and a stacked cache, the sampler's decode step was slower on XLA:CPU, since
every step sliced (copied) each layer's weights and cache out of the stacks (docs/tpu.md,
"Decoding at long responses").

    PromptCache    k [Q, K, C, P], v [Q, K, P, C] per layer; valid [Q, P]; length [Q]:
                   the prompts' keys, written once by `prefill_shared`, then read-only
    ResponseCache  k [B, K, C, W], v [B, K, W, C] per layer *and* per time segment
                   (`response_segments`): row b's own generated tokens, slot t = token t
    Row b of the B = Q·G decode rows continues prompt b // G (G contiguous rows per
    prompt; G = 1 when every row has its own prompt copy). A step at response slot t
    writes the new token's k/v into the segment holding t and attends to the prompt's
    valid slots plus response slots 0..t; segments after t's are not read, which is why
    the response cache is split in time (a step reads only what can hold tokens).

Hybrid models (Qwen3.5): only the full-attention layers have k/v buffers (the tuples run
over those layers, in order); each Gated DeltaNet layer keeps (conv window [rows, K−1,
conv channels], recurrent state [rows, heads, d_k, d_v] float32) instead — the prompt's,
from the prefill, in `PromptCache.linear`, and each decode row's in `ResponseCache.linear`.
The step at response slot 0 starts every row from its prompt's state (the G rows of a
prompt share it, as they share its keys); later steps carry their own. The decode step
runs the recurrent form, the prefill the chunked one (deltanet.py).

Writing past a buffer's end is not checked inside jit (dynamic_update_slice clamps):
size caches as prompt length + max new tokens.

Shape letters: Q prompt rows, G = B/Q rows per prompt, B decode rows, P prompt slots,
W slots of a response segment, L tokens of one call, K kv heads, C head dim, H query
heads, V vocab, M MoE layers, X experts per token. The layer count is written out.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct

from gspo_jax.models import partition
from gspo_jax.models.attention import attend_cached
from gspo_jax.models.config import ModelConfig
from gspo_jax.models.functional import logits_from_hidden, run_full
from gspo_jax.models.params import merge


@struct.dataclass
class PromptCache:
    """Keys/values of Q (left-padded) prompts, read-only while decoding.

    k       tuple over layers of [Q, K, C, P]
    v       tuple over layers of [Q, K, P, C]
    valid   bool [Q, P]   slot holds a real prompt token
    length  int32 [Q]     real prompt tokens = position id of the first response token
    linear  tuple over linear layers of (conv window, recurrent state) after the prompt
    """

    k: tuple
    v: tuple
    valid: jax.Array
    length: jax.Array
    linear: tuple = ()


@struct.dataclass
class ResponseCache:
    """Keys/values of the B decode rows' generated tokens, in time segments.

    k   tuple over layers of a tuple over segments of [B, K, C, W_m]
    v   tuple over layers of a tuple over segments of [B, K, W_m, C]
    Segment m holds response slots [start_m, start_m + W_m) (`segments`).
    linear  tuple over linear layers of (conv window, recurrent state) of each row
    """

    k: tuple
    v: tuple
    linear: tuple = ()

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
    k/v in `dtype` (default: the compute dtype).

    Under a mesh in context (`jax.set_mesh`) the buffers are constrained to rows over the
    batch axes and kv heads over the tensor axis: zeros depend on no input, and left to
    itself XLA replicated them (compiled for v5p:4x4x4 = v5p-128, Qwen3-8B at 16k-token responses: a
    1.1 TiB per-chip prefill instead of the cache's 1/64th).
    """
    cfg = model_config
    dtype = jnp.dtype(dtype or cfg.dtype)
    B, K, C = batch_size, cfg.num_kv_heads, cfg.head_dim
    widths = [w for _, w in response_segments(max_len, segments)]
    mesh = partition.context_mesh()

    def zeros(shape, names):
        x = jnp.zeros(shape, dtype)
        if mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, partition.spec(mesh, names, shape))

    k_names, v_names = ("batch", "kv_heads", None, None), ("batch", "kv_heads", None, None)
    full = cfg.num_layers - cfg.num_linear_layers
    H, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    channels = 2 * cfg.linear_num_key_heads * dk + H * dv
    window = (B, cfg.linear_conv_kernel_dim - 1, channels)
    # The window in the compute dtype, the state in float32: what a decode step returns.
    linear = tuple(
        (
            zeros(window, ("batch", None, None)).astype(cfg.dtype),
            zeros((B, H, dk, dv), ("batch",) + (None,) * 3).astype(jnp.float32),
        )
        for _ in range(cfg.num_linear_layers)
    )
    return ResponseCache(
        k=tuple(tuple(zeros((B, K, C, w), k_names) for w in widths) for _ in range(full)),
        v=tuple(tuple(zeros((B, K, w, C), v_names) for w in widths) for _ in range(full)),
        linear=linear,
    )


def _write(k_QKCW, v_QKWC, k_BLKC, v_BLKC, at):
    """This call's L keys/values written at slots [at, at + L) of one cache buffer."""
    k_new = k_BLKC.transpose(0, 2, 3, 1).astype(k_QKCW.dtype)  # [B, K, C, L]
    v_new = v_BLKC.transpose(0, 2, 1, 3).astype(v_QKWC.dtype)  # [B, K, L, C]
    return (
        jax.lax.dynamic_update_slice(k_QKCW, k_new, (0, 0, 0, at)),
        jax.lax.dynamic_update_slice(v_QKWC, v_new, (0, 0, at, 0)),
    )


@dataclasses.dataclass(frozen=True)
class _CacheAttention:
    """Attention context of a decode step (see decoder.Decoder, called unrolled with
    the layer index): every layer writes this call's k/v into time segment `segment` of
    its own buffers at offset `at`, then attends to [prompt ‖ segments 0..segment] with
    `attention.attend_cached`.

    prompt   PromptCache: keys read by groups of rows, never written
    k, v     per layer, a tuple over segments of [B, K, C, W] / [B, K, W, C]
    allowed  bool [B|1, L|1, W] over the written segment's slots (after the write);
             earlier segments are full and wholly visible, later ones are not read
    The cache entry a layer returns is its (k segments, v segments) tuples, updated.
    index    layer -> its index among the layers of its kind (full attention / DeltaNet)
    states   per DeltaNet layer, the rows' (conv window, state) before this step
    first    bool []: the response's first step, whose rows start from their prompt's state
    """

    prompt: PromptCache
    k: tuple
    v: tuple
    segment: int
    at: jax.Array
    allowed: jax.Array
    index: tuple
    states: tuple = ()
    first: jax.Array | None = None
    layer_data = None  # per-layer buffers are indexed by layer (unrolled decoder)

    def linear(self, layer: int):
        """A DeltaNet layer's context: no mask, its rows' state, kept, the recurrent form."""
        i = self.index[layer]
        rows = self.states[i][0].shape[0]
        own = self.states[i]
        start = tuple(jnp.repeat(x, rows // x.shape[0], axis=0) for x in self.prompt.linear[i])
        state = tuple(jnp.where(self.first, p, o.astype(p.dtype)) for p, o in zip(start, own))
        return None, state, True, True

    def __call__(self, layer: int, q_BLHC, k_BLKC, v_BLKC):
        layer = self.index[layer]
        ks, vs = list(self.k[layer]), list(self.v[layer])
        m = self.segment
        # Only segment m changes, and attention reads the updated buffer whole (a slice
        # of an updated loop carry made XLA copy the entire cache every step).
        ks[m], vs[m] = _write(ks[m], vs[m], k_BLKC, v_BLKC, self.at)
        valid = self.prompt.valid[:, None, :]
        parts = [(self.prompt.k[layer], self.prompt.v[layer], valid)]
        parts += [(ks[j], vs[j], None) for j in range(m)]
        parts.append((ks[m], vs[m], self.allowed))
        return attend_cached(q_BLHC, parts), (tuple(ks), tuple(vs))


def kind_index(cfg: ModelConfig) -> tuple[int, ...]:
    """Layer i's index among the layers of its kind (full attention / Gated DeltaNet)."""
    out, counts = [], [0, 0]
    for i in range(cfg.num_layers):
        kind = int(cfg.is_linear_layer(i))
        out.append(counts[kind])
        counts[kind] += 1
    return tuple(out)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("dtype",))
def prefill_shared(
    model_config: ModelConfig, params, tokens_QP, attention_mask_QP, *, dtype=None, routing=None
):
    """Runs Q LEFT-padded prompts once (the full-sequence pass, `forward`'s arithmetic).

    Returns (PromptCache, logits of every prompt's last token [Q, V] float32, routing
    [M, Q, P, X] used: computed, or `routing` forced). The cache's k/v are in `dtype`
    (default: compute dtype). Any number of decode rows may then share one prompt row
    (`decode_step_shared`).
    """
    cfg = model_config
    hidden_QPD, entries, routing_out = run_full(
        cfg, params, tokens_QP, attention_mask_QP, routing, keep_kv=True
    )
    linear = ()
    if cfg.is_hybrid:  # (full layers' (k, v), DeltaNet layers' (window, state)), stacked
        entries, (window, state) = entries
        linear = tuple((window[i], state[i]) for i in range(cfg.num_linear_layers))
    k, v = entries
    dtype = jnp.dtype(dtype or cfg.dtype)
    mask = attention_mask_QP.astype(bool)
    layers = range(cfg.num_layers - cfg.num_linear_layers)
    cache = PromptCache(
        k=tuple(k[i].transpose(0, 2, 3, 1).astype(dtype) for i in layers),  # [Q, K, C, P]
        v=tuple(v[i].transpose(0, 2, 1, 3).astype(dtype) for i in layers),  # [Q, K, P, C]
        valid=mask,
        length=jnp.sum(mask, axis=1, dtype=jnp.int32),
        linear=linear,
    )
    logits = logits_from_hidden(cfg, params, hidden_QPD[:, -1])
    return cache, logits, routing_out


@functools.partial(jax.jit, static_argnums=0, static_argnames=("segment",))
def decode_step_shared(
    model_config: ModelConfig,
    params,
    prompt: PromptCache,
    response: ResponseCache,
    tokens_B,
    slot,
    *,
    segment: int | None = None,
    routing=None,
    layer_params=None,
):
    """One token per row at response slot `slot`; returns (next-token logits [B, V]
    float32, updated ResponseCache, routing [M, B, 1, X] used: computed or forced).

    Row b continues prompt b // G (G = B / Q) from position prompt.length + slot; its
    token's keys/values go to response slot `slot` (int32 [], the same for all rows =
    tokens already in the response cache) and it attends to its prompt's valid slots
    and its own response slots 0..slot. `segment` (static) is the index of the time
    segment holding `slot` (`response.segments`); it may be None with one segment. A
    slot outside that segment is not checked inside jit. Donate `response` (or carry it
    in a while_loop) so the writes happen in place. Inside a loop, pass
    `layer_params=models.split_layers(cfg, params)` computed once before it (the layers
    run unrolled; slicing their weights out of the stacks at every step copies them).
    """
    cfg = model_config
    B = tokens_B.shape[0]
    Q = prompt.valid.shape[0]
    bounds = response.segments
    rows = response.k[0][0].shape[0]
    if B % Q or rows != B:
        raise ValueError(
            f"decode_step_shared: {B} token rows, response cache of {rows} rows and {Q} "
            "prompt rows: need the same row count for tokens and response cache, a "
            "multiple of the prompt rows"
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
        prompt=prompt,
        k=response.k,
        v=response.v,
        segment=segment,
        at=offset,
        allowed=(jnp.arange(width) <= offset)[None, None, :],
        index=kind_index(cfg),
        states=response.linear,
        first=jnp.asarray(slot, jnp.int32) == 0,
    )
    model = merge(cfg, params)
    hidden_B1D, entries, routing_out = model(
        tokens_B[:, None], positions_B1, context, routing, unroll=True, layer_params=layer_params
    )
    full = [e for i, e in enumerate(entries) if not cfg.is_linear_layer(i)]
    new = ResponseCache(
        k=tuple(k for k, _ in full),
        v=tuple(v for _, v in full),
        linear=tuple(e for i, e in enumerate(entries) if cfg.is_linear_layer(i)),
    )
    logits = logits_from_hidden(cfg, params, hidden_B1D[:, 0])
    return logits, new, routing_out
