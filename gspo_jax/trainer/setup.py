"""`setup(config, workdir) -> Trainer`: every fixed piece of a run, built once from the config.

A `Trainer` holds what does not change while training (what changes is the `RunState`,
state.py): the mesh, the model config, the tokenizer, the data, the stages of an RL step
(the rollout, the jitted train step, the evaluator), the metric writer and the checkpoint
manager. Each stage holds its own spec (specs.py) and the functions it needs; `setup` is
where the ConfigDict is read, and nothing built here keeps it.

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
from gspo_jax.config import specs
from gspo_jax.config import validate as config_lib
from gspo_jax.data.build import manual_digests
from gspo_jax.rewards import RewardPool, voting
from gspo_jax.rollout.stage import Rollouts, Scorer, make_advantage_fn
from gspo_jax.train_step import StepConfig, batch_shardings, make_logprobs_fn, make_train_step
from gspo_jax.train_step.optim import make_optimizer
from gspo_jax.trainer import memory
from gspo_jax.trainer import state as state_lib
from gspo_jax.trainer import warm_cache as warm_cache_lib
from gspo_jax.trainer.evaluation import Evaluator
from gspo_jax.trainer.io import checkpoint, writers
from gspo_jax.trainer.io import workdir as workdir_lib

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Trainer:
    """The fixed pieces of one run (one per process)."""

    workdir: str
    mesh: Mesh
    model_config: models.ModelConfig
    tokenizer: Any  # transformers tokenizer
    schedule: specs.LoopSpec
    # The stages of an RL step.
    rollouts: Rollouts  # prompts -> the train batch
    step_config: StepConfig
    train_step: Any  # jitted (TrainState, batch) -> (TrainState, metrics)
    evaluator: Evaluator  # params -> held-out metrics
    # Data: the train split's prompt iterator (global batches of rollout_batch_size prompts,
    # this process's rows of each) and, for a scratch model's warm start, the train split.
    train_iter: data.BatchIterator
    warm_start: specs.WarmStartSpec
    prompt: specs.PromptSpec
    sft_source: Any
    data_spec: data.DatasetSpec
    # Optimisation state's layout, and I/O.
    tx: optax.GradientTransformation
    state_shardings: state_lib.RunState  # a RunState of shardings
    pool: RewardPool | None
    writer: writers.MetricsWriter
    manager: ocp.CheckpointManager
    lock: workdir_lib.RunLock | None = None  # one run per workdir, until `close`
    warm_cache: warm_cache_lib.Entry | None = None  # where the warm start is cached (None: off)

    @property
    def is_lead(self) -> bool:
        return jax.process_index() == 0

    def abstract_state(self) -> state_lib.RunState:
        return state_lib.abstract_state(
            models.abstract_params(self.model_config), self.tx, self.state_shardings
        )

    def close(self) -> None:
        """Release the workers, the writer and the checkpoint manager. Never raises: it runs
        on the way out of a failed run, whose own error is the one to report."""
        closers = (
            getattr(self.pool, "close", None),
            self.writer.close,
            functools.partial(checkpoint.close, self.manager),  # bounded (a stalled save)
            checkpoint.release_process_hooks,
            getattr(self.lock, "release", None),  # last: the run's files are all closed
        )
        for close in closers:
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
) -> Trainer:
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
    mesh = sharding_lib.make_mesh(
        config_lib.mesh_shape(c, len(devices)), devices, dcn_data=c.mesh.dcn_data
    )
    checkpoint_dir = os.path.join(workdir, "checkpoints")
    workdir_lib.prepare(workdir, checkpoint_dir)
    run_lock = workdir_lib.lock(workdir)  # before anything in the workdir is written
    try:
        return _setup_locked(c, workdir, mesh, checkpoint_dir, run_lock, allow_config_change)
    except BaseException:
        run_lock.release()  # a failed set-up leaves the workdir free for the next try
        raise


def _setup_locked(c, workdir, mesh, checkpoint_dir, run_lock, allow_config_change) -> Trainer:
    """`setup`'s work once the workdir is checked and locked."""
    steps = checkpoint.existing_steps(checkpoint_dir)
    resuming = bool(steps)
    workdir_lib.check_not_shortened(c.num_steps, steps, checkpoint_dir)
    workdir_lib.record_config(c, workdir, resuming=resuming, allow_change=allow_config_change)

    tokenizer = _tokenizer(c, workdir)
    model_config = specs.model_config(c, tokenizer)
    config_lib.check_model_against_tokenizer(c, model_config, tokenizer)
    memory.check_sampling_fits(c, model_config, list(mesh.devices.flat))
    if c.model.routing_replay and model_config.num_experts == 0:
        raise config_lib.ConfigError(
            f"config.model.routing_replay needs a Mixture-of-Experts model; "
            f"{c.model.hf_path or 'the scratch model'} has none"
        )
    if c.model.router_aux_loss_coef and model_config.num_experts == 0:
        raise config_lib.ConfigError(
            f"config.model.router_aux_loss_coef={c.model.router_aux_loss_coef} needs a "
            f"Mixture-of-Experts model; {c.model.hf_path or 'the scratch model'} has none"
        )
    data_spec = data.get_spec(c.data.name)
    spec = specs.from_config(c, model_config, reference_key=data_spec.reference_key)
    sources = _sources(c, workdir)
    tx = make_optimizer(spec.optim)
    # With LoRA π_ref is the frozen base (rollout/stage.py): no separate copy in the state.
    with_ref = spec.rollout.needs_ref and not model_config.lora_rank
    state_shardings = _state_shardings(model_config, tx, mesh, with_ref)
    pool = RewardPool(spec.reward.num_workers) if spec.reward.num_workers > 0 else None
    return Trainer(
        workdir=workdir,
        mesh=mesh,
        model_config=model_config,
        tokenizer=tokenizer,
        schedule=spec.loop,
        rollouts=_rollouts(spec, model_config, tokenizer, mesh, pool),
        step_config=spec.step,
        train_step=make_train_step(spec.step, tx, state_shardings=state_shardings.train, mesh=mesh),
        evaluator=_evaluator(spec, model_config, tokenizer, mesh, pool, sources[c.data.eval_split]),
        train_iter=prepare_prompts(spec.prompt, sources[c.data.train_split], tokenizer).iterator(
            spec.loop.rollout_batch_size,
            seed=spec.loop.seed,
            train=True,
            rows=sharding_lib.process_rows(mesh, spec.loop.rollout_batch_size),
        ),
        warm_start=spec.warm_start,
        prompt=spec.prompt,
        sft_source=sources[c.data.train_split],
        data_spec=data_spec,
        tx=tx,
        state_shardings=state_shardings,
        pool=pool,
        writer=_writer(c, spec.loop, workdir),
        manager=checkpoint.make_manager(
            checkpoint_dir,
            max_to_keep=spec.loop.max_to_keep,
            async_save=spec.loop.async_save,
            save_timeout_s=spec.loop.save_timeout_s,
        ),
        lock=run_lock,
        warm_cache=_warm_cache(c, workdir, spec.warm_start.steps, data_spec),
    )


