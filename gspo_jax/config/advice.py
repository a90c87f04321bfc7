"""Warnings about a config that runs but is probably not what was meant: far from the
paper (GSPO with a GRPO-sized clip range, a token-sum aggregation that is not LUSPO), a
warm-up longer than the run, an option set while its switch is off. Defaults are read from
configs/base.py (`_default`), never restated here.
"""

from gspo_jax.algorithm import objectives
from gspo_jax.config.errors import get as _get
from gspo_jax.config.errors import warn as _warn
from gspo_jax.config.specs import lora_fields, pass_k
from gspo_jax.models.config import LORA_TARGETS

# GSPO's paper clip range is 3e-4 / 4e-4 (§5.1); anything this large is GRPO-sized.
GSPO_CLIP_WARN = 0.01


def warn_far_from_paper(config) -> None:
    """Legal settings far from the paper's, each with the paper's value."""
    g = config.num_return_sequences_in_group
    if config.importance_sampling in objectives.sequence_level_modes():
        clip_mode = config.loss_mode == "clip"
        if clip_mode and max(config.clip_low, config.clip_high) >= GSPO_CLIP_WARN:
            _warn(
                f"GSPO (importance_sampling={config.importance_sampling!r}) with clip range "
                f"({config.clip_low}, {config.clip_high}): sequence ratios sit within ~1e-3 of "
                "1, so a GRPO-sized range almost never clips. The paper uses "
                "clip_low=3e-4, clip_high=4e-4 (§5.1)."
            )
        luspo = config.importance_sampling == "seq" and (
            config.loss_agg_mode == "seq-mean-token-sum"
        )
        if luspo:
            pass  # LUSPO (length-unbiased GSPO, arXiv 2602.05261): asked for by name
        elif config.loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
            _warn(
                f"GSPO (importance_sampling={config.importance_sampling!r}) with "
                f"loss_agg_mode={config.loss_agg_mode!r} weights each sequence by its length; "
                "the paper's objective (§4.1) averages sequences with 1/|y_i| length "
                "normalisation: loss_agg_mode='seq-mean-token-mean'. Length-weighted GSPO "
                "on purpose is LUSPO (length-unbiased GSPO, arXiv 2602.05261): "
                "importance_sampling='seq' with loss_agg_mode='seq-mean-token-sum' "
                "(configs/luspo.py)."
            )
        if config.loss_agg_mode == "token-mean":
            _warn(
                "GSPO with loss_agg_mode='token-mean' weights each sequence's ratio term by "
                "its number of tokens (a mean over the batch's tokens), which is not the "
                "paper's objective (§4.1: (1/G) Σ_i over sequences): longer responses pull "
                "harder. Use loss_agg_mode='seq-mean-token-mean'."
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


def warn_warmup_longer_than_the_run(config) -> None:
    """The schedule (train_step/optim.py) counts optimizer updates, not RL steps: a warm-up
    longer than the run's updates never reaches the set learning rate."""
    updates = config.num_steps * config.ppo_epochs * config.num_mini_batches
    if config.optim.warmup_steps > updates:
        _warn(
            f"config.optim.warmup_steps={config.optim.warmup_steps} is longer than the run: "
            f"num_steps x ppo_epochs x num_mini_batches = {config.num_steps} x "
            f"{config.ppo_epochs} x {config.num_mini_batches} = {updates} optimizer updates "
            "(the warm-up counts updates, not RL steps), so the learning rate never reaches "
            f"optim.learning_rate={config.optim.learning_rate:g}"
        )


# An option -> (the switch that makes it matter, a test of whether the switch is on, its
# value when unused). Setting the option while its switch is off changes nothing, which is
# worth a word: the reverse case (a switch on with a zero coefficient) warns too. Warnings,
# not errors: ROLL / verl yamls routinely carry kl_loss_coef: 0.001 with use_kl_loss: false.
def warn_options_without_switch(config, reward_norm) -> None:
    pairs = [
        *_loss_pairs(config, reward_norm),
        *_run_pairs(config),
        *_eval_lora_wandb_pairs(config),
    ]
    for option, is_set, switch, switch_on in pairs:
        if is_set and not switch_on:
            _warn(
                f"config.{option}={_get(config, option)!r} has no effect: it is only used "
                f"with {switch}, which is off"
            )


def _loss_pairs(config, reward_norm) -> list[tuple]:
    """(option, set?, switch, switch on?) of the loss, reward and advantage options."""
    return [
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
            config.dual_clip_ratio != _default("dual_clip_ratio"),
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
            "dynamic_sampling_max_rounds",
            config.dynamic_sampling_max_rounds != _default("dynamic_sampling_max_rounds"),
            "dynamic_sampling",
            config.dynamic_sampling,
        ),
        (
            "overlong_penalty_factor",
            config.overlong_penalty_factor != _default("overlong_penalty_factor"),
            "overlong_buffer_len > 0",
            config.overlong_buffer_len > 0,
        ),
        *(
            (name, config[name] != _default(name), "loss_mode='sapo'", config.loss_mode == "sapo")
            for name in SAPO_OPTIONS
        ),
        *(
            (
                name,
                config[name] != _default(name),
                "loss_mode='dppo_tv' or 'dppo_kl'",
                config.loss_mode in ("dppo_tv", "dppo_kl"),
            )
            for name in DPPO_OPTIONS
        ),
        (
            "norm_adv_by_std_in_grpo",
            not config.norm_adv_by_std_in_grpo,
            "adv_estimator='grpo'",
            config.adv_estimator == "grpo",
        ),
    ]


