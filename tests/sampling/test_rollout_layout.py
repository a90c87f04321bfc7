"""Specification of the rollout's decode layout (`sampling.RolloutLayout`,
`sharding.ROLLOUT_RULES`, `sample(..., layout="tensor")`).

The tensor layout splits weights, KV heads and vocabulary over fsdp x tensor and keeps the
rows whole. It must change where values live, never which tokens are drawn: the references
are the same sampler on one device (tokens exactly, log-probs to the float rounding of the
tensor-parallel sums), and the compiled decode loop must move activations' partial sums
only, never a weight or the [rows, V] logits (read off the optimised HLO).
"""

import dataclasses
import functools
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax import models, sampling, sharding
from gspo_jax.models import partition
from gspo_jax.sampling import continuous, draw
from tools import hlo_stats

FIXTURES = Path(__file__).parents[1] / "fixtures" / "models"
BUCKET, T, G = 16, 12, 4
EOS = (229, 193)
TOL = 1e-5  # f32 log-probs: the tensor-parallel sums add in another order


def _mesh(n: int, **axes):
    sizes = {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1} | axes
    return sharding.make_mesh(sizes, jax.devices()[:n])


@pytest.fixture(scope="module")
def fixture_model():
    """The Qwen3 fixture (4 query heads on 2 kv heads, vocabulary 256) and 4 prompts."""
    cfg, params = models.load_pretrained(FIXTURES / "qwen3")
    ref = dict(np.load(FIXTURES / "reference_qwen3.npz"))
    tokens = np.zeros((4, BUCKET), np.int32)
    mask = np.zeros((4, BUCKET), np.int32)
    for n in range(3):
        row = ref["gen_prompt_tokens"][n][ref["gen_prompt_mask"][n] > 0]
        tokens[n, BUCKET - len(row) :], mask[n, BUCKET - len(row) :] = row, 1
    tokens[3, -11:], mask[3, -11:] = np.arange(40, 51), 1
    return cfg, params, tokens, mask


def _on_mesh(cfg, params, mesh):
    """`params` laid out as the trainer keeps them on `mesh` (FSDP)."""
    trainer = sharding.tree_shardings(
        jax.eval_shape(lambda: params), models.logical_axes(cfg), mesh
    )
    return jax.device_put(params, trainer)


def _sample(cfg, params, tokens, mask, **kw):
    return sampling.sample(
        cfg,
        params,
        tokens,
        mask,
        jax.random.key(7),
        num_samples=G,
        max_new_tokens=T,
        eos_ids=EOS,
        buckets=(BUCKET,),
        **kw,
    )


@pytest.mark.parametrize(
    "engine, axes",
    [
        ("continuous", {"fsdp": 2}),  # every weight and kv head split in two
        ("static", {"fsdp": 2}),
        # 4 query heads over 4 chips, the 2 kv heads over 2: GSPMD must still be right
        ("continuous", {"fsdp": 2, "tensor": 2}),
    ],
)
def test_the_tensor_layout_samples_what_one_device_samples(fixture_model, engine, axes):
    cfg, params, tokens, mask = fixture_model
    want = _sample(cfg, params, tokens, mask, engine=engine)
    mesh = _mesh(int(np.prod(list(axes.values()))), **axes)
    with jax.set_mesh(mesh):
        copy = sampling.RolloutLayout(cfg, mesh, "tensor")
        assert copy.layout == "tensor"
        rows = sharding.batch_sharding(mesh, 2)
        tok, msk = jax.device_put((tokens, mask), rows)
        rollout = copy(_on_mesh(cfg, params, mesh))
        got = _sample(cfg, rollout, tok, msk, engine=engine, layout="tensor")
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(want.lengths))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=TOL)
    np.testing.assert_array_equal(np.asarray(got.prompt_tokens), np.asarray(want.prompt_tokens))
    # Rows come back on the prompts' row layout (a multi-process loop reads its own rows).
    assert got.tokens.sharding.is_equivalent_to(tok.sharding, 2)
    assert got.prompt_tokens.sharding.is_equivalent_to(tok.sharding, 2)


