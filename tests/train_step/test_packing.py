"""Packed sequences (`config.packing`, train_step/packing.py): the placement by hand; per-token
log-probs and entropies equal the padded pass's and each sequence's computed alone (a
length-1 response packed next to one of response_length); the loss, every metric and the
gradient equal the padded step's for every ratio, aggregation and loss mode, with
micro-batches, shared prompts, rollout correction, OPSM, KL and entropy; the whole step
through `make_train_step` (buckets), on 8-device meshes; MoE with Routing Replay (one
device, and the whole step on fsdp 2 x expert 2 x tensor 2); the
splash kernel with segment ids (Pallas interpret mode); π_ref's log-prob pass packed
(make_logprobs_fn); Qwen3.5's Gated DeltaNet packed (each sequence as alone, the step as
padded); the default rule (packing=None: on from 64 response tokens)."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import base as base_config
from gspo_jax import models, sharding
from gspo_jax.config import specs, validate
from gspo_jax.config.errors import ConfigError
from gspo_jax.config.specs import step_config
from gspo_jax.train_step import TrainState, make_logprobs_fn, make_train_step, packing
from gspo_jax.train_step import jitted as jitted_lib
from gspo_jax.train_step import step as step_lib

FIXTURE = "tests/fixtures/models/qwen2"
MOE_FIXTURE = "tests/fixtures/models/qwen3_moe"
HYBRID_FIXTURE = "tests/fixtures/models/qwen35"
N, G, P, T = 2, 4, 6, 5
B, L = N * G, P + T
LENGTHS = np.array([T, 1, 3, T, 2, T, 4, 1])  # a length-1 response beside full-length ones
PACK = 2 * L  # two rollout rows' worth of tokens per packed row


@pytest.fixture(scope="module")
def model():
    return models.load_pretrained(FIXTURE)


def _rows(vocab, seed=0, lengths=LENGTHS):
    """N left-padded prompts (prompt 0 two tokens short), G responses each (right padded)."""
    rng = np.random.default_rng(seed)
    prompt_NP = rng.integers(3, vocab, (N, P)).astype(np.int32)
    prompt_mask_NP = np.ones((N, P), np.int32)
    prompt_mask_NP[0, :2], prompt_NP[0, :2] = 0, 0
    response_BT = rng.integers(3, vocab, (B, T)).astype(np.int32)
    response_mask_BT = (np.arange(T)[None] < lengths[:, None]).astype(np.int32)
    tokens_BL = np.concatenate([np.repeat(prompt_NP, G, 0), response_BT], 1)
    mask_BL = np.concatenate([np.repeat(prompt_mask_NP, G, 0), response_mask_BT], 1)
    return tokens_BL, mask_BL


def _sc(cfg, **overrides):
    sc = step_config(base_config.get_config(), cfg)
    overrides = {"shared_prompt": True, "packing": False, **overrides}  # padded unless asked
    return dataclasses.replace(sc, group_size=G, horizon=T, **overrides)


def _packed(sc, mask_BL, *, length=PACK):
    """`sc` packed into rows of `length`, with the rows `make_train_step` would compile."""
    sc = dataclasses.replace(sc, packing=True, pack_length=length)
    mini = B // sc.num_mini_batches
    micro, group = step_lib._micro_batching(sc, mini)
    splits = sc.num_mini_batches * micro
    needed, contiguous = packing.rows_needed(sc, jnp.asarray(mask_BL), T, splits, group)
    assert bool(contiguous)
    return dataclasses.replace(sc, pack_rows=packing.bucket_rows(int(needed), B // splits))


# ---------------------------------------------------------------------- placement by hand


def test_first_fit_decreasing_placement_by_hand():
    """Rows of 10, prompts of 2 real tokens, responses of 5, 1, 7, 3 (rows b0 … b3), placed
    longest first: b2 (9 tokens) -> row 0, b0 (7) -> row 1, b3 (5) -> row 2 (fits neither),
    b1 (3) -> row 1; segment ids in placement order."""
    P_, T_ = 3, 7
    lengths = np.array([5, 1, 7, 3])
    mask = np.concatenate(
        [np.tile([0, 1, 1], (4, 1)), (np.arange(T_)[None] < lengths[:, None])], 1
    ).astype(np.int32)
    tokens = np.arange(4 * (P_ + T_), dtype=np.int32).reshape(4, P_ + T_) + 1
    lay = packing.layout(jnp.asarray(tokens), jnp.asarray(mask), P_, group=1, rows=4, length=10)
    assert int(lay.rows_used) == 3 and bool(lay.fits)
    seg = np.asarray(lay.segment_RL)
    np.testing.assert_array_equal(seg[0], [1] * 9 + [0])
    np.testing.assert_array_equal(seg[1], [2] * 7 + [4] * 3)
    np.testing.assert_array_equal(seg[2], [3] * 5 + [0] * 5)
    np.testing.assert_array_equal(seg[3], [0] * 10)
    # each token at its own unpacked position, members 0 (prompt) / b + 1 (response b)
    np.testing.assert_array_equal(np.asarray(lay.positions_RL)[1], [0, 1, 2, 3, 4, 5, 6, 0, 1, 2])
    np.testing.assert_array_equal(np.asarray(lay.member_RL)[1], [0, 0, 1, 1, 1, 1, 1, 0, 0, 2])
    np.testing.assert_array_equal(np.asarray(lay.tokens_RL)[1, 7:], tokens[1, 1:4])
    np.testing.assert_array_equal(
        np.asarray(lay.dst_BL)[1], [40, 17, 18, 19, 40, 40, 40, 40, 40, 40]
    )
    # shared prompts (group 2: b0 b1, b2 b3): b3 does not fit b2's segment (row 0) and opens
    # one of its own in row 2; b1 joins b0's in row 1, after b0's response
    lay = packing.layout(jnp.asarray(tokens), jnp.asarray(mask), P_, group=2, rows=4, length=10)
    np.testing.assert_array_equal(np.asarray(lay.segment_RL)[1], [2] * 8 + [0] * 2)
    np.testing.assert_array_equal(np.asarray(lay.member_RL)[1, :8], [0, 0, 1, 1, 1, 1, 1, 2])
    np.testing.assert_array_equal(np.asarray(lay.positions_RL)[1, :8], [0, 1, 2, 3, 4, 5, 6, 2])
    assert int(lay.rows_used) == 3


def test_buckets():
    assert packing.bucket_sizes(16) == list(range(1, 17))
    sizes = packing.bucket_sizes(64)
    assert sizes[-8:] == [35, 39, 42, 46, 50, 54, 59, 64]  # 64 · 2^(-k/8), rounded up
    assert all(b <= a * 2 ** (1 / 8) + 1 for a, b in itertools.pairwise(sizes))
    assert packing.bucket_sizes(8, shards=4) == [4, 8]
    assert packing.bucket_sizes(2, shards=8) == [1, 2]  # fewer rows than devices: no rounding
    assert packing.bucket_rows(9, 64) == 9 and packing.bucket_rows(17, 64) == 18
    assert packing.bucket_rows(3, 8, shards=4) == 4


def test_pack_length_is_validated():
    c = base_config.get_config()
    c.pack_length = c.prompt_length + c.response_length - 1
    with pytest.raises(ConfigError, match="pack_length"):
        validate.validate(c)
    c.pack_length = -1
    with pytest.raises(ConfigError, match="pack_length"):
        validate.validate(c)


def test_packing_none_packs_long_responses_only():
    """packing=None (the default): on from PACKING_MIN_RESPONSE_LENGTH response tokens, so
    configs/default.py's 16-token answers stay padded; True / False as set."""
    from configs import default

    c = base_config.get_config()
    assert c.packing is None
    c.response_length = specs.PACKING_MIN_RESPONSE_LENGTH
    assert specs.packing_on(c)
    c.response_length -= 1
    assert not specs.packing_on(c)
    c.packing = True
    assert specs.packing_on(c)
    assert not specs.packing_on(default.get_config())


