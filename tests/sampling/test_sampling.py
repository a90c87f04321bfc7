"""Specification of gspo_jax.sampling.sample: the rollout sampler.

References: transformers' greedy `generate` tokens stored with the fixtures (Qwen2, Qwen3,
Qwen3-MoE; a left-padded batch), `models.forward` log-softmax on concat(prompt, response)
for the log-probs, the non-shared-prefix path for the shared one, and hand-computed
filters / an empirical histogram for top-k, top-p and the categorical draw.

The decode's cache segments (one while_loop per time segment) are checked against the
single-segment result; the sharded test runs prompts split over 4 of the 8 fake devices.

Compiles are the cost here, so most calls share shapes: N = 3 or 4 prompts left padded to
width 20 (bucket 16), T = 12, two end-token ids (end ids are data, not static).
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax import models, sampling
from gspo_jax.sampling import continuous, draw, sampler, static

# Shape letters: N prompts, G samples per prompt, B = N·G, P prompt width, T new tokens.

FIXTURES = Path(__file__).parents[1] / "fixtures" / "models"
FAMILIES = ("qwen2", "qwen3", "qwen3_moe", "llama")
WIDTH, BUCKET, T = 20, 16, 12
UNUSED_EOS = (2, 1)  # <|im_end|> and <|im_start|>: absent from every greedy reference
G = 4


@pytest.fixture(scope="module")
def fixture_models():
    cache = {}

    def get(family):
        if family not in cache:
            cfg, params = models.load_pretrained(FIXTURES / family)
            ref = dict(np.load(FIXTURES / f"reference_{family}.npz"))
            cache[family] = (cfg, params, ref)
        return cache[family]

    return get


def _left_pad(tokens, mask, width):
    pad = width - tokens.shape[1]
    return np.pad(tokens, ((0, 0), (pad, 0))), np.pad(mask, ((0, 0), (pad, 0)))


def _greedy_prompts(ref):
    return _left_pad(ref["gen_prompt_tokens"], ref["gen_prompt_mask"], WIDTH)


def _greedy(cfg, params, tokens, mask, eos_ids, **kw):
    return sampling.sample(
        cfg,
        params,
        tokens,
        mask,
        jax.random.PRNGKey(0),  # raw uint32 keys work as well as typed ones
        num_samples=1,
        max_new_tokens=T,
        temperature=0.0,
        eos_ids=eos_ids,
        buckets=(BUCKET, 32),
        **kw,
    )


@pytest.fixture(scope="module")
def sampling_prompts(fixture_models):
    """4 left-padded prompts: the 3 reference rows plus one of 11 tokens (width 20)."""
    _, _, ref = fixture_models("qwen3")
    tokens, mask = _greedy_prompts(ref)
    extra = np.zeros((1, WIDTH), np.int32)
    extra[0, -11:] = np.arange(40, 51)
    extra_mask = (extra > 0).astype(np.int32)
    return np.concatenate([tokens, extra]), np.concatenate([mask, extra_mask])


def _sample(cfg, params, prompts, key, **kw):
    kw = {"num_samples": G, "max_new_tokens": T, "eos_ids": (2, 3), "buckets": (BUCKET, 32)} | kw
    return sampling.sample(cfg, params, *prompts, key, **kw)


@pytest.fixture(scope="module")
def tempered(fixture_models, sampling_prompts):
    """Samples at temperature 1 (shared prefix), reused by several tests."""
    cfg, params, _ = fixture_models("qwen3")
    return _sample(cfg, params, sampling_prompts, jax.random.key(7), temperature=1.0)


def _forward_logprobs(cfg, params, out, temperature):
    """log softmax(forward(concat(prompt, response)) / τ) at each response token."""
    tokens, mask = out.sequences()
    logits = models.forward(cfg, params, tokens, mask)
    P = out.prompt_tokens.shape[1]
    z = np.asarray(logits[:, P - 1 : P + T - 1], np.float64) / temperature
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return np.take_along_axis(logp, np.asarray(out.tokens)[..., None], -1)[..., 0]


# ----------------------------------------------------------------------- greedy parity


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_generate(fixture_models, family):
    cfg, params, ref = fixture_models(family)
    out = _greedy(cfg, params, *_greedy_prompts(ref), UNUSED_EOS)
    np.testing.assert_array_equal(out.tokens, ref["gen_tokens"])
    # Greedy log-probs are of log softmax(logits) (τ = 1): transformers' own numbers.
    np.testing.assert_allclose(out.logprobs, ref["gen_logprobs"], atol=1e-4)
    np.testing.assert_array_equal(out.mask, np.ones((3, T)))
    np.testing.assert_array_equal(out.lengths, [T] * 3)
    assert np.asarray(out.truncated).all() and int(out.num_steps) == T
    assert out.prompt_tokens.shape == (3, BUCKET)  # width 20 trimmed to its bucket


@pytest.mark.parametrize(
    "eos, lengths, truncated, steps",
    [
        ((229, 92), (3, 12, 2), (False, False, False), 12),  # row 1 ends on the last column
        ((240, 79), (2, 2, 12), (False, False, True), 12),
        ((229, 193), (3, 3, 2), (False, False, False), 3),  # all done: the loop stops early
    ],
)
def test_end_token_masks_and_pads(fixture_models, eos, lengths, truncated, steps):
    cfg, params, ref = fixture_models("qwen3")
    out = _greedy(cfg, params, *_greedy_prompts(ref), eos, pad_id=7)
    gen = ref["gen_tokens"]
    for row, n in enumerate(lengths):
        np.testing.assert_array_equal(out.tokens[row, :n], gen[row, :n])  # end token kept
        np.testing.assert_array_equal(out.tokens[row, n:], 7)
        np.testing.assert_array_equal(out.mask[row], np.arange(T) < n)
        np.testing.assert_allclose(out.logprobs[row, :n], ref["gen_logprobs"][row, :n], atol=1e-4)
        np.testing.assert_array_equal(out.logprobs[row, n:], 0.0)
    np.testing.assert_array_equal(out.lengths, lengths)
    np.testing.assert_array_equal(out.truncated, truncated)
    assert int(out.num_steps) == steps


# ------------------------------------------------------------------------- log-probs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_forward_log_softmax(
    fixture_models, sampling_prompts, tempered, temperature
):
    cfg, params, _ = fixture_models("qwen3")
    if temperature == 1.0:
        out = tempered
    else:
        out = _sample(cfg, params, sampling_prompts, jax.random.key(3), temperature=temperature)
    expected = _forward_logprobs(cfg, params, out, temperature)
    mask = np.asarray(out.mask).astype(bool)
    assert mask.sum() > T  # something to compare
    np.testing.assert_allclose(np.asarray(out.logprobs)[mask], expected[mask], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.logprobs)[~mask], 0.0)
    # Prompts come back repeated G times, row-aligned with the responses.
    np.testing.assert_array_equal(
        out.prompt_tokens, np.repeat(sampling_prompts[0][:, -BUCKET:], G, axis=0)
    )


def test_shared_prefix_equals_unshared(fixture_models, sampling_prompts, tempered):
    cfg, params, _ = fixture_models("qwen3")
    plain = _sample(cfg, params, sampling_prompts, jax.random.key(7), share_prefix=False)
    np.testing.assert_array_equal(plain.tokens, tempered.tokens)
    np.testing.assert_array_equal(plain.mask, tempered.mask)
    np.testing.assert_allclose(plain.logprobs, tempered.logprobs, atol=1e-5)


def test_cache_segments_do_not_change_samples(fixture_models, sampling_prompts, tempered):
    """The static engine with 3 time segments of the response cache (3 while_loops, each
    attending to the segments reached so far) gives the default (one segment) result."""
    cfg, params, _ = fixture_models("qwen3")
    segmented = _sample(
        cfg, params, sampling_prompts, jax.random.key(7), decode_segments=3, engine="static"
    )
    np.testing.assert_array_equal(segmented.tokens, tempered.tokens)
    np.testing.assert_allclose(segmented.logprobs, tempered.logprobs, atol=1e-5)
    assert static.cache_segments(T, 3) == [(0, 4), (4, 4), (8, 4)]
    assert static.cache_segments(128, static.auto_segment_count(128)) == [
        (0, 32),
        (32, 32),
        (64, 32),
        (96, 32),
    ]


def test_rng_determinism_and_group_diversity(fixture_models, sampling_prompts, tempered):
    cfg, params, _ = fixture_models("qwen3")
    again = _sample(cfg, params, sampling_prompts, jax.random.key(7))
    for field in ("tokens", "mask", "logprobs", "lengths"):
        np.testing.assert_array_equal(getattr(again, field), getattr(tempered, field))
    other = _sample(cfg, params, sampling_prompts, jax.random.key(8))
    assert not np.array_equal(other.tokens, tempered.tokens)
    tokens = np.asarray(tempered.tokens).reshape(4, G, T)
    for n in range(4):  # every member of every group is its own sample
        assert len({tuple(row) for row in tokens[n]}) == G, f"group {n} has repeated samples"


def test_end_tokens_after_sampling_are_padded(fixture_models, sampling_prompts):
    """At temperature 1, with frequent end tokens: the mask/padding invariants hold row-wise."""
    cfg, params, _ = fixture_models("qwen3")
    # 229 and 193 dominate this model's greedy continuations, so sampling hits them often.
    out = _sample(cfg, params, sampling_prompts, jax.random.key(11), eos_ids=(229, 193))
    tokens, mask = np.asarray(out.tokens), np.asarray(out.mask)
    ends = np.isin(tokens, (229, 193)) & (mask > 0)
    assert ends.any(), "no end token sampled: pick more frequent ids"
    for b in range(tokens.shape[0]):
        n = int(out.lengths[b])
        first_end = np.flatnonzero(np.isin(tokens[b, :n], (229, 193)))
        if out.truncated[b]:
            assert n == T and first_end.size == 0
        else:
            assert first_end.tolist() == [n - 1]  # exactly one end token, the last valid one
        np.testing.assert_array_equal(tokens[b, n:], 0)
        np.testing.assert_array_equal(mask[b], np.arange(T) < n)


# ---------------------------------------------------------------------- filtered draws


def test_top_k_one_and_tiny_top_p_are_greedy(fixture_models):
    cfg, params, ref = fixture_models("qwen3")
    prompts = _greedy_prompts(ref)
    greedy = _greedy(cfg, params, *prompts, UNUSED_EOS)
    for kw in ({"top_k": 1}, {"top_p": 1e-6}):
        with pytest.warns(sampling.BiasedPiOldWarning):  # filtered draw, sampler π_old
            out = sampling.sample(
                cfg, params, *prompts, jax.random.key(5), num_samples=1, max_new_tokens=T,
                temperature=1.0, eos_ids=UNUSED_EOS, buckets=(BUCKET, 32),
                logprobs_as_pi_old=True, **kw,
            )  # fmt: skip
        np.testing.assert_array_equal(out.tokens, greedy.tokens, err_msg=str(kw))
        # The reported log-prob is of the unfiltered softmax(logits / 1): greedy's own.
        np.testing.assert_allclose(out.logprobs, greedy.logprobs, atol=1e-6, err_msg=str(kw))


def test_filter_logits_hand_computed():
    p = np.array([0.15, 0.5, 0.05, 0.2, 0.1])  # sorted: 0.5, 0.2, 0.15, 0.1, 0.05
    z = jnp.asarray(np.log(p)[None], jnp.float32)

    def kept(**kw):
        return np.flatnonzero(np.isfinite(np.asarray(draw.filter_logits(z, **kw))[0])).tolist()

    assert kept() == [0, 1, 2, 3, 4]
    assert kept(top_k=2) == [1, 3]
    assert kept(top_k=1) == [1]
    assert kept(top_p=0.6) == [1, 3]  # mass before 0.2 is 0.5 < 0.6; before 0.15 it is 0.7
    assert kept(top_p=0.5) == [1]  # mass before 0.2 is 0.5, not < 0.5
    assert kept(top_p=0.71) == [0, 1, 3]
    assert kept(top_p=1e-9) == [1]
    # top-p after top-k uses the renormalised top-k probabilities: 0.5/.85, 0.2/.85, 0.15/.85.
    assert kept(top_k=3, top_p=0.82) == [1, 3]  # mass before the 3rd: 0.7/0.85 = 0.8235
    assert kept(top_k=3, top_p=0.83) == [0, 1, 3]
    np.testing.assert_array_equal(draw.filter_logits(z, top_k=3), np.where(
        np.isin(np.arange(5), [0, 1, 3]), np.log(p), -np.inf)[None].astype(np.float32))  # fmt: skip


def test_draw_categorical_matches_softmax():
    """Empirical frequencies of 40k draws from one [B, V] call match softmax(z); masked
    (−inf) tokens never come up. V = 300 is not a multiple of the inverse-CDF block."""
    rng = np.random.default_rng(0)
    V, B = 300, 40_000
    z = rng.normal(size=V) * 1.5
    z[[0, 17, 150, 299]] = -np.inf
    z[5] = 4.0  # one dominant token
    p = np.exp(z - z[np.isfinite(z)].max())
    p /= p.sum()
    draws = np.asarray(
        jax.jit(draw.draw_categorical)(
            jnp.broadcast_to(jnp.asarray(z, jnp.float32), (B, V)), jax.random.key(0)
        )
    )
    freq = np.bincount(draws, minlength=V) / B
    assert freq[[0, 17, 150, 299]].sum() == 0
    np.testing.assert_array_less(np.abs(freq - p), 5 * np.sqrt(p * (1 - p) / B) + 1e-9)
    # Rows are independent draws: two rows with the same logits disagree somewhere.
    assert len(set(draws[:64].tolist())) > 10


# --------------------------------------------------------------------- compile reuse


def trace_counts() -> dict[str, int]:
    """Compiled versions of the sampler's two jitted stages (a new one = a recompile)."""
    return {
        "prefill": static.prefill._cache_size() + continuous.prefill_pages._cache_size(),
        "decode": static.decode._cache_size() + continuous.engine_loop._cache_size(),
    }


