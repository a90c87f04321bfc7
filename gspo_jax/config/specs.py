"""The config, translated once: one frozen, typed spec per stage of an RL step.

`setup` (setup.py) validates the experiment ConfigDict (config.py), then calls `from_config`
here; every stage below it takes its spec and the functions it needs, and nothing below
trainer/ ever reads the ConfigDict. Each derived count (responses per step, optimizer
updates per step and per run, the token-level KL switch, ...) is computed here, once.

    SamplerSpec     sampling.sample's options: the rollout's G samples, or greedy evaluation
    RewardSpec      the verifiers: reward and accuracy specs, failure rule, workers, timeout
    AdvantageSpec   compute_advantages' options (ROLL's names), the token-level KL reward
    RolloutSpec     what the rollout hands the train step (π_ref, the token-level KL's π_old)
    StepConfig      the train step's static configuration (train_step/step.py)
    OptimSpec       the optax chain (train_step/optim.py)
    PromptSpec      how prompts are templated and padded (data.prepare_prompts)
    WarmStartSpec   the supervised warm start of a scratch or loaded model (warm_start.py)
    EvalSpec        held-out evaluation
    LoopSpec        the loop's schedule: steps, evaluation / checkpoint cadence, outputs

Validation (config.py) runs before any of this, so the builders here assume a valid config.
"""

from __future__ import annotations

import dataclasses

from gspo_jax import models
from gspo_jax.train_step import StepConfig
from gspo_jax.train_step.optim import OptimSpec


def normalize_reward_norm(value: str | None) -> str | None:
    """ROLL writes `reward_norm: null`; on the command line that arrives as "None"/"none"."""
    if value is None or str(value).lower() in ("none", "null", ""):
        return None
    return value


def batch_sizes(config) -> dict[str, int]:
    """The derived sizes of one RL step: responses, mini-batch and micro-batch."""
    responses = config.rollout_batch_size * config.num_return_sequences_in_group
    mini = responses // config.num_mini_batches
    micro = config.micro_batch_size or mini
    return {"responses": responses, "mini_batch": mini, "micro_batch": micro}


# ------------------------------------------------------------------------------------- model


# model.scan_layers=None scans a model of more than this many layers
UNROLLED_MAX_LAYERS = 4


def model_numerics(config, num_layers: int) -> dict:
    """The run's numerics, applied to any architecture (a checkpoint's, a preset's) of
    `num_layers` layers (which `model.scan_layers=None` decides on)."""
    m = config.model
    scan = m.scan_layers if m.scan_layers is not None else num_layers > UNROLLED_MAX_LAYERS
    return {
        "param_dtype": m.param_dtype,
        "dtype": m.dtype,
        "remat": m.remat,
        "moe_impl": m.moe_impl,
        "attention_impl": m.attention_impl,
        "scan_layers": scan,
        **lora_fields(config),
    }


def lora_fields(config) -> dict:
    """ModelConfig's LoRA fields of `model.lora_*` (targets: the comma-separated string)."""
    m = config.model
    targets = tuple(t.strip() for t in str(m.lora_targets).split(",") if t.strip())
    return {"lora_rank": m.lora_rank, "lora_alpha": m.lora_alpha, "lora_targets": targets}


def model_config(config, tokenizer) -> models.ModelConfig:
    """The policy's architecture and numerics.

    With `model.hf_path`: the checkpoint's config.json, with the run's `model_numerics`.
    Otherwise the scratch model of `model.*`, its vocabulary and special tokens taken from
    the tokenizer.
    """
    m = config.model
    if m.hf_path:
        hf = models.read_model_config(checkpoint_dir(config))
        return dataclasses.replace(hf, **model_numerics(config, hf.num_layers))
    from gspo_jax import data

    return scratch_model_config(
        config,
        vocab_size=len(tokenizer),
        eos_token_ids=tuple(data.stop_token_ids(tokenizer)),
        pad_token_id=tokenizer.pad_token_id,
    )


def scratch_model_config(config, **tokens) -> models.ModelConfig:
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
        qk_norm=m.arch not in ("qwen2", "llama"),
        num_experts=m.num_experts if moe else 0,
        num_experts_per_tok=m.num_experts_per_tok if moe else 0,
        moe_intermediate_size=m.moe_intermediate_size if moe else 0,
        norm_topk_prob=moe,
        max_position_embeddings=max(4096, config.prompt_length + config.response_length),
        **model_numerics(config, m.num_layers),
        **tokens,
    )


