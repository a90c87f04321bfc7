"""Qwen2 / Qwen3 / Qwen3-MoE decoder in Flax NNX, driven through pure jittable functions.

    config.py       ModelConfig (hashable, static), HF config.json <-> ModelConfig
    layers.py       NNX modules: RMSNorm, RoPE, GQA attention, SwiGLU, MoE (dense/ragged);
                    the attention math (`attend` full-sequence, `attend_cached` cache layout)
    transformer.py  Decoder (the one block composition, driven by an attention context),
                    params (init/abstract/logical axes), forward, hidden_states,
                    unembedding, routing_disagreement
    kv_cache.py     cached decoding: shared-prefix PromptCache/ResponseCache (the sampler's)
                    and the per-row KVCache, both through the same Decoder
    hf_io.py        load_pretrained / save_pretrained (safetensors, no torch); tokenizers load
                    with gspo_jax.data.load_tokenizer

Cached decoding API (kv_cache.py; all jitted with model_config static):

    prefill_shared(cfg, params, tokens_QP, mask_QP, *, dtype=None, return_routing=False)
        -> (PromptCache, last-token logits [Q, V] f32)         Q left-padded prompts, once
    init_response_cache(cfg, B, T, *, segments=1, dtype=None) -> ResponseCache
        B decode rows (G = B/Q per prompt, contiguous), T slots in time segments
        (`response_segments(T, segments)`; `ResponseCache.segments` gives (start, width))
    decode_step_shared(cfg, params, prompt, response, tokens_B, slot, *, segment=None,
                       return_routing=False) -> (logits [B, V] f32, ResponseCache)
        row b feeds tokens_B[b] at position prompt.length[b // G] + slot, writes response
        slot `slot` (in static segment `segment`), attends to prompt + response 0..slot
    init_cache / prefill / decode_step / repeat_cache: per-row KVCache (chunked prefill)

Params are a plain nested dict of arrays; every function takes
`(model_config, params, arrays)` with model_config static. The tree (logical axes):

    embed/embedding                    [V, D]     (vocab, embed)
    layers/{i}/input_norm/scale        [D]        (None,)          i: int keys 0..N-1
    layers/{i}/attn/q_proj/kernel      [D, H, C]  (embed, heads, None)   (+ bias [H, C])
    layers/{i}/attn/{k,v}_proj/kernel  [D, K, C]  (embed, kv_heads, None) (+ bias [K, C])
    layers/{i}/attn/o_proj/kernel      [H, C, D]  (heads, None, embed)
    layers/{i}/attn/{q,k}_norm/scale   [C]        (None,)          Qwen3 only
    layers/{i}/post_attn_norm/scale    [D]        (None,)
    layers/{i}/mlp/{gate,up}_proj/kernel [D, F]   (embed, mlp)     dense layers
    layers/{i}/mlp/down_proj/kernel    [F, D]     (mlp, embed)
    layers/{i}/mlp/router/kernel       [D, E]     (embed, None)    MoE layers
    layers/{i}/mlp/{gate,up}_proj      [E, D, F]  (expert, embed, mlp)
    layers/{i}/mlp/down_proj           [E, F, D]  (expert, mlp, embed)
    final_norm/scale                   [D]        (None,)
    lm_head/kernel                     [D, V]     (embed, vocab)   untied only
"""

from gspo_jax.models.config import ModelConfig
from gspo_jax.models.hf_io import load_pretrained, read_hf_config, save_pretrained
from gspo_jax.models.kv_cache import (
    KVCache,
    PromptCache,
    ResponseCache,
    decode_step,
    decode_step_shared,
    init_cache,
    init_response_cache,
    prefill,
    prefill_shared,
    repeat_cache,
    response_segments,
)
from gspo_jax.models.transformer import (
    abstract_params,
    forward,
    hidden_states,
    init_params,
    logical_axes,
    logits_from_hidden,
    param_count,
    positions_from_mask,
    routing_disagreement,
    unembedding,
)

__all__ = [
    "KVCache",
    "ModelConfig",
    "PromptCache",
    "ResponseCache",
    "abstract_params",
    "decode_step",
    "decode_step_shared",
    "forward",
    "hidden_states",
    "init_cache",
    "init_params",
    "init_response_cache",
    "load_pretrained",
    "logical_axes",
    "logits_from_hidden",
    "param_count",
    "positions_from_mask",
    "prefill",
    "prefill_shared",
    "read_hf_config",
    "repeat_cache",
    "response_segments",
    "routing_disagreement",
    "save_pretrained",
    "unembedding",
]
