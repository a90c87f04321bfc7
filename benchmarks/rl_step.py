"""One RL step's two halves on this machine: train-step MFU and sampler throughput.

  python benchmarks/rl_step.py                         # tiny preset (CPU, ~1 minute)
  python benchmarks/rl_step.py --preset=qwen3_0p6b     # Qwen3-0.6B shapes (GPU/TPU)
  python benchmarks/rl_step.py --preset=trl_anchor [--profile] [--shared_prompt=16:64,256:256]
                                [--compare=trl.txt]
      one whole RL step of TRL's GSPO example geometry (benchmarks/anchor_spec.py; TRL's
      side: benchmarks/trl_anchor.py), by phase: sample, score (decode + reward on text),
      advantages, train step; FLOP ratios per round against the matmul rate measured just
      before. --profile: a train step's top XLA ops (jax.profiler trace, kept on disk).
      --shared_prompt: the train step with each prompt once per group vs G times, at
      prompt:response lengths (alternating rounds, median speedup). --compare: the output
      of `trl_anchor.py` saved to a file; the phase table then shows TRL beside gspo_jax.

Everything is a ratio measured in the same run, because shared machines drift:
  train MFU     model FLOPs of one jitted train step (its π_old forward pass, 2·N per token,
                and the updates, benchmarks/common.py: 6·N per token
                for the matmul parameters, the unembedding on response tokens only, causal
                attention; rematerialisation and the log-prob backward's logit recompute
                NOT counted) divided by wall time, over this machine's measured bf16 (or f32
                on CPU) matmul rate;
  sampler       generated tokens/s of `sampling.sample` (N prompts x G samples, one prefill
                per prompt), the decode step's time over its FLOP floor (one step's FLOPs
                attending to the mean cache length, at the measured matmul rate), and
                against a per-token Python loop over the model's decode step (--baseline).
Random weights (the numbers do not depend on them); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import time

import anchor_spec
import common
import jax
import jax.numpy as jnp
import numpy as np
import optax

from configs import base
from gspo_jax import advantages, data, models, sampling, train_step
from gspo_jax.config import specs
from gspo_jax.config.specs import step_config
from gspo_jax.rollout import stage as rollout
from gspo_jax.train_step import TrainState, make_train_step, optim

PRESETS = {
    "tiny": {
        "model": {
            "arch": "qwen3",
            "vocab_size": 4096,
            "hidden_size": 256,
            "intermediate_size": 768,
            "num_layers": 4,
            "num_heads": 4,
            "num_kv_heads": 2,
            "head_dim": 64,
            "qk_norm": True,
            "tie_word_embeddings": True,
        },
        "prompts": 4,
        "group": 8,
        "prompt_len": 64,
        "response_len": 128,
        "dtype": "float32",
        "remat": "none",
        "micro": None,
    },
    # TRL's GSPO example geometry (benchmarks/anchor_spec.py; TRL's side: trl_anchor.py):
    # one whole RL step, by phase.
    "trl_anchor": {
        "model": {
            "arch": "qwen2",
            "qkv_bias": True,
            **{k: v for k, v in anchor_spec.MODEL.items()},
            "scan_layers": False,  # 4 small layers: unrolled is 1.2x faster (ModelConfig)
        },
        "prompts": anchor_spec.NUM_PROMPTS,
        "group": anchor_spec.GROUP,
        "prompt_len": anchor_spec.PROMPT_LEN,
        "response_len": anchor_spec.RESPONSE_LEN,
        "dtype": "float32",
        "remat": "none",
        "micro": None,
        "whole_step": True,
    },
    # Qwen3-0.6B's published config.json (28 layers, GQA 16/8, head_dim 128, tied).
    "qwen3_0p6b": {
        "model": {
            "arch": "qwen3",
            "vocab_size": 151936,
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_layers": 28,
            "num_heads": 16,
            "num_kv_heads": 8,
            "head_dim": 128,
            "qk_norm": True,
            "tie_word_embeddings": True,
            "rope_theta": 1e6,
            "max_position_embeddings": 40960,
        },
        "prompts": 32,
        "group": 8,
        "prompt_len": 256,
        "response_len": 768,
        "dtype": "bfloat16",
        "remat": "full",
        "micro": 32,
    },
}


def bench_train(preset, cfg, rate):
    n, g = preset["prompts"], preset["group"]
    p, t = preset["prompt_len"], preset["response_len"]
    b = n * g
    config = base.get_config()  # the train step at the defaults of configs/base.py, with:
    config.num_mini_batches = 4
    config.micro_batch_size = preset["micro"]
    config.response_length = t
    config.logprob_chunk_size = 512
    config.packing = False  # padded, as TRL's step (packing: benchmarks/train_packing.py)
    sc = step_config(config, cfg)
    tx = optax.adamw(1e-6)
    params = jax.jit(models.init_params, static_argnums=0)(cfg, jax.random.PRNGKey(0))
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
    rng = np.random.default_rng(0)
    batch = {
        "tokens": jnp.asarray(rng.integers(0, cfg.vocab_size, (b, p + t)), jnp.int32),
        "attention_mask": jnp.ones((b, p + t), jnp.int32),
        "response_mask": jnp.ones((b, t), jnp.float32),
        "sampler_logprobs": jnp.asarray(-rng.random((b, t)) * 5, jnp.float32),
        "advantages": jnp.asarray(rng.normal(size=b), jnp.float32),
    }
    step = make_train_step(sc, tx, donate=True)
    holder = {"state": state}

    def one_step():  # the state is donated: carry it from call to call
        holder["state"], metrics = step(holder["state"], batch)
        return metrics

    compile_s = common.seconds(one_step)
    seconds = common.median_seconds(one_step, reps=3, warmup=0)
    # 4 mini-batches cover the batch once, after the step's own π_old forward pass
    # (old_logprobs_source="recompute", the default).
    flops = common.train_flops(cfg, b, p, t) + common.forward_flops(cfg, b, p + t, t)
    return {
        "train/responses": b,
        "train/tokens": b * (p + t),
        "train/seconds": seconds,
        "train/first_call_s": compile_s,
        "train/tokens_per_s": b * (p + t) / seconds,
        "train/model_tflops": flops / seconds / 1e12,
        "train/mfu_vs_measured_matmul": flops / seconds / rate,
    }


def anchor_config(preset):
    """The experiment config of the whole-step preset (benchmarks/anchor_spec.py)."""
    config = base.get_config()
    config.rollout_batch_size = preset["prompts"]
    config.num_return_sequences_in_group = preset["group"]
    config.response_length = preset["response_len"]
    config.importance_sampling = "seq"
    config.clip_low, config.clip_high = anchor_spec.CLIP_LOW, anchor_spec.CLIP_HIGH
    config.loss_agg_mode = "seq-mean-token-mean"
    config.adv_estimator = "grpo"  # group z-score
    config.ppo_epochs, config.num_mini_batches, config.micro_batch_size = 1, 1, None
    config.use_kl_loss, config.entropy_coef = False, 0.0
    config.old_logprobs_source = "sampler"  # one update per rollout: pi_old = the sampler's
    config.packing = False  # padded, as TRL's step (packing: benchmarks/train_packing.py)
    config.sampling.temperature = anchor_spec.TEMPERATURE
    config.optim.learning_rate = anchor_spec.LEARNING_RATE
    config.optim.max_grad_norm = anchor_spec.MAX_GRAD_NORM
    config.optim.weight_decay = 0.0
    return config


class WholeStep:
    """One RL step of the anchor workload, phase by phase, as the loop runs it:

      sample      `sampling.sample` (one prefill per prompt, G samples, the log-probs)
      score       device -> host, decode to text, the reward on each text (in-process)
      advantages  the jitted group z-score (`rollout.make_advantage_fn`)
      train       the jitted train step (one AdamW update), state donated

    Each phase waits for its outputs, so the phase times add up to the step.
    """

    def __init__(self, preset, cfg):
        self.preset, self.cfg = preset, cfg
        self.config = config = anchor_config(preset)
        self.tokenizer = anchor_spec.make_tokenizer()
        enc = self.tokenizer(
            anchor_spec.prompts(),
            padding="max_length",
            max_length=preset["prompt_len"],
            return_tensors="np",
        )
        self.prompt_tokens = enc["input_ids"].astype(np.int32)
        self.prompt_mask = enc["attention_mask"].astype(np.int32)
        self.step_config = step_config(config, cfg)
        tx = optim.make_optimizer(specs.optim_spec(config))
        self.train_step = make_train_step(self.step_config, tx, donate=True)
        self.advantage_fn = rollout.make_advantage_fn(specs.advantage_spec(config))
        self.eos_ids = tuple(data.stop_token_ids(self.tokenizer))
        params = jax.jit(models.init_params, static_argnums=0)(cfg, jax.random.PRNGKey(0))
        self.state = TrainState(
            step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params)
        )
        self.running = advantages.init_running_moments()
        self.step_index = 0

    def sample(self):
        c = self.config
        key = jax.random.fold_in(jax.random.PRNGKey(1), self.step_index)
        out = sampling.sample(
            self.cfg,
            self.state.params,
            self.prompt_tokens,
            self.prompt_mask,
            key,
            eos_ids=self.eos_ids,
            pad_id=int(self.tokenizer.pad_token_id),
            **specs.sampler_spec(c).kwargs(),
        )
        return jax.block_until_ready(out)

    def score(self, out):
        tokens_BT, mask_BT = jax.device_get((out.tokens, out.mask))
        texts = rollout.decode_responses(self.tokenizer, tokens_BT, mask_BT)
        return np.asarray([anchor_spec.reward(text) for text in texts], np.float32)

    def advantages(self, rewards_B):
        valid_B = np.ones(rewards_B.shape, bool)
        adv, self.running = self.advantage_fn(rewards_B, valid_B, self.running)
        return jax.block_until_ready(adv)

    def batch(self, out, adv):
        tokens_BL, mask_BL = out.sequences()
        return {
            "tokens": tokens_BL,
            "attention_mask": mask_BL,
            "response_mask": out.mask.astype(jnp.float32),
            "sampler_logprobs": out.logprobs,  # π_old here (old_logprobs_source="sampler")
            "advantages": adv,
        }

    def train(self, batch):
        self.state, metrics = self.train_step(self.state, batch)
        jax.block_until_ready(self.state.step)
        return metrics

    def run(self) -> dict[str, float]:
        """One whole RL step; returns its phase times (seconds) and generated tokens."""
        t0 = time.perf_counter()
        out = self.sample()
        t1 = time.perf_counter()
        rewards = self.score(out)
        t2 = time.perf_counter()
        adv = self.advantages(rewards)
        t3 = time.perf_counter()
        self.train(self.batch(out, adv))
        t4 = time.perf_counter()
        self.step_index += 1
        return {
            "sample": t1 - t0,
            "score": t2 - t1,
            "advantages": t3 - t2,
            "train": t4 - t3,
            "step": t4 - t0,
            "generated": float(np.asarray(out.mask).sum()),
        }


def bench_whole_step(preset, cfg, reps: int, profile: bool):
    """Medians over `reps` rounds (after one compile step) of: this machine's matmul rate,
    then one whole RL step. Ratios are per round (the rate measured just before its step),
    then the median over rounds: the machine is shared, and a ratio within a round holds."""
    runner = WholeStep(preset, cfg)
    first = runner.run()  # compiles every phase
    flops = anchor_spec.model_flops_per_step(common.matmul_params(cfg))
    b, p, t = preset["prompts"] * preset["group"], preset["prompt_len"], preset["response_len"]
    assert abs(flops["train"] / common.train_flops(cfg, b, p, t) - 1) < 1e-9  # one FLOP model
    # FLOPs the train step computes: with the prompt once per group, fewer than the
    # repeated-prompt count of the FLOP model (flops["train"], the yardstick).
    computed = flops["train"]
    if train_step.shared_group(runner.step_config, 1) > 1:
        computed = common.train_flops_shared_prompt(cfg, preset["prompts"], preset["group"], p, t)
    rounds = []
    for _ in range(reps):
        rate = common.matmul_rate()
        times = runner.run()
        times["rate"] = rate
        times["train_over_matmul"] = computed / times["train"] / rate
        times["train_repeated_over_matmul"] = flops["train"] / times["train"] / rate
        times["sample_over_matmul"] = flops["generation"] / times["sample"] / rate
        times["step_over_matmul"] = flops["step"] / times["step"] / rate
        rounds.append(times)
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    result = {
        "matmul_tflops_measured": med["rate"] / 1e12,
        "step/first_call_s": first["step"],
        "step/generated_tokens": med["generated"],
        **{f"step/{k}_s": med[k] for k in ("step", "sample", "score", "advantages", "train")},
        "step/train_flops_over_matmul": med["train_over_matmul"],
        "step/train_repeated_prompt_flops_over_matmul": med["train_repeated_over_matmul"],
        "step/sample_flops_over_matmul": med["sample_over_matmul"],
        "step/step_flops_over_matmul": med["step_over_matmul"],
        "step/rounds": [
            {k: round(v, 4) for k, v in r.items() if k in ("step", "train", "rate")} for r in rounds
        ],
    }
    if profile:
        out = runner.sample()
        batch = runner.batch(out, runner.advantages(runner.score(out)))
        text = runner.train_step.lower(runner.state, batch).compile().as_text()
        holder = {"state": runner.state}

        def one():
            holder["state"], metrics = runner.train_step(holder["state"], batch)
            return metrics

        total, directory = common.profile_ops(one, compiled_text=text)
        runner.state = holder["state"]
        common.print_top_ops(total, title=f"Train step by XLA op (trace in {directory})")
    return result


# The targets for the whole-step preset: the RL step at <= half of TRL's, the train
# step at >= 0.70 of the measured matmul rate.
TARGET_STEP_OVER_TRL = 0.5
TARGET_TRAIN_OVER_MATMUL = 0.70


def load_report(path: str) -> dict:
    """The JSON report `trl_anchor.py` prints last (its whole output, or that line alone)."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise SystemExit(f"--compare={path}: cannot read it ({e.strerror})") from None
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                report = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "step/step_s" in report and "step/generation_s" in report:
                return report
    raise SystemExit(
        f"--compare={path}: no trl_anchor.py report in it (the JSON line that script prints "
        "last, with step/step_s and step/generation_s)"
    )


