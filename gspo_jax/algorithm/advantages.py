"""Advantages from rewards: reward normalisation and clipping, group (GRPO, Dr. GRPO's
mean-only baseline, RLOO) or REINFORCE estimators, whitening and advantage clipping.

Where it sits: after the verifiers score the B = N·G sampled responses (rewards [B], the G
responses of one prompt contiguous) and before `train_step`, which feeds the advantages to
`objectives.policy_loss`. Everything runs jitted on device (group statistics by reshaping
[B] -> [N, G], no loop over groups); `group_size` and the mode names are static Python values.

Shape letters: B responses, N prompts, G group size (B = N·G), T response tokens.

Statistics: std is the unbiased (ddof=1) estimate and every z-score divides by (std + eps),
eps = 1e-6. A set with fewer than two valid members has std := 0 (so its z-score is x − mean,
which is 0 for a single member). Means are computed relative to one of the set's own valid
values, so a set of identical values has mean equal to that value exactly and gets exactly zero
advantage, never NaN. Invalid entries (mask 0) are excluded from every statistic, may hold
garbage (NaN), and get advantage 0. Non-finite rewards at *valid* positions are not repaired
here (they would spread NaN loudly); the trainer masks and counts them.
"""

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from gspo_jax.registry import Registry

Array = jax.Array

EPS = 1e-6

# Names accepted by `reward_norm` (None = no reward normalisation).
REWARD_NORMS = (None, "batch", "group", "running")


@dataclasses.dataclass
class Estimator:
    """An advantage estimator's two forms (`adv_estimator` names one).

    sequence: fn(rewards_B, valid_B, *, group_size, eps) -> advantages_B
              (`compute_advantages`, one reward per response);
    token:    fn(rewards_BT, valid_BT, valid_B, *, group_size, gamma, eps) -> advantages_BT
              (`compute_token_advantages`, rewards per token), or None when it has none.
    """

    sequence: Callable[..., Array] | None = None
    token: Callable[..., Array] | None = None


# name -> Estimator (gspo_jax.registry); config validation reads the live names.
ADV_ESTIMATORS: Registry[Estimator] = Registry("adv_estimator")


def register_advantage_estimator(name: str, level: str = "sequence"):
    """Decorator adding the sequence-level (`compute_advantages`) or token-level
    (`compute_token_advantages`, for add_token_level_kl) form of estimator `name`; a form
    registered twice raises."""
    if level not in ("sequence", "token"):
        raise ValueError(f"level must be 'sequence' or 'token', got {level!r}")

    def decorator(fn):
        estimator = ADV_ESTIMATORS[name] if name in ADV_ESTIMATORS else Estimator()
        if getattr(estimator, level) is not None:
            raise ValueError(f"duplicate {level}-level advantage estimator {name!r}")
        setattr(estimator, level, fn)
        ADV_ESTIMATORS.add(name, estimator)
        return fn

    return decorator


# ---------------------------------------------------------------------------------------------
# Masked moments.
# ---------------------------------------------------------------------------------------------


def _masked_moments(x: Array, valid: Array, axis=None) -> tuple[Array, Array, Array]:
    """(count, mean, M2 = Σ (x − mean)²) over the valid entries, keepdims along `axis`.

    Shifted by one valid member (the max) so that identical values give mean == value exactly
    (and M2 == 0), and so that large offsets do not cost precision.
    """
    valid = valid.astype(bool)
    count = jnp.sum(valid.astype(jnp.float32), axis=axis, keepdims=True)
    ref = jnp.max(jnp.where(valid, x, -jnp.inf), axis=axis, keepdims=True)
    ref = jnp.where(count > 0, ref, 0.0)
    d = jnp.where(valid, x - ref, 0.0)
    mean_d = jnp.sum(d, axis=axis, keepdims=True) / jnp.maximum(count, 1.0)
    m2 = jnp.sum(jnp.where(valid, jnp.square(d - mean_d), 0.0), axis=axis, keepdims=True)
    return count, ref + mean_d, m2


def _unbiased_std(count: Array, m2: Array) -> Array:
    """sqrt(M2 / (n − 1)); 0 when n < 2 (a single member carries no spread)."""
    count = jnp.asarray(count, jnp.float32)
    return jnp.where(count > 1, jnp.sqrt(m2 / jnp.maximum(count - 1.0, 1.0)), 0.0)


def _normalise(x, mean, std, *, shift: bool, scale: bool, eps: float) -> Array:
    """(x − mean)/(std + eps); shift-only: x − mean; scale-only: x/(std + eps)."""
    if not (shift or scale):  # neither flag = full z-score
        shift = scale = True
    if shift:
        x = x - mean
    if scale:
        x = x / (std + eps)
    return x