# ------------------------------------------------------------------ per-token equality


@pytest.mark.parametrize("group", [1, G])
def test_logprobs_equal_the_padded_pass(model, group):
    cfg, params = model
    tokens_BL, mask_BL = _rows(cfg.vocab_size)
    plain = _sc(cfg, shared_prompt=False)
    ref = step_lib.response_logprobs(plain, params, tokens_BL, mask_BL, T)
    sc = _packed(plain, mask_BL)
    sc = dataclasses.replace(sc, pack_rows=int(packing.rows_needed(sc, mask_BL, T, 1, group)[0]))
    assert sc.pack_rows <= B // 2  # several sequences per packed row
    out = jax.jit(lambda p: step_lib.response_logprobs(sc, p, tokens_BL, mask_BL, T, group=group))(
        params
    )
    real = mask_BL[:, P:].astype(bool)
    for a, b in zip(out[:2], ref[:2]):
        np.testing.assert_allclose(np.asarray(a)[real], np.asarray(b)[real], atol=5e-6)
        assert np.all(np.asarray(a)[~real] == 0)


def test_the_reference_logprob_pass_packs_too(model):
    """make_logprobs_fn (π_ref's pass) with packing: the whole batch in fewer packed rows,
    the same log-probs and entropies as the padded pass; full-length rows run it padded."""
    cfg, params = model
    tokens_BL, mask_BL = _rows(cfg.vocab_size, seed=1)
    sc = _sc(cfg)
    packed_sc = dataclasses.replace(sc, packing=True, pack_length=PACK)
    rows = jitted_lib.packed_rows(packed_sc, mask_BL, T, 1, step_lib.shared_group(sc, 1), 1)
    assert 0 < rows < B
    full_BL = mask_BL.copy()
    full_BL[:, P:] = 1
    assert jitted_lib.packed_rows(packed_sc, full_BL, T, 1, G, 1) == 0
    got = make_logprobs_fn(packed_sc)(params, tokens_BL, mask_BL, T)
    want = make_logprobs_fn(sc)(params, tokens_BL, mask_BL, T)
    real = mask_BL[:, P:].astype(bool)
    for a, b in zip(got[:2], want[:2]):
        np.testing.assert_allclose(np.asarray(a)[real], np.asarray(b)[real], atol=5e-6)
        assert np.all(np.asarray(a)[~real] == 0)


