"""Start-up validation of the experiment config: every field checked before anything is
compiled or loaded, with one line naming it.

`configs/base.py` holds every field and its default; nothing else defines a default.

  validate(config)                     before anything is compiled or loaded
  check_model_against_tokenizer(...)   tokenizer ids inside the model's vocabulary (once the
                                       model config is read)
  mesh_shape(config, num_devices)      config.mesh resolved, as a ConfigError

Valid names are read live from the registries that define them (objectives, advantages,
optim, models, data, rewards), never restated here: a name registered after import is valid
too. Errors name the field and list the valid values; every number must be finite and in its
range (NaN compares False, so it is named here instead of becoming a NaN loss). Settings
that are legal but far from the paper's (GSPO with a GRPO-sized clip range, GSPO with a
token-sum or token-mean aggregation other than LUSPO's) warn with the paper's values, and so does an option set
while its switch is off (docs/failures.md). The translation into the stages' arguments is
specs.py's.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

from gspo_jax import sharding as sharding_lib
from gspo_jax.algorithm import advantages, objectives, old_policy
from gspo_jax.config import advice, meaning, ranges
from gspo_jax.config.errors import (  # noqa: F401 (validate.* names)
    ConfigError,
    ConfigWarning,
    _bool,
    _choice,
    _int,
    _number,
    _positive_int,
)
from gspo_jax.config.errors import get as _get
from gspo_jax.config.errors import warn as _warn
from gspo_jax.config.loaded import check_model_against_tokenizer  # noqa: F401 (validate.*)
from gspo_jax.config.meaning import (  # noqa: F401 (validate.* names)
    MIN_TEMPERATURE,
    lora_projection_dims,
    warn_lora_rank_above_projection,
)
from gspo_jax.config.specs import (
    batch_sizes,
    checkpoint_dir,
    lora_fields,
    normalize_reward_norm,
    pass_k_field,
    scratch_model_config,
)
from gspo_jax.data.build import DATASETS
from gspo_jax.data.pipeline import OVERLONG_POLICIES
from gspo_jax.data.templates import check_chat_template
from gspo_jax.models.config import (
    ARCHS,
    ATTENTION_IMPLS,
    DTYPES,
    LORA_TARGETS,
    MOE_IMPLS,
    REMAT_POLICIES,
)
from gspo_jax.train_step import optim

INVALID_REWARD_RULES = ("mask", "zero")


def validate(config, *, num_devices: int | None = None, num_processes: int = 1) -> None:
    """Raise ConfigError for a config that cannot run; warn for one far from the paper.

    Args:
      config: the experiment ConfigDict (configs/base.py layout).
      num_devices: devices of the global mesh (default: only checks not needing it).
      num_processes: JAX processes; each must get a whole number of prompts.
    """
    _check_imports(config)
    _check_deprecated_names(config)
    _check_names(config)
    _check_rollout_mesh(config, num_devices, num_processes)
    _check_sizes(config, num_devices, num_processes)
    ranges.check_ranges(config)
    _check_model(config)
    _check_data(config)
    _check_rewards(config)
    meaning.check_meaning(config)
    _check_sampled_eval(config)
    _check_wandb(config)
    _check_pi_old(config)
    _check_loss_mode(config)
    _check_dapo(config)
    advice.warn_far_from_paper(config)
    advice.warn_warmup_longer_than_the_run(config)
    advice.warn_options_without_switch(config, normalize_reward_norm(config.reward_norm))


def _check_imports(config) -> None:
    """config.imports: the user's modules, imported first (what they register is then a
    valid name in the rest of the config)."""
    from gspo_jax.config import imports

    try:
        imports.import_all(config.get("imports", ""))
    except imports.ImportsError as e:
        raise ConfigError(f"config.imports: {e}") from None


def _check_deprecated_names(config) -> None:
    """A deprecated field still works, with a warning naming its new name, for one release;
    set beside the new one (to another value) it is an error."""
    old = config.eval.get("num_samples")
    if old is None:
        return
    if config.eval.pass_k not in (0, old):
        raise ConfigError(
            f"config.eval.num_samples={old!r} and config.eval.pass_k={config.eval.pass_k!r}: "
            "num_samples is pass_k's deprecated name; set only eval.pass_k"
        )
    _warn(
        f"config.eval.num_samples is deprecated: it is now eval.pass_k (k of pass@k); "
        f"read as eval.pass_k={old!r}"
    )


def _check_rollout_mesh(config, num_devices, num_processes: int) -> None:
    """sampling.rollout_mesh.tensor: 0 (the trainer's mesh) or a group size dividing each
    process's devices (a tensor-parallel group stays within a process: sampling/layout.py)."""
    tensor = _int(config, "sampling.rollout_mesh.tensor", minimum=0)
    if not tensor or num_devices is None:
        return
    per_process = num_devices // max(num_processes, 1)
    if per_process % tensor:
        where = (
            f"{num_devices} devices"
            if num_processes <= 1
            else (f"{per_process} devices of each of the {num_processes} processes")
        )
        raise ConfigError(
            f"config.sampling.rollout_mesh.tensor={tensor} does not divide the {where} "
            "(a tensor-parallel group of the rollout stays within one process)"
        )


def _check_names(config) -> None:
    """Every mode name is registered (read live: a name registered after import counts)."""
    _choice("importance_sampling", config.importance_sampling, objectives.RATIOS)
    _choice("loss_agg_mode", config.loss_agg_mode, objectives.LOSS_AGG_MODES)
    _choice("loss_mode", config.loss_mode, objectives.LOSS_MODES)
    _choice("kl_estimator", config.kl_estimator, objectives.KL_ESTIMATORS)
    _choice("adv_estimator", config.adv_estimator, advantages.ADV_ESTIMATORS)
    reward_norm = normalize_reward_norm(config.reward_norm)
    _choice("reward_norm", reward_norm, [None, *[n for n in advantages.REWARD_NORMS if n]])
    _choice("old_logprobs_source", config.old_logprobs_source, old_policy.SOURCES)
    _choice("rollout_correction", config.rollout_correction, objectives.ROLLOUT_CORRECTIONS)
    _choice(
        "rollout_correction_level",
        config.rollout_correction_level,
        objectives.ROLLOUT_CORRECTION_LEVELS,
    )
    _choice("invalid_reward", config.invalid_reward, INVALID_REWARD_RULES)
    _choice("optim.schedule", config.optim.schedule, optim.SCHEDULES)
    _choice("model.arch", config.model.arch, ARCHS)
    _choice("model.param_dtype", config.model.param_dtype, DTYPES)
    _choice("model.dtype", config.model.dtype, DTYPES)
    _choice("model.remat", config.model.remat, REMAT_POLICIES)
    _choice("model.moe_impl", config.model.moe_impl, MOE_IMPLS)
    _choice("model.attention_impl", config.model.attention_impl, ATTENTION_IMPLS)
    _choice("data.name", config.data.name, sorted(DATASETS))


def _check_sizes(config, num_devices: int | None, num_processes: int) -> None:
    """Positive sizes that split: responses into mini-batches, mini-batches into
    micro-batches, micro-batches over the data-parallel devices, prompts over processes;
    group statistics need a group."""
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
    responses, mini = sizes["responses"], sizes["mini_batch"]
    if responses % config.num_mini_batches:
        raise ConfigError(
            f"rollout_batch_size x num_return_sequences_in_group = {n} x {g} = {responses} "
            f"responses do not split into num_mini_batches={config.num_mini_batches} "
            "equal mini-batches"
        )
    if config.micro_batch_size is not None and mini % config.micro_batch_size:
        raise ConfigError(
            f"a mini-batch of {responses} / {config.num_mini_batches} = {mini} responses does "
            f"not split into micro_batch_size={config.micro_batch_size} micro-batches"
        )
    if n % num_processes:
        raise ConfigError(
            f"rollout_batch_size={n} prompts do not split over {num_processes} JAX processes"
        )
    if num_devices is not None:
        _check_devices(config, sizes["micro_batch"], num_devices, num_processes)
    reward_norm = normalize_reward_norm(config.reward_norm)
    if g < 2 and config.adv_estimator == "grpo":
        raise ConfigError(
            f"adv_estimator='grpo' normalises within each group, which needs "
            f"num_return_sequences_in_group >= 2 (got {g})"
        )
    if g < 2 and config.adv_estimator == "rloo":
        raise ConfigError(
            f"adv_estimator='rloo' takes each response's baseline from the other responses "
            f"of its group, which needs num_return_sequences_in_group >= 2 (got {g})"
        )
    if g < 2 and reward_norm == "group":
        raise ConfigError(f"reward_norm='group' needs num_return_sequences_in_group >= 2 (got {g})")


def _check_devices(config, micro: int, num_devices: int, num_processes: int) -> None:
    data_parallel = _data_parallel_size(config, num_devices)
    if micro % data_parallel:
        raise ConfigError(
            f"a micro-batch of {micro} responses does not split over the "
            f"{data_parallel} data-parallel devices (mesh.data x fsdp x expert) of {num_devices}"
        )
    if num_processes > 1:
        # Each process feeds its own prompt rows to its own devices (no replication across
        # hosts), so prompt batches must split over every data-parallel device.
        for name, rows in (
            ("rollout_batch_size", config.rollout_batch_size),
            ("eval.batch_size", config.eval.batch_size),
        ):
            if rows % data_parallel:
                raise ConfigError(
                    f"config.{name}={rows} prompts do not split over the {data_parallel} "
                    f"data-parallel devices of {num_processes} processes"
                )


def _check_pi_old(config) -> None:
    """The π_old source against the rollout's sampling (algorithm/old_policy.py): greedy
    is an error, top-k / top-p a warning (BiasedPiOldWarning)."""
    s = config.sampling
    try:
        old_policy.check_source(
            config.old_logprobs_source, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if config.rollout_correction != "none" and s.temperature == 0:
        raise ConfigError(
            f"config.rollout_correction={config.rollout_correction!r} needs "
            "sampling.temperature > 0: greedy decoding has no sampling distribution mu to "
            "correct for"
        )


def _check_loss_mode(config) -> None:
    """The GSPO family (objectives.LOSS_MODES, docs/objectives.md): each mode's parameters,
    the ratio it needs, and off-policy sequence masking's sampler log-probs."""
    mode = config.loss_mode
    for name in ("sapo_tau_pos", "sapo_tau_neg", "dppo_delta_low", "dppo_delta_high"):
        _number(config, name, low=0.0, low_open=True)
    _number(config, "dppo_max_weight", low=0.0, low_open=True)
    _number(config, "opsm_delta", low=0.0, allow_none=True)
    _bool(config, "norm_adv_by_std_in_grpo")
    if mode == "cispo" and not config.clip_high > 0:
        raise ConfigError(
            f"config.clip_high={config.clip_high!r}: loss_mode='cispo' caps its weight at "
            "1 + clip_high, which must be > 1 (configs/cispo.py: clip_high=4.0, a cap of 5)"
        )
    if objectives.LOSS_MODES[mode].token_ratio and config.importance_sampling != "token":
        raise ConfigError(
            f"config.loss_mode={mode!r} needs token log-ratios, but "
            f"config.importance_sampling={config.importance_sampling!r}: set "
            "importance_sampling='token'"
        )
    if config.dual_clip_loss and mode != "clip":
        raise ConfigError(
            f"config.dual_clip_loss=True applies to loss_mode='clip' only, not "
            f"config.loss_mode={mode!r}"
        )
    if config.opsm_delta is not None and config.sampling.temperature == 0:
        raise ConfigError(
            f"config.opsm_delta={config.opsm_delta!r} reads the sampler's log-probs, which "
            "greedy decoding (sampling.temperature=0) does not keep: there is no sampling "
            "distribution mu to mask against"
        )


def _check_dapo(config) -> None:
    """DAPO's rollout options (rollout/filtering.py): dynamic sampling, overlong handling."""
    dynamic = _bool(config, "dynamic_sampling")
    _bool(config, "overlong_filter")
    _int(config, "dynamic_sampling_max_rounds", minimum=0)
    buffer = _int(config, "overlong_buffer_len", minimum=0)
    if buffer > config.response_length:
        raise ConfigError(
            f"config.overlong_buffer_len={buffer} must be in [0, response_length="
            f"{config.response_length}]: the penalty ramps over the last overlong_buffer_len "
            "tokens of a response"
        )
    _number(config, "overlong_penalty_factor", low=0.0)
    if dynamic and config.num_return_sequences_in_group < 2:
        raise ConfigError(
            "config.dynamic_sampling=True needs num_return_sequences_in_group >= 2 (got "
            f"{config.num_return_sequences_in_group}): a group of one has zero reward std "
            "and would always be dropped"
        )


def _check_model(config) -> None:
    """The model fields, before any file is read: a scratch architecture is built once with
    a placeholder vocabulary (ModelConfig checks itself); a checkpoint directory must be one."""
    m = config.model
    if m.routing_replay and m.arch != "qwen3_moe" and not m.hf_path:
        raise ConfigError("config.model.routing_replay needs a Mixture-of-Experts model")
    if m.router_aux_loss_coef and m.arch != "qwen3_moe" and not m.hf_path:
        raise ConfigError(
            f"config.model.router_aux_loss_coef={m.router_aux_loss_coef} needs a "
            f"Mixture-of-Experts model (model.arch={m.arch!r} is dense)"
        )
    _check_lora(config)
    if m.hf_path:
        try:
            where = checkpoint_dir(config)
        except FileNotFoundError as e:
            raise ConfigError(f"config.model.hf_path: {e}") from None
        _check_dir("model.hf_path", where, must_hold=("config.json",))
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
        scratch_model_config(config, vocab_size=1, eos_token_ids=(), pad_token_id=None)
    except ValueError as e:
        raise ConfigError(str(e).replace("ModelConfig.", "config.model.")) from None


def _check_lora(config) -> None:
    """model.lora_*: a rank >= 0; with adapters, alpha > 0 and known target names (MLP
    targets on a MoE checkpoint are refused when its config is read: ModelConfig)."""
    if not _int(config, "model.lora_rank", minimum=0):
        return
    _number(config, "model.lora_alpha", low=0.0, low_open=True)
    targets = lora_fields(config)["lora_targets"]
    unknown = sorted(set(targets) - set(LORA_TARGETS))
    if not targets or unknown or len(set(targets)) != len(targets):
        raise ConfigError(
            f"config.model.lora_targets={config.model.lora_targets!r}: expected distinct "
            f"comma-separated names from {list(LORA_TARGETS)}"
            + (f"; unknown {unknown}" if unknown else "")
        )


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
    if d.name in ("jsonl", "parquet"):
        _check_files(d)
    if d.name == "hf":
        _check_hf(d)
    try:
        check_chat_template(d.chat_template)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    base = d.train_split.split("[", 1)[0]
    if d.train_split == d.eval_split:
        _warn(
            f"config.data.train_split and eval_split are both {d.train_split!r}: the "
            "held-out accuracy is measured on training prompts"
        )
    elif d.eval_split.split("[", 1)[0] == base and (
        "[" not in d.train_split or "[" not in d.eval_split
    ):  # a slice of the very split it trains on (two slices of one split: the user's ranges)
        _warn(
            f"config.data.eval_split={d.eval_split!r} and train_split={d.train_split!r} "
            "overlap: the held-out accuracy is measured on training prompts "
            f"(a dev split: train_split='{base}[N:]', eval_split='{base}[:N]')"
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


def _check_files(d) -> None:
    """data.name="jsonl" / "parquet": both files exist, the keys are names."""
    kind = "a JSONL file" if d.name == "jsonl" else "a Parquet file"
    for field in ("train_path", "test_path"):
        path = d.get(field)
        if not path:
            raise ConfigError(f'config.data.name="{d.name}" needs config.data.{field}: {kind}')
        if not os.path.isfile(path):
            raise ConfigError(f"config.data.{field}={path!r}: no such file")
        if d.name == "parquet" and not path.endswith(".parquet"):
            raise ConfigError(f"config.data.{field}={path!r}: {kind} ends in .parquet")
    _check_keys(d)


def _check_hf(d) -> None:
    """data.name="hf": a path or Hub id is given (what it holds is read at start-up)."""
    if not d.hf_path:
        raise ConfigError(
            'config.data.name="hf" needs config.data.hf_path: a `datasets` save_to_disk '
            "directory, a directory of Parquet files, or a Hub id (org/name)"
        )
    _check_keys(d)


def _check_keys(d) -> None:
    for field in ("prompt_key", "answer_key"):
        if not isinstance(d.get(field), str) or not d.get(field):
            raise ConfigError(f"config.data.{field}={d.get(field)!r} must be a non-empty key name")


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
        if not importable_by_workers(module):
            raise ConfigError(
                f"config.{field}: reward {term!r} is registered in module {module!r}, which "
                "the reward worker processes cannot import by name (a config file or a "
                "script is not a module on sys.path). Move it into an importable module, or "
                "score in-process with config.reward.num_workers=0 (reward.timeout_s is then "
                "enforced with SIGALRM)"
            )


WANDB_MODES = ("online", "offline", "disabled")


def _check_sampled_eval(config) -> None:
    """eval.pass_k / eval.temperature (pass@k, maj@k; trainer/evaluation.py): maj@k
    needs the answer that reward.accuracy grades (rewards/voting.py)."""
    name = pass_k_field(config)
    k = _int(config, name, minimum=0)
    _number(config, "eval.temperature", low=0.0, low_open=True)
    if k == 0:
        return
    from gspo_jax.rewards import voting

    try:
        voting.answer_key_fn(config.reward.accuracy)
    except ValueError as e:
        raise ConfigError(f"config.{name}={k} with config.reward.accuracy: {e}") from None


def _check_wandb(config) -> None:
    """log.wandb_*: the writer (trainer/io/wandb_writer.py) imports wandb only when a project
    is set, so that is when a missing wandb is named, before anything is loaded."""
    log = config.log
    for name in ("log.wandb_project", "log.wandb_entity"):
        value = _get(config, name)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ConfigError(f"config.{name}={value!r} must be a non-empty string or None")
    _choice("log.wandb_mode", log.wandb_mode, WANDB_MODES)
    steps = log.profile_steps
    if not isinstance(steps, (tuple, list)) or any(
        not isinstance(s, int) or isinstance(s, bool) or not 1 <= s <= config.num_steps
        for s in steps
    ):
        raise ConfigError(
            f"config.log.profile_steps={steps!r} must be a tuple of RL step numbers in "
            f"[1, num_steps={config.num_steps}] (e.g. (3, 4); () profiles nothing)"
        )
    if log.wandb_project is None or log.wandb_mode == "disabled":
        return
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            f"config.log.wandb_project={log.wandb_project!r} logs to Weights & Biases, but "
            "wandb is not installed: pip install wandb (or unset log.wandb_project)"
        )


def importable_by_workers(module: str) -> bool:
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
        sizes = sharding_lib.mesh_shape(config.mesh, num_devices)
        # "tensor" on a mesh with data / expert replicas: an error naming the field
        sharding_lib.resolve_rollout_layout(config.sampling.rollout_layout, sizes)
        return sizes
    except ValueError as e:
        raise ConfigError(str(e)) from None
