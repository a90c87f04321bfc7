"""Values that are legal but defeat their purpose: a held-out split that overlaps the
training data, an accuracy reward that is not a 0/1 reward, a reward that cannot vary, a
temperature so small that log-probs overflow, a LoRA rank above a projection's size."""

import os
import re

from gspo_jax import models
from gspo_jax.config.errors import ConfigError
from gspo_jax.config.errors import get as _get
from gspo_jax.config.errors import warn as _warn
from gspo_jax.config.specs import lora_fields, scratch_model_config
from gspo_jax.data.build import DATASETS


def check_meaning(config) -> None:
    """Values legal for their type that defeat their purpose (docs/failures.md): a reward
    that cannot mean accuracy or carries no signal, a range narrower than the type, a
    held-out split that repeats the training data."""
    _check_reward_meaning(config)
    _check_narrow_ranges(config)
    _warn_held_out_overlap(config)


# A held-out split sharing more than this fraction of its examples with the training data
# measures (partly) training accuracy.
OVERLAP_WARN_FRACTION = 0.01


def _warn_held_out_overlap(config) -> None:
    """Beyond the same-split check (_check_data): a held-out file that repeats the training
    file's lines (a copy, or one built from the other), and two bounded slices of one split
    that overlap, warn with the fraction of the held-out examples also trained on."""
    d = config.data
    spec = DATASETS[d.name]
    if len(spec.manual_files) == 2 and d.manual_dir:
        train, held_out = (os.path.join(d.manual_dir, f) for f in spec.manual_files)
        try:
            with open(train, "rb") as f:
                seen = {line.strip() for line in f if line.strip()}
            with open(held_out, "rb") as f:
                lines = [line.strip() for line in f if line.strip()]
        except OSError:
            return  # named by the manual-dir check
        shared = sum(line in seen for line in lines) / max(len(lines), 1)
        if shared >= OVERLAP_WARN_FRACTION:
            _warn(
                f"config.data.manual_dir: {shared:.0%} of the held-out examples in {held_out} "
                f"are also in {train}: the held-out accuracy is partly measured on training "
                "prompts"
            )
    a, b = _slice_bounds(d.train_split), _slice_bounds(d.eval_split)
    if a and b and a[0] == b[0] and a[1:] != b[1:]:
        lo, hi = max(a[1], b[1]), min(a[2], b[2])
        shared = max(hi - lo, 0) / max(b[2] - b[1], 1)
        if shared >= OVERLAP_WARN_FRACTION:
            _warn(
                f"config.data.eval_split={d.eval_split!r} and train_split={d.train_split!r} "
                f"share {shared:.0%} of the held-out examples: the held-out accuracy is partly "
                "measured on training prompts"
            )


def _slice_bounds(split: str) -> tuple[str, int, int] | None:
    """(split, start, stop) of a slice with both bounds as example counts ("train[100:600]")."""
    m = re.fullmatch(r"(\w+)\[(\d+):(\d+)\]", split.replace(" ", ""))
    return None if m is None else (m[1], int(m[2]), int(m[3]))


def _check_reward_meaning(config) -> None:
    """reward.accuracy is a 0/1 score reported as a fraction: one term of weight 1 (a weight
    or a sum makes the held-out "accuracy" exceed 1). A reward spec whose weights are all 0 is
    constant: every group is dead and nothing trains."""
    from gspo_jax import rewards

    accuracy = rewards.build_reward(config.reward.accuracy)
    if len(accuracy.names) != 1 or accuracy.weights[0] != 1.0:
        raise ConfigError(
            f"config.reward.accuracy={config.reward.accuracy!r} must name one 0/1 reward "
            "without a weight (e.g. 'math'): it is reported as a fraction of correct "
            "answers, and a weight or a sum can make it exceed 1. Weights belong in "
            "config.reward.spec"
        )
    spec = rewards.build_reward(config.reward.spec)
    if all(w == 0 for w in spec.weights):
        raise ConfigError(
            f"config.reward.spec={config.reward.spec!r}: every weight is 0, so the reward is "
            "constant and no group has a signal (nothing would train)"
        )


# The smallest temperature a run samples or scores at (0: greedy). Log-probs are of
# logits / T: below this, a float32 logit of ~40 becomes ~4e4+ per token and the ratios and
# gradients scale as 1 / T (at 1e-38 the division overflows to inf). Greedy is 0, not a tiny T.
MIN_TEMPERATURE = 1e-3


def _check_narrow_ranges(config) -> None:
    """Fields whose legal range is narrower than their type: a temperature so small its
    log-probs blow up; a LoRA rank above a scratch projection's smaller dimension (warn:
    the adapter is then a full-rank update with extra parameters)."""
    for name, greedy in (("sampling.temperature", True), ("eval.temperature", False)):
        value = _get(config, name)
        if isinstance(value, (int, float)) and 0 < value < MIN_TEMPERATURE:
            where = "0 (greedy) or " if greedy else ""
            raise ConfigError(
                f"config.{name}={value!r} is below the floor {MIN_TEMPERATURE}: log-probs of "
                f"logits / temperature overflow float32 or swamp the update. Use {where}a "
                f"temperature >= {MIN_TEMPERATURE}"
            )
    m = config.model
    if m.lora_rank and not m.hf_path:
        warn_lora_rank_above_projection(
            config, scratch_model_config(config, vocab_size=1, eos_token_ids=(), pad_token_id=None)
        )


def lora_projection_dims(model_config: models.ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection LoRA can adapt (models/lora.py's targets)."""
    c = model_config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {
        "q_proj": (c.hidden_size, q),
        "k_proj": (c.hidden_size, kv),
        "v_proj": (c.hidden_size, kv),
        "o_proj": (q, c.hidden_size),
        "gate_proj": (c.hidden_size, c.intermediate_size),
        "up_proj": (c.hidden_size, c.intermediate_size),
        "down_proj": (c.intermediate_size, c.hidden_size),
    }


def warn_lora_rank_above_projection(config, model_config: models.ModelConfig) -> None:
    rank = config.model.lora_rank
    dims = lora_projection_dims(model_config)
    targets = lora_fields(config)["lora_targets"]
    over = {t: min(dims[t]) for t in targets if t in dims and rank > min(dims[t])}
    if over:
        _warn(
            f"config.model.lora_rank={rank} exceeds the smaller dimension of "
            + ", ".join(f"{t} ({d})" for t, d in over.items())
            + ": a rank above min(in, out) adds parameters but no expressiveness (a full "
            "update has that rank); fine-tune fully or lower the rank"
        )