def phase_table(ours: dict, trl: dict | None = None) -> str:
    """Markdown table of the whole-step phases (and, given trl_anchor.py's report, TRL's
    beside them with gspo_jax / TRL), then the targets, met or not."""
    rows = [
        ("whole RL step", "step/step_s", "step/step_s", "s"),
        ("generation", "step/sample_s", "step/generation_s", "s"),
        ("reward + advantages", None, "step/score_adv_s", "s"),
        ("train step (forward + backward + optimizer)", "step/train_s", "step/train_s", "s"),
        (
            "train FLOP/s / matmul",
            "step/train_flops_over_matmul",
            "step/train_flops_over_matmul",
            "",
        ),
        ("step FLOP/s / matmul", "step/step_flops_over_matmul", "step/step_flops_over_matmul", ""),
        ("matmul TFLOP/s (f32 2048²)", "matmul_tflops_measured", "matmul_tflops_measured", ""),
    ]

    def ours_value(key):
        if key is None:  # the two host-side phases, as TRL reports them together
            return ours["step/score_s"] + ours["step/advantages_s"]
        return ours[key]

    def fmt(value, unit):
        return f"{value:.3f} {unit}".strip()

    if trl is None:
        lines = ["| phase | gspo_jax |", "| --- | ---: |"]
        lines += [f"| {name} | {fmt(ours_value(k), u)} |" for name, k, _, u in rows]
    else:
        threads = trl.get("threads", "?")
        threads = f"{threads} thread{'' if threads == 1 else 's'}"
        lines = [
            f"| phase | gspo_jax | TRL {trl.get('trl', '')} ({threads}) | gspo_jax / TRL |",
            "| --- | ---: | ---: | ---: |",
        ]
        for name, k, tk, u in rows:
            a, b = ours_value(k), trl[tk]
            ratio = f"{a / b:.2f}x" if u == "s" else ""
            lines.append(f"| {name} | {fmt(a, u)} | {fmt(b, u)} | {ratio} |")
    train = ours["step/train_flops_over_matmul"]
    verdict = "met" if train >= TARGET_TRAIN_OVER_MATMUL else "not met"
    lines.append("")
    lines.append(
        f"target: train step >= {TARGET_TRAIN_OVER_MATMUL:.2f} of the matmul rate: {verdict} "
        f"({train:.2f}; {ours['step/train_repeated_prompt_flops_over_matmul']:.2f} counting "
        "each prompt G times)"
    )
    if trl is not None:
        step = ours["step/step_s"] / trl["step/step_s"]
        verdict = "met" if step <= TARGET_STEP_OVER_TRL else "not met"
        lines.append(
            f"target: whole RL step <= {TARGET_STEP_OVER_TRL}x TRL's: {verdict} ({step:.2f}x)"
        )
    return "\n".join(lines)


