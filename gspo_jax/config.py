"""The experiment config: start-up validation, and its translation into the pieces' arguments.

`configs/base.py` holds every field and its default; nothing else defines a default. This
module is the one place a config is read into the arguments of the pieces it drives:

  validate(config)                     before anything is compiled or loaded
  model_config(config, tokenizer)      the policy architecture (scratch or Hugging Face)
  step_config(config, model_config)    the train step's static StepConfig
  advantage_kwargs(config)             compute_advantages' options (ROLL's names)
  sampler_kwargs(config, greedy=)      sampling.sample's options
  batch_sizes(config)                  responses, mini-batch and micro-batch sizes

Valid names are read from the registries that define them (objectives, advantages, optim,
models, data), never restated here. Errors name the field and list the valid values;
settings that are legal but far from the paper's (GSPO with a GRPO-sized clip range, GSPO
with a token-sum aggregation) warn with the paper's values.
"""

from __future__ import annotations

import dataclasses
import warnings

from gspo_jax import advantages, models, objectives, optim
from gspo_jax import sharding as sharding_lib
from gspo_jax.data.build import DATASETS
from gspo_jax.models.config import ARCHS, ATTENTION_IMPLS, DTYPES, MOE_IMPLS, REMAT_POLICIES
from gspo_jax.train_step import StepConfig


class ConfigError(ValueError):
    """A config field has a value the trainer cannot run with."""


class ConfigWarning(UserWarning):
    """A config is legal but departs from the paper's settings in a way worth knowing."""


SEQ_MODES = tuple(sorted(objectives.SEQUENCE_LEVEL_IS_MODES))
OLD_LOGPROBS_SOURCES = ("recompute", "sampler")
INVALID_REWARD_RULES = ("mask", "zero")
# GSPO's paper clip range is 3e-4 / 4e-4 (§5.1); anything this large is GRPO-sized.
GSPO_CLIP_WARN = 0.01


def normalize_reward_norm(value: str | None) -> str | None:
    """ROLL writes `reward_norm: null`; on the command line that arrives as "None"/"none"."""
    if value is None or str(value).lower() in ("none", "null", ""):
        return None
    return value


def _choice(name: str, value, valid) -> None:
    valid = tuple(valid)
    if value not in valid:
        raise ConfigError(f"config.{name}={value!r} is not one of {list(valid)}")


def _positive_int(config, name: str) -> int:
    value = _get(config, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"config.{name}={value!r} must be a positive integer")
    return value


def _get(config, dotted: str):
    node = config
    for part in dotted.split("."):
        node = node[part]
    return node


def batch_sizes(config) -> dict[str, int]:
    """The derived sizes of one RL step: responses, mini-batch and micro-batch."""
    responses = config.rollout_batch_size * config.num_return_sequences_in_group
    mini = responses // config.num_mini_batches
    micro = config.micro_batch_size or mini
    return {"responses": responses, "mini_batch": mini, "micro_batch": micro}


