"""Layouts read from the compiled programs: weights move, activations stay (issue 22).

On 8 fake CPU devices (the SPMD partitioner is XLA:TPU's), the functions the trainer and the
sampler jit — the train step, the log-prob pass, the prefill and one decode step — are
compiled for data x fsdp, fsdp, fsdp x tensor and an expert mesh (MoE), and their optimised
HLO is read with `sharding.hlo_stats`:

  * collective bytes (per device, loop bodies times their trip counts) within 1.5x of the
    layout's analytic count (`analytic_bytes`): FSDP gathers each weight once per use
    (forward; the scanned backward gathers the layer stack again) and reduces every gradient
    once; tensor parallelism all-reduces [rows, tokens, D] twice per layer per pass, plus
    the embedding lookup of a vocabulary-sharded table;
  * no collective carries a [rows, tokens, ...] activation except those tensor
    parallelism calls for (all-reduces of [rows, tokens, D], per-row log-prob reductions);
  * token ids (int32 [rows, tokens]) are never gathered.

The model is small enough to compile in seconds, with weights dominating the activations
(6.8 MB of f32 weights against 0.08-0.16 MB of [rows, tokens, D] residual per device),
and its sizes are chosen so that no weight dimension equals a token count: a collective's
shape then says whether it moves an activation. Every compiled program is built once per
module. The gathered bytes are checked on their own too: in this model the activations
are about the weights' size in all, so a layout that all-reduces activations instead of
gathering weights could pass the total alone (the old one did, for 10 of 16 programs).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding

from configs import default
from gspo_jax import models, sharding
from gspo_jax.config import specs
from gspo_jax.models import kv_cache, partition
from gspo_jax.train_step import StepConfig, batch_shardings, make_logprobs_fn, make_train_step
from gspo_jax.trainer import state as state_lib
from tools import hlo_parse, hlo_stats

DENSE = models.ModelConfig(
    arch="qwen3",
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    qk_norm=True,
)
MOE = models.ModelConfig(
    arch="qwen3_moe",
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    qk_norm=True,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=256,
    norm_topk_prob=True,
)
B, P, T = 16, 28, 12  # rows, prompt and response tokens: L = 40
L = P + T
CHUNK_POSITIONS = 3  # log-prob chunks of 3 positions: 4 iterations of the chunk loop
MESHES = {
    "data 2 x fsdp 4": (DENSE, {"data": 2, "fsdp": 4}),
    "fsdp 8": (DENSE, {"fsdp": 8}),
    "fsdp 4 x tensor 2": (DENSE, {"fsdp": 4, "tensor": 2}),
    "fsdp 4 x expert 2 (MoE)": (MOE, {"fsdp": 4, "expert": 2}),
}
FUNCTIONS = ("train step", "log-prob pass", "prefill", "decode step")


def _step_config(cfg, mesh) -> StepConfig:
    """One update of one micro-batch, π_old from the sampler: the step is one forward and
    backward of the whole batch (MoE models still run the π_old pass, for its routing).
    `logprob_chunk_size` counts tokens per device: CHUNK_POSITIONS x the device's rows."""
    rows = B // math.prod(mesh.shape[a] for a in sharding.BATCH_AXES)
    c = default.get_config()
    c.num_mini_batches, c.ppo_epochs, c.micro_batch_size = 1, 1, None
    c.old_logprobs_source, c.use_kl_loss, c.add_token_level_kl = "sampler", False, False
    c.response_length, c.shared_prompt = T, False
    c.logprob_chunk_size = CHUNK_POSITIONS * rows
    c.num_return_sequences_in_group, c.entropy_coef = 4, 0.0
    return specs.step_config(c, cfg)


def _sds(shape, dtype, sharding_):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding_)


def _mesh(sizes):
    return sharding.make_mesh({a: sizes.get(a, 1) for a in sharding.MESH_AXES})


