"""The RL loop: prompts -> G samples each -> rewards -> advantages -> train step, repeated.

`run(config, workdir)` is everything `python -m gspo_jax.main` does after flag parsing; it is
importable, so a Colab or a test runs the same loop. It is built from small pieces, each
usable on its own (docs/architecture.md):

  setup.setup(config, workdir) -> Trainer      the fixed pieces: mesh, model, data, stages
  init_or_restore(trainer) -> RunState         the changing state (state.py)
  trainer.rollouts.collect(state, prompts)     sample, score, π_ref, advantages -> Rollout
  rl_step(trainer, state, rollout)             the jitted train step on that rollout
  trainer.evaluator(params)                    greedy held-out accuracy

Resume order (automatic): the workdir's latest checkpoint -> config.model.hf_path -> scratch
initialisation (+ the supervised warm start, saved as checkpoint 0). A killed run restarted
with the same command continues as if never stopped: everything that changes is in the
`RunState`, and all of it is in the checkpoint. SIGTERM / SIGINT stop the loop at the next
step boundary with a checkpoint (preemption.py); what happens on each failure is listed in
docs/failures.md.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from typing import Any

import jax
import numpy as np

from gspo_jax import models
from gspo_jax.trainer import checkpoint, preemption, writers
from gspo_jax.trainer import state as state_lib
from gspo_jax.trainer import warm_start as warm_start_lib
from gspo_jax.trainer.rollout import Rollout
from gspo_jax.trainer.setup import Trainer, setup
from gspo_jax.trainer.state import RunState

log = logging.getLogger(__name__)

# Metric keys shown on the progress bar (short label -> key).
PROGRESS_KEYS = {
    "reward": "reward/mean",
    "acc": "reward/accuracy",
    "eval": "eval/accuracy",
    "clip": "policy/clipfrac",
    "kl": "policy/approx_kl",
}


def run(
    config,
    workdir: str,
    *,
    stop_after: int | None = None,
    allow_config_change: bool = False,
) -> dict[str, Any]:
    """Train with `config` in `workdir` (resuming if it holds a checkpoint); returns a summary.

    `stop_after=k` stops right after RL step k has been checkpointed, skipping the end-of-run
    work, as a preempted job would. `allow_config_change` resumes a workdir whose run was
    started with a config that differs in fields that change the run (workdir.py).
    A signal-stopped run's summary has `preempted` (the signal's name) and `stopped_after`.
    """
    trainer = setup(config, workdir, allow_config_change=allow_config_change)
    try:
        # The model's shard_map regions (splash attention, per-device MoE) read the mesh in
        # context when the jitted functions are traced.
        with jax.set_mesh(trainer.mesh):
            summary = train(trainer, init_or_restore(trainer), stop_after=stop_after)
    finally:
        trainer.close()
    if trainer.is_lead:
        with open(os.path.join(trainer.workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2, default=str)
    return summary


def train(trainer: Trainer, state: RunState, *, stop_after: int | None = None) -> dict[str, Any]:
    """The loop, from `state` to the schedule's num_steps RL steps (see `run`)."""
    schedule = trainer.schedule
    log.info("starting at RL step %d from %s", state.step, state.origin)
    summary: dict[str, Any] = {"origin": state.origin, "start_step": state.step}
    report = _Reporter(trainer, initial=state.step)
    if state.step == 0:
        first = trainer.evaluator(state.train.params)
        report.write(0, first)
        summary["eval_start"] = first["eval/accuracy"]
    saved = state.step if state.step in trainer.manager.all_steps() else None
    with preemption.StopOnSignal() as signals:
        while state.step < schedule.num_steps:
            if signum := signals.requested():
                _stop_on_signal(trainer, state, signum, summary, saved=saved == state.step)
                break
            state, metrics = _one_step(trainer, state)
            done, last = state.step, state.step == schedule.num_steps
            stopping = stop_after is not None and done >= stop_after and not last
            if last or _every(done, trainer.evaluator.spec.every_steps):
                metrics.update(trainer.evaluator(state.train.params))
                summary["eval_end"] = metrics["eval/accuracy"]
            saving = last or stopping or _every(done, schedule.checkpoint_every)
            if saving:
                checkpoint.save(trainer.manager, state)
                saved = done
            # A checkpointed step's row is written now: a restart from it repeats no row.
            report.step(done, metrics, flush=saving)
            checkpoint.check(trainer.manager)  # a failed asynchronous save stops the run here
            if stopping:
                summary["stopped_after"] = done
                break
    report.close()
    checkpoint.finish(trainer.manager)
    if state.step < schedule.num_steps:
        return summary  # stopped early: no export, no plot, as a preempted job
    return summary | _finish(trainer, state)