def test_rollout_params_are_the_compute_dtype_in_the_decode_layout(fixture_model):
    """bf16 compute, f32 master weights: the copy is bf16, split over fsdp x tensor on its
    heads / MLP / vocabulary dimensions and never over `embed`; sampling from it draws
    exactly what sampling from the f32 master weights draws (the model casts each weight
    where it uses it)."""
    cfg, params, tokens, mask = fixture_model
    cfg16 = dataclasses.replace(cfg, dtype="bfloat16")
    mesh = _mesh(2, fsdp=2)
    with jax.set_mesh(mesh):
        copy = sampling.RolloutLayout(cfg16, mesh, "auto")
        assert copy.layout == "tensor"  # auto on a mesh without data / expert replicas
        rollout = copy(_on_mesh(cfg16, params, mesh))
    leaves = jax.tree_util.tree_leaves_with_path(rollout)
    axes = jax.tree.structure(rollout).flatten_up_to(models.logical_axes(cfg16))
    for (path, x), names in zip(leaves, axes, strict=True):
        where = jax.tree_util.keystr(path)
        assert x.dtype == jnp.bfloat16, where
        spec = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
        for name, dim, s in zip(names, x.shape, spec):
            if name == "embed" or name is None or name == "layers":
                assert s is None, (where, name, spec)
            elif dim % 2 == 0:
                assert s == "fsdp", (where, name, spec)
    want = jax.tree.map(lambda p: np.asarray(p.astype(jnp.bfloat16)), params)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, rollout), want)
    a = _sample(cfg16, params, tokens, mask)
    b = _sample(cfg16, jax.device_get(rollout), tokens, mask)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_array_equal(np.asarray(a.logprobs), np.asarray(b.logprobs))


def test_a_rollout_mesh_in_another_device_order_gets_the_copy(fixture_model):
    """On a TPU slice the rollout's own mesh orders the chips otherwise than the trainer's
    (groups of neighbours), and one jit cannot take inputs and outputs in two device
    orders: the copy is cast onto the rollout mesh's twin in the trainer's order, then its
    shards are moved (tools.aot compiled the 8B run into this error before). Here: the
    same 4 devices reversed."""
    cfg, params, _, _ = fixture_model
    cfg16 = dataclasses.replace(cfg, dtype="bfloat16")
    trainer = _mesh(4, fsdp=4)
    devices = np.asarray(jax.devices()[:4][::-1]).reshape(2, 1, 2, 1)
    auto = (jax.sharding.AxisType.Auto,) * 4
    own = jax.sharding.Mesh(devices, sharding.MESH_AXES, axis_types=auto)
    copy = sampling.RolloutLayout(cfg16, own, "tensor")
    rollout = copy(_on_mesh(cfg16, params, trainer))
    for x in jax.tree.leaves(rollout):
        assert x.sharding.mesh.devices.tolist() == own.devices.tolist()
    want = jax.tree.map(lambda p: np.asarray(p.astype(jnp.bfloat16)), params)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, rollout), want)


def test_the_moe_router_stays_float32():
    cfg, _ = models.load_pretrained(FIXTURES / "qwen3_moe")
    cfg = dataclasses.replace(cfg, dtype="bfloat16")
    out = jax.eval_shape(functools.partial(models.rollout_params, cfg), models.abstract_params(cfg))
    for path, x in jax.tree_util.tree_leaves_with_path(out):
        router = "router" in jax.tree_util.keystr(path)
        assert x.dtype == (jnp.float32 if router else jnp.bfloat16), jax.tree_util.keystr(path)


LOOP = 10**6  # stands for the engine loop's unknown trip count


