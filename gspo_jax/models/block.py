"""The NNX modules of the decoder: one layer (`Block`), the stacked layers (`Layers`), the
embedding and the untied output head.

Every per-layer parameter is stacked on a leading layer axis (logical axis "layers",
never sharded): `layers/attn/q_proj/kernel` is [layers, D, H, C]. The attention half of a
layer (its two norms and `Attention`) is stacked over all layers; the MLP half over the
dense layers (`layers/mlp`, in layer order) and the MoE half over the MoE layers
(`layers/moe`, in `model_config.moe_layers` order, which is also the order of the routing
arrays). `Block` is the one place a layer is written down: layer_stack.py merges one from
each layer's slice of the stacks.

Shape letters: B batch, L tokens, D model width, V vocab, X experts per token.
"""

from __future__ import annotations

from flax import nnx

from gspo_jax.models import partition
from gspo_jax.models.config import ModelConfig
from gspo_jax.models.deltanet import GatedDeltaNet
from gspo_jax.models.layers import MLP, Attention, MoE, RMSNorm, _param
from gspo_jax.models.partition import RESIDUAL


class Block(nnx.Module):
    """Pre-norm decoder layer: x += attn(norm(x)); x += mlp_or_moe(norm(x)).

    One layer's parameters. The decoder keeps them stacked (`Layers`) and merges a Block
    from each layer's slice inside its scan. A hybrid model's linear layers (`is_linear`)
    mix tokens with a Gated DeltaNet (`linear_attn`) instead of attention; their context
    is called with no arguments and returns (mask_BL, state, keep_state, recurrent), a
    packed pass's also a fifth value, its segment starts (`reset_BL` of the DeltaNet)."""

    def __init__(self, cfg: ModelConfig, is_moe: bool, rngs: nnx.Rngs, is_linear: bool = False):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg)
        self.is_linear = is_linear
        if is_linear:
            self.linear_attn = GatedDeltaNet(cfg, rngs)
        else:
            self.attn = Attention(cfg, rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg)
        self.is_moe = is_moe
        self.mlp = MoE(cfg, rngs) if is_moe else MLP(cfg, cfg.intermediate_size, rngs)

    def __call__(self, x_BLD, cos, sin, attention, forced_BLX=None, stats_mask_BL=None):
        """attention: this layer's context, `(q, k, v) -> (out, cache_entry)`.
        Returns (x_BLD, cache_entry, expert indices [B, L, X] or None); with
        `stats_mask_BL` also the MoE layer's router load statistics (`layers.MoE`; None for
        a dense layer) as a fourth value."""
        x_BLD = partition.constrain(x_BLD, RESIDUAL)
        if self.is_linear:
            mask_BL, state, keep_state, recurrent, *reset = attention()
            attn_out, state = self.linear_attn(
                self.input_norm(x_BLD),
                mask_BL,
                state,
                recurrent=recurrent,
                reset_BL=reset[0] if reset else None,
            )
            cache_entry = state if keep_state else None
        else:
            attn_out, cache_entry = self.attn(self.input_norm(x_BLD), cos, sin, attention)
        x_BLD = partition.constrain(x_BLD + attn_out, RESIDUAL)
        stats = None
        if self.is_moe and stats_mask_BL is not None:
            mlp_out, idx_BLX, stats = self.mlp(
                self.post_attn_norm(x_BLD), forced_BLX, stats_mask_BL
            )
        elif self.is_moe:
            mlp_out, idx_BLX = self.mlp(self.post_attn_norm(x_BLD), forced_BLX)
        else:
            mlp_out, idx_BLX = self.mlp(self.post_attn_norm(x_BLD)), None
        out = (partition.constrain(x_BLD + mlp_out, RESIDUAL), cache_entry, idx_BLX)
        return out if stats_mask_BL is None else (*out, stats)


def _stacked(n: int, make, rngs: nnx.Rngs):
    """`make(rngs)` n times, each parameter stacked on a new leading axis named "layers"
    (independent random init per layer)."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def create(rngs):
        return make(rngs)

    return create(rngs)


class Layers(nnx.Module):
    """Every layer's parameters, stacked: the norms over all layers, attention over the
    full-attention layers (all but a hybrid model's linear ones), the Gated DeltaNet over
    the linear layers, the MLP half over the dense layers and the MoE half over the MoE
    layers (module docstring)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        n, m, lin = cfg.num_layers, cfg.num_moe_layers, cfg.num_linear_layers
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_norm = _stacked(n, lambda r: RMSNorm(D, eps, cfg), rngs)
        self.attn = _stacked(n - lin, lambda r: Attention(cfg, r), rngs)
        self.linear_attn = _stacked(lin, lambda r: GatedDeltaNet(cfg, r), rngs) if lin else None
        self.post_attn_norm = _stacked(n, lambda r: RMSNorm(D, eps, cfg), rngs)
        dense = n - m
        self.mlp = (
            _stacked(dense, lambda r: MLP(cfg, cfg.intermediate_size, r), rngs) if dense else None
        )
        self.moe = _stacked(m, lambda r: MoE(cfg, r), rngs) if m else None


class Embed(nnx.Module):
    """Token embedding table [V, D]."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        shape = (cfg.vocab_size, cfg.hidden_size)
        self.embedding = _param(rngs, shape, ("vocab", "embed"), cfg.param_dtype)


class LMHead(nnx.Module):
    """Untied output projection [D, V]."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        shape = (cfg.hidden_size, cfg.vocab_size)
        self.kernel = _param(rngs, shape, ("embed", "vocab"), cfg.param_dtype)
