"""Flax NNX building blocks of the Qwen decoder: RMSNorm, RoPE, GQA attention, SwiGLU MLP, MoE.

Where it sits: `block.Block` (stacked by `block.Layers`, run by layer_stack.py) uses these; nothing here knows about checkpoints,
caches as pytrees, or training. Every parameter is an `nnx.Param` carrying its logical
axis names (metadata `out_sharding`, with eager sharding off) so `sharding/rules.py` can map
them to mesh axes without touching this file. Parameters live in `param_dtype` and are
cast to the compute `dtype` where used; statistics (RMS), softmaxes, RoPE angles and the
MoE router run in float32.

The attention math itself (which keys a query sees, the kernels) lives in attention.py;
which of it runs, and what gets cached, is decided by the attention context the decoder
passes to `Attention` (see contexts.py, kv_cache.py), not by this module.

Each module here is one layer's worth of parameters; the decoder stacks them on a leading
layer axis (`nnx.vmap`) and scans over that axis (layer_stack.py).

Shape letters: B batch, L query tokens, D model width, H query heads, K kv heads,
C head dim, F MLP width, E experts, X experts per token (top-k), J = B·L tokens
flattened, A = J·X token-expert assignments.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from gspo_jax.models import moe_aux, partition
from gspo_jax.models.config import ModelConfig
from gspo_jax.models.grouped import grouped_matmul

F32 = jnp.float32
_INIT_STD = 0.02  # transformers' initializer_range default for Qwen


def _param(rngs: nnx.Rngs | None, shape, axes, param_dtype, init: str = "normal") -> nnx.Param:
    """A parameter with logical axis names; normal(0, 0.02) like HF init, ones, zeros, or
    "lora_a": uniform(±1/√fan_in) over all but the last (rank) dim, PEFT's default for A
    (kaiming_uniform with a = √5)."""
    if init == "normal":
        value = _INIT_STD * jax.random.normal(rngs.params(), shape, F32)
    elif init == "lora_a":
        bound = 1.0 / math.sqrt(math.prod(shape[:-1]))
        value = jax.random.uniform(rngs.params(), shape, F32, -bound, bound)
    elif init == "ones":
        value = jnp.ones(shape, F32)
    else:
        value = jnp.zeros(shape, F32)
    # eager_sharding=False: logical names are not mesh axes; sharding/rules.py maps them.
    return nnx.Param(value.astype(param_dtype), out_sharding=tuple(axes), eager_sharding=False)


class RMSNorm(nnx.Module):
    """y = x / sqrt(mean(x²) + eps) · scale; statistics in float32 (as transformers).

    Zero-centred (hybrid Qwen3.5, `cfg.is_hybrid`): the stored scale is w, initialised to
    0, and y = (x / sqrt(mean(x²) + eps) · (1 + w)) computed in float32, then cast
    (transformers' Qwen3_5RMSNorm), so w is read and written as the checkpoint holds it."""

    def __init__(self, dim: int, eps: float, cfg: ModelConfig):
        self.zero_centred = cfg.is_hybrid
        init = "zeros" if self.zero_centred else "ones"
        self.scale = _param(None, (dim,), (None,), cfg.param_dtype, init=init)
        self.eps = eps
        self.dtype = jnp.dtype(cfg.dtype)

    def __call__(self, x):
        x32 = x.astype(F32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.zero_centred:
            return (normed * (1.0 + self.scale[...].astype(F32))).astype(self.dtype)
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

    Kept in this form on purpose: x ⊙ [cos, cos] + roll(x, C/2) ⊙ [−sin, sin] is faster
    on the TRL anchor's train step (XLA:CPU fuses it better), but XLA then contracts the
    multiply-adds differently in the π_old pass and in the update's forward of a scanned
    model, so the first update's ratios were no longer exactly 1 (tests/e2e/test_presets.py,
    tests/train_step/test_routing_replay.py; the figures: docs/benchmarks.md, "What was tried").
    """
    dtype = x_BLHC.dtype
    rotary = 2 * cos_BLc.shape[-1]
    if rotary < x_BLHC.shape[-1]:  # partial rotary (Qwen3.5): the rest passes unrotated
        head, tail = x_BLHC[..., :rotary], x_BLHC[..., rotary:]
        return jnp.concatenate([apply_rope(head, cos_BLc, sin_BLc), tail], axis=-1)
    x = x_BLHC.astype(F32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    cos, sin = cos_BLc[:, :, None, :], sin_BLc[:, :, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(dtype)


class Proj(nnx.Module):
    """Linear map contracting the trailing `len(in_shape)` dims of x with the kernel's
    leading dims: y = x · W (+ b), W [*in_shape, *out_shape].

    With a LoRA rank r > 0 (`cfg.lora_rank_of(name)`, models/lora.py):
    y = x · W + (alpha/r) · (x · A) · B (+ b), A [*in_shape, r] (uniform ±1/√fan_in, seeded
    by the params RNG), B [r, *out_shape] zeros, so a fresh adapter leaves y unchanged. A
    and B carry the kernel's logical axes on their in / out dims; the rank dim is
    replicated. They are float32 whatever `param_dtype` (a bf16 base, f32 adapters)."""

    def __init__(self, in_shape, out_shape, in_axes, out_axes, cfg, rngs, *, bias=False, name=""):
        in_shape, out_shape = tuple(in_shape), tuple(out_shape)
        self.kernel = _param(rngs, in_shape + out_shape, in_axes + out_axes, cfg.param_dtype)
        self.bias = (
            _param(None, out_shape, out_axes, cfg.param_dtype, init="zeros") if bias else None
        )
        rank = cfg.lora_rank_of(name)
        self.lora_scale = cfg.lora_scale
        if rank:
            # Adapters keep float32 master weights whatever the (frozen) base's param_dtype.
            self.lora_a = _param(
                rngs, in_shape + (rank,), in_axes + (None,), "float32", init="lora_a"
            )
            self.lora_b = _param(
                None, (rank,) + out_shape, (None,) + out_axes, "float32", init="zeros"
            )
        else:
            self.lora_a = self.lora_b = None
        self.n_in = len(in_shape)
        self.dtype = jnp.dtype(cfg.dtype)

    def __call__(self, x):
        # One 2-D matmul [tokens, in] x [in, out]: contracting several dims (or a [B, L, .]
        # activation) makes XLA:CPU transpose the activation cotangent before each weight
        # gradient, a copy as slow as the matmul itself (benchmarks/rl_step.py --profile).
        kernel = self.kernel[...].astype(self.dtype)
        lead, out_shape = x.shape[: x.ndim - self.n_in], kernel.shape[self.n_in :]
        fan_in = math.prod(kernel.shape[: self.n_in])
        x2 = x.astype(self.dtype).reshape(-1, fan_in)
        y = jnp.dot(x2, kernel.reshape(fan_in, -1))
        if self.lora_a is not None:
            a = self.lora_a[...].astype(self.dtype).reshape(fan_in, -1)
            b = self.lora_b[...].astype(self.dtype)
            y = y + self.lora_scale * jnp.dot(jnp.dot(x2, a), b.reshape(b.shape[0], -1))
        y = y.reshape(lead + out_shape)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


class Attention(nnx.Module):
    """GQA self-attention with RoPE, optional q/k/v(/o) bias (Qwen2) and per-head q/k
    RMSNorm before RoPE (Qwen3). Hybrid Qwen3.5 adds an output gate: q_proj gives
    [H, 2C] per token, the query (first C) and a gate (last C), and the attention output
    is multiplied by σ(gate) before o_proj; RoPE rotates the first `rotary_dim` dims only
    (`apply_rope` with shorter cos/sin). Which keys a query sees (causal mask, cache) is the
    attention context's business: the same module serves forward, prefill and decode."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, H, K, C = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.gated = cfg.is_hybrid
        self.q_proj = Proj(
            (D,),
            (H, 2 * C if self.gated else C),
            ("embed",),
            ("heads", None),
            cfg,
            rngs,
            bias=cfg.qkv_bias,
            name="q_proj",
        )
        kv = ((D,), (K, C), ("embed",), ("kv_heads", None), cfg, rngs)
        self.k_proj = Proj(*kv, bias=cfg.qkv_bias, name="k_proj")
        self.v_proj = Proj(*kv, bias=cfg.qkv_bias, name="v_proj")
        self.o_proj = Proj(
            (H, C), (D,), ("heads", None), ("embed",), cfg, rngs, bias=cfg.o_bias, name="o_proj"
        )
        if cfg.qk_norm:
            self.q_norm = RMSNorm(C, cfg.rms_norm_eps, cfg)
            self.k_norm = RMSNorm(C, cfg.rms_norm_eps, cfg)
        else:
            self.q_norm = self.k_norm = None

    def __call__(self, x_BLD, cos, sin, attention):
        """attention: `attention(q_BLHC, k_BLKC, v_BLKC) -> (out_BLHC, cache_entry)`, the
        decoder's attention context for this layer (see decoder.py): it gets this
        call's normed, rotated queries/keys and values, stores what its cache keeps, and
        attends. Returns (y_BLD, cache_entry)."""
        q = partition.constrain(self.q_proj(x_BLD), partition.HEADS)
        gate = None
        if self.gated:
            q, gate = jnp.split(q, 2, axis=-1)
        k = partition.constrain(self.k_proj(x_BLD), partition.KV_HEADS)
        v = partition.constrain(self.v_proj(x_BLD), partition.KV_HEADS)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Names the selective remat policies save (layer_stack.REMAT_SAVED_NAMES).
        q, k, v = (checkpoint_name(t, "qkv") for t in (q, k, v))
        out_BLHC, cache_entry = attention(q, k, v)
        out_BLHC = checkpoint_name(partition.constrain(out_BLHC, partition.HEADS), "attention")
        if gate is not None:
            out_BLHC = out_BLHC * jax.nn.sigmoid(gate.astype(F32)).astype(out_BLHC.dtype)
        return partition.constrain(self.o_proj(out_BLHC), partition.RESIDUAL), cache_entry


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) · up(x))."""

    def __init__(self, cfg: ModelConfig, width: int, rngs: nnx.Rngs):
        D = cfg.hidden_size
        self.gate_proj = Proj((D,), (width,), ("embed",), ("mlp",), cfg, rngs, name="gate_proj")
        self.up_proj = Proj((D,), (width,), ("embed",), ("mlp",), cfg, rngs, name="up_proj")
        self.down_proj = Proj((width,), (D,), ("mlp",), ("embed",), cfg, rngs, name="down_proj")

    def __call__(self, x_BLD):
        gate_BLF = partition.constrain(self.gate_proj(x_BLD), partition.HIDDEN)
        up_BLF = partition.constrain(self.up_proj(x_BLD), partition.HIDDEN)
        return partition.constrain(
            self.down_proj(jax.nn.silu(gate_BLF) * up_BLF), partition.RESIDUAL
        )


def route(router_logits_JE, k: int, norm_topk_prob: bool, forced_JX=None):
    """Top-k softmax routing (Qwen3-MoE), optionally replaying given expert indices.

    p = softmax(logits) (float32); chosen = top_k(p) or, for Routing Replay (paper §5.3),
    the forced indices; gates = p[chosen], divided by their sum when norm_topk_prob.
    Gates always come from the current router, so its gradient flows under replay.
    Returns (gates_JX float32, indices_JX int32).
    """
    probs_JE = jax.nn.softmax(router_logits_JE.astype(F32), axis=-1)
    if forced_JX is None:
        gates_JX, idx_JX = _top_k_per_device(probs_JE, k)
    else:
        idx_JX = forced_JX.astype(jnp.int32)
        gates_JX = jnp.take_along_axis(probs_JE, idx_JX, axis=-1)
    if norm_topk_prob:
        gates_JX = gates_JX / jnp.sum(gates_JX, axis=-1, keepdims=True)
    return gates_JX, idx_JX.astype(jnp.int32)


def _top_k_per_device(probs_JE, k: int):
    """`jax.lax.top_k` over experts, each device on its own tokens (rows over the batch
    axes) under a mesh in context: GSPMD partitioned top_k by gathering every token's
    router probabilities on every device."""
    mesh = partition.context_mesh()
    if mesh is None:
        return jax.lax.top_k(probs_JE, k)
    rows = partition.spec(mesh, ("batch", None), probs_JE.shape)
    return jax.shard_map(
        lambda p: tuple(jax.lax.top_k(p, k)),
        mesh=mesh,
        in_specs=rows,
        out_specs=(rows, rows),
        check_vma=False,
    )(probs_JE)


class MoE(nnx.Module):
    """Sparse MoE block: router [D, E] and E SwiGLU experts of width moe_intermediate_size.

    y_j = Σ_{e ∈ topk(j)} gate_{j,e} · down_e(silu(gate_e(x_j)) · up_e(x_j)) for each token j,
    plus, with a shared expert (Qwen3.5-MoE, `shared_expert_intermediate_size`),
    σ(w_sᵀ x_j) · shared(x_j), a SwiGLU every token goes through, scaled by its own gate.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, E, F = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        # The router stays replicated: it is small and every token needs all of it.
        self.router = Proj((D,), (E,), ("embed",), (None,), cfg, rngs)
        self.gate_proj = _param(rngs, (E, D, F), ("expert", "embed", "mlp"), cfg.param_dtype)
        self.up_proj = _param(rngs, (E, D, F), ("expert", "embed", "mlp"), cfg.param_dtype)
        self.down_proj = _param(rngs, (E, F, D), ("expert", "mlp", "embed"), cfg.param_dtype)
        S = cfg.shared_expert_intermediate_size
        self.shared_expert = MLP(cfg, S, rngs) if S else None
        self.shared_expert_gate = Proj((D,), (1,), ("embed",), (None,), cfg, rngs) if S else None
        self.k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.impl = cfg.moe_impl
        self.dtype = jnp.dtype(cfg.dtype)

    def __call__(self, x_BLD, forced_BLX=None, stats_mask_BL=None):
        """Returns (y_BLD, expert indices int32 [B, L, X]): the current router's own top-k,
        also when `forced_BLX` decides which experts run (Routing Replay), so a caller can
        count how many choices the router would change (paper §5.3's volatility).

        With `stats_mask_BL` (1 for a real token) also this layer's router load statistics
        for the load-balancing loss, `moe_aux.router_load_stats` of its router logits over
        the real tokens, counted on the router's own top-k (as transformers counts them,
        whatever experts replay runs): (y_BLD, indices, (counts [E], probs [E], rows))."""
        B, L, D = x_BLD.shape
        J = B * L
        x_JD = partition.constrain(x_BLD.reshape(J, D), ("batch", None))
        # Router matmul in float32: routing decisions are discrete and bf16 noise would
        # flip them (the routing volatility the paper's §5.3 is about).
        logits_JE = jnp.dot(x_JD.astype(F32), self.router.kernel[...].astype(F32))
        # Tokens' rows stay where they are (GSPMD gathered every token's logits).
        logits_JE = partition.constrain(logits_JE, ("batch", None))
        forced_JX = None if forced_BLX is None else forced_BLX.reshape(J, self.k)
        gates_JX, idx_JX = route(logits_JE, self.k, self.norm_topk_prob, forced_JX)
        own_JX = idx_JX if forced_JX is None else route(logits_JE, self.k, False)[1]
        wg, wu, wd = (
            w[...].astype(self.dtype) for w in (self.gate_proj, self.up_proj, self.down_proj)
        )
        x_JD = x_JD.astype(self.dtype)
        if self.impl == "dense":
            y_JD = _experts_dense(x_JD, gates_JX, idx_JX, wg, wu, wd)
        elif L > 1:  # full-sequence passes: many tokens per row
            y_JD = _experts_ragged_per_device(B, x_JD, gates_JX, idx_JX, wg, wu, wd)
        else:
            # The decode step: B tokens in all, and the per-device path's weight gathers,
            # loop-invariant, were hoisted out of the sampler's loop for every layer at
            # once, many times the temporaries of this way (docs/tpu.md, "MoE on TPU").
            y_JD = _experts_on_their_chips(x_JD, gates_JX, idx_JX, wg, wu, wd)
        y_BLD = y_JD.astype(self.dtype).reshape(B, L, D)
        if self.shared_expert is not None:
            gate_BL1 = jax.nn.sigmoid(self.shared_expert_gate(x_BLD).astype(F32))
            y_BLD = y_BLD + gate_BL1.astype(self.dtype) * self.shared_expert(x_BLD)
        out = (y_BLD, own_JX.reshape(B, L, self.k))
        if stats_mask_BL is None:
            return out
        stats = moe_aux.router_load_stats(
            logits_JE, self.k, stats_mask_BL.reshape(J), chosen_JX=own_JX
        )
        return (*out, stats)