# ---------------------------------------------------------------------------- the rollout


@dataclasses.dataclass(frozen=True)
class SamplerSpec:
    """`sampling.sample`'s options (the end ids and pad id come from the tokenizer)."""

    num_samples: int
    max_new_tokens: int
    temperature: float
    top_k: int | None
    top_p: float | None
    buckets: tuple[int, ...]
    engine: str = "continuous"
    num_slots: int | None = None
    page_size: int = 16
    kv_budget_tokens: int | None = None
    layout: str = "auto"
    kv_dtype: str = "auto"
    shared_prefix_attention: bool = True
    rollout_tensor: int = 0  # > 0: the rollout's own mesh (sampling.rollout_mesh.tensor)

    def greedy(self) -> SamplerSpec:
        """One temperature-0 response per prompt (held-out evaluation, on the trainer's mesh)."""
        return dataclasses.replace(
            self, num_samples=1, temperature=0.0, top_k=None, top_p=None, rollout_tensor=0
        )

    def sampled_eval(self, num_samples: int, temperature: float) -> SamplerSpec:
        """`num_samples` responses per prompt at `temperature`, unfiltered (pass@k, maj@k):
        one call per prompt batch, the prompt's prefill shared by its samples."""
        return dataclasses.replace(self.greedy(), num_samples=num_samples, temperature=temperature)

    def kwargs(self) -> dict:
        """`sampling.sample`'s keyword arguments (the mesh is the caller's)."""
        kwargs = dataclasses.asdict(self)
        if kwargs.pop("rollout_tensor"):
            kwargs["layout"] = "tensor"  # the rollout's own mesh is laid out for decoding
        return kwargs

    def options(self, *, eos_ids, pad_id: int):
        """`sampling.SampleOptions` of this spec with the tokenizer's end and pad ids."""
        from gspo_jax import sampling

        return sampling.SampleOptions(eos_ids=tuple(eos_ids), pad_id=int(pad_id), **self.kwargs())


@dataclasses.dataclass(frozen=True)
class RewardSpec:
    """The verifiers (gspo_jax.rewards): `spec` scores the rollout, `accuracy` (0/1) is
    reported as accuracy; a failed verification follows `invalid_reward` ("mask" / "zero").
    `timeout_s` is None when scoring runs in-process (`num_workers` = 0), where
    `in_process_timeout_s` bounds each call instead (SIGALRM, rewards/scoring.py)."""

    spec: str
    accuracy: str
    invalid_reward: str
    num_workers: int
    timeout_s: float | None
    max_failed_rollouts: int
    in_process_timeout_s: float | None = None


@dataclasses.dataclass(frozen=True)
class AdvantageSpec:
    """`advantages.compute_advantages` options (ROLL's names), and the token-level KL reward
    (`add_token_level_kl`): r_t = −token_level_kl_coef · KL_t(π_old ‖ π_ref) per token."""

    group_size: int
    adv_estimator: str
    reward_clip: float | None
    reward_norm: str | None
    reward_shift: bool
    reward_scale: bool
    whiten_advantages: bool
    advantage_clip: float | None
    norm_adv_by_std_in_grpo: bool
    token_level_kl: bool
    token_level_kl_coef: float
    kl_estimator: str

    def kwargs(self) -> dict:
        """`compute_advantages` / `compute_token_advantages` keyword arguments."""
        names = (
            "group_size",
            "adv_estimator",
            "reward_clip",
            "reward_norm",
            "reward_shift",
            "reward_scale",
            "whiten_advantages",
            "advantage_clip",
            "norm_adv_by_std_in_grpo",
        )
        return {name: getattr(self, name) for name in names}


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    """What the rollout hands the train step besides the samples: π_ref's log-probs (a KL
    term in the loss, `use_kl_loss`, or in the reward) and, for the token-level KL reward,
    π_old's (`old_logprobs_source`, algorithm/old_policy.py); DAPO's dynamic sampling and
    overlong handling (rollout/filtering.py)."""

    group_size: int
    response_length: int
    buckets: tuple[int, ...]
    use_kl_loss: bool
    token_level_kl: bool
    old_logprobs_source: str
    # DAPO's options (filtering.py), off by default
    dynamic_sampling: bool = False  # drop zero-std groups, refill from the data stream
    dynamic_sampling_max_rounds: int = 0  # extra sampling rounds per RL step at most
    overlong_filter: bool = False  # truncated responses get no loss
    overlong_buffer_len: int = 0  # soft overlong penalty's buffer L_b (0: no penalty)
    overlong_penalty_factor: float = 1.0  # the penalty at L = response_length is -factor

    @property
    def needs_ref(self) -> bool:
        return self.use_kl_loss or self.token_level_kl


