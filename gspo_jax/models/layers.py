"""Flax NNX building blocks of the Qwen decoder: RMSNorm, RoPE, GQA attention, SwiGLU MLP, MoE.

Where it sits: `transformer.Decoder` stacks these; nothing here knows about checkpoints,
caches as pytrees, or training. Every parameter is an `nnx.Param` carrying its logical
axis names (metadata `out_sharding`, with eager sharding off) so `sharding.py` can map
them to mesh axes without touching this file. Parameters live in `param_dtype` and are
cast to the compute `dtype` where used; statistics (RMS), softmaxes, RoPE angles and the
MoE router run in float32.

Attention math lives here twice, for two key layouts, with one arithmetic (f32 scores
scaled by 1/√C, disallowed slots set to the f32 minimum, f32 softmax, probabilities cast
to the value dtype): `attend` for keys as projected ([B, S, K, C], the full-sequence
pass) and `attend_cached` for keys as caches store them ([X, K, C, W], the decode step;
see kv_cache.py). Which one runs, and what gets cached, is decided by the attention
context the decoder passes to `Attention` (see transformer.py), not by this module.

Shape letters: B batch, L query tokens, S key slots (= L without a cache), D model
width, H query heads, K kv heads, R = H/K query heads per kv head, C head dim,
F MLP width, E experts, X experts per token (top-k), T = B·L flattened tokens,
A = T·X token-expert assignments. In `attend_cached`: W key slots of one cache part and
X its rows (X = B, or fewer rows each shared by G = B/X consecutive query rows).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from gspo_jax.models.config import ModelConfig

F32 = jnp.float32
F32_MIN = float(jnp.finfo(F32).min)  # score of a disallowed key slot
_INIT_STD = 0.02  # transformers' initializer_range default for Qwen


def _param(rngs: nnx.Rngs | None, shape, axes, param_dtype, init: str = "normal") -> nnx.Param:
    """A parameter with logical axis names; normal(0, 0.02) like HF init, ones, or zeros."""
    if init == "normal":
        value = _INIT_STD * jax.random.normal(rngs.params(), shape, F32)
    elif init == "ones":
        value = jnp.ones(shape, F32)
    else:
        value = jnp.zeros(shape, F32)
    # eager_sharding=False: logical names are not mesh axes; sharding.py maps them.
    return nnx.Param(value.astype(param_dtype), out_sharding=tuple(axes), eager_sharding=False)


class RMSNorm(nnx.Module):
    """y = x / sqrt(mean(x²) + eps) · scale; statistics in float32 (as transformers)."""

    def __init__(self, dim: int, eps: float, cfg: ModelConfig):
        self.scale = _param(None, (dim,), (None,), cfg.param_dtype, init="ones")
        self.eps = eps
        self.dtype = jnp.dtype(cfg.dtype)

    def __call__(self, x):
        x32 = x.astype(F32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        # transformers casts back to the activation dtype before the scale multiply.
        return normed.astype(self.dtype) * self.scale[...].astype(self.dtype)


def rope_cos_sin(cfg: ModelConfig, positions_BL):
    """cos, sin [B, L, C/2] (float32) of angle = position · inv_freq, times the RoPE scale."""
    inv_freq, scale = cfg.rope_inv_freq_and_scale()
    angles = positions_BL.astype(F32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x_BLHC, cos_BLc, sin_BLc):
    """Rotate-half RoPE (transformers layout: pairs are (i, i + C/2), not interleaved).

    [x1, x2] -> [x1·cos − x2·sin, x2·cos + x1·sin], computed in float32.
    """
    dtype = x_BLHC.dtype
    x = x_BLHC.astype(F32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    cos, sin = cos_BLc[:, :, None, :], sin_BLc[:, :, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(dtype)


class Proj(nnx.Module):
    """Linear map contracting the trailing `len(in_shape)` dims of x with the kernel's
    leading dims: y = x · W (+ b), W [*in_shape, *out_shape]."""

    def __init__(self, in_shape, out_shape, in_axes, out_axes, cfg, rngs, *, bias=False):
        in_shape, out_shape = tuple(in_shape), tuple(out_shape)
        self.kernel = _param(rngs, in_shape + out_shape, in_axes + out_axes, cfg.param_dtype)
        self.bias = (
            _param(None, out_shape, out_axes, cfg.param_dtype, init="zeros") if bias else None
        )
        self.n_in = len(in_shape)
        self.dtype = jnp.dtype(cfg.dtype)

    def __call__(self, x):
        y = jnp.tensordot(x.astype(self.dtype), self.kernel[...].astype(self.dtype), self.n_in)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


def attend(q_BLHC, k_BSKC, v_BSKC, allowed_BLS):
    """Grouped-query softmax attention: softmax(q·kᵀ/√C + mask) · v, per kv-head group.

    Query head h uses kv head h // R (transformers' repeat_kv order). Scores and softmax
    are float32; disallowed pairs get the float32 minimum, so a row with no allowed key
    (a padding query) gets a uniform, finite average instead of NaN.
    """
    B, L, H, C = q_BLHC.shape
    K = k_BSKC.shape[2]
    q_BLKRC = q_BLHC.reshape(B, L, K, H // K, C)
    scores_BKRLS = jnp.einsum("blkrc,bskc->bkrls", q_BLKRC, k_BSKC, preferred_element_type=F32) * (
        C**-0.5
    )
    scores_BKRLS = jnp.where(allowed_BLS[:, None, None], scores_BKRLS, F32_MIN)
    probs_BKRLS = jax.nn.softmax(scores_BKRLS, axis=-1).astype(v_BSKC.dtype)
    out_BLKRC = jnp.einsum("bkrls,bskc->blkrc", probs_BKRLS, v_BSKC)
    return out_BLKRC.reshape(B, L, H, C)


def attend_cached(q_BLHC, parts):
    """`attend` over keys stored in cache layout, split into parts: one softmax over the
    concatenated slots of all parts, softmax(q·kᵀ/√C + mask) · v.

    parts: sequence of (k [X, K, C, W], v [X, K, W, C], allowed), X dividing B. A part
    with X = B holds each query row's own keys; with X < B, key row x serves the
    G = B/X consecutive query rows x·G … x·G+G−1 (the G samples of one prompt), so its
    keys are read once per group as one [G·L·R, W] score block per (row, kv head) —
    never copied G times. `allowed`: bool broadcastable to [X, L, W] (1 for X or L
    broadcasts), or None when every slot is allowed.

    Keys are [.., C, W] (slot last) and values [.., W, C], so both products contract the
    cache in its stored layout: no per-step transpose of the cache. Arithmetic is
    `attend`'s (f32 scores and softmax, f32-minimum masking, probabilities cast to the
    value dtype); k/v are cast to the query dtype as `attend`'s callers do.
    """
    B, L, H, C = q_BLHC.shape
    K = parts[0][0].shape[1]
    R = H // K
    dtype = q_BLHC.dtype
    scores, shapes = [], []
    for k_XKCW, _, allowed in parts:
        X, _, _, W = k_XKCW.shape
        if B % X:
            raise ValueError(f"cache part has {X} rows, which do not divide the {B} query rows")
        q_XGLKRC = q_BLHC.reshape(X, B // X, L, K, R, C)
        # Output in dot_general's own order (batch x, k first): any other order makes
        # jnp.einsum swap the operands, and XLA:CPU then multiplies by the transposed
        # cache, several times slower than q·k.
        s_XKGLRW = jnp.einsum(
            "xglkrc,xkcw->xkglrw", q_XGLKRC, k_XKCW.astype(dtype), preferred_element_type=F32
        ) * (C**-0.5)
        if allowed is not None:
            allowed_XLW = jnp.asarray(allowed, bool)
            s_XKGLRW = jnp.where(allowed_XLW[:, None, None, :, None, :], s_XKGLRW, F32_MIN)
        scores.append(s_XKGLRW.transpose(0, 2, 1, 3, 4, 5).reshape(B, K, L, R, W))
        shapes.append((X, W))
    probs_BKLRS = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1).astype(dtype)
    out_BLHC, start = None, 0
    for (_, v_XKWC, _), (X, W) in zip(parts, shapes):
        p_XGKLRW = probs_BKLRS[..., start : start + W].reshape(X, B // X, K, L, R, W)
        o_XKGLRC = jnp.einsum("xgklrw,xkwc->xkglrc", p_XGKLRW, v_XKWC.astype(dtype))
        o_BLHC = o_XKGLRC.transpose(0, 2, 3, 1, 4, 5).reshape(B, L, H, C)
        out_BLHC = o_BLHC if out_BLHC is None else out_BLHC + o_BLHC
        start += W
    return out_BLHC


class Attention(nnx.Module):
    """GQA self-attention with RoPE, optional q/k/v(/o) bias (Qwen2) and per-head q/k
    RMSNorm before RoPE (Qwen3). Which keys a query sees (causal mask, cache) is the
    attention context's business: the same module serves forward, prefill and decode."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, H, K, C = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Proj((D,), (H, C), ("embed",), ("heads", None), cfg, rngs, bias=cfg.qkv_bias)
        self.k_proj = Proj(
            (D,), (K, C), ("embed",), ("kv_heads", None), cfg, rngs, bias=cfg.qkv_bias
        )
        self.v_proj = Proj(
            (D,), (K, C), ("embed",), ("kv_heads", None), cfg, rngs, bias=cfg.qkv_bias
        )
        self.o_proj = Proj((H, C), (D,), ("heads", None), ("embed",), cfg, rngs, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(C, cfg.rms_norm_eps, cfg)
            self.k_norm = RMSNorm(C, cfg.rms_norm_eps, cfg)
        else:
            self.q_norm = self.k_norm = None

    def __call__(self, x_BLD, cos, sin, attention):
        """attention: `attention(q_BLHC, k_BLKC, v_BLKC) -> (out_BLHC, cache_entry)`, the
        decoder's attention context for this layer (see transformer.py): it gets this
        call's normed, rotated queries/keys and values, stores what its cache keeps, and
        attends. Returns (y_BLD, cache_entry)."""
        q, k, v = self.q_proj(x_BLD), self.k_proj(x_BLD), self.v_proj(x_BLD)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out_BLHC, cache_entry = attention(q, k, v)
        return self.o_proj(out_BLHC), cache_entry


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) · up(x))."""

    def __init__(self, cfg: ModelConfig, width: int, rngs: nnx.Rngs):
        D = cfg.hidden_size
        self.gate_proj = Proj((D,), (width,), ("embed",), ("mlp",), cfg, rngs)
        self.up_proj = Proj((D,), (width,), ("embed",), ("mlp",), cfg, rngs)
        self.down_proj = Proj((width,), (D,), ("mlp",), ("embed",), cfg, rngs)

    def __call__(self, x_BLD):
        return self.down_proj(jax.nn.silu(self.gate_proj(x_BLD)) * self.up_proj(x_BLD))


def route(router_logits_TE, k: int, norm_topk_prob: bool, forced_TX=None):
    """Top-k softmax routing (Qwen3-MoE), optionally replaying given expert indices.

    p = softmax(logits) (float32); chosen = top_k(p) or, for Routing Replay (paper §5.3),
    the forced indices; gates = p[chosen], divided by their sum when norm_topk_prob.
    Gates always come from the current router, so its gradient flows under replay.
    Returns (gates_TX float32, indices_TX int32).
    """
    probs_TE = jax.nn.softmax(router_logits_TE.astype(F32), axis=-1)
    if forced_TX is None:
        gates_TX, idx_TX = jax.lax.top_k(probs_TE, k)
    else:
        idx_TX = forced_TX.astype(jnp.int32)
        gates_TX = jnp.take_along_axis(probs_TE, idx_TX, axis=-1)
    if norm_topk_prob:
        gates_TX = gates_TX / jnp.sum(gates_TX, axis=-1, keepdims=True)
    return gates_TX, idx_TX.astype(jnp.int32)


class MoE(nnx.Module):
    """Sparse MoE block: router [D, E] and E SwiGLU experts of width moe_intermediate_size.

    y_t = Σ_{e ∈ topk(t)} gate_{t,e} · down_e(silu(gate_e(x_t)) · up_e(x_t)).
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, E, F = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        # The router stays replicated: it is small and every token needs all of it.
        self.router = Proj((D,), (E,), ("embed",), (None,), cfg, rngs)
        self.gate_proj = _param(rngs, (E, D, F), ("expert", "embed", "mlp"), cfg.param_dtype)
        self.up_proj = _param(rngs, (E, D, F), ("expert", "embed", "mlp"), cfg.param_dtype)
        self.down_proj = _param(rngs, (E, F, D), ("expert", "mlp", "embed"), cfg.param_dtype)
        self.k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.impl = cfg.moe_impl
        self.dtype = jnp.dtype(cfg.dtype)

    def __call__(self, x_BLD, forced_BLX=None):
        """Returns (y_BLD, expert indices int32 [B, L, X]): the current router's own top-k,
        also when `forced_BLX` decides which experts run (Routing Replay), so a caller can
        count how many choices the router would change (paper §5.3's volatility)."""
        B, L, D = x_BLD.shape
        x_TD = x_BLD.reshape(B * L, D)
        # Router matmul in float32: routing decisions are discrete and bf16 noise would
        # flip them (the routing volatility the paper's §5.3 is about).
        logits_TE = jnp.dot(x_TD.astype(F32), self.router.kernel[...].astype(F32))
        forced_TX = None if forced_BLX is None else forced_BLX.reshape(B * L, self.k)
        gates_TX, idx_TX = route(logits_TE, self.k, self.norm_topk_prob, forced_TX)
        own_TX = idx_TX if forced_TX is None else route(logits_TE, self.k, False)[1]
        wg, wu, wd = (
            w[...].astype(self.dtype) for w in (self.gate_proj, self.up_proj, self.down_proj)
        )
        x_TD = x_TD.astype(self.dtype)
        if self.impl == "dense":
            y_TD = _experts_dense(x_TD, gates_TX, idx_TX, wg, wu, wd)
        else:
            y_TD = _experts_ragged(x_TD, gates_TX, idx_TX, wg, wu, wd)
        return y_TD.astype(self.dtype).reshape(B, L, D), own_TX.reshape(B, L, self.k)