def validate(config, *, num_devices: int | None = None, num_processes: int = 1) -> None:
    """Raise ConfigError for a config that cannot run; warn for one far from the paper.

    Args:
      config: the experiment ConfigDict (configs/base.py layout).
      num_devices: devices of the global mesh (default: only checks not needing it).
      num_processes: JAX processes; each must get a whole number of prompts.
    """
    # -- mode names ------------------------------------------------------------------------
    _choice("importance_sampling", config.importance_sampling, objectives.IMPORTANCE_SAMPLING_MODES)
    _choice("loss_agg_mode", config.loss_agg_mode, objectives.LOSS_AGG_MODES)
    _choice("kl_estimator", config.kl_estimator, objectives.KL_ESTIMATORS)
    _choice("adv_estimator", config.adv_estimator, advantages.ADV_ESTIMATORS)
    reward_norm = normalize_reward_norm(config.reward_norm)
    _choice("reward_norm", reward_norm, [None, *[n for n in advantages.REWARD_NORMS if n]])
    _choice("old_logprobs_source", config.old_logprobs_source, OLD_LOGPROBS_SOURCES)
    _choice("invalid_reward", config.invalid_reward, INVALID_REWARD_RULES)
    _choice("optim.schedule", config.optim.schedule, optim.SCHEDULES)
    _choice("model.arch", config.model.arch, ARCHS)
    _choice("model.param_dtype", config.model.param_dtype, DTYPES)
    _choice("model.dtype", config.model.dtype, DTYPES)
    _choice("model.remat", config.model.remat, REMAT_POLICIES)
    _choice("model.moe_impl", config.model.moe_impl, MOE_IMPLS)
    _choice("model.attention_impl", config.model.attention_impl, ATTENTION_IMPLS)
    _choice("data.name", config.data.name, sorted(DATASETS))

    # -- sizes -----------------------------------------------------------------------------
    for name in (
        "num_steps",
        "rollout_batch_size",
        "num_return_sequences_in_group",
        "prompt_length",
        "response_length",
        "ppo_epochs",
        "num_mini_batches",
    ):
        _positive_int(config, name)
    if config.micro_batch_size is not None:
        _positive_int(config, "micro_batch_size")

    n, g = config.rollout_batch_size, config.num_return_sequences_in_group
    sizes = batch_sizes(config)
    responses = sizes["responses"]
    if responses % config.num_mini_batches:
        raise ConfigError(
            f"rollout_batch_size x num_return_sequences_in_group = {n} x {g} = {responses} "
            f"responses do not split into num_mini_batches={config.num_mini_batches} "
            "equal mini-batches"
        )
    mini = sizes["mini_batch"]
    if config.micro_batch_size is not None and mini % config.micro_batch_size:
        raise ConfigError(
            f"a mini-batch of {responses} / {config.num_mini_batches} = {mini} responses does "
            f"not split into micro_batch_size={config.micro_batch_size} micro-batches"
        )
    if num_devices is not None:
        data_parallel = _data_parallel_size(config, num_devices)
        if sizes["micro_batch"] % data_parallel:
            raise ConfigError(
                f"a micro-batch of {sizes['micro_batch']} responses does not split over the "
                f"{data_parallel} data-parallel devices (mesh.data x fsdp x expert) of {num_devices}"
            )
    if n % num_processes:
        raise ConfigError(
            f"rollout_batch_size={n} prompts do not split over {num_processes} JAX processes"
        )
    if num_processes > 1 and num_devices is not None:
        # Each process feeds its own prompt rows to its own devices (no replication across
        # hosts), so prompt batches must split over every data-parallel device.
        data_parallel = _data_parallel_size(config, num_devices)
        for name, rows in (
            ("rollout_batch_size", n),
            ("eval.batch_size", config.eval.batch_size),
        ):
            if rows % data_parallel:
                raise ConfigError(
                    f"config.{name}={rows} prompts do not split over the {data_parallel} "
                    f"data-parallel devices of {num_processes} processes"
                )

    # -- group statistics need a group -----------------------------------------------------
    if g < 2 and config.adv_estimator == "grpo":
        raise ConfigError(
            f"adv_estimator='grpo' normalises within each group, which needs "
            f"num_return_sequences_in_group >= 2 (got {g})"
        )
    if g < 2 and reward_norm == "group":
        raise ConfigError(f"reward_norm='group' needs num_return_sequences_in_group >= 2 (got {g})")

    # -- ranges ------------------------------------------------------------------------------
    if not 0.0 <= config.clip_low < 1.0:
        raise ConfigError(f"config.clip_low={config.clip_low} must be in [0, 1)")
    if not config.clip_high >= 0.0:
        raise ConfigError(f"config.clip_high={config.clip_high} must be >= 0")
    if config.dual_clip_loss and not config.dual_clip_ratio > 1.0:
        raise ConfigError(f"config.dual_clip_ratio={config.dual_clip_ratio} must be > 1")
    for name in ("reward_clip", "advantage_clip"):
        value = config[name]
        if value is not None and not value > 0:
            raise ConfigError(f"config.{name}={value} must be > 0 (or None to switch it off)")
    if config.kl_loss_coef < 0 or config.token_level_kl_coef < 0:
        raise ConfigError("config.kl_loss_coef and config.token_level_kl_coef must be >= 0")
    if config.sampling.temperature < 0:
        raise ConfigError(f"config.sampling.temperature={config.sampling.temperature} < 0")
    if config.sampling.top_k is not None and config.sampling.top_k < 1:
        raise ConfigError(f"config.sampling.top_k={config.sampling.top_k} must be >= 1")
    if config.sampling.top_p is not None and not 0.0 < config.sampling.top_p <= 1.0:
        raise ConfigError(f"config.sampling.top_p={config.sampling.top_p} must be in (0, 1]")
    if config.optim.learning_rate < 0:
        raise ConfigError(f"config.optim.learning_rate={config.optim.learning_rate} < 0")
    if config.data.name == "gsm8k" and not config.data.manual_dir:
        raise ConfigError(
            "config.data.name='gsm8k' needs config.data.manual_dir: a directory holding "
            "train.jsonl and test.jsonl"
        )
    if (
        config.model.routing_replay
        and config.model.arch != "qwen3_moe"
        and not config.model.hf_path
    ):
        raise ConfigError("config.model.routing_replay needs a Mixture-of-Experts model")

    # -- legal, but worth a warning ------------------------------------------------------------
    if config.importance_sampling in SEQ_MODES:
        if max(config.clip_low, config.clip_high) >= GSPO_CLIP_WARN:
            warnings.warn(
                f"GSPO (importance_sampling={config.importance_sampling!r}) with clip range "
                f"({config.clip_low}, {config.clip_high}): sequence ratios sit within ~1e-3 of "
                "1, so a GRPO-sized range almost never clips. The paper uses "
                "clip_low=3e-4, clip_high=4e-4 (§5.1).",
                ConfigWarning,
                stacklevel=2,
            )
        if config.loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
            warnings.warn(
                f"GSPO with loss_agg_mode={config.loss_agg_mode!r} weights each sequence by its "
                "length; the paper's objective (§4.1) averages sequences with 1/|y_i| length "
                "normalisation: loss_agg_mode='seq-mean-token-mean'.",
                ConfigWarning,
                stacklevel=2,
            )
    if config.old_logprobs_source == "sampler":
        if config.sampling.temperature == 0:
            raise ConfigError(
                "old_logprobs_source='sampler' needs sampling.temperature > 0: greedy decoding "
                "has no sampling distribution to serve as pi_old"
            )
        if config.sampling.top_k is not None or config.sampling.top_p is not None:
            warnings.warn(
                "old_logprobs_source='sampler' with top_k/top_p: the sampler's log-probs are "
                "of the unfiltered softmax(logits / temperature), but tokens were drawn from "
                "the filtered distribution, so the importance ratio is biased.",
                ConfigWarning,
                stacklevel=2,
            )
    if config.use_kl_loss and config.kl_loss_coef == 0:
        warnings.warn("use_kl_loss=True with kl_loss_coef=0 adds nothing", ConfigWarning, 2)
    if config.add_token_level_kl and config.token_level_kl_coef == 0:
        warnings.warn(
            "add_token_level_kl=True with token_level_kl_coef=0 adds nothing", ConfigWarning, 2
        )


