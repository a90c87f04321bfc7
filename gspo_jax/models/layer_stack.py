"""How the stacked layers are run: scanned in runs of a repeating unit, or unrolled.

The full-sequence pass (train step, log-probs, prefill) applies the stacked layers with
`jax.lax.scan`, so its compiled program (and compile time) does not grow with depth;
`model_config.scan_layers=False` runs the same layers in a Python loop instead (MaxText's
`scan_layers`): a program that grows with depth, but no stacked residuals for the
backward pass to write and read back (docs/benchmarks.md has the measurements). A model
whose layers are not all of one kind (Qwen3-MoE's `mlp_only_layers`,
`decoder_sparse_step`) is cut into runs of a repeating unit (`layer_runs`: e.g. 24 ×
(dense, MoE) for decoder_sparse_step=2), each run one scan over its unit; order is kept
exactly. The one-token decode step runs the layers unrolled instead, each with its own
cache buffer (`apply_layers_unrolled`, `split_layers`): scanned, every step copied each
layer's weights and cache out of the stacks.

Every function here takes an attention context (models/contexts.py) and hands each layer
its slice of the context's per-layer data (`context.layer_data`, leading layer axis),
sliced by the same scan as the weights.

Shape letters: B batch, L tokens, D model width, M MoE layers, X experts per token.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from gspo_jax.models.block import Block
from gspo_jax.models.config import ModelConfig

_SCAN_UNROLL = 1


@dataclasses.dataclass(frozen=True)
class LayerRun:
    """`repeats` consecutive copies of a unit of layers, applied as one scan.

    start: first layer; kinds: per layer of the unit, True for MoE; dense_start /
    moe_start: index of the run's first dense / MoE layer in the `mlp` / `moe` stacks;
    mixers: per layer of the unit, True for a Gated DeltaNet layer (hybrid models; empty
    when none is); full_start / linear_start: the run's first index in the `attn` /
    `linear_attn` stacks.
    """

    start: int
    kinds: tuple[bool, ...]
    repeats: int
    dense_start: int
    moe_start: int
    mixers: tuple[bool, ...] = ()
    full_start: int = 0
    linear_start: int = 0

    def is_linear(self, j: int) -> bool:
        return bool(self.mixers) and self.mixers[j]

    @property
    def linear_per_unit(self) -> int:
        return sum(self.mixers)

    @property
    def full_per_unit(self) -> int:
        return len(self.kinds) - self.linear_per_unit

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
    moe = tuple(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    linear = tuple(cfg.is_linear_layer(i) for i in range(cfg.num_layers))
    kinds = tuple(zip(moe, linear))
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
        moe_before, linear_before = sum(moe[:i]), sum(linear[:i])
        mixers = linear[i : i + p] if any(linear) else ()
        out.append(
            LayerRun(
                i,
                moe[i : i + p],
                repeats,
                i - moe_before,
                moe_before,
                mixers,
                i - linear_before,
                linear_before,
            )
        )
        i += p * repeats
    return tuple(out)


# What each selective policy saves, by the `checkpoint_name`s layers.Attention gives.
REMAT_SAVED_NAMES = {"save_qkv": ("qkv",), "save_qkv_attention": ("qkv", "attention")}


def _remat_policy(name: str):
    if name == "dots":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    if name in REMAT_SAVED_NAMES:
        return jax.checkpoint_policies.save_only_these_names(*REMAT_SAVED_NAMES[name])
    return None  # "full": save nothing but the layer's inputs


@functools.cache
def _block_graph(cfg: ModelConfig, is_moe: bool, is_linear: bool = False):
    """(graphdef, abstract State) of one layer of this kind, built once."""
    # graph_updates=False: no shardings from a mesh in context (logical names are not mesh
    # axes; the first call may happen while tracing under jax.set_mesh).
    return nnx.split(
        nnx.eval_shape(lambda: Block(cfg, is_moe, nnx.Rngs(0), is_linear), graph_updates=False)
    )


def _merge_block(cfg: ModelConfig, is_moe: bool, layer_params, is_linear: bool = False) -> Block:
    graphdef, abstract_state = _block_graph(cfg, is_moe, is_linear)
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
    """(x, this unit's slices) -> (x, {"entries", "linear_entries", "routes"} stacked over
    the unit's layers of each kind, and "stats": its MoE layers' router load statistics
    summed, when layer_fn returns them): the body of the run's scan. layer_fn((is_moe,
    is_linear), layer_params, x, data, forced) runs one layer; with a remat policy each
    layer is checkpointed on its own."""

    def unit(x, xs_unit):
        entries, linear_entries, unit_routes, unit_stats = [], [], [], []
        counts = {"mlp": 0, "moe": 0, "attn": 0, "linear_attn": 0}

        def take(name):
            index = counts[name]
            counts[name] += 1
            return jax.tree.map(lambda a: a[index], xs_unit[name])

        for j, is_moe in enumerate(run.kinds):
            is_linear = run.is_linear(j)
            layer_params = jax.tree.map(lambda a, j=j: a[j], xs_unit["half"])
            forced = None
            if is_moe and "forced" in xs_unit:
                forced = xs_unit["forced"][counts["moe"]]
            layer_params["mlp"] = take("moe" if is_moe else "mlp")
            mixer = "linear_attn" if is_linear else "attn"
            layer_params[mixer] = take(mixer)
            data = jax.tree.map(lambda a, j=j: a[j], xs_unit["data"])
            fn = functools.partial(layer_fn, (is_moe, is_linear))
            if policy is not False:
                # Inside a scan the loop already keeps iterations apart, so CSE across the
                # recomputation is harmless (jax's advice for remat inside scan).
                fn = jax.checkpoint(fn, policy=policy, prevent_cse=not scanned)
            x, entry, idx, *stats = fn(layer_params, x, data, forced)
            (linear_entries if is_linear else entries).append(entry)
            if is_moe:
                unit_routes.append(idx)
                unit_stats.extend(stats)
        stack = functools.partial(jax.tree.map, lambda *a: jnp.stack(a))
        ys = {
            "entries": stack(*entries) if entries else None,
            "linear_entries": stack(*linear_entries) if linear_entries else None,
            "routes": stack(*unit_routes) if unit_routes else None,
        }
        if unit_stats:
            ys["stats"] = jax.tree.map(lambda *a: sum(a), *unit_stats)
        return x, ys

    return unit


def _layer_context(attention, data, is_linear: bool):
    """This layer's context: attention's, or (a linear layer) `attention.linear`'s."""
    if is_linear:
        return functools.partial(attention.linear, data)
    return functools.partial(attention, data)


