"""Qwen2 / Qwen3 / Qwen3-MoE decoder in Flax NNX, driven through pure jittable functions.

Each module's docstring says what it holds; docs/architecture.md is the map.

Calls (all jitted with model_config static; every one returns the same structure for
dense and MoE models, routing [M, B, L, X] with M = X = 0 when dense):

    forward(cfg, params, tokens_BL, mask_BL, *, routing=None) -> logits [B, L, V] f32
    forward_with_routing(cfg, params, tokens_BL, mask_BL, *, routing=None)
        -> (logits [B, L, V] f32, routing [M, B, L, X])
    hidden_states(cfg, params, tokens_BL, mask_BL, *, routing=None, router_stats=False)
        -> (hidden [B, L, D] compute dtype, routing [M, B, L, X][, router load statistics
        (counts [E], probs [E], rows) of the real tokens over the MoE layers, moe_aux.py])
    prefill_shared(cfg, params, tokens_QP, mask_QP, *, dtype=None, routing=None)
        -> (PromptCache, last-token logits [Q, V] f32, routing [M, Q, P, X])
    init_response_cache(cfg, B, T, *, segments=1, dtype=None) -> ResponseCache
        B decode rows (G = B/Q per prompt, contiguous), T slots in time segments
        (`response_segments(T, segments)`; `ResponseCache.segments` gives (start, width))
    decode_step_shared(cfg, params, prompt, response, tokens_B, slot, *, segment=None,
                       routing=None, layer_params=None)
        -> (logits [B, V] f32, ResponseCache, routing [M, B, 1, X])
        row b feeds tokens_B[b] at position prompt.length[b // G] + slot, writes response
        slot `slot` (in static segment `segment`), attends to prompt + response 0..slot;
        in a loop pass layer_params=split_layers(cfg, params), sliced once before it

`routing=` forces the MoE expert choice (Routing Replay, paper §5.3).

Params are a plain nested dict of arrays; every function takes
`(model_config, params, arrays)` with model_config static. Per-layer parameters are
stacked on a leading layer axis ("layers", never sharded) — over all layers for the
attention half, over the dense layers for `mlp`, over the MoE layers for `moe`
(block.py). The tree (shapes, logical axes):

    embed/embedding                        [V, D]          (vocab, embed)
    layers/input_norm/scale                [n, D]          (layers, None)   n = num_layers
    layers/attn/q_proj/kernel              [n, D, H, C]    (layers, embed, heads, None)
                                                           (+ bias [n, H, C])
    layers/attn/{k,v}_proj/kernel          [n, D, K, C]    (layers, embed, kv_heads, None)
                                                           (+ bias [n, K, C])
    layers/attn/o_proj/kernel              [n, H, C, D]    (layers, heads, None, embed)
    layers/attn/{q,k}_norm/scale           [n, C]          (layers, None)   Qwen3 only
    layers/post_attn_norm/scale            [n, D]          (layers, None)
    layers/mlp/{gate,up}_proj/kernel       [n - M, D, F]   (layers, embed, mlp)   dense layers
    layers/mlp/down_proj/kernel            [n - M, F, D]   (layers, mlp, embed)
    layers/moe/router/kernel               [M, D, E]       (layers, embed, None)  MoE layers
    layers/moe/{gate,up}_proj              [M, E, D, F]    (layers, expert, embed, mlp)
    layers/moe/down_proj                   [M, E, F, D]    (layers, expert, mlp, embed)
    final_norm/scale                       [D]             (None,)
    lm_head/kernel                         [D, V]          (embed, vocab)   untied only
    .../<proj>/lora_a, lora_b              [n, *in, r], [n, r, *out]  (the kernel's axes, rank
                                           None)   with model_config.lora_rank = r (lora.py)
"""

from gspo_jax.models.config import ModelConfig
from gspo_jax.models.functional import (
    forward,
    forward_with_routing,
    hidden_states,
    hidden_states_packed,
    hidden_states_shared,
    logits_from_hidden,
    positions_from_mask,
    unembedding,
)
from gspo_jax.models.hf_io import (
    load_pretrained,
    read_hf_config,
    read_model_config,
    save_pretrained,
)
from gspo_jax.models.kv_cache import (
    PromptCache,
    ResponseCache,
    decode_step_shared,
    init_response_cache,
    prefill_shared,
    response_segments,
)
from gspo_jax.models.layer_stack import layer_runs, split_layers
from gspo_jax.models.paged import (
    KV_DTYPES,
    Int8Pages,
    copy_pages,
    decode_step_paged,
    paged_attention_impl,
    prompt_pages,
    quantize_int8,
    ragged_paged_attention,
    to_kv_dtype,
)
from gspo_jax.models.paged_prefix import SharedPrefix
from gspo_jax.models.params import (
    abstract_params,
    for_decoding,
    init_params,
    logical_axes,
    param_count,
    rollout_params,
)

__all__ = [
    "KV_DTYPES",
    "Int8Pages",
    "ModelConfig",
    "PromptCache",
    "ResponseCache",
    "SharedPrefix",
    "abstract_params",
    "copy_pages",
    "decode_step_paged",
    "decode_step_shared",
    "for_decoding",
    "forward",
    "forward_with_routing",
    "hidden_states",
    "hidden_states_packed",
    "hidden_states_shared",
    "init_params",
    "init_response_cache",
    "layer_runs",
    "load_pretrained",
    "logical_axes",
    "logits_from_hidden",
    "paged_attention_impl",
    "param_count",
    "positions_from_mask",
    "prefill_shared",
    "prompt_pages",
    "quantize_int8",
    "ragged_paged_attention",
    "read_hf_config",
    "read_model_config",
    "response_segments",
    "rollout_params",
    "save_pretrained",
    "split_layers",
    "to_kv_dtype",
    "unembedding",
]
