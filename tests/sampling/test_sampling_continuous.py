"""Specification of the continuous engine (gspo_jax/sampling/continuous.py) and the paged
attention it decodes with (gspo_jax/models/paged.py).

References: a plain-NumPy attention over each row's gathered context and jax's own
reference of the Pallas kernel (`ref_ragged_paged_attention`) for the paged attention; the
static engine (every row decodes until the last ends) for the sampler, on a batch whose
rows end at very different times, with fewer slots than sequences and a KV budget so small
that rows wait and are preempted. One static and one continuous compile (the Qwen3
fixture, the shapes of tests/sampling/test_sampling.py).
"""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

from gspo_jax import models, sampling, sharding
from gspo_jax.models import paged
from gspo_jax.sampling import continuous, draw
from gspo_jax.sampling.options import EngineOptions

FIXTURES = Path(__file__).parents[1] / "fixtures" / "models"
BUCKET, T, G = 16, 12, 4
EOS = (229, 193)  # frequent in this model's samples: lengths from 2 to 12 below


def _numpy_paged_attention(q_SHC, kv, lens, table, scale):
    """Row s: softmax over its context positions i < lens[s] (page table[s, i // ps],
    offset i % ps; keys at combined head 2k, values at 2k + 1), float64."""
    S, H, C = q_SHC.shape
    ps, K = kv.shape[1], kv.shape[2] // 2
    out = np.zeros((S, H, C))
    for s in range(S):
        ctx = np.stack([kv[table[s, i // ps], i % ps] for i in range(lens[s])]).astype(np.float64)
        for h in range(H):
            k, v = ctx[:, 2 * (h // (H // K))], ctx[:, 2 * (h // (H // K)) + 1]
            z = k @ q_SHC[s, h].astype(np.float64) * scale
            p = np.exp(z - z.max())
            out[s, h] = (p / p.sum()) @ v
    return out


def test_ragged_paged_attention_matches_dense_references():
    """GQA (4 query heads on 2 kv heads), shared and scattered pages, lengths from 1 to a
    full table, read in blocks of 2 pages (3 loop trips for the longest row)."""
    rng = np.random.default_rng(0)
    S, H, K, C, ps, pages = 4, 4, 2, 8, 4, 12
    q = rng.standard_normal((S, H, C)).astype(np.float32)
    kv = rng.standard_normal((pages, ps, 2 * K, C)).astype(np.float32)
    table = np.array(
        [[3, 7, 1, 0, 0, 0], [3, 7, 2, 9, 4, 11], [5, 0, 0, 0, 0, 0], [3, 8, 6, 10, 0, 0]]
    )
    lens = np.array([9, 24, 1, 14], np.int32)
    scale = C**-0.5
    got = models.ragged_paged_attention(
        jnp.asarray(q),
        jnp.asarray(kv),
        jnp.asarray(lens),
        jnp.asarray(table, jnp.int32),
        sm_scale=scale,
        block_pages=2,
    )
    want = _numpy_paged_attention(q, kv, lens, table, scale)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6, rtol=1e-5)
    # The prompt / response split of the value product (the trainer's order) changes
    # nothing but rounding.
    split = models.ragged_paged_attention(
        jnp.asarray(q),
        jnp.asarray(kv),
        jnp.asarray(lens),
        jnp.asarray(table, jnp.int32),
        sm_scale=scale,
        block_pages=2,
        split_S=jnp.array([3, 10, 1, 0], jnp.int32),
    )
    np.testing.assert_allclose(np.asarray(split), want, atol=2e-6, rtol=1e-5)
    # jax's reference for the Pallas kernel (one query per row): the same numbers.
    kernel_ref = ref_ragged_paged_attention(
        jnp.asarray(q),
        jnp.asarray(kv),
        jnp.asarray(lens),
        jnp.asarray(table, jnp.int32),
        jnp.arange(S + 1, dtype=jnp.int32),
        jnp.array([S], jnp.int32),
        sm_scale=scale,
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(kernel_ref), atol=2e-6, rtol=1e-5)


def test_prompt_pages_put_real_tokens_first():
    """Left-padded prompt caches become pages holding position 0 onwards."""
    N, K, C, P, ps = 2, 2, 3, 6, 4
    k = np.arange(N * K * C * P, dtype=np.float32).reshape(N, K, C, P)
    v = -np.arange(N * K * P * C, dtype=np.float32).reshape(N, K, P, C)
    prompt = models.PromptCache(
        k=(jnp.asarray(k),), v=(jnp.asarray(v),), valid=None, length=jnp.array([4, 6], jnp.int32)
    )
    (pages,) = models.prompt_pages(prompt, ps)
    assert pages.shape == (N * 2, ps, 2 * K, C)
    flat = np.asarray(pages).reshape(N, 2 * ps, K, 2, C)
    for n, length in enumerate((4, 6)):
        for i in range(length):
            slot = P - length + i
            np.testing.assert_array_equal(flat[n, i, :, 0], k[n, :, :, slot])
            np.testing.assert_array_equal(flat[n, i, :, 1], v[n, :, slot, :])


def test_plan_sizes_and_errors():
    p = continuous.plan(16, 20, 12, num_slots=5, page_size=4, kv_budget_tokens=18)
    assert (p.num_slots, p.num_pages, p.prompt_pages, p.seq_pages) == (5, 4, 5, 4)
    assert continuous.plan(16, 20, 12, num_slots=40).num_slots == 16  # capped
    default = continuous.plan(16, 20, 12, num_slots=3, page_size=4)
    assert default.num_pages == 3 * 4  # every slot at full length: no row ever waits
    with pytest.raises(ValueError, match=r"kv_budget_tokens=15 holds 3 pages"):
        continuous.plan(16, 20, 12, page_size=4, kv_budget_tokens=15)
    with pytest.raises(ValueError, match=r"num_slots must be None or an int >= 1"):
        continuous.plan(16, 20, 12, num_slots=2.5)


def test_default_slots_follow_the_budget_and_the_platform():
    """`num_slots=None`: every sequence its own slot while a decode step costs about the
    same for that many rows (TPU: up to 256), about a quarter of the sequences (a queue
    behind each slot) past that, and never more than the KV budget holds at full length."""
    slots = continuous.default_num_slots
    assert slots(64, 4, 16, None, "tpu") == 64
    assert slots(512, 4, 16, None, "tpu") == 256
    assert slots(2048, 4, 16, None, "tpu") == 512
    assert [slots(b, 4, 16, None, "cpu") for b in (8, 64, 100, 128)] == [8, 16, 32, 32]
    # A budget of 10 full-length sequences (and a bit): 10 slots, so no row ever waits.
    assert slots(512, 4, 16, 16 * 4 * 10 + 15, "tpu") == 10
    p = continuous.plan(64, 16, 48, page_size=16, platform="cpu")
    assert (p.num_slots, p.num_pages) == (16, 16 * 4)
    assert continuous.plan(64, 16, 48, page_size=16, platform="tpu").num_slots == 64
    # Over R replicas the flat region is R x 256 rows: 64 replicas of 8 sequences each get
    # all 8 slots (one wave of weight reads), not 256 / 64 = 4 (two waves).
    assert slots(512, 4, 16, None, "tpu", 64) == 512
    assert slots(512, 4, 16, None, "tpu", 1) == 256
    assert [slots(b, 4, 16, None, "cpu", 2) for b in (8, 64, 100, 200)] == [8, 32, 32, 56]


def test_replica_count_is_the_layouts_row_axes_but_expert():
    from gspo_jax.sampling.replicas import replica_count

    devices = jax.devices()
    assert replica_count(None, "trainer") == 1
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 1, "expert": 2}, devices[:8])
    assert replica_count(mesh, "trainer") == 4  # data x fsdp; expert splits the model
    mesh = sharding.make_mesh({"data": 2, "fsdp": 4, "tensor": 1, "expert": 1}, devices[:8])
    assert replica_count(mesh, "tensor") == 2  # "tensor": rows over data only


def test_row_keys_depend_on_sequence_and_position_only():
    rng = jax.random.key(3)
    keys = draw.row_keys(rng, jnp.array([5, 5, 2]), jnp.array([1, 1, 1]))
    u = np.asarray(draw.row_uniforms(keys))[:, 0]
    assert u[0] == u[1] and u[0] != u[2]
    expected = jax.random.uniform(jax.random.fold_in(jax.random.fold_in(rng, 2), 1), (1,))
    assert u[2] == float(expected[0])


@pytest.fixture(scope="module")
def model_and_prompts():
    cfg, params = models.load_pretrained(FIXTURES / "qwen3")
    ref = dict(np.load(FIXTURES / "reference_qwen3.npz"))
    tokens = np.zeros((4, BUCKET), np.int32)
    mask = np.zeros((4, BUCKET), np.int32)
    for n in range(3):
        row = ref["gen_prompt_tokens"][n][ref["gen_prompt_mask"][n] > 0]
        tokens[n, BUCKET - len(row) :], mask[n, BUCKET - len(row) :] = row, 1
    tokens[3, -11:], mask[3, -11:] = np.arange(40, 51), 1
    return cfg, params, tokens, mask


def test_continuous_equals_static_with_queue_waits_and_preemption(model_and_prompts):
    """16 sequences on 5 slots, pages of 4 tokens and a 16-token budget (4 pages: one
    full-length response): rows wait for pages and are preempted and rerun; the results are
    the static engine's — same tokens, lengths, truncation, log-probs to f32 rounding."""
    cfg, params, tokens, mask = model_and_prompts
    key = jax.random.key(7)
    kw = {"num_samples": G, "max_new_tokens": T, "eos_ids": EOS, "buckets": (BUCKET,)}
    static = sampling.sample(cfg, params, tokens, mask, key, engine="static", **kw)
    lengths = np.asarray(static.lengths)
    assert lengths.min() <= 3 and lengths.max() == T  # rows end at very different times
    plan = continuous.plan(4 * G, BUCKET, T, num_slots=5, page_size=4, kv_budget_tokens=16)
    options = EngineOptions(
        num_samples=G,
        max_new_tokens=T,
        temperature=1.0,
        top_k=None,
        top_p=None,
        share_prefix=True,
        drain_levels=2,
        layout="trainer",
        kv_dtype="auto",
    )
    out = continuous.run(
        cfg,
        params,
        jnp.asarray(tokens),
        jnp.asarray(mask),
        key,
        np.array(EOS, np.int32),
        np.int32(0),
        options=options,
        page_plan=plan,
    )
    got_tokens, got_mask, got_logprobs, got_lengths, got_truncated, prompt_BP, _, stats = out
    np.testing.assert_array_equal(got_tokens, static.tokens)
    np.testing.assert_array_equal(got_mask, static.mask)
    np.testing.assert_array_equal(got_lengths, static.lengths)
    np.testing.assert_array_equal(got_truncated, static.truncated)
    np.testing.assert_array_equal(prompt_BP, static.prompt_tokens)
    np.testing.assert_allclose(got_logprobs, static.logprobs, rtol=1e-6, atol=1e-6)
    assert int(stats.preemptions) > 0  # the budget ran out: rows were preempted and rerun
    # 5 slots cannot finish 16 sequences in the static engine's 12 steps; the drain (widths
    # 5, 2, 1 once the queue is empty) computes fewer rows than 5 per step.
    assert int(stats.steps) > T
    assert int(stats.row_steps) < 5 * int(stats.steps)
    assert continuous.drain_widths(5, 2) == (5, 2, 1) and continuous.drain_widths(1, 2) == (1,)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_the_page_pools_stay_in_place_in_the_compiled_loop(model_and_prompts, kv_dtype):
    """Every pool write of a step (the admissions' page copies, each layer's new token)
    comes before the decode's attention loops read the pools: a write after those reads
    made XLA copy every layer's whole pool twice per decoded token (1.5x the wall time of
    benchmarks/sampler_longtail.py's long tail). The optimised program must hold no copy
    of a pool-shaped array (with a table of one block of pages, XLA hoists the page reads out
    of the attention loops and fuses the write into them, which copies again: a toy-size
    case, not checked). int8 pools: neither do their scales, and no float pool exists (the
    XLA path reads the int8 pages, never a dequantised copy)."""
    cfg, params, tokens, mask = model_and_prompts
    plan = continuous.plan(4 * G, BUCKET, T, num_slots=5, page_size=2)
    assert plan.table_width > 8  # more than one block of pages: the attention loops loop
    pages, plen, logits, _, _ = continuous.prefill_pages(
        cfg,
        params,
        jnp.asarray(tokens),
        jnp.asarray(mask),
        num_samples=G,
        share_prefix=True,
        page_size=plan.page_size,
        kv_dtype=kv_dtype,
    )
    compiled = continuous.engine_loop.lower(
        cfg,
        params,
        pages,
        plen,
        logits,
        jax.random.key(0),
        jnp.asarray(EOS, jnp.int32),
        jnp.int32(0),
        num_sequences=4 * G,
        max_new_tokens=T,
        page_plan=plan,
        temperature=1.0,
        top_k=None,
        top_p=None,
        impl="xla",
    ).compile()
    text = compiled.as_text()
    pool_rows = 1 + pages[0].shape[0] + plan.num_pages
    stored = pages[0].q if kv_dtype == "int8" else pages[0]  # int8: head major
    pool = ",".join(str(d) for d in (pool_rows, *stored.shape[1:]))
    assert f"[{pool}]" in text  # the pools are where we look for them
    copies = re.findall(rf"= \w+\[{pool}\]\{{[0-9,]+\}} copy\(", text)
    assert not copies, f"{len(copies)} copies of a page pool in the compiled engine"
    if kv_dtype == "int8":
        assert isinstance(pages[0], models.Int8Pages)
        assert f"s8[{pool}]" in text and f"f32[{pool}]" not in text
        scales = ",".join(str(d) for d in (pool_rows, *pages[0].scale.shape[1:]))
        copies = re.findall(rf"= \w+\[{scales}\]\{{[0-9,]+\}} copy\(", text)
        assert not copies, f"{len(copies)} copies of a scale pool in the compiled engine"


def test_the_continuous_engine_is_the_default_of_sample_and_of_the_rl_loop():
    """`sampling.sample`'s default engine and the RL loop's (configs/base.py through
    `specs.sampler_spec`) are the continuous one; the static engine is the option."""
    import inspect

    from configs import base
    from gspo_jax.config import specs

    assert inspect.signature(sampling.sample).parameters["engine"].default == "continuous"
    assert specs.sampler_spec(base.get_config()).engine == "continuous"
    assert specs.SamplerSpec(1, 1, 1.0, None, None, (8,)).engine == "continuous"


def test_sample_reports_the_decode_rows_it_computed(model_and_prompts):
    """`SampleOutput.row_steps` / `preemptions`: the static engine computes every row at
    every step (B x num_steps); the continuous one reports its loop's own count, which
    with a queue and preemption is what `continuous.run`'s EngineStats says."""
    cfg, params, tokens, mask = model_and_prompts
    key = jax.random.key(7)
    kw = {"num_samples": G, "max_new_tokens": T, "eos_ids": EOS, "buckets": (BUCKET,)}
    static = sampling.sample(cfg, params, tokens, mask, key, engine="static", **kw)
    assert int(static.row_steps) == 4 * G * int(static.num_steps)
    assert int(static.preemptions) == 0
    queued = sampling.sample(
        cfg, params, tokens, mask, key, num_slots=5, page_size=4, kv_budget_tokens=16, **kw
    )
    np.testing.assert_array_equal(queued.tokens, static.tokens)
    assert int(queued.preemptions) > 0  # 16 tokens of pages: rows were preempted and rerun
    lengths = int(np.asarray(queued.lengths).sum())
    # 5 slots (no drain below 32 rows): 5 rows a step, and more steps than 16 x 12 / 5.
    assert int(queued.row_steps) % 5 == 0 and int(queued.row_steps) >= lengths


def test_copy_pages_copies_whole_pages_and_touches_nothing_else():
    """`models.copy_pages` (written as token rows for the TPU's layout) against the page
    indexing it replaces: pages 5 and 2 take pages 1 and 3; the rows with nothing to copy
    all name the trash page 0 (duplicates: whatever lands there is never read)."""
    pool = jnp.asarray(np.random.default_rng(0).normal(size=(8, 4, 2, 3)), jnp.float32)
    src = jnp.array([1, 0, 3, 0], jnp.int32)
    dst = jnp.array([5, 0, 2, 0], jnp.int32)
    got = np.asarray(models.copy_pages(pool, src, dst))
    want = np.asarray(pool).copy()
    want[5], want[2] = want[1], want[3]
    np.testing.assert_array_equal(got[1:], want[1:])


# ------------------------------------------------------------------------ int8 KV pages

U32 = 2.0**-24  # f32 unit roundoff


def test_int8_round_trip_is_within_half_a_scale():
    """absmax per token and head: scale = max|x| / 127, q = round(x / scale), so
    |q·scale − x| ≤ scale/2 from the rounding, plus f32 rounding of the division and the
    product: ≤ scale·(1/2 + 254u), u = 2⁻²⁴ (`paged.quantize_int8`'s docstring). Vectors of
    very different magnitudes, and an all-zero one (scale 0, exact)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 4, 8, 16)).astype(np.float32)
    x *= 10.0 ** rng.integers(-3, 4, (6, 4, 8, 1))
    x[0, 0, 0] = 0.0
    q, scale = models.quantize_int8(jnp.asarray(x))
    assert q.dtype == jnp.int8 and scale.shape == x.shape[:-1]
    assert int(jnp.max(jnp.abs(q.astype(jnp.int32)))) == 127  # the absmax maps to ±127
    back = np.asarray(q, np.float64) * np.asarray(scale, np.float64)[..., None]
    err = np.abs(back - x)
    bound = np.asarray(scale, np.float64)[..., None] * (0.5 + 254 * U32)
    assert np.all(err <= bound)
    assert err.max() / bound.max() > 0.1  # the bound is not vacuous
    assert np.all(back[0, 0, 0] == 0)


def test_ragged_paged_attention_on_int8_pages():
    """Paged attention over int8 pages (`models.Int8Pages`):

    - equals, to f32 rounding, the float path on the dequantised pages (the scales are
      folded into the scores and the probabilities: the same products, reassociated), and
      jax's reference of the Pallas kernel on them (what the TPU path runs);
    - is within the quantisation's bound of the float path on the original pages: keys off
      by ≤ s_k/2 move a score by δ ≤ sm_scale·‖q‖₁·max s_k/2, so each probability moves
      by a factor within e^{±2δ} and Σ|Δp| ≤ e^{2δ} − 1; values off by ≤ s_v/2 then give
      |Δout| ≤ max s_v/2 + (e^{2δ} − 1)·max|v|."""
    rng = np.random.default_rng(1)
    S, H, K, C, ps, pages = 4, 4, 2, 8, 4, 12
    q = rng.standard_normal((S, H, C)).astype(np.float32)
    kv = rng.standard_normal((pages, ps, 2 * K, C)).astype(np.float32)
    table = jnp.asarray(
        [[3, 7, 1, 0, 0, 0], [3, 7, 2, 9, 4, 11], [5, 0, 0, 0, 0, 0], [3, 8, 6, 10, 0, 0]],
        jnp.int32,
    )
    lens = jnp.array([9, 24, 1, 14], jnp.int32)
    scale = C**-0.5
    int8 = models.to_kv_dtype(jnp.asarray(kv), "int8")
    assert isinstance(int8, models.Int8Pages) and int8.q.dtype == jnp.int8

    def attend(pool, **kw):
        return np.asarray(
            models.ragged_paged_attention(
                jnp.asarray(q), pool, lens, table, sm_scale=scale, block_pages=2, **kw
            ),
            np.float64,
        )

    got = attend(int8)
    dequantized = paged.dequantize(int8, jnp.float32)
    np.testing.assert_allclose(got, attend(dequantized), atol=2e-6, rtol=1e-5)
    split = attend(int8, split_S=jnp.array([3, 10, 1, 0], jnp.int32))
    np.testing.assert_allclose(split, got, atol=2e-6, rtol=1e-5)
    kernel_ref = ref_ragged_paged_attention(
        jnp.asarray(q),
        dequantized,
        lens,
        table,
        jnp.arange(S + 1, dtype=jnp.int32),
        jnp.array([S], jnp.int32),
        sm_scale=scale,
    )
    np.testing.assert_allclose(got, np.asarray(kernel_ref), atol=2e-6, rtol=1e-5)

    s = np.asarray(int8.scale).reshape(pages, K, 2, ps)
    s = s.transpose(0, 3, 1, 2)
    s_k, s_v = s[..., 0].max(), s[..., 1].max()
    delta = scale * np.abs(q).sum(-1).max() * s_k / 2
    bound = s_v / 2 + np.expm1(2 * delta) * np.abs(kv[:, :, 1::2]).max()
    err = np.abs(got - attend(jnp.asarray(kv))).max()
    assert 0 < err <= bound, (err, bound)


def test_write_entry_quantises_the_token_it_writes():
    """A decode step's token goes into an int8 pool quantised (its scale beside it); the
    other entries are untouched."""
    rng = np.random.default_rng(2)
    pool = models.to_kv_dtype(jnp.asarray(rng.standard_normal((5, 4, 4, 8)), jnp.float32), "int8")
    k, v = (jnp.asarray(rng.standard_normal((2, 2, 8)), jnp.float32) for _ in range(2))
    new = paged.write_entry(pool, jnp.array([3, 1]), jnp.array([2, 0]), k, v)
    want_q, want_scale = models.quantize_int8(paged.kv_entry(k, v, jnp.float32))
    np.testing.assert_array_equal(new.q[3, :, 2], want_q[0])  # head major: [page, 2K, o, C]
    np.testing.assert_array_equal(new.scale[1, :, 0], want_scale[1])
    keep = np.ones((5, 4), bool)
    keep[3, 2] = keep[1, 0] = False
    q_new, q_old = (np.asarray(x.q).transpose(0, 2, 1, 3) for x in (new, pool))
    np.testing.assert_array_equal(q_new[keep], q_old[keep])
    copied = models.copy_pages(new, jnp.array([3, 0]), jnp.array([4, 0]))
    np.testing.assert_array_equal(copied.q[4], new.q[3])
    np.testing.assert_array_equal(copied.scale[4], new.scale[3])


def test_sampler_with_int8_kv_gives_the_bf16_kv_greedy_tokens(model_and_prompts):
    """Greedy decoding of the Qwen3 fixture (f32 compute) with int8 KV pages: the 48 tokens
    of the f32 pages, and at least 3 of the 4 sequences of the bf16 pages (each rounding
    parts from the others where two logits nearly tie: bf16 pages part from f32 and int8
    in row 3 at token 7), log-probs within 0.05 of both on the sequences they share
    (measured: max 0.025; benchmarks/rollout_bf16_gap.py --kv_dtype auto,int8 measures the
    gap against the trainer). The static engine takes a float kv_dtype (bf16 caches: the
    continuous engine's samples) and refuses int8, naming the engine."""
    cfg, params, tokens, mask = model_and_prompts
    key = jax.random.key(0)
    kw = {"num_samples": 1, "max_new_tokens": T, "eos_ids": (), "buckets": (BUCKET,)}
    kw["temperature"] = 0.0
    f32 = sampling.sample(cfg, params, tokens, mask, key, **kw)
    bf16 = sampling.sample(cfg, params, tokens, mask, key, kv_dtype="bfloat16", **kw)
    int8 = sampling.sample(cfg, params, tokens, mask, key, kv_dtype="int8", **kw)
    np.testing.assert_array_equal(int8.tokens, f32.tokens)
    same = np.all(np.asarray(int8.tokens) == np.asarray(bf16.tokens), axis=1)
    assert same.sum() >= 3, same  # measured: rows 0-2; row 3 parts from bf16's at token 7
    for other in (f32, bf16):
        gap = np.abs(np.asarray(int8.logprobs) - np.asarray(other.logprobs))[same]
        assert 0 < gap.max() < 0.05
    # The static engine stores its dense caches in a float kv_dtype: the same samples.
    static = sampling.sample(
        cfg, params, tokens, mask, key, kv_dtype="bfloat16", engine="static", **kw
    )
    np.testing.assert_array_equal(static.tokens, bf16.tokens)
    np.testing.assert_allclose(static.logprobs, bf16.logprobs, atol=1e-5)
    with pytest.raises(ValueError, match=r'kv_dtype="int8" needs engine="continuous"'):
        sampling.sample(cfg, params, tokens, mask, key, kv_dtype="int8", engine="static", **kw)
    with pytest.raises(ValueError, match=r"kv_dtype='fp8': expected one of"):
        sampling.sample(cfg, params, tokens, mask, key, kv_dtype="fp8", **kw)


def test_shared_prefix_attention_keeps_the_greedy_tokens(model_and_prompts, monkeypatch):
    """int8 pages, 4 prompts x G = 4 on 5 slots (a prompt's rows partly resident: the
    others queued or finished), pages of 4 tokens (prompts of 6-11 tokens: whole shared
    pages and a partly filled last page in each row's own copy): with
    `shared_prefix_attention` (the default) the decode reads the prompts' pages once per
    prompt (`models.paged_prefix`) and draws the greedy tokens of the unsplit attention,
    log-probs to f32 rounding."""
    from gspo_jax.models import paged_prefix

    cfg, params, tokens, mask = model_and_prompts
    calls = []
    original = paged_prefix.shared_prefix_attention
    monkeypatch.setattr(
        paged_prefix,
        "shared_prefix_attention",
        lambda *a, **k: calls.append(1) or original(*a, **k),
    )
    kw = {"num_samples": G, "max_new_tokens": T, "eos_ids": EOS, "buckets": (BUCKET,)}
    kw.update(temperature=0.0, kv_dtype="int8", num_slots=5, page_size=4)
    key = jax.random.key(0)
    on = sampling.sample(cfg, params, tokens, mask, key, **kw)
    assert calls  # the decode step took the shared-prefix path
    off = sampling.sample(cfg, params, tokens, mask, key, shared_prefix_attention=False, **kw)
    np.testing.assert_array_equal(on.tokens, off.tokens)
    np.testing.assert_array_equal(on.lengths, off.lengths)
    np.testing.assert_allclose(on.logprobs, off.logprobs, atol=1e-5)