def test_the_decode_loop_moves_no_weight_and_no_logits():
    """8 chips (fsdp 2 x tensor 4), a model whose every split divides: inside the engine's
    while_loop (one decoded token for every slot) the collectives are the tensor-parallel
    all-reduces of [slots, hidden] (two per layer), the embedding's, and row scalars of the
    draw and the log-prob (a row max, sums, the token) — nothing of a weight's size, nothing
    of [slots, V]. The trainer's layout on the same mesh moves more per token."""
    cfg = models.ModelConfig(
        arch="qwen3",
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,
        num_layers=2,
        num_heads=16,
        num_kv_heads=8,
        head_dim=16,
        max_position_embeddings=256,
        scan_layers=False,
    )
    mesh = _mesh(8, fsdp=2, tensor=4)
    N, P, S = 8, 16, 32
    trainer = sharding.tree_shardings(models.abstract_params(cfg), models.logical_axes(cfg), mesh)
    params = jax.jit(lambda: models.init_params(cfg, jax.random.key(0)), out_shardings=trainer)()
    tokens = np.random.default_rng(0).integers(1, 500, (N, P)).astype(np.int32)
    plan = continuous.plan(N * G, P, T, num_slots=S, page_size=8)

    def loop_collectives(layout, p):
        with jax.set_mesh(mesh):
            tok, msk = jax.device_put(
                (tokens, np.ones_like(tokens)), sharding.batch_sharding(mesh, 2)
            )
            pages, plen, logits, _, _ = continuous.prefill_pages(
                cfg, p, tok, msk, num_samples=G, share_prefix=True, page_size=8, layout=layout
            )
            text = (
                continuous.engine_loop.lower(
                    cfg,
                    p,
                    pages,
                    plen,
                    logits,
                    jax.random.key(1),
                    np.array(EOS, np.int32),
                    np.int32(0),
                    num_sequences=N * G,
                    max_new_tokens=T,
                    page_plan=plan,
                    temperature=1.0,
                    top_k=None,
                    top_p=None,
                    impl="xla",
                    drain_levels=0,
                    layout=layout,
                )
                .compile()
                .as_text()
            )
        found = hlo_stats.collectives(text, unknown_trip_count=LOOP)
        return [c for c in found if c.count >= LOOP]

    with jax.set_mesh(mesh):
        rollout = sampling.RolloutLayout(cfg, mesh, "tensor")(params)
    tensor = loop_collectives("tensor", rollout)
    D, V = cfg.hidden_size, cfg.vocab_size
    assert S == N * G
    assert max(c.bytes for c in tensor) <= S * D * 4, [(c.kind, c.shape) for c in tensor]
    assert not [c for c in tensor if c.kind in ("all-to-all", "reduce-scatter")]
    hidden = [c for c in tensor if c.kind == "all-reduce" and c.shape == f"f32[{S},{D}]"]
    assert len(hidden) == 2 * cfg.num_layers  # attention out and MLP down, per layer
    # Nothing the size of a weight, a page or the logits crosses chips per token.
    assert all(str(V) not in re.findall(r"\d+", c.shape) for c in tensor)
    assert all(c.bytes < S * V * 4 / 2 for c in tensor)
    trainer_bytes = sum(c.bytes for c in loop_collectives("trainer", params))
    assert sum(c.bytes for c in tensor) * 2 < trainer_bytes  # 85 kB against 238 kB here


def test_sharded_draws_are_the_one_slice_draw():
    """Vocabulary slices (the tensor layout's logits) locate u·Σp slice by slice: the same
    tokens as the unsliced search, and as an exact inverse CDF in float64, on logits with
    −inf entries (filtered tokens) and whole slices of them."""
    z = jax.random.normal(jax.random.key(0), (2048, 512)) * 3.0
    z = z.at[:, 100:300].set(-jnp.inf)  # slices 1-2 of 4 wholly or partly impossible
    u = jax.random.uniform(jax.random.key(1), (2048, 1))
    one = np.asarray(draw.draw_categorical(z, u_B1=u))
    p = np.exp(np.asarray(z, np.float64) - np.asarray(z).max(-1, keepdims=True))
    cdf = np.cumsum(p, -1)
    exact = (cdf <= np.asarray(u, np.float64) * cdf[:, -1:]).sum(-1)
    assert np.mean(one != exact) < 1e-3  # f32 rounding at a boundary, at most
    for shards in (2, 4, 8):
        np.testing.assert_array_equal(
            np.asarray(draw.draw_categorical(z, u_B1=u, shards=shards)), one
        )
    with pytest.raises(ValueError, match="divide the vocabulary"):
        draw.draw_categorical(z, u_B1=u, shards=3)


