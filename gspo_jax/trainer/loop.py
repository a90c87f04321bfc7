"""The RL loop: prompts -> G samples each -> rewards -> advantages -> train step, repeated.

`run(config, workdir)` is everything `python -m gspo_jax.main` does after flag parsing; it is
importable, so a Colab or a test runs the same loop. It is built from small pieces, each
usable on its own (docs/architecture.md):

  experiment.setup(config, workdir) -> Run     the fixed pieces: mesh, model, data, jitted fns
  init_or_restore(run) -> RunState             the changing state (state.py)
  rollout.collect(run, state, batch) -> Rollout  sample, score, π_old / π_ref, advantages
  rl_step(run, state, rollout) -> (state, metrics)  the jitted train step on that rollout
  evaluate(run, state)                          greedy held-out accuracy

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
from gspo_jax.trainer import (
    checkpoint,
    evaluation,
    preemption,
    rollout,
    writers,
)
from gspo_jax.trainer import (
    setup as experiment,
)
from gspo_jax.trainer import state as state_lib
from gspo_jax.trainer import (
    warm_start as sft,
)
from gspo_jax.trainer.setup import Run
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
    pieces = experiment.setup(config, workdir, allow_config_change=allow_config_change)
    try:
        # The model's shard_map regions (splash attention, per-device MoE) read the mesh in
        # context when the jitted functions are traced.
        with jax.set_mesh(pieces.mesh):
            summary = train(pieces, init_or_restore(pieces), stop_after=stop_after)
    finally:
        pieces.close()
    if pieces.is_lead:
        with open(os.path.join(pieces.workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2, default=str)
    return summary


def train(run: Run, state: RunState, *, stop_after: int | None = None) -> dict[str, Any]:
    """The loop, from `state` to config.num_steps RL steps (see `run`)."""
    c = run.config
    log.info("starting at RL step %d from %s", state.step, state.origin)
    summary: dict[str, Any] = {"origin": state.origin, "start_step": state.step}
    report = _Reporter(run, initial=state.step)
    if state.step == 0:
        first = evaluate(run, state)
        report.write(0, first)
        summary["eval_start"] = first["eval/accuracy"]
    saved = state.step if state.step in run.manager.all_steps() else None
    with preemption.StopOnSignal() as signals:
        while state.step < c.num_steps:
            if signum := signals.requested():
                _stop_on_signal(run, state, signum, summary, saved=saved == state.step)
                break
            t0 = time.perf_counter()
            prompts = next(run.train_iter)
            state = state.replace(data=json.dumps(run.train_iter.get_state()))
            state, metrics = rl_step(run, state, rollout.collect(run, state, prompts))
            metrics["time/step_s"] = time.perf_counter() - t0
            done, last = state.step, state.step == c.num_steps
            stopping = stop_after is not None and done >= stop_after and not last
            if last or _every(done, c.eval.every_steps):
                metrics.update(evaluate(run, state))
                summary["eval_end"] = metrics["eval/accuracy"]
            saving = last or stopping or _every(done, c.checkpoint.every_steps)
            if saving:
                checkpoint.save(run.manager, state)
                saved = done
            # A checkpointed step's row is written now: a restart from it repeats no row.
            report.step(done, metrics, flush=saving)
            checkpoint.check(run.manager)  # a failed asynchronous save stops the run here
            if stopping:
                summary["stopped_after"] = done
                break
    report.close()
    checkpoint.finish(run.manager)
    if state.step < c.num_steps:
        return summary  # stopped early: no export, no plot, as a preempted job
    if c.checkpoint.export_hf:
        path = os.path.join(run.workdir, "hf")
        params = state.train.params
        summary["export"] = checkpoint.export_hf(run.model_config, run.tokenizer, params, path)
    run.writer.close()
    if run.is_lead and c.log.plot and os.path.exists(run.writer.path):
        png = os.path.join(run.workdir, "curves.png")
        summary["plot"] = writers.plot_curves(run.writer.path, png)
    return summary


def _stop_on_signal(run: Run, state: RunState, signum: int, summary: dict, *, saved: bool):
    """Checkpoint the state at this step boundary (unless it is saved already)."""
    if not saved:
        checkpoint.save(run.manager, state)
    name = signal.Signals(signum).name
    summary.update(preempted=name, stopped_after=state.step)
    log.warning(
        "%s: stopped after RL step %d, checkpoint %d in %s; the same command resumes",
        name,
        state.step,
        state.step,
        run.manager.directory,
    )


def rl_step(run: Run, state: RunState, rollout: rollout.Rollout) -> tuple[RunState, dict]:
    """The train half of RL step `state.step`: ppo_epochs x num_mini_batches optimizer
    updates on the rollout. Returns the next state and the step's metrics (plain floats,
    and device scalars the caller fetches when it needs them)."""
    t0 = time.perf_counter()
    train_state, step_metrics = run.train_step(state.train, rollout.batch)
    jax.block_until_ready(train_state.step)  # honest phase timing; metrics stay on device
    seconds = time.perf_counter() - t0
    state = state.replace(train=train_state, running=rollout.running, step=state.step + 1)
    metrics = dict(rollout.host_metrics)
    metrics.update(rollout.device_metrics)
    # Named keys (sampler/*, updates/* arrays [U]) as they are, the rest under policy/.
    metrics.update({k if "/" in k else f"policy/{k}": v for k, v in step_metrics.items()})
    metrics["time/train_s"] = seconds
    tokens = float(rollout.batch["tokens"].size) * run.config.ppo_epochs
    metrics["perf/train_tokens_per_s"] = tokens / max(seconds, 1e-9)
    return state, metrics


def evaluate(run: Run, state: RunState) -> dict[str, float]:
    """Greedy accuracy on the held-out split (config.eval.num_prompts prompts)."""
    c = run.config
    key = jax.random.PRNGKey(0)  # greedy decoding draws nothing
    return evaluation.greedy_accuracy(
        lambda tokens, mask: run.sample(state.train.params, tokens, mask, key, greedy=True),
        run.eval_data,
        run.tokenizer,
        run.accuracy,
        run.mesh,
        num_prompts=c.eval.num_prompts,
        batch_size=c.eval.batch_size,
        buckets=c.sampling.prompt_buckets,
    )


def init_or_restore(run: Run) -> RunState:
    """The workdir's latest checkpoint; else the config's Hugging Face checkpoint; else a
    scratch initialisation with its supervised warm start (saved as checkpoint 0, so a
    restart skips it)."""
    c = run.config
    restored = checkpoint.restore_latest(run.manager, run.abstract_state())
    if restored is not None:
        run.train_iter.set_state(restored.data)
        return restored
    param_shardings = run.state_shardings.train.params
    if c.model.hf_path:
        # Tensor by tensor, straight into its sharding: never whole on one device.
        _, params = models.load_pretrained(
            c.model.hf_path, dtype=c.model.param_dtype, shardings=param_shardings
        )
        # NaN weights would give NaN losses and skip every update, without another word.
        checkpoint.require_finite(params, f"the Hugging Face checkpoint {c.model.hf_path}")
        origin = f"Hugging Face checkpoint {c.model.hf_path}"
    else:
        init = jax.jit(models.init_params, static_argnums=0, out_shardings=param_shardings)
        params = init(run.model_config, jax.random.PRNGKey(c.seed))
        origin = "scratch initialisation"
        if c.warm_start.steps > 0:
            params = warm_start(run, params)
            origin += f" + {c.warm_start.steps} supervised warm-start steps"
    state = state_lib.init_state(params, run.tx, c.seed, run.state_shardings, origin=origin)
    state = state.replace(data=json.dumps(run.train_iter.get_state()))
    if c.warm_start.steps > 0 and not c.model.hf_path:
        checkpoint.save(run.manager, state)
    return state


def warm_start(run: Run, params):
    """`config.warm_start.steps` supervised steps on the task (scratch models only)."""
    c = run.config
    return sft.warm_start(
        run.model_config,
        params,
        run.sft_source,
        run.tokenizer,
        run.mesh,
        warm_start_config=c.warm_start,
        data_spec=run.data_spec,
        prompt_length=c.prompt_length,
        response_length=c.response_length,
        seed=c.seed + 1,
        system_prompt=c.data.system_prompt,
        instruction=run.prompt_kwargs["instruction"],
        chunk_size=c.logprob_chunk_size,
        progress=run.is_lead and c.log.progress_bar,
        param_shardings=run.state_shardings.train.params,
        overlong=c.data.overlong,
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

    def __init__(self, run: Run, *, initial: int):
        self.writer = run.writer
        self.writer.resume(initial)
        self.updates_per_step = run.config.ppo_epochs * run.config.num_mini_batches
        self.pending: tuple[int, dict] | None = None
        self.shown: dict[str, float] = {}  # latest values on the progress bar
        self.bar = None
        if run.is_lead and run.config.log.progress_bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=run.config.num_steps, initial=initial, desc="RL", dynamic_ncols=True
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
