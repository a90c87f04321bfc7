"""TRL's side of the anchor benchmark: GRPOTrainer's GSPO step on the anchor workload.

The same model, prompts, tokenizer and reward as `benchmarks/rl_step.py --preset=trl_anchor`
(both read benchmarks/anchor_spec.py): Qwen2 (hidden 256, 4 layers, 4 q / 2 kv heads of 64,
MLP 688, vocabulary 1,024, tied, f32, 3.17M parameters) with random weights; per RL step
4 prompts x 8 samples, prompts left padded to 16, 64 new tokens at temperature 1, reward on
the decoded text, group z-score (scale_rewards="group"), GSPO sequence ratio
(importance_sampling_level="sequence", ε 3e-4 / 4e-4), loss_type="grpo" (per-sequence token
mean, then the mean over sequences), β = 0, one optimizer update per rollout
(steps_per_generation = gradient_accumulation_steps = 1, num_iterations = 1: π_old is the
detached current log-prob, no extra pass), AdamW lr 1e-6, grad-norm clip 1.0, constant
schedule. TRL's default fused LM head is on; its default gradient checkpointing is off (the
gspo_jax preset keeps every activation too, and checkpointing only slows TRL down here).

Threads: under load (other processes on the cores) torch's 2 OpenMP threads wait on each
other, and generation runs 20-40x slower than with one thread (measured: 26 s vs 0.7 s for
the same generate call at load ~10 on 2 cores). Compare with `--threads 1` and with the
default, and take TRL's faster.

It runs `GRPOTrainer.train()` itself for 1 + reps steps and times, per optimizer step:
  step         a TrainerCallback's on_step_begin -> on_step_end (the whole RL step)
  generation   GRPOTrainer._generate (tokenize, model.generate, decode)
  score+adv    the rest of _generate_and_score_completions (rewards, group z-score, ...)
  train        step − _generate_and_score_completions (forward + backward + clip + AdamW)
and, in rounds alternating with the steps, torch's f32 2048 x 2048 matmul rate, so the
FLOP ratios use the same FLOP model (anchor_spec.model_flops_per_step) as gspo_jax's side.
The first step (warm-up) is not counted; medians over the rest.

Runs in a separate venv; torch and trl are never dependencies of gspo_jax:

    python3.11 -m venv /tmp/trlvenv
    /tmp/trlvenv/bin/pip install torch==2.13.0 trl transformers
    /tmp/trlvenv/bin/python benchmarks/trl_anchor.py [--reps 3] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import anchor_spec
import torch
from datasets import Dataset
from transformers import Qwen2Config, Qwen2ForCausalLM, TrainerCallback
from trl import GRPOConfig, GRPOTrainer


def matmul_rate(n: int = 2048, reps: int = 5) -> float:
    """torch's f32 n x n matmul FLOP/s now (median of `reps` after a warm-up)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


def make_model() -> Qwen2ForCausalLM:
    m = anchor_spec.MODEL
    config = Qwen2Config(
        vocab_size=m["vocab_size"],
        hidden_size=m["hidden_size"],
        intermediate_size=m["intermediate_size"],
        num_hidden_layers=m["num_layers"],
        num_attention_heads=m["num_heads"],
        num_key_value_heads=m["num_kv_heads"],
        head_dim=m["head_dim"],
        tie_word_embeddings=m["tie_word_embeddings"],
        rope_theta=m["rope_theta"],
        rms_norm_eps=m["rms_norm_eps"],
        max_position_embeddings=256,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).float()
    params = sum(p.numel() for p in model.parameters())
    assert abs(params - 3_166_464) < 1000, params  # the same 3.17M as gspo_jax's model
    return model


def reward_fn(prompts, completions, **kwargs):
    return [anchor_spec.reward(text) for text in completions]


class Timer:
    """Wraps a bound method, recording the wall time of each call."""

    def __init__(self, obj, name):
        self.calls = []
        inner = getattr(obj, name)

        def wrapped(*args, **kwargs):
            t0 = time.perf_counter()
            out = inner(*args, **kwargs)
            self.calls.append(time.perf_counter() - t0)
            return out

        setattr(obj, name, wrapped)


class StepTimes(TrainerCallback):
    """Whole optimizer steps, with the matmul rate measured between steps (same rounds)."""

    def __init__(self):
        self.steps, self.rates, self._t0 = [], [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self.rates.append(matmul_rate())
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(time.perf_counter() - self._t0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n, g = anchor_spec.NUM_PROMPTS, anchor_spec.GROUP
    tokenizer = anchor_spec.make_tokenizer()
    dataset = Dataset.from_dict({"prompt": anchor_spec.prompts()})
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_anchor_"),
        per_device_train_batch_size=n * g,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=g,
        max_completion_length=anchor_spec.RESPONSE_LEN,
        temperature=anchor_spec.TEMPERATURE,
        top_p=1.0,
        importance_sampling_level="sequence",
        loss_type="grpo",
        epsilon=anchor_spec.CLIP_LOW,
        epsilon_high=anchor_spec.CLIP_HIGH,
        beta=0.0,
        scale_rewards="group",
        learning_rate=anchor_spec.LEARNING_RATE,
        max_grad_norm=anchor_spec.MAX_GRAD_NORM,
        gradient_checkpointing=False,  # TRL's default recomputes; gspo_jax's preset does not
        weight_decay=0.0,
        lr_scheduler_type="constant",
        max_steps=1 + args.reps,
        logging_steps=10_000,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=0,
        disable_tqdm=True,
        log_completions=False,
        shuffle_dataset=False,
    )
    trainer = GRPOTrainer(
        model=make_model(),
        reward_funcs=reward_fn,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    gen = Timer(trainer, "_generate")
    gen_score = Timer(trainer, "_generate_and_score_completions")
    steps = StepTimes()
    trainer.add_callback(steps)
    trainer.train()

    assert len(steps.steps) == len(gen.calls) == len(gen_score.calls) == 1 + args.reps
    flops = anchor_spec.model_flops_per_step(anchor_spec.matmul_params())
    rounds = []
    for step, g_s, gs_s, rate in list(zip(steps.steps, gen.calls, gen_score.calls, steps.rates))[
        1:
    ]:
        train = step - gs_s
        rounds.append(
            {
                "step": step,
                "generation": g_s,
                "score_adv": gs_s - g_s,
                "train": train,
                "rate": rate,
                "train_over_matmul": flops["train"] / train / rate,
                "generation_over_matmul": flops["generation"] / g_s / rate,
                "step_over_matmul": flops["step"] / step / rate,
            }
        )
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    results = {
        "torch": torch.__version__,
        "trl": __import__("trl").__version__,
        "threads": torch.get_num_threads(),
        "load": os.getloadavg()[0],
        "matmul_tflops_measured": med["rate"] / 1e12,
        "step/first_call_s": steps.steps[0],
        **{f"step/{k}_s": med[k] for k in ("step", "generation", "score_adv", "train")},
        "step/train_flops_over_matmul": med["train_over_matmul"],
        "step/generation_flops_over_matmul": med["generation_over_matmul"],
        "step/step_flops_over_matmul": med["step_over_matmul"],
        "step/rounds": [
            {k: round(r[k], 4) for k in ("step", "train", "generation", "rate")} for r in rounds
        ],
    }
    width = max(len(k) for k in results)
    for key, value in results.items():
        print(
            f"{key:<{width}}  {value:.4g}"
            if isinstance(value, float)
            else f"{key:<{width}}  {value}"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
