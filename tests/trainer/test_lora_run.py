"""LoRA through the RL loop (model.lora_rank > 0) on the tiny end-to-end config: only the
adapters train and are checkpointed, π_ref is the frozen base, a restored run continues
exactly, and the exports (merged weights, PEFT adapters) come out."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_config
from safetensors.numpy import load_file

from gspo_jax import models
from gspo_jax.models import lora
from gspo_jax.trainer import loop, setup
from gspo_jax.trainer.io import checkpoint


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(trainer, state after the warm start, the first RL step's prompts)."""
    root = tmp_path_factory.mktemp("lora")
    config = tiny_config(root / "data")
    config.checkpoint.async_save = False
    config.model.lora_rank, config.model.lora_alpha = 4, 8.0
    config.use_kl_loss, config.kl_loss_coef = True, 0.01  # π_ref: the base, no copy
    trainer = setup.setup(config, str(root / "run"))
    state = loop.init_or_restore(trainer)
    yield trainer, state, next(trainer.train_iter)
    trainer.close()


def _copy(state):
    """The train step donates its state: the tests step copies of the shared one."""
    return state.replace(train=jax.tree.map(jnp.copy, state.train))


def _step(trainer, state, prompts):
    return loop.train_on(trainer, state, trainer.rollouts.collect(state, prompts))


def test_only_the_adapters_train(run):
    trainer, state0, prompts = run
    assert state0.ref_params is None and os.path.isdir(f"{trainer.workdir}/lora_base")
    frozen0, adapters0 = lora.partition(state0.train.params)
    moments = [x.shape for x in jax.tree.leaves(state0.train.opt_state) if x.ndim]
    assert sorted(moments) == sorted(2 * [x.shape for x in jax.tree.leaves(adapters0)])
    state1, metrics = _step(trainer, _copy(state0), prompts)
    frozen1, adapters1 = lora.partition(state1.train.params)
    jax.tree.map(np.testing.assert_array_equal, frozen1, frozen0)
    b = adapters1["layers"]["attn"]["q_proj"]["lora_b"]
    assert np.abs(np.asarray(b)).max() > 0  # B left zero: the adapters moved
    assert metrics["policy/skipped_updates"] == 0 and np.isfinite(metrics["policy/kl_loss"])
    # π_old recomputed at the incoming params: the first update's ratios are exactly 1.
    assert float(metrics["policy/ratio_noise_floor"]) == 0.0


def test_checkpoint_holds_the_adapters_and_resume_continues_exactly(run):
    trainer, state0, prompts = run
    state1, _ = _step(trainer, _copy(state0), prompts)
    checkpoint.save(trainer.manager, state1)
    checkpoint.finish(trainer.manager)
    with open(os.path.join(trainer.manager.directory, "1", "meta", "metadata")) as f:
        meta = json.load(f)
    saved = [k for k in meta["digests"] if k.startswith("train/params/")]
    assert saved and all(k.rsplit("/", 1)[1] in ("lora_a", "lora_b") for k in saved), saved
    restored = loop.init_or_restore(trainer)  # base from lora_base/, adapters from step 1
    assert restored.step == 1
    jax.tree.map(np.testing.assert_array_equal, restored.train, state1.train)
    more = next(trainer.train_iter)
    a, metrics_a = _step(trainer, _copy(state1), more)
    b, metrics_b = _step(trainer, restored, more)
    jax.tree.map(np.testing.assert_array_equal, b.train, a.train)
    for key in ("policy/loss", "policy/grad_norm", "reward/mean"):
        assert float(metrics_b[key]) == float(metrics_a[key]), key


def test_exports_merged_weights_and_peft_adapters(run, tmp_path):
    trainer, state0, prompts = run
    state1, _ = _step(trainer, _copy(state0), prompts)
    params = state1.train.params
    cfg, merged = lora.merged(trainer.model_config, params)
    checkpoint.export_hf(cfg, trainer.tokenizer, merged, str(tmp_path / "hf"))
    checkpoint.export_peft(trainer.model_config, params, str(tmp_path / "adapter"))
    loaded_cfg, loaded = models.load_pretrained(tmp_path / "hf")
    assert loaded_cfg.lora_rank == 0 and not lora.has_adapters(loaded)
    tokens = np.asarray(prompts["prompt_tokens"][:2])
    mask = np.asarray(prompts["prompt_mask"][:2])
    np.testing.assert_allclose(
        models.forward(loaded_cfg, loaded, tokens, mask),
        models.forward(trainer.model_config, params, tokens, mask),
        atol=1e-4,
    )
    peft = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    r = trainer.model_config.lora_rank
    name = "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"
    assert peft[name].shape == (trainer.model_config.intermediate_size, r)


def test_gspo_on_the_adapters_raises_the_advantaged_responses(run):
    """Policy improvement through the adapters alone: after one RL step on a rollout whose
    advantages are +1 for half of each group and -1 for the other half, the responses with
    A > 0 gained log-probability relative to those with A < 0 (the tiny warm start scores
    every response 0, so the advantages are set here)."""
    trainer, state0, prompts = run
    rollout = trainer.rollouts.collect(state0, prompts)
    batch = dict(rollout.batch)
    B = batch["advantages"].shape[0]
    sign = np.where(np.arange(B) % 2 == 0, 1.0, -1.0).astype(np.float32)
    batch["advantages"] = jax.device_put(sign, batch["advantages"].sharding)
    length = batch["response_mask"].shape[1]

    def seq_logp(params):
        logp = trainer.rollouts.logprobs_fn(
            params, batch["tokens"], batch["attention_mask"], length
        )[0]
        mask = np.asarray(batch["response_mask"])
        return (np.asarray(logp) * mask).sum(1) / np.maximum(mask.sum(1), 1)

    before = seq_logp(state0.train.params)
    state1, _ = trainer.train_step(_copy(state0).train, batch)
    gain = seq_logp(state1.params) - before
    valid = np.asarray(batch["response_mask"]).sum(1) > 0
    up, down = gain[(sign > 0) & valid].mean(), gain[(sign < 0) & valid].mean()
    assert up - down > 0, (up, down)


def test_a_lora_warm_start_trained_to_a_target_checks_the_base(run):
    """With LoRA the warm start trains the base model; its check samples through the
    run's LoRA evaluator, so the base gets adapters whose B is zero (the base's function)."""
    import dataclasses

    trainer, state, _ = run
    spec = dataclasses.replace(
        trainer.warm_start,
        steps=2,
        max_steps=2,
        check_every=2,
        check_prompts=8,
        target_accuracy=1.0,
    )
    base = jax.tree.map(jnp.copy, lora.partition(state.train.params)[0])  # SFT donates it
    _, result = loop.warm_start(dataclasses.replace(trainer, warm_start=spec), base)
    assert result.steps == 2 and result.reached is False
    assert [s for s, _ in result.checks] == [2] and 0.0 <= result.checks[0][1] <= 1.0