def test_prompts_of_a_known_bucket_do_not_recompile(fixture_models, sampling_prompts, tempered):
    cfg, params, _ = fixture_models("qwen3")
    tokens, mask = sampling_prompts
    before = trace_counts()
    shorter = mask.copy()
    shorter[:, :-5] = 0  # real lengths 5 instead of up to 11: same bucket 16
    out = _sample(cfg, params, (tokens, shorter), jax.random.key(1))
    assert out.prompt_tokens.shape == (4 * G, BUCKET)
    assert trace_counts() == before
    # A longer prompt needs the next bucket (capped at the width 20): a new trace each.
    # (Another test in this process may have compiled that bucket already: start empty.)
    for stage in (static.prefill, static.decode, continuous.prefill_pages, continuous.engine_loop):
        stage.clear_cache()
    cleared = trace_counts()
    longer = np.ones_like(mask)
    out = _sample(cfg, params, (tokens + 1, longer), jax.random.key(1))
    assert out.prompt_tokens.shape == (4 * G, 20)
    after = trace_counts()
    assert after == {"prefill": cleared["prefill"] + 1, "decode": cleared["decode"] + 1}


def test_sharded_prompts_give_the_same_samples(fixture_models, sampling_prompts, tempered):
    """Prompts sharded over a 4-device 'data' axis, params replicated: same samples."""
    cfg, params, _ = fixture_models("qwen3")
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    tokens, mask = (jax.device_put(x, rows) for x in sampling_prompts)
    params = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    out = _sample(cfg, params, (tokens, mask), jax.random.key(7))
    np.testing.assert_array_equal(out.tokens, tempered.tokens)
    np.testing.assert_allclose(out.logprobs, tempered.logprobs, atol=1e-5)
    assert len(out.tokens.sharding.device_set) == 4
    # The device-side prompt summary (used when prompts span processes) agrees with numpy.
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    right = mask.at[0, -1].set(0).at[1, -1].set(2)  # row 0 not left padded; one mask value 2
    summary = sampler._replicated_prompt_summary(replicated)(tokens.at[2, 3].set(-5), right)
    lengths, left, bad_mask, low, high = (np.asarray(x) for x in summary)
    np.testing.assert_array_equal(lengths, np.asarray(right != 0).sum(1))
    np.testing.assert_array_equal(left, [False, True, True, True])
    assert bad_mask == 1 and low == -5 and high == np.asarray(tokens).max()


