"""The RL loop (DESIGN.md §4): prompts -> G samples each -> rewards -> advantages -> train step.

`run(config, workdir)` is everything `python -m gspo_jax.main` does after flag parsing; it is
importable so a Colab or a test runs the same loop. Per RL step:

  prompts [N]            grain iterator over a TFDS array_record source (this process's shard)
  sample                 sampling.sample: one prefill per prompt, G samples, sampler log-probs
  rewards [B]            verifiers on the host, in worker processes with a timeout
  advantages [B]         jitted compute_advantages (running reward stats carried)
  π_old log-probs        the sampler's (old_logprobs_source="sampler", paper §5.4) or recomputed
  π_ref log-probs        only with use_kl_loss / add_token_level_kl
  train_step             one jit: ppo_epochs × num_mini_batches AdamW updates
  metrics                fetched one step late, written to metrics.jsonl, TensorBoard, tqdm

Resume order (automatic): the workdir's latest checkpoint -> config.model.hf_path -> scratch
initialisation (+ the supervised warm start, saved as checkpoint 0). A killed run restarted
with the same command continues as if never stopped: params, optimizer, step, RNG, data
position and running reward statistics all come from the checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tensorflow_datasets as tfds

from gspo_jax import advantages as advantages_lib
from gspo_jax import checkpoint, data, evaluation, models, optim, rollout, sampling, sft, writers
from gspo_jax import config as config_lib
from gspo_jax import sharding as sharding_lib
from gspo_jax.rewards import RewardPool, build_reward
from gspo_jax.train_step import StepConfig, TrainState, make_logprobs_fn, make_train_step

log = logging.getLogger(__name__)

# Metric keys shown on the progress bar (short label -> key).
PROGRESS_KEYS = {
    "reward": "reward/mean",
    "acc": "reward/accuracy",
    "eval": "eval/accuracy",
    "clip": "policy/clipfrac",
    "kl": "policy/approx_kl",
}


def scratch_model_config(config, tokenizer) -> models.ModelConfig:
    """The architecture of a model trained from scratch (config.model.* and the tokenizer)."""
    m = config.model
    moe = m.arch == "qwen3_moe"
    return models.ModelConfig(
        arch=m.arch,
        vocab_size=len(tokenizer),
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
        param_dtype=m.param_dtype,
        dtype=m.dtype,
        remat=m.remat,
        moe_impl=m.moe_impl,
        attention_impl=m.attention_impl,
        eos_token_ids=tuple(data.stop_token_ids(tokenizer)),
        pad_token_id=tokenizer.pad_token_id,
    )


def _with_numerics(model_config: models.ModelConfig, config) -> models.ModelConfig:
    return dataclasses.replace(
        model_config,
        param_dtype=config.model.param_dtype,
        dtype=config.model.dtype,
        remat=config.model.remat,
        moe_impl=config.model.moe_impl,
        attention_impl=config.model.attention_impl,
    )


class Trainer:
    """Owns the run's state; `run()` executes the loop. One instance per process."""

    def __init__(self, config, workdir: str):
        self.config = config
        self.workdir = os.path.abspath(workdir)
        self.is_lead = jax.process_index() == 0
        os.makedirs(self.workdir, exist_ok=True)
        config_lib.validate(
            config, num_devices=jax.device_count(), num_processes=jax.process_count()
        )
        self.mesh = sharding_lib.make_mesh(config_lib.mesh_shape(config, jax.device_count()))
        self.group_size = config.num_return_sequences_in_group
        self.local_prompts = config.rollout_batch_size // jax.process_count()
        if self.is_lead:
            with open(os.path.join(self.workdir, "config.json"), "w") as f:
                f.write(config.to_json_best_effort(indent=2))

        self._setup_tokenizer_and_data()
        self._setup_model_config()
        self._setup_functions()
        self._setup_rewards()
        self.writer = writers.MetricsWriter(
            self.workdir, tensorboard=config.log.tensorboard, enabled=self.is_lead
        )
        self.manager = checkpoint.make_manager(
            os.path.join(self.workdir, "checkpoints"),
            max_to_keep=config.checkpoint.max_to_keep,
            async_save=config.checkpoint.async_save,
        )
        self._shown: dict[str, float] = {}  # latest values on the progress bar
        self._greedy_key = jax.random.PRNGKey(0)  # greedy decoding draws nothing
        self._init_or_restore()

    # ------------------------------------------------------------------------- set-up

    def _setup_tokenizer_and_data(self):
        c = self.config
        if c.model.hf_path or c.model.tokenizer_path:
            self.tokenizer = data.load_tokenizer(c.model.tokenizer_path or c.model.hf_path)
        else:
            path = os.path.join(self.workdir, "tokenizer")
            self.tokenizer = _lead_first(
                "tokenizer",
                lambda: data.make_char_tokenizer(path),
                lambda: data.load_tokenizer(path),
            )
        self.eos_ids = tuple(data.stop_token_ids(self.tokenizer))
        self.pad_id = int(self.tokenizer.pad_token_id)
        data_dir = c.data.data_dir or os.path.join(self.workdir, "data")
        tfds.disable_progress_bar()  # one progress bar per run is ours
        spec = data.get_spec(c.data.name)
        self.data_spec = spec
        build = functools.partial(
            data.build_dataset,
            c.data.name,
            c.data.config_name or None,
            data_dir=data_dir,
            manual_dir=c.data.manual_dir,
            splits=(c.data.train_split, c.data.eval_split),
        )
        # One process writes the dataset; the others read it once it is complete.
        sources = _lead_first("dataset", build, lambda: build(prepare=False))
        self.sources = sources
        instruction = data.DEFAULT_INSTRUCTION if c.data.instruction is None else c.data.instruction
        self.prompt_kwargs = {
            "prompt_length": c.prompt_length,
            "reference_key": spec.reference_key,
            "system_prompt": c.data.system_prompt,
            "instruction": instruction or None,
        }
        train_data = data.prepare_prompts(
            sources[c.data.train_split], self.tokenizer, **self.prompt_kwargs
        )
        self.train_iter = train_data.iterator(self.local_prompts, seed=c.seed, train=True)
        self.eval_data = data.prepare_prompts(
            sources[c.data.eval_split], self.tokenizer, **self.prompt_kwargs
        )

    def _setup_model_config(self):
        c = self.config
        if c.model.hf_path:
            hf = models.read_hf_config(c.model.hf_path)
            self.model_config = _with_numerics(models.ModelConfig.from_hf_config(hf), c)
        else:
            self.model_config = scratch_model_config(c, self.tokenizer)
        if c.model.routing_replay and self.model_config.num_experts == 0:
            raise config_lib.ConfigError(
                f"config.model.routing_replay needs a Mixture-of-Experts model; "
                f"{c.model.hf_path or 'the scratch model'} has none"
            )
        abstract = models.abstract_params(self.model_config)
        self.param_shardings = sharding_lib.tree_shardings(
            abstract, models.logical_axes(self.model_config), self.mesh
        )

    def _setup_functions(self):
        c = self.config
        self.step_config = StepConfig.from_config(c, self.model_config)
        total_updates = c.num_steps * c.ppo_epochs * c.num_mini_batches
        self.tx = optim.make_optimizer(c.optim, total_updates)
        abstract = models.abstract_params(self.model_config)
        opt_shardings = sharding_lib.optimizer_state_shardings(
            self.tx, abstract, self.param_shardings, self.mesh
        )
        self.state_shardings = TrainState(
            step=sharding_lib.replicated(self.mesh),
            params=self.param_shardings,
            opt_state=opt_shardings,
        )
        self.train_step = make_train_step(
            self.step_config, self.tx, state_shardings=self.state_shardings
        )
        self.logprobs_fn = make_logprobs_fn(self.step_config)
        self.needs_ref = bool(c.use_kl_loss or c.add_token_level_kl)
        if c.add_token_level_kl:
            self.advantage_fn = rollout.make_token_advantage_fn(c)
        else:
            self.advantage_fn = rollout.make_advantage_fn(c)
        if c.old_logprobs_source == "sampler":
            sampling.warn_if_biased_pi_old(c.sampling.top_k, c.sampling.top_p)

    def _setup_rewards(self):
        c = self.config
        self.pool = RewardPool(c.reward.num_workers) if c.reward.num_workers > 0 else None
        timeout = c.reward.timeout_s if self.pool is not None else None
        self.reward = rollout.Scorer(
            build_reward(c.reward.spec), c.invalid_reward, timeout_s=timeout, pool=self.pool
        )
        # Accuracy counts a failed verification as wrong (0), never as missing.
        self.accuracy = rollout.Scorer(
            build_reward(c.reward.accuracy), "zero", timeout_s=timeout, pool=self.pool
        )

    def _init_opt_state(self, params):
        init = jax.jit(self.tx.init, out_shardings=self.state_shardings.opt_state)
        return init(params)

    def _abstract_checkpoint(self):
        abstract_params = models.abstract_params(self.model_config)
        params = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            abstract_params,
            self.param_shardings,
        )
        opt = jax.eval_shape(self.tx.init, abstract_params)
        opt = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            opt,
            self.state_shardings.opt_state,
        )
        rep = sharding_lib.replicated(self.mesh)
        tree = {
            "train": TrainState(
                step=jax.ShapeDtypeStruct((), jnp.int32, sharding=rep), params=params, opt_state=opt
            ),
            "rng": jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep),
            "running": jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep),
                advantages_lib.init_running_moments(),
            ),
        }
        if self.needs_ref:
            tree["ref_params"] = params
        return tree

    def _init_or_restore(self):
        c = self.config
        restored = checkpoint.restore_latest(self.manager, self._abstract_checkpoint())
        if restored is not None:
            step, tree, meta = restored
            self.state = tree["train"]
            self.rng = tree["rng"]
            self.running = tree["running"]
            self.ref_params = tree.get("ref_params")
            states = meta["data"]
            if len(states) != jax.process_count():
                raise ValueError(
                    f"checkpoint {step} was written by {len(states)} processes; resuming it "
                    f"with {jax.process_count()} would change every process's data shard"
                )
            self.train_iter.set_state(states[jax.process_index()])
            self.start_step = int(meta["step"])
            self.origin = f"checkpoint {step} in {self.manager.directory}"
            return
        # Small host-made state is placed replicated on the mesh: with several processes a
        # single-device array could be neither checkpointed nor combined with global arrays.
        replicate = functools.partial(jax.device_put, device=sharding_lib.replicated(self.mesh))
        self.rng = replicate(jax.random.key_data(jax.random.PRNGKey(c.seed)))
        self.running = replicate(advantages_lib.init_running_moments())
        self.start_step = 0
        if c.model.hf_path:
            # Tensor by tensor, straight into its sharding: never whole on one device.
            _, params = models.load_pretrained(
                c.model.hf_path, dtype=c.model.param_dtype, shardings=self.param_shardings
            )
            self.origin = f"Hugging Face checkpoint {c.model.hf_path}"
        else:
            init = jax.jit(models.init_params, static_argnums=0, out_shardings=self.param_shardings)
            params = init(self.model_config, jax.random.PRNGKey(c.seed))
            self.origin = "scratch initialisation"
            if c.warm_start.steps > 0:
                params = self._warm_start(params)
                self.origin += f" + {c.warm_start.steps} supervised warm-start steps"
        self.state = TrainState(
            step=replicate(jnp.zeros((), jnp.int32)),
            params=params,
            opt_state=self._init_opt_state(params),
        )
        # The reference policy is the policy RL starts from (after any warm start).
        self.ref_params = jax.tree.map(jnp.copy, params) if self.needs_ref else None
        if c.warm_start.steps > 0 and not c.model.hf_path:
            self.save(0)  # a restart then skips the warm start

    def _warm_start(self, params):
        c = self.config
        return sft.warm_start(
            self.model_config,
            params,
            self.sources[c.data.train_split],
            self.tokenizer,
            self.mesh,
            warm_start_config=c.warm_start,
            data_spec=self.data_spec,
            prompt_length=c.prompt_length,
            response_length=c.response_length,
            seed=c.seed + 1,
            system_prompt=c.data.system_prompt,
            instruction=self.prompt_kwargs["instruction"],
            chunk_size=c.logprob_chunk_size,
            progress=self.is_lead and c.log.progress_bar,
        )

    # ------------------------------------------------------------------------- one RL step

    def sample(self, params, prompt_tokens, prompt_mask, key, *, greedy: bool = False):
        c = self.config
        return sampling.sample(
            self.model_config,
            params,
            prompt_tokens,
            prompt_mask,
            key,
            num_samples=1 if greedy else self.group_size,
            max_new_tokens=c.response_length,
            temperature=0.0 if greedy else c.sampling.temperature,
            top_k=None if greedy else c.sampling.top_k,
            top_p=None if greedy else c.sampling.top_p,
            eos_ids=self.eos_ids,
            pad_id=self.pad_id,
            buckets=tuple(c.sampling.prompt_buckets),
        )

    def rl_step(self, step: int) -> tuple[dict, dict]:
        """One RL step. Returns (host metrics, device metrics still on the device)."""
        c = self.config
        g = self.group_size
        times = {}
        t0 = time.perf_counter()
        batch = next(self.train_iter)
        tokens_NP, mask_NP = rollout.bucket_prompts(
            batch["prompt_tokens"], batch["prompt_mask"], c.sampling.prompt_buckets
        )
        prompt_tokens, prompt_mask = sharding_lib.to_global(self.mesh, (tokens_NP, mask_NP))
        key = jax.random.fold_in(jax.random.wrap_key_data(self.rng), step)
        params = self.state.params
        out = self.sample(params, prompt_tokens, prompt_mask, key)
        response_tokens = sharding_lib.to_local(out.tokens)
        response_mask = sharding_lib.to_local(out.mask)
        times["time/sample_s"] = time.perf_counter() - t0

        t1 = time.perf_counter()
        completions = rollout.decode_responses(self.tokenizer, response_tokens, response_mask)
        prompts = np.repeat(batch["prompt_text"], g)
        references = np.repeat(batch["reference"], g)
        rewards, valid, stats = self.reward.score(prompts, completions, references)
        if c.reward.accuracy == c.reward.spec:
            correct = rewards
        else:
            correct, _, _ = self.accuracy.score(prompts, completions, references)
        times["time/reward_s"] = time.perf_counter() - t1

        t2 = time.perf_counter()
        tokens_BL, mask_BL = out.sequences()  # prompt (repeated G times) then response
        response_len = c.response_length
        mask_BT = out.mask.astype(jnp.float32)
        device_metrics = {}
        routing = None
        if c.old_logprobs_source == "recompute" or c.model.routing_replay:
            res = self.logprobs_fn(params, tokens_BL, mask_BL, response_len)
            old_logprobs = res[0]
            if c.model.routing_replay:
                routing = res[2]
            gap = rollout.logprob_gap(out.logprobs, old_logprobs, mask_BT)
            (
                device_metrics["sampler/logprob_gap_mean"],
                device_metrics["sampler/logprob_gap_max"],
            ) = gap
            if c.old_logprobs_source == "sampler":
                old_logprobs = out.logprobs
        else:
            old_logprobs = out.logprobs
        ref_logprobs = None
        if self.needs_ref:
            ref_logprobs = self.logprobs_fn(self.ref_params, tokens_BL, mask_BL, response_len)[0]
        rewards_g, valid_g = sharding_lib.to_global(self.mesh, (rewards, valid))
        if c.add_token_level_kl:
            adv, self.running = self.advantage_fn(
                rewards_g, valid_g, self.running, old_logprobs, ref_logprobs, mask_BT
            )
        else:
            adv, self.running = self.advantage_fn(rewards_g, valid_g, self.running)
        train_batch = {
            "tokens": tokens_BL,
            "attention_mask": mask_BL,
            "response_mask": mask_BT,
            "old_logprobs": old_logprobs,
            "advantages": adv,
        }
        if c.use_kl_loss:
            train_batch["ref_logprobs"] = ref_logprobs
        if routing is not None:
            train_batch["routing"] = routing
        train_batch = jax.device_put(
            train_batch, sharding_lib.batch_shardings(self.mesh, train_batch)
        )
        self.state, step_metrics = self.train_step(self.state, train_batch)
        jax.block_until_ready(self.state.step)  # honest phase timing; metrics stay on device
        times["time/train_s"] = time.perf_counter() - t2
        times["time/step_s"] = time.perf_counter() - t0

        device_metrics.update(
            {f"policy/{k}": v for k, v in step_metrics.items() if not k.startswith("updates/")}
        )
        host = {}
        host.update(rollout.reward_metrics(rewards, valid, correct, stats, g))
        host.update(rollout.response_metrics(response_mask, sharding_lib.to_local(out.truncated)))
        num_generated = float(response_mask.sum()) * jax.process_count()
        host["perf/sample_tokens_per_s"] = num_generated / max(times["time/sample_s"], 1e-9)
        train_tokens = float(tokens_BL.shape[0] * tokens_BL.shape[1]) * c.ppo_epochs
        host["perf/train_tokens_per_s"] = train_tokens / max(times["time/train_s"], 1e-9)
        host["data/epoch"] = float(self.train_iter.epoch)
        host.update(times)
        return host, device_metrics

    # ------------------------------------------------------------------------- evaluation

    def evaluate(self) -> dict[str, float]:
        """Greedy accuracy on the held-out split (config.eval.num_prompts prompts)."""
        c = self.config
        return evaluation.greedy_accuracy(
            lambda tokens, mask: self.sample(
                self.state.params, tokens, mask, self._greedy_key, greedy=True
            ),
            self.eval_data,
            self.tokenizer,
            self.accuracy,
            self.mesh,
            num_prompts=c.eval.num_prompts,
            batch_size=c.eval.batch_size,
            buckets=c.sampling.prompt_buckets,
        )

    # ------------------------------------------------------------------------- checkpoints

    def save(self, step: int) -> None:
        tree = {"train": self.state, "rng": self.rng, "running": self.running}
        if self.needs_ref:
            tree["ref_params"] = self.ref_params
        # Every process reads its own shard, so the meta keeps one iterator state per process.
        meta = {
            "step": step,
            "data": _gather_json(self.train_iter.get_state()),
            "origin": self.origin,
        }
        checkpoint.save(self.manager, step, tree, meta)

    def export(self) -> str:
        path = os.path.join(self.workdir, "hf")
        params = self.state.params
        if jax.process_count() > 1:  # params span hosts: every host gathers, host 0 writes
            from jax.experimental import multihost_utils

            params = multihost_utils.process_allgather(params, tiled=True)
        params = jax.tree.map(np.asarray, jax.device_get(params))
        if self.is_lead:
            models.save_pretrained(self.model_config, params, path)
            self.tokenizer.save_pretrained(path)
        return path

    # ------------------------------------------------------------------------- the loop

    def run(self, stop_after: int | None = None) -> dict[str, Any]:
        """Train until config.num_steps. `stop_after=k` stops right after RL step k has been
        checkpointed, skipping the end-of-run work, as a preempted job would."""
        c = self.config
        log.info("starting at RL step %d from %s", self.start_step, self.origin)
        bar = _progress(
            c.num_steps, self.start_step, "RL", enabled=self.is_lead and c.log.progress_bar
        )
        summary: dict[str, Any] = {"origin": self.origin, "start_step": self.start_step}
        if self.start_step == 0:
            first = self.evaluate()
            self._write(0, first, {})
            summary["eval_start"] = first["eval/accuracy"]
        pending = None
        stopping = False
        for step in range(self.start_step, c.num_steps):
            host, device = self.rl_step(step)
            if pending is not None:
                self._write(*pending)  # the previous step's device metrics are ready by now
            done = step + 1
            last = done == c.num_steps
            stopping = stop_after is not None and done >= stop_after and not last
            if last or (c.eval.every_steps and done % c.eval.every_steps == 0):
                host.update(self.evaluate())
                summary["eval_end"] = host["eval/accuracy"]
            every = c.checkpoint.every_steps
            if last or stopping or (every and done % every == 0):
                self.save(done)
            pending = (done, host, device)
            if bar is not None:
                bar.update(1)
                self._show(bar, host)
            if stopping:
                summary["stopped_after"] = done
                break
        if pending is not None:
            self._write(*pending)
        if bar is not None:
            bar.close()
        self.manager.wait_until_finished()
        if stopping:
            return summary
        if c.checkpoint.export_hf:
            summary["export"] = self.export()
        self.writer.close()
        if self.is_lead and c.log.plot and os.path.exists(self.writer.path):
            summary["plot"] = writers.plot_curves(
                self.writer.path, os.path.join(self.workdir, "curves.png")
            )
        return summary

    def _write(self, step: int, host: dict, device: dict) -> None:
        metrics = dict(host)
        metrics.update({k: float(v) for k, v in jax.device_get(device).items()})
        self.writer.write(step, metrics)
        self._shown.update({lbl: metrics[k] for lbl, k in PROGRESS_KEYS.items() if k in metrics})

    def _show(self, bar, host: dict) -> None:
        self._shown.update({lbl: host[k] for lbl, k in PROGRESS_KEYS.items() if k in host})
        bar.set_postfix({k: f"{v:.3g}" for k, v in self._shown.items()}, refresh=False)

    def close(self):
        if self.pool is not None:
            self.pool.close()
        self.manager.close()