def bench_shared_prompt(preset, cfg, reps: int, prompt_len: int, response_len: int):
    """The train step with each prompt once per group (`shared_prompt`, the default) and with
    the prompt repeated G times, alternating in rounds (median per-round speedup), on a
    rollout-shaped batch: N prompts of `prompt_len` tokens, G responses of `response_len`."""
    n, g = preset["prompts"], preset["group"]
    b, p, t = n * g, prompt_len, response_len
    config = anchor_config(preset)
    config.response_length = t
    rng = np.random.default_rng(0)
    prompt = np.repeat(rng.integers(0, cfg.vocab_size, (n, p)), g, axis=0)
    tokens = np.concatenate([prompt, rng.integers(0, cfg.vocab_size, (b, t))], axis=1)
    batch = {
        "tokens": jnp.asarray(tokens, jnp.int32),
        "attention_mask": jnp.ones((b, p + t), jnp.int32),
        "response_mask": jnp.ones((b, t), jnp.float32),
        "sampler_logprobs": jnp.asarray(-rng.random((b, t)) * 5, jnp.float32),
        "advantages": jnp.asarray(rng.normal(size=b), jnp.float32),
    }
    tx = optim.make_optimizer(specs.optim_spec(config))
    params = jax.jit(models.init_params, static_argnums=0)(cfg, jax.random.PRNGKey(0))
    steps = {}
    for shared in (True, False):
        config.shared_prompt = shared
        sc = step_config(config, cfg)
        fn = make_train_step(sc, tx, donate=False)
        state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
        jax.block_until_ready(fn(state, batch))  # compile
        steps[shared] = functools.partial(fn, state, batch)
    rounds = [(common.seconds(steps[True]), common.seconds(steps[False])) for _ in range(reps)]
    key = f"shared_prompt/P{p}_T{t}_G{g}"
    return {
        f"{key}/shared_s": statistics.median(r[0] for r in rounds),
        f"{key}/repeated_s": statistics.median(r[1] for r in rounds),
        f"{key}/speedup": statistics.median(r[1] / r[0] for r in rounds),
    }


