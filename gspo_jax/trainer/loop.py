"""The RL loop: prompts -> G samples each -> rewards -> advantages -> train step, repeated.

`run(config, workdir)` is everything `python -m gspo_jax.main` does after flag parsing; it is
importable, so a Colab or a test runs the same loop. It is built from small pieces, each
usable on its own (docs/architecture.md):

  setup.setup(config, workdir) -> Trainer      the fixed pieces: mesh, model, data, stages
  init_or_restore(trainer) -> RunState         the changing state (state.py)
  trainer.rollouts.collect(state, prompts)     sample, score, π_ref, advantages -> Rollout
  train_on(trainer, state, rollout)            the jitted train step on that rollout
  rl_step(trainer, state)                      one whole RL step: the next prompts, their
                                               rollout, train_on
  trainer.evaluator(params)                    held-out greedy accuracy (and pass@k, maj@k)

Resume order (automatic): the workdir's latest checkpoint -> config.model.hf_path -> scratch
initialisation (+ the supervised warm start, saved as checkpoint 0). A killed run restarted
with the same command continues as if never stopped: everything that changes is in the
`RunState`, and all of it is in the checkpoint. SIGTERM, SIGINT, SIGHUP, SIGUSR1 ... stop the
loop at the next step boundary with a checkpoint (preemption.py); what happens on each failure is listed in
docs/failures.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import time
import warnings
from typing import Any

import jax
import numpy as np

from gspo_jax import models
from gspo_jax.models import lora
from gspo_jax.rollout import filtering
from gspo_jax.rollout.stage import Rollout
from gspo_jax.trainer import memory, preemption, warm_cache
from gspo_jax.trainer import state as state_lib
from gspo_jax.trainer import warm_start as warm_start_lib
from gspo_jax.trainer.io import checkpoint, profile, writers
from gspo_jax.trainer.io.summary import (  # noqa: F401 (loop.* names)
    OUTCOME_KEYS,
    SUMMARY_FILE,
    write_summary,
)
from gspo_jax.trainer.setup import Trainer, prepare_prompts, setup
from gspo_jax.trainer.state import RunState

log = logging.getLogger(__name__)

# With LoRA: the warm-started base (saved once; resume reads it) and the PEFT export.
LORA_BASE_DIR = "lora_base"
LORA_ADAPTER_DIR = "hf_adapter"

# Metric keys shown on the progress bar (short label -> key).
PROGRESS_KEYS = {
    "reward": "reward/mean",
    "acc": "reward/accuracy",
    "eval": "eval/accuracy",
    "clip": "policy/clipfrac",
    "kl": "policy/approx_kl",
}

# |update| / |params| of one optimizer update (policy/update_ratio, the step's largest)
# above which the loop warns naming optim.learning_rate. Adam moves every weight by about
# the learning rate per update, so the ratio is about learning_rate / (RMS weight): ~1e-3
# and below for sane rates, ~1e4 for the typo 1e3 (for 1e-3). At 1 one update is as large
# as the whole model: no learning rate that trains does that.
UPDATE_RATIO_WARN = 1.0


class NothingTrainedError(RuntimeError):
    """`max_all_skipped_steps` RL steps in a row had every optimizer update skipped; the
    run's summary (written to summary.json before this propagates) rides along."""

    def __init__(self, message: str, summary: dict):
        super().__init__(message)
        self.summary = summary


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
    A signal-stopped run's summary has `preempted` (the signal's name) and `stopped_after`;
    a run that trained nothing raises NothingTrainedError, its summary (with `error`)
    written first. summary.json is merged into, never truncated (`write_summary`).
    """
    trainer = setup(config, workdir, allow_config_change=allow_config_change)
    try:
        # The model's shard_map regions (splash attention, per-device MoE) read the mesh in
        # context when the jitted functions are traced.
        with jax.set_mesh(trainer.mesh):
            summary = train(trainer, init_or_restore(trainer), stop_after=stop_after)
        # Before close(), which releases the workdir's lock: no other run writes in between.
        if trainer.is_lead:
            write_summary(trainer.workdir, summary)
    except NothingTrainedError as e:
        if trainer.is_lead:
            write_summary(trainer.workdir, e.summary)
        raise
    finally:
        trainer.close()
    return summary


def train(trainer: Trainer, state: RunState, *, stop_after: int | None = None) -> dict[str, Any]:
    """The loop, from `state` to the schedule's num_steps RL steps (see `run`)."""
    schedule = trainer.schedule
    if state.step > schedule.num_steps:  # setup refuses it first (workdir.check_not_shortened)
        raise ValueError(
            f"num_steps={schedule.num_steps} is below RL step {state.step}, which the run "
            "reached: it would export that later model as the final one"
        )
    log.info("starting at RL step %d from %s", state.step, state.origin)
    summary: dict[str, Any] = {"origin": state.origin, "start_step": state.step}
    report = _Reporter(trainer, initial=state.step)
    skips = _SkipCount(trainer, state)
    dead_groups = filtering.DeadGroupWatch(dynamic=trainer.rollouts.spec.dynamic_sampling)
    if state.step == 0:
        first = _evaluate(trainer, report, state.train.params, 0)
        report.write(0, first)
        summary["eval_start"] = first["eval/accuracy"]
    saved = state.step if state.step in trainer.manager.all_steps() else None
    profiler = profile.StepProfiler(trainer.workdir, schedule.profile_steps)
    with preemption.StopOnSignal() as signals, profiler:
        while state.step < schedule.num_steps:
            if signum := signals.requested():
                _stop_on_signal(trainer, state, signum, summary, saved=saved == state.step)
                break
            if not report.stepped:  # minutes on a large model, with nothing else said
                report.phase(
                    "compiling",
                    f"RL step {state.step + 1}: compiling the RL step (first step only)",
                )
            profiler.before(state.step + 1)
            state, metrics = rl_step(trainer, state)
            profiler.after(state.step, state.train.params)
            report.phase(None)
            dead_groups.after_step(state.step, metrics)
            done, last = state.step, state.step == schedule.num_steps
            stopping = stop_after is not None and done >= stop_after and not last
            if stalled := skips.after_step(state):
                report.close()  # the rows up to this step, for the record
                summary.update(skipped_updates=skips.total(state), error=stalled)
                raise NothingTrainedError(stalled, summary)
            if last or _every(done, trainer.evaluator.spec.every_steps):
                metrics.update(_evaluate(trainer, report, state.train.params, done))
                summary["eval_end"] = metrics["eval/accuracy"]
                summary["eval_end_step"] = done
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
    summary["skipped_updates"] = skips.total(state)
    if state.step < schedule.num_steps:
        return summary  # stopped early: no export, no plot, as a preempted job
    return summary | _finish(trainer, state)


