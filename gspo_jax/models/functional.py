"""The pure, jittable functions the rest of gspo_jax calls: forward, hidden states (plain and
with a shared prompt), the unembedding.

Where it sits: `sampling` (prefill/decode through kv_cache.py), `logprobs` and
`train_step` (`hidden_states` + `unembedding`, or `forward`) use this module; it never
imports training code. Every function takes `(model_config, params, arrays)` with
model_config static.

Positions come from the attention mask: position = cumsum(mask) − 1, so left padding
gives every row positions 0, 1, … from its first real token (what transformers'
`generate` does), and causal attention never looks at padding keys.

Routing format (MoE): int32 [M, B, L, X] — top-k expert indices per MoE layer (in
layer order, `model_config.moe_layers`), batch row, position and choice (descending
router probability; a forced routing may list them in any order). Returned routing is the
current router's own top-k: with forced routing (Routing Replay) the forced experts run,
and what comes back is what the router would have chosen (equal to the forced routing
when the router agrees). For dense models M = X = 0: every function that returns routing
returns it, then empty.

Shape letters: B batch, L tokens, D model width, V vocab, N prompts, P prompt tokens,
T response tokens, M MoE layers, X experts per token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gspo_jax.models import partition
from gspo_jax.models.config import ModelConfig
from gspo_jax.models.contexts import SharedPromptAttention, full_context, packed_context
from gspo_jax.models.params import merge

F32 = jnp.float32


def positions_from_mask(mask_BL):
    """position = cumsum(mask) − 1 (0 on leading padding): left padding shifts nothing."""
    mask = mask_BL.astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)


def run_full(
    cfg: ModelConfig,
    params,
    tokens_BL,
    mask_BL,
    routing=None,
    *,
    remat=False,
    keep_kv=False,
    router_stats=False,
):
    """Full-sequence pass: causal attention over this call's real tokens only.

    Returns (hidden [B, L, D], (k, v) each [layers, B, L, K, C] when `keep_kv` else None,
    routing [M, B, L, X]), and with `router_stats` (MoE) the router load statistics of
    the real tokens summed over the MoE layers, (counts [E], probs [E], rows)
    (`moe_aux.load_balancing_loss` takes them).
    """
    model = merge(cfg, params)
    context = full_context(cfg, mask_BL, keep_kv=keep_kv)
    stats_mask = mask_BL if router_stats else None
    return model(
        tokens_BL,
        positions_from_mask(mask_BL),
        context,
        routing,
        remat=remat,
        stats_mask_BL=stats_mask,
    )


def _run(cfg, params, tokens_BL, mask_BL, routing, router_stats=False):
    """The differentiable pass of forward / hidden_states: (hidden, routing[, stats])."""
    hidden, _, routing_out, *stats = run_full(
        cfg, params, tokens_BL, mask_BL, routing, remat=True, router_stats=router_stats
    )
    return hidden, routing_out, *stats


def _check_routing(cfg, tokens_BL, routing):
    if routing is None:
        return
    want = (cfg.num_moe_layers, *tokens_BL.shape, cfg.num_experts_per_tok)
    if tuple(routing.shape) != want:
        raise ValueError(f"routing has shape {tuple(routing.shape)}, expected [M, B, L, X]={want}")


@functools.partial(jax.jit, static_argnums=0, static_argnames=("router_stats",))
def hidden_states(
    model_config: ModelConfig,
    params,
    tokens_BL,
    attention_mask_BL,
    *,
    routing=None,
    router_stats: bool = False,
):
    """(final-normed hidden states [B, L, D] in the compute dtype, routing [M, B, L, X]).

    `routing` forces the MoE expert choice (Routing Replay, paper §5.3); the gates are
    still the current router's probabilities at those experts. The routing returned is
    the one used (computed, or the forced one); [0, B, L, 0] for dense models.
    `router_stats` (MoE models; static) adds a third value: the router load statistics of
    the real tokens (`attention_mask_BL`) summed over the MoE layers, (counts [E], probs
    [E], rows), for `moe_aux.load_balancing_loss` (Qwen3-MoE's router_aux_loss).
    """
    _check_routing(model_config, tokens_BL, routing)
    if router_stats and not model_config.num_moe_layers:
        raise ValueError("hidden_states: router_stats needs a Mixture-of-Experts model")
    return _run(model_config, params, tokens_BL, attention_mask_BL, routing, router_stats)


@functools.partial(jax.jit, static_argnums=0)
def hidden_states_shared(
    model_config: ModelConfig, params, prompt_tokens_NP, prompt_mask_NP, tokens_BT, mask_BT
):
    """`hidden_states` of B = N·G rows that repeat N prompts G times each, with every
    prompt computed once: (prompt hidden [N, P, D], response hidden [B, T, D]).

    Row b = n·G + g is prompt n (left padded, mask `prompt_mask_NP`) followed by response
    tokens `tokens_BT[b]` (mask `mask_BT`). The hidden states equal those of
    `hidden_states` on the repeated rows concat(prompt n, response b) at every real
    position (float rounding aside): positions continue from the prompt's real length,
    and each response attends to its prompt and its own earlier tokens
    (`SharedPromptAttention`). The prompt's tokens go through the layers once instead of
    G times, and autodiff sums their gradients over the G responses. Dense models only
    (the MoE routing arrays are laid out per repeated row).
    """
    if model_config.num_moe_layers:
        raise ValueError("hidden_states_shared: dense models only (MoE routing is per row)")
    N, P = prompt_tokens_NP.shape
    B, T = tokens_BT.shape
    if B % N:
        raise ValueError(f"hidden_states_shared: {B} response rows are not G per {N} prompts")
    G = B // N
    tokens_NS = jnp.concatenate([prompt_tokens_NP, tokens_BT.reshape(N, G * T)], axis=1)
    prompt_pos_NP = positions_from_mask(prompt_mask_NP)
    real_N = jnp.sum(prompt_mask_NP.astype(jnp.int32), axis=1)
    response_pos_NGT = jnp.maximum(
        real_N[:, None, None] + jnp.cumsum(mask_BT.astype(jnp.int32).reshape(N, G, T), -1) - 1,
        0,
    )
    positions_NS = jnp.concatenate([prompt_pos_NP, response_pos_NGT.reshape(N, G * T)], axis=1)
    context = SharedPromptAttention(prompt_mask_NP, mask_BT.reshape(N, G, T))
    hidden_NSD, _, _ = merge(model_config, params)(tokens_NS, positions_NS, context, remat=True)
    D = hidden_NSD.shape[-1]
    return hidden_NSD[:, :P], hidden_NSD[:, P:].reshape(B, T, D)


@functools.partial(jax.jit, static_argnums=0)
def hidden_states_packed(
    model_config: ModelConfig,
    params,
    tokens_RL,
    positions_RL,
    segment_RL,
    member_RL,
    *,
    routing=None,
):
    """`hidden_states` of packed rows (`train_step.packing`): (hidden [R, L, D], routing
    [M, R, L, X]). Row r holds segments (`segment_RL`, 0 = empty slot), each a prompt
    (`member_RL` 0) then one or more responses to it (`member_RL` their own ids), with
    the positions each token has in its own unpacked row (`positions_RL`). A token attends
    to its segment's prompt and its own response at or before it
    (`contexts.PackedAttention`), so at every real token the hidden state equals
    `hidden_states` of the unpacked row (float rounding aside). With the splash kernel a
    segment holds one response (the kernel masks by segment ids alone), and so it does for
    a hybrid model, whose Gated DeltaNet layers restart at each segment's first token.
    """
    _check_routing(model_config, tokens_RL, routing)
    model = merge(model_config, params)
    context = packed_context(model_config, segment_RL, member_RL)
    hidden, _, routing_out = model(tokens_RL, positions_RL, context, routing, remat=True)
    return hidden, routing_out


def unembedding(model_config: ModelConfig, params):
    """Output projection [D, V] in the compute dtype (the embedding transposed when tied).

    logits = hidden_states @ unembedding (accumulate in float32).

    Under a mesh in context it comes gathered over fsdp (whole D), its vocabulary still
    over tensor: the gather happens here, once, and not inside a caller's loop over
    chunks (`logprobs.token_logprobs`), where XLA did not hoist it; logits then come out
    vocabulary-sharded, and only per-row reductions cross chips.
    """
    if model_config.tie_word_embeddings:
        w = params["embed"]["embedding"].T
    else:
        w = params["lm_head"]["kernel"]
    return partition.constrain(w.astype(model_config.dtype), (None, "vocab"))


def logits_from_hidden(model_config: ModelConfig, params, hidden_BLD):
    """hidden @ unembedding with float32 accumulation -> float32 logits."""
    w_DV = unembedding(model_config, params)
    logits = jnp.einsum(
        "...d,dv->...v", hidden_BLD.astype(w_DV.dtype), w_DV, preferred_element_type=F32
    )
    return partition.constrain(logits, ("batch", *[None] * (logits.ndim - 2), "vocab"))


@functools.partial(jax.jit, static_argnums=0)
def forward(model_config: ModelConfig, params, tokens_BL, attention_mask_BL, *, routing=None):
    """Logits [B, L, V] float32 of a padded batch (1 = real token; left padding allowed).

    Logits at padding positions are finite but meaningless. `routing` [M, B, L, X]
    forces the MoE expert choice (see the module docstring); `forward_with_routing` also
    returns the routing.
    """
    return forward_with_routing(
        model_config, params, tokens_BL, attention_mask_BL, routing=routing
    )[0]


@functools.partial(jax.jit, static_argnums=0)
def forward_with_routing(
    model_config: ModelConfig, params, tokens_BL, attention_mask_BL, *, routing=None
):
    """(`forward`'s logits [B, L, V] float32, routing [M, B, L, X]: computed or forced)."""
    _check_routing(model_config, tokens_BL, routing)
    hidden, routing_out = _run(model_config, params, tokens_BL, attention_mask_BL, routing)
    return logits_from_hidden(model_config, params, hidden), routing_out
