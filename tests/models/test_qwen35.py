"""Hybrid Qwen3.5 (Gated DeltaNet + gated attention, dense and MoE) against transformers and
against itself (fixtures from tests/fixtures/make_qwen35_fixtures.py).

Specification: the gated delta rule's recurrent form equals a float64 NumPy loop of its
definition, and the chunked form equals the recurrent one for any chunk size and carried
state (its blocked unit-triangular solve equals a float64 solve, its gradient autodiff of a
triangular solve); the causal conv carried by its window equals one pass; with segment resets (packed
rows) the chunked rule and the conv equal each segment alone; f32 logits within 1e-4 of
transformers at every real token (dense; MoE within twice transformers' own f32-vs-f64
error on the same inputs), with and without left padding; the vision-language
checkpoint's text part loads to the same model; save -> load gives identical logits;
greedy sampling (static and continuous engines, the latter reusing slots) equals
transformers' generate and the trainer's log-probs; bad config.json / tensors fail with one line naming the key or tensor and the file.
"""

import dataclasses
import functools
import itertools
import json
import logging
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (bf16 in safetensors.numpy)
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from gspo_jax import models, sampling
from gspo_jax.models import deltanet

FIXTURES = Path(__file__).parents[1] / "fixtures" / "models"


def _rule_inputs(seed, B=2, L=11, J=2, H=4, dk=8, dv=8):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, L, J, dk)).astype(np.float32)
    k = rng.normal(size=(B, L, J, dk)).astype(np.float32)
    v = rng.normal(size=(B, L, H, dv)).astype(np.float32)
    g = -rng.uniform(0.01, 1.5, size=(B, L, H)).astype(np.float32)
    beta = rng.uniform(0.05, 0.95, size=(B, L, H)).astype(np.float32)
    state = rng.normal(size=(B, H, dk, dv)).astype(np.float32)
    return q, k, v, g, beta, state


def _numpy_rule(q, k, v, g, beta, state):
    """S ← e^g S; S ← S + k ⊗ β(v − Sᵀk); out = Sᵀq, per value head, float64 (module docstring)."""
    q, k, v, g, beta, S = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, state))
    B, L, H, _ = v.shape
    rep = H // q.shape[2]
    out = np.zeros(v.shape)
    S = S.copy()
    for b in range(B):
        for h in range(H):
            for t in range(L):
                qt, kt = q[b, t, h // rep], k[b, t, h // rep]
                kt = kt / np.sqrt((kt**2).sum() + 1e-6)
                qt = qt / np.sqrt((qt**2).sum() + 1e-6) / np.sqrt(len(qt))
                S[b, h] *= np.exp(g[b, t, h])
                S[b, h] += np.outer(kt, beta[b, t, h] * (v[b, t, h] - S[b, h].T @ kt))
                out[b, t, h] = S[b, h].T @ qt
    return out, S


def test_recurrent_rule_is_its_definition():
    q, k, v, g, beta, state = _rule_inputs(0)
    out, final = jax.jit(deltanet.recurrent_gated_delta_rule)(q, k, v, g, beta, state)
    want_out, want_final = _numpy_rule(q, k, v, g, beta, state)
    np.testing.assert_allclose(out, want_out, atol=2e-5)
    np.testing.assert_allclose(final, want_final, atol=2e-5)


@pytest.mark.parametrize("chunk", [1, 3, 4, 16, 64])
def test_chunked_rule_equals_the_recurrent_one(chunk):
    q, k, v, g, beta, state = _rule_inputs(1)
    rec_out, rec_state = deltanet.recurrent_gated_delta_rule(q, k, v, g, beta, state)
    out, final = jax.jit(deltanet.chunk_gated_delta_rule, static_argnames="chunk_size")(
        q, k, v, g, beta, state, chunk_size=chunk
    )
    np.testing.assert_allclose(out, rec_out, atol=2e-5)
    np.testing.assert_allclose(final, rec_state, atol=2e-5)


def test_chunked_rule_gradients_equal_the_recurrent_ones():
    """The chunked form's hand-written solve gradient (deltanet._solve_bwd): d(Σ w·out +
    Σ u·state) with respect to every input, chunked (two chunks and a padded tail) vs
    autodiff through the recurrent scan."""
    inputs = _rule_inputs(4)
    rng = np.random.default_rng(5)
    w = rng.normal(size=inputs[2].shape).astype(np.float32)
    u = rng.normal(size=inputs[-1].shape).astype(np.float32)

    def loss(rule, *args):
        out, state = rule(*args)
        return jnp.sum(out * w) + jnp.sum(state * u)

    chunked = functools.partial(deltanet.chunk_gated_delta_rule, chunk_size=4)
    got = jax.jit(jax.grad(functools.partial(loss, chunked), argnums=range(6)))(*inputs)
    rule = deltanet.recurrent_gated_delta_rule
    want = jax.jit(jax.grad(functools.partial(loss, rule), argnums=range(6)))(*inputs)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "state"), got, want):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("C", [3, 64])