def _run_xs(cfg: ModelConfig, run: LayerRun, stacks: dict, attention, routing) -> dict:
    """The slices of the weights, context data and forced routing one run scans over."""
    n, m, lin = cfg.num_layers, cfg.num_moe_layers, cfg.num_linear_layers
    p, pd, pm = len(run.kinds), run.dense_per_unit, run.moe_per_unit
    half = {k: stacks[k] for k in ("input_norm", "post_attn_norm")}
    xs = {
        "half": _slice_layers(half, run.start, run.num_layers, n, p),
        "data": _slice_layers(attention.layer_data, run.start, run.num_layers, n, p),
    }
    pf, pl = run.full_per_unit, run.linear_per_unit
    if pf:
        xs["attn"] = _slice_layers(stacks["attn"], run.full_start, pf * run.repeats, n - lin, pf)
    if pl:
        xs["linear_attn"] = _slice_layers(
            stacks["linear_attn"], run.linear_start, pl * run.repeats, lin, pl
        )
    if pd:
        xs["mlp"] = _slice_layers(stacks["mlp"], run.dense_start, pd * run.repeats, n - m, pd)
    if pm:
        xs["moe"] = _slice_layers(stacks["moe"], run.moe_start, pm * run.repeats, m, pm)
        if routing is not None:
            xs["forced"] = _slice_layers(routing, run.moe_start, pm * run.repeats, m, pm)
    return xs


def _concat(parts):
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *parts)


