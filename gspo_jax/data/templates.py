"""Chat templates: how a question becomes the prompt text the policy is asked.

`data.chat_template` chooses the template (validated at start-up, `check_chat_template`):

- `"tokenizer"` (default): the tokenizer's own, through `apply_chat_template`: the scratch
  model's ChatML (data/tokenizer.py), a Qwen or Llama 3 checkpoint's template as shipped.
- `"none"`: no template, for base models without one: the system prompt (if any), a blank
  line, then the question and the instruction as plain text.
- a Jinja chat template of your own: its text (it contains `{{` or `{%`) or the path of a
  `.jinja` file, applied through the tokenizer's `apply_chat_template` like its own.

`data.enable_thinking` (None: the template's default) is passed to the template as
`enable_thinking`, Qwen3's switch between thinking and direct answers.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import transformers

TEMPLATE_NAMES = ("tokenizer", "none")
DEFAULT_INSTRUCTION = "Give the final answer after ####."


def _is_template_text(value: str) -> bool:
    return "{{" in value or "{%" in value


def check_chat_template(value: str) -> None:
    """ValueError naming `data.chat_template` unless it is a name of `TEMPLATE_NAMES`, a
    readable .jinja file or Jinja text, and the template parses."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(
            f"config.data.chat_template={value!r}: use 'tokenizer', 'none', a Jinja chat "
            "template or the path of a .jinja file"
        )
    if value in TEMPLATE_NAMES:
        return
    where = "config.data.chat_template"
    if not _is_template_text(value):
        if not os.path.isfile(value):
            raise ValueError(
                f"{where}={value!r} is neither {' nor '.join(map(repr, TEMPLATE_NAMES))}, nor "
                "Jinja text ({{ ... }}), nor an existing file"
            )
        where = f"{where} file {value}"
        with open(value, encoding="utf-8") as f:
            value = f.read()
    import jinja2

    try:
        jinja2.Environment().parse(value)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{where}: not a valid Jinja template (line {e.lineno}: {e})") from None


def resolve_chat_template(value: str) -> str | None:
    """What the pipeline applies: None (the tokenizer's own), "none", or the template text
    (a file's contents)."""
    if value == "tokenizer":
        return None
    if value == "none" or _is_template_text(value):
        return value
    with open(value, encoding="utf-8") as f:
        return f.read()


def build_messages(
    question: str,
    *,
    system_prompt: str | None = None,
    instruction: str | None = DEFAULT_INSTRUCTION,
) -> list[dict[str, str]]:
    """Chat messages of one prompt: optional system turn, then ``question\\ninstruction``."""
    content = f"{question}\n{instruction}" if instruction else question
    messages = [{"role": "user", "content": content}]
    if system_prompt:
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def render_prompt(
    tokenizer: transformers.PreTrainedTokenizerBase,
    question: str,
    *,
    system_prompt: str | None = None,
    instruction: str | None = DEFAULT_INSTRUCTION,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The prompt text: templated, ending with the opened assistant turn (`chat_template`:
    None for the tokenizer's own, "none" for plain text, else a Jinja template)."""
    messages = build_messages(question, system_prompt=system_prompt, instruction=instruction)
    if chat_template == "none":
        text = messages[-1]["content"]
        return f"{system_prompt}\n\n{text}" if system_prompt else text
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"Tokenizer {type(tokenizer).__name__} has no chat_template; set "
            "config.data.chat_template to 'none' (plain text) or to a Jinja template "
            "(make_char_tokenizer sets one; Qwen and Llama 3 instruct tokenizers ship one)."
        )
    return tokenizer.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=True,
        chat_template=chat_template,
        **(chat_template_kwargs or {}),
    )
