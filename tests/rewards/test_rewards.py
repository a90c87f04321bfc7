"""Specification of gspo_jax.rewards: answer extraction and exact equivalence, the math,
format and arithmetic verifiers, the registry and spec parser, and robust batch scoring
(errors, non-finite and non-numeric values, hangs killed by timeout, worker crashes,
pool recovery and clean shutdown).

Deliberately broken verifiers come from `gspo_jax.rewards.testing` (test-only): worker
processes import the registering module by name, which a module under tests/ would not
reliably be.
"""

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
from fractions import Fraction

import numpy as np
import pytest

import gspo_jax.rewards.testing  # noqa: F401  (registers test_chaos and friends)
from gspo_jax import rewards
from gspo_jax.rewards import answers, items, registry

math_fn = rewards.get_reward_fn("math")
math_strict_fn = rewards.get_reward_fn("math_strict")
format_fn = rewards.get_reward_fn("format")
boxed_format_fn = rewards.get_reward_fn("boxed_format")
arith_fn = rewards.get_reward_fn("arith_exact")
digits_fn = rewards.get_reward_fn("arith_digits")

GSM8K_REFERENCE = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n"
    "#### 72"
)


# ----------------------------------------------------------------- numbers and equivalence

EQUIVALENT = [
    ("1,000", "1000"),
    ("1,000,000", "1000000"),
    ("\\frac{1}{2}", "0.5"),
    ("\\dfrac{1}{2}", "1/2"),
    ("\\tfrac12", "0.5"),
    ("\\dfrac34", "0.75"),
    ("- 3", "-3"),
    ("−3", "-3"),  # Unicode minus
    ("+7", "7"),
    ("3.0", "3"),
    ("3.", "3"),
    ("0.50", "1/2"),
    (".5", "1/2"),
    ("$1,000", "1000"),
    ("\\$5", "5"),
    ("-$5", "-5"),
    ("50%", "50"),
    ("50\\%", "50"),
    ("-\\frac{3}{4}", "-0.75"),
    ("\\frac{-3}{4}", "-3/4"),
    ("\\frac{1.5}{3}", "0.5"),
    ("$\\frac{6}{8}$", "3/4"),
    ("$\\frac{1}{3}$.", "2/6"),
    ("\\(12\\)", "12"),
    ("1{,}234", "1234"),
    ("1\\,234", "1234"),
    ("12,345.50", "12345.5"),
    ("1.5e3", "1500"),
    ("007", "7"),
    ("90^\\circ", "90"),
    ("{42}", "42"),
    ("x = 5", "5"),
    ("42 apples", "42"),
    ("18 \\text{ dollars}", "18"),
    ("x^2 + 1", "x^2+1"),  # non-numeric: textual normalisation
    ("\\left( 1, 2 \\right)", "(1,2)"),
    ("\\text{Monday}", "Monday"),
]

NOT_EQUIVALENT = [
    ("12", "120"),
    ("-3", "3"),
    ("1/2", "2"),
    ("0.333", "1/3"),  # exact rationals, no tolerance
    ("1,0000", "10000"),  # not a valid thousands grouping
    ("12,5", "12.5"),  # decimal comma is not supported
    ("5 or 6", "5"),
    ("3 + 4", "7"),
    ("1/0", "0"),
    ("50%", "0.5"),  # percent is units-free, not a scale
    ("x^2", "x^3"),
    ("5", "x"),
    ("1e999999999", "1"),  # exponent too long: not parsed (and must not hang)
]


@pytest.mark.parametrize(("a", "b"), EQUIVALENT)
def test_answers_match_equivalent_both_directions(a, b):
    assert answers.answers_match(a, b)
    assert answers.answers_match(b, a)


@pytest.mark.parametrize(("a", "b"), NOT_EQUIVALENT)
def test_answers_match_not_equivalent_both_directions(a, b):
    assert not answers.answers_match(a, b)
    assert not answers.answers_match(b, a)