def _experts_dense(x_JD, gates_JX, idx_JX, wg_EDF, wu_EDF, wd_EFD):
    """Every expert on every token; combine with the sparse gate matrix (exact reference)."""
    E = wg_EDF.shape[0]
    gate_JE = jnp.einsum("jx,jxe->je", gates_JX, jax.nn.one_hot(idx_JX, E, dtype=F32))
    h_JEF = jax.nn.silu(jnp.einsum("jd,edf->jef", x_JD, wg_EDF)) * jnp.einsum(
        "jd,edf->jef", x_JD, wu_EDF
    )
    y_JED = jnp.einsum("jef,efd->jed", h_JEF, wd_EFD, preferred_element_type=F32)
    return jnp.einsum("jed,je->jd", y_JED, gate_JE)


def _experts_ragged_per_device(B, x_JD, gates_JX, idx_JX, wg_EDF, wu_EDF, wd_EFD):
    """`_experts_ragged` with each device sorting and running only its own tokens.

    Under a mesh, a sort over the batch-sharded tokens would be global: XLA then gave
    every chip the whole batch's J·X sorted assignments (the memory it took: docs/tpu.md,
    "MoE on TPU"). Here, in `jax.shard_map`, the tokens stay where they
    are (rows over the batch axes) and each device gets this layer's expert weights whole
    (gathered like FSDP gathers a dense layer, bf16 after the cast) for its own sort and
    ragged matmuls: memory ∝ local tokens. Weight gradients are summed back by the
    shard_map's transpose. Without a mesh in context it is `_experts_ragged`. Used for
    the full-sequence passes; the decode step's few tokens go to each chip's own experts
    instead (`_experts_on_their_chips`).
    """
    mesh = partition.context_mesh()
    if mesh is None:
        return _experts_ragged(x_JD, gates_JX, idx_JX, wg_EDF, wu_EDF, wd_EFD)
    rows = partition.spec(mesh, ("batch",), (B,))  # J = B·L, rows major: B's split
    tokens, whole = jax.sharding.PartitionSpec(rows[0], None), jax.sharding.PartitionSpec()
    return jax.shard_map(
        _experts_ragged,
        mesh=mesh,
        in_specs=(tokens, tokens, tokens, whole, whole, whole),
        out_specs=tokens,
        check_vma=False,
    )(x_JD, gates_JX, idx_JX, wg_EDF, wu_EDF, wd_EFD)