def _one_step(trainer: Trainer, state: RunState) -> tuple[RunState, dict]:
    """RL step `state.step`: the next prompts, their rollout, the train step."""
    t0 = time.perf_counter()
    prompts = next(trainer.train_iter)
    state = state.replace(data=json.dumps(trainer.train_iter.get_state()))
    state, metrics = rl_step(trainer, state, trainer.rollouts.collect(state, prompts))
    metrics["data/epoch"] = float(trainer.train_iter.epoch)
    metrics["time/step_s"] = time.perf_counter() - t0
    return state, metrics


def _finish(trainer: Trainer, state: RunState) -> dict[str, Any]:
    """A finished run's outputs: the Hugging Face export and the plot of its curves."""
    out = {}
    if trainer.schedule.export_hf:
        path = os.path.join(trainer.workdir, "hf")
        params = state.train.params
        out["export"] = checkpoint.export_hf(trainer.model_config, trainer.tokenizer, params, path)
    trainer.writer.close()
    if trainer.is_lead and trainer.schedule.plot and os.path.exists(trainer.writer.path):
        png = os.path.join(trainer.workdir, "curves.png")
        out["plot"] = writers.plot_curves(trainer.writer.path, png)
    return out


def _stop_on_signal(trainer: Trainer, state: RunState, signum: int, summary: dict, *, saved):
    """Checkpoint the state at this step boundary (unless it is saved already)."""
    if not saved:
        checkpoint.save(trainer.manager, state)
    name = signal.Signals(signum).name
    summary.update(preempted=name, stopped_after=state.step)
    log.warning(
        "%s: stopped after RL step %d, checkpoint %d in %s; the same command resumes",
        name,
        state.step,
        state.step,
        trainer.manager.directory,
    )


def rl_step(trainer: Trainer, state: RunState, rollout: Rollout) -> tuple[RunState, dict]:
    """The train half of RL step `state.step`: ppo_epochs x num_mini_batches optimizer
    updates on the rollout. Returns the next state and the step's metrics (plain floats,
    and device scalars the caller fetches when it needs them)."""
    t0 = time.perf_counter()
    train_state, step_metrics = trainer.train_step(state.train, rollout.batch)
    jax.block_until_ready(train_state.step)  # honest phase timing; metrics stay on device
    seconds = time.perf_counter() - t0
    state = state.replace(train=train_state, running=rollout.running, step=state.step + 1)
    metrics = dict(rollout.host_metrics)
    # Named keys (sampler/*, updates/* arrays [U]) as they are, the rest under policy/.
    metrics.update({k if "/" in k else f"policy/{k}": v for k, v in step_metrics.items()})
    metrics["time/train_s"] = seconds
    tokens = float(rollout.batch["tokens"].size) * trainer.step_config.ppo_epochs
    metrics["perf/train_tokens_per_s"] = tokens / max(seconds, 1e-9)
    return state, metrics


