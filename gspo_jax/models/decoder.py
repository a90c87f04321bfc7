"""The decoder: embedding -> stacked layers -> final norm, driven by an attention context.

Flax NNX driven functionally: `Decoder` is an `nnx.Module`; its graphdef is built once per
`ModelConfig` (params.py) and the public functions (functional.py) take the parameters as
a plain nested dict of arrays and merge inside. `model_config` is static (hashable) and
weights are always arguments, never closed-over constants.

One composition, three uses: `Decoder.__call__` and `Block` (block.py) are the only places
the model is written down; the full-sequence pass, the cached prefill and the one-token
decode step differ only in the attention context they hand in (contexts.py,
kv_cache.py). A change to the block (norm placement, a new projection, a new MLP) is made
once and reaches training, prefill and sampling together.

Shape letters: B batch, L tokens, D model width, M MoE layers, X experts per token.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from gspo_jax.models import partition
from gspo_jax.models.block import Embed, Layers, LMHead
from gspo_jax.models.config import ModelConfig
from gspo_jax.models.layer_stack import apply_layers, apply_layers_unrolled, split_layers
from gspo_jax.models.layers import RMSNorm, rope_cos_sin
from gspo_jax.models.partition import RESIDUAL


class Decoder(nnx.Module):
    """Embedding -> stacked layers -> final RMSNorm. Returns final-normed hidden states."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = Embed(cfg, rngs)
        self.layers = Layers(cfg, rngs)
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = LMHead(cfg, rngs)

    def __call__(
        self,
        tokens_BL,
        positions_BL,
        attention,
        routing=None,
        *,
        remat=False,
        unroll=False,
        layer_params=None,
        stats_mask_BL=None,
    ):
        """The one composition of the model, shared by forward, prefill and decode.

        attention: the attention context, `attention(layer_data, q_BLHC, k_BLKC, v_BLKC) ->
          (out_BLHC, cache_entry)` with `attention.layer_data` its per-layer arrays
          (leading layer axis) or None (`SelfAttention`). With `unroll` (kv_cache.py's
          decode step) the layers run in a Python loop and the context is called with
          the layer's index instead; `layer_params` (`split_layers`, sliced once outside
          the caller's loop) then replaces this module's stacks.
        routing: None or [M, B, L, X] expert indices to force. remat: apply the config's
          remat policy per layer (the differentiated full-sequence pass only).
        Returns (final-normed hidden [B, L, D], the layers' cache entries — stacked on a
        leading layer axis when scanned (None when the context keeps none), a tuple over
        layers when unrolled — and routing [M, B, L, X]); with `stats_mask_BL` (scanned
        pass, MoE) also the router load statistics summed over layers (`apply_layers`).
        """
        cfg = self.cfg
        dtype = jnp.dtype(cfg.dtype)
        # The table gathered over fsdp (its vocabulary stays over tensor), the rows of the
        # result over the batch axes: token ids are never gathered (partition.constrain).
        table_VD = partition.constrain(self.embed.embedding[...], ("vocab", None))
        x = partition.constrain(jnp.take(table_VD, tokens_BL, axis=0).astype(dtype), RESIDUAL)
        cos, sin = rope_cos_sin(cfg, positions_BL)
        stacks = nnx.to_pure_dict(nnx.state(self.layers, nnx.Param))
        if unroll:
            if layer_params is None:
                layer_params = split_layers(cfg, {"layers": stacks})
            x, entries, routing_out = apply_layers_unrolled(
                cfg, layer_params, x, cos, sin, attention, routing
            )
            stats = []
        else:
            x, entries, routing_out, *stats = apply_layers(
                cfg, stacks, x, cos, sin, attention, routing, remat, stats_mask_BL
            )
        return partition.constrain(self.final_norm(x), RESIDUAL), entries, routing_out, *stats


# ---------------------------------------------------------------------------- params