def _experts_on_their_chips(x_JD, gates_JX, idx_JX, wg_EDF, wu_EDF, wd_EFD):
    """The decode step's experts where the weights split experts over mesh axes (the
    rollout's `expert` axis): each chip runs its own experts on the step's tokens, and the
    partial outputs are summed over those axes (and the MLP width's): an all-reduce of
    [J, D] activations per layer. Left to GSPMD, a ragged_dot whose groups are split
    gathered every expert's weights on every chip, every step (Qwen3.5-35B-A3B's decode
    loop: 397 TB of all-gathers per chip, docs/tpu.md section 10). Tokens split over
    those axes too are gathered first, and each chip keeps its rows of the sum. Without
    a mesh or split experts: `_experts_ragged`."""
    mesh = partition.context_mesh()
    w_spec = None if mesh is None else partition.spec(mesh, ("expert", None, "mlp"), wg_EDF.shape)
    if w_spec is None or w_spec[0] is None:
        return _experts_ragged(x_JD, gates_JX, idx_JX, wg_EDF, wu_EDF, wd_EFD)

    def axes(entry):
        return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)

    experts, width = axes(w_spec[0]), axes(w_spec[2])
    P = jax.sharding.PartitionSpec
    row_spec = partition.spec(mesh, ("batch", None), x_JD.shape)
    gathered = tuple(a for a in axes(row_spec[0]) if a in experts + width)
    kept = tuple(a for a in experts + width if a not in gathered)

    def local(x_JD, gates_JX, idx_JX, wg_EDF, wu_EDF, wd_EFD):
        if gathered:
            x_JD, gates_JX, idx_JX = (
                jax.lax.all_gather(t, gathered, axis=0, tiled=True)
                for t in (x_JD, gates_JX, idx_JX)
            )
        E = wg_EDF.shape[0]
        idx_JX = idx_JX - jax.lax.axis_index(experts) * E  # this chip's experts: 0 .. E-1
        mine_JX = (idx_JX >= 0) & (idx_JX < E)
        y_JD = _experts_ragged(x_JD, gates_JX, idx_JX, wg_EDF, wu_EDF, wd_EFD, mine_JX)
        if gathered:
            y_JD = jax.lax.psum_scatter(y_JD, gathered, scatter_dimension=0, tiled=True)
        return jax.lax.psum(y_JD, kept) if kept else y_JD

    w_down = P(w_spec[0], w_spec[2], None)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(row_spec, row_spec, row_spec, w_spec, w_spec, w_down),
        out_specs=row_spec,
        check_vma=False,
    )(x_JD, gates_JX, idx_JX, wg_EDF, wu_EDF, wd_EFD)