def apply_layers(
    cfg: ModelConfig, stacks: dict, x_BLD, cos, sin, attention, routing, remat, stats_mask_BL=None
):
    """All layers, run by run (`layer_runs`), each run a scan over its repeated unit.

    Returns (x_BLD, cache entries stacked on a leading layer axis (or None) — for a
    hybrid model a pair (full-attention layers' entries, linear layers' entries), each in
    layer order — and routing [M, B, L, X] computed or forced); with `stats_mask_BL`
    [B, L] (1: a real token; MoE models) also the router load statistics of every MoE
    layer summed over the layers, (counts [E], probs [E], rows) as
    `moe_aux.load_balancing_loss` takes them."""
    policy = _remat_policy(cfg.remat) if remat and cfg.remat != "none" else False
    extra = () if stats_mask_BL is None else (stats_mask_BL,)

    def layer_fn(kind, layer_params, x, data, forced):
        is_moe, is_linear = kind
        block = _merge_block(cfg, is_moe, layer_params, is_linear)
        context = _layer_context(attention, data, is_linear)
        return block(x, cos, sin, context, forced, *extra)

    entries, linear_entries, routes, stats = [], [], [], []
    for run in layer_runs(cfg):
        xs = _run_xs(cfg, run, stacks, attention, routing)
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
        linear_entries.append(flat(ys["linear_entries"]))
        routes.append(flat(ys["routes"]))
        if "stats" in ys:  # [repeats, ...] -> summed over the run
            stats.append(jax.tree.map(lambda a: jnp.sum(a, axis=0), ys["stats"]))
    entries_out = _concat(entries)
    if cfg.is_hybrid:
        entries_out = (entries_out, _concat(linear_entries))
    B, L = x_BLD.shape[:2]
    routing_out = _concat(routes)
    if routing_out is None:
        routing_out = jnp.zeros((0, B, L, cfg.num_experts_per_tok), jnp.int32)
    if stats_mask_BL is None:
        return x_BLD, entries_out, routing_out
    if not stats:
        raise ValueError("router load statistics (stats_mask_BL) need a Mixture-of-Experts model")
    return x_BLD, entries_out, routing_out, jax.tree.map(lambda *a: sum(a), *stats)


def split_layers(model_config: ModelConfig, params) -> tuple[dict, ...]:
    """Each layer's own parameters sliced out of the stacks, in the compute dtype: a tuple
    over layers of {"input_norm", "attn", "post_attn_norm", "mlp"} (for a MoE layer "mlp"
    holds its MoE block's). Jittable.

    For a loop that runs the layers unrolled at every iteration (the sampler's decode
    loop): slice once before the loop and pass the result as `layer_params`. XLA does
    not hoist static slices of the stacks out of a while loop; inside it they copy every
    layer's weights at every step (the sampler's decode step was slower: docs/tpu.md,
    "Decoding at long responses").
    The cast to the compute dtype is the one every layer applies on use (the MoE router
    excepted: it computes in f32 from the stored weights), done once: a decode step then
    reads bf16 weights, not f32 master weights, and the copy costs half as much.
    """
    stacks = params["layers"]
    dtype = jnp.dtype(model_config.dtype)
    out, dense, moe, full, linear = [], 0, 0, 0, 0

    def at(tree, index):
        return jax.tree.map(lambda a: a[index].astype(dtype), tree)

    for i in range(model_config.num_layers):
        layer = {k: at(stacks[k], i) for k in ("input_norm", "post_attn_norm")}
        if model_config.is_linear_layer(i):
            # A_log / dt_bias / the norms stay as stored: the layer computes them in f32.
            layer["linear_attn"] = jax.tree.map(lambda a, j=linear: a[j], stacks["linear_attn"])
            linear += 1
        else:
            layer["attn"] = at(stacks["attn"], full)
            full += 1
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


def apply_layers_unrolled(cfg: ModelConfig, layer_params, x_BLD, cos, sin, attention, routing):
    """All layers in a Python loop, layer i's weights `layer_params[i]` (`split_layers`).

    For the decode step (kv_cache.py), whose cache is one buffer per layer: the context is
    called with the layer's index, reads and writes that layer's buffers only, and the
    cache entries come back as a tuple over layers. Scanning the decode step over stacked
    weights and a stacked cache made the sampler's XLA:CPU decode step slower (every step
    sliced each layer out of the stacks; docs/tpu.md, "Decoding at long responses");
    compile time is the differentiated pass's problem, which stays scanned.
    Returns (x_BLD, tuple of entries, routing [M, B, L, X])."""
    entries, routes = [], []
    moe = 0
    for i in range(cfg.num_layers):
        is_moe, is_linear = cfg.is_moe_layer(i), cfg.is_linear_layer(i)
        forced = routing[moe] if is_moe and routing is not None else None
        block = _merge_block(cfg, is_moe, layer_params[i], is_linear)
        context = _layer_context(attention, i, is_linear)
        x_BLD, entry, idx = block(x_BLD, cos, sin, context, forced)
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
