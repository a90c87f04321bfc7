"""Qwen3-0.6B on GSM8K with GSPO at the paper's settings, from a local checkpoint.

  python -m gspo_jax.main \
      --config=configs/qwen3_0p6b_gsm8k.py:hf_path=/ckpt/Qwen3-0.6B,manual_dir=/data/gsm8k \
      --workdir=/tmp/gspo_qwen3_gsm8k

hf_path: a local copy of the Hugging Face checkpoint `Qwen/Qwen3-0.6B` (config.json,
model.safetensors, tokenizer files). manual_dir: GSM8K's official `train.jsonl` and
`test.jsonl` (`openai/gsm8k`, config "main"). Nothing is downloaded at run time.

Hardware: written for one accelerator host with >= 40 GB (bf16 compute, f32 master weights,
full remat); on a TPU pod slice raise rollout_batch_size and set mesh.fsdp (README, TPU pods).
The paper's claims to check here: clipped fraction ~2 orders of magnitude above the GRPO
baseline (configs/grpo_paper.py with the same arguments), stable reward and accuracy curves,
and a small sampler-vs-trainer log-prob gap (metric sampler/logprob_gap_mean, paper §5.4).
"""

from configs import common, gspo_paper


def get_config(arg: str | None = None):
    args = common.parse_arg(arg, hf_path="", manual_dir="")
    if not args["hf_path"]:
        raise ValueError(
            "configs/qwen3_0p6b_gsm8k.py needs :hf_path=DIR,manual_dir=DIR (a local Qwen3-0.6B "
            "checkpoint and the GSM8K jsonl files)"
        )
    c = gspo_paper.get_config(arg)
    c.num_steps = 500
    c.rollout_batch_size = 64
    c.num_return_sequences_in_group = 8
    c.micro_batch_size = 16
    c.response_length = 768
    c.sampling.temperature = 1.0
    c.optim.learning_rate = 1e-6
    c.optim.warmup_steps = 20
    c.eval.every_steps = 25
    c.eval.num_prompts = 500
    c.checkpoint.every_steps = 25
    return c