def test_short_and_long_responses_packed_together_equal_each_alone(model):
    """A length-1 response, one of response_length and one between, in one packed row with
    their prompts: each token's log-prob and entropy equal its sequence run by itself."""
    cfg, params = model
    tokens_BL, mask_BL = _rows(cfg.vocab_size, seed=3)
    pick = [1, 0, 2]  # lengths 1, T, 3 (all of prompt 0, left padded)
    tokens_BL, mask_BL = tokens_BL[pick], mask_BL[pick]
    sc = dataclasses.replace(_sc(cfg, shared_prompt=False), packing=True, pack_length=3 * L)
    sc = dataclasses.replace(sc, pack_rows=1)
    assert int(packing.rows_needed(sc, mask_BL, T, 1, 1)[0]) == 1
    packed = step_lib.response_logprobs(sc, params, tokens_BL, mask_BL, T)
    plain = dataclasses.replace(sc, packing=False)
    for b in range(3):
        alone = step_lib.response_logprobs(
            plain, params, tokens_BL[b : b + 1], mask_BL[b : b + 1], T
        )
        real = mask_BL[b, P:].astype(bool)
        for a, want in zip(packed[:2], alone[:2]):
            np.testing.assert_allclose(np.asarray(a)[b][real], np.asarray(want)[0][real], atol=5e-6)


# ------------------------------------------------------------- loss and gradient equality

CASES = [  # every ratio, aggregation and loss mode at least once; micro-batches in some
    {"importance_sampling": "seq", "loss_agg_mode": "seq-mean-token-mean", "loss_mode": "clip"},
    {
        "importance_sampling": "token",
        "loss_agg_mode": "token-mean",
        "loss_mode": "sapo",
        "micro_batch_size": 4,
    },
    {
        "importance_sampling": "seq_token",
        "loss_agg_mode": "seq-mean-token-sum",
        "loss_mode": "cispo",
    },
    {
        "importance_sampling": "token",
        "loss_agg_mode": "seq-mean-token-sum-norm",
        "loss_mode": "gmpo",
        "micro_batch_size": 2,
    },
    {"importance_sampling": "token", "loss_agg_mode": "token-mean", "loss_mode": "dppo_tv"},
    {"importance_sampling": "seq", "loss_agg_mode": "seq-mean-token-mean", "loss_mode": "dppo_kl"},
    {  # sequence-level rollout correction, OPSM, KL and entropy in the loss
        "importance_sampling": "seq",
        "loss_agg_mode": "seq-mean-token-mean",
        "loss_mode": "clip",
        "rollout_correction": "tis",
        "rollout_correction_level": "seq",
        "opsm_delta": 1e-3,
        "use_kl_loss": True,
        "kl_estimator": "k3",
        "entropy_coef": 0.01,
        "micro_batch_size": 4,
    },
]