# ------------------------------------------------------------------------ data and loop


@dataclasses.dataclass(frozen=True)
class PromptSpec:
    """How `data.prepare_prompts` templates and pads prompts (the warm start's too)."""

    prompt_length: int
    reference_key: str
    system_prompt: str | None
    instruction: str | None
    overlong: str
    # data/templates.py: None (the tokenizer's own), "none" (plain text), or Jinja text
    chat_template: str | None = None
    enable_thinking: bool | None = None  # passed to the template; None: its default

    def kwargs(self) -> dict:
        out = dataclasses.asdict(self)
        thinking = out.pop("enable_thinking")
        out["chat_template_kwargs"] = None if thinking is None else {"enable_thinking": thinking}
        return out


@dataclasses.dataclass(frozen=True)
class WarmStartSpec:
    """The supervised warm start (warm_start.py) of the scratch model, or of model.hf_path's
    weights with warm_start.on_checkpoint; steps = 0: none."""

    steps: int
    batch_size: int
    learning_rate: float
    teacher_error_rate: float
    seed: int
    response_length: int
    chunk_size: int
    # Train to a target instead of a step count (None: run `steps`): greedy accuracy on
    # the first `check_prompts` train-split problems every `check_every` steps; stop at the
    # first check at or above the target, else at `max_steps` (the learning rate holds its
    # final value past `steps`).
    target_accuracy: float | None = None
    check_every: int = 100
    check_prompts: int = 200
    max_steps: int = 0
    router_aux_loss_coef: float = 0.0  # model.router_aux_loss_coef: MoE load balancing


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """Held-out evaluation: at the start, every `every_steps` (0: only the ends). Greedy
    accuracy always; with `pass_k` k >= 1 also pass@1..k and maj@k of k samples per
    prompt at `temperature`, drawn from the eval stream of `seed` (trainer/evaluation.py)."""

    every_steps: int
    num_prompts: int
    batch_size: int
    pass_k: int = 0  # k (0: greedy only)
    temperature: float = 1.0
    seed: int = 0
    save_per_problem: bool = False  # WORKDIR/eval_problems/ (trainer/loop.py)


@dataclasses.dataclass(frozen=True)
class WandbSpec:
    """`wandb.init`'s options (`log.wandb_*`, trainer/io/wandb_writer.py; the run is named
    after the workdir)."""

    project: str
    entity: str | None
    mode: str  # "online" | "offline" ("disabled": no WandbSpec at all)


@dataclasses.dataclass(frozen=True)
class LoopSpec:
    """The loop's schedule and outputs."""

    num_steps: int
    seed: int
    rollout_batch_size: int
    updates_per_step: int  # ppo_epochs × num_mini_batches
    checkpoint_every: int
    max_to_keep: int
    async_save: bool
    save_timeout_s: float  # a save (or its background write) taking longer stops the run
    export_hf: bool
    progress_bar: bool
    tensorboard: bool
    plot: bool
    hf_path: str | None  # the checkpoint the policy starts from (None: scratch)
    param_dtype: str
    max_all_skipped_steps: int  # RL steps in a row with every update skipped that stop the
    # run (0: never)
    wandb: WandbSpec | None = None  # the W&B run the metrics also go to (None: none)
    profile_steps: tuple[int, ...] = ()  # RL steps traced into workdir/profile (io/profile.py)


@dataclasses.dataclass(frozen=True)
class Specs:
    """Every stage's spec of one run (`from_config`)."""

    sampler: SamplerSpec
    reward: RewardSpec
    advantage: AdvantageSpec
    rollout: RolloutSpec
    step: StepConfig
    optim: OptimSpec
    prompt: PromptSpec
    warm_start: WarmStartSpec
    eval: EvalSpec
    loop: LoopSpec


