"""Rewards: verifiers (math answers, synthetic arithmetic, answer format), their registry,
and robust batch scoring (`items`: one call judged; `pool`: worker processes with
timeouts; `scoring`: `score_batch`).

Data flow: decoded completions (host) -> `score_batch(build_reward(config.reward), ...)`
-> rewards [B] + failure stats -> advantages. Importing this package registers the
built-in rewards: math, math_strict, format, boxed_format, arith_exact, arith_digits, and
the answers maj@k votes with (`voting`).
`gspo_jax.rewards.testing` (test-only, not imported here) adds deliberately broken ones.
"""

from gspo_jax.rewards import arith, math_rewards, voting  # noqa: F401  (registers the built-ins)
from gspo_jax.rewards.answers import (
    answer_value,
    answers_match,
    extract_answer,
    extract_reference_answer,
    parse_number,
)
from gspo_jax.rewards.items import (
    STATUS_ERROR,
    STATUS_NAMES,
    STATUS_NONFINITE,
    STATUS_NONNUMERIC,
    STATUS_OK,
    STATUS_TIMEOUT,
)
from gspo_jax.rewards.pool import RewardPool, get_default_pool, shutdown_default_pool
from gspo_jax.rewards.registry import (
    Reward,
    RewardFn,
    build_reward,
    get_reward_fn,
    list_rewards,
    register_reward,
)
from gspo_jax.rewards.scoring import RewardError, score_batch, summarize
from gspo_jax.rewards.voting import majority_vote, register_answer

__all__ = [
    "STATUS_ERROR",
    "STATUS_NAMES",
    "STATUS_NONFINITE",
    "STATUS_NONNUMERIC",
    "STATUS_OK",
    "STATUS_TIMEOUT",
    "Reward",
    "RewardError",
    "RewardFn",
    "RewardPool",
    "answer_value",
    "answers_match",
    "build_reward",
    "extract_answer",
    "extract_reference_answer",
    "get_default_pool",
    "get_reward_fn",
    "list_rewards",
    "majority_vote",
    "parse_number",
    "register_answer",
    "register_reward",
    "score_batch",
    "shutdown_default_pool",
    "summarize",
]
