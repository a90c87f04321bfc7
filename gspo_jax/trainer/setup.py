"""`setup(config, workdir) -> Run`: every fixed piece of a run, built once from the config.

A `Run` holds what does not change while training (what changes is the `RunState`,
state.py): the mesh, the model config, the tokenizer, the data, the jitted functions, the
reward scorers, the metric writer and the checkpoint manager. The loop (train.py) and the
rollout (rollout.py) read it; nothing writes to it after `setup`, except the prompt
iterator advancing (its position is part of the `RunState`).

`setup` does the cheap checks first, before any data, model or compile work: the config is
validated, the workdir must be a writable directory, a resumed run's config is compared
with the one it was started with (workdir.py), and the tokenizer is checked against the
model's vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Sequence
from typing import Any

import jax
import optax
import orbax.checkpoint as ocp
import tensorflow_datasets as tfds
from jax.sharding import Mesh

from gspo_jax import data, models, sampling
from gspo_jax import sharding as sharding_lib
from gspo_jax.rewards import RewardPool, build_reward
from gspo_jax.train_step import (
    StepConfig,
    batch_shardings,
    make_logprobs_fn,
    make_train_step,
    optim,
)
from gspo_jax.trainer import checkpoint, rollout, writers
from gspo_jax.trainer import config as config_lib
from gspo_jax.trainer import state as state_lib
from gspo_jax.trainer import workdir as workdir_lib

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Run:
    """The fixed pieces of one run (one per process)."""

    config: Any  # the experiment ConfigDict (configs/base.py)
    workdir: str
    mesh: Mesh
    model_config: models.ModelConfig
    step_config: StepConfig
    tokenizer: Any  # transformers tokenizer
    eos_ids: tuple[int, ...]
    pad_id: int
    # Data: the train split's prompt iterator (global batches of rollout_batch_size prompts,
    # this process's rows of each) and the whole held-out split.
    train_iter: data.BatchIterator
    eval_data: data.PreparedData
    sft_source: Any  # the train split's records, for the supervised warm start
    data_spec: data.DatasetSpec
    prompt_kwargs: dict  # data.prepare_prompts' template options (the warm start's too)
    # Optimisation and the jitted functions of one RL step.
    tx: optax.GradientTransformation
    state_shardings: state_lib.RunState  # a RunState of shardings
    train_step: Any  # (TrainState, batch) -> (TrainState, metrics)
    batch_shardings: dict  # the train batch's layout, as the train step declares it
    logprobs_fn: Any  # (params, tokens, mask, T) -> (logprobs, entropy, routing): π_ref
    # (and π_old for the token-level KL reward), the whole batch at once
    advantage_fn: Any  # rollout.make_advantage_fn
    # Rewards and I/O.
    reward: rollout.Scorer
    accuracy: rollout.Scorer
    pool: RewardPool | None
    writer: writers.MetricsWriter
    manager: ocp.CheckpointManager

    @property
    def is_lead(self) -> bool:
        return jax.process_index() == 0

    @property
    def needs_ref(self) -> bool:
        """π_ref is part of the state (a KL term in the loss or in the reward)."""
        return self.state_shardings.ref_params is not None

    def abstract_state(self) -> state_lib.RunState:
        return state_lib.abstract_state(
            models.abstract_params(self.model_config), self.tx, self.state_shardings
        )

    def sample(self, params, prompt_tokens, prompt_mask, key, *, greedy: bool = False):
        """`sampling.sample` with the config's options (greedy: one temperature-0 response)."""
        return sampling.sample(
            self.model_config,
            params,
            prompt_tokens,
            prompt_mask,
            key,
            eos_ids=self.eos_ids,
            pad_id=self.pad_id,
            **config_lib.sampler_kwargs(self.config, greedy=greedy),
        )

    def close(self) -> None:
        """Release the workers, the writer and the checkpoint manager. Never raises: it runs
        on the way out of a failed run, whose own error is the one to report."""
        for close in (getattr(self.pool, "close", None), self.writer.close, self.manager.close):
            if close is None:
                continue
            try:
                close()
            except Exception as e:  # noqa: BLE001
                log.debug("closing %s: %s", close, e)