def _evaluate(trainer: Trainer, report: _Reporter, params, step: int) -> dict:
    """trainer.evaluator(params), said on the bar; the first call (which compiles the
    greedy sampler) also in the log."""
    line = None
    if not report.evaluated:
        line = (
            f"RL step {step}: evaluating on the held-out split (the first evaluation "
            "compiles the greedy sampler)"
        )
    report.evaluated = True
    report.phase("evaluating", line)
    with memory.name_the_field(
        "the held-out evaluation", "eval.batch_size or eval.pass_k (k samples per prompt)"
    ):
        if not trainer.evaluator.spec.save_per_problem:
            out = trainer.evaluator(params)
        else:
            per_problem = []
            out = trainer.evaluator(params, per_problem)
            _save_per_problem(trainer.workdir, step, per_problem)
    report.phase(None)
    return out


def _save_per_problem(workdir: str, step: int, batches: list) -> None:
    """eval.save_per_problem: WORKDIR/eval_problems/step<step>_p<process>.npz with `index`
    (position in the held-out split) and `score` (greedy accuracy score, what eval/accuracy
    averages) of this process's problems; a resumed run rewrites a step's file."""
    out = os.path.join(workdir, "eval_problems")
    os.makedirs(out, exist_ok=True)
    index = np.concatenate([i for i, _ in batches]) if batches else np.zeros(0, np.int64)
    score = np.concatenate([s for _, s in batches]) if batches else np.zeros(0, np.float32)
    path = os.path.join(out, f"step{step}_p{jax.process_index()}.npz")
    np.savez(path, index=index.astype(np.int64), score=score.astype(np.float32))


