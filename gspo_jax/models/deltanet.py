"""Gated DeltaNet, the linear-attention layer of the hybrid Qwen3.5 models: one set of
weights, two forms of the same recurrence (arXiv 2412.06464; transformers' Qwen3_5GatedDeltaNet).

Per value head, with state S [d_k, d_v] (float32) and the token's L2-normalised key k,
query q (scaled by 1/√d_k), value v, decay g ≤ 0 and write strength β ∈ (0, 1):

    S ← exp(g)·S;   S ← S + k ⊗ β·(v − Sᵀk);   out = Sᵀq

- `recurrent_gated_delta_rule`: that loop, token by token (`jax.lax.scan`): the decode step.
- `chunk_gated_delta_rule`: the same sums, chunk by chunk (`chunk_size` tokens, a
  unit-triangular solve inside each chunk — the UT transform — and one state update per
  chunk, scanned in float32): the full-sequence passes (train step, log-probs, prefill).

Around the rule (`GatedDeltaNet`): x → in_proj_qkv → causal depthwise conv (kernel K,
the previous K−1 inputs kept as the conv window) → SiLU → split q, k, v; g = −exp(A_log)·
softplus(in_proj_a x + dt_bias), β = σ(in_proj_b x); the rule's output → RMSNorm gated by
SiLU(in_proj_z x) → out_proj. Key heads are shared by linear_num_value_heads /
linear_num_key_heads consecutive value heads. Padding: the input is zeroed at padding
tokens (as transformers does) and g = β = 0 there, so a padding token leaves the state
and the conv window's contribution untouched wherever it sits.

Shape letters: B batch, L tokens, D model width, H value heads, J key heads, k key dim,
v value dim, W conv window (K − 1), Q conv channels (2·J·k + H·v), N chunks, C chunk size.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from gspo_jax.models import partition
from gspo_jax.models.config import ModelConfig
from gspo_jax.models.layers import Proj, _param

F32 = jnp.float32


def l2norm(x, eps: float = 1e-6):
    """x / sqrt(Σx² + eps) over the last dim (the FLA / transformers form), float32."""
    x = x.astype(F32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _prepare(q_BLJk, k_BLJk, v_BLHv, g_BLH, beta_BLH):
    """float32, key heads repeated to the value heads, q/k L2-normalised, q scaled."""
    H, J = v_BLHv.shape[2], q_BLJk.shape[2]
    q, k = (jnp.repeat(x, H // J, axis=2) for x in (q_BLJk, k_BLJk))
    q, k = l2norm(q), l2norm(k)
    q = q * (q.shape[-1] ** -0.5)
    return q, k, v_BLHv.astype(F32), g_BLH.astype(F32), beta_BLH.astype(F32)


def recurrent_gated_delta_rule(q_BLJk, k_BLJk, v_BLHv, g_BLH, beta_BLH, state_BHkv=None):
    """The gated delta rule token by token. Returns (out [B, L, H, v] float32, final
    state [B, H, k, v] float32). `state_BHkv`: the state before the first token (zeros)."""
    q, k, v, g, beta = _prepare(q_BLJk, k_BLJk, v_BLHv, g_BLH, beta_BLH)
    B, _, H, dv = v.shape
    if state_BHkv is None:
        state_BHkv = jnp.zeros((B, H, k.shape[-1], dv), F32)

    def step(S, xs):
        q_t, k_t, v_t, g_t, b_t = xs  # [B, H, k], [B, H, k], [B, H, v], [B, H], [B, H]
        S = S * jnp.exp(g_t)[..., None, None]
        kv_mem = jnp.einsum("bhkv,bhk->bhv", S, k_t)
        delta = (v_t - kv_mem) * b_t[..., None]
        S = S + k_t[..., :, None] * delta[..., None, :]
        return S, jnp.einsum("bhkv,bhk->bhv", S, q_t)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    state, out_LBHv = jax.lax.scan(step, state_BHkv.astype(F32), xs)
    return jnp.moveaxis(out_LBHv, 0, 1), state


def chunk_gated_delta_rule(
    q_BLJk,
    k_BLJk,
    v_BLHv,
    g_BLH,
    beta_BLH,
    state_BHkv=None,
    *,
    chunk_size: int = 64,
    reset_BL=None,
):
    """The gated delta rule chunk by chunk: the same result as
    `recurrent_gated_delta_rule` (float rounding aside) with matmuls over C tokens.

    Within a chunk, with cumulative decay c_i = Σ_{j≤i} g_j and Γ_ij = exp(c_i − c_j)
    (i ≥ j, else 0): the chunk's corrected values U and decayed keys W solve the
    unit-lower-triangular system (I + strict_lower(β k kᵀ ⊙ Γ)) [U, W] = [β v, β k e^c];
    then v' = U − W S, out = (q e^c) S + (q kᵀ ⊙ Γ) v', S ← e^{c_C} S + (k e^{c_C − c})ᵀ v'.
    The sequence is zero-padded to a multiple of C (g = β = 0 there: no effect).

    reset_BL (bool, packed rows): the state is 0 before each token marked (a segment's
    first), as if exp(g) were 0 there. Exactly, without an infinite g in the cumulative
    sums: with s_i the resets at or before token i within its chunk, Γ_ij is 0 unless
    s_i = s_j, the carried state reaches token i only when s_i = 0, token j reaches the
    next chunk's state only when s_j = s_C, and the chunk's decay e^{c_C} only when s_C = 0.
    Returns (out [B, L, H, v] float32, final state [B, H, k, v] float32).
    """
    q, k, v, g, beta = _prepare(q_BLJk, k_BLJk, v_BLHv, g_BLH, beta_BLH)
    B, L, H, dv = v.shape
    dk, C = k.shape[-1], chunk_size
    pad = (-L) % C
    N = (L + pad) // C

    def chunks(x):  # [B, L, H, ...] -> [N, B, H, C, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(B, N, C, H, *x.shape[3:])
        return jnp.moveaxis(jnp.moveaxis(x, 3, 2), 1, 0)

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    cum = jnp.cumsum(g, axis=-1)  # [N, B, H, C]
    lower = jnp.tril(jnp.ones((C, C), bool))
    from_start, to_end = cum, cum[..., -1:] - cum  # log decays: chunk start -> i, i -> end
    if reset_BL is not None:  # s: resets so far in the chunk ([N, B, 1, C], all heads)
        r = jnp.pad(reset_BL.astype(jnp.int32), [(0, 0), (0, pad)]).reshape(B, N, C)
        s = jnp.cumsum(jnp.moveaxis(r, 1, 0), axis=-1)[:, :, None]
        lower = lower & (s[..., :, None] == s[..., None, :])
        from_start = jnp.where(s == 0, from_start, -jnp.inf)
        to_end = jnp.where(s == s[..., -1:], to_end, -jnp.inf)
    decay_CC = jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    k_beta = k * beta[..., None]
    system = jnp.einsum("nbhik,nbhjk->nbhij", k_beta, k) * decay_CC
    system = jnp.where(jnp.tril(jnp.ones((C, C), bool), -1), system, 0.0) + jnp.eye(C, dtype=F32)
    rhs = jnp.concatenate([v * beta[..., None], k_beta * jnp.exp(from_start)[..., None]], axis=-1)
    solved = _unit_lower_solve(system, rhs)
    u, w = solved[..., :dv], solved[..., dv:]
    intra = jnp.einsum("nbhik,nbhjk->nbhij", q, k) * decay_CC
    q_dec = q * jnp.exp(from_start)[..., None]
    k_dec = k * jnp.exp(to_end)[..., None]
    chunk_decay = jnp.exp(from_start[..., -1])[..., None, None]
    if state_BHkv is None:
        state_BHkv = jnp.zeros((B, H, dk, dv), F32)

    def step(S, xs):
        u_c, w_c, intra_c, q_c, k_c, decay_c = xs
        v_new = u_c - jnp.einsum("bhck,bhkv->bhcv", w_c, S)
        out = jnp.einsum("bhck,bhkv->bhcv", q_c, S) + jnp.einsum("bhij,bhjv->bhiv", intra_c, v_new)
        S = S * decay_c + jnp.einsum("bhck,bhcv->bhkv", k_c, v_new)
        return S, out

    xs = (u, w, intra, q_dec, k_dec, chunk_decay)
    state, out_NBHCv = jax.lax.scan(step, state_BHkv.astype(F32), xs)
    out = jnp.moveaxis(out_NBHCv, 0, 1).transpose(0, 1, 3, 2, 4).reshape(B, N * C, H, dv)
    return out[:, :L], state


def _unit_lower_inverse(a_CC):
    """a⁻¹ for unit-lower-triangular a ([..., C, C], batched; only a's strictly lower part
    is read), by recursive blocks: if T₁₁ and T₂₂ invert two adjacent diagonal blocks of
    size s, then [[T₁₁, 0], [−T₂₂ a₂₁ T₁₁, T₂₂]] inverts the 2s block they make. From s = 1
    (T = 1) to C (padded to a power of 2 with the identity): log₂ C rounds of batched
    matmuls, no loop over rows — the FLA kernels' blocked inverse, all the way down.

    The matmuls run at HIGHEST precision (on TPU, f32 in several bf16 passes rather than
    one): each round's T₂₁ feeds the next, and they are ~C²·log C flops against the C²·X of
    the product a⁻¹b that follows."""
    C, lead = a_CC.shape[-1], a_CC.shape[:-2]
    P = 1 << (C - 1).bit_length()  # the power of 2 >= C
    strict = jnp.where(jnp.tril(jnp.ones((C, C), bool), -1), a_CC, 0.0)
    strict = jnp.pad(strict, [(0, 0)] * len(lead) + [(0, P - C)] * 2)
    mm = functools.partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)
    t = jnp.ones((*lead, P, 1, 1), a_CC.dtype)  # the inverses of the P diagonal 1-blocks
    s = 1
    while s < P:  # t: [..., P/s, s, s], the inverses of the diagonal s-blocks
        nb = P // (2 * s)  # the diagonal 2s-blocks of a, by a strided slice of the pairs
        pairs = jnp.swapaxes(strict.reshape(*lead, nb, 2 * s, nb, 2 * s), -3, -2)
        a21 = pairs.reshape(*lead, nb * nb, 2 * s, 2 * s)[..., :: nb + 1, s:, :s]
        t11, t22 = t[..., 0::2, :, :], t[..., 1::2, :, :]
        t21 = -mm(mm(t22, a21), t11)
        top = jnp.concatenate([t11, jnp.zeros_like(t11)], axis=-1)
        t = jnp.concatenate([top, jnp.concatenate([t21, t22], axis=-1)], axis=-2)
        s *= 2
    return t[..., 0, :C, :C]


@jax.custom_vjp
def _unit_lower_solve(a_CC, b_CX):
    """X with a X = b for unit-lower-triangular a (batched over leading dims; only a's
    strictly lower part is read): X = a⁻¹ b, the inverse by blocks (`_unit_lower_inverse`),
    then one matmul. Plain matmuls and slices, which GSPMD partitions without collectives
    (XLA:CPU's partitioned triangular_solve deadlocked on a mesh).

    It replaces a forward substitution (a `lax.scan` over the C rows) whose every row read
    and wrote the whole [..., C, X] carry: ~6 TB of HBM traffic per chip in one train step
    of Qwen3.5-0.8B on v5e-8 (docs/tpu.md, section 10). The gradient is written by hand
    (`_solve_bwd`), two matmuls with the saved inverse."""
    return jnp.matmul(_unit_lower_inverse(a_CC), b_CX)


def _solve_fwd(a_CC, b_CX):
    t_CC = _unit_lower_inverse(a_CC)
    x_CX = jnp.matmul(t_CC, b_CX)
    return x_CX, (t_CC, x_CX)


def _solve_bwd(residuals, dx_CX):
    """X = a⁻¹b: db = a⁻ᵀ dX, da = −db Xᵀ on the strictly lower part (the only part the
    solve reads)."""
    t_CC, x_CX = residuals
    C = t_CC.shape[-1]
    db = jnp.einsum("...ji,...jx->...ix", t_CC, dx_CX)
    da = -jnp.einsum("...ix,...jx->...ij", db, x_CX)
    da = jnp.where(jnp.tril(jnp.ones((C, C), bool), -1), da, 0.0).astype(t_CC.dtype)
    return da, db.astype(dx_CX.dtype)


_unit_lower_solve.defvjp(_solve_fwd, _solve_bwd)


def causal_conv(x_BLQ, w_QK, window_BWQ=None, reset_BL=None):
    """Causal depthwise conv1d, then SiLU: y_t = silu(Σ_j w[:, j] · x_{t−K+1+j}), with the
    window's K−1 earlier inputs (zeros at a sequence's start) in front. reset_BL (bool,
    packed rows): a marked token starts a segment, and no tap of a token reads an input
    before its segment's first (nor the window).
    Returns (y [B, L, Q], the new window: the last K−1 inputs [B, W, Q])."""
    B, L, Q = x_BLQ.shape
    K = w_QK.shape[1]
    if window_BWQ is None:
        window_BWQ = jnp.zeros((B, K - 1, Q), x_BLQ.dtype)
    xp = jnp.concatenate([window_BWQ.astype(x_BLQ.dtype), x_BLQ], axis=1)
    w = w_QK.astype(F32)
    taps = [xp[:, j : j + L].astype(F32) * w[:, j] for j in range(K)]
    if reset_BL is not None:  # tap j reads d = K − 1 − j tokens back: within the segment?
        t_L = jnp.arange(L)
        start_BL = jax.lax.cummax(jnp.where(reset_BL, t_L, -1), axis=1)
        since_BL = jnp.where(start_BL < 0, L + K, t_L - start_BL)[..., None]
        taps = [jnp.where(since_BL >= K - 1 - j, tap, 0.0) for j, tap in enumerate(taps)]
    return jax.nn.silu(sum(taps)).astype(x_BLQ.dtype), xp[:, L:]


class GatedRMSNorm(nnx.Module):
    """y = scale · (x / sqrt(mean(x²) + eps)) · silu(z), statistics and gate in float32
    (transformers' Qwen3_5RMSNormGated: scale is not zero-centred)."""

    def __init__(self, dim: int, eps: float, cfg: ModelConfig):
        self.scale = _param(None, (dim,), (None,), cfg.param_dtype, init="ones")
        self.eps = eps
        self.dtype = jnp.dtype(cfg.dtype)

    def __call__(self, x, z):
        x32 = x.astype(F32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        y = self.scale[...].astype(self.dtype) * normed.astype(self.dtype)
        return (y * jax.nn.silu(z.astype(F32))).astype(self.dtype)


class GatedDeltaNet(nnx.Module):
    """The linear-attention token mixer of a Qwen3.5 layer (module docstring)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, J, H = cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        Q = 2 * J * dk + H * dv
        self.in_proj_qkv = Proj((D,), (Q,), ("embed",), (None,), cfg, rngs)
        self.in_proj_z = Proj((D,), (H, dv), ("embed",), ("heads", None), cfg, rngs)
        self.in_proj_b = Proj((D,), (H,), ("embed",), (None,), cfg, rngs)
        self.in_proj_a = Proj((D,), (H,), ("embed",), (None,), cfg, rngs)
        self.conv1d = _param(rngs, (Q, cfg.linear_conv_kernel_dim), (None, None), cfg.param_dtype)
        self.dt_bias = _param(None, (H,), (None,), cfg.param_dtype, init="ones")
        self.A_log = _param(None, (H,), (None,), cfg.param_dtype, init="zeros")
        self.norm = GatedRMSNorm(dv, cfg.rms_norm_eps, cfg)
        self.out_proj = Proj((H, dv), (D,), ("heads", None), ("embed",), cfg, rngs)
        self.dims = (J, H, dk, dv)
        self.chunk_size = cfg.deltanet_chunk_size
        self.dtype = jnp.dtype(cfg.dtype)

    def __call__(self, x_BLD, mask_BL=None, state=None, *, recurrent=False, reset_BL=None):
        """mask_BL: 1 for real tokens (None: all real). state: (conv window [B, W, Q],
        recurrent state [B, H, k, v] f32) carried in from earlier tokens, or None (a
        sequence's start). recurrent: the token-by-token form (decode), else chunked.
        reset_BL (bool, the chunked form of a packed pass): True at each segment's first
        token, where the state and the conv window start afresh.
        Returns (y_BLD, the state after the last token)."""
        J, H, dk, dv = self.dims
        B, L, _ = x_BLD.shape
        if mask_BL is not None:
            x_BLD = x_BLD * mask_BL[..., None].astype(x_BLD.dtype)
        window, S = (None, None) if state is None else state
        qkv, window = causal_conv(self.in_proj_qkv(x_BLD), self.conv1d[...], window, reset_BL)
        q = qkv[..., : J * dk].reshape(B, L, J, dk)
        k = qkv[..., J * dk : 2 * J * dk].reshape(B, L, J, dk)
        v = qkv[..., 2 * J * dk :].reshape(B, L, H, dv)
        beta = jax.nn.sigmoid(self.in_proj_b(x_BLD).astype(F32))
        a = self.in_proj_a(x_BLD).astype(F32) + self.dt_bias[...].astype(F32)
        g = -jnp.exp(self.A_log[...].astype(F32)) * jax.nn.softplus(a)
        if mask_BL is not None:
            g, beta = g * mask_BL[..., None], beta * mask_BL[..., None]
        if recurrent:
            out, S = recurrent_gated_delta_rule(q, k, v, g, beta, S)
        else:
            out, S = chunk_gated_delta_rule(
                q, k, v, g, beta, S, chunk_size=self.chunk_size, reset_BL=reset_BL
            )
        out = partition.constrain(out.astype(self.dtype), partition.HEADS)
        z = self.in_proj_z(x_BLD)
        y = self.out_proj(self.norm(out, z))
        return partition.constrain(y, partition.RESIDUAL), (window, S)