def from_config(config, model_config: models.ModelConfig, *, reference_key: str) -> Specs:
    """Every stage's spec from a validated config (`reference_key`: the dataset's record
    field the reward compares with)."""
    c = config
    step = step_config(c, model_config)
    return Specs(
        sampler=sampler_spec(c),
        reward=RewardSpec(
            spec=c.reward.spec,
            accuracy=c.reward.accuracy,
            invalid_reward=c.invalid_reward,
            num_workers=c.reward.num_workers,
            timeout_s=c.reward.timeout_s if c.reward.num_workers > 0 else None,
            max_failed_rollouts=c.reward.max_failed_rollouts,
            in_process_timeout_s=c.reward.timeout_s if c.reward.num_workers == 0 else None,
        ),
        advantage=advantage_spec(c),
        rollout=RolloutSpec(
            group_size=c.num_return_sequences_in_group,
            response_length=c.response_length,
            buckets=tuple(c.sampling.prompt_buckets),
            use_kl_loss=bool(c.use_kl_loss),
            token_level_kl=bool(c.add_token_level_kl),
            old_logprobs_source=c.old_logprobs_source,
            dynamic_sampling=bool(c.dynamic_sampling),
            dynamic_sampling_max_rounds=int(c.dynamic_sampling_max_rounds),
            overlong_filter=bool(c.overlong_filter),
            overlong_buffer_len=int(c.overlong_buffer_len),
            overlong_penalty_factor=float(c.overlong_penalty_factor),
        ),
        step=step,
        optim=optim_spec(c, updates_per_step=step.num_updates),
        prompt=_prompt_spec(c, reference_key),
        warm_start=_warm_start_spec(c),
        eval=EvalSpec(
            c.eval.every_steps,
            c.eval.num_prompts,
            c.eval.batch_size,
            pass_k=pass_k(c),
            temperature=float(c.eval.temperature),
            seed=c.seed,
            save_per_problem=c.eval.save_per_problem,
        ),
        loop=_loop_spec(c, step),
    )


def sampler_spec(c) -> SamplerSpec:
    """The rollout's sampler options (`.greedy()` for evaluation)."""
    s = c.sampling
    return SamplerSpec(
        num_samples=c.num_return_sequences_in_group,
        max_new_tokens=c.response_length,
        temperature=float(s.temperature),
        top_k=s.top_k,
        top_p=s.top_p,
        buckets=tuple(s.prompt_buckets),
        engine=s.engine,
        num_slots=s.num_slots,
        page_size=s.page_size,
        kv_budget_tokens=s.kv_budget_tokens,
        layout=s.rollout_layout,
        kv_dtype=s.kv_dtype,
        shared_prefix_attention=bool(s.shared_prefix_attention),
        rollout_tensor=int(s.rollout_mesh.tensor),
    )


def advantage_spec(c) -> AdvantageSpec:
    return AdvantageSpec(
        group_size=c.num_return_sequences_in_group,
        adv_estimator=c.adv_estimator,
        reward_clip=c.reward_clip,
        reward_norm=normalize_reward_norm(c.reward_norm),
        reward_shift=c.reward_shift,
        reward_scale=c.reward_scale,
        whiten_advantages=c.whiten_advantages,
        advantage_clip=c.advantage_clip,
        norm_adv_by_std_in_grpo=bool(c.norm_adv_by_std_in_grpo),
        token_level_kl=bool(c.add_token_level_kl),
        token_level_kl_coef=float(c.token_level_kl_coef),
        kl_estimator=c.kl_estimator,
    )


def _prompt_spec(c, reference_key: str) -> PromptSpec:
    from gspo_jax import data

    instruction = data.DEFAULT_INSTRUCTION if c.data.instruction is None else c.data.instruction
    return PromptSpec(
        prompt_length=c.prompt_length,
        reference_key=reference_key,
        system_prompt=c.data.system_prompt,
        instruction=instruction or None,
        overlong=c.data.overlong,
        chat_template=data.resolve_chat_template(c.data.chat_template),
        enable_thinking=c.data.enable_thinking,
    )


def _warm_start_spec(c) -> WarmStartSpec:
    w = c.warm_start
    return WarmStartSpec(
        steps=int(w.steps) if not c.model.hf_path or w.on_checkpoint else 0,
        batch_size=w.batch_size,
        learning_rate=float(w.learning_rate),
        teacher_error_rate=float(w.teacher_error_rate),
        seed=c.seed + 1,
        response_length=c.response_length,
        chunk_size=c.logprob_chunk_size,
        target_accuracy=float(w.target_accuracy) if w.target_accuracy else None,
        check_every=int(w.check_every),
        check_prompts=int(w.check_prompts),
        max_steps=int(w.steps if w.max_steps is None else w.max_steps),
        router_aux_loss_coef=float(c.model.router_aux_loss_coef),
    )