def rl_step(
    trainer: Trainer, state: RunState, rollout: Rollout | None = None
) -> tuple[RunState, dict]:
    """One whole RL step, `state.step`: the next prompts, their rollout, `train_on` it.

    `rl_step(trainer, state, rollout)` is the old name of `train_on` (the train half only):
    it still works, with a DeprecationWarning, until the next release."""
    if rollout is not None:
        warnings.warn(
            "loop.rl_step(trainer, state, rollout) is now loop.train_on(trainer, state, "
            "rollout); rl_step(trainer, state) runs one whole RL step",
            DeprecationWarning,
            stacklevel=2,
        )
        return train_on(trainer, state, rollout)
    t0 = time.perf_counter()
    prompts = next(trainer.train_iter)
    # Dynamic sampling's extra rounds read on from the same stream; the position saved is
    # the one after them, so a resumed run reads what it would have read.
    with memory.name_the_field(
        f"RL step {state.step + 1}'s rollout",
        "rollout_batch_size, num_return_sequences_in_group or response_length",
    ):
        rollout = trainer.rollouts.collect(
            state, prompts, more_prompts=lambda: next(trainer.train_iter)
        )
    state = state.replace(data=json.dumps(trainer.train_iter.get_state()))
    state, metrics = train_on(trainer, state, rollout)
    metrics["data/epoch"] = float(trainer.train_iter.epoch)
    metrics["time/step_s"] = time.perf_counter() - t0
    return state, metrics


def _finish(trainer: Trainer, state: RunState) -> dict[str, Any]:
    """A finished run's outputs: the Hugging Face export and the plot of its curves."""
    out = {}
    if trainer.schedule.export_hf:
        path = os.path.join(trainer.workdir, "hf")
        params = state.train.params
        # LoRA: the merged model W + (alpha/r)·A·B, and the adapters alone in PEFT's layout.
        cfg, merged = lora.merged(trainer.model_config, params)
        out["export"] = checkpoint.export_hf(cfg, trainer.tokenizer, merged, path)
        if trainer.model_config.lora_rank:
            adapter_path = os.path.join(trainer.workdir, LORA_ADAPTER_DIR)
            out["export_adapter"] = checkpoint.export_peft(
                trainer.model_config,
                params,
                adapter_path,
                base_model=trainer.schedule.hf_path or "",
            )
    trainer.writer.close()
    if trainer.is_lead and trainer.schedule.plot and os.path.exists(trainer.writer.path):
        png = os.path.join(trainer.workdir, "curves.png")
        out["plot"] = writers.plot_curves(trainer.writer.path, png)
    return out


class _SkipCount:
    """Optimizer updates skipped (a non-finite gradient or update, train_step/step.py),
    counted exactly from the optimizer's own counter, which counts applied updates only:
    `train_on` has already waited for it, so reading it is a copy of one ready scalar, not a
    stall (the per-step metrics are fetched one step late, `_Reporter`). After
    `max_all_skipped_steps` RL steps in a row with every update skipped, `after_step` names
    the failure: such a run trains nothing, and exporting its model would pass it off as a
    trained one."""

    def __init__(self, trainer: Trainer, state: RunState):
        self.limit = trainer.schedule.max_all_skipped_steps
        self.updates_per_step = trainer.schedule.updates_per_step
        self.applied = int(state.train.step)
        self.in_a_row = 0

    def after_step(self, state: RunState) -> str | None:
        applied = int(state.train.step)
        self.in_a_row = self.in_a_row + 1 if applied == self.applied else 0
        self.applied = applied
        if not self.limit or self.in_a_row < self.limit:
            return None
        return (
            f"every optimizer update of the last {self.in_a_row} RL steps (up to step "
            f"{state.step}) was skipped for a non-finite gradient or update: the run trains "
            "nothing, so it stops before any export. Look for a huge coefficient "
            "(kl_loss_coef, entropy_coef), optim.learning_rate or NaN inputs; "
            "max_all_skipped_steps=0 never stops"
        )

    def total(self, state: RunState) -> int:
        """Skipped updates over the whole run (RL steps x updates per step - applied)."""
        return max(state.step * self.updates_per_step - int(state.train.step), 0)


def _stop_on_signal(trainer: Trainer, state: RunState, signum: int, summary: dict, *, saved):
    """Checkpoint the state at this step boundary (unless it is saved already)."""
    if not saved:
        checkpoint.save(trainer.manager, state)
    name = signal.Signals(signum).name
    summary.update(preempted=name, stopped_after=state.step)
    trainer.writer.preempting()  # a W&B run is marked resumable (wandb_writer.py)
    log.warning(
        "%s: stopped after RL step %d, checkpoint %d in %s; the same command resumes",
        name,
        state.step,
        state.step,
        trainer.manager.directory,
    )