def _mini_batch(cfg, params, seed):
    tokens_BL, mask_BL = _rows(cfg.vocab_size, seed=seed)
    plain = _sc(cfg, shared_prompt=False)
    logp_BT = step_lib.response_logprobs(plain, params, tokens_BL, mask_BL, T)[0]
    rng = np.random.default_rng(seed + 1)
    noise = lambda s: jnp.asarray(rng.normal(0, s, (B, T)), jnp.float32)
    return {
        "tokens": jnp.asarray(tokens_BL),
        "attention_mask": jnp.asarray(mask_BL),
        "response_mask": jnp.asarray(mask_BL[:, P:], jnp.float32),
        # π_old off the current policy, so ratios leave 1 and the clip acts on some rows
        "old_logprobs": logp_BT + noise(0.3),
        "sampler_logprobs": logp_BT + noise(0.1),
        "ref_logprobs": logp_BT + noise(0.2),
        "advantages": jnp.asarray(rng.normal(size=B), jnp.float32),
    }


def _grads(sc, params, batch):
    return jax.jit(step_lib._mini_batch_grads, static_argnums=0)(sc, params, batch)


def _assert_same_grads(got, want, rel=1e-5):
    largest = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(want))
    assert largest > 1e-3  # a real gradient, not zeros on both sides
    paths = jax.tree_util.tree_flatten_with_path(want)[0]
    for (path, a), b in zip(paths, jax.tree.leaves(got)):
        np.testing.assert_allclose(b, a, atol=rel * largest, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"{c['importance_sampling']}-{c['loss_mode']}"
)
def test_loss_metrics_and_gradients_equal_the_padded_step(model, case):
    cfg, params = model
    batch = _mini_batch(cfg, params, seed=len(case))
    sc = _sc(cfg, num_mini_batches=1, **case)
    packed = _packed(sc, batch["attention_mask"])
    assert packed.pack_rows < B  # fewer rows than the padded micro-batch
    got_grads, got = _grads(packed, params, batch)
    want_grads, want = _grads(sc, params, batch)
    assert set(got) == set(want)
    for key in want:
        # gap_*: |log π − the sampler's|, summed per token: f32 noise relative to its size
        np.testing.assert_allclose(got[key], want[key], rtol=2e-5, atol=2e-6, err_msg=key)
    _assert_same_grads(got_grads, want_grads)


# ---------------------------------------------------------------- the whole step, meshes


def _whole_batch(cfg, params):
    batch = _mini_batch(cfg, params, seed=7)
    del batch["old_logprobs"], batch["ref_logprobs"]
    return batch


def _state(params, tx):
    params = jax.tree.map(jnp.copy, params)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def _mesh_step(sc, tx, cfg, mesh):
    abstract = models.abstract_params(cfg)
    p_shard = sharding.tree_shardings(abstract, models.logical_axes(cfg), mesh)
    shardings = TrainState(
        step=sharding.replicated(mesh),
        params=p_shard,
        opt_state=sharding.optimizer_state_shardings(tx, abstract, p_shard, mesh),
    )
    fn = make_train_step(sc, tx, state_shardings=shardings, mesh=mesh, donate=False)
    return fn, shardings


