"""`sampling.sample`'s options as one typed value: `sample_with(options=SampleOptions(...))`
is what the keyword form calls, and what the RL loop binds."""

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest

from gspo_jax import models, sampling

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "qwen3"


def test_the_keyword_form_and_the_typed_form_sample_the_same():
    cfg, params = models.load_pretrained(FIXTURE)
    tokens = np.array([[0, 5, 6, 7], [8, 9, 10, 11]], np.int32)
    mask = np.array([[0, 1, 1, 1], [1, 1, 1, 1]], np.int32)
    key = jax.random.key(3)
    kw = {"num_samples": 2, "max_new_tokens": 4, "eos_ids": (), "engine": "static"}
    a = sampling.sample(cfg, params, tokens, mask, key, **kw)
    b = sampling.sample_with(cfg, params, tokens, mask, key, options=sampling.SampleOptions(**kw))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    bound = sampling.SampleOptions(**(kw | {"eos_ids": (1,)}))
    c = sampling.sample_with(cfg, params, tokens, mask, key, options=bound, eos_ids=())
    np.testing.assert_array_equal(a.tokens, c.tokens)  # a call's change of a bound option


def test_options_are_frozen_hashable_and_name_every_keyword_of_sample():
    import inspect

    o = sampling.SampleOptions(num_samples=2, max_new_tokens=4)
    assert hash(o) == hash(o.replace()) and o.replace(top_k=5).top_k == 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.num_samples = 3
    keywords = {
        n
        for n, p in inspect.signature(sampling.sample).parameters.items()
        if p.kind is p.KEYWORD_ONLY
    }
    assert keywords == {f.name for f in dataclasses.fields(sampling.SampleOptions)}