def train_on(trainer: Trainer, state: RunState, rollout: Rollout) -> tuple[RunState, dict]:
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


# What each part of the data iterator's identity (data/pipeline.py) comes from in the config.
_DATA_FIELDS = {
    "fingerprint": "the training prompts (data.name, data.config_name, data.train_split, "
    "data.manual_dir's files, data.instruction, the tokenizer, prompt_length)",
    "batch_size": "rollout_batch_size",
    "seed": "seed",
    "kind": "data.name",
}


def _resume_data(trainer: Trainer, restored: RunState) -> None:
    """Puts the training data at the checkpoint's position; a position saved over other
    data is an error naming the config fields that decide the data, not the iterator's
    fingerprint."""
    try:
        trainer.train_iter.set_state(restored.data)
    except ValueError as e:
        saved = restored.data.get("pipeline", {}) if isinstance(restored.data, dict) else {}
        now = getattr(trainer.train_iter, "_identity", {})
        changed = [k for k in _DATA_FIELDS if k in now and saved.get(k) != now[k]]
        what = "; ".join(_DATA_FIELDS[k] for k in changed) or "data.*"
        raise ValueError(
            f"{restored.origin} was written while training on other data than this config "
            f"gives: changed: {what}. Resume with the data settings the run started with "
            f"(its config.json in the workdir), or start a new --workdir ({e})"
        ) from None


def init_or_restore(trainer: Trainer) -> RunState:
    """The workdir's latest checkpoint; else the config's Hugging Face checkpoint; else a
    scratch initialisation with its supervised warm start (saved as checkpoint 0, so a
    restart skips it).

    With LoRA (model.lora_rank > 0) that order gives the frozen base, and the checkpoints
    hold the adapters and their optimizer state only: a resumed run rebuilds the base
    (hf_path, the saved warm start `lora_base/`, or the seed's initialisation) and puts
    the restored adapters on it; a new run puts fresh adapters on it."""
    schedule = trainer.schedule
    restored = checkpoint.restore_latest(trainer.manager, trainer.abstract_state())
    if restored is not None:
        _resume_data(trainer, restored)
        if trainer.model_config.lora_rank:
            base, _ = _base_params(trainer, resume=True)
            params = lora.combine(base, restored.train.params)
            restored = restored.replace(train=restored.train.replace(params=params))
        return restored
    params, origin = _base_params(trainer, resume=False)
    if trainer.model_config.lora_rank:
        init = jax.jit(
            lora.init_adapters,
            static_argnums=0,
            out_shardings=lora.trainable(trainer.state_shardings.train.params),
        )
        adapters = init(trainer.model_config, jax.random.PRNGKey(schedule.seed + 1))
        params = lora.combine(params, adapters)
        origin += f" + LoRA adapters of rank {trainer.model_config.lora_rank}"
    state = state_lib.init_state(
        params, trainer.tx, schedule.seed, trainer.state_shardings, origin=origin
    )
    state = state.replace(data=json.dumps(trainer.train_iter.get_state()))
    if trainer.warm_start.steps > 0:
        checkpoint.save(trainer.manager, state)
    return state


def _base_params(trainer: Trainer, *, resume: bool) -> tuple[dict, str]:
    """(the starting weights, where they came from): hf_path, else the seed's scratch
    initialisation; either one then trained by the supervised warm start when
    warm_start.steps > 0 (from a checkpoint: e.g. an upcycled MoE whose experts and router
    must specialise before RL). With LoRA these are the frozen base, of `lora.base_config`;
    a LoRA warm start is saved once (`lora_base/`) and read back on resume (`resume`)."""
    schedule = trainer.schedule
    cfg = lora.base_config(trainer.model_config)
    shardings = _base_shardings(trainer)
    warm = trainer.warm_start.steps > 0
    lora_warm = warm and trainer.model_config.lora_rank
    base_dir = os.path.join(trainer.workdir, LORA_BASE_DIR)
    if schedule.hf_path:
        origin = f"Hugging Face checkpoint {schedule.hf_path}"
    else:
        origin = "scratch initialisation"
    if lora_warm and resume:
        params = checkpoint.restore_params(base_dir, models.abstract_params(cfg), shardings)
        return params, origin + f" + warm start ({base_dir})"
    cached = warm and warm_cache.load(trainer.warm_cache, models.abstract_params(cfg), shardings)
    if cached:
        params, result = cached
    elif schedule.hf_path:
        # Tensor by tensor, straight into its sharding: never whole on one device.
        _, params = models.load_pretrained(
            schedule.hf_path, dtype=schedule.param_dtype, shardings=shardings
        )
        # NaN weights would give NaN losses and skip every update, without another word.
        checkpoint.require_finite(params, f"the Hugging Face checkpoint {schedule.hf_path}")
    else:
        init = jax.jit(models.init_params, static_argnums=0, out_shardings=shardings)
        params = init(cfg, jax.random.PRNGKey(schedule.seed))
    if warm and not cached:
        params, result = warm_start(trainer, params)
        warm_cache.store(trainer.warm_cache, params, result)
    if warm:
        origin += f" + {result.describe()}"
        origin += f" (cached: {trainer.warm_cache.path})" if cached else ""
        if lora_warm:
            checkpoint.save_params(base_dir, params)
    return params, origin


