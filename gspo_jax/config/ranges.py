"""Every number of the config in its legal range, one line naming the field: learning
rates, clip ranges, coefficients, counts, the warm start's schedule."""

import os

from gspo_jax import models
from gspo_jax import sharding as sharding_lib
from gspo_jax.config.errors import ConfigError, _bool, _choice, _int, _number, _positive_int


def _warm_start_ranges(config) -> None:
    """warm_start.*: counts, rates and the target-accuracy stop."""
    _int(config, "warm_start.steps", minimum=0)
    _bool(config, "warm_start.on_checkpoint")
    _bool(config, "warm_start.cache")
    folder = config.warm_start.cache_dir
    if folder and os.path.exists(folder) and not os.path.isdir(folder):
        raise ConfigError(f"config.warm_start.cache_dir={folder!r} is a file, not a directory")
    _positive_int(config, "warm_start.batch_size")
    _number(config, "warm_start.learning_rate", low=0.0, low_open=True)
    _number(config, "warm_start.teacher_error_rate", low=0.0, high=1.0)
    if config.warm_start.target_accuracy not in (None, 0):  # None or 0: off
        _number(config, "warm_start.target_accuracy", low=0.0, high=1.0, low_open=True)
        _positive_int(config, "warm_start.check_every")
        _positive_int(config, "warm_start.check_prompts")
    if config.warm_start.max_steps is not None:
        _int(config, "warm_start.max_steps", minimum=config.warm_start.steps)


def check_ranges(config) -> None:
    """Every number a run reads, checked finite and in range (NaN compares False)."""
    if not 0 <= _int(config, "seed", minimum=0) < 2**31:
        raise ConfigError(f"config.seed={config.seed} must be in [0, 2**31)")
    _number(config, "clip_low", low=0.0, high=1.0)  # 1: no lower bound (CISPO's preset)
    _number(config, "clip_high", low=0.0)
    _number(config, "dual_clip_ratio", low=1.0, low_open=True)
    _number(config, "rollout_correction_threshold", low=1.0, low_open=True)
    for name in ("reward_clip", "advantage_clip"):
        _number(config, name, low=0.0, low_open=True, allow_none=True)
    for name in ("kl_loss_coef", "token_level_kl_coef", "model.router_aux_loss_coef"):
        _number(config, name, low=0.0)
    _number(config, "entropy_coef")
    for name in (
        "use_kl_loss",
        "add_token_level_kl",
        "dual_clip_loss",
        "whiten_advantages",
        "reward_shift",
        "reward_scale",
        "model.routing_replay",
        "checkpoint.async_save",
        "checkpoint.export_hf",
        "log.progress_bar",
        "log.tensorboard",
        "log.plot",
    ):
        _bool(config, name)
    if config.model.scan_layers is not None:  # None: scan models of more than 4 layers
        _bool(config, "model.scan_layers")
    if config.packing is not None:  # None: pack long responses (specs.packing_on)
        _bool(config, "packing")
    _positive_int(config, "logprob_chunk_size")
    _pack_length(config)

    _number(config, "sampling.temperature", low=0.0)
    _int(config, "sampling.top_k", minimum=1, allow_none=True)
    _number(config, "sampling.top_p", low=0.0, high=1.0, low_open=True, allow_none=True)
    _sampling_engine(config)
    buckets = config.sampling.prompt_buckets
    if (
        not isinstance(buckets, (tuple, list))
        or not buckets
        or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in buckets)
    ):
        raise ConfigError(
            f"config.sampling.prompt_buckets={buckets!r} must be a non-empty tuple of "
            "positive integers"
        )

    # 0 is allowed: a run whose policy never moves measures the ratio's noise floor.
    _number(config, "optim.learning_rate", low=0.0)
    _int(config, "optim.warmup_steps", minimum=0)
    _number(config, "optim.end_lr_ratio", low=0.0, high=1.0)
    _number(config, "optim.weight_decay", low=0.0)
    _number(config, "optim.b1", low=0.0, high=1.0, high_open=True)
    _number(config, "optim.b2", low=0.0, high=1.0, high_open=True)
    _number(config, "optim.eps", low=0.0, low_open=True)
    if config.optim.max_grad_norm not in (None, 0):  # None or 0: no clipping
        _number(config, "optim.max_grad_norm", low=0.0, low_open=True)

    _warm_start_ranges(config)

    _int(config, "eval.every_steps", minimum=0)
    _positive_int(config, "eval.num_prompts")
    _positive_int(config, "eval.batch_size")
    _bool(config, "eval.save_per_problem")
    _int(config, "checkpoint.every_steps", minimum=0)
    _positive_int(config, "checkpoint.max_to_keep")
    _number(config, "checkpoint.save_timeout_s", low=0.0, low_open=True)
    _int(config, "max_all_skipped_steps", minimum=0)

    _int(config, "reward.num_workers", minimum=0)
    _int(config, "reward.max_failed_rollouts", minimum=0)
    _number(config, "reward.timeout_s", low=0.0, low_open=True)


def _sampling_engine(config) -> None:
    """sampling.engine, the KV dtype (int8 only with the continuous engine) and the
    continuous engine's slots, page size and KV budget (which must hold one full-length
    response: ⌈response_length / page_size⌉ + 1 pages)."""
    s = config.sampling
    _choice("sampling.engine", s.engine, ("continuous", "static"))
    _choice("sampling.rollout_layout", s.rollout_layout, sharding_lib.ROLLOUT_LAYOUTS)
    _choice("sampling.kv_dtype", s.kv_dtype, models.KV_DTYPES)
    if s.kv_dtype == "int8" and s.engine != "continuous":
        raise ConfigError(
            f'config.sampling.kv_dtype="int8" needs sampling.engine="continuous" (int8 KV '
            f"pages), not {s.engine!r}"
        )
    _bool(config, "sampling.shared_prefix_attention")
    _int(config, "sampling.num_slots", minimum=1, allow_none=True)
    page = _int(config, "sampling.page_size", minimum=1)
    budget = _int(config, "sampling.kv_budget_tokens", minimum=1, allow_none=True)
    need = -(-config.response_length // page) + 1
    if budget is not None and budget // page < need:
        raise ConfigError(
            f"config.sampling.kv_budget_tokens={budget} holds {budget // page} pages of "
            f"sampling.page_size={page}; one response of response_length="
            f"{config.response_length} needs up to {need} pages: raise it to >= {need * page}"
        )


def _pack_length(config) -> None:
    """pack_length: 0 (a rollout row's length) or at least prompt_length + response_length,
    so that any one response and its prompt fit a packed row."""
    length = _int(config, "pack_length", minimum=0)
    row = config.prompt_length + config.response_length
    if length and length < row:
        raise ConfigError(
            f"config.pack_length={length} is shorter than a rollout row (prompt_length + "
            f"response_length = {row}): one response and its prompt must fit a packed row; "
            "set it >= that, or 0 for exactly that"
        )
