"""Rollout sampler: N prompts in, G responses per prompt out, with the sampler's log-probs.

Where it sits (docs/architecture.md): `trainer/loop.py` calls `sample(...)` once per RL step; the response
tokens go to the verifiers, and `logprobs` can serve as π_old (paper §5.4: the sampler's own
likelihoods instead of a recomputation). Imports only `models` and `draw` (the token draw,
whose log-probs use the trainer's own log-softmax formula).

How it runs (no per-token Python):

  host     validate the arguments and the prompts (integer ids inside the vocabulary, a 0/1
           mask, left padding: one small device->host read, or none for numpy input); trim
           the left-padded prompts to their bucket
  jit 1    `_prefill`: one prefill per prompt (`models.prefill_shared`), its KV cache kept
           once per prompt; a zeroed `models.ResponseCache` and the `SamplerState`
  jit 2    `_decode`: sample the first token from the prefill logits, then `lax.while_loop`s
           of `models.decode_step_shared` that stop when every row has emitted an end token
           or `max_new_tokens` is reached; the state is donated and updated in place

Engines (`engine=`): "continuous" (the default; continuous.py) prefills the same way, then
runs S decode slots over a queue of the B sequences with a paged KV cache — a finished slot
takes the next sequence, so no row waits for the longest: it computes ~90 % useful rows on a
long tail against the static engine's ~24 %. "static" (jit 1 and 2 above) decodes all B rows
until the last one ends; it stays as an option because on CPU, for a small model and short
responses of about equal length, its step is cheaper (fewer, larger ops: the default
run's rollout takes about half the continuous engine's time; docs/benchmarks.md, "The rollout on
a long tail"). Token t of sequence b is drawn with key fold_in(fold_in(rng, b), t) in both
(`draw.row_keys`), so they return the same samples.

The model owns the decode arithmetic (models/kv_cache.py, through the same `Decoder` as
`models.forward`); this module owns what is sampling-specific: bucketing and validation,
the loop, and the schedule of the response cache's time segments. The G
samples of a prompt share its prompt KV cache without copying it (the model reads it once
per group). `share_prefix=False` prefills the N·G repeated prompts instead and runs the same
code with groups of one; it gives the same samples for the same rng (the benchmark's
baseline and a test).

The response cache is split into S segments along time (`decode_segments`, default about one
per 32 tokens, at most 4) and the decode runs one while_loop per segment, each calling the
decode step for its (static) segment, so a step reads only the segments that can hold
tokens: ~(S+1)/2S of the cache on average instead of all of it (the cache, not the FLOPs, is
what a CPU decode step waits on). Each segment is one more compiled copy of the step; when
every row is done the remaining loops exit at once.

Token draw (`draw.py`): `filter_logits` (top-k, then top-p) on logits / τ, then one
categorical draw per row by inverse CDF (`draw_categorical`; one uniform per row instead of
Gumbel noise over [B, V]); greedy is argmax. `logprobs` are always of the unfiltered
softmax(logits / τ) (see `sample`).

Buckets: the prompt width fed to the model is the smallest entry of `buckets` that holds the
longest real prompt, capped at the input width (the rule of `rollout.stage.bucket_prompts`), so the
compiled shapes come from `buckets` ∪ {input width}. `DEFAULT_BUCKETS` are the powers of two
16 … 32768. Both jitted functions are module level with the model config and sampling options
static, so jax's cache reuses them: a new prompt batch of a known bucket never recompiles
(end ids and the pad id are data, not static).

Shape letters: N prompts, G samples per prompt, B = N·G rows (the G samples of a prompt
contiguous), P prompt slots (the bucket), T response tokens (= max_new_tokens), V vocab,
E end-token ids. Prompt-cache arrays carry the letter Q for their rows: Q = N when the
prefix is shared, Q = B when it is not.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from gspo_jax import models, sharding
from gspo_jax.algorithm.old_policy import BiasedPiOldWarning, warn_if_biased_pi_old
from gspo_jax.models import partition
from gspo_jax.sampling import continuous
from gspo_jax.sampling.options import DEFAULT_BUCKETS, EngineOptions, SampleOptions
from gspo_jax.sampling.output import SampleOutput
from gspo_jax.sampling.replicas import replica_count
from gspo_jax.sampling.static import SamplerState, sample_static, segment_count

__all__ = [
    "DEFAULT_BUCKETS",
    "BiasedPiOldWarning",
    "SampleOptions",
    "SampleOutput",
    "SamplerState",
    "choose_bucket",
    "sample",
    "sample_with",
    "warn_if_biased_pi_old",
]

F32 = jnp.float32

# --------------------------------------------------------------------------------- pytrees


# ------------------------------------------------------------------------------- host side


def choose_bucket(longest: int, width: int, buckets=DEFAULT_BUCKETS) -> int:
    """Smallest bucket ≥ longest, capped at the input width (the width if none fits)."""
    fitting = [b for b in sorted(buckets) if b >= longest]
    return min(fitting[0] if fitting else width, width)


def _prompt_summary(tokens_NP, mask_NP):
    """(real length [N], left-padded [N] bool, mask entries not 0/1, smallest id, largest id):
    padding only before the first real token; ids checked everywhere, padding included (an
    out-of-range id at a masked position still reaches the embedding lookup)."""
    m = mask_NP != 0
    seen = jnp.cumsum(m, axis=1) > 0
    bad_mask = jnp.sum((mask_NP != 0) & (mask_NP != 1), dtype=jnp.int32)
    return (
        jnp.sum(m, axis=1, dtype=jnp.int32),
        jnp.all(m | ~seen, axis=1),
        bad_mask,
        jnp.min(tokens_NP),
        jnp.max(tokens_NP),
    )


@functools.cache
def _replicated_prompt_summary(sharding):
    return jax.jit(_prompt_summary, out_shardings=(sharding,) * 5)


def _host_prompt_summary(tokens_NP, mask_NP):
    """`_prompt_summary` on the host. numpy and fully addressable arrays are read directly
    ([N, P] ints); arrays spread over several processes are reduced where they live and only
    the [N] results and three scalars come back, replicated (the same on every process)."""
    arrays = [x for x in (tokens_NP, mask_NP) if isinstance(x, jax.Array)]
    if all(x.is_fully_addressable for x in arrays):
        tokens, mask = np.asarray(tokens_NP), np.asarray(mask_NP)
        m = mask != 0
        seen = np.cumsum(m, axis=1) > 0
        bad = int(np.sum(m & (mask != 1)))
        return m.sum(axis=1), np.all(m | ~seen, axis=1), bad, tokens.min(), tokens.max()
    mesh = arrays[0].sharding.mesh  # a multi-process array has a NamedSharding
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    out = _replicated_prompt_summary(replicated)(tokens_NP, mask_NP)
    return tuple(np.asarray(x) for x in out)


def _check_prompts(tokens_NP, mask_NP, vocab_size: int):
    """Host-side checks of the prompt arrays (their dtypes, mask values and ids); returns
    (real lengths [N], left-padded [N]) for the later checks."""
    for name, x, kinds in (
        ("prompt_tokens", tokens_NP, "iu"),
        ("prompt_mask", mask_NP, "iubf"),
    ):
        kind = np.dtype(x.dtype).kind if hasattr(x, "dtype") else np.asarray(x).dtype.kind
        if kind not in kinds:
            dtype = getattr(x, "dtype", np.asarray(x).dtype)
            what = "integer token ids" if name == "prompt_tokens" else "0/1 (int, bool or float)"
            raise TypeError(f"{name} must hold {what}, got dtype {dtype}")
    lengths, left_padded, bad_mask, low, high = _host_prompt_summary(tokens_NP, mask_NP)
    if int(bad_mask):
        raise ValueError(
            f"prompt_mask has {int(bad_mask)} value(s) other than 0 and 1; it marks real "
            "tokens (1) and padding (0)"
        )
    if int(low) < 0 or int(high) >= vocab_size:
        bad = int(low) if int(low) < 0 else int(high)
        raise ValueError(
            f"prompt_tokens holds id {bad} outside the vocabulary [0, {vocab_size}) "
            "(padding positions included: their ids still reach the embedding)"
        )
    return np.asarray(lengths), np.asarray(left_padded)


def _check_options(
    model_config, num_samples, max_new_tokens, temperature, top_k, top_p, eos_ids, pad_id
):
    V = model_config.vocab_size
    if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)):
        raise TypeError(f"num_samples must be an int, got {num_samples!r}")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)):
        raise TypeError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if isinstance(temperature, bool) or not (
        isinstance(temperature, (int, float, np.integer, np.floating))
        and math.isfinite(temperature)
    ):
        raise TypeError(f"temperature must be a finite number, got {temperature!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and (
        isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1
    ):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and not (
        isinstance(top_p, (int, float, np.integer, np.floating)) and 0.0 < top_p <= 1.0
    ):
        raise ValueError(f"top_p must be None or in (0, 1], got {top_p!r}")
    if eos_ids is None:
        eos_ids = tuple(model_config.eos_token_ids)
        if not eos_ids:
            raise ValueError(
                "eos_ids=None but model_config.eos_token_ids is empty: pass the end-token ids "
                "explicitly (eos_ids=() samples every row to max_new_tokens)"
            )
    if isinstance(eos_ids, (int, np.integer)):
        eos_ids = (eos_ids,)
    eos_ids = tuple(int(e) for e in eos_ids)
    bad = [e for e in eos_ids if not 0 <= e < V]
    if bad:
        raise ValueError(f"eos_ids {bad} outside the vocabulary [0, {V})")
    if not 0 <= int(pad_id) < V:
        raise ValueError(f"pad_id={pad_id} outside the vocabulary [0, {V})")
    return eos_ids


def sample(
    model_config,
    params,
    prompt_tokens,
    prompt_mask,
    rng,
    *,
    num_samples: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_ids=None,
    pad_id: int = 0,
    max_prompt_length: int | None = None,
    buckets=DEFAULT_BUCKETS,
    share_prefix: bool = True,
    max_cache_len: int | None = None,
    logprobs_as_pi_old: bool = False,
    decode_segments: int | None = None,
    engine: str = "continuous",
    num_slots: int | None = None,
    page_size: int = 16,
    kv_budget_tokens: int | None = None,
    drain_levels: int | None = None,
    layout: str = "trainer",
    kv_dtype: str = "auto",
    shared_prefix_attention: bool = True,
) -> SampleOutput:
    """Samples `num_samples` (G) responses for each of N left-padded prompts.

    Args:
      model_config, params: the policy (`models.ModelConfig`, nested dict of arrays; may be
        sharded — the jitted stages follow the inputs' shardings).
      prompt_tokens, prompt_mask: int [N, P], LEFT padded (mask 1 = real token); numpy or
        jax arrays (possibly sharded over a mesh). Every row needs ≥ 1 real token.
      rng: one PRNG key (typed or raw uint32) for the whole call; token t of row b is drawn
        with fold_in(fold_in(rng, b), t) (`draw.row_keys`): independent of the engine, the
        decode slot and the step it was drawn at.
      num_samples: G; the output has B = N·G rows, the G samples of prompt n contiguous.
      max_new_tokens: T, the response width (fixed, for the trainer).
      temperature: τ; 0 is greedy (argmax).
      top_k, top_p: filters applied to logits / τ before the draw (see `filter_logits`).
      eos_ids: end-token ids (int or tuple); None takes model_config.eos_token_ids; () never
        stops early. A row ends at its first end token (which has mask 1); later columns hold
        pad_id with mask 0 and log-prob 0.
      pad_id: token id written after the end (and in unused columns).
      max_prompt_length: if given, a row with more real tokens is an error.
      buckets: allowed prompt widths (see the module docstring).
      share_prefix: one prefill per prompt whose cache serves its G samples (default); False
        prefills the N·G repeated prompts (same samples for the same rng, G× the prefill).
      max_cache_len: cache-length limit (bucket + max_new_tokens must fit); default
        model_config.max_position_embeddings.
      logprobs_as_pi_old: the caller will use `logprobs` as π_old; warns when that is biased
        (`warn_if_biased_pi_old`).
      decode_segments: time segments of the static engine's response cache (see the
        module docstring); None = max(1, min(4, max_new_tokens // 32)). Speed only.
      engine: "continuous" (the default: continuous batching over a paged KV cache,
        continuous.py) or "static" (every row decodes until the last one ends; faster on
        CPU for small models and short, even lengths). Both give the same tokens for the
        same rng and log-probs equal to float rounding.
      num_slots: continuous decode rows S; fewer slots than sequences make a queue that
        finished slots take from. None: `continuous.default_num_slots` (one per sequence up
        to the rows a step costs about the same for on the platform, 256 on TPU and 16 on
        CPU, else about a quarter of the sequences; never more than kv_budget_tokens holds
        at full length).
      page_size: tokens per KV page (continuous).
      kv_budget_tokens: response tokens the page pool holds at once (continuous); None =
        every slot at full length. A smaller budget makes rows wait or be preempted and
        rerun (same results); less than one full-length sequence is an error.
      drain_levels: once the queue is empty, the continuous loop halves its width (rows
        computed per step) up to this many times as rows end (each level is one more
        compiled copy of the decode step; 0 keeps num_slots rows to the end). None (the
        default): at most 2 levels, none narrower than `continuous.DRAIN_MIN_WIDTH` rows.
      layout: how the stages lay the work out on the mesh in context (`jax.set_mesh`; no
        effect without one). "trainer" (the default): the trainer's rules, rows over the
        batch axes, each weight gathered whole over fsdp once per call (`for_decoding`).
        "tensor": `sharding.ROLLOUT_RULES`, every weight, the KV heads and the vocabulary
        split over fsdp x tensor, rows replicated; tokens are drawn from the
        vocabulary-sharded logits. Give it `sampling.RolloutLayout`'s params (compute
        dtype, already in that layout; the RL loop makes them once per step), else each
        call reshards. A mesh with mesh.data or mesh.expert > 1 rejects "tensor". "auto"
        picks "tensor" on a mesh without those axes, else "trainer". Results are the same
        either way, to the float rounding of the tensor-parallel sums.
      kv_dtype: how the decode's keys and values are stored (`models.KV_DTYPES`): "auto"
        (the compute dtype), "bfloat16", "float32", or "int8" (continuous engine only: int8
        pages with a scale per token and kv head, `models.Int8Pages`, about half a bf16
        pool's bytes; the log-probs then carry the quantisation error, docs/benchmarks.md).
      shared_prefix_attention: with int8 pages and share_prefix, a decode step reads a
        prompt's pages once for all its rows (`models.paged_prefix`): the same math.

    Returns `SampleOutput`. `logprobs[b, t]` = log softmax(logits_t / τ)[token_t] in f32, the
    UNFILTERED tempered distribution — what the trainer recomputes with the same τ
    (`logprobs.logprobs_from_logits`, the same arithmetic) — even when top-k/top-p filtered
    the draw; for τ = 0 it is log softmax(logits)[token_t] (τ = 1). logits_t are the model's
    f32 next-token logits given the prompt and tokens 0..t−1. With a float32 model they
    equal `models.forward`'s to ~1e-6 (tested to 1e-5); with bf16 compute, to bf16 rounding
    (the cached decode and the full forward add in different orders).

    Raises ValueError/TypeError on the host, before anything compiles, for: shapes of tokens
    and mask that differ or are not [N, P]; token ids that are not integers, or outside
    [0, vocab_size) anywhere (padding included); mask values other than 0 and 1; a row with
    no real token or with padding after a real token (not left padded); a row longer than
    max_prompt_length; bucket + max_new_tokens beyond the cache limit; num_samples < 1,
    max_new_tokens < 1, temperature < 0, top_k < 1, top_p outside (0, 1], eos / pad ids
    outside the vocabulary, an unknown engine, bad num_slots / page_size / drain_levels, a
    kv_budget_tokens below one full-length response, an unknown kv_dtype or "int8" with the
    static engine.
    """
    return sample_with(
        model_config,
        params,
        prompt_tokens,
        prompt_mask,
        rng,
        options=SampleOptions(
            num_samples=num_samples,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_ids=eos_ids,
            pad_id=pad_id,
            max_prompt_length=max_prompt_length,
            buckets=buckets,
            share_prefix=share_prefix,
            max_cache_len=max_cache_len,
            logprobs_as_pi_old=logprobs_as_pi_old,
            decode_segments=decode_segments,
            engine=engine,
            num_slots=num_slots,
            page_size=page_size,
            kv_budget_tokens=kv_budget_tokens,
            drain_levels=drain_levels,
            layout=layout,
            kv_dtype=kv_dtype,
            shared_prefix_attention=shared_prefix_attention,
        ),
    )


def sample_with(
    model_config, params, prompt_tokens, prompt_mask, rng, *, options: SampleOptions, **changes
) -> SampleOutput:
    """`sample` with its options as one typed `SampleOptions` (what the RL loop binds once:
    config/specs.py's `SamplerSpec.options`), `changes` replacing some of them for this call
    (`eos_ids=()`). The arguments and the checks are `sample`'s."""
    o, cfg = options.replace(**changes) if changes else options, model_config
    eos_ids = _check_options(
        cfg, o.num_samples, o.max_new_tokens, o.temperature, o.top_k, o.top_p, o.eos_ids, o.pad_id
    )
    segments = segment_count(o.max_new_tokens, o.decode_segments)
    temperature = float(o.temperature)
    top_k = None if o.top_k is None or o.top_k >= cfg.vocab_size else int(o.top_k)
    top_p = None if o.top_p is None or o.top_p >= 1.0 else float(o.top_p)
    if o.logprobs_as_pi_old:
        warn_if_biased_pi_old(top_k, top_p, temperature)
    if temperature == 0.0:
        top_k = top_p = None  # greedy: filters change nothing
    prompt_tokens, prompt_mask, lengths = _checked_prompts(
        prompt_tokens, prompt_mask, cfg.vocab_size, o.max_prompt_length
    )
    width = np.shape(prompt_tokens)[1]
    bucket = _bucket_within_cache(
        lengths, width, o.buckets, o.max_new_tokens, o.max_cache_len, cfg.max_position_embeddings
    )
    engine = EngineOptions(
        num_samples=int(o.num_samples),
        max_new_tokens=int(o.max_new_tokens),
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        share_prefix=bool(o.share_prefix),
        drain_levels=_drain_levels(o.drain_levels),
        layout=_layout(o.layout, cfg.num_kv_heads),
        kv_dtype=_kv_dtype(o.kv_dtype, o.engine),
        shared_prefix_attention=bool(o.shared_prefix_attention),
    )
    B = np.shape(prompt_tokens)[0] * int(o.num_samples)
    page_plan = _page_plan(
        o.engine, B, bucket, engine, o.num_slots, o.page_size, o.kv_budget_tokens
    )
    tokens_NP = _trim_to_int32(prompt_tokens, bucket)
    mask_NP = _trim_to_int32(prompt_mask, bucket)
    # numpy, not device arrays: the same on every process of a multi-host run.
    eos_E = np.asarray(eos_ids, np.int32).reshape(len(eos_ids))
    if o.engine == "static":
        return sample_static(
            cfg, params, tokens_NP, mask_NP, rng, eos_E, o.pad_id, engine, segments
        )
    return _sample_continuous(
        cfg, params, tokens_NP, mask_NP, rng, eos_E, o.pad_id, engine, page_plan
    )


def _sample_continuous(cfg, params, tokens_NP, mask_NP, rng, eos_E, pad_id, options, page_plan):
    """The continuous engine (continuous.py) as a `SampleOutput`."""
    out = continuous.run(
        cfg,
        params,
        tokens_NP,
        mask_NP,
        rng,
        eos_E,
        np.int32(pad_id),
        options=options,
        page_plan=page_plan,
    )
    tokens, mask, logprobs, lengths, truncated, tokens_BP, mask_BP, stats = out
    return SampleOutput(
        tokens=tokens,
        mask=mask,
        logprobs=logprobs,
        lengths=lengths,
        truncated=truncated,
        prompt_tokens=tokens_BP,
        prompt_mask=mask_BP,
        num_steps=jnp.max(lengths),
        row_steps=stats.row_steps,
        preemptions=stats.preemptions,
    )


ENGINES = ("continuous", "static")


def _layout(layout, kv_heads: int) -> str:
    """`layout` resolved against the mesh in context ("auto" -> "tensor" or "trainer");
    ValueError for an unknown one, or "tensor" on a mesh with data / expert replicas."""
    if layout not in sharding.ROLLOUT_LAYOUTS:
        raise ValueError(f"layout={layout!r}: expected one of {sharding.ROLLOUT_LAYOUTS}")
    mesh = partition.context_mesh()
    if mesh is None:
        return "trainer" if layout == "auto" else layout
    return sharding.resolve_rollout_layout(layout, dict(mesh.shape), "layout", kv_heads)


def _kv_dtype(kv_dtype, engine) -> str:
    """`kv_dtype` checked: one of `models.KV_DTYPES`; "int8" only for the continuous engine
    (the static engine's dense caches have no scales)."""
    if kv_dtype not in models.KV_DTYPES:
        raise ValueError(f"kv_dtype={kv_dtype!r}: expected one of {models.KV_DTYPES}")
    if kv_dtype == "int8" and engine == "static":
        raise ValueError(
            'kv_dtype="int8" needs engine="continuous" (int8 KV pages); the static engine '
            "stores its caches in a float dtype"
        )
    return kv_dtype


def _drain_levels(drain_levels) -> int | None:
    if drain_levels is None:
        return None
    if (
        isinstance(drain_levels, bool)
        or not isinstance(drain_levels, (int, np.integer))
        or drain_levels < 0
    ):
        raise ValueError(f"drain_levels must be None or an int >= 0, got {drain_levels!r}")
    return int(drain_levels)


def _page_plan(engine, num_sequences, bucket, options, num_slots, page_size, kv_budget_tokens):
    """The continuous engine's `continuous.plan` (None for "static"); ValueError for an
    unknown engine or bad slot / page / budget options, before anything compiles."""
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r}: expected one of {ENGINES}")
    if engine == "static":
        return None
    return continuous.plan(
        num_sequences,
        bucket,
        options.max_new_tokens,
        num_slots=num_slots,
        page_size=page_size,
        kv_budget_tokens=kv_budget_tokens,
        replicas=replica_count(partition.context_mesh(), options.layout),
    )


def _checked_prompts(prompt_tokens, prompt_mask, vocab_size: int, max_prompt_length):
    """`sample`'s prompt checks (shapes, dtypes, ids, mask values, one real token per row,
    left padding, max_prompt_length), on the host before anything compiles. Returns the
    prompts (numpy unless they were jax arrays) and their real lengths [N]."""
    tokens_shape = tuple(np.shape(prompt_tokens))
    mask_shape = tuple(np.shape(prompt_mask))
    if len(tokens_shape) != 2 or tokens_shape != mask_shape:
        raise ValueError(
            f"prompt_tokens {tokens_shape} and prompt_mask {mask_shape} must both be [N, P]"
        )
    N, width = tokens_shape
    if N == 0 or width == 0:
        raise ValueError(f"empty prompt batch: prompt_tokens has shape {tokens_shape}")
    if not isinstance(prompt_tokens, jax.Array):
        prompt_tokens = np.asarray(prompt_tokens)
    if not isinstance(prompt_mask, jax.Array):
        prompt_mask = np.asarray(prompt_mask)
    lengths, left_padded = _check_prompts(prompt_tokens, prompt_mask, vocab_size)
    empty = np.flatnonzero(lengths == 0)
    if empty.size:
        raise ValueError(f"empty prompt: row(s) {empty.tolist()} of prompt_mask have no real token")
    not_left = np.flatnonzero(~left_padded)
    if not_left.size:
        raise ValueError(
            f"prompt row(s) {not_left.tolist()} are not left padded (a 0 in prompt_mask after "
            "a real token); the sampler continues from the last column of every row"
        )
    if max_prompt_length is not None:
        too_long = np.flatnonzero(lengths > max_prompt_length)
        if too_long.size:
            rows = ", ".join(f"row {r}: {lengths[r]} tokens" for r in too_long[:8])
            raise ValueError(f"prompt(s) longer than max_prompt_length={max_prompt_length}: {rows}")
    return prompt_tokens, prompt_mask, lengths


def _bucket_within_cache(
    lengths, width: int, buckets, max_new_tokens: int, max_cache_len, max_position_embeddings
) -> int:
    """The prompt bucket for the longest prompt (`choose_bucket`); an error when it plus the
    response exceeds the cache limit (max_cache_len, default max_position_embeddings)."""
    longest = int(lengths.max())
    bucket = choose_bucket(longest, width, buckets)
    limit = max_position_embeddings if max_cache_len is None else int(max_cache_len)
    if bucket + max_new_tokens > limit:
        raise ValueError(
            f"prompt bucket {bucket} (longest prompt {longest}) + max_new_tokens "
            f"{max_new_tokens} = {bucket + max_new_tokens} exceeds the cache limit {limit} "
            f"({'max_cache_len' if max_cache_len is not None else 'max_position_embeddings'})"
        )
    return bucket


def _trim_to_int32(x_NP, bucket: int):
    """The last `bucket` columns as int32 (numpy is sliced before it goes to the device)."""
    if not isinstance(x_NP, jax.Array):
        x_NP = np.asarray(x_NP)
        return jnp.asarray(x_NP[:, x_NP.shape[1] - bucket :].astype(np.int32))
    x_NP = x_NP[:, x_NP.shape[1] - bucket :]
    return x_NP if x_NP.dtype == jnp.int32 else x_NP.astype(jnp.int32)