def _param_shardings(cfg, mesh):
    return sharding.tree_shardings(models.abstract_params(cfg), models.logical_axes(cfg), mesh)


def _abstract_params(cfg, mesh):
    shardings = _param_shardings(cfg, mesh)
    return jax.tree.map(
        lambda a, s: _sds(a.shape, a.dtype, s), models.abstract_params(cfg), shardings
    )


def _rows(mesh, shape, dtype):
    return _sds(shape, dtype, sharding.batch_sharding(mesh, len(shape)))


def _compile_train_step(cfg, mesh):
    sc, tx = _step_config(cfg, mesh), optax.adamw(1e-3)
    abstract = models.abstract_params(cfg)
    shardings = state_lib.state_shardings(
        abstract, _param_shardings(cfg, mesh), tx, mesh, with_ref=False
    )
    shapes = jax.eval_shape(lambda p: state_lib.new_state(p, tx, 0, with_ref=False), abstract)
    train = jax.tree.map(lambda a, s: _sds(a.shape, a.dtype, s), shapes.train, shardings.train)
    ranks = {"tokens": (L, jnp.int32), "attention_mask": (L, jnp.int32)}
    ranks |= {"response_mask": (T, jnp.float32), "sampler_logprobs": (T, jnp.float32)}
    batch = {k: _rows(mesh, (B, n), d) for k, (n, d) in ranks.items()}
    batch["advantages"] = _rows(mesh, (B,), jnp.float32)
    assert set(batch) == set(batch_shardings(sc, mesh))
    step = make_train_step(sc, tx, state_shardings=shardings.train, mesh=mesh)
    return step.lower(train, batch).compile()


def _compile_logprobs(cfg, mesh):
    fn = make_logprobs_fn(_step_config(cfg, mesh))
    tokens, mask = _rows(mesh, (B, L), jnp.int32), _rows(mesh, (B, L), jnp.int32)
    return fn.lower(_abstract_params(cfg, mesh), tokens, mask, T).compile()


def _compile_prefill(cfg, mesh):
    tokens, mask = _rows(mesh, (B, P), jnp.int32), _rows(mesh, (B, P), jnp.int32)
    return kv_cache.prefill_shared.lower(cfg, _abstract_params(cfg, mesh), tokens, mask).compile()


def _cache_sds(mesh, shape, names, dtype):
    return _sds(shape, dtype, NamedSharding(mesh, partition.spec(mesh, names, shape)))


def _compile_decode(cfg, mesh):
    K, C, W = cfg.num_kv_heads, cfg.head_dim, T
    names = ("batch", "kv_heads", None, None)
    f32 = jnp.float32
    prompt = kv_cache.PromptCache(
        k=tuple(_cache_sds(mesh, (B, K, C, P), names, f32) for _ in range(cfg.num_layers)),
        v=tuple(_cache_sds(mesh, (B, K, P, C), names, f32) for _ in range(cfg.num_layers)),
        valid=_rows(mesh, (B, P), jnp.bool_),
        length=_rows(mesh, (B,), jnp.int32),
    )
    response = kv_cache.ResponseCache(
        k=tuple((_cache_sds(mesh, (B, K, C, W), names, f32),) for _ in range(cfg.num_layers)),
        v=tuple((_cache_sds(mesh, (B, K, W, C), names, f32),) for _ in range(cfg.num_layers)),
    )
    tokens = _rows(mesh, (B,), jnp.int32)
    slot = _sds((), jnp.int32, sharding.replicated(mesh))
    params = _abstract_params(cfg, mesh)
    return kv_cache.decode_step_shared.lower(cfg, params, prompt, response, tokens, slot).compile()


_COMPILERS = {
    "train step": _compile_train_step,
    "log-prob pass": _compile_logprobs,
    "prefill": _compile_prefill,
    "decode step": _compile_decode,
}