def _experts_dense(x_TD, gates_TX, idx_TX, wg_EDF, wu_EDF, wd_EFD):
    """Every expert on every token; combine with the sparse gate matrix (exact reference)."""
    E = wg_EDF.shape[0]
    gate_TE = jnp.einsum("tx,txe->te", gates_TX, jax.nn.one_hot(idx_TX, E, dtype=F32))
    h_TEF = jax.nn.silu(jnp.einsum("td,edf->tef", x_TD, wg_EDF)) * jnp.einsum(
        "td,edf->tef", x_TD, wu_EDF
    )
    y_TED = jnp.einsum("tef,efd->ted", h_TEF, wd_EFD, preferred_element_type=F32)
    return jnp.einsum("ted,te->td", y_TED, gate_TE)


def _experts_ragged(x_TD, gates_TX, idx_TX, wg_EDF, wu_EDF, wd_EFD):
    """Sort the T·X assignments by expert, run each expert on its contiguous group with
    `jax.lax.ragged_dot`, unsort, and combine with the gates: compute ∝ top-k, not E."""
    T, X = idx_TX.shape
    E = wg_EDF.shape[0]
    expert_A = idx_TX.reshape(T * X)
    order_A = jnp.argsort(expert_A, stable=True)
    group_sizes_E = jnp.bincount(expert_A, length=E).astype(jnp.int32)
    xs_AD = x_TD[order_A // X]
    h_AF = jax.nn.silu(jax.lax.ragged_dot(xs_AD, wg_EDF, group_sizes_E)) * jax.lax.ragged_dot(
        xs_AD, wu_EDF, group_sizes_E
    )
    ys_AD = jax.lax.ragged_dot(h_AF, wd_EFD, group_sizes_E, preferred_element_type=F32)
    y_AD = jnp.zeros_like(ys_AD).at[order_A].set(ys_AD, unique_indices=True)
    return jnp.einsum("txd,tx->td", y_AD.reshape(T, X, -1), gates_TX)