def _base_shardings(trainer: Trainer):
    """Shardings of the base weights: the params' own, less LoRA's adapters."""
    shardings = trainer.state_shardings.train.params
    return lora.partition(shardings)[0] if trainer.model_config.lora_rank else shardings


def warm_start(trainer: Trainer, params):
    """The supervised warm start (`trainer.warm_start`) of a scratch or loaded model: (params,
    warm_start.WarmStartResult). With LoRA it trains the whole base model (it makes the
    "pretrained" base the adapters adapt). Trained to a target accuracy, its checks are
    the held-out evaluator's greedy accuracy on the first `check_prompts` problems of the
    train split (never the held-out split the run reports)."""
    check = None
    spec = trainer.warm_start
    if spec.target_accuracy is not None:
        evaluator = dataclasses.replace(
            trainer.evaluator,
            spec=dataclasses.replace(
                trainer.evaluator.spec, num_prompts=spec.check_prompts, pass_k=0
            ),
            eval_data=prepare_prompts(trainer.prompt, trainer.sft_source, trainer.tokenizer),
            sample_k=None,
        )

        adapters = None
        if trainer.model_config.lora_rank:  # the evaluator samples the LoRA model: give the
            # base fresh adapters (B = 0, so exactly the base's function)
            adapters = jax.jit(
                lora.init_adapters,
                static_argnums=0,
                out_shardings=lora.trainable(trainer.state_shardings.train.params),
            )(trainer.model_config, jax.random.PRNGKey(0))

        def check(params):
            params = params if adapters is None else lora.combine(params, adapters)
            return evaluator(params)["eval/accuracy"]

    return warm_start_lib.warm_start(
        lora.base_config(trainer.model_config),
        params,
        trainer.sft_source,
        trainer.tokenizer,
        trainer.mesh,
        spec=trainer.warm_start,
        prompt=trainer.prompt,
        data_spec=trainer.data_spec,
        progress=trainer.is_lead and trainer.schedule.progress_bar,
        param_shardings=_base_shardings(trainer),
        check=check,
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
        self.warned_update_ratio = False  # once a run: every later step would repeat it
        self.pending: tuple[int, dict] | None = None
        self.stepped = self.evaluated = False  # has this process compiled the step / eval?
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
        ratio = values.get("policy/update_ratio", 0.0)
        if ratio > UPDATE_RATIO_WARN and not self.warned_update_ratio:
            self.warned_update_ratio = True
            log.warning(
                "RL step %d: an optimizer update moved the params by %.3g times their own "
                "norm (policy/update_ratio > %g): no learning rate that trains does that; "
                "check optim.learning_rate (a typo such as 1e3 for 1e-3?)",
                step,
                ratio,
                UPDATE_RATIO_WARN,
            )

    def phase(self, label: str | None, line: str | None = None) -> None:
        """A long stretch that completes no step (a first compile, an evaluation): `line`
        logged, `label` beside the bar until phase(None). Costs nothing on the device."""
        if line is not None:
            if self.bar is not None:
                self.bar.clear()  # the line on a line of its own, then the bar again
            log.info("%s", line)
        if self.bar is not None:
            self.bar.set_description_str(f"RL ({label})" if label else "RL")

    def step(self, step: int, metrics: dict, *, flush: bool = False) -> None:
        self.stepped = True
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