def test_parse_number_exact_values():
    assert answers.parse_number("1,234.5") == Fraction(2469, 2)
    assert answers.parse_number("-\\frac{2}{6}") == Fraction(-1, 3)
    assert answers.parse_number("1.5e-3") == Fraction(3, 2000)
    assert answers.parse_number("0.1") == Fraction(1, 10)  # not the float 0.1000000000000000055
    for text in (
        "",
        "abc",
        "1,2",
        "1..2",
        "--3",
        "\\frac{1}{0}",
        "3 4",
        "1" * 300,
        "1 000",
        "4 2",
        "3 .5",
    ):
        assert answers.parse_number(text) is None, text


def test_answers_match_float_fallback_only_when_asked():
    assert not answers.answers_match("0.333", "1/3")
    assert answers.answers_match("0.333", "1/3", rel_tol=1e-2)
    assert not answers.answers_match("0.3", "1/3", rel_tol=1e-2)
    assert not answers.answers_match(None, "1")


def test_pathological_inputs_are_fast():
    # Long digit runs, a huge exponent and a huge completion: linear-time regexes and
    # the length cap keep each call well under the per-item timeout.
    start = time.perf_counter()
    assert math_fn("", "9" * 100_000, "9") == 0.0
    assert math_fn("", "#### 1e999999999", "1") == 0.0
    assert math_fn("", "a " * 200_000 + "#### 3", "3") == 1.0
    assert math_fn("", "\\boxed{" * 5_000, "3") == 0.0
    assert time.perf_counter() - start < 5.0


# --------------------------------------------------------------------- answer extraction


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("step 1... so 2+2=4\n#### 4", "4"),
        ("#### 1,000", "1,000"),
        ("#### 72 apples\n", "72 apples"),
        ("the answer:\n####\n42\nbye", "42"),  # marker ends its line: next non-empty line
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\boxed{5}}", "5"),  # nested: the box that only wraps a box is unwrapped
        ("first \\boxed{3}, no wait: \\boxed{4}.", "4"),  # last top-level box
        ("\\boxed{2 + \\boxed{3}}", "2 + \\boxed{3}"),  # a nested box is not top-level
        ("\\boxed{3}\n#### 4", "4"),  # the marker that starts last wins
        ("#### 4\nor rather $\\boxed{3}$", "3"),
        ("\\fbox{7}", "7"),
        ("\\boxed 9 is it", "9"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces do not count
        ("I computed 42.\n#### ", None),  # a marker with nothing after: no fallback
        ("so \\boxed{42", None),  # unbalanced last box
        ("\\boxed{}", None),
        ("The answer is $1,234.56!", "$1,234.56"),  # last-number fallback
        ("We get 3/4 of 12, which is 9.", "9"),
        ("The result is - 7", "- 7"),
        ("x2 and y3", None),  # digits inside words are not numbers
        ("no digits here", None),
    ],
)
def test_extract_answer(completion, expected):
    assert answers.extract_answer(completion) == expected


def test_extract_answer_fallback_switch():
    assert answers.extract_answer("The answer is 42.", fallback=None) is None
    assert answers.extract_answer("#### 42", fallback=None) == "42"
    with pytest.raises(ValueError, match="fallback"):
        answers.extract_answer("42", fallback="first_number")


def test_extract_reference_answer():
    assert answers.extract_reference_answer(GSM8K_REFERENCE) == "72"
    assert answers.extract_reference_answer("  42 \n") == "42"
    assert answers.extract_reference_answer("so it is $\\boxed{\\frac{3}{4}}$.") == "\\frac{3}{4}"
    for bad in ("", "   ", "text\n#### ", "\\boxed{}"):
        with pytest.raises(ValueError, match="reference has no answer"):
            answers.extract_reference_answer(bad)


# ------------------------------------------------------------------------- math verifier