# ------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "change, message",
    [
        ({"max_prompt_length": 4}, r"longer than max_prompt_length=4: row 0: 6 tokens, row 1: 5"),
        (
            {"max_new_tokens": 20, "max_cache_len": 25},
            r"bucket 6 \(longest prompt 6\) \+ max_new_tokens 20 = 26 exceeds the cache limit 25",
        ),
        ({"num_samples": 0}, r"num_samples must be >= 1"),
        ({"temperature": -0.5}, r"temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be None or in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be None or in \(0, 1\]"),
        ({"top_k": 0}, r"top_k must be None or an int >= 1"),
        ({"eos_ids": (2, 999)}, r"eos_ids \[999\] outside the vocabulary"),
        ({"max_new_tokens": 0}, r"max_new_tokens must be >= 1"),
        ({"decode_segments": 0}, r"decode_segments must be None or an int >= 1"),
        ({"engine": "fast"}, r"engine='fast': expected one of \('continuous', 'static'\)"),
        ({"engine": "continuous", "num_slots": 0}, r"num_slots must be None or an int >= 1"),
        ({"engine": "continuous", "page_size": 0}, r"page_size must be an int >= 1"),
        (
            {"engine": "continuous", "page_size": 4, "kv_budget_tokens": 15},
            r"kv_budget_tokens=15 holds 3 pages of page_size=4; one sequence of max_new_tokens",
        ),
    ],
)
def test_bad_options_raise_before_compiling(fixture_models, change, message):
    cfg, params, ref = fixture_models("qwen3")
    tokens, mask = ref["gen_prompt_tokens"], ref["gen_prompt_mask"]
    kw = {"num_samples": 2, "max_new_tokens": T, "eos_ids": (2,)} | change
    before = trace_counts()
    with pytest.raises((ValueError, TypeError), match=message):
        sampling.sample(cfg, params, tokens, mask, jax.random.key(0), **kw)
    assert trace_counts() == before