def test_layout_choices_and_errors(fixture_model):
    resolve = sharding.resolve_rollout_layout
    assert resolve("auto", {"fsdp": 8}) == "tensor"
    assert resolve("auto", {"fsdp": 4, "tensor": 2}) == "tensor"
    assert resolve("auto", {"data": 2, "fsdp": 4}) == "tensor"  # TP in a host, DP across
    assert resolve("auto", {"data": 8}) == "trainer"  # pure data parallelism
    assert resolve("auto", {"data": 4, "expert": 2}) == "trainer"
    assert resolve("auto", {}) == "trainer"  # one chip
    assert resolve("trainer", {"fsdp": 8}) == "trainer"
    # Qwen3-8B's 8 kv heads on 64 model-parallel chips: one replica per chip instead.
    assert resolve("auto", {"fsdp": 64}, kv_heads=8) == "trainer"
    assert resolve("auto", {"data": 16, "fsdp": 4}, kv_heads=8) == "tensor"
    assert resolve("tensor", {"fsdp": 64}, kv_heads=8) == "tensor"  # asked for: as asked
    with pytest.raises(ValueError, match="sampling.rollout_layout='rows'"):
        resolve("rows", {"fsdp": 8})
    cfg, params, tokens, mask = fixture_model
    with pytest.raises(ValueError, match="layout='diagonal'"):
        _sample(cfg, params, tokens, mask, layout="diagonal")
    # The rules a stage is traced under are scoped to its `layout` context.
    assert partition.active_rules() is sharding.LOGICAL_RULES
    with partition.layout(sharding.ROLLOUT_RULES):
        assert partition.active_rules() is sharding.ROLLOUT_RULES
    assert partition.active_rules() is sharding.LOGICAL_RULES
    # Inside a replica of the engine (manual over data): data indexes replicas, rows whole.
    inner = partition.without_axes(sharding.ROLLOUT_RULES, ("data",))
    assert inner["batch"] is None and inner["heads"] == ("fsdp", "tensor")
    inner = partition.without_axes(sharding.LOGICAL_RULES, ("data", "fsdp"))
    assert inner["batch"] is None and inner["embed"] is None and inner["heads"] == ("tensor",)