def _gather_json(obj) -> list:
    """[obj of process 0, obj of process 1, ...] for a JSON-able obj, on every process."""
    if jax.process_count() == 1:
        return [obj]
    from jax.experimental import multihost_utils

    raw = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    length = int(np.max(multihost_utils.process_allgather(np.int32(raw.size))))
    padded = np.zeros(length, np.uint8)
    padded[: raw.size] = raw
    rows = multihost_utils.process_allgather(padded)
    return [json.loads(bytes(r).rstrip(b"\x00").decode()) for r in np.asarray(rows)]


def _lead_first(name: str, lead_fn, other_fn):
    """Process 0 runs `lead_fn` (which writes shared files); the others wait, then `other_fn`."""
    if jax.process_count() == 1:
        return lead_fn()
    from jax.experimental import multihost_utils

    if jax.process_index() == 0:
        out = lead_fn()
        multihost_utils.sync_global_devices(f"gspo_jax:{name}")
        return out
    multihost_utils.sync_global_devices(f"gspo_jax:{name}")
    return other_fn()


def _progress(total: int, initial: int, desc: str, *, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True)


def run(config, workdir: str, *, stop_after: int | None = None) -> dict[str, Any]:
    """Train with `config` in `workdir` (resuming if it holds a checkpoint); returns a summary."""
    trainer = Trainer(config, workdir)
    try:
        # The model's shard_map regions (splash attention, per-device MoE) read the mesh
        # in context when the jitted functions are traced.
        with jax.set_mesh(trainer.mesh):
            summary = trainer.run(stop_after=stop_after)
    finally:
        trainer.close()
    if trainer.is_lead:
        with open(os.path.join(trainer.workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2, default=str)
    return summary