def test_bad_prompts_raise(fixture_models):
    cfg, params, ref = fixture_models("qwen3")
    tokens, mask = ref["gen_prompt_tokens"], ref["gen_prompt_mask"]

    def call(t, m, **kw):
        kw = {"num_samples": 2, "max_new_tokens": T, "eos_ids": (2,)} | kw
        return sampling.sample(cfg, params, t, m, jax.random.key(0), **kw)

    empty = mask.copy()
    empty[1] = 0
    with pytest.raises(ValueError, match=r"empty prompt: row\(s\) \[1\]"):
        call(tokens, empty)
    right = mask.copy()
    right[2] = [1, 1, 1, 0, 0, 0]
    with pytest.raises(ValueError, match=r"row\(s\) \[2\] are not left padded"):
        call(tokens, right)
    with pytest.raises(ValueError, match=r"must both be \[N, P\]"):
        call(tokens, mask[:, 1:])
    with pytest.raises(ValueError, match=r"empty prompt batch"):
        call(tokens[:0], mask[:0])
    no_eos = cfg.__class__(**{**cfg.__dict__, "eos_token_ids": ()})
    with pytest.raises(ValueError, match=r"eos_ids=None but model_config.eos_token_ids is empty"):
        sampling.sample(
            no_eos, params, tokens, mask, jax.random.key(0), num_samples=1, max_new_tokens=T
        )