def test_blocked_unit_lower_solve_and_its_gradient_equal_a_triangular_solve(C):
    """deltanet._unit_lower_solve (inverse by recursive blocks, C padded to a power of 2)
    equals a float64 solve, and its hand-written gradient equals autodiff through
    jax.scipy's triangular solve; only a's strictly lower part is read."""
    rng = np.random.default_rng(C)
    a = rng.normal(size=(2, C, C)).astype(np.float32)  # diagonal and upper part: ignored
    b, w = (rng.normal(size=(2, C, 5)).astype(np.float32) for _ in range(2))
    unit = np.tril(a.astype(np.float64), -1) + np.eye(C)
    got = deltanet._unit_lower_solve(a, b)
    np.testing.assert_allclose(got, np.linalg.solve(unit, b), atol=2e-5 * np.abs(got).max())

    def reference(a, b):
        strict = jnp.where(np.tril(np.ones((C, C), bool), -1), a, 0.0)
        return jax.scipy.linalg.solve_triangular(strict, b, lower=True, unit_diagonal=True)

    def loss(solve, a, b):
        return jnp.sum(solve(a, b) * w)

    got = jax.grad(functools.partial(loss, deltanet._unit_lower_solve), (0, 1))(a, b)
    want = jax.grad(functools.partial(loss, reference), (0, 1))(a, b)
    for name, x, y in zip(("a", "b"), got, want):
        np.testing.assert_allclose(x, y, atol=2e-5 * np.abs(y).max(), err_msg=name)


def test_a_sequence_split_in_two_carries_its_state_and_conv_window():
    """Prefill of the first 7 tokens, then the rest from the carried (window, state): the
    chunked+recurrent path a sampler takes equals one chunked pass."""
    q, k, v, g, beta, _ = _rule_inputs(2)
    whole, _ = deltanet.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=4)
    first, state = deltanet.chunk_gated_delta_rule(
        *(x[:, :7] for x in (q, k, v, g, beta)), chunk_size=4
    )
    rest, _ = deltanet.recurrent_gated_delta_rule(*(x[:, 7:] for x in (q, k, v, g, beta)), state)
    np.testing.assert_allclose(np.concatenate([first, rest], 1), whole, atol=2e-5)

    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 9, 6)).astype(np.float32)
    w = rng.normal(size=(6, 4)).astype(np.float32)
    y, _ = deltanet.causal_conv(x, w)
    y1, window = deltanet.causal_conv(x[:, :5], w)
    y2, _ = deltanet.causal_conv(x[:, 5:], w, window)
    np.testing.assert_allclose(np.concatenate([y1, y2], 1), y, atol=1e-6)
    # y_t = silu(Σ_j w[:, j] x_{t-3+j}): at t = 0 only the last tap sees a real input.
    np.testing.assert_allclose(y[:, 0], jax.nn.silu(x[:, 0] * w[:, 3]), atol=1e-6)