def bench_sampler(preset, cfg, rate, baseline: bool):
    n, g = preset["prompts"], preset["group"]
    p, t = preset["prompt_len"], preset["response_len"]
    params = jax.jit(models.init_params, static_argnums=0)(cfg, jax.random.PRNGKey(1))
    rng = np.random.default_rng(1)
    prompts = rng.integers(0, cfg.vocab_size, (n, p)).astype(np.int32)
    mask = np.ones((n, p), np.int32)
    kwargs = {"num_samples": g, "max_new_tokens": t, "eos_ids": (), "buckets": (p,)}

    def run(key):
        return sampling.sample(cfg, params, prompts, mask, key, **kwargs)

    seconds = common.median_seconds(run, jax.random.PRNGKey(0))
    generated = int(np.asarray(run(jax.random.PRNGKey(0)).mask).sum())
    b = n * g
    # Decode floor: one step's FLOPs for B rows, attending to the mean cache length.
    step_flops = common.decode_step_flops(cfg, b, p + t / 2)
    result = {
        "sampler/rows": b,
        "sampler/generated_tokens": generated,
        "sampler/seconds": seconds,
        "sampler/tokens_per_s": generated / seconds,
        "sampler/step_ms": 1e3 * seconds / t,
        "sampler/step_floor_ms": 1e3 * step_flops / rate,
        "sampler/step_over_floor": (seconds / t) / (step_flops / rate),
    }
    if baseline:
        loop = common.python_loop_sampler(cfg, params, prompts, mask, g, t)
        loop_s = common.median_seconds(loop, reps=1)
        result["sampler/python_loop_tokens_per_s"] = b * t / loop_s
        result["sampler/speedup_over_python_loop"] = loop_s / seconds
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--baseline", action="store_true", help="also time a per-token Python loop")
    ap.add_argument("--skip_train", action="store_true")
    ap.add_argument("--skip_sampler", action="store_true")
    ap.add_argument("--reps", type=int, default=7, help="whole-step preset: timed RL steps")
    ap.add_argument(
        "--profile", action="store_true", help="whole-step preset: top XLA ops of a train step"
    )
    ap.add_argument(
        "--shared_prompt",
        default="",
        help="whole-step preset: P:T pairs (e.g. 16:64,256:256) at which to time the train "
        "step with the prompt once per group against G times",
    )
    ap.add_argument(
        "--compare",
        default="",
        help="whole-step preset: a file holding trl_anchor.py's output; prints the phases "
        "side by side with gspo_jax / TRL and the targets",
    )
    args = ap.parse_args()
    preset = PRESETS[args.preset]
    trl = load_report(args.compare) if args.compare else None  # a bad file fails first
    cfg = models.ModelConfig(
        **preset["model"], param_dtype="float32", dtype=preset["dtype"], remat=preset["remat"]
    )
    device = jax.devices()[0]
    rate = common.matmul_rate(
        dtype=preset["dtype"] if jax.default_backend() != "cpu" else "float32"
    )
    results = {
        "device": f"{device.platform}:{getattr(device, 'device_kind', '')}",
        "jax": jax.__version__,
        "preset": args.preset,
        "params_M": models.param_count(cfg) / 1e6,
        "matmul_tflops_measured": rate / 1e12,
        "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k in preset["model"]},
    }
    if preset.get("whole_step"):
        results.update(bench_whole_step(preset, cfg, args.reps, args.profile))
        for pair in filter(None, args.shared_prompt.split(",")):
            p, t = (int(x) for x in pair.split(":"))
            results.update(bench_shared_prompt(preset, cfg, args.reps, p, t))
    if not args.skip_train and not preset.get("whole_step"):
        results.update(bench_train(preset, cfg, rate))
    if not args.skip_sampler and not preset.get("whole_step"):
        results.update(bench_sampler(preset, cfg, rate, args.baseline))
    width = max(len(k) for k in results)
    for key, value in results.items():
        if isinstance(value, float):
            value = f"{value:.4g}"
        print(f"{key:<{width}}  {value}")
    if preset.get("whole_step"):
        print()
        print(phase_table(results, trl))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
