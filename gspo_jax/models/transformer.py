"""The Qwen decoder and the pure, jittable functions the rest of gspo_jax calls.

Where it sits: `sampling.py` (prefill/decode through `kv_cache.py`), `logprobs.py` and
`train_step.py` (`hidden_states` + `unembedding`, or `forward`) and `sharding.py`
(`abstract_params`, `logical_axes`) use this module; it never imports training code.

Flax NNX driven functionally: `Decoder` is an `nnx.Module`; its graphdef
is built once per `ModelConfig` (cached) and the public functions take the parameters as
a plain nested dict of arrays and merge inside. `model_config` is static (hashable) and
weights are always arguments, never closed-over constants.

Scanned layers. Every per-layer parameter is stacked on a leading layer axis (logical
axis "layers", never sharded): `layers/attn/q_proj/kernel` is [layers, D, H, C]. The
attention half of a layer (its two norms and `Attention`) is stacked over all layers;
the MLP half over the dense layers (`layers/mlp`, in layer order) and the MoE half over
the MoE layers (`layers/moe`, in `model_config.moe_layers` order, which is also the
order of the routing arrays). The full-sequence pass (train step, log-probs, prefill)
applies them with `jax.lax.scan`, so its compiled program (and compile time) does not
grow with depth; `model_config.scan_layers=False` runs the same layers in a Python loop
instead (MaxText's `scan_layers`): a program that grows with depth, but no stacked
residuals for the backward pass to write and read back, which is what a small model's
train step spends its time on (1.2x faster at the TRL anchor's 4 layers on XLA:CPU,
benchmarks/rl_step.py). A model whose layers are not all of one kind (Qwen3-MoE's
`mlp_only_layers`, `decoder_sparse_step`) is cut into runs of a repeating unit
(`layer_runs`: e.g. 24 × (dense, MoE) for decoder_sparse_step=2), each run one scan over
its unit; order is kept exactly. The one-token decode step runs the layers unrolled
instead, each with its own cache buffer (`_apply_layers_unrolled`, `split_layers`):
scanned, every step copied each layer's weights and cache out of the stacks.

One composition, three uses: `Decoder.__call__` (embedding -> layers -> final norm) and
`Block` (one layer) are the only places the model is written down. What differs between
the full-sequence pass, the cached prefill and the one-token decode step is only which
keys each query attends to and what is stored for later: that is the *attention
context*, a callable `(layer_data, q, k, v) -> (out, cache_entry)` the decoder hands to
every block. `layer_data` is this layer's slice of the context's own per-layer arrays
(`context.layer_data`, leading layer axis, or None), sliced by the same scan as the
weights; the cache entries come back stacked on a leading layer axis. (Unrolled, the
context gets the layer's index and the entries come back as a tuple.) `SelfAttention`
is the full-sequence context (its kernel chosen by `model_config.attention_impl`, see
attention.py); kv_cache.py has the decode step's. A change to the block (norm placement,
a new projection, a new MLP) is therefore made once and reaches training, prefill and
sampling together.

Positions come from the attention mask: position = cumsum(mask) − 1, so left padding
gives every row positions 0, 1, … from its first real token (what transformers'
`generate` does), and causal attention never looks at padding keys.

Routing format (MoE): int32 [M, B, L, X] — top-k expert indices per MoE layer (in
layer order, `model_config.moe_layers`), batch row, position and choice (descending
router probability; a forced routing may list them in any order). Returned routing is the current
router's own top-k: with forced routing (Routing Replay) the forced experts run, and what
comes back is what the router would have chosen (equal to the forced routing when the
router agrees). For dense models M = X = 0: every function that returns routing returns
it, then empty.

Shape letters: B batch, L tokens, D model width, V vocab, H query heads, K kv heads,
C head dim, M MoE layers, X experts per token. The layer count is written out
("layers"), never a letter.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from gspo_jax.models.attention import (
    attend_shared_prompt,
    causal_allowed,
    resolve_impl,
    self_attention,
)
from gspo_jax.models.config import ModelConfig
from gspo_jax.models.layers import MLP, Attention, MoE, RMSNorm, _param, rope_cos_sin

F32 = jnp.float32
_SCAN_UNROLL = 1


class Block(nnx.Module):
    """Pre-norm decoder layer: x += attn(norm(x)); x += mlp_or_moe(norm(x)).

    One layer's parameters. The decoder keeps them stacked (`Layers`) and merges a Block
    from each layer's slice inside its scan."""

    def __init__(self, cfg: ModelConfig, is_moe: bool, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg)
        self.attn = Attention(cfg, rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg)
        self.is_moe = is_moe
        self.mlp = MoE(cfg, rngs) if is_moe else MLP(cfg, cfg.intermediate_size, rngs)

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


