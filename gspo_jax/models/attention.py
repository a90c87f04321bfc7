"""Attention math of the decoder: the einsum reference, its cache-layout twin, and the fused
kernels `ModelConfig.attention_impl` chooses between for the full-sequence pass.

Where it sits: `contexts.SelfAttention` (the differentiated pass of the train step and
the log-prob pass, and the sampler's prefill) calls `self_attention`, which dispatches on
the implementation; the decode step (kv_cache.py) always calls `attend_cached`, which reads
the cache in place. Nothing here owns parameters.

One arithmetic for every path: softmax(q·kᵀ/√C + mask) · v per query head, query head h
reading kv head h // R (transformers' repeat_kv order), a query at position i seeing the
real keys at positions j ≤ i of its own row. Implementations (`ATTENTION_IMPLS`):

    xla     `attend`: f32 scores [B, K, R, L, S] materialised, f32-minimum masking, f32
            softmax, probabilities cast to the value dtype. The reference (CPU default):
            memory grows with L², at 8k tokens and 16 heads 4 GiB of f32 scores per row.
    splash  the Pallas splash-attention kernel shipped with jax (TPU; flash-style, scores
            never leave VMEM: temporaries linear in L). Left/right padding become segment
            ids (real tokens 1, padding 0) on top of a causal mask; GQA is native (kv head
            h // R). Runs under `jax.shard_map` over the mesh in context (batch over the
            batch axes, heads over the tensor axis). The sequence is padded to a multiple
            of 128 (the kernel's lane width) inside.
    cudnn   `jax.nn.dot_product_attention(implementation="cudnn")` (GPU flash attention).
            cuDNN masks by sequence lengths only, so each row is rotated to put its real
            tokens first (positions come from the mask, so nothing else changes) and back.
            Needs every row's real tokens contiguous (left and/or right padding, what every
            gspo_jax caller passes), bf16/f16 compute.
    auto    splash on TPU, cudnn on GPU with 16-bit compute, xla otherwise (`resolve_impl`).

Outputs at padding query positions are finite but differ between implementations (no
real key is visible there; `attend` gives the uniform average of all values); outputs at
real query positions agree to float rounding, which tests/models/test_models_attention.py
checks for value and gradient (Pallas interpret mode on CPU).

Shape letters: B batch rows, L query tokens, S key slots, H query heads, K kv heads,
R = H/K query heads per kv head, C head dim. In `attend_cached` (keys in cache layout):
Q rows of one cache part (Q = B, or fewer rows each shared by G = B/Q consecutive query
rows: the G samples of one prompt), W slots of one cache part.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from gspo_jax.models import partition
from gspo_jax.models.config import ATTENTION_IMPLS

F32 = jnp.float32
F32_MIN = float(jnp.finfo(F32).min)  # score of a disallowed key slot
_LANES = 128  # TPU lane width: splash blocks (and so padded lengths) are multiples of it


# ----------------------------------------------------------------------------- reference


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


def causal_allowed(mask_BL):
    """allowed[b, i, j] = j ≤ i and token j of row b is real: [B, L, L] bool."""
    L = mask_BL.shape[1]
    causal_LL = jnp.tril(jnp.ones((L, L), bool))
    return causal_LL[None] & mask_BL.astype(bool)[:, None, :]


def attend_cached(q_BLHC, parts):
    """`attend` over keys stored in cache layout, split into parts: one softmax over the
    concatenated slots of all parts, softmax(q·kᵀ/√C + mask) · v.

    parts: sequence of (k [Q, K, C, W], v [Q, K, W, C], allowed), Q dividing B. A part
    with Q = B holds each query row's own keys; with Q < B, key row q serves the
    G = B/Q consecutive query rows q·G … q·G+G−1 (the G samples of one prompt), so its
    keys are read once per group as one [G·L·R, W] score block per (row, kv head) —
    never copied G times. `allowed`: bool broadcastable to [Q, L, W] (1 for Q or L
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
    for k_QKCW, _, allowed in parts:
        Q, _, _, W = k_QKCW.shape
        if B % Q:
            raise ValueError(f"cache part has {Q} rows, which do not divide the {B} query rows")
        q_QGLKRC = q_BLHC.reshape(Q, B // Q, L, K, R, C)
        # Output in dot_general's own order (batch q, k first): any other order makes
        # jnp.einsum swap the operands, and XLA:CPU then multiplies by the transposed
        # cache, several times slower than q·k.
        s_QKGLRW = jnp.einsum(
            "qglkrc,qkcw->qkglrw", q_QGLKRC, k_QKCW.astype(dtype), preferred_element_type=F32
        ) * (C**-0.5)
        if allowed is not None:
            allowed_QLW = jnp.asarray(allowed, bool)
            s_QKGLRW = jnp.where(allowed_QLW[:, None, None, :, None, :], s_QKGLRW, F32_MIN)
        scores.append(s_QKGLRW.transpose(0, 2, 1, 3, 4, 5).reshape(B, K, L, R, W))
        shapes.append((Q, W))
    probs_BKLRS = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1).astype(dtype)
    out_BLHC, start = None, 0
    for (_, v_QKWC, _), (Q, W) in zip(parts, shapes):
        p_QGKLRW = probs_BKLRS[..., start : start + W].reshape(Q, B // Q, K, L, R, W)
        o_QKGLRC = jnp.einsum("qgklrw,qkwc->qkglrc", p_QGKLRW, v_QKWC.astype(dtype))
        o_BLHC = o_QKGLRC.transpose(0, 2, 3, 1, 4, 5).reshape(B, L, H, C)
        out_BLHC = o_BLHC if out_BLHC is None else out_BLHC + o_BLHC
        start += W
    return out_BLHC


def packed_allowed(segment_BL, member_BL):
    """allowed[b, i, j] of a packed row (`train_step.packing`): key j at or before query i,
    of the same segment (`segment_BL`, 0 = empty slot, which sees and is seen by nothing)
    and either the segment's prompt (`member_BL` 0) or the query's own response (equal
    `member_BL`): [B, L, L] bool. Several responses sharing one prompt inside a segment
    each see the prompt and themselves, never each other (`attend_shared_prompt`'s rule).
    """
    L = segment_BL.shape[1]
    causal_LL = jnp.tril(jnp.ones((L, L), bool))
    seg_q, seg_k = segment_BL[:, :, None], segment_BL[:, None, :]
    mem_q, mem_k = member_BL[:, :, None], member_BL[:, None, :]
    return causal_LL[None] & (seg_q == seg_k) & (seg_k > 0) & ((mem_k == 0) | (mem_k == mem_q))


def attend_shared_prompt(q_NSHC, k_NSKC, v_NSKC, prompt_mask_NP, response_mask_NGT):
    """`attend` over a shared-prompt row: each of N rows holds one prompt's P tokens
    followed by its G responses of T tokens (S = P + G·T), and response g sees the prompt
    and its own earlier tokens, never another response's.

        prompt query i      the real prompt keys j ≤ i             (causal, as `attend`)
        response g query t  the real prompt keys, then response g's real keys s ≤ t

    One softmax per query over exactly the keys `attend` gives the same query in the
    repeated layout ([N·G, P + T], the prompt copied G times), with `attend`'s arithmetic
    (f32 scores scaled by 1/√C, f32-minimum masking, f32 softmax, probabilities cast to
    the value dtype), so real queries agree with it to float rounding; padding queries
    (no real key visible) get a uniform average, as there. The prompt's keys and values
    are computed and read once per group; under autodiff their gradients are the sums
    over the G responses that read them.
    Returns out [N, S, H, C].
    """
    N, _, H, C = q_NSHC.shape
    K = k_NSKC.shape[2]
    R = H // K
    P = prompt_mask_NP.shape[1]
    _, G, T = response_mask_NGT.shape
    dtype = v_NSKC.dtype
    scale = C**-0.5
    prompt_out = attend(q_NSHC[:, :P], k_NSKC[:, :P], v_NSKC[:, :P], causal_allowed(prompt_mask_NP))
    q_NGTKRC = q_NSHC[:, P:].reshape(N, G, T, K, R, C)
    k_NGTKC = k_NSKC[:, P:].reshape(N, G, T, K, C)
    v_NGTKC = v_NSKC[:, P:].reshape(N, G, T, K, C)
    # Scores against the prompt (shared by the group) and against the row's own response.
    s_prompt = (
        jnp.einsum("ngtkrc,npkc->nkgrtp", q_NGTKRC, k_NSKC[:, :P], preferred_element_type=F32)
        * scale
    )
    s_prompt = jnp.where(
        prompt_mask_NP.astype(bool)[:, None, None, None, None, :], s_prompt, F32_MIN
    )
    s_own = (
        jnp.einsum("ngtkrc,ngskc->nkgrts", q_NGTKRC, k_NGTKC, preferred_element_type=F32) * scale
    )
    causal_TT = jnp.tril(jnp.ones((T, T), bool))
    allowed_NGTT = causal_TT & response_mask_NGT.astype(bool)[:, :, None, :]
    s_own = jnp.where(allowed_NGTT[:, None, :, None], s_own, F32_MIN)
    probs = jax.nn.softmax(jnp.concatenate([s_prompt, s_own], axis=-1), axis=-1).astype(dtype)
    out_NGTKRC = jnp.einsum("nkgrtp,npkc->ngtkrc", probs[..., :P], v_NSKC[:, :P])
    out_NGTKRC = out_NGTKRC + jnp.einsum("nkgrts,ngskc->ngtkrc", probs[..., P:], v_NGTKC)
    response_out = out_NGTKRC.reshape(N, G * T, H, C)
    return jnp.concatenate([prompt_out, response_out], axis=1)


# ------------------------------------------------------------------------- dispatch


def target_platform() -> str:
    """The platform being compiled for: that of the devices of the mesh in context
    (`jax.set_mesh`; a TPU topology's when compiling ahead of time on a CPU machine),
    else jax's default backend."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    return device.platform if device is not None else jax.default_backend()


def resolve_impl(impl: str, *, dtype: str = "float32", platform: str | None = None) -> str:
    """The implementation `impl` stands for on `platform` (default: `target_platform()`).

    "auto" -> "splash" on TPU; "cudnn" on GPU when the compute dtype is 16-bit (cuDNN's
    flash attention has no f32 kernel); "xla" otherwise. Others are returned as given.
    At run time (no `platform` given) on several TPU devices without a mesh in context,
    "auto" warns and falls back to "xla": splash needs the mesh to shard (trace under
    `jax.set_mesh(mesh)`), and unsharded it would gather every row on every device.
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl={impl!r}: expected one of {ATTENTION_IMPLS}")
    if impl != "auto":
        return impl
    runtime = platform is None
    platform = platform or target_platform()
    if platform == "tpu":
        if runtime and jax.device_count() > 1 and jax.sharding.get_abstract_mesh().empty:
            warnings.warn(
                "attention_impl='auto' on several TPU devices without a mesh in context: "
                "using 'xla' attention (memory grows with L^2); trace under "
                "jax.set_mesh(mesh) to get the splash kernel",
                RuntimeWarning,
                stacklevel=3,
            )
            return "xla"
        return "splash"
    if platform in ("gpu", "cuda", "rocm") and dtype in ("bfloat16", "float16"):
        return "cudnn"
    return "xla"


def self_attention(impl: str, q_BLHC, k_BLKC, v_BLKC, mask_BL, allowed_BLS=None):
    """Causal self-attention of one full-sequence call with implementation `impl` (resolved,
    not "auto"). mask_BL: 1 for real tokens. allowed_BLS: `causal_allowed(mask_BL)`, only
    read (and best built once by the caller) for "xla"."""
    if impl == "xla":
        if allowed_BLS is None:
            allowed_BLS = causal_allowed(mask_BL)
        return attend(q_BLHC, k_BLKC, v_BLKC, allowed_BLS)
    if impl == "splash":
        return splash_attention(q_BLHC, k_BLKC, v_BLKC, mask_BL)
    if impl == "cudnn":
        return cudnn_attention(q_BLHC, k_BLKC, v_BLKC, mask_BL)
    raise ValueError(f"attention implementation {impl!r} is not resolved (see resolve_impl)")


# --------------------------------------------------------------------------- splash


def _splash_kernel(num_heads: int, length: int, block: int, interpret: bool):
    """The splash kernel for `num_heads` local heads over a (padded) causal length.

    Built inside each trace (its mask tables become constants of that trace); the mask
    preprocessing, the costly part, is cached by jax (`process_mask`)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    mask = sm.MultiHeadMask([sm.CausalMask((length, length)) for _ in range(num_heads)])
    sizes = sk.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    # The kernel names its residuals (output, log-sum-exp) "attention", so the remat policy
    # "save_qkv_attention" keeps them and the backward's recomputed forward skips the kernel.
    return sk.make_splash_mha(
        mask,
        block_sizes=sizes,
        head_shards=1,
        q_seq_shards=1,
        residual_checkpoint_name="attention",
        interpret=interpret,
    )


def _splash_block(length: int) -> int:
    """Largest of 512 / 256 / 128 dividing the padded length (512: MaxText's default)."""
    return next(b for b in (512, 256, 128) if length % b == 0)


def _interpret() -> bool:
    """Pallas TPU kernels run in interpret mode unless compiled for a TPU (CPU tests)."""
    return target_platform() != "tpu"


def _local_splash(q_BHLC, k_BKLC, v_BKLC, seg_BL):
    """Splash on this device's rows and heads (inside shard_map, or the whole array)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    _, H, L, _ = q_BHLC.shape
    kernel = _splash_kernel(H, L, _splash_block(L), _interpret())
    segments = sk.SegmentIds(q=seg_BL, kv=seg_BL)
    return jax.vmap(kernel)(q_BHLC, k_BKLC, v_BKLC, segments)


def _mesh_specs(mesh, shapes):
    """PartitionSpecs of q, k/v ([B, H|K, L, C]) and segment ids ([B, L]) on `mesh`: batch
    over the mesh's batch axes, heads over its tensor axis (sharding.LOGICAL_RULES)."""
    q_shape, k_shape = shapes
    q = partition.spec(mesh, ("batch", "heads", None, None), q_shape)
    k = partition.spec(mesh, ("batch", "kv_heads", None, None), k_shape)
    return q, k, PartitionSpec(q[0], None)


def splash_attention(q_BLHC, k_BLKC, v_BLKC, mask_BL):
    """Causal GQA attention of a padded batch with the Pallas splash kernel.

    Segment ids are the mask (real 1, padding 0): a real query sees real keys at or before
    it, exactly `attend`'s rule; padding queries see padding keys (never read by anyone).
    q is scaled by 1/√C (in f32, then cast) before the kernel, which does not scale.
    Under a mesh in context (`jax.set_mesh`) it runs in `jax.shard_map`: batch over the
    batch axes and heads over the tensor axis where they divide; kv heads that the tensor
    axis does not divide are repeated to one per query head first.
    """
    _, L, H, C = q_BLHC.shape
    K = k_BLKC.shape[2]
    dtype = q_BLHC.dtype
    q_BLHC = (q_BLHC.astype(F32) * C**-0.5).astype(dtype)
    k_BLKC, v_BLKC = k_BLKC.astype(dtype), v_BLKC.astype(dtype)
    Lp = -(-L // _LANES) * _LANES
    seg_BL = mask_BL.astype(jnp.int32)
    if Lp != L:  # padded tail: segment 0, sliced off below
        pad = ((0, 0), (0, Lp - L), (0, 0), (0, 0))
        q_BLHC, k_BLKC, v_BLKC = (jnp.pad(x, pad) for x in (q_BLHC, k_BLKC, v_BLKC))
        seg_BL = jnp.pad(seg_BL, ((0, 0), (0, Lp - L)))
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q_BLHC, k_BLKC, v_BLKC))  # [B, heads, Lp, C]

    mesh = partition.context_mesh()
    if mesh is None:
        if jax.device_count() > 1 and jax.default_backend() == "tpu":
            raise ValueError(
                "splash attention needs the mesh in context (trace under jax.set_mesh(mesh)) "
                "to shard over several devices; or set model.attention_impl='xla'"
            )
        out = _local_splash(q, k, v, seg_BL)
    else:
        q_spec, k_spec, seg_spec = _mesh_specs(mesh, (q.shape, k.shape))
        if q_spec[1] is not None and k_spec[1] != q_spec[1]:
            # The tensor axis splits the query heads but not the kv heads: give every
            # query head its own kv head so each device holds the ones it reads.
            k, v = (jnp.repeat(x, H // K, axis=1) for x in (k, v))
            k_spec = q_spec
        out = jax.shard_map(
            _local_splash,
            mesh=mesh,
            in_specs=(q_spec, k_spec, k_spec, seg_spec),
            out_specs=q_spec,
            check_vma=False,
        )(q, k, v, seg_BL)
    return out.transpose(0, 2, 1, 3)[:, :L]


# ---------------------------------------------------------------------------- cuDNN


def cudnn_attention(q_BLHC, k_BLKC, v_BLKC, mask_BL, *, implementation: str = "cudnn"):
    """Causal GQA attention with `jax.nn.dot_product_attention` (cuDNN flash attention).

    cuDNN masks only by sequence length (right padding), so each row is rotated left by
    its leading padding (real tokens first, then the trailing padding), attended with
    query/key lengths = real tokens, and rotated back. Rotation changes nothing else:
    RoPE positions were applied before, from the mask. Needs each row's real tokens to be
    contiguous. `implementation="xla"` runs the same wrapper with jax's XLA path (tests).
    """
    L = q_BLHC.shape[1]
    mask = mask_BL.astype(jnp.int32)
    start_B = jnp.argmax(mask, axis=1)  # first real token (0 for an all-padding row)
    length_B = jnp.sum(mask, axis=1, dtype=jnp.int32)
    take_BL = (jnp.arange(L)[None, :] + start_B[:, None]) % L
    back_BL = (jnp.arange(L)[None, :] - start_B[:, None]) % L

    def rotate(x_BLxx, index_BL):
        return jnp.take_along_axis(x_BLxx, index_BL[:, :, None, None], axis=1)

    out = jax.nn.dot_product_attention(
        rotate(q_BLHC, take_BL),
        rotate(k_BLKC.astype(q_BLHC.dtype), take_BL),
        rotate(v_BLKC.astype(q_BLHC.dtype), take_BL),
        is_causal=True,
        query_seq_lengths=length_B,
        key_value_seq_lengths=length_B,
        implementation=implementation,
    )
    return rotate(out, back_BL)


__all__ = [
    "ATTENTION_IMPLS",
    "attend",
    "attend_cached",
    "causal_allowed",
    "cudnn_attention",
    "packed_allowed",
    "resolve_impl",
    "self_attention",
    "splash_attention",
]
