"""The Qwen decoder and the pure, jittable functions the rest of gspo_jax calls.

Where it sits: `sampling.py` (prefill/decode through `kv_cache.py`), `logprobs.py` and
`train_step.py` (`hidden_states` + `unembedding`, or `forward`) and `sharding.py`
(`abstract_params`, `logical_axes`) use this module; it never imports training code.

Flax NNX driven functionally (STYLE.md §3): `Decoder` is an `nnx.Module`; its graphdef
is built once per `ModelConfig` (cached) and the public functions take the parameters as
a plain nested dict of arrays (`params["layers"][i]["attn"]["q_proj"]["kernel"]`, layer
keys are ints) and merge inside. `model_config` is static (hashable) and weights are
always arguments, never closed-over constants.

One composition, three uses: `Decoder.__call__` (embedding -> blocks -> final norm) is
the only place the layer stack is written down. What differs between the full-sequence
pass, the cached prefill and the one-token decode step is only which keys each query
attends to and what is stored for later: that is the *attention context*, a callable
`(layer, q, k, v) -> (out, cache_entry)` the decoder hands to every block
(`SelfAttention` here; the cache contexts in kv_cache.py). A change to the block
(norm placement, a new projection, a new MLP) is therefore made once and reaches
training, prefill and sampling together.

Positions come from the attention mask: position = cumsum(mask) − 1, so left padding
gives every row positions 0, 1, … from its first real token (what transformers'
`generate` does), and causal attention never looks at padding keys.

Routing format (MoE): int32 [M, B, L, X] — top-k expert indices per MoE layer (in
layer order, `model_config.moe_layers`), batch row, position and choice (descending
router probability; a forced routing may list them in any order). Returned routing is the current
router's own top-k: with forced routing (Routing Replay) the forced experts run, and what
comes back is what the router would have chosen (equal to the forced routing when the
router agrees). For dense models M = X = 0.

Shape letters: B batch, L tokens, S key/cache slots, D model width, V vocab, N layers,
M MoE layers, X experts per token.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from gspo_jax.models.config import ModelConfig
from gspo_jax.models.layers import MLP, Attention, MoE, RMSNorm, _param, attend, rope_cos_sin

F32 = jnp.float32


class Block(nnx.Module):
    """Pre-norm decoder layer: x += attn(norm(x)); x += mlp_or_moe(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg)
        self.attn = Attention(cfg, rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg)
        self.is_moe = cfg.is_moe_layer(layer)
        self.mlp = MoE(cfg, rngs) if self.is_moe else MLP(cfg, cfg.intermediate_size, rngs)

    def __call__(self, x_BLD, cos, sin, attention, forced_BLX=None):
        """attention: this layer's context, `(q, k, v) -> (out, cache_entry)`.
        Returns (x_BLD, cache_entry, expert indices [B, L, X] or None)."""
        attn_out, cache_entry = self.attn(self.input_norm(x_BLD), cos, sin, attention)
        x_BLD = x_BLD + attn_out
        if self.is_moe:
            mlp_out, idx_BLX = self.mlp(self.post_attn_norm(x_BLD), forced_BLX)
        else:
            mlp_out, idx_BLX = self.mlp(self.post_attn_norm(x_BLD)), None
        return x_BLD + mlp_out, cache_entry, idx_BLX


@dataclasses.dataclass(frozen=True)
class SelfAttention:
    """Attention context of a full-sequence pass: each query attends to this call's keys
    where `allowed_BLS` is True (`layers.attend`); the layer's cache entry is its own
    (k [B, L, K, C], v [B, L, K, C]) — `kv_cache.prefill_shared` keeps them, `forward`
    drops them (dead code to XLA)."""

    allowed_BLS: jax.Array

    def __call__(self, layer: int, q_BLHC, k_BLKC, v_BLKC):
        del layer  # every layer attends the same way
        dtype = q_BLHC.dtype
        out = attend(q_BLHC, k_BLKC.astype(dtype), v_BLKC.astype(dtype), self.allowed_BLS)
        return out, (k_BLKC, v_BLKC)


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


def _remat_policy(name: str):
    if name == "dots":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    return None  # "full": save nothing but the layer's inputs