def test_whole_step_packed_equals_padded_one_device_and_8_devices(model):
    """make_train_step with packing (2 mini-batches x 2 micro-batches, π_old recomputed) on
    one device, on data 4 x fsdp 2 and on data 2 x fsdp 2 x tensor 2 equals the padded step
    on one device: params after two AdamW updates and the step's metrics."""
    import optax

    cfg, params = model
    batch = _whole_batch(cfg, params)
    tx = optax.adam(1e-3)
    sc = _sc(cfg, num_mini_batches=2, micro_batch_size=2, importance_sampling="seq")
    want_state, want = make_train_step(sc, tx, donate=False)(_state(params, tx), batch)
    packed_sc = _packed(sc, batch["attention_mask"])
    assert packed_sc.pack_rows == 1  # each micro-batch's 2 responses in one packed row
    got_state, got = make_train_step(packed_sc, tx, donate=False)(_state(params, tx), batch)
    runs = [(got_state, got)]
    for sizes in ({"data": 4, "fsdp": 2}, {"data": 2, "fsdp": 2, "tensor": 2}):
        mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1, "expert": 1, **sizes})
        fn, shardings = _mesh_step(packed_sc, tx, cfg, mesh)
        runs.append(
            fn(
                jax.device_put(_state(params, tx), shardings),
                jax.device_put(batch, sharding.batch_shardings(mesh, batch)),
            )
        )
    for other_state, other in runs:
        for key in ("loss", "pg_loss", "clipfrac", "grad_norm", "entropy", "ratio_noise_floor"):
            np.testing.assert_allclose(other[key], want[key], rtol=1e-4, atol=1e-6, err_msg=key)
        for a, b in zip(jax.tree.leaves(other_state.params), jax.tree.leaves(want_state.params)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_the_step_packs_only_when_it_computes_fewer_tokens(model):
    """`PackedStep` (pack_rows None) picks its bucket per batch; a batch of full-length
    responses packs no better than the padded layout, so it runs the padded step (rows 0)."""
    import optax

    cfg, params = model
    sc = _sc(cfg, num_mini_batches=1, packing=True, pack_length=4 * L)
    step = make_train_step(sc, optax.sgd(0.0), donate=False)
    ragged = _whole_batch(cfg, params)
    assert 0 < step.rows(ragged) < B
    full = dict(ragged, attention_mask=ragged["attention_mask"].at[:, P:].set(1))
    assert step.rows(full) == 0
    bad = dict(ragged, attention_mask=ragged["attention_mask"].at[0, P + 1].set(0))
    with pytest.raises(ValueError, match="contiguous"):
        step.rows(bad)


def test_hybrid_deltanet_packed_equals_each_alone_and_the_padded_step():
    """Qwen3.5 (Gated DeltaNet layers, chunks of 4 so segment starts fall inside and on
    chunk edges): a packed row of three sequences (responses of 1, T and 3 tokens) gives
    each token the log-prob and entropy of its sequence alone (the padded pass: a row per
    sequence); the packed mini-batch's loss, metrics and gradient equal the padded one's."""
    cfg, params = models.load_pretrained(HYBRID_FIXTURE)
    cfg = dataclasses.replace(cfg, deltanet_chunk_size=4)
    tokens_BL, mask_BL = _rows(cfg.vocab_size, seed=3)
    pick = [1, 0, 2]  # lengths 1, T, 3
    sc = _sc(cfg, use_kl_loss=True, entropy_coef=0.01, num_mini_batches=1)
    assert step_lib.shared_group(sc, 1) == 1  # hybrid: a prompt per response
    row = dataclasses.replace(sc, packing=True, pack_length=3 * L, pack_rows=1)
    fn = jax.jit(lambda s, p, t, m: step_lib.response_logprobs(s, p, t, m, T), static_argnums=0)
    packed = fn(row, params, tokens_BL[pick], mask_BL[pick])
    alone = fn(sc, params, tokens_BL[pick], mask_BL[pick])
    real = mask_BL[pick, P:].astype(bool)
    # f32 rounding: the segments start at other chunk offsets than alone (log-probs up to
    # ~9 here, 1 ulp ~1e-6; measured 6.7e-6 at the tests' -O0, the blocked chunk solve)
    for a, want in zip(packed[:2], alone[:2]):
        np.testing.assert_allclose(np.asarray(a)[real], np.asarray(want)[real], atol=1e-5)
    batch = _mini_batch(cfg, params, seed=13)
    packed_sc = _packed(sc, batch["attention_mask"])
    assert packed_sc.pack_rows < B
    got_grads, got = _grads(packed_sc, params, batch)
    want_grads, want = _grads(sc, params, batch)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=2e-5, atol=2e-6, err_msg=key)
    _assert_same_grads(got_grads, want_grads)


# ----------------------------------------------------------------------- MoE, replay