@pytest.mark.parametrize(
    ("completion", "reference", "expected"),
    [
        ("#### 1,000", "1000", 1.0),
        ("#### 1000", "1,000", 1.0),
        ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("so \\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("#### - 3", "-3", 1.0),
        ("#### 3", "-3", 0.0),
        ("#### 3.0", "3", 1.0),
        ("#### 12", "120", 0.0),
        ("#### 120", "12", 0.0),
        ("\\boxed{\\boxed{5}}", "5", 1.0),
        ("\\boxed{3} ... \\boxed{4}", "4", 1.0),
        ("\\boxed{3} ... \\boxed{4}", "3", 0.0),
        ("#### 72", GSM8K_REFERENCE, 1.0),
        ("#### 24", GSM8K_REFERENCE, 0.0),  # an intermediate value of the solution
        ("48+24 = 72 clips", GSM8K_REFERENCE, 1.0),  # fallback: last number
        ("72 clips, not 24", GSM8K_REFERENCE, 0.0),
        ("I don't know", "5", 0.0),  # no answer at all
        ("5 is it\n####", "5", 0.0),  # empty marker: no fallback
        ("#### $18.", "18", 1.0),
        ("\\boxed{x^2+1}", "x^2 + 1", 1.0),
    ],
)
def test_math_reward(completion, reference, expected):
    assert math_fn("prompt", completion, reference) == expected


def test_math_strict_has_no_fallback():
    assert math_fn("", "The answer is 42", "42") == 1.0
    assert math_strict_fn("", "The answer is 42", "42") == 0.0
    assert math_strict_fn("", "The answer is \\boxed{42}", "42") == 1.0


def test_math_reward_raises_on_bad_reference():
    with pytest.raises(ValueError, match="reference has no answer"):
        math_fn("", "#### 1", "solution without answer\n####")


# -------------------------------------------------------------------------- format rewards


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("work\n#### 42", 1.0),
        ("#### 42\n\n", 1.0),
        ("#### 42.", 1.0),
        ("#### -1,000", 1.0),
        ("#### 3/4", 1.0),
        ("#### 42\nmore text", 0.0),  # the answer line must end the completion
        ("#### 4\n#### 5", 0.0),  # exactly one marker
        ("the answer is 42", 0.0),
        ("#### forty-two", 0.0),
        ("#### 42 apples", 0.0),  # a bare number only
        ("####", 0.0),
    ],
)
def test_format_reward(completion, expected):
    assert format_fn("", completion, "ignored") == expected


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("so \\boxed{42}.", 1.0),
        ("\\boxed{x^2 + \\frac{1}{2}}", 1.0),  # content need not be numeric
        ("\\boxed{\\boxed{1}}", 1.0),  # one top-level box
        ("\\boxed{1} or \\boxed{2}", 0.0),
        ("\\boxed{ }", 0.0),
        ("\\boxed{42", 0.0),
        ("\\boxed 42", 0.0),  # no braces
        ("#### 42", 0.0),
    ],
)
def test_boxed_format_reward(completion, expected):
    assert boxed_format_fn("", completion, "ignored") == expected


# ------------------------------------------------------------------------ arithmetic task


@pytest.mark.parametrize(
    ("completion", "reference", "expected"),
    [
        ("1234", "1234", 1.0),
        (" 1234\n", "1234", 1.0),
        ("1234.", "1234", 1.0),
        ("#### 1234", "1234", 1.0),
        ("\\boxed{1234}", "1234", 1.0),
        ("1,234", "1234", 1.0),
        ("1234.0", "1234", 1.0),
        ("01234", "1234", 1.0),
        ("-56", "-56", 1.0),
        ("- 56", "-56", 1.0),
        ("56", "-56", 0.0),
        ("1235", "1234", 0.0),
        ("-1234", "1234", 0.0),
        ("1234 apples", "1234", 0.0),
        ("12 34", "1234", 0.0),
        ("12 + 1222 = 1234", "1234", 0.0),  # no last-number fallback
        ("The answer is 1234", "1234", 0.0),
        ("#### 1234", "the sum\n#### 1234", 1.0),  # GSM8K-style reference
        ("", "1234", 0.0),
        ("#### ", "1234", 0.0),
    ],
)
def test_arith_exact(completion, reference, expected):
    assert arith_fn("What is 1200 + 34?", completion, reference) == expected


