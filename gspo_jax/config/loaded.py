"""Checks that need what was loaded: the tokenizer's ids inside the model's vocabulary, and
the checkpoint's numbers (end-of-sequence ids) against the tokenizer's stop ids."""

import math
import os

from gspo_jax import models
from gspo_jax.config.errors import ConfigError
from gspo_jax.config.errors import warn as _warn
from gspo_jax.config.meaning import warn_lora_rank_above_projection
from gspo_jax.config.specs import checkpoint_dir


def check_model_against_tokenizer(config, model_config: models.ModelConfig, tokenizer) -> None:
    """The tokenizer's ids, the model's vocabulary and the run's lengths agree (run when the
    model config is read, before any data or weights). A token id >= vocab_size has no
    embedding row: it would give NaN log-probs and skip every update, silently."""
    from gspo_jax import data

    vocab = model_config.vocab_size
    where = f"model.hf_path={config.model.hf_path!r}" if config.model.hf_path else "model"
    source = config.model.tokenizer_path or config.model.hf_path or "the char tokenizer"
    largest = max(tokenizer.get_vocab().values(), default=-1)
    if largest >= vocab:
        raise ConfigError(
            f"the tokenizer ({source}) has token ids up to {largest}, but the {where} has "
            f"vocab_size={vocab}: ids >= {vocab} have no embedding. Use the model's own "
            "tokenizer (config.model.tokenizer_path)"
        )
    special = {"pad_token_id": tokenizer.pad_token_id}
    for i, eos in enumerate(data.stop_token_ids(tokenizer)):
        special[f"stop token {i}"] = eos
    for name, value in special.items():
        if value is not None and not 0 <= value < vocab:
            raise ConfigError(
                f"the tokenizer's {name}={value} is outside the {where} vocabulary [0, {vocab})"
            )
    _check_checkpoint_numbers(config, model_config, tokenizer)
    length = config.prompt_length + config.response_length
    if length > model_config.max_position_embeddings:
        raise ConfigError(
            f"config.prompt_length + config.response_length = {length} exceeds the "
            f"{where}'s max_position_embeddings={model_config.max_position_embeddings}"
        )


def _check_checkpoint_numbers(config, model_config: models.ModelConfig, tokenizer) -> None:
    """A checkpoint's numbers beside its config.json (read by models.read_model_config):
    generation_config.json's ids in the vocabulary, its and config.json's end-of-sequence
    ids against the tokenizer's stop ids (warn naming both); a LoRA rank above a projection's
    smaller dimension (warn)."""
    import json

    from gspo_jax import data

    if config.model.lora_rank:
        warn_lora_rank_above_projection(config, model_config)
    path = checkpoint_dir(config)
    if not path:
        return
    stops = sorted(data.stop_token_ids(tokenizer))
    eos_sources = {os.path.join(path, "config.json"): sorted(model_config.eos_token_ids)}
    generation = os.path.join(path, "generation_config.json")
    if os.path.isfile(generation):
        try:
            with open(generation, "rb") as f:
                fields = json.loads(f.read().decode("utf-8"))
        except (OSError, ValueError) as e:
            raise ConfigError(f"{generation!r} cannot be read as JSON: {e}") from None
        if not isinstance(fields, dict):
            raise ConfigError(f"{generation!r} holds a JSON {type(fields).__name__}, not an object")
        vocab = model_config.vocab_size
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
            value = fields.get(key)
            ids = value if isinstance(value, list) else [] if value is None else [value]
            for i in ids:
                if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab:
                    raise ConfigError(
                        f"{generation!r}: {key}={value!r} must be token ids in the model's "
                        f"vocabulary [0, {vocab})"
                    )
            if key == "eos_token_id" and ids:
                eos_sources[generation] = sorted(ids)
        for key, low in (("temperature", 0.0), ("top_p", 0.0), ("top_k", 0)):
            value = fields.get(key)
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value < low
            ):
                raise ConfigError(
                    f"{generation!r}: {key}={value!r} must be a finite number >= {low}"
                )
    for file, ids in eos_sources.items():
        if ids and stops and not set(ids) & set(stops):
            _warn(
                f"{file} names end-of-sequence id(s) {ids}, but the tokenizer "
                f"({config.model.tokenizer_path or path}) stops at {stops}: responses end at "
                "the tokenizer's; check that the two belong to the same model"
            )
