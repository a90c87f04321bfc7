"""Functional KV cache: prefill a left-padded batch once, then decode one token at a time.

Where it sits: `sampling.py` calls `init_cache` -> `prefill` (once per prompt) ->
`repeat_cache` (broadcast each prompt's cache to its G samples) -> `decode_step` inside
its `lax.while_loop`. The cache is a pytree passed in and returned (donate it); its slot
count S is fixed per compiled shape, so a new prompt length/response budget recompiles
once, not per token.

Layout (`KVCache`):
    k, v   [N, B, S, K, C]  keys/values of every layer (N layers, K kv heads, C head dim)
    mask   [B, S] bool      slot holds a real token (left padding stays False)
    pos    [B] int32        next position id per row = number of real tokens so far
    index  [] int32         next slot to write; shared by all rows (prompts are
                            left-padded to a common length, so rows advance together)

Causality in slot space: the query written at slot j sees slots s <= j with mask[s]
True. Writing past S is not checked inside jit (dynamic_update_slice clamps): size the
cache as prompt length + max new tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from gspo_jax.models.config import ModelConfig
from gspo_jax.models.transformer import logits_from_hidden, merge


@struct.dataclass
class KVCache:
    k: jax.Array  # [N, B, S, K, C]
    v: jax.Array  # [N, B, S, K, C]
    mask: jax.Array  # [B, S] bool
    pos: jax.Array  # [B] int32
    index: jax.Array  # [] int32

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


def init_cache(model_config: ModelConfig, batch_size: int, max_len: int, dtype=None) -> KVCache:
    """Empty cache with `max_len` slots; k/v in `dtype` (default: the compute dtype)."""
    cfg = model_config
    dtype = jnp.dtype(dtype or cfg.dtype)
    shape = (cfg.num_layers, batch_size, max_len, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
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
    model = merge(cfg, params)
    hidden, (k, v), routing_out = model(
        tokens_BL, positions_BL, allowed_BLS, (cache.k, cache.v, cache.index), routing
    )
    new_cache = KVCache(
        k=k, v=v, mask=new_mask_BS, pos=cache.pos + step[:, -1], index=cache.index + L
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
    """Repeats every row n times contiguously (row i -> rows i·n … i·n+n−1): one prefill
    per prompt serves its G samples."""
    return KVCache(
        k=jnp.repeat(cache.k, n, axis=1),
        v=jnp.repeat(cache.v, n, axis=1),
        mask=jnp.repeat(cache.mask, n, axis=0),
        pos=jnp.repeat(cache.pos, n, axis=0),
        index=cache.index,
    )
