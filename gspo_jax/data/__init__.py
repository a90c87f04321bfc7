"""Data: TFDS builders (synthetic arithmetic, local GSM8K), tokenizers, prompt/SFT pipelines.

Flow: ``build_dataset`` -> ``{split: source}`` -> ``prepare_prompts`` / ``prepare_sft`` (this
process's shard, templated, tokenized, padded) -> ``.iterator(batch_size, seed=, train=)`` ->
batch dicts of numpy arrays for the trainer.
"""

from gspo_jax.data.arithmetic import (
    ARITHMETIC_CONFIGS,
    ArithmeticConfig,
    SyntheticArithmetic,
    generate_problems,
)
from gspo_jax.data.build import (
    DATASETS,
    FILE_DATASETS,
    DatasetSpec,
    build_dataset,
    get_builder,
    get_spec,
    register_dataset,
)
from gspo_jax.data.gsm8k import Gsm8kLocal, check_gsm8k_manual_dir, read_gsm8k_jsonl
from gspo_jax.data.jsonl import JsonlConfig, JsonlLocal, files_config, hf_config, jsonl_config
from gspo_jax.data.pipeline import (
    ANSWER_PREFIX,
    DEFAULT_INSTRUCTION,
    DEFAULT_TARGET_TEMPLATE,
    OVERLONG_POLICIES,
    BatchIterator,
    PreparedData,
    build_messages,
    decode_record,
    format_answer,
    make_prompt_iterator,
    make_sft_iterator,
    prepare_prompts,
    prepare_sft,
    read_shard,
    render_prompt,
    resolve_shard,
)
from gspo_jax.data.scratchpad import (
    SCRATCHPAD_CONFIGS,
    ScratchpadConfig,
    SyntheticScratchpad,
    worked_solution,
)
from gspo_jax.data.teacher import NoisyTeacher, drop_carry_sum, needs_carry
from gspo_jax.data.templates import TEMPLATE_NAMES, check_chat_template, resolve_chat_template
from gspo_jax.data.tokenizer import (
    CHAT_TEMPLATE,
    IM_END,
    IM_START,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    UNK_TOKEN,
    load_tokenizer,
    make_char_tokenizer,
    stop_token_ids,
)

__all__ = [
    "ANSWER_PREFIX",
    "ARITHMETIC_CONFIGS",
    "CHAT_TEMPLATE",
    "DATASETS",
    "DEFAULT_INSTRUCTION",
    "DEFAULT_TARGET_TEMPLATE",
    "FILE_DATASETS",
    "IM_END",
    "IM_START",
    "OVERLONG_POLICIES",
    "PAD_TOKEN",
    "SCRATCHPAD_CONFIGS",
    "SPECIAL_TOKENS",
    "TEMPLATE_NAMES",
    "UNK_TOKEN",
    "ArithmeticConfig",
    "BatchIterator",
    "DatasetSpec",
    "Gsm8kLocal",
    "JsonlConfig",
    "JsonlLocal",
    "NoisyTeacher",
    "PreparedData",
    "ScratchpadConfig",
    "SyntheticArithmetic",
    "SyntheticScratchpad",
    "build_dataset",
    "build_messages",
    "check_chat_template",
    "check_gsm8k_manual_dir",
    "decode_record",
    "drop_carry_sum",
    "files_config",
    "format_answer",
    "generate_problems",
    "get_builder",
    "get_spec",
    "hf_config",
    "jsonl_config",
    "load_tokenizer",
    "make_char_tokenizer",
    "make_prompt_iterator",
    "make_sft_iterator",
    "needs_carry",
    "prepare_prompts",
    "prepare_sft",
    "read_gsm8k_jsonl",
    "read_shard",
    "register_dataset",
    "render_prompt",
    "resolve_chat_template",
    "resolve_shard",
    "stop_token_ids",
    "worked_solution",
]