def _zscore(x: Array, valid: Array, axis=None, *, eps: float) -> Array:
    count, mean, m2 = _masked_moments(x, valid, axis)
    return _normalise(x, mean, _unbiased_std(count, m2), shift=True, scale=True, eps=eps)


# ---------------------------------------------------------------------------------------------
# Running moments (reward_norm="running").
# ---------------------------------------------------------------------------------------------


class RunningMoments(NamedTuple):
    """Running (count, mean, M2) of every valid reward seen so far (Chan et al. parallel
    merge). A plain pytree of scalars: carried by the trainer and saved in checkpoints."""

    count: Array  # int32 []
    mean: Array  # float32 []
    m2: Array  # float32 [], Σ (x − mean)²


def init_running_moments() -> RunningMoments:
    """The empty state (count 0)."""
    return RunningMoments(
        count=jnp.zeros((), jnp.int32),
        mean=jnp.zeros((), jnp.float32),
        m2=jnp.zeros((), jnp.float32),
    )


def update_running_moments(running: RunningMoments, x: Array, valid: Array) -> RunningMoments:
    """Merges the valid entries of `x` into `running` (Chan's parallel update):

        n = n_a + n_b,  δ = mean_b − mean_a,
        mean = mean_a + δ·n_b/n,  M2 = M2_a + M2_b + δ²·n_a·n_b/n

    so after a stream of batches the state equals the moments of the concatenated stream.
    """
    count_b, mean_b, m2_b = (v.reshape(()) for v in _masked_moments(x, valid))
    count_a = running.count.astype(jnp.float32)
    total = count_a + count_b
    safe_total = jnp.maximum(total, 1.0)
    delta = mean_b - running.mean
    mean = running.mean + delta * (count_b / safe_total)
    m2 = running.m2 + m2_b + jnp.square(delta) * (count_a * count_b / safe_total)
    return RunningMoments(
        count=running.count + count_b.astype(jnp.int32),
        mean=jnp.where(total > 0, mean, running.mean).astype(jnp.float32),
        m2=jnp.where(total > 0, m2, running.m2).astype(jnp.float32),
    )


# ---------------------------------------------------------------------------------------------
# Estimators.
# ---------------------------------------------------------------------------------------------