def test_segment_resets_equal_each_segment_alone(chunk=4):
    """Packed rows (reset_BL): segments starting at 0, 4, 5 and 9 of 11 tokens (a length-1
    segment, starts on and off chunk boundaries), row 1 without resets but with a carried
    state: the chunked rule and the conv equal each segment run alone from a zero state."""
    q, k, v, g, beta, state = _rule_inputs(4)
    reset = np.zeros((2, 11), bool)
    reset[0, [0, 4, 5, 9]] = True
    fn = jax.jit(deltanet.chunk_gated_delta_rule, static_argnames="chunk_size")
    out, final = fn(q, k, v, g, beta, state, chunk_size=chunk, reset_BL=reset)
    rec_out, rec_state = deltanet.recurrent_gated_delta_rule(q, k, v, g, beta, state)
    np.testing.assert_allclose(out[1], rec_out[1], atol=2e-5)
    np.testing.assert_allclose(final[1], rec_state[1], atol=2e-5)
    rng = np.random.default_rng(5)
    x = rng.normal(size=(2, 11, 6)).astype(np.float32)
    w = rng.normal(size=(6, 4)).astype(np.float32)
    y, _ = deltanet.causal_conv(x, w, reset_BL=reset)
    np.testing.assert_allclose(y[1], deltanet.causal_conv(x, w)[0][1], atol=1e-6)
    for a, b in itertools.pairwise([0, 4, 5, 9, 11]):
        alone, s = deltanet.recurrent_gated_delta_rule(*(z[:1, a:b] for z in (q, k, v, g, beta)))
        np.testing.assert_allclose(out[0, a:b], alone[0], atol=2e-5)
        np.testing.assert_allclose(y[0, a:b], deltanet.causal_conv(x[:1, a:b], w)[0][0], atol=1e-6)
    np.testing.assert_allclose(final[0], s[0], atol=2e-5)
    grads = jax.grad(lambda g_: fn(q, k, v, g_, beta, chunk_size=chunk, reset_BL=reset)[0].sum())(g)
    assert np.all(np.isfinite(grads))  # no inf − inf behind the zeroed decays


@pytest.fixture(scope="module", params=["qwen35", "qwen35_moe"])
def family(request):
    cfg, params = models.load_pretrained(FIXTURES / request.param)
    ref = dict(np.load(FIXTURES / f"reference_{request.param}.npz"))
    return request.param, cfg, params, ref


def test_fixture_configs_cover_the_hybrid_pattern(family):
    name, cfg, _, _ = family
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert cfg.linear_num_key_heads < cfg.linear_num_value_heads  # grouped value heads
    assert cfg.rotary_dim == 4 < cfg.head_dim  # partial rotary
    assert cfg.num_moe_layers == (4 if name == "qwen35_moe" else 0)
    assert cfg.tie_word_embeddings == (name == "qwen35_moe")


@pytest.mark.parametrize("case", ["full", "left"])
def test_logits_match_transformers(family, case):
    name, cfg, params, ref = family
    mask = ref[f"mask_{case}"]
    logits = models.forward(cfg, params, jnp.asarray(ref["tokens"]), jnp.asarray(mask))
    err = np.abs(np.where(mask[..., None], np.asarray(logits) - ref[f"logits_{case}"], 0)).max()
    # transformers' own float32 rounding moves the MoE fixture's logits by
    # f32_vs_f64_error (1.1e-4; 1.8e-5 for the dense one): the bound cannot be tighter.
    bound = max(1e-4, 2 * float(ref["f32_vs_f64_error"]))
    assert err <= bound, (name, case, err)


def test_chunk_size_and_scan_do_not_change_the_logits(family):
    _, cfg, params, ref = family
    tokens, mask = jnp.asarray(ref["tokens"]), jnp.asarray(ref["mask_left"])
    base = np.asarray(models.forward(cfg, params, tokens, mask))
    for change in ({"deltanet_chunk_size": 3}, {"scan_layers": False}):
        other = np.asarray(models.forward(dataclasses.replace(cfg, **change), params, tokens, mask))
        real = ref["mask_left"][..., None].astype(bool)
        # Only rounding changes: bounded by the model's own sensitivity to it.
        bound = max(2e-5, float(ref["f32_vs_f64_error"]))
        assert np.abs(np.where(real, other - base, 0)).max() < bound, change