def test_replicas_divide_prompts_slots_and_pages():
    mesh = _mesh(8, data=2, fsdp=4)
    plan = continuous.plan(32, 16, 12, num_slots=32, page_size=4)  # 4 pages per sequence
    assert continuous.replica_axes(mesh, "trainer", 8, plan) == (
        ("data", "fsdp"),
        dataclasses.replace(plan, num_slots=4, num_pages=plan.num_pages // 8),
    )
    assert continuous.replica_axes(mesh, "tensor", 8, plan)[0] == ("data",)
    # 6 prompts: 8 replicas do not divide them, 2 do.
    assert continuous.replica_axes(mesh, "trainer", 6, plan)[0] == ("data",)
    # A KV budget of 2 sequences' pages cannot be split 8 ways (each replica needs one).
    small = continuous.plan(32, 16, 12, num_slots=32, page_size=4, kv_budget_tokens=2 * 5 * 4)
    assert continuous.replica_axes(mesh, "trainer", 8, small)[0] == ("data",)
    assert continuous.replica_axes(None, "trainer", 8, plan) == ((), plan)


@pytest.mark.parametrize(
    "axes, kv_dtype",
    [({"data": 4}, "auto"), ({"data": 2, "fsdp": 2}, "auto"), ({"data": 4}, "int8")],
    ids=["data 4", "data 2 x fsdp 2", "data 4, int8 KV"],
)
def test_engine_replicas_sample_what_one_device_samples(fixture_model, axes, kv_dtype):
    """The trainer's layout on a data (x fsdp) mesh: one engine per replica on its own
    prompts, slots and pages (fewer slots than sequences and a tight KV budget, so rows
    queue, wait and are preempted inside each replica): the one-device engine's tokens and
    log-probs (benchmarks/continuous_aot.py and the probe in docs/tpu.md read the loop's
    collectives: none on a data x fsdp mesh). int8 KV pages and their scales split over
    the replicas alike (the same samples up to a draw that rounding flips, below)."""
    cfg, params, tokens, mask = fixture_model
    kw = {"num_slots": 8, "page_size": 4, "kv_budget_tokens": 64, "kv_dtype": kv_dtype}
    want = _sample(cfg, params, tokens, mask, **kw)
    n = int(np.prod(list(axes.values())))
    mesh = _mesh(n, **axes)
    with jax.set_mesh(mesh):
        tok, msk = jax.device_put((tokens, mask), sharding.batch_sharding(mesh, 2))
        got = _sample(cfg, _on_mesh(cfg, params, mesh), tok, msk, **kw)
        kw.pop("kv_dtype")
        plan = continuous.plan(4 * G, BUCKET, T, **kw)
        assert continuous.replica_axes(partition.context_mesh(), "trainer", 4, plan)[0] == tuple(
            axes
        )
    assert got.tokens.sharding.is_equivalent_to(tok.sharding, 2)
    if kv_dtype == "int8":
        # Rounding that differs with the replica's shapes (2 slots, not 8) can move a key
        # or value across a rounding boundary of the quantisation: a whole int8 step, so a
        # draw may flip (measured: 1 of 16 sequences). The others are the one-device ones.
        same = np.all(np.asarray(got.tokens) == np.asarray(want.tokens), axis=1)
        assert same.mean() >= 0.9, same
        gap = np.abs(np.asarray(got.logprobs) - np.asarray(want.logprobs))[same]
        assert gap.max() < 0.05
        return
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(want.lengths))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=TOL)


def _run_config(data_dir, mesh: dict):
    from configs import default

    c = default.get_config()
    c.model.hf_path = str(FIXTURES / "qwen3")
    c.model.tokenizer_path = str(FIXTURES / "tokenizer")
    c.data.data_dir = str(data_dir)
    c.rollout_batch_size, c.num_return_sequences_in_group = 8, 4
    c.num_mini_batches = 4
    c.prompt_length, c.response_length = 24, 8
    c.sampling.prompt_buckets = (24,)
    c.reward.spec = c.reward.accuracy = "test_checksum"
    c.reward.num_workers = 0
    c.warm_start.steps = 0
    c.checkpoint.async_save = False
    c.log.progress_bar = c.log.plot = c.log.tensorboard = False
    for axis in ("data", "fsdp", "tensor", "expert"):
        c.mesh[axis] = mesh.get(axis, 1)
    return c


def _collect(workdir, config, devices):
    import gspo_jax.rewards.testing  # noqa: F401  (registers test_checksum)
    from gspo_jax.trainer import loop, setup

    trainer = setup.setup(config, str(workdir), devices=devices)
    try:
        with jax.set_mesh(trainer.mesh):
            state = loop.init_or_restore(trainer)
            # As after a train step: the key on the trainer's mesh (a rollout mesh of its
            # own must take it off: "Mesh for all inputs should be equal" otherwise).
            state = state.replace(rng=jax.device_put(state.rng, sharding.replicated(trainer.mesh)))
            out = trainer.rollouts.collect(state, next(trainer.train_iter))
            return out, trainer.rollouts.rollout_params
    finally:
        trainer.close()