@register_advantage_estimator("grpo")
def grpo_advantages(
    rewards_B: Array,
    valid_B: Array,
    *,
    group_size: int,
    eps: float = EPS,
    norm_adv_by_std_in_grpo: bool = True,
):
    """GRPO / GSPO group advantage (GSPO paper eq. for Â_i, §4.1):

    Â_i = (r_i − mean_group(r)) / (std_group(r) + eps), over the valid members of the group.

    `norm_adv_by_std_in_grpo=False`: Â_i = r_i − mean_group(r), Dr. GRPO's baseline (Liu et
    al., "Understanding R1-Zero-Like Training", arXiv 2503.20783): dividing by the
    group's std weights easy and hard prompts (low std) up, a question-level difficulty bias.
    """
    num_b = rewards_B.shape[0]
    rewards_NG = rewards_B.reshape(num_b // group_size, group_size)
    valid_NG = valid_B.reshape(num_b // group_size, group_size)
    if not norm_adv_by_std_in_grpo:
        _, mean_NG, _ = _masked_moments(rewards_NG, valid_NG, axis=1)
        return (rewards_NG - mean_NG).reshape(num_b)
    return _zscore(rewards_NG, valid_NG, axis=1, eps=eps).reshape(num_b)


@register_advantage_estimator("rloo")
def rloo_advantages(rewards_B: Array, valid_B: Array, *, group_size: int, eps: float = EPS):
    """RLOO, REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al., arXiv 2402.14740):
    each response's baseline is the mean reward of the *other* valid members of its group,

        Â_i = r_i − (1/(n − 1)) Σ_{j≠i} r_j = n/(n − 1) · (r_i − mean_group(r)),

    n the group's valid members (a member alone in its group gets 0). Unbiased: r_i's own
    reward never enters its baseline. Needs G >= 2.
    """
    del eps
    num_b = rewards_B.shape[0]
    rewards_NG = rewards_B.reshape(num_b // group_size, group_size)
    valid_NG = valid_B.reshape(num_b // group_size, group_size)
    count_NG, mean_NG, _ = _masked_moments(rewards_NG, valid_NG, axis=1)
    scale_NG = jnp.where(count_NG > 1, count_NG / jnp.maximum(count_NG - 1.0, 1.0), 0.0)
    return (scale_NG * (rewards_NG - mean_NG)).reshape(num_b)


@register_advantage_estimator("reinforce")
def reinforce_advantages(rewards_B: Array, valid_B: Array, *, group_size: int, eps: float = EPS):
    """REINFORCE: Â_i = r_i (the processed reward; use reward_norm / whitening for a baseline)."""
    del valid_B, group_size, eps
    return rewards_B


# ---------------------------------------------------------------------------------------------
# Public API.
# ---------------------------------------------------------------------------------------------


def _grpo_option(adv_estimator: str, norm_adv_by_std_in_grpo: bool) -> dict:
    """The estimator's keyword for `norm_adv_by_std_in_grpo`: only "grpo" reads it."""
    if adv_estimator == "grpo":
        return {"norm_adv_by_std_in_grpo": bool(norm_adv_by_std_in_grpo)}
    return {}


def _check_args(num_b: int, *, group_size, adv_estimator, reward_norm, running) -> None:
    ADV_ESTIMATORS.get(adv_estimator)  # ValueError listing the valid names
    if reward_norm not in REWARD_NORMS:
        raise ValueError(f"unknown reward_norm {reward_norm!r}; valid: {list(REWARD_NORMS)}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive Python int, got {group_size!r}")
    if num_b % group_size:
        raise ValueError(
            f"rewards has {num_b} entries, not a multiple of group_size={group_size} "
            "(B = N·G with each prompt's G responses contiguous)"
        )
    if running is not None and not isinstance(running, RunningMoments):
        raise ValueError(f"running must be a RunningMoments or None, got {type(running)}")


def _valid_mask(rewards_B: Array, mask: Array | None) -> Array:
    if mask is None:
        return jnp.ones(rewards_B.shape, bool)
    if mask.shape != rewards_B.shape:
        raise ValueError(f"mask has shape {mask.shape}, expected rewards' {rewards_B.shape}")
    return jnp.asarray(mask) > 0


def process_rewards(
    rewards_B: Array,
    valid_B: Array,
    *,
    group_size: int,
    reward_norm: str | None,
    reward_shift: bool = False,
    reward_scale: bool = False,
    reward_clip: float | None = None,
    running: RunningMoments | None = None,
    eps: float = EPS,
) -> tuple[Array, RunningMoments | None]:
    """Steps (1)-(2) of `compute_advantages`: normalise, then clip to ±reward_clip.

    "running": the batch is merged into the running moments first, then normalised with the
    updated moments — a stream of one batch therefore equals "batch", and after any stream the
    state equals the moments of the concatenated stream. Invalid entries come back as 0.
    """
    rewards_B = jnp.where(valid_B, rewards_B.astype(jnp.float32), 0.0)
    flags = {"shift": reward_shift, "scale": reward_scale, "eps": eps}
    if reward_norm == "batch":
        count, mean, m2 = _masked_moments(rewards_B, valid_B)
        rewards_B = _normalise(rewards_B, mean, _unbiased_std(count, m2), **flags)
    elif reward_norm == "group":
        num_b = rewards_B.shape[0]
        shape_NG = (num_b // group_size, group_size)
        count, mean, m2 = _masked_moments(
            rewards_B.reshape(shape_NG), valid_B.reshape(shape_NG), axis=1
        )
        normed_NG = _normalise(rewards_B.reshape(shape_NG), mean, _unbiased_std(count, m2), **flags)
        rewards_B = normed_NG.reshape(num_b)
    elif reward_norm == "running":
        running = update_running_moments(
            init_running_moments() if running is None else running, rewards_B, valid_B
        )
        std = _unbiased_std(running.count, running.m2)
        rewards_B = _normalise(rewards_B, running.mean, std, **flags)
    if reward_clip is not None:
        rewards_B = jnp.clip(rewards_B, -reward_clip, reward_clip)
    return jnp.where(valid_B, rewards_B, 0.0), running


def compute_advantages(
    rewards: Array,
    *,
    group_size: int,
    adv_estimator: str,
    reward_clip: float | None = None,
    reward_norm: str | None = None,
    reward_shift: bool = False,
    reward_scale: bool = False,
    whiten_advantages: bool = False,
    advantage_clip: float | None = None,
    mask: Array | None = None,
    running: RunningMoments | None = None,
    eps: float = EPS,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[Array, RunningMoments | None]:
    """Per-response advantages [B] from rewards [B] (B = N·G, groups contiguous).

    In this order, each over the valid entries only:
      1. normalise by `reward_norm` (None: skip; "batch"; "group"; "running"): full z-score
         (r − mean)/(std + eps) by default or with both flags, r − mean with `reward_shift`
         alone, r/(std + eps) with `reward_scale` alone;
      2. clip to ±`reward_clip`;
      3. estimator: "grpo" Â = (r − mean_group)/(std_group + eps) (GSPO paper §4.1), or
         r − mean_group with `norm_adv_by_std_in_grpo=False` (Dr. GRPO); "rloo"
         Â = r − mean of the group's other members; "reinforce" Â = r;
      4. `whiten_advantages`: z-score over the valid batch;
      5. clip to ±`advantage_clip`.
    Invalid entries get 0. std is unbiased (ddof=1), and 0 for a set with < 2 valid members.

    Returns (advantages [B] f32, running): the updated `RunningMoments` for "running" (started
    from the empty state when None is given), else `running` passed through unchanged.
    """
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be [B], got shape {rewards.shape}")
    _check_args(
        rewards.shape[0],
        group_size=group_size,
        adv_estimator=adv_estimator,
        reward_norm=reward_norm,
        running=running,
    )
    valid_B = _valid_mask(rewards, mask)
    rewards_B, running = process_rewards(
        rewards,
        valid_B,
        group_size=group_size,
        reward_norm=reward_norm,
        reward_shift=reward_shift,
        reward_scale=reward_scale,
        reward_clip=reward_clip,
        running=running,
        eps=eps,
    )
    estimate = ADV_ESTIMATORS[adv_estimator].sequence
    adv_B = estimate(
        rewards_B,
        valid_B,
        group_size=group_size,
        eps=eps,
        **_grpo_option(adv_estimator, norm_adv_by_std_in_grpo),
    )
    if whiten_advantages:
        adv_B = _zscore(adv_B, valid_B, eps=eps)
    if advantage_clip is not None:
        adv_B = jnp.clip(adv_B, -advantage_clip, advantage_clip)
    return jnp.where(valid_B, adv_B, 0.0), running


# ---------------------------------------------------------------------------------------------
# Token-level rewards (in-reward KL).
# ---------------------------------------------------------------------------------------------


def token_level_returns(token_rewards_BT: Array, mask_BT: Array, gamma: float = 1.0) -> Array:
    """Reward-to-go over valid tokens: R_t = Σ_{t' ≥ t, valid} γ^{k(t, t')} r_{t'}.

    k(t, t') counts the valid tokens in (t, t'], i.e. masked positions (padding, or tool output
    inside a response) carry no reward and do not count as discount steps. For a contiguous
    mask this is the usual Σ_{t'≥t} γ^{t'−t} r_{t'}. Masked positions get return 0.
    """
    if token_rewards_BT.ndim != 2 or mask_BT.shape != token_rewards_BT.shape:
        raise ValueError(
            f"token_level_returns: token_rewards_BT {token_rewards_BT.shape} and mask_BT "
            f"{mask_BT.shape} must both be [B, T] of the same shape"
        )
    valid_BT = jnp.asarray(mask_BT) > 0
    rewards_BT = jnp.where(valid_BT, token_rewards_BT.astype(jnp.float32), 0.0)

    def step(carry_B, inputs):
        reward_B, valid_B = inputs
        ret_B = jnp.where(valid_B, reward_B + gamma * carry_B, carry_B)
        return ret_B, jnp.where(valid_B, ret_B, 0.0)

    init_B = jnp.zeros(rewards_BT.shape[:1], jnp.float32)
    _, returns_TB = jax.lax.scan(step, init_B, (rewards_BT.T, valid_BT.T), reverse=True)
    return returns_TB.T


@register_advantage_estimator("reinforce", level="token")
def reinforce_token_advantages(
    rewards_BT: Array, valid_BT: Array, valid_B: Array, *, group_size: int, gamma, eps=EPS
):
    """REINFORCE per token: Â_t = reward-to-go of the token rewards (`token_level_returns`)."""
    del valid_B, group_size, eps
    return token_level_returns(rewards_BT, valid_BT, gamma)


@register_advantage_estimator("grpo", level="token")
def grpo_token_advantages(
    rewards_BT: Array,
    valid_BT: Array,
    valid_B: Array,
    *,
    group_size: int,
    gamma,
    eps=EPS,
    norm_adv_by_std_in_grpo: bool = True,
):
    """GRPO per token: the sequence score Σ_t r_t, group z-scored (or mean-centred,
    `norm_adv_by_std_in_grpo=False`), on each of its tokens."""
    del valid_BT, gamma
    adv_B = grpo_advantages(
        jnp.sum(rewards_BT, axis=-1),
        valid_B,
        group_size=group_size,
        eps=eps,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
    )
    return jnp.broadcast_to(adv_B[:, None], rewards_BT.shape)


def compute_token_advantages(
    rewards: Array,
    token_rewards_BT: Array,
    mask_BT: Array,
    *,
    group_size: int,
    adv_estimator: str,
    reward_clip: float | None = None,
    reward_norm: str | None = None,
    reward_shift: bool = False,
    reward_scale: bool = False,
    whiten_advantages: bool = False,
    advantage_clip: float | None = None,
    mask: Array | None = None,
    running: RunningMoments | None = None,
    gamma: float = 1.0,
    eps: float = EPS,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[Array, RunningMoments | None]:
    """Per-token advantages [B, T] when part of the reward is per token (e.g. −β·KL_t).

    A sequence is valid when `mask` (optional, [B]) says so and it has at least one valid
    token. Then, mirroring how verl / ROLL put the KL penalty into the reward:
      1. the sequence reward gets `compute_advantages`' steps 1-2 (normalise, clip);
      2. it is placed on the sequence's last valid token and added to the per-token rewards:
         r̃_t = token_rewards_t + [t = last] · r_seq;
      3. "reinforce": Â_t = reward-to-go of r̃ (`token_level_returns`, discount `gamma`);
         "grpo": the sequence score Σ_t r̃_t is group z-scored and broadcast to its tokens;
      4. `whiten_advantages`: z-score over all valid tokens (token-weighted, unlike the
         per-sequence whitening of `compute_advantages`);
      5. clip to ±`advantage_clip`.
    Masked tokens and invalid sequences get 0. With zero token rewards this equals
    `compute_advantages` broadcast over the valid tokens (without whitening).
    """
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be [B], got shape {rewards.shape}")
    num_b = rewards.shape[0]
    if token_rewards_BT.ndim != 2 or token_rewards_BT.shape[0] != num_b:
        raise ValueError(
            f"token_rewards_BT has shape {token_rewards_BT.shape}, expected [B={num_b}, T]"
        )
    if mask_BT.shape != token_rewards_BT.shape:
        raise ValueError(
            f"mask_BT has shape {mask_BT.shape}, expected token_rewards_BT's "
            f"{token_rewards_BT.shape}"
        )
    _check_args(
        num_b,
        group_size=group_size,
        adv_estimator=adv_estimator,
        reward_norm=reward_norm,
        running=running,
    )
    num_t = token_rewards_BT.shape[1]
    tok_valid_BT = jnp.asarray(mask_BT) > 0
    valid_B = _valid_mask(rewards, mask) & jnp.any(tok_valid_BT, axis=-1)
    tok_valid_BT = tok_valid_BT & valid_B[:, None]

    seq_rewards_B, running = process_rewards(
        rewards,
        valid_B,
        group_size=group_size,
        reward_norm=reward_norm,
        reward_shift=reward_shift,
        reward_scale=reward_scale,
        reward_clip=reward_clip,
        running=running,
        eps=eps,
    )
    last_B = num_t - 1 - jnp.argmax(tok_valid_BT[:, ::-1], axis=-1)
    is_last_BT = jnp.arange(num_t)[None, :] == last_B[:, None]
    combined_BT = jnp.where(tok_valid_BT, token_rewards_BT.astype(jnp.float32), 0.0)
    combined_BT = combined_BT + jnp.where(is_last_BT & tok_valid_BT, seq_rewards_B[:, None], 0.0)

    estimate = ADV_ESTIMATORS[adv_estimator].token
    if estimate is None:
        valid = sorted(n for n, e in ADV_ESTIMATORS.items() if e.token is not None)
        raise ValueError(
            f"compute_token_advantages: adv_estimator {adv_estimator!r} has no token-level "
            f"form; valid: {valid}"
        )
    adv_BT = estimate(
        combined_BT,
        tok_valid_BT,
        valid_B,
        group_size=group_size,
        gamma=gamma,
        eps=eps,
        **_grpo_option(adv_estimator, norm_adv_by_std_in_grpo),
    )
    if whiten_advantages:
        adv_BT = _zscore(adv_BT, tok_valid_BT, eps=eps)
    if advantage_clip is not None:
        adv_BT = jnp.clip(adv_BT, -advantage_clip, advantage_clip)
    return jnp.where(tok_valid_BT, adv_BT, 0.0), running