def _stacked(n: int, make, rngs: nnx.Rngs):
    """`make(rngs)` n times, each parameter stacked on a new leading axis named "layers"
    (independent random init per layer)."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def create(rngs):
        return make(rngs)

    return create(rngs)


class Layers(nnx.Module):
    """Every layer's parameters, stacked: the attention half over all layers, the MLP half
    over the dense layers and the MoE half over the MoE layers (module docstring)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        n, m = cfg.num_layers, cfg.num_moe_layers
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_norm = _stacked(n, lambda r: RMSNorm(D, eps, cfg), rngs)
        self.attn = _stacked(n, lambda r: Attention(cfg, r), rngs)
        self.post_attn_norm = _stacked(n, lambda r: RMSNorm(D, eps, cfg), rngs)
        dense = n - m
        self.mlp = (
            _stacked(dense, lambda r: MLP(cfg, cfg.intermediate_size, r), rngs) if dense else None
        )
        self.moe = _stacked(m, lambda r: MoE(cfg, r), rngs) if m else None


@dataclasses.dataclass(frozen=True)
class LayerRun:
    """`repeats` consecutive copies of a unit of layers, applied as one scan.

    start: first layer; kinds: per layer of the unit, True for MoE; dense_start /
    moe_start: index of the run's first dense / MoE layer in the `mlp` / `moe` stacks.
    """

    start: int
    kinds: tuple[bool, ...]
    repeats: int
    dense_start: int
    moe_start: int

    @property
    def num_layers(self) -> int:
        return len(self.kinds) * self.repeats

    @property
    def dense_per_unit(self) -> int:
        return len(self.kinds) - sum(self.kinds)

    @property
    def moe_per_unit(self) -> int:
        return sum(self.kinds)