@functools.cache
def compiled_hlo(mesh_name: str, function: str) -> str:
    """The optimised HLO of `function` on `mesh_name`, traced under the mesh as the trainer
    traces it (loop.py: `jax.set_mesh`). Built once per process."""
    cfg, sizes = MESHES[mesh_name]
    mesh = _mesh(sizes)
    with jax.set_mesh(mesh):
        return _COMPILERS[function](cfg, mesh).as_text()


# ----------------------------------------------------------------------------- analytic count


def _itemsize(cfg) -> int:
    return jnp.dtype(cfg.param_dtype).itemsize


def analytic_bytes(cfg, sizes: dict[str, int], function: str) -> dict[str, int]:
    """Per-device collective bytes the layout calls for (hlo_stats' conventions: a gather
    counts the array each device ends with, a reduction the array reduced).

    weights gathered: every fsdp-sharded parameter, whole over fsdp (still split over
      tensor), once per use: the forward; in the train step the scanned layer stack once
      more for the backward (the output projection is the log-prob VJP's residual, the
      embedding's backward is a scatter; with tensor > 1 that backward gathers it whole
      over the vocabulary too, once before its loop). MoE experts come whole (per-device path: each
      device gets the layer's experts for its own tokens), twice in the train step, whose
      MoE π_old pass runs a forward of its own. A decode step keeps the experts split
      over `expert` (each chip runs its own on the step's tokens,
      `layers._experts_on_their_chips`) and gathers their fsdp shards: each device ends
      with its experts whole (in the sampler's loop, once before it: XLA hoists it).
    gradients reduced (train step): every parameter's gradient, as sharded by tensor.
    activations (tensor > 1): two all-reduces of the [rows, L, D] residual per layer per
      forward (attention and MLP outputs), two in the backward (the inputs' cotangents),
      and one for the lookup in the vocabulary-sharded embedding table.
    """
    tensor, fsdp = sizes.get("tensor", 1), sizes.get("fsdp", 1)
    rows = B // math.prod(sizes.get(a, 1) for a in sharding.BATCH_AXES)
    axes = models.logical_axes(cfg)
    train = function == "train step"
    forwards = 2 if train and cfg.num_moe_layers else 1  # MoE: the π_old pass too
    gathered = reduced = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(models.abstract_params(cfg)):
        names = functools.reduce(lambda t, k: t[k.key], path, axes)
        where = jax.tree_util.keystr(path)
        nbytes = math.prod(leaf.shape) * _itemsize(cfg)
        split = tensor if any(n in ("vocab", "heads", "kv_heads", "mlp") for n in names) else 1
        if "expert" in names:
            if function == "decode step":  # its own experts, whole over fsdp
                gathered += nbytes // sizes.get("expert", 1) if fsdp > 1 else 0
                continue
            split = 1  # gathered whole (per-device MoE)
        if train:
            reduced += nbytes // (tensor if split > 1 else 1)
        if "embed" not in names or fsdp == 1 and "expert" not in names:
            continue
        uses = forwards
        if train and "layers" in where:
            uses += forwards if "moe" in where else 1  # the backward's gather
        gathered += uses * nbytes // split
        if train and tensor > 1 and "lm_head" in where:
            gathered += nbytes  # the log-prob backward takes it whole, once
    activations = 0
    if tensor > 1:
        tokens = L if function != "prefill" else P
        if function == "decode step":
            tokens = 1
        residual = rows * tokens * cfg.hidden_size * 4
        per_pass = (2 * cfg.num_layers + 1) * residual
        activations = per_pass * (forwards + 1 if train else 1)
    return {"weights": gathered, "gradients": reduced, "activations": activations}


# ----------------------------------------------------------------------------- reading the HLO


