"""data.chat_template and data.enable_thinking: the tokenizer's own template (default), plain
text, a Jinja template given as text or a file; checked at start-up, naming the field."""

import pytest

from configs import default
from gspo_jax import data
from gspo_jax.config import specs
from gspo_jax.config.validate import ConfigError, validate

# A template that shows what it was given: the roles, contents and the thinking switch.
MINE = (
    "{%- for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{%- endfor %}"
    "{%- if add_generation_prompt %}[assistant"
    "{%- if enable_thinking is defined and not enable_thinking %} no-think{%- endif %}]"
    "{%- endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return data.make_char_tokenizer(tmp_path_factory.mktemp("tok"))


def test_the_tokenizers_own_template_is_the_default(tokenizer):
    text = data.render_prompt(tokenizer, "Q?", instruction="Say it.")
    assert text == "<|im_start|>user\nQ?\nSay it.<|im_end|>\n<|im_start|>assistant\n"
    assert default.get_config().data.chat_template == "tokenizer"


def test_plain_text_and_a_template_of_your_own(tokenizer):
    assert data.render_prompt(tokenizer, "Q?", instruction=None, chat_template="none") == "Q?"
    plain = data.render_prompt(tokenizer, "Q?", system_prompt="Be brief.", chat_template="none")
    assert plain == f"Be brief.\n\nQ?\n{data.DEFAULT_INSTRUCTION}"
    mine = data.render_prompt(tokenizer, "Q?", instruction=None, chat_template=MINE)
    assert mine == "[user]Q?[assistant]"
    off = data.render_prompt(
        tokenizer,
        "Q?",
        instruction=None,
        chat_template=MINE,
        chat_template_kwargs={"enable_thinking": False},
    )
    assert off == "[user]Q?[assistant no-think]"


def test_the_config_reaches_the_prompt_pipeline(tokenizer, tmp_path):
    c = default.get_config()
    path = tmp_path / "mine.jinja"
    path.write_text(MINE)
    c.data.chat_template, c.data.enable_thinking = str(path), False
    validate(c)
    prompt = specs._prompt_spec(c, "answer")
    kwargs = prompt.kwargs()
    assert kwargs["chat_template"] == MINE
    assert kwargs["chat_template_kwargs"] == {"enable_thinking": False}
    source = [{"id": "a", "question": "1 + 1?", "answer": "2"}]
    prepared = data.prepare_prompts(source, tokenizer, **kwargs, shard_index=0, shard_count=1)
    assert prepared.arrays["prompt_text"][0] == "[user]1 + 1?[assistant no-think]"
    assert specs._prompt_spec(default.get_config(), "answer").kwargs()["chat_template"] is None


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("chatml", r"config.data.chat_template='chatml' is neither 'tokenizer' nor 'none'"),
        ("{% for m in messages %}", r"config.data.chat_template: not a valid Jinja template"),
        ("", r"config.data.chat_template='': use 'tokenizer', 'none'"),
    ],
)
def test_a_bad_template_is_named_at_start_up(value, error):
    c = default.get_config()
    c.data.chat_template = value
    with pytest.raises(ConfigError, match=error):
        validate(c)


def test_a_tokenizer_without_a_template_says_which_field_to_set(tokenizer):
    tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match=r"has no chat_template; set config.data.chat_template"):
        data.render_prompt(tokenizer, "Q?")