def _data_parallel_size(config, num_devices: int) -> int:
    return sharding_lib.data_parallel_size_of(mesh_shape(config, num_devices))


def mesh_shape(config, num_devices: int) -> dict[str, int]:
    """`sharding.mesh_shape` of config.mesh (one axis may be -1), as a ConfigError."""
    try:
        return sharding_lib.mesh_shape(config.mesh, num_devices)
    except ValueError as e:
        raise ConfigError(str(e)) from None


# ------------------------------------------------------------------------------ translation


def model_config(config, tokenizer) -> models.ModelConfig:
    """The policy's architecture and numerics.

    With `model.hf_path`: the checkpoint's config.json, with the run's numerics
    (param_dtype, dtype, remat, moe_impl, attention_impl). Otherwise the scratch model of `model.*`, its
    vocabulary and special tokens taken from the tokenizer.
    """
    m = config.model
    numerics = {
        "param_dtype": m.param_dtype,
        "dtype": m.dtype,
        "remat": m.remat,
        "moe_impl": m.moe_impl,
        "attention_impl": m.attention_impl,
    }
    if m.hf_path:
        hf = models.ModelConfig.from_hf_config(models.read_hf_config(m.hf_path))
        return dataclasses.replace(hf, **numerics)
    from gspo_jax import data

    moe = m.arch == "qwen3_moe"
    return models.ModelConfig(
        arch=m.arch,
        vocab_size=len(tokenizer),
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        rope_theta=m.rope_theta,
        tie_word_embeddings=m.tie_word_embeddings,
        qkv_bias=m.arch == "qwen2",
        qk_norm=m.arch != "qwen2",
        num_experts=m.num_experts if moe else 0,
        num_experts_per_tok=m.num_experts_per_tok if moe else 0,
        moe_intermediate_size=m.moe_intermediate_size if moe else 0,
        norm_topk_prob=moe,
        max_position_embeddings=max(4096, config.prompt_length + config.response_length),
        eos_token_ids=tuple(data.stop_token_ids(tokenizer)),
        pad_token_id=tokenizer.pad_token_id,
        **numerics,
    )