@pytest.mark.parametrize("reference", ["1.5", "abc", "", "1/2"])
def test_arith_exact_rejects_non_integer_reference(reference):
    with pytest.raises(ValueError, match="reference"):
        arith_fn("", "1", reference)


@pytest.mark.parametrize(
    ("completion", "expected"),
    [("1234", 1.0), ("1284", 0.75), ("234", 0.75), ("12345", 0.0), ("4321", 0.0)]
    + [("-1234", 0.0), ("abc", 0.0), ("1234.5", 0.0), ("#### 1204", 0.75)],
)
def test_arith_digits(completion, expected):
    assert digits_fn("", completion, "1234") == expected


def test_arith_digits_is_one_exactly_when_exact():
    rng = np.random.default_rng(0)
    for _ in range(200):
        ref = int(rng.integers(-999, 1000))
        guess = ref + int(rng.integers(-3, 4)) * int(rng.choice([1, 10, 100]))
        exact = arith_fn("", str(guess), str(ref))
        assert (digits_fn("", str(guess), str(ref)) == 1.0) == (exact == 1.0)


# ------------------------------------------------------------------------------- registry


@pytest.fixture
def temp_names():
    """Names registered by a test, removed afterwards (the registry is global)."""
    names = []
    yield names
    for name in names:
        registry.REWARDS.remove(name)


def test_builtin_rewards_registered():
    assert {"math", "math_strict", "format", "boxed_format", "arith_exact", "arith_digits"} <= set(
        rewards.list_rewards()
    )


def test_get_reward_fn_unknown_lists_names():
    with pytest.raises(ValueError, match="unknown reward 'nope'") as info:
        rewards.get_reward_fn("nope")
    assert "arith_exact" in str(info.value) and "math" in str(info.value)


def test_register_reward_rules(temp_names):
    temp_names.append("tmp_reward")

    @rewards.register_reward("tmp_reward")
    def tmp(prompt, completion, reference):
        return 0.5

    assert rewards.get_reward_fn("tmp_reward") is tmp
    rewards.register_reward("tmp_reward")(tmp)  # the same function again: fine

    def other(prompt, completion, reference):
        return 1.0

    with pytest.raises(ValueError, match="already registered"):
        rewards.register_reward("tmp_reward")(other)
    for bad_name in ("a:b", "a,b", "", "1abc", None):
        with pytest.raises(ValueError, match="reward name"):
            rewards.register_reward(bad_name)


def test_build_reward_weighted_sum():
    reward = rewards.build_reward(" math:1.0 , format:0.1 ")
    assert reward.names == ("math", "format")
    assert reward.weights == (1.0, 0.1)
    assert reward.spec == "math:1.0,format:0.1"
    assert reward("", "#### 42", "42") == pytest.approx(1.1)  # correct and well-formed
    assert reward("", "so 42", "42") == pytest.approx(1.0)  # correct, no marker
    assert reward("", "#### 41", "42") == pytest.approx(0.1)  # well-formed, wrong
    assert reward("", "nothing", "42") == 0.0
    single = rewards.build_reward("math")
    assert single.names == ("math",) and single.weights == (1.0,)
    assert rewards.build_reward("math:-0.5")("", "#### 1", "1") == -0.5


