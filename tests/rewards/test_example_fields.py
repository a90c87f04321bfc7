"""Rewards that get the example's other fields (`example=`): asked for by signature, carried
from a JSONL line through the prompt pipeline and the rollout's scorer, in-process and in
worker processes; the three-argument verifiers are called as before."""

import json
import sys
import textwrap

import numpy as np
import pytest

from gspo_jax import data, rewards
from gspo_jax.rewards import registry
from gspo_jax.rollout.scoring import Scorer, examples_of

MODULE = '''
import gspo_jax.rewards


@gspo_jax.rewards.register_reward("test_difficulty")
def difficulty(prompt, completion, reference, *, example):
    """The line's own "difficulty" field, and 10 more if the response is the answer."""
    return float(example["difficulty"]) + 10.0 * (completion == reference)


@gspo_jax.rewards.register_reward("test_kwargs_fields")
def kwargs_fields(prompt, completion, reference, **kwargs):
    return float(len(kwargs["example"].get("tests", [])))
'''


@pytest.fixture(scope="module")
def field_rewards(tmp_path_factory):
    """The rewards above, registered from a module on sys.path (so workers import it)."""
    folder = tmp_path_factory.mktemp("mine")
    (folder / "field_rewards_mod.py").write_text(textwrap.dedent(MODULE))
    sys.path.insert(0, str(folder))
    try:
        import field_rewards_mod

        yield field_rewards_mod
    finally:
        sys.path.remove(str(folder))


def test_whether_a_reward_asks_is_read_from_its_signature():
    def three(prompt, completion, reference):
        return 0.0

    def keyword(prompt, completion, reference, *, example):
        return 0.0

    def positional_named(prompt, completion, reference, example=None):
        return 0.0

    def kwargs(prompt, completion, reference, **kw):
        return 0.0

    def other_name(prompt, completion, reference, *, fields=None):
        return 0.0

    assert not registry.takes_example(three) and not registry.takes_example(other_name)
    assert registry.takes_example(keyword) and registry.takes_example(kwargs)
    assert registry.takes_example(positional_named)
    assert not registry.takes_example(len)  # no signature: called as a verifier always was


def test_a_three_argument_verifier_is_called_as_before():
    """The built-in verifiers get no `example` (they would raise TypeError if they did)."""
    reward = rewards.build_reward("arith_exact:1.0,format:0.5")
    assert not reward.takes_example
    values, stats = rewards.score_batch(
        reward, ["p"], ["#### 7"], ["7"], timeout_s=None, examples=[{"difficulty": 3}]
    )
    assert stats["num_errors"] == 0 and values[0] == pytest.approx(1.5)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_reward_gets_each_items_fields(field_rewards, workers):
    spec = "test_difficulty:1.0,test_kwargs_fields:2.0"
    examples = [{"difficulty": 0.25, "tests": [1, 2]}, {"difficulty": 0.5}]
    args = (spec, ["p", "q"], ["7", "x"], ["7", "8"])
    if workers:
        with rewards.RewardPool(workers) as pool:
            values, stats = rewards.score_batch(*args, timeout_s=30.0, pool=pool, examples=examples)
    else:
        values, stats = rewards.score_batch(*args, timeout_s=None, examples=examples)
    assert stats["num_errors"] == 0, stats["messages"]
    np.testing.assert_allclose(values, [10.25 + 2 * 2.0, 0.5])
    # Without the fields a reward that needs one fails like any verifier error: counted.
    _, stats = rewards.score_batch("test_difficulty", ["p"], ["c"], ["r"], timeout_s=None)
    assert stats["num_errors"] == 1 and "KeyError: 'difficulty'" in stats["messages"][0]


def test_a_reward_cannot_change_the_next_items_fields(field_rewards):
    def greedy(prompt, completion, reference, *, example):
        example["difficulty"] = 99
        return 0.0

    shared = {"difficulty": 1}
    rewards.score_batch(
        greedy, ["p"] * 2, ["c"] * 2, ["r"] * 2, timeout_s=None, examples=[shared] * 2
    )
    assert shared == {"difficulty": 1}


def test_bad_examples_are_named():
    with pytest.raises(ValueError, match="examples has 1 items but completions has 2"):
        rewards.score_batch("math", ["p"] * 2, ["c"] * 2, ["r"] * 2, timeout_s=None, examples=[{}])
    with pytest.raises(TypeError, match=r"examples\[0\] must be a dict or None, got str"):
        rewards.score_batch("math", ["p"], ["c"], ["r"], timeout_s=None, examples=["x"])


def test_a_jsonl_lines_fields_reach_the_scorer_through_the_pipeline(tmp_path, field_rewards):
    """JSONL file -> TFDS records -> prompt batch (`example`) -> the rollout's Scorer, as the
    rollout stage calls it (G responses per prompt)."""
    rows = [
        {"prompt": f"What is {i} + 1?", "answer": i + 1, "difficulty": i / 10, "tests": [i]}
        for i in range(6)
    ]
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = data.jsonl_config(tmp_path / "train.jsonl", tmp_path / "test.jsonl")
    source = data.build_dataset("jsonl", config, data_dir=tmp_path / "tfds")["train"]
    tokenizer = data.make_char_tokenizer(tmp_path / "tok")
    prepared = data.prepare_prompts(
        source, tokenizer, prompt_length=128, shard_index=0, shard_count=1
    )
    batch = next(prepared.iterator(3, seed=1))
    g = 2
    scorer = Scorer(rewards.build_reward("test_difficulty"), "zero")
    completions = ["no"] * 3 * g
    texts, refs = np.repeat(batch["prompt_text"], g), np.repeat(batch["reference"], g)
    values, _, stats = scorer.score(texts, completions, refs, lambda: examples_of(batch, g))
    want = [json.loads(e)["difficulty"] for e in batch["example"] for _ in range(g)]
    assert stats["num_errors"] == 0 and values.tolist() == pytest.approx(want)
    # The fields are the line's own, keys as written.
    first = json.loads(batch["example"][0])
    assert set(first) == {"prompt", "answer", "difficulty", "tests"}
    # A reward that does not ask never has the fields read.
    plain = Scorer(rewards.build_reward("math"), "zero")

    def unread():
        raise AssertionError("examples read for a reward that does not ask for them")

    plain.score(texts, completions, refs, unread)
