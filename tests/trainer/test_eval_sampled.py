"""pass@k / maj@k held-out evaluation (trainer/evaluation.py, rewards/voting.py): the
estimator against enumeration, the vote on hand-made answers, the per-batch sums on a fake
sampler. The end-to-end run that writes the keys is in tests/trainer/test_wandb.py (one tiny run
serves both)."""

import itertools
import math
import types

import numpy as np
import pytest

from gspo_jax.rewards import build_reward, voting
from gspo_jax.rollout import stage as rollout
from gspo_jax.trainer import evaluation


def _enumerated_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of the k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 4, 5, 8])
def test_pass_at_k_equals_enumeration_over_subsets(n):
    for k in range(1, n + 1):
        c_P = np.arange(n + 1)
        want = [_enumerated_pass_at_k(n, c, k) for c in c_P]
        np.testing.assert_allclose(evaluation.pass_at_k(n, c_P, k), want, rtol=0, atol=1e-12)


def test_pass_at_k_is_stable_where_binomials_overflow_floats():
    # C(2000, 1000) ~ 1e600 overflows float64; the product form does not.
    n, k = 2000, 1000
    c_P = np.array([0, 1, 3, 999, 1000, 1001, 2000])
    exact = [1 - math.comb(n - c, k) / math.comb(n, k) for c in c_P]  # Python ints: exact
    np.testing.assert_allclose(evaluation.pass_at_k(n, c_P, k), exact, rtol=1e-12, atol=1e-12)
    # pass@1 is the fraction correct.
    np.testing.assert_allclose(evaluation.pass_at_k(n, c_P, 1), c_P / n, rtol=1e-12)


def test_pass_at_k_rejects_impossible_inputs():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        evaluation.pass_at_k(4, [1], 5)
    with pytest.raises(ValueError, match=r"\[0, n=4\]"):
        evaluation.pass_at_k(4, [5], 2)


def test_answer_keys_follow_each_reward_extraction():
    math_key = voting.answer_key_fn("math")
    # One value however it is written; a marker beats the last number; words are no answer.
    assert math_key("#### 0.5") == math_key("so \\boxed{\\frac{1}{2}}") == math_key("it is 1/2")
    assert math_key("3 apples, #### 7") == math_key("7")
    assert math_key("no idea") is None
    assert math_key("#### x^2 + 1") == math_key("#### x^2+1") == ("text", "x^2+1")
    strict = voting.answer_key_fn("math_strict:1.0,format:0.1")  # the first term's
    assert strict("it is 7") is None and strict("#### 7") == math_key("7")
    arith = voting.answer_key_fn("arith_exact")
    assert arith("42") == arith("#### 42.0") and arith("12 + 30 = 42") is None
    with pytest.raises(ValueError, match="'format' has no registered answer"):
        voting.answer_key_fn("format")


@pytest.mark.parametrize(
    "keys, winner",
    [
        (["a", "b", "b"], 1),  # plain majority: the first completion that gave it
        (["a", "b", "b", "a"], 0),  # a 2-2 tie: the answer given first wins
        (["b", "a", "a", "b"], 0),
        ([None, None, "c", "d", "d"], 3),  # no-answer completions do not vote
        ([None, None, None, "c"], 3),  # one answer among none beats three non-votes
        ([None, None], None),  # nobody answered: no winner
        ([], None),
    ],
)
def test_majority_vote(keys, winner):
    assert voting.majority_vote(keys) == winner


class _CharTokenizer:
    """Token id = the character's code point (enough for decode_responses)."""

    def batch_decode(self, rows, skip_special_tokens=True):
        return ["".join(map(chr, row)) for row in rows]


def _sample_output(texts, width=8):
    tokens = np.zeros((len(texts), width), np.int32)
    mask = np.zeros((len(texts), width), np.int32)
    for i, text in enumerate(texts):
        tokens[i, : len(text)] = [ord(ch) for ch in text]
        mask[i, : len(text)] = 1
    return types.SimpleNamespace(tokens=tokens, mask=mask)


def test_sampled_sums_by_hand():
    """3 prompts x k=4 samples of arithmetic answers, scored by arith_exact; the third
    prompt is padding (valid 0) and must not count."""
    completions = [
        # prompt 0, reference 5: one correct sample; the majority (7, 7) is wrong
        *["#### 7", "#### 5", "#### 7", "hm"],
        # prompt 1, reference 9: 9, 8 tie at 2 each -> 9 (given first) wins; 2 of 4 correct
        *["9", "8", "8", "9"],
        # prompt 2 (padding): all correct, must not count
        *["1", "1", "1", "1"],
    ]
    batch = {"prompt_text": np.array(["p0", "p1", "p2"]), "reference": np.array(["5", "9", "1"])}
    valid = np.array([True, True, False])
    scorer = rollout.Scorer(build_reward("arith_exact"), "zero")
    got = evaluation._sampled_sums(
        _sample_output(completions),
        batch,
        valid,
        4,
        _CharTokenizer(),
        scorer,
        voting.answer_key_fn("arith_exact"),
    )
    # pass@j with c correct of 4: c=1 -> j/4; c=2 -> 1 - C(2,j)/C(4,j) = 1/2, 5/6, 1, 1.
    want_pass = np.array([1 / 4 + 1 / 2, 2 / 4 + 5 / 6, 3 / 4 + 1, 1 + 1])
    np.testing.assert_allclose(got[:4], want_pass, rtol=1e-12)
    assert got[4] == 0 + 1  # maj@4: prompt 0 wrong, prompt 1 right
    assert got[5] == (6 + 6 + 6 + 2) + (1 + 1 + 1 + 1)  # response tokens of valid prompts


def test_eval_stream_is_not_a_rollout_key():
    """The evaluation's samples never reuse a training step's key (rollout: fold_in(PRNGKey
    (seed), step)) and depend on the seed."""
    import jax

    key = np.asarray(evaluation.eval_stream_key(0))
    for step in range(4):
        assert not np.array_equal(key, jax.random.fold_in(jax.random.PRNGKey(0), step))
    assert not np.array_equal(key, np.asarray(evaluation.eval_stream_key(1)))