@pytest.mark.parametrize(
    ("spec", "pattern"),
    [
        ("math:abc", r"bad weight 'abc' in term 'math:abc'"),
        ("math,,format", "empty term"),
        ("math,", "empty term"),
        ("nope:1.0", r"unknown reward 'nope' in term 'nope:1.0'.*registered rewards: .*math"),
        ("math:1,math:2", "appears twice"),
        (":1.0", "no reward name"),
        ("math:inf", "must be finite"),
        ("", "non-empty string"),
        (None, "non-empty string"),
    ],
)
def test_build_reward_errors_name_the_bad_part(spec, pattern):
    with pytest.raises(ValueError, match=pattern):
        rewards.build_reward(spec)


def test_reward_pickles_by_name():
    reward = rewards.build_reward("math:1.0,format:0.1")
    payload = pickle.dumps(reward)
    assert b"_rebuild_reward" in payload and b"math:1.0,format:0.1" in payload
    clone = pickle.loads(payload)
    assert clone == reward and clone.fns == reward.fns
    assert clone("", "#### 42", "42") == reward("", "#### 42", "42")


# -------------------------------------------------------------------------- batch scoring

# (completion for test_chaos, expected reward, expected status)
CHAOS = [
    ("ok:1", 1.0, rewards.STATUS_OK),
    ("raise", 0.0, rewards.STATUS_ERROR),
    ("nan", 0.0, rewards.STATUS_NONFINITE),
    ("str", 0.0, rewards.STATUS_NONNUMERIC),
    ("ok:2.5", 2.5, rewards.STATUS_OK),
    ("inf", 0.0, rewards.STATUS_NONFINITE),
    ("none", 0.0, rewards.STATUS_NONNUMERIC),
    ("huge", 0.0, rewards.STATUS_NONFINITE),
    ("ok:-3", -3.0, rewards.STATUS_OK),
    ("sysexit", 0.0, rewards.STATUS_ERROR),
]
HANGS = [
    ("sleep", 0.0, rewards.STATUS_TIMEOUT),
    ("spin", 0.0, rewards.STATUS_TIMEOUT),
    ("regex", 0.0, rewards.STATUS_TIMEOUT),
    ("exit", 0.0, rewards.STATUS_ERROR),  # the worker process dies
]


def _check_chaos(cases, rewards_B, stats):
    expected_rewards = np.array([c[1] for c in cases], np.float32)
    expected_status = np.array([c[2] for c in cases], np.int8)
    assert rewards_B.dtype == np.float32 and rewards_B.shape == (len(cases),)
    np.testing.assert_array_equal(rewards_B, expected_rewards)
    np.testing.assert_array_equal(stats["status_B"], expected_status)
    for code, count_key, flag_key in [
        (rewards.STATUS_ERROR, "num_errors", "error_B"),
        (rewards.STATUS_TIMEOUT, "num_timeouts", "timeout_B"),
        (rewards.STATUS_NONFINITE, "num_nonfinite", "nonfinite_B"),
        (rewards.STATUS_NONNUMERIC, "num_nonnumeric", "nonnumeric_B"),
    ]:
        assert stats[count_key] == int((expected_status == code).sum()), count_key
        np.testing.assert_array_equal(stats[flag_key], expected_status == code)
    np.testing.assert_array_equal(stats["ok_B"], expected_status == rewards.STATUS_OK)
    assert stats["num_failed"] == int((expected_status != rewards.STATUS_OK).sum())
    assert set(stats["messages"]) == set(np.flatnonzero(expected_status != 0).tolist())


def _batch(cases):
    completions = [c[0] for c in cases]
    return [f"prompt {i}" for i in range(len(cases))], completions, ["ref"] * len(cases)


def test_score_batch_in_process_counts_each_failure_kind():
    rewards_B, stats = rewards.score_batch("test_chaos", *_batch(CHAOS), timeout_s=None)
    _check_chaos(CHAOS, rewards_B, stats)
    assert stats["num_worker_restarts"] == 0
    assert "deliberate failure" in stats["messages"][1]
    np.testing.assert_array_equal(stats["terms"]["test_chaos"], rewards_B)


