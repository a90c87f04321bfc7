"""Qwen3.5 (hybrid Gated DeltaNet + gated attention) on GSM8K with GSPO, from a local checkpoint.

  python -m gspo_jax.main \
      --config=configs/qwen35_gsm8k.py:hf_path=/ckpt/Qwen3.5-0.8B,manual_dir=/data/gsm8k \
      --workdir=/tmp/gspo_qwen35_gsm8k

hf_path: a local copy of a Qwen3.5 checkpoint: a text model (`Qwen3_5ForCausalLM`,
`Qwen3_5MoeForCausalLM`) or a released vision-language one
(`Qwen3_5ForConditionalGeneration`, whose language model is loaded and whose vision tower
and multi-token-prediction weights are skipped); config.json, safetensors, tokenizer files.
manual_dir: GSM8K's official `train.jsonl` and `test.jsonl`. Nothing is downloaded.

The sampler is the default continuous engine: pages for the full-attention layers only,
each decode slot's Gated DeltaNet conv window and recurrent state beside them, reset from
the prompt's prefill when the slot takes a sequence (sampling/slot_states.py). Sampler and
trainer share the model code: the prefill and every train-step pass run the chunked
Gated DeltaNet, the decode steps its recurrent form (docs/configuration.md, "Qwen3.5"); the gap
shows as sampler/logprob_gap_*. Settings otherwise as configs/qwen3_0p6b_gsm8k.py.
"""

from configs import common, qwen3_0p6b_gsm8k


def get_config(arg: str | None = None):
    args = common.parse_arg(arg, hf_path="", manual_dir="")
    if not args["hf_path"]:
        raise ValueError(
            "configs/qwen35_gsm8k.py needs :hf_path=DIR,manual_dir=DIR (a local Qwen3.5 "
            "checkpoint and the GSM8K jsonl files)"
        )
    return qwen3_0p6b_gsm8k.get_config(arg)