def _loop_spec(c, step: StepConfig) -> LoopSpec:
    return LoopSpec(
        num_steps=c.num_steps,
        seed=c.seed,
        rollout_batch_size=c.rollout_batch_size,
        updates_per_step=step.num_updates,
        checkpoint_every=c.checkpoint.every_steps,
        max_to_keep=c.checkpoint.max_to_keep,
        async_save=c.checkpoint.async_save,
        save_timeout_s=float(c.checkpoint.save_timeout_s),
        export_hf=c.checkpoint.export_hf,
        progress_bar=c.log.progress_bar,
        tensorboard=c.log.tensorboard,
        plot=c.log.plot,
        hf_path=checkpoint_dir(c),
        param_dtype=c.model.param_dtype,
        max_all_skipped_steps=c.max_all_skipped_steps,
        wandb=wandb_spec(c),
        profile_steps=tuple(int(s) for s in c.log.profile_steps),
    )


def wandb_spec(c) -> WandbSpec | None:
    """The W&B run of `log.wandb_*` (None without a project, or with mode "disabled")."""
    if c.log.wandb_project is None or c.log.wandb_mode == "disabled":
        return None
    return WandbSpec(c.log.wandb_project, c.log.wandb_entity, c.log.wandb_mode)


def optim_spec(c, *, updates_per_step: int | None = None) -> OptimSpec:
    """The optax chain's settings; its schedule spans every update of the run
    (`updates_per_step`: the train step's `StepConfig.num_updates`; given alone, a config's
    optimizer is built as the run's would be)."""
    if updates_per_step is None:
        updates_per_step = c.ppo_epochs * c.num_mini_batches
    o = c.optim
    return OptimSpec(
        learning_rate=float(o.learning_rate),
        schedule=o.schedule,
        warmup_steps=int(o.warmup_steps),
        end_lr_ratio=float(o.end_lr_ratio),
        weight_decay=float(o.weight_decay),
        b1=float(o.b1),
        b2=float(o.b2),
        eps=float(o.eps),
        max_grad_norm=o.max_grad_norm,
        total_updates=c.num_steps * updates_per_step,
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
        loss_mode=config.loss_mode,
        sapo_tau_pos=float(config.sapo_tau_pos),
        sapo_tau_neg=float(config.sapo_tau_neg),
        dppo_delta_low=float(config.dppo_delta_low),
        dppo_delta_high=float(config.dppo_delta_high),
        dppo_max_weight=float(config.dppo_max_weight),
        opsm_delta=None if config.opsm_delta is None else float(config.opsm_delta),
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
        rollout_correction=config.rollout_correction,
        rollout_correction_level=config.rollout_correction_level,
        rollout_correction_threshold=float(config.rollout_correction_threshold),
        routing_replay=bool(config.model.routing_replay),
        router_aux_loss_coef=float(config.model.router_aux_loss_coef),
        token_advantages=bool(config.add_token_level_kl),
        group_size=int(config.num_return_sequences_in_group),
        shared_prompt=bool(config.shared_prompt),
        packing=packing_on(config),
        pack_length=int(config.pack_length),
    )


# packing=None (the default) packs from this response length: a packed-row bucket's compile
# pays back in ~15 steps here, ~50 at 32 tokens, ~300 at 16 (docs/benchmarks.md, packing)
PACKING_MIN_RESPONSE_LENGTH = 64


def packing_on(config) -> bool:
    """`config.packing`, or when it is None: response_length ≥ PACKING_MIN_RESPONSE_LENGTH."""
    return resolve_packing(config.packing, config.response_length)


def resolve_packing(packing: bool | None, response_length: int) -> bool:
    """What `packing` means at `response_length` (None: on from PACKING_MIN_RESPONSE_LENGTH)."""
    return response_length >= PACKING_MIN_RESPONSE_LENGTH if packing is None else bool(packing)


def pass_k_field(config) -> str:
    """The field k was given as: `eval.pass_k`, or its deprecated name `eval.num_samples`."""
    return "eval.pass_k" if config.eval.get("num_samples") is None else "eval.num_samples"


def pass_k(config) -> int:
    """k of pass@k / maj@k, from whichever field `pass_k_field` names."""
    field = pass_k_field(config).split(".")[1]
    return config.eval[field]


def checkpoint_dir(config) -> str | None:
    """The local directory of `model.hf_path` (a directory, or a Hub id found in the
    Hugging Face cache, downloaded first only with `model.download`); None for scratch."""
    from gspo_jax.models import hub

    m = config.model
    return hub.resolve(m.hf_path, download=bool(m.get("download", False))) if m.hf_path else None