class Decoder(nnx.Module):
    """Embedding -> N blocks -> final RMSNorm. Returns final-normed hidden states."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = Embed(cfg, rngs)
        self.layers = nnx.List([Block(cfg, i, rngs) for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = LMHead(cfg, rngs)

    def __call__(self, tokens_BL, positions_BL, attention, routing=None, *, remat=False):
        """The one composition of the model, shared by forward, prefill and decode.

        attention: the attention context, `attention(layer, q_BLHC, k_BLKC, v_BLKC) ->
          (out_BLHC, cache_entry)` (`SelfAttention`, or a cache's context in kv_cache.py).
        routing: None or [M, B, L, X] expert indices to force. remat: apply the config's
          remat policy per block (the differentiated full-sequence pass only).
        Returns (final-normed hidden [B, L, D], the tuple of the N layers' cache entries,
        routing [M, B, L, X]).
        """
        cfg = self.cfg
        dtype = jnp.dtype(cfg.dtype)
        x = jnp.take(self.embed.embedding[...], tokens_BL, axis=0).astype(dtype)
        cos, sin = rope_cos_sin(cfg, positions_BL)
        routes, cache_entries = [], []
        for i, block in enumerate(self.layers):

            def run_block(block, x, forced, i=i):
                return block(x, cos, sin, functools.partial(attention, i), forced)

            if remat and cfg.remat != "none":
                run_block = nnx.remat(run_block, policy=_remat_policy(cfg.remat))
            forced = None
            if block.is_moe and routing is not None:
                forced = routing[len(routes)]
            x, entry, idx = run_block(block, x, forced)
            cache_entries.append(entry)
            if idx is not None:
                routes.append(idx)
        B, L = tokens_BL.shape
        if routes:
            routing_out = jnp.stack(routes)
        else:
            routing_out = jnp.zeros((0, B, L, cfg.num_experts_per_tok), jnp.int32)
        return self.final_norm(x), tuple(cache_entries), routing_out


# ---------------------------------------------------------------------------- params


@functools.cache
def _graph(cfg: ModelConfig):
    """(graphdef, abstract State) of the Decoder for this config, built once."""
    abstract = nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0)))
    return nnx.split(abstract)


def merge(cfg: ModelConfig, params) -> Decoder:
    """Decoder module holding `params` (a nested dict as returned by init_params)."""
    graphdef, abstract_state = _graph(cfg)
    _check_params(cfg, params)
    state = jax.tree.map(lambda v: v, abstract_state)  # fresh Variables, cached ones untouched
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def _check_params(cfg: ModelConfig, params) -> None:
    """Clear error (at trace time) when params do not fit the config's tree and shapes."""

    def paths(tree):
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {"/".join(str(getattr(k, "key", k)) for k in p): tuple(x.shape) for p, x in flat}

    want, got = paths(abstract_params(cfg)), paths(params)
    if want == got:
        return
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    wrong = sorted(k for k in set(want) & set(got) if want[k] != got[k])
    details = [
        f"missing {missing[:4]}" if missing else "",
        f"unexpected {extra[:4]}" if extra else "",
    ]
    details += [f"{k} has shape {got[k]}, expected {want[k]}" for k in wrong[:4]]
    raise ValueError(
        f"params do not fit this {cfg.arch} ModelConfig: " + "; ".join(d for d in details if d)
    )


def _state_to_dict(state, leaf_fn):
    """nnx.State -> nested dict, applying leaf_fn to each Variable."""
    out = {}
    for key, value in state.items():
        if isinstance(value, nnx.Variable):
            out[key] = leaf_fn(value)
        else:
            out[key] = _state_to_dict(value, leaf_fn)
    return out


def init_params(model_config: ModelConfig, rng: jax.Array) -> dict:
    """Random parameters, normal(0, 0.02) for matrices, ones for norms, zeros for biases.

    Jittable with model_config static (give out_shardings to create them sharded).
    """
    model = Decoder(model_config, nnx.Rngs(params=rng))
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def abstract_params(model_config: ModelConfig) -> dict:
    """ShapeDtypeStructs of the parameters (no allocation)."""
    return _state_to_dict(_graph(model_config)[1], lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype))


def logical_axes(model_config: ModelConfig) -> dict:
    """Same tree as the params; each leaf a tuple of logical axis names (or None per dim).

    Names: "vocab", "embed", "heads", "kv_heads", "mlp", "expert"; None for head_dim,
    norm scales and the router's expert dim (kept replicated). Map with
    `jax.tree.map(fn, params, logical_axes(cfg))` (params first, so tuples stay whole).
    """
    return _state_to_dict(
        _graph(model_config)[1], lambda v: tuple(v.get_metadata()["out_sharding"])
    )


def param_count(model_config: ModelConfig, *, active: bool = False) -> int:
    """Number of parameters; `active=True` counts only top-k of the experts per MoE layer."""
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params(model_config))[0]:
        n = 1
        for s in leaf.shape:
            n *= s
        names = [getattr(p, "key", None) for p in path]
        is_expert = names[-1] in ("gate_proj", "up_proj", "down_proj") and len(leaf.shape) == 3
        if active and is_expert:  # expert tensor [E, ., .]: only top-k of E are used
            n = n // model_config.num_experts * model_config.num_experts_per_tok
        total += n
    return total


# ----------------------------------------------------------------------------- calls


