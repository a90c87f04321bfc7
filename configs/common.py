"""Helpers shared by the experiment configs (argument parsing, size presets)."""

from __future__ import annotations


def parse_arg(arg: str | None, **defaults):
    """Parse `key=value,key=value` from `--config=configs/<name>.py:key=value,...`.

    Values are converted to the type of the default (bool accepts true/false/1/0); an unknown
    key is an error naming the valid ones.
    """
    values = dict(defaults)
    if not arg:
        return values
    for part in arg.split(","):
        if not part:
            continue
        if "=" not in part:
            raise ValueError(
                f"config argument {part!r} is not key=value (valid keys: {list(defaults)})"
            )
        key, raw = part.split("=", 1)
        if key not in defaults:
            raise ValueError(f"unknown config argument {key!r}; valid keys: {list(defaults)}")
        default = defaults[key]
        if isinstance(default, bool):
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"config argument {key}={raw!r} is not a boolean")
            values[key] = raw.lower() in ("true", "1")
        elif default is None or isinstance(default, str):
            values[key] = raw
        else:
            values[key] = type(default)(raw)
    return values


def no_arg(arg: str | None, config_file: str) -> None:
    """The argument check of a config that takes none: `--config=FILE:anything` is an
    error naming the file and the argument, never silently dropped (a run of the wrong
    model with the wrong data)."""
    if arg:
        raise ValueError(
            f"{config_file} takes no config argument, got {arg!r}; set fields with "
            "--config.<field>=<value> (configs/gspo_paper.py, grpo_paper.py and "
            "roll_gspo_example.py take hf_path=...,manual_dir=...)"
        )


def use_hf_model_on_gsm8k(c, hf_path: str, manual_dir: str) -> None:
    """Point a config at a local Hugging Face checkpoint trained on GSM8K (manual_dir)."""
    if not manual_dir:
        raise ValueError(
            "hf_path=... needs manual_dir=... (a directory with GSM8K train.jsonl/test.jsonl)"
        )
    c.model.hf_path = hf_path
    c.data.name = "gsm8k"
    c.data.config_name = ""  # GSM8K has no builder configs
    c.data.manual_dir = manual_dir
    c.data.instruction = '\nLet\'s think step by step and output the final answer after "####".'
    c.reward.spec = "math"
    c.prompt_length = 256
    c.response_length = 512
    c.rollout_batch_size = 32
    c.num_return_sequences_in_group = 8
    c.micro_batch_size = 8
    c.optim.learning_rate = 1e-6
    c.optim.warmup_steps = 10
    c.model.param_dtype = "float32"
    c.model.dtype = "bfloat16"
    c.model.remat = "full"
    c.warm_start.steps = 0
    c.eval.num_prompts = 256