@functools.cache
def layer_runs(cfg: ModelConfig) -> tuple[LayerRun, ...]:
    """The layers cut into runs of a repeating unit, fewest traced layers first.

    Each run compiles its unit once, so compile work is Σ unit lengths; this picks the
    cut minimising it (then the number of runs): all-dense or all-MoE models are one run
    of a one-layer unit; decoder_sparse_step=2 is one run of (dense, MoE) pairs; an odd
    mlp_only_layers entry costs a run or two more.
    """
    kinds = tuple(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    n = len(kinds)
    # best[i] = (traced layers, runs, (unit length, repeats)) for layers i..n-1
    best: list = [None] * n + [(0, 0, None)]
    for i in range(n - 1, -1, -1):
        for p in range(1, n - i + 1):
            unit = kinds[i : i + p]
            r = 1
            while i + (r + 1) * p <= n and kinds[i + r * p : i + (r + 1) * p] == unit:
                r += 1
            for repeats in range(1, r + 1):
                cost, runs, _ = best[i + p * repeats]
                candidate = (cost + p, runs + 1, (p, repeats))
                if best[i] is None or candidate[:2] < best[i][:2]:
                    best[i] = candidate
    out, i = [], 0
    while i < n:
        p, repeats = best[i][2]
        before = kinds[:i]
        out.append(LayerRun(i, kinds[i : i + p], repeats, i - sum(before), sum(before)))
        i += p * repeats
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class SelfAttention:
    """Attention context of a full-sequence pass: each query attends to this call's real
    keys at or before it (`attention.self_attention` with implementation `impl`); the
    layer's cache entry is its (k [B, L, K, C], v [B, L, K, C]) when `keep_kv` (what
    `kv_cache.prefill_shared` stores), else None."""

    mask_BL: jax.Array
    impl: str
    keep_kv: bool = False
    allowed_BLS: jax.Array | None = None  # built once for "xla" (see `full_context`)
    layer_data = None  # nothing per layer

    def __call__(self, layer_data, q_BLHC, k_BLKC, v_BLKC):
        del layer_data
        dtype = q_BLHC.dtype
        k_BLKC, v_BLKC = k_BLKC.astype(dtype), v_BLKC.astype(dtype)
        out = self_attention(self.impl, q_BLHC, k_BLKC, v_BLKC, self.mask_BL, self.allowed_BLS)
        return out, ((k_BLKC, v_BLKC) if self.keep_kv else None)


def full_context(cfg: ModelConfig, mask_BL, *, keep_kv: bool = False) -> SelfAttention:
    """The `SelfAttention` context of `cfg.attention_impl` for a batch with this mask."""
    impl = resolve_impl(cfg.attention_impl, dtype=cfg.dtype)
    allowed = causal_allowed(mask_BL) if impl == "xla" else None
    return SelfAttention(mask_BL, impl, keep_kv, allowed)


@dataclasses.dataclass(frozen=True)
class SharedPromptAttention:
    """Attention context of the shared-prompt full-sequence pass (`hidden_states_shared`):
    row n of the call holds prompt n's P tokens, then its G responses of T tokens
    (`attention.attend_shared_prompt`). Always the einsum arithmetic (`attend`'s), whatever
    `attention_impl` says; no cache entry."""

    prompt_mask_NP: jax.Array
    response_mask_NGT: jax.Array
    layer_data = None  # nothing per layer

    def __call__(self, layer_data, q_NSHC, k_NSKC, v_NSKC):
        del layer_data
        dtype = q_NSHC.dtype
        out = attend_shared_prompt(
            q_NSHC,
            k_NSKC.astype(dtype),
            v_NSKC.astype(dtype),
            self.prompt_mask_NP,
            self.response_mask_NGT,
        )
        return out, None


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


@functools.cache
def _block_graph(cfg: ModelConfig, is_moe: bool):
    """(graphdef, abstract State) of one layer of this kind, built once."""
    # graph_updates=False: no shardings from a mesh in context (logical names are not mesh
    # axes; the first call may happen while tracing under jax.set_mesh).
    return nnx.split(nnx.eval_shape(lambda: Block(cfg, is_moe, nnx.Rngs(0)), graph_updates=False))


def _merge_block(cfg: ModelConfig, is_moe: bool, layer_params) -> Block:
    graphdef, abstract_state = _block_graph(cfg, is_moe)
    state = jax.tree.map(lambda v: v, abstract_state)  # fresh Variables, cached ones untouched
    nnx.replace_by_pure_dict(state, layer_params)
    return nnx.merge(graphdef, state)


def _slice_layers(tree, start: int, count: int, total: int, unit: int):
    """Layers [start, start + count) of arrays with a leading layer axis of `total`, as
    [count // unit, unit, ...] (no slice when the run covers the whole stack)."""

    def one(a):
        if count != total:
            a = jax.lax.slice_in_dim(a, start, start + count, axis=0)
        return a.reshape(count // unit, unit, *a.shape[1:])

    return jax.tree.map(one, tree)


def _unit_fn(run: LayerRun, layer_fn, policy, scanned: bool):
    """(x, this unit's slices) -> (x, {"entries", "routes"} stacked over the unit's layers):
    the body of the run's scan. layer_fn(is_moe, layer_params, x, data, forced) runs one
    layer; with a remat policy each layer is checkpointed on its own."""

    def unit(x, xs_unit):
        unit_entries, unit_routes = [], []
        d = e = 0
        for j, is_moe in enumerate(run.kinds):
            layer_params = jax.tree.map(lambda a, j=j: a[j], xs_unit["half"])
            if is_moe:
                layer_params["mlp"] = jax.tree.map(lambda a, e=e: a[e], xs_unit["moe"])
                forced = xs_unit["forced"][e] if "forced" in xs_unit else None
            else:
                layer_params["mlp"] = jax.tree.map(lambda a, d=d: a[d], xs_unit["mlp"])
                forced = None
            data = jax.tree.map(lambda a, j=j: a[j], xs_unit["data"])
            fn = functools.partial(layer_fn, is_moe)
            if policy is not False:
                # Inside a scan the loop already keeps iterations apart, so CSE across the
                # recomputation is harmless (jax's advice for remat inside scan).
                fn = jax.checkpoint(fn, policy=policy, prevent_cse=not scanned)
            x, entry, idx = fn(layer_params, x, data, forced)
            unit_entries.append(entry)
            if is_moe:
                unit_routes.append(idx)
                e += 1
            else:
                d += 1
        stack = functools.partial(jax.tree.map, lambda *a: jnp.stack(a))
        routes = stack(*unit_routes) if unit_routes else None
        return x, {"entries": stack(*unit_entries), "routes": routes}

    return unit


def _apply_layers(cfg: ModelConfig, stacks: dict, x_BLD, cos, sin, attention, routing, remat):
    """All layers, run by run (`layer_runs`), each run a scan over its repeated unit.

    Returns (x_BLD, cache entries stacked on a leading layer axis (or None), routing
    [M, B, L, X] computed or forced)."""
    n, m = cfg.num_layers, cfg.num_moe_layers
    policy = _remat_policy(cfg.remat) if remat and cfg.remat != "none" else False

    def layer_fn(is_moe, layer_params, x, data, forced):
        block = _merge_block(cfg, is_moe, layer_params)
        return block(x, cos, sin, functools.partial(attention, data), forced)

    entries, routes = [], []
    for run in layer_runs(cfg):
        p, pd, pm = len(run.kinds), run.dense_per_unit, run.moe_per_unit
        half = {k: stacks[k] for k in ("input_norm", "attn", "post_attn_norm")}
        xs = {
            "half": _slice_layers(half, run.start, run.num_layers, n, p),
            "data": _slice_layers(attention.layer_data, run.start, run.num_layers, n, p),
        }
        if pd:
            xs["mlp"] = _slice_layers(stacks["mlp"], run.dense_start, pd * run.repeats, n - m, pd)
        if pm:
            xs["moe"] = _slice_layers(stacks["moe"], run.moe_start, pm * run.repeats, m, pm)
            if routing is not None:
                xs["forced"] = _slice_layers(routing, run.moe_start, pm * run.repeats, m, pm)
        scanned = run.repeats > 1 and cfg.scan_layers
        unit = _unit_fn(run, layer_fn, policy, scanned)
        if scanned:
            x_BLD, ys = jax.lax.scan(unit, x_BLD, xs, unroll=_SCAN_UNROLL)
        else:  # one unit, or `scan_layers=False`: the units in a Python loop
            per_unit = []
            for r in range(run.repeats):
                x_BLD, y = unit(x_BLD, jax.tree.map(lambda a, r=r: a[r], xs))
                per_unit.append(y)
            ys = jax.tree.map(lambda *a: jnp.stack(a), *per_unit)
        flat = functools.partial(jax.tree.map, lambda a: a.reshape(-1, *a.shape[2:]))
        entries.append(flat(ys["entries"]))
        if pm:
            routes.append(flat(ys["routes"]))
    if len(entries) == 1:
        entries_out = entries[0]
    else:
        entries_out = jax.tree.map(lambda *a: jnp.concatenate(a), *entries)
    B, L = x_BLD.shape[:2]
    if routes:
        routing_out = routes[0] if len(routes) == 1 else jnp.concatenate(routes)
    else:
        routing_out = jnp.zeros((0, B, L, cfg.num_experts_per_tok), jnp.int32)
    return x_BLD, entries_out, routing_out


def split_layers(model_config: ModelConfig, params) -> tuple[dict, ...]:
    """Each layer's own parameters sliced out of the stacks, in the compute dtype: a tuple
    over layers of {"input_norm", "attn", "post_attn_norm", "mlp"} (for a MoE layer "mlp"
    holds its MoE block's). Jittable.

    For a loop that runs the layers unrolled at every iteration (the sampler's decode
    loop): slice once before the loop and pass the result as `layer_params`. XLA does
    not hoist static slices of the stacks out of a while loop; inside it they copy every
    layer's weights at every step (measured: the sampler's decode step 1.45x slower).
    The cast to the compute dtype is the one every layer applies on use (the MoE router
    excepted: it computes in f32 from the stored weights), done once: a decode step then
    reads bf16 weights, not f32 master weights, and the copy costs half as much.
    """
    stacks = params["layers"]
    dtype = jnp.dtype(model_config.dtype)
    out, dense, moe = [], 0, 0

    def at(tree, index):
        return jax.tree.map(lambda a: a[index].astype(dtype), tree)

    for i in range(model_config.num_layers):
        layer = {k: at(stacks[k], i) for k in ("input_norm", "attn", "post_attn_norm")}
        if model_config.is_moe_layer(i):
            router = stacks["moe"]["router"]
            layer["mlp"] = at({k: v for k, v in stacks["moe"].items() if k != "router"}, moe)
            layer["mlp"]["router"] = jax.tree.map(lambda a, m=moe: a[m], router)
            moe += 1
        else:
            layer["mlp"] = at(stacks["mlp"], dense)
            dense += 1
        out.append(layer)
    return tuple(out)


def _apply_layers_unrolled(cfg: ModelConfig, layer_params, x_BLD, cos, sin, attention, routing):
    """All layers in a Python loop, layer i's weights `layer_params[i]` (`split_layers`).

    For the decode step (kv_cache.py), whose cache is one buffer per layer: the context is
    called with the layer's index, reads and writes that layer's buffers only, and the
    cache entries come back as a tuple over layers. Scanning the decode step over stacked
    weights and a stacked cache made the sampler's XLA:CPU decode step 1.6x slower (every
    step sliced each layer out of the stacks); compile time is the differentiated pass's
    problem, which stays scanned.
    Returns (x_BLD, tuple of entries, routing [M, B, L, X])."""
    entries, routes = [], []
    moe = 0
    for i in range(cfg.num_layers):
        is_moe = cfg.is_moe_layer(i)
        forced = routing[moe] if is_moe and routing is not None else None
        block = _merge_block(cfg, is_moe, layer_params[i])
        x_BLD, entry, idx = block(x_BLD, cos, sin, functools.partial(attention, i), forced)
        entries.append(entry)
        if is_moe:
            routes.append(idx)
            moe += 1
    B, L = x_BLD.shape[:2]
    if routes:
        routing_out = jnp.stack(routes)
    else:
        routing_out = jnp.zeros((0, B, L, cfg.num_experts_per_tok), jnp.int32)
    return x_BLD, tuple(entries), routing_out


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
        layers when unrolled — and routing [M, B, L, X]).
        """
        cfg = self.cfg
        dtype = jnp.dtype(cfg.dtype)
        x = jnp.take(self.embed.embedding[...], tokens_BL, axis=0).astype(dtype)
        cos, sin = rope_cos_sin(cfg, positions_BL)
        stacks = nnx.to_pure_dict(nnx.state(self.layers, nnx.Param))
        if unroll:
            if layer_params is None:
                layer_params = split_layers(cfg, {"layers": stacks})
            x, entries, routing_out = _apply_layers_unrolled(
                cfg, layer_params, x, cos, sin, attention, routing
            )
        else:
            x, entries, routing_out = _apply_layers(
                cfg, stacks, x, cos, sin, attention, routing, remat
            )
        return self.final_norm(x), entries, routing_out


# ---------------------------------------------------------------------------- params


@functools.cache
def _graph(cfg: ModelConfig):
    """(graphdef, abstract State) of the Decoder for this config, built once."""
    abstract = nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0)), graph_updates=False)
    return nnx.split(abstract)  # (graph_updates=False: see _block_graph)


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

    Names: "layers" (the leading axis of every per-layer parameter), "vocab", "embed",
    "heads", "kv_heads", "mlp", "expert"; None for head_dim, norm scales and the router's
    expert dim (kept replicated). Map with
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
        is_expert = names[-2:-1] == ["moe"] and names[-1] in ("gate_proj", "up_proj", "down_proj")
        if active and is_expert:  # expert tensor [M, E, ., .]: only top-k of E are used
            n = n // model_config.num_experts * model_config.num_experts_per_tok
        total += n
    return total


# ----------------------------------------------------------------------------- calls


def positions_from_mask(mask_BL):
    """position = cumsum(mask) − 1 (0 on leading padding): left padding shifts nothing."""
    mask = mask_BL.astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)


def run_full(
    cfg: ModelConfig, params, tokens_BL, mask_BL, routing=None, *, remat=False, keep_kv=False
):
    """Full-sequence pass: causal attention over this call's real tokens only.

    Returns (hidden [B, L, D], (k, v) each [layers, B, L, K, C] when `keep_kv` else None,
    routing [M, B, L, X]).
    """
    model = merge(cfg, params)
    context = full_context(cfg, mask_BL, keep_kv=keep_kv)
    return model(tokens_BL, positions_from_mask(mask_BL), context, routing, remat=remat)


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


@functools.partial(jax.jit, static_argnums=0)
def hidden_states(model_config: ModelConfig, params, tokens_BL, attention_mask_BL, *, routing=None):
    """(final-normed hidden states [B, L, D] in the compute dtype, routing [M, B, L, X]).

    `routing` forces the MoE expert choice (Routing Replay, paper §5.3); the gates are
    still the current router's probabilities at those experts. The routing returned is
    the one used (computed, or the forced one); [0, B, L, 0] for dense models.
    """
    _check_routing(model_config, tokens_BL, routing)
    return _run(model_config, params, tokens_BL, attention_mask_BL, routing)


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