def _write_vision_language(src: Path, dst: Path) -> None:
    """The fixture as Qwen3_5ForConditionalGeneration ships: nested text_config, language
    model under model.language_model., plus vision-tower and MTP tensors."""
    hf = json.loads((src / "config.json").read_text())
    text = {k: v for k, v in hf.items() if k not in ("architectures", "tie_word_embeddings")}
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "vision_config": {"depth": 1, "hidden_size": 8},
        "tie_word_embeddings": hf["tie_word_embeddings"],
    }
    tensors = {
        (k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
        for k, v in load_file(src / "model.safetensors").items()
    }
    tensors["model.visual.patch_embed.proj.weight"] = np.ones((8, 3), np.float32)
    tensors["mtp.fc.weight"] = np.ones((4, 4), np.float32)
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(dst / "model.safetensors"))


def test_the_vision_language_checkpoints_text_part_loads(tmp_path, caplog):
    cfg, params = models.load_pretrained(FIXTURES / "qwen35")
    _write_vision_language(FIXTURES / "qwen35", tmp_path / "vl")
    with caplog.at_level(logging.INFO, logger="gspo_jax.models.hf_io"):
        vl_cfg, vl_params = models.load_pretrained(tmp_path / "vl")
    assert vl_cfg == cfg
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), params, vl_params))
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) == 1 and "2 vision-tower / multi-token-prediction" in skipped[0]


def test_save_then_load_gives_identical_logits(family, tmp_path):
    _, cfg, params, ref = family
    models.save_pretrained(cfg, params, tmp_path / "out")
    hf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hf["rope_parameters"]["partial_rotary_factor"] == cfg.partial_rotary_factor
    cfg2, params2 = models.load_pretrained(tmp_path / "out")
    assert cfg2 == cfg
    tokens, mask = jnp.asarray(ref["tokens"]), jnp.asarray(ref["mask_left"])
    a = models.forward(cfg, params, tokens, mask)
    b = models.forward(cfg2, params2, tokens, mask)
    assert bool((a == b).all())