def test_bad_prompt_ids_and_mask_values_raise_before_compiling(fixture_models):
    """Ids outside the vocabulary (padding included: they still reach the embedding and
    gave NaN log-probs), negative ids (they wrapped around), float ids (truncated) and mask
    values other than 0/1 (they changed the samples) are host-side errors."""
    cfg, params, ref = fixture_models("qwen3")
    tokens, mask = np.asarray(ref["gen_prompt_tokens"]), np.asarray(ref["gen_prompt_mask"])
    row = int(np.argmin(mask.sum(axis=1)))  # the shortest prompt: its column 0 is padding
    assert mask[row, 0] == 0
    cases = [
        (tokens.copy(), mask, f"id {cfg.vocab_size} outside the vocabulary"),
        (tokens - tokens.max() - 1, mask, r"id -\d+ outside the vocabulary"),
        (tokens.astype(np.float32), mask, "integer token ids, got dtype float32"),
        (tokens, np.where(mask > 0, 0.5, 0.0), r"value\(s\) other than 0 and 1"),
        (tokens, mask * 2, r"value\(s\) other than 0 and 1"),
    ]
    cases[0][0][row, 0] = cfg.vocab_size  # at a masked position
    before = trace_counts()
    for t, m, message in cases:
        for to_device in (False, True):
            t_, m_ = (jax.numpy.asarray(t), jax.numpy.asarray(m)) if to_device else (t, m)
            with pytest.raises((ValueError, TypeError), match=message):
                sampling.sample(
                    cfg, params, t_, m_, jax.random.key(0), num_samples=2, max_new_tokens=T
                )
    assert trace_counts() == before
    # A float mask of exact zeros and ones is a mask.
    out = sampling.sample(
        cfg,
        params,
        tokens,
        mask.astype(np.float32),
        jax.random.key(0),
        num_samples=1,
        max_new_tokens=2,
        eos_ids=(),
    )
    assert out.tokens.shape == (tokens.shape[0], 2)


def test_biased_pi_old_warning():
    with pytest.warns(sampling.BiasedPiOldWarning, match=r"top_k=5.*biased"):
        assert sampling.warn_if_biased_pi_old(top_k=5)
    with pytest.warns(sampling.BiasedPiOldWarning, match=r"top_p=0.9"):
        sampling.warn_if_biased_pi_old(top_p=0.9)
    with pytest.warns(sampling.BiasedPiOldWarning, match=r"greedy"):
        sampling.warn_if_biased_pi_old(temperature=0.0)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not sampling.warn_if_biased_pi_old(top_k=None, top_p=1.0, temperature=0.7)