def test_the_rl_loop_samples_from_its_rollout_copy(tmp_path):
    """A run on fsdp 2 (rollout_layout "auto" -> "tensor") makes the rollout copy once per
    step, logs the reshard's time and samples what the one-device run samples."""
    devices = jax.devices()
    data = tmp_path / "data"
    ref, none = _collect(tmp_path / "one", _run_config(data, {}), devices[:1])
    assert none is None  # one chip: the sampler reads the trainer's params
    got, copy = _collect(tmp_path / "tp", _run_config(data, {"fsdp": 2}), devices[:2])
    assert isinstance(copy, sampling.RolloutLayout) and copy.layout == "tensor"
    assert got.host_metrics["time/rollout_reshard_s"] > 0
    assert "time/rollout_reshard_s" not in ref.host_metrics
    np.testing.assert_array_equal(np.asarray(got.batch["tokens"]), np.asarray(ref.batch["tokens"]))
    np.testing.assert_allclose(
        np.asarray(got.batch["sampler_logprobs"]),
        np.asarray(ref.batch["sampler_logprobs"]),
        atol=TOL,
    )


@pytest.mark.parametrize("chips", [4, 2], ids=["2 replicas x tensor 2", "tensor 2"])
def test_a_rollout_mesh_of_its_own_samples_what_one_device_samples(tmp_path, chips):
    """`sampling.rollout_mesh.tensor=2` on a trainer mesh of fsdp 4 (2): the rollout runs on
    its own mesh of the same chips (2 replicas (1) x tensor groups of 2, "tensor" layout),
    the params resharded onto it once per step; the batch comes back on the trainer's mesh
    with the one-device run's tokens and log-probs."""
    devices = jax.devices()
    data = tmp_path / "data"
    ref, _ = _collect(tmp_path / "one", _run_config(data, {}), devices[:1])
    config = _run_config(data, {"fsdp": chips})
    config.sampling.rollout_mesh.tensor = 2
    got, copy = _collect(tmp_path / "own", config, devices[:chips])
    assert isinstance(copy, sampling.RolloutLayout) and copy.layout == "tensor"
    shape = {"data": chips // 2, "fsdp": 1, "tensor": 2, "expert": 1}
    assert dict(copy.mesh.shape) == shape
    assert got.host_metrics["time/rollout_reshard_s"] > 0
    tokens = got.batch["tokens"]
    assert dict(tokens.sharding.mesh.shape)["fsdp"] == chips  # back on the trainer's mesh
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(ref.batch["tokens"]))
    np.testing.assert_allclose(
        np.asarray(got.batch["sampler_logprobs"]),
        np.asarray(ref.batch["sampler_logprobs"]),
        atol=TOL,
    )


def test_a_rollout_mesh_must_divide_each_process_s_devices():
    from configs import default
    from gspo_jax.config.validate import ConfigError, validate

    c = default.get_config()
    c.sampling.rollout_mesh.tensor = 3
    with pytest.raises(ConfigError, match=r"rollout_mesh.tensor=3 does not divide the 8"):
        validate(c, num_devices=8)
    c.sampling.rollout_mesh.tensor = 2
    validate(c, num_devices=8)
    c.eval.batch_size = 64  # (a whole number of prompts per process)
    validate(c, num_devices=8, num_processes=2)  # groups of 2 within each process's 4
    c.sampling.rollout_mesh.tensor = 8
    with pytest.raises(ConfigError, match=r"tensor=8 does not divide the 4 devices of each of"):
        validate(c, num_devices=8, num_processes=2)
    with pytest.raises(ValueError, match=r"rollout_mesh.tensor=3 must be a positive int"):
        sampling.rollout_mesh(jax.devices(), 3)
    mesh = sampling.rollout_mesh(jax.devices(), 4)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 4, "expert": 1}