def _dims(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    return [
        (d, tuple(int(x) for x in dims.split(",") if x))
        for d, dims in hlo_parse._ARRAY.findall(shape)
    ]


def _token_dims(sizes) -> set[int]:
    """Sizes a dimension of a [rows, tokens, ...] activation takes here (whole, per device,
    flattened rows x tokens); none of them is a weight dimension of the models."""
    n = math.prod(sizes.get(a, 1) for a in sharding.BATCH_AXES)
    lengths = {L, P, T, L - 1, CHUNK_POSITIONS}
    return lengths | {r * t for r in (B, B // n) for t in lengths}


def activation_collectives(hlo: str, sizes, cfg, allowed_tensor: bool) -> list:
    """Collectives moving a [rows, tokens, ...] array, except tensor parallelism's
    all-reduces of [rows, tokens, D] and of per-row values (at most one per token).
    Collectives over groups of one device move nothing and are skipped."""
    tokens = _token_dims(sizes)
    per_device = B * L // math.prod(sizes.get(a, 1) for a in sharding.BATCH_AXES)
    bad = []
    for c in hlo_stats.collectives(hlo):
        if c.group_size == 1:
            continue
        for _, dims in _dims(c.shape):
            if len(dims) < 2 or not tokens & set(dims):
                continue
            tp_ok = allowed_tensor and c.kind == "all-reduce"
            if tp_ok and (dims[-1] == cfg.hidden_size or math.prod(dims) <= per_device):
                continue
            bad.append(c)
            break
    return bad


def _measured(hlo: str) -> dict[str, int]:
    return {k: v for k, v in hlo_stats.collective_bytes(hlo).items() if v}


@pytest.mark.parametrize("function", FUNCTIONS)
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_collective_bytes_are_the_layouts(mesh_name, function):
    cfg, sizes = MESHES[mesh_name]
    hlo = compiled_hlo(mesh_name, function)
    measured = _measured(hlo)
    want = analytic_bytes(cfg, sizes, function)
    total, expected = sum(measured.values()), sum(want.values())
    top = sorted(hlo_stats.collectives(hlo), key=lambda c: -c.bytes * c.count)[:6]
    detail = f"{mesh_name}, {function}: measured {measured}, analytic {want}; top: " + "; ".join(
        f"{c.kind} {c.shape} x{c.count}" for c in top
    )
    print(detail)
    assert expected / 1.5 <= total <= 1.5 * expected, detail
    # ... and weights are what is gathered (not activations reduced in their place).
    gathered = measured.get("all-gather", 0)
    assert want["weights"] / 1.5 <= gathered <= 1.5 * want["weights"], detail


@pytest.mark.parametrize("function", FUNCTIONS)
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_no_activation_moves_unless_the_layout_says_so(mesh_name, function):
    cfg, sizes = MESHES[mesh_name]
    hlo = compiled_hlo(mesh_name, function)
    bad = activation_collectives(hlo, sizes, cfg, allowed_tensor=sizes.get("tensor", 1) > 1)
    assert not bad, [f"{c.kind} {c.shape} x{c.count} in {c.computation}" for c in bad]
    gathered_ids = [
        c
        for c in hlo_stats.collectives(hlo)
        if c.kind in ("all-gather", "all-to-all", "collective-permute")
        and any(d == "s32" and _token_dims(sizes) & set(s) for d, s in _dims(c.shape))
    ]
    assert not gathered_ids, [f"{c.kind} {c.shape}" for c in gathered_ids]


@pytest.mark.parametrize("mesh_name", MESHES)
def test_log_prob_chunks_count_tokens_per_device(mesh_name):
    """`logprob_chunk_size` is tokens per device: CHUNK_POSITIONS x each device's rows give
    chunks of CHUNK_POSITIONS positions on every mesh, so the forward's chunk loop runs
    T / CHUNK_POSITIONS times. (Counted globally, it was 1-position chunks, T iterations,
    each re-reading the whole unembedding.)"""
    trips = hlo_stats.while_trip_counts(compiled_hlo(mesh_name, "log-prob pass"))
    assert T // CHUNK_POSITIONS in trips.values(), trips
    assert T not in trips.values(), trips


def test_row_shards_counts_the_batch_axes_that_divide_the_rows():
    assert partition.row_shards(16) == 1  # no mesh in context
    with jax.set_mesh(_mesh({"data": 2, "fsdp": 4})):
        assert partition.row_shards(16) == 8
        assert partition.row_shards(4) == 2  # fsdp 4 does not divide the 2 rows data leaves
        assert partition.row_shards(3) == 1
    with jax.set_mesh(_mesh({"fsdp": 4, "tensor": 2})):
        assert partition.row_shards(16) == 4  # tensor does not split rows


def test_the_reader_sees_a_moved_activation():
    """The checks can fail: a program that gathers the batch's rows is caught."""
    mesh = _mesh({"fsdp": 8})
    x = _rows(mesh, (B, L, DENSE.hidden_size), jnp.float32)
    fn = jax.jit(lambda x: x * 2, out_shardings=sharding.replicated(mesh))
    hlo = fn.lower(x).compile().as_text()
    bad = activation_collectives(hlo, {"fsdp": 8}, DENSE, allowed_tensor=False)
    assert [c.kind for c in bad] == ["all-gather"]
    assert bad[0].bytes == B * L * DENSE.hidden_size * 4


def test_analytic_count_by_hand():
    # Per layer: q, o 256x256; k, v 256x128; gate, up, down 256x512: 589,824 f32 weights.
    layer, table = 589_824 * 4, 1024 * 256 * 4
    prefill = analytic_bytes(DENSE, {"fsdp": 8}, "prefill")
    assert prefill == {"weights": 2 * layer + 2 * table, "gradients": 0, "activations": 0}
    train = analytic_bytes(DENSE, {"data": 2, "fsdp": 4}, "train step")
    norms = (2 * 256 + 2 * 64) * 2 * 4 + 256 * 4  # two per layer, two per head, final
    assert train == {
        "weights": 2 * 2 * layer + 2 * table,
        "gradients": 2 * layer + 2 * table + norms,
        "activations": 0,
    }
    tp = analytic_bytes(DENSE, {"fsdp": 4, "tensor": 2}, "log-prob pass")
    assert tp["weights"] == (2 * layer + 2 * table) // 2  # q/k/v/o, MLP, tables: all split
    assert tp["activations"] == 5 * (16 // 4) * 40 * 256 * 4


def test_the_samplers_decode_loop_gathers_the_weights_once():
    """The static sampler's whole decode (`static.decode`: T tokens in a while_loop) under
    fsdp 8 gathers each weight once, before its loop (`models.for_decoding`), not once per
    token: all-gathered bytes, loop trip counts included, stay within 1.5x of one decode
    step's weights (per-token gathers would be T = 12 times that)."""
    from gspo_jax.sampling import static

    cfg, sizes = MESHES["fsdp 8"]
    mesh = _mesh(sizes)
    with jax.set_mesh(mesh):
        init = jax.jit(
            models.init_params, static_argnums=0, out_shardings=_param_shardings(cfg, mesh)
        )
        params = init(cfg, jax.random.key(0))
        tokens = jnp.ones((B // 2, P), jnp.int32)
        prompt, state, logits, _, _ = static.prefill(
            cfg,
            params,
            tokens,
            tokens,
            jax.random.key(1),
            num_samples=2,
            share_prefix=True,
            max_new_tokens=T,
        )
        eos = jnp.array([1], jnp.int32)
        lowered = static.decode.lower(
            cfg, params, prompt, state, logits, eos, 0, temperature=1.0, top_k=None, top_p=None
        )
        hlo = lowered.compile().as_text()
    gathered = hlo_stats.collective_bytes(hlo).get("all-gather", 0)
    weights = analytic_bytes(cfg, sizes, "decode step")["weights"]
    assert 0 < gathered <= 1.5 * weights, (gathered, weights)