def test_score_batch_in_process_accepts_any_callable_and_fail_value():
    def half(prompt, completion, reference):
        return 0.5 if completion else float("nan")

    rewards_B, stats = rewards.score_batch(
        half, ["p", "p"], ["x", ""], ["r", "r"], timeout_s=None, fail_value=-1.0
    )
    np.testing.assert_array_equal(rewards_B, [0.5, -1.0])
    assert stats["num_nonfinite"] == 1 and stats["terms"]["reward"][1] == 0.0


def test_score_batch_input_errors():
    with pytest.raises(ValueError, match="prompts has 1 items but completions has 2"):
        rewards.score_batch("math", ["p"], ["a", "b"], ["1", "2"], timeout_s=None)
    with pytest.raises(TypeError, match=r"completions\[1\] must be a str"):
        rewards.score_batch("math", ["p", "p"], ["a", None], ["1", "2"], timeout_s=None)
    with pytest.raises(ValueError, match="cannot enforce timeout_s"):
        rewards.score_batch("math", ["p"], ["a"], ["1"], timeout_s=1.0, use_processes=False)
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        rewards.score_batch("math", ["p"], ["a"], ["1"], timeout_s=0.0)
    with pytest.raises(ValueError, match="unknown reward"):
        rewards.score_batch("nope", ["p"], ["a"], ["1"], timeout_s=None)
    with pytest.raises(TypeError, match="not registered"):
        rewards.score_batch(lambda p, c, r: 1.0, ["p"], ["a"], ["1"], timeout_s=1.0)


def test_score_batch_empty():
    rewards_B, stats = rewards.score_batch("math", [], [], [], timeout_s=None)
    assert rewards_B.shape == (0,) and stats["num_items"] == 0 and stats["num_failed"] == 0


def test_summarize_is_flat_scalars():
    _, stats = rewards.score_batch(
        "math:1.0,format:0.1", ["p"] * 3, ["#### 1", "1", "raise?"], ["1"] * 3, timeout_s=None
    )
    metrics = rewards.summarize(stats)
    assert metrics["reward/math/mean"] == pytest.approx(2 / 3)
    assert metrics["reward/format/mean"] == pytest.approx(1 / 3)
    assert metrics["reward/num_failed"] == 0.0
    assert all(isinstance(v, float) for v in metrics.values())


@pytest.fixture(scope="module")
def pool():
    with rewards.RewardPool(num_workers=2) as p:
        yield p


def test_pool_parity_with_in_process(pool):
    completions = ["#### 42", "so 42", "#### 41", "\\boxed{\\frac{1}{2}}", "nothing"] * 7
    references = ["42", "42", "42", "0.5", "3"] * 7
    prompts = ["q"] * len(completions)
    spec = "math:1.0,format:0.1"
    r_in, s_in = rewards.score_batch(spec, prompts, completions, references, timeout_s=None)
    r_pool, s_pool = rewards.score_batch(
        spec, prompts, completions, references, timeout_s=5.0, pool=pool
    )
    np.testing.assert_array_equal(r_pool, r_in)
    np.testing.assert_allclose(r_pool[:5], [1.1, 1.0, 0.1, 1.0, 0.0], rtol=1e-6)
    for name in ("math", "format"):
        np.testing.assert_array_equal(s_pool["terms"][name], s_in["terms"][name])
    assert s_pool["num_failed"] == 0 and s_pool["num_worker_restarts"] == 0