def _warm_cache(c, workdir: str, steps: int, data_spec) -> warm_cache_lib.Entry | None:
    """The warm start's cache entry (trainer/warm_cache.py); None without a warm start."""
    if not steps:
        return None
    identity = None
    if c.data.name in data.FILE_DATASETS:
        identity = data_identity(c).name
    elif data_spec.manual_files and c.data.manual_dir:
        identity = manual_digests(c.data.manual_dir, data_spec.manual_files)
    flat = workdir_lib.flat_config(c)
    return warm_cache_lib.entry(c, workdir, flat, specs.checkpoint_dir(c), identity)


def _writer(c, loop: specs.LoopSpec, workdir: str) -> writers.MetricsWriter:
    """metrics.jsonl and TensorBoard on process 0, mirrored to W&B with log.wandb_project."""
    lead = jax.process_index() == 0
    mirrors = []
    if lead and loop.wandb is not None:
        from gspo_jax.trainer.io.wandb_writer import WandbWriter  # wandb is imported there

        mirrors.append(WandbWriter(loop.wandb, workdir, workdir_lib.flat_config(c)))
    return writers.MetricsWriter(
        workdir, tensorboard=loop.tensorboard, enabled=lead, mirrors=mirrors
    )


def _state_shardings(model_config, tx, mesh, with_ref: bool) -> state_lib.RunState:
    """Every array of the RunState laid out: params by their logical axes (and π_ref, with
    a KL term), optimizer moments like their params, the rest replicated."""
    abstract_params = models.abstract_params(model_config)
    param_shardings = sharding_lib.tree_shardings(
        abstract_params, models.logical_axes(model_config), mesh
    )
    return state_lib.state_shardings(abstract_params, param_shardings, tx, mesh, with_ref=with_ref)