def positions_from_mask(mask_BL):
    """position = cumsum(mask) − 1 (0 on leading padding): left padding shifts nothing."""
    mask = mask_BL.astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)


def run_full(cfg: ModelConfig, params, tokens_BL, mask_BL, routing=None, *, remat=False):
    """Full-sequence pass: causal attention over this call's valid tokens only.

    Returns (hidden [B, L, D], per-layer (k, v) [B, L, K, C], routing [M, B, L, X]).
    """
    L = tokens_BL.shape[1]
    mask = mask_BL.astype(bool)
    causal_LL = jnp.tril(jnp.ones((L, L), bool))
    allowed_BLS = causal_LL[None] & mask[:, None, :]
    model = merge(cfg, params)
    return model(
        tokens_BL, positions_from_mask(mask_BL), SelfAttention(allowed_BLS), routing, remat=remat
    )


def _run(cfg, params, tokens_BL, mask_BL, routing):
    """The differentiable pass of forward / hidden_states: (hidden, routing)."""
    hidden, _, routing_out = run_full(cfg, params, tokens_BL, mask_BL, routing, remat=True)
    return hidden, routing_out


def _check_routing(cfg, tokens_BL, routing):
    if routing is None:
        return
    want = (cfg.num_moe_layers, *tokens_BL.shape, cfg.num_experts_per_tok)
    if tuple(routing.shape) != want:
        raise ValueError(f"routing has shape {tuple(routing.shape)}, expected [M, B, L, X]={want}")


@functools.partial(jax.jit, static_argnums=0, static_argnames=("return_routing",))
def hidden_states(
    model_config: ModelConfig,
    params,
    tokens_BL,
    attention_mask_BL,
    *,
    routing=None,
    return_routing: bool = False,
):
    """Final-normed hidden states [B, L, D] in the compute dtype (+ routing [M, B, L, X]).

    `routing` forces the MoE expert choice (Routing Replay, paper §5.3); the gates are
    still the current router's probabilities at those experts.
    """
    _check_routing(model_config, tokens_BL, routing)
    hidden, routing_out = _run(model_config, params, tokens_BL, attention_mask_BL, routing)
    return (hidden, routing_out) if return_routing else hidden


def unembedding(model_config: ModelConfig, params):
    """Output projection [D, V] in the compute dtype (the embedding transposed when tied).

    logits = hidden_states @ unembedding (accumulate in float32).
    """
    if model_config.tie_word_embeddings:
        w = params["embed"]["embedding"].T
    else:
        w = params["lm_head"]["kernel"]
    return w.astype(model_config.dtype)


def logits_from_hidden(model_config: ModelConfig, params, hidden_BLD):
    """hidden @ unembedding with float32 accumulation -> float32 logits."""
    w_DV = unembedding(model_config, params)
    return jnp.einsum(
        "...d,dv->...v", hidden_BLD.astype(w_DV.dtype), w_DV, preferred_element_type=F32
    )


@functools.partial(jax.jit, static_argnums=0, static_argnames=("return_routing",))
def forward(
    model_config: ModelConfig,
    params,
    tokens_BL,
    attention_mask_BL,
    *,
    routing=None,
    return_routing: bool = False,
):
    """Logits [B, L, V] float32 of a padded batch (1 = real token; left padding allowed).

    Logits at padding positions are finite but meaningless. Optionally forces / returns
    the MoE routing (see module docstring for its format).
    """
    _check_routing(model_config, tokens_BL, routing)
    hidden, routing_out = _run(model_config, params, tokens_BL, attention_mask_BL, routing)
    logits = logits_from_hidden(model_config, params, hidden)
    return (logits, routing_out) if return_routing else logits


@functools.partial(jax.jit, static_argnums=0)
def routing_disagreement(model_config: ModelConfig, params_a, params_b, tokens, attention_mask):
    """Fraction of routing decisions that differ between two parameter sets (paper §5.3).

    Each model routes the same tokens with its own hidden states; per valid token and MoE
    layer the k chosen experts are compared as sets:
        1 − Σ_{m,b,l} mask·|top_a ∩ top_b| / (k · M · Σ mask).
    """
    if model_config.num_moe_layers == 0:
        raise ValueError(f"routing_disagreement needs an MoE model, got arch={model_config.arch!r}")
    _, idx_a = _run(model_config, params_a, tokens, attention_mask, None)
    _, idx_b = _run(model_config, params_b, tokens, attention_mask, None)
    same = jnp.any(idx_a[..., :, None] == idx_b[..., None, :], axis=-1).sum(-1)  # [M, B, L]
    mask = attention_mask.astype(F32)
    kept = jnp.sum(same.astype(F32) * mask[None])
    total = model_config.num_experts_per_tok * model_config.num_moe_layers * jnp.sum(mask)
    return 1.0 - kept / jnp.maximum(total, 1.0)
