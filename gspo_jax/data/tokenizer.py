"""Tokenizers: a tiny character-level ChatML tokenizer for the synthetic task, and the loader.

The synthetic run trains a tiny transformer from scratch, so its vocabulary is ~100 characters
plus ChatML special tokens, built with the ``tokenizers`` library and saved as a normal Hugging
Face tokenizer directory. ``load_tokenizer`` reads that directory, or a real Qwen tokenizer
directory, through ``transformers.AutoTokenizer`` (local files only, never the Hub); the prompt
pipelines (``gspo_jax.data.pipeline``) then template and tokenize with it.

Special tokens of the char tokenizer (ids fixed):

    0 <|endoftext|>   pad token
    1 <|im_start|>
    2 <|im_end|>      eos token: ends every assistant turn, the sampler stops on it
    3 <|unk|>         any character outside the vocabulary

The layout follows Qwen2.5-Instruct (eos ``<|im_end|>``, pad ``<|endoftext|>``); use
``stop_token_ids`` for the sampler's ``eos_ids`` with either tokenizer.
"""

from __future__ import annotations

import os
import string

import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models

from gspo_jax import jsonio

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END, UNK_TOKEN)

# Digits, letters, ASCII punctuation (operators, '#', '?', ...), space and newline.
CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"

# Qwen-style ChatML: each turn is "<|im_start|>{role}\n{content}<|im_end|>\n"; the generation
# prompt opens the assistant turn. No default system prompt is injected.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def make_char_tokenizer(
    path: str | os.PathLike, *, model_max_length: int = 4096
) -> transformers.PreTrainedTokenizerBase:
    """Builds the character-level ChatML tokenizer, saves it to ``path``, and loads it back.

    Returns the tokenizer as ``load_tokenizer(path)`` gives it, so callers use exactly what is
    on disk. Vocabulary: 4 special tokens + ``CHARS`` (100 entries in all).
    """
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + tuple(CHARS))}
    # BPE without merges is a pure character model; unknown characters map to <|unk|>.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    backend.decoder = decoders.Fuse()  # Concatenate characters; no spaces between tokens.
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=[IM_START],
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
    )
    os.makedirs(path, exist_ok=True)
    tokenizer.save_pretrained(os.fspath(path))
    return load_tokenizer(path)


def load_tokenizer(path: str | os.PathLike) -> transformers.PreTrainedTokenizerBase:
    """Loads a tokenizer from a local Hugging Face directory (char tokenizer or Qwen's).

    Never touches the network: a missing directory or one without tokenizer files is an error
    naming the path.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Tokenizer directory {path!r} does not exist.")
    if not any(
        os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        raise FileNotFoundError(
            f"Tokenizer directory {path!r} has neither tokenizer.json nor tokenizer_config.json."
        )
    # Its JSON files first: a truncated tokenizer.json is transformers' "data did not match
    # any variant of untagged enum" (or a bare JSONDecodeError), naming no file.
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.isfile(os.path.join(path, name)):
            jsonio.read_json(os.path.join(path, name), what=f"the tokenizer's {name}")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"Tokenizer directory {path!r} cannot be loaded: {e}") from e
    if tokenizer.pad_token_id is None:
        raise ValueError(
            f"Tokenizer at {path!r} has no pad token; the prompt pipeline left-pads with it. "
            "Set pad_token in its tokenizer_config.json (Qwen uses <|endoftext|>)."
        )
    return tokenizer


def stop_token_ids(tokenizer: transformers.PreTrainedTokenizerBase) -> tuple[int, ...]:
    """Ids that end a response: the eos token plus <|im_end|> and <|endoftext|> if present.

    Qwen base models use <|endoftext|> as eos while chat turns end with <|im_end|>; stopping on
    both is what the sampler wants for either kind of checkpoint.
    """
    ids = []
    vocab = tokenizer.get_vocab()
    for token in (tokenizer.eos_token, IM_END, PAD_TOKEN):
        if token is not None and token in vocab and vocab[token] not in ids:
            ids.append(vocab[token])
    if not ids:
        raise ValueError("Tokenizer has no eos token and neither <|im_end|> nor <|endoftext|>.")
    return tuple(ids)