def _edited(tmp_path, edit_config=None, edit_tensors=None) -> Path:
    dst = tmp_path / "bad"
    shutil.copytree(FIXTURES / "qwen35", dst)
    if edit_config:
        hf = json.loads((dst / "config.json").read_text())
        edit_config(hf)
        (dst / "config.json").write_text(json.dumps(hf))
    if edit_tensors:
        tensors = load_file(dst / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_bad_checkpoints_fail_naming_the_key_and_file(tmp_path):
    def unknown_type(hf):
        hf["layer_types"][1] = "sliding_attention"

    path = _edited(tmp_path, edit_config=unknown_type)
    with pytest.raises(ValueError, match=r"config\.json.*layer_types\[1\]='sliding_attention'"):
        models.load_pretrained(path)
    shutil.rmtree(path)

    path = _edited(tmp_path, edit_tensors=lambda t: t.pop("model.layers.2.linear_attn.A_log"))
    with pytest.raises(KeyError, match=r"bad.*missing 1 tensor.*layers\.2\.linear_attn\.A_log"):
        models.load_pretrained(path)
    shutil.rmtree(path)

    def three_taps(hf):
        hf["linear_conv_kernel_dim"] = 3

    path = _edited(tmp_path, edit_config=three_taps)
    with pytest.raises(ValueError, match=r"conv1d\.weight.*model\.safetensors.*\[64, 1, 4\]"):
        models.load_pretrained(path)


def _greedy(cfg, params, ref, **engine):
    """Greedy `sampling.sample` of the fixture's generation prompts, 2 samples each, for as
    many tokens as transformers' reference generated, with the given engine options."""
    prompt = ref["gen_prompt_tokens"]
    return sampling.sample(
        cfg,
        params,
        prompt,
        ref["gen_prompt_mask"],
        jax.random.key(0),
        num_samples=2,
        max_new_tokens=ref["gen_tokens"].shape[1],
        temperature=0.0,
        eos_ids=(),
        buckets=(prompt.shape[1],),
        **engine,
    )


def _trainer_gap(cfg, params, out) -> float:
    """Largest |sampler log-prob − the trainer's recomputation| (one full-sequence pass over
    prompt + response) over the sampled tokens."""
    tokens = jnp.concatenate([out.prompt_tokens, out.tokens], axis=1)
    mask = jnp.concatenate([out.prompt_mask, out.mask], axis=1)
    P = out.prompt_tokens.shape[1]
    logits = models.forward(cfg, params, tokens, mask)[:, P - 1 : -1]
    trainer = jnp.take_along_axis(jax.nn.log_softmax(logits), out.tokens[..., None], -1)[..., 0]
    return float(jnp.abs(trainer - out.logprobs).max())


def test_greedy_static_sampling_matches_transformers_generate(family):
    """`sampling.sample` (static engine: chunked prefill, recurrent decode) greedy ==
    transformers' greedy generate token for token, and the sampler's log-probs equal the
    trainer's recomputation (one chunked full-sequence pass over prompt + response)."""
    name, cfg, params, ref = family
    out = _greedy(
        cfg,
        params,
        ref,
        engine="static",
        decode_segments=2,
    )
    np.testing.assert_array_equal(np.asarray(out.tokens)[::2], ref["gen_tokens"])
    np.testing.assert_array_equal(np.asarray(out.tokens)[1::2], ref["gen_tokens"])
    bound = max(1e-4, 2 * float(ref["f32_vs_f64_error"]))
    np.testing.assert_allclose(np.asarray(out.logprobs)[::2], ref["gen_logprobs"], atol=bound)

    gap = _trainer_gap(cfg, params, out)
    assert gap < (5e-5 if name == "qwen35" else bound), gap  # measured 1.7e-5 / 1.8e-5


def test_greedy_continuous_sampling_reuses_slots_and_matches_transformers():
    """The continuous engine on a hybrid model: 6 sequences through 3 slots (each slot
    refilled from the queue, its DeltaNet states reset from its prompt's prefill), a KV
    budget that makes rows wait and be preempted, and a drain to fewer slots: greedy tokens
    equal transformers' generate (hence the static engine's, tested above), and the sampler's
    log-probs equal the trainer's recomputation (f32). The dense fixture: the MoE one keeps
    the same per-slot states, and each fixture costs a compile of the engine."""
    cfg, params = models.load_pretrained(FIXTURES / "qwen35")
    ref = dict(np.load(FIXTURES / "reference_qwen35.npz"))
    out = _greedy(
        cfg,
        params,
        ref,
        engine="continuous",
        num_slots=3,
        page_size=4,
        kv_budget_tokens=16,
        drain_levels=1,
    )
    assert int(out.preemptions) > 0  # rows waited for pages and were decoded again
    np.testing.assert_array_equal(np.asarray(out.tokens)[::2], ref["gen_tokens"])
    np.testing.assert_array_equal(np.asarray(out.tokens)[1::2], ref["gen_tokens"])
    gap = _trainer_gap(cfg, params, out)
    assert gap < 5e-5, gap  # measured 1.9e-5 (the static engine's: 1.7e-5)


def test_routing_replay_forces_the_moe_fixtures_experts():
    """Routing Replay's model half on Qwen3.5-MoE (routed experts + shared expert, DeltaNet
    layers between): forcing the model's own routing reproduces its routing exactly and its
    logits within f32 rounding (two programs, fused differently: the bound is the fixture's
    f32-vs-f64 spread, as for the parity test; measured 4.8e-5), forcing other experts moves
    every real token's (the shared expert alone does not decide them)."""
    cfg, params = models.load_pretrained(FIXTURES / "qwen35_moe")
    ref = dict(np.load(FIXTURES / "reference_qwen35_moe.npz"))
    tokens, mask = jnp.asarray(ref["tokens"]), jnp.asarray(ref["mask_left"])
    fwd = jax.jit(models.forward_with_routing, static_argnums=0)
    logits, routing = fwd(cfg, params, tokens, mask)
    assert routing.shape == (cfg.num_moe_layers, *tokens.shape, cfg.num_experts_per_tok)
    replay, replay_routing = fwd(cfg, params, tokens, mask, routing=routing)
    np.testing.assert_array_equal(replay_routing, routing)
    bound = max(1e-4, 2 * float(ref["f32_vs_f64_error"]))
    np.testing.assert_allclose(replay, logits, atol=bound)
    other, _ = fwd(cfg, params, tokens, mask, routing=(routing + 1) % cfg.num_experts)
    valid = np.asarray(mask).astype(bool)
    moved = np.abs(np.asarray(other) - np.asarray(logits)).max(-1)  # per token, over vocab
    assert moved[valid].min() > 10 * bound