def _run_pairs(config) -> list[tuple]:
    """(option, set?, switch, switch on?) of rollout correction, the continuous engine and
    the warm start."""
    return [
        (
            "rollout_correction_level",
            config.rollout_correction_level != "token",
            "rollout_correction",
            config.rollout_correction != "none",
        ),
        (
            "rollout_correction_threshold",
            config.rollout_correction_threshold != _default("rollout_correction_threshold"),
            "rollout_correction",
            config.rollout_correction != "none",
        ),
        *(
            (
                f"sampling.{name}",
                config.sampling[name] != _default(f"sampling.{name}"),
                'sampling.engine="continuous"',
                config.sampling.engine == "continuous",
            )
            for name in CONTINUOUS_ONLY
        ),
        (
            "warm_start.steps",
            config.warm_start.steps > 0,
            "a scratch model (model.hf_path unset) or warm_start.on_checkpoint",
            not config.model.hf_path or config.warm_start.on_checkpoint,
        ),
        (
            "warm_start.on_checkpoint",
            config.warm_start.on_checkpoint,
            "model.hf_path",
            bool(config.model.hf_path),
        ),
    ]


def _eval_lora_wandb_pairs(config) -> list[tuple]:
    """(option, set?, switch, switch on?) of eval.temperature, model.lora_alpha /
    lora_targets and log.wandb_entity / wandb_mode: each only acts with its switch."""
    wandb_switch = "log.wandb_project", config.log.wandb_project is not None
    lora_switch = "model.lora_rank > 0", config.model.lora_rank > 0
    targets = lora_fields(config)["lora_targets"]
    return [
        (
            "eval.temperature",
            config.eval.temperature != _default("eval.temperature"),
            "eval.pass_k > 0",
            pass_k(config) > 0,
        ),
        ("model.lora_alpha", config.model.lora_alpha != _default("model.lora_alpha"), *lora_switch),
        ("model.lora_targets", set(targets) != set(LORA_TARGETS), *lora_switch),
        ("log.wandb_entity", config.log.wandb_entity is not None, *wandb_switch),
        ("log.wandb_mode", config.log.wandb_mode != "online", *wandb_switch),
    ]


def _default(dotted: str):
    """A field's default, read from configs/base.py (the one place defaults live): an
    option that differs from it while its switch is off is worth a warning."""
    from configs import base

    return _get(base.get_config(), dotted)


# The SAPO and DPPO parameters (a value other than base.py's without its loss_mode warns).
SAPO_OPTIONS = ("sapo_tau_pos", "sapo_tau_neg")
DPPO_OPTIONS = ("dppo_delta_low", "dppo_delta_high", "dppo_max_weight")
# The continuous rollout engine's options, unused by the static engine.
CONTINUOUS_ONLY = ("num_slots", "page_size", "kv_budget_tokens")