def setup(
    config,
    workdir: str,
    *,
    allow_config_change: bool = False,
    devices: Sequence[jax.Device] | None = None,
) -> Run:
    """Validate `config`, then build every fixed piece of the run in `workdir`.

    `allow_config_change`: resume a workdir whose run was started with a config that
    differs in fields that change the run (workdir.record_config).
    The mesh (config.mesh) spans `devices`, by default all of them; a subset runs a
    one-device reference beside a sharded run in one process (tests, a Colab).
    """
    c = config
    workdir = os.path.abspath(workdir)
    devices = list(jax.devices() if devices is None else devices)
    config_lib.validate(c, num_devices=len(devices), num_processes=jax.process_count())
    mesh = sharding_lib.make_mesh(config_lib.mesh_shape(c, len(devices)), devices)
    checkpoint_dir = os.path.join(workdir, "checkpoints")
    workdir_lib.prepare(workdir, checkpoint_dir)
    workdir_lib.record_config(
        c,
        workdir,
        resuming=bool(checkpoint.existing_steps(checkpoint_dir)),
        allow_change=allow_config_change,
    )

    tokenizer = _tokenizer(c, workdir)
    model_config = config_lib.model_config(c, tokenizer)
    config_lib.check_model_against_tokenizer(c, model_config, tokenizer)
    if c.model.routing_replay and model_config.num_experts == 0:
        raise config_lib.ConfigError(
            f"config.model.routing_replay needs a Mixture-of-Experts model; "
            f"{c.model.hf_path or 'the scratch model'} has none"
        )
    spec = data.get_spec(c.data.name)
    sources = _sources(c, workdir)
    instruction = data.DEFAULT_INSTRUCTION if c.data.instruction is None else c.data.instruction
    prompt_kwargs = {
        "prompt_length": c.prompt_length,
        "reference_key": spec.reference_key,
        "system_prompt": c.data.system_prompt,
        "instruction": instruction or None,
        "overlong": c.data.overlong,
    }
    # Every process prepares the whole split and keeps its rows of each global batch, so the
    # batches (and a saved data position) do not depend on the number of processes.
    whole = {"shard_index": 0, "shard_count": 1}
    train_data = data.prepare_prompts(
        sources[c.data.train_split], tokenizer, **prompt_kwargs, **whole
    )

    step_config = config_lib.step_config(c, model_config)
    tx = optim.make_optimizer(c.optim, c.num_steps * c.ppo_epochs * c.num_mini_batches)
    abstract_params = models.abstract_params(model_config)
    param_shardings = sharding_lib.tree_shardings(
        abstract_params, models.logical_axes(model_config), mesh
    )
    state_shardings = state_lib.state_shardings(
        abstract_params,
        param_shardings,
        tx,
        mesh,
        with_ref=bool(c.use_kl_loss or c.add_token_level_kl),
    )
    if c.old_logprobs_source == "sampler":
        sampling.warn_if_biased_pi_old(c.sampling.top_k, c.sampling.top_p)

    pool = RewardPool(c.reward.num_workers) if c.reward.num_workers > 0 else None
    timeout = c.reward.timeout_s if pool is not None else None
    return Run(
        config=c,
        workdir=workdir,
        mesh=mesh,
        model_config=model_config,
        step_config=step_config,
        tokenizer=tokenizer,
        eos_ids=tuple(data.stop_token_ids(tokenizer)),
        pad_id=int(tokenizer.pad_token_id),
        train_iter=train_data.iterator(
            c.rollout_batch_size,
            seed=c.seed,
            train=True,
            rows=sharding_lib.process_rows(mesh, c.rollout_batch_size),
        ),
        eval_data=data.prepare_prompts(
            sources[c.data.eval_split], tokenizer, **prompt_kwargs, **whole
        ),
        sft_source=sources[c.data.train_split],
        data_spec=spec,
        prompt_kwargs=prompt_kwargs,
        tx=tx,
        state_shardings=state_shardings,
        train_step=make_train_step(
            step_config, tx, state_shardings=state_shardings.train, mesh=mesh
        ),
        batch_shardings=batch_shardings(step_config, mesh),
        logprobs_fn=make_logprobs_fn(step_config),
        advantage_fn=rollout.make_advantage_fn(c, mesh),
        reward=rollout.Scorer(
            build_reward(c.reward.spec),
            c.invalid_reward,
            timeout_s=timeout,
            pool=pool,
            max_failed_batches=c.reward.max_failed_rollouts,
        ),
        # Accuracy counts a failed verification as wrong (0), never as missing.
        accuracy=rollout.Scorer(
            build_reward(c.reward.accuracy), "zero", timeout_s=timeout, pool=pool
        ),
        pool=pool,
        writer=writers.MetricsWriter(
            workdir, tensorboard=c.log.tensorboard, enabled=jax.process_index() == 0
        ),
        manager=checkpoint.make_manager(
            checkpoint_dir,
            max_to_keep=c.checkpoint.max_to_keep,
            async_save=c.checkpoint.async_save,
        ),
    )


def _tokenizer(c, workdir: str):
    """The checkpoint's tokenizer, or the char-level one of a scratch run (made once)."""
    if c.model.hf_path or c.model.tokenizer_path:
        return data.load_tokenizer(c.model.tokenizer_path or c.model.hf_path)
    path = os.path.join(workdir, "tokenizer")
    return sharding_lib.lead_first(
        "tokenizer", lambda: data.make_char_tokenizer(path), lambda: data.load_tokenizer(path)
    )


def _sources(c, workdir: str) -> dict:
    """{split: random-access source}; one process writes the dataset, the others read it."""
    tfds.disable_progress_bar()  # one progress bar per run is ours
    build = functools.partial(
        data.build_dataset,
        c.data.name,
        c.data.config_name or None,
        data_dir=c.data.data_dir or os.path.join(workdir, "data"),
        manual_dir=c.data.manual_dir,
        splits=(c.data.train_split, c.data.eval_split),
    )
    return sharding_lib.lead_first("dataset", build, lambda: build(prepare=False))