def init_or_restore(trainer: Trainer) -> RunState:
    """The workdir's latest checkpoint; else the config's Hugging Face checkpoint; else a
    scratch initialisation with its supervised warm start (saved as checkpoint 0, so a
    restart skips it)."""
    schedule = trainer.schedule
    restored = checkpoint.restore_latest(trainer.manager, trainer.abstract_state())
    if restored is not None:
        trainer.train_iter.set_state(restored.data)
        return restored
    param_shardings = trainer.state_shardings.train.params
    if schedule.hf_path:
        # Tensor by tensor, straight into its sharding: never whole on one device.
        _, params = models.load_pretrained(
            schedule.hf_path, dtype=schedule.param_dtype, shardings=param_shardings
        )
        # NaN weights would give NaN losses and skip every update, without another word.
        checkpoint.require_finite(params, f"the Hugging Face checkpoint {schedule.hf_path}")
        origin = f"Hugging Face checkpoint {schedule.hf_path}"
    else:
        init = jax.jit(models.init_params, static_argnums=0, out_shardings=param_shardings)
        params = init(trainer.model_config, jax.random.PRNGKey(schedule.seed))
        origin = "scratch initialisation"
        if trainer.warm_start.steps > 0:
            params = warm_start(trainer, params)
            origin += f" + {trainer.warm_start.steps} supervised warm-start steps"
    state = state_lib.init_state(
        params, trainer.tx, schedule.seed, trainer.state_shardings, origin=origin
    )
    state = state.replace(data=json.dumps(trainer.train_iter.get_state()))
    if trainer.warm_start.steps > 0:
        checkpoint.save(trainer.manager, state)
    return state


def warm_start(trainer: Trainer, params):
    """The supervised warm start of a scratch model (`trainer.warm_start` steps)."""
    return warm_start_lib.warm_start(
        trainer.model_config,
        params,
        trainer.sft_source,
        trainer.tokenizer,
        trainer.mesh,
        spec=trainer.warm_start,
        prompt=trainer.prompt,
        data_spec=trainer.data_spec,
        progress=trainer.is_lead and trainer.schedule.progress_bar,
        param_shardings=trainer.state_shardings.train.params,
    )


def flat_metrics(metrics: dict) -> dict[str, float]:
    """Plain floats, each per-update array `updates/<key>` [U] as `updates/<key>/<u>`: one
    scalar per update, so update 0 (on-policy: the noise floor) stands apart from the rest."""
    out = {}
    for key, value in metrics.items():
        if np.ndim(value) == 1:
            out.update({f"{key}/{u}": float(v) for u, v in enumerate(np.asarray(value))})
        else:
            out[key] = float(value)
    return out


def _every(step: int, period: int) -> bool:
    return bool(period) and step % period == 0


class _Reporter:
    """metrics.jsonl / TensorBoard rows and the progress bar. A step's row is written one
    step late, so its device values are ready and fetching them never stalls the loop
    (a checkpointed step's row at once, `flush`). Starting at step k drops the rows a
    previous, interrupted run wrote after its checkpoint k: one row per step."""

    def __init__(self, trainer: Trainer, *, initial: int):
        self.writer = trainer.writer
        self.writer.resume(initial)
        self.updates_per_step = trainer.schedule.updates_per_step
        self.pending: tuple[int, dict] | None = None
        self.shown: dict[str, float] = {}  # latest values on the progress bar
        self.bar = None
        if trainer.is_lead and trainer.schedule.progress_bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=trainer.schedule.num_steps, initial=initial, desc="RL", dynamic_ncols=True
            )

    def write(self, step: int, metrics: dict) -> None:
        values = flat_metrics(jax.device_get(metrics))
        self.writer.write(step, values)
        self._remember(values)
        skipped = values.get("policy/skipped_updates", 0)
        if skipped:
            log.warning(
                "RL step %d: %d of %d optimizer updates skipped (a non-finite gradient or "
                "update; policy/skipped_updates)",
                step,
                skipped,
                self.updates_per_step,
            )

    def step(self, step: int, metrics: dict, *, flush: bool = False) -> None:
        if self.pending is not None:
            self.write(*self.pending)  # the previous step's device metrics are ready by now
        self.pending = (step, metrics)
        if flush:
            self.write(*self.pending)
            self.pending = None
        if self.bar is not None:
            self.bar.update(1)
            self._remember({k: v for k, v in metrics.items() if isinstance(v, float)})
            self.bar.set_postfix({k: f"{v:.3g}" for k, v in self.shown.items()}, refresh=False)

    def close(self) -> None:
        if self.pending is not None:
            self.write(*self.pending)
            self.pending = None
        if self.bar is not None:
            self.bar.close()

    def _remember(self, values: dict) -> None:
        self.shown.update({lbl: values[k] for lbl, k in PROGRESS_KEYS.items() if k in values})