def test_moe_routing_replay_packed_equals_padded():
    """Qwen3-MoE with Routing Replay: the π_old pass's routing comes back to each token's
    unpacked place, and the replayed gradient equals the padded one's."""
    cfg, params = models.load_pretrained(MOE_FIXTURE)
    batch = _mini_batch(cfg, params, seed=11)
    sc = _sc(cfg, num_mini_batches=1, routing_replay=True, importance_sampling="token")
    packed = _packed(sc, batch["attention_mask"])
    assert step_lib.shared_group(packed, 1) == 1  # MoE: a prompt per response
    outs = []
    for s in (sc, packed):
        logp, _, routing = jax.jit(
            lambda p, s=s: step_lib.response_logprobs(
                s, p, batch["tokens"], batch["attention_mask"], T
            )
        )(params)
        outs.append((logp, routing))
    real_BL = np.asarray(batch["attention_mask"], bool)
    np.testing.assert_array_equal(
        np.asarray(outs[1][1])[:, real_BL], np.asarray(outs[0][1])[:, real_BL]
    )
    mb = {**batch, "old_logprobs": outs[0][0], "old_routing": jnp.moveaxis(outs[0][1], 0, 1)}
    got_grads, got = _grads(packed, params, mb)
    want_grads, want = _grads(sc, params, mb)
    for key in ("loss", "experts_changed", "experts_total", "expert_change"):
        if key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=2e-5, atol=2e-6, err_msg=key)
    _assert_same_grads(got_grads, want_grads)


def test_splash_segment_ids_equal_the_padded_pass(model):
    """attention_impl="splash" (Pallas interpret mode on CPU): packed rows attend through the
    kernel's segment ids (one response per segment), per-token log-probs as the padded
    einsum pass's."""
    cfg, params = model
    tokens_BL, mask_BL = _rows(cfg.vocab_size, seed=5)
    plain = _sc(cfg, shared_prompt=False)
    ref = step_lib.response_logprobs(plain, params, tokens_BL, mask_BL, T)
    splash = dataclasses.replace(cfg, attention_impl="splash")
    sc = _packed(dataclasses.replace(plain, model=splash, num_mini_batches=1), mask_BL)
    assert step_lib.shared_group(dataclasses.replace(sc, shared_prompt=True), 1) == 1
    assert 1 < sc.pack_rows < B
    out = jax.jit(lambda p: step_lib.response_logprobs(sc, p, tokens_BL, mask_BL, T))(params)
    real = mask_BL[:, P:].astype(bool)
    np.testing.assert_allclose(np.asarray(out[0])[real], np.asarray(ref[0])[real], atol=2e-5)


def test_moe_replay_whole_step_packed_on_the_expert_mesh():
    """Qwen3-MoE with Routing Replay, the whole step (π_old's routes replayed in 2 updates):
    packed on fsdp 2 x expert 2 x tensor 2 equals padded on one device."""
    import optax

    cfg, params = models.load_pretrained(MOE_FIXTURE)
    batch = _whole_batch(cfg, params)
    # SGD: Adam's m / sqrt(v) turns the rounding of a near-zero expert gradient into up to a
    # whole step of either sign (the padded step alone on this mesh moves such a weight by
    # 1.4e-4 against one device), so it would compare rounding, not the packed step
    tx = optax.sgd(0.1)
    sc = _sc(cfg, num_mini_batches=2, routing_replay=True, importance_sampling="token")
    want_state, want = make_train_step(sc, tx, donate=False)(_state(params, tx), batch)
    packed_sc = _packed(sc, batch["attention_mask"])
    assert packed_sc.pack_rows < B // 2
    mesh = sharding.make_mesh({"data": 1, "fsdp": 2, "tensor": 2, "expert": 2})
    fn, shardings = _mesh_step(packed_sc, tx, cfg, mesh)
    got_state, got = fn(
        jax.device_put(_state(params, tx), shardings),
        jax.device_put(batch, sharding.batch_shardings(mesh, batch)),
    )
    for key in ("loss", "clipfrac", "grad_norm", "expert_change", "ratio_noise_floor"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-6, err_msg=key)
    for a, b in zip(jax.tree.leaves(got_state.params), jax.tree.leaves(want_state.params)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)  # test_mesh_equality's f32 bound