def _experts_ragged(x_JD, gates_JX, idx_JX, wg_EDF, wu_EDF, wd_EFD, mine_JX=None):
    """Sort the J·X assignments by expert, run each expert on its contiguous group with
    `jax.lax.ragged_dot` (`grouped.grouped_matmul`: its weight gradient without a dense
    matmul over every expert on TPU), unsort, and combine with the gates: compute ∝ top-k,
    not E. `mine_JX` (False: an assignment to another chip's expert) puts those last, in
    no group, their output 0."""
    J, X = idx_JX.shape
    E = wg_EDF.shape[0]
    expert_A = idx_JX.reshape(J * X)
    if mine_JX is not None:  # bincount drops E: the groups end before these rows
        expert_A = jnp.where(mine_JX.reshape(J * X), expert_A, E)
    order_A = jnp.argsort(expert_A, stable=True)
    group_sizes_E = jnp.bincount(expert_A, length=E).astype(jnp.int32)
    xs_AD = x_JD[order_A // X]
    h_AF = jax.nn.silu(grouped_matmul(xs_AD, wg_EDF, group_sizes_E)) * grouped_matmul(
        xs_AD, wu_EDF, group_sizes_E
    )
    ys_AD = grouped_matmul(h_AF, wd_EFD, group_sizes_E, F32)
    y_AD = jnp.zeros_like(ys_AD).at[order_A].set(ys_AD, unique_indices=True)
    if mine_JX is not None:  # rows past the groups: whatever the kernel left there
        y_AD = jnp.where(mine_JX.reshape(J * X, 1), y_AD, 0.0)
    return jnp.einsum("jxd,jx->jd", y_AD.reshape(J, X, -1), gates_JX)
