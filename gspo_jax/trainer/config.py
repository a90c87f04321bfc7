"""The experiment config: start-up validation, and its translation into the pieces' arguments.

`configs/base.py` holds every field and its default; nothing else defines a default. This
module is the one place a config is read into the arguments of the pieces it drives:

  validate(config)                     before anything is compiled or loaded
  model_config(config, tokenizer)      the policy architecture (scratch or Hugging Face)
  check_model_against_tokenizer(...)   tokenizer ids inside the model's vocabulary
  step_config(config, model_config)    the train step's static StepConfig
  advantage_kwargs(config)             compute_advantages' options (ROLL's names)
  sampler_kwargs(config, greedy=)      sampling.sample's options
  batch_sizes(config)                  responses, mini-batch and micro-batch sizes

Valid names are read from the registries that define them (objectives, advantages, optim,
models, data), never restated here. Errors name the field and list the valid values; every
number must be finite and in its range (NaN compares False, so it is named here instead of
becoming a NaN loss). Settings that are legal but far from the paper's (GSPO with a
GRPO-sized clip range, GSPO with a token-sum aggregation) warn with the paper's values, and
so does an option set while its switch is off (docs/failures.md).
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import math
import numbers
import os
import sys
import warnings

from gspo_jax import advantages, models, objectives
from gspo_jax import sharding as sharding_lib
from gspo_jax.data.build import DATASETS
from gspo_jax.data.pipeline import OVERLONG_POLICIES
from gspo_jax.models.config import ARCHS, ATTENTION_IMPLS, DTYPES, MOE_IMPLS, REMAT_POLICIES
from gspo_jax.train_step import StepConfig, optim


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
    return _int(config, name, minimum=1)


def _int(config, name: str, *, minimum: int, allow_none: bool = False) -> int | None:
    """An int >= minimum (bools are not ints here)."""
    value = _get(config, name)
    if value is None and allow_none:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        kind = {0: "a non-negative integer", 1: "a positive integer"}.get(
            minimum, f"an integer >= {minimum}"
        )
        raise ConfigError(f"config.{name}={value!r} must be {kind}")
    return value


def _number(
    config,
    name: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    allow_none: bool = False,
) -> float | None:
    """A finite real number within [low, high] (an end open where asked). NaN and inf
    fail every check, so they are named here rather than turned into NaN losses later."""
    value = _get(config, name)
    if value is None and allow_none:
        return None
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    ok = ok and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        if low is not None and high is not None:
            where = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        elif low is not None:
            where = f"{'>' if low_open else '>='} {low:g}"
        elif high is not None:
            where = f"{'<' if high_open else '<='} {high:g}"
        else:
            where = "finite"
        none = " (or None)" if allow_none else ""
        raise ConfigError(f"config.{name}={value!r} must be a finite number {where}{none}")
    return float(value)


def _bool(config, name: str) -> bool:
    value = _get(config, name)
    if not isinstance(value, bool):
        raise ConfigError(f"config.{name}={value!r} must be True or False")
    return value


def _warn(message: str) -> None:
    warnings.warn(message, ConfigWarning, stacklevel=3)


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
    _ranges(config)
    _check_model(config)
    _check_data(config)
    _check_rewards(config)

    # -- legal, but worth a warning ------------------------------------------------------------
    if config.importance_sampling in SEQ_MODES:
        if max(config.clip_low, config.clip_high) >= GSPO_CLIP_WARN:
            _warn(
                f"GSPO (importance_sampling={config.importance_sampling!r}) with clip range "
                f"({config.clip_low}, {config.clip_high}): sequence ratios sit within ~1e-3 of "
                "1, so a GRPO-sized range almost never clips. The paper uses "
                "clip_low=3e-4, clip_high=4e-4 (§5.1)."
            )
        if config.loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
            _warn(
                f"GSPO with loss_agg_mode={config.loss_agg_mode!r} weights each sequence by its "
                "length; the paper's objective (§4.1) averages sequences with 1/|y_i| length "
                "normalisation: loss_agg_mode='seq-mean-token-mean'."
            )
    if config.old_logprobs_source == "sampler":
        if config.sampling.temperature == 0:
            raise ConfigError(
                "old_logprobs_source='sampler' needs sampling.temperature > 0: greedy decoding "
                "has no sampling distribution to serve as pi_old"
            )
        if config.sampling.top_k is not None or config.sampling.top_p is not None:
            _warn(
                "old_logprobs_source='sampler' with top_k/top_p: the sampler's log-probs are "
                "of the unfiltered softmax(logits / temperature), but tokens were drawn from "
                "the filtered distribution, so the importance ratio is biased."
            )
    if config.sampling.temperature == 0 and g > 1:
        _warn(
            f"sampling.temperature=0 samples greedily: the {g} responses of a prompt are "
            "identical, so group advantages are 0 and nothing is learned"
        )
    if config.use_kl_loss and config.kl_loss_coef == 0:
        _warn("use_kl_loss=True with kl_loss_coef=0 adds nothing")
    if config.add_token_level_kl and config.token_level_kl_coef == 0:
        _warn("add_token_level_kl=True with token_level_kl_coef=0 adds nothing")
    _warn_options_without_switch(config, reward_norm)


# An option -> (the switch that makes it matter, a test of whether the switch is on, its
# value when unused). Setting the option while its switch is off changes nothing, which is
# worth a word: the reverse case (a switch on with a zero coefficient) warns too. Warnings,
# not errors: ROLL / verl yamls routinely carry kl_loss_coef: 0.001 with use_kl_loss: false.
def _warn_options_without_switch(config, reward_norm) -> None:
    pairs = [
        ("kl_loss_coef", config.kl_loss_coef != 0, "use_kl_loss", config.use_kl_loss),
        (
            "token_level_kl_coef",
            config.token_level_kl_coef != 0,
            "add_token_level_kl",
            config.add_token_level_kl,
        ),
        ("reward_shift", config.reward_shift, "reward_norm", reward_norm is not None),
        ("reward_scale", config.reward_scale, "reward_norm", reward_norm is not None),
        (
            "dual_clip_ratio",
            config.dual_clip_ratio != DEFAULT_DUAL_CLIP_RATIO,
            "dual_clip_loss",
            config.dual_clip_loss,
        ),
        (
            "kl_estimator",
            config.kl_estimator != "k3",
            "use_kl_loss or add_token_level_kl",
            config.use_kl_loss or config.add_token_level_kl,
        ),
        (
            "warm_start.steps",
            config.warm_start.steps > 0,
            "a scratch model (model.hf_path unset)",
            not config.model.hf_path,
        ),
    ]
    for option, is_set, switch, switch_on in pairs:
        if is_set and not switch_on:
            _warn(
                f"config.{option}={_get(config, option)!r} has no effect: it is only used "
                f"with {switch}, which is off"
            )


# dual_clip_ratio's value in configs/base.py; a different one without dual_clip_loss warns.
DEFAULT_DUAL_CLIP_RATIO = 3.0


def _ranges(config) -> None:
    """Every number a run reads, checked finite and in range (NaN compares False)."""
    if not 0 <= _int(config, "seed", minimum=0) < 2**31:
        raise ConfigError(f"config.seed={config.seed} must be in [0, 2**31)")
    _number(config, "clip_low", low=0.0, high=1.0, high_open=True)
    _number(config, "clip_high", low=0.0)
    _number(config, "dual_clip_ratio", low=1.0, low_open=True)
    for name in ("reward_clip", "advantage_clip"):
        _number(config, name, low=0.0, low_open=True, allow_none=True)
    for name in ("kl_loss_coef", "token_level_kl_coef"):
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
        "model.scan_layers",
        "checkpoint.async_save",
        "checkpoint.export_hf",
        "log.progress_bar",
        "log.tensorboard",
        "log.plot",
    ):
        _bool(config, name)
    _positive_int(config, "logprob_chunk_size")

    _number(config, "sampling.temperature", low=0.0)
    _int(config, "sampling.top_k", minimum=1, allow_none=True)
    _number(config, "sampling.top_p", low=0.0, high=1.0, low_open=True, allow_none=True)
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

    _int(config, "warm_start.steps", minimum=0)
    _positive_int(config, "warm_start.batch_size")
    _number(config, "warm_start.learning_rate", low=0.0, low_open=True)
    _number(config, "warm_start.teacher_error_rate", low=0.0, high=1.0)

    _int(config, "eval.every_steps", minimum=0)
    _positive_int(config, "eval.num_prompts")
    _positive_int(config, "eval.batch_size")
    _int(config, "checkpoint.every_steps", minimum=0)
    _positive_int(config, "checkpoint.max_to_keep")

    _int(config, "reward.num_workers", minimum=0)
    _int(config, "reward.max_failed_rollouts", minimum=0)
    _number(config, "reward.timeout_s", low=0.0, low_open=True)


def _check_model(config) -> None:
    """The model fields, before any file is read: a scratch architecture is built once with
    a placeholder vocabulary (ModelConfig checks itself); a checkpoint directory must be one."""
    m = config.model
    if m.routing_replay and m.arch != "qwen3_moe" and not m.hf_path:
        raise ConfigError("config.model.routing_replay needs a Mixture-of-Experts model")
    if m.hf_path:
        _check_dir("model.hf_path", m.hf_path, must_hold=("config.json",))
    if m.tokenizer_path:
        _check_dir("model.tokenizer_path", m.tokenizer_path)
    if m.hf_path:
        return
    for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "head_dim"):
        _positive_int(config, f"model.{name}")
    _positive_int(config, "model.num_kv_heads")
    _number(config, "model.rope_theta", low=0.0, low_open=True)
    if m.arch == "qwen3_moe":
        experts = _positive_int(config, "model.num_experts")
        if not 1 <= _positive_int(config, "model.num_experts_per_tok") <= experts:
            raise ConfigError(
                f"config.model.num_experts_per_tok={m.num_experts_per_tok} must be in "
                f"[1, model.num_experts={experts}]"
            )
        _positive_int(config, "model.moe_intermediate_size")
    try:
        _scratch_model_config(config, vocab_size=1, eos_token_ids=(), pad_token_id=None)
    except ValueError as e:
        raise ConfigError(str(e).replace("ModelConfig.", "config.model.")) from None


def _check_dir(name: str, path, *, must_hold: tuple[str, ...] = ()) -> None:
    if not os.path.isdir(path):
        what = "is a file, not a directory" if os.path.exists(path) else "does not exist"
        raise ConfigError(f"config.{name}={path!r} {what}")
    for file in must_hold:
        if not os.path.isfile(os.path.join(path, file)):
            raise ConfigError(f"config.{name}={path!r} has no {file}")


def _check_data(config) -> None:
    d = config.data
    spec = DATASETS[d.name]
    configs = [c.name for c in spec.builder.BUILDER_CONFIGS]
    if configs and d.config_name not in configs:
        raise ConfigError(
            f"config.data.config_name={d.config_name!r} is not one of {configs} "
            f"(dataset {d.name!r})"
        )
    if not configs and d.config_name:
        raise ConfigError(
            f"config.data.config_name={d.config_name!r}: dataset {d.name!r} has no builder "
            "configs; set it to ''"
        )
    _choice("data.overlong", d.overlong, OVERLONG_POLICIES)
    if d.train_split == d.eval_split:
        _warn(
            f"config.data.train_split and eval_split are both {d.train_split!r}: the "
            "held-out accuracy is measured on training prompts"
        )
    if spec.check_manual_dir is not None:
        if not d.manual_dir:
            raise ConfigError(
                f"config.data.name={d.name!r} needs config.data.manual_dir: a directory "
                "holding train.jsonl and test.jsonl"
            )
        try:
            spec.check_manual_dir(d.manual_dir)
        except FileNotFoundError as e:
            raise ConfigError(f"config.data.manual_dir={d.manual_dir!r}: {e}") from None


def _check_rewards(config) -> None:
    """The reward specs name registered rewards; with worker processes, each reward's module
    must be importable by name (a reward registered in the config file is not: the workers
    would fail at the first rollout, after the model is loaded)."""
    from gspo_jax import rewards

    modules = {}
    for name in ("reward.spec", "reward.accuracy"):
        try:
            reward = rewards.build_reward(_get(config, name))
        except ValueError as e:
            raise ConfigError(f"config.{name}: {e}") from None
        for term, fn in zip(reward.names, reward.fns):
            modules[term] = (name, getattr(fn, "__module__", "__main__"))
    if config.reward.num_workers == 0:
        return
    for term, (field, module) in modules.items():
        if not _importable_by_workers(module):
            raise ConfigError(
                f"config.{field}: reward {term!r} is registered in module {module!r}, which "
                "the reward worker processes cannot import by name (a config file or a "
                "script is not a module on sys.path). Move it into an importable module, or "
                "score in-process with config.reward.num_workers=0 (no timeout)"
            )


def _importable_by_workers(module: str) -> bool:
    """Workers import reward modules by name with the parent's sys.path (rewards/pool.py)."""
    if module in ("__main__", "__mp_main__"):
        return False
    top = module.split(".")[0]
    return (
        top in ("gspo_jax",)
        or importlib.machinery.PathFinder.find_spec(top) is not None
        or top in sys.builtin_module_names
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


def model_numerics(config) -> dict:
    """The run's numerics, applied to any architecture (a checkpoint's, a preset's)."""
    m = config.model
    return {
        "param_dtype": m.param_dtype,
        "dtype": m.dtype,
        "remat": m.remat,
        "moe_impl": m.moe_impl,
        "attention_impl": m.attention_impl,
        "scan_layers": m.scan_layers,
    }


def model_config(config, tokenizer) -> models.ModelConfig:
    """The policy's architecture and numerics.

    With `model.hf_path`: the checkpoint's config.json, with the run's `model_numerics`.
    Otherwise the scratch model of `model.*`, its vocabulary and special tokens taken from
    the tokenizer.
    """
    m = config.model
    if m.hf_path:
        hf = models.ModelConfig.from_hf_config(models.read_hf_config(m.hf_path))
        return dataclasses.replace(hf, **model_numerics(config))
    from gspo_jax import data

    return _scratch_model_config(
        config,
        vocab_size=len(tokenizer),
        eos_token_ids=tuple(data.stop_token_ids(tokenizer)),
        pad_token_id=tokenizer.pad_token_id,
    )


def _scratch_model_config(config, **tokens) -> models.ModelConfig:
    """The scratch architecture of `model.*`; `tokens`: vocab_size and the special ids."""
    m = config.model
    moe = m.arch == "qwen3_moe"
    return models.ModelConfig(
        arch=m.arch,
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
        **model_numerics(config),
        **tokens,
    )


def check_model_against_tokenizer(config, model_config: models.ModelConfig, tokenizer) -> None:
    """The tokenizer's ids, the model's vocabulary and the run's lengths agree (run when the
    model config is read, before any data or weights). A token id >= vocab_size has no
    embedding row: it would give NaN log-probs and skip every update, silently."""
    from gspo_jax import data

    vocab = model_config.vocab_size
    where = f"model.hf_path={config.model.hf_path!r}" if config.model.hf_path else "model"
    source = config.model.tokenizer_path or config.model.hf_path or "the char tokenizer"
    largest = max(tokenizer.get_vocab().values(), default=-1)
    if largest >= vocab:
        raise ConfigError(
            f"the tokenizer ({source}) has token ids up to {largest}, but the {where} has "
            f"vocab_size={vocab}: ids >= {vocab} have no embedding. Use the model's own "
            "tokenizer (config.model.tokenizer_path)"
        )
    special = {"pad_token_id": tokenizer.pad_token_id}
    for i, eos in enumerate(data.stop_token_ids(tokenizer)):
        special[f"stop token {i}"] = eos
    for name, value in special.items():
        if value is not None and not 0 <= value < vocab:
            raise ConfigError(
                f"the tokenizer's {name}={value} is outside the {where} vocabulary [0, {vocab})"
            )
    length = config.prompt_length + config.response_length
    if length > model_config.max_position_embeddings:
        raise ConfigError(
            f"config.prompt_length + config.response_length = {length} exceeds the "
            f"{where}'s max_position_embeddings={model_config.max_position_embeddings}"
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
        old_logprobs_source=config.old_logprobs_source,
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