def _pid_gone(pid: int) -> bool:
    """The process has exited: no such pid, or a zombie waiting for its (new) parent."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_pool_kills_hangs_and_recovers(pool):
    cases = CHAOS[:3] + HANGS[:1] + CHAOS[3:6] + HANGS[1:] + CHAOS[6:]
    # Workers start lazily: score one batch first so that there are workers to replace,
    # whichever test ran on this module's pool before (pytest-xdist decides the order).
    rewards.score_batch("test_chaos", *_batch(CHAOS[:2]), timeout_s=5.0, pool=pool)
    pids_before = set(pool.worker_pids())
    assert len(pids_before) == 2
    start = time.perf_counter()
    rewards_B, stats = rewards.score_batch("test_chaos", *_batch(cases), timeout_s=0.5, pool=pool)
    elapsed = time.perf_counter() - start
    _check_chaos(cases, rewards_B, stats)
    assert stats["num_timeouts"] == 3 and stats["num_worker_restarts"] == 4
    assert "timed out after 0.5 s" in stats["messages"][3]
    assert "exit code 3" in stats["messages"][cases.index(HANGS[3])]
    # Three 0.5 s hangs on two workers, plus replacements starting in the background.
    assert elapsed < 10.0
    # The hung workers were really killed (and reaped), not abandoned.
    replaced = pids_before - set(pool.worker_pids())
    assert replaced and all(_pid_gone(pid) for pid in replaced)

    # The next batch runs on the replacement workers without failures or restarts.
    cases = [(f"ok:{i}", float(i), rewards.STATUS_OK) for i in range(20)]
    start = time.perf_counter()
    rewards_B, stats = rewards.score_batch("test_chaos", *_batch(cases), timeout_s=0.5, pool=pool)
    _check_chaos(cases, rewards_B, stats)
    assert stats["num_worker_restarts"] == 0
    assert time.perf_counter() - start < 5.0


def test_pool_term_failure_is_named(pool):
    rewards_B, stats = rewards.score_batch(
        "math:1.0,test_chaos:0.5", ["p", "p"], ["nan", "ok:2"], ["3", "3"], timeout_s=5.0, pool=pool
    )
    np.testing.assert_array_equal(rewards_B, [0.0, 1.0])  # 1.0 * 0 (math) + 0.5 * 2
    np.testing.assert_array_equal(stats["status_B"], [rewards.STATUS_NONFINITE, 0])
    assert "'test_chaos'" in stats["messages"][0]


def test_pool_rejects_unimportable_rewards(pool, temp_names):
    def in_main(prompt, completion, reference):
        return 1.0

    in_main.__module__ = "__main__"
    temp_names.append("tmp_in_main")
    rewards.register_reward("tmp_in_main")(in_main)
    with pytest.raises(ValueError, match="registered in __main__"):
        rewards.score_batch("tmp_in_main", ["p"], ["c"], ["r"], timeout_s=1.0, pool=pool)

    def elsewhere(prompt, completion, reference):
        return 1.0

    elsewhere.__module__ = "no_such_module_for_gspo_tests"
    temp_names.append("tmp_elsewhere")
    rewards.register_reward("tmp_elsewhere")(elsewhere)
    with pytest.raises(RuntimeError, match="could not build reward 'tmp_elsewhere:1.0'"):
        rewards.score_batch("tmp_elsewhere", ["p"], ["c"], ["r"], timeout_s=5.0, pool=pool)
    # The pool dropped its workers and starts fresh ones for the next batch.
    rewards_B, _ = rewards.score_batch("math", ["p"], ["#### 2"], ["2"], timeout_s=5.0, pool=pool)
    np.testing.assert_array_equal(rewards_B, [1.0])


def test_closed_pool_refuses_work():
    with rewards.RewardPool(num_workers=1) as p:
        pass
    assert p.closed
    with pytest.raises(RuntimeError, match="closed"):
        rewards.score_batch("math", ["p"], ["1"], ["1"], timeout_s=1.0, pool=p)


def _run_script(code: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )


def test_default_pool_shuts_down_at_interpreter_exit():
    # No close() call and no __main__ guard: the atexit hook must stop the workers
    # (one of which was just replaced after a hang) and the interpreter must exit.
    code = """
        import gspo_jax.rewards.testing
        from gspo_jax import rewards
        r, s = rewards.score_batch("test_chaos", ["p"] * 3, ["ok:1", "spin", "ok:2"],
                                   ["r"] * 3, timeout_s=0.3, num_workers=2)
        assert list(r) == [1.0, 0.0, 2.0] and s["num_timeouts"] == 1, (r, s)
        print(*rewards.get_default_pool(2).worker_pids())
    """
    start = time.perf_counter()
    result = _run_script(code, timeout=30)
    assert result.returncode == 0, result.stderr
    assert time.perf_counter() - start < 15.0
    pids = [int(p) for p in result.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 5.0
    while not all(_pid_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_pid_gone(p) for p in pids)


def test_workers_exit_when_parent_is_killed():
    # The parent dies by SIGKILL (no atexit) while a worker sleeps in a verifier: the
    # worker's parent watchdog ends it within about a second.
    code = """
        import os, signal, threading, time
        import gspo_jax.rewards.testing
        from gspo_jax import rewards
        pool = rewards.RewardPool(1)
        rewards.score_batch("test_chaos", ["p"], ["ok:1"], ["r"], timeout_s=5.0, pool=pool)
        print(*pool.worker_pids(), flush=True)
        threading.Thread(target=rewards.score_batch, daemon=True, args=(
            "test_chaos", ["p"], ["sleep"], ["r"]), kwargs={"timeout_s": 100.0, "pool": pool}
        ).start()
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    """
    result = _run_script(code, timeout=30)
    assert result.returncode == -signal.SIGKILL, result.stderr
    pids = [int(p) for p in result.stdout.split()]
    assert len(pids) == 1
    deadline = time.monotonic() + 5.0
    while not _pid_gone(pids[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _pid_gone(pids[0])


def test_a_signal_to_the_process_group_does_not_fail_the_item_in_flight():
    """SIGTERM (a preemption, `tpu_pod.sh stop`) and SIGINT reach the whole process group.
    The trainer finishes the step in flight and checkpoints it (preemption.py); a worker
    that died of the same signal used to score its item as an error in that step."""
    with rewards.RewardPool(num_workers=1) as pool:
        rewards.score_batch("test_chaos", ["p"], ["ok:1"], ["r"], timeout_s=30.0, pool=pool)
        (pid,) = pool.worker_pids()
        result = {}

        def score():
            result["out"] = rewards.score_batch(
                "test_chaos", ["p"] * 2, ["nap", "ok:2"], ["r"] * 2, timeout_s=30.0, pool=pool
            )

        thread = threading.Thread(target=score)
        thread.start()
        time.sleep(0.3)  # the worker is inside the 1 s verifier
        # A dropped SSH connection (SIGHUP) and a batch system's warning (SIGUSR1) too.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
            os.kill(pid, sig)
        thread.join(timeout=30)
        rewards_B, stats = result["out"]
        np.testing.assert_array_equal(rewards_B, [1.0, 2.0])
        assert stats["num_failed"] == 0 and stats["num_worker_restarts"] == 0
        assert pool.worker_pids() == [pid] and not _pid_gone(pid)


def test_check_value_rules():
    assert items.check_value(1) == (rewards.STATUS_OK, 1.0, None)
    assert items.check_value(True)[:2] == (rewards.STATUS_OK, 1.0)
    assert items.check_value(np.float32(0.25))[:2] == (rewards.STATUS_OK, 0.25)
    assert items.check_value(Fraction(1, 4))[:2] == (rewards.STATUS_OK, 0.25)
    assert items.check_value("1.0")[0] == rewards.STATUS_NONNUMERIC
    assert items.check_value(np.array([1.0]))[0] == rewards.STATUS_NONNUMERIC
    assert items.check_value(float("-inf"))[0] == rewards.STATUS_NONFINITE
    assert items.check_value(10**400)[0] == rewards.STATUS_NONFINITE