def _bind_sampler(model_config, sampler: specs.SamplerSpec, tokenizer):
    """sample(params, prompt_tokens, prompt_mask, key) with the spec's options bound."""
    eos_ids, pad_id = data.stop_token_ids(tokenizer), tokenizer.pad_token_id
    options = sampler.options(eos_ids=eos_ids, pad_id=pad_id)
    return functools.partial(sampling.sample_with, model_config, options=options)


def _rollouts(spec: specs.Specs, model_config, tokenizer, mesh, pool) -> Rollouts:
    same = spec.reward.accuracy == spec.reward.spec
    rollout_mesh = None
    if spec.sampler.rollout_tensor:  # a mesh of its own over the same chips, "tensor" layout
        rollout_mesh = sampling.rollout_mesh(mesh.devices.flat, spec.sampler.rollout_tensor)
        layout = sampling.RolloutLayout(model_config, rollout_mesh, "tensor")
    else:
        layout = sampling.RolloutLayout(model_config, mesh, spec.sampler.layout)
    return Rollouts(
        spec=spec.rollout,
        mesh=mesh,
        tokenizer=tokenizer,
        sample=_bind_sampler(model_config, spec.sampler, tokenizer),
        reward=Scorer.for_reward(spec.reward, pool),
        accuracy=None if same else Scorer.for_accuracy(spec.reward, pool),
        logprobs_fn=make_logprobs_fn(spec.step, mesh=mesh),
        advantage_fn=make_advantage_fn(spec.advantage, mesh),
        batch_shardings=batch_shardings(spec.step, mesh),
        rollout_params=layout if layout.layout == "tensor" else None,
        rollout_mesh=rollout_mesh,
    )


def _evaluator(spec: specs.Specs, model_config, tokenizer, mesh, pool, source) -> Evaluator:
    k = spec.eval.pass_k
    sampled = spec.sampler.sampled_eval(k, spec.eval.temperature) if k else None
    return Evaluator(
        spec=spec.eval,
        sample_greedy=_bind_sampler(model_config, spec.sampler.greedy(), tokenizer),
        eval_data=prepare_prompts(spec.prompt, source, tokenizer),
        tokenizer=tokenizer,
        accuracy=Scorer.for_accuracy(spec.reward, pool),
        mesh=mesh,
        buckets=spec.sampler.buckets,
        sample_k=_bind_sampler(model_config, sampled, tokenizer) if k else None,
        answer_key=voting.answer_key_fn(spec.reward.accuracy) if k else None,
    )


def prepare_prompts(prompt: specs.PromptSpec, source, tokenizer) -> data.PreparedData:
    """A whole split's prompts, templated and padded. Every process prepares the whole split
    and keeps its rows of each global batch, so the batches (and a saved data position) do
    not depend on the number of processes."""
    return data.prepare_prompts(source, tokenizer, **prompt.kwargs(), shard_index=0, shard_count=1)


def _tokenizer(c, workdir: str):
    """The checkpoint's tokenizer, or the char-level one of a scratch run (made once)."""
    if c.model.hf_path or c.model.tokenizer_path:
        return data.load_tokenizer(c.model.tokenizer_path or specs.checkpoint_dir(c))
    path = os.path.join(workdir, "tokenizer")
    return sharding_lib.lead_first(
        "tokenizer", lambda: data.make_char_tokenizer(path), lambda: data.load_tokenizer(path)
    )


def data_identity(c):
    """The builder config of your files (data.name "jsonl", "parquet", "hf"), named by a
    digest of their contents and keys; None for the other datasets."""
    d = c.data
    if d.name == "hf":
        return data.hf_config(d.hf_path, d.prompt_key, d.answer_key, download=d.download)
    if d.name in data.FILE_DATASETS:
        return data.jsonl_config(d.train_path, d.test_path, d.prompt_key, d.answer_key)
    return None


def _sources(c, workdir: str) -> dict:
    """{split: random-access source}; one process writes the dataset, the others read it."""
    tfds.disable_progress_bar()  # one progress bar per run is ours
    config_name = c.data.config_name or None
    if c.data.name in data.FILE_DATASETS:  # one builder config per set of files and keys
        config_name = data_identity(c)
    build = functools.partial(
        data.build_dataset,
        c.data.name,
        config_name,
        data_dir=c.data.data_dir or os.path.join(workdir, "data"),
        manual_dir=c.data.manual_dir,
        splits=(c.data.train_split, c.data.eval_split),
    )
    return sharding_lib.lead_first("dataset", build, lambda: build(prepare=False))