def step_config(config, model_config: models.ModelConfig) -> StepConfig:
    """The train step's static configuration (part of its compilation key)."""
    temperature = config.sampling.temperature
    return StepConfig(
        model=model_config,
        importance_sampling=config.importance_sampling,
        clip_low=float(config.clip_low),
        clip_high=float(config.clip_high),
        dual_clip_loss=bool(config.dual_clip_loss),
        dual_clip_ratio=float(config.dual_clip_ratio),
        loss_agg_mode=config.loss_agg_mode,
        horizon=int(config.response_length),
        ppo_epochs=int(config.ppo_epochs),
        num_mini_batches=int(config.num_mini_batches),
        micro_batch_size=config.micro_batch_size,
        use_kl_loss=bool(config.use_kl_loss),
        kl_loss_coef=float(config.kl_loss_coef),
        kl_estimator=config.kl_estimator,
        entropy_coef=float(config.entropy_coef),
        # log-probs are of softmax(logits / τ), as sampled; greedy (τ = 0) scores with τ = 1
        temperature=float(temperature) if temperature > 0 else 1.0,
        logprob_chunk_size=int(config.logprob_chunk_size),
        routing_replay=bool(config.model.routing_replay),
        token_advantages=bool(config.add_token_level_kl),
        group_size=int(config.num_return_sequences_in_group),
        shared_prompt=bool(config.shared_prompt),
    )


def advantage_kwargs(config) -> dict:
    """`advantages.compute_advantages` / `compute_token_advantages` options (ROLL's names)."""
    return {
        "group_size": config.num_return_sequences_in_group,
        "adv_estimator": config.adv_estimator,
        "reward_clip": config.reward_clip,
        "reward_norm": normalize_reward_norm(config.reward_norm),
        "reward_shift": config.reward_shift,
        "reward_scale": config.reward_scale,
        "whiten_advantages": config.whiten_advantages,
        "advantage_clip": config.advantage_clip,
    }


def sampler_kwargs(config, *, greedy: bool = False) -> dict:
    """`sampling.sample` options: the rollout's (G samples at config.sampling.*) or, with
    greedy, one temperature-0 response per prompt (evaluation)."""
    s = config.sampling
    return {
        "num_samples": 1 if greedy else config.num_return_sequences_in_group,
        "max_new_tokens": config.response_length,
        "temperature": 0.0 if greedy else s.temperature,
        "top_k": None if greedy else s.top_k,
        "top_p": None if greedy else s.top_p,
        "buckets": tuple(s.prompt_buckets),
    }
