"""configs/roll_gspo_example.py (ROLL's GSPO recipe) through the RL loop, with and without the
in-reward token-level KL (add_token_level_kl), on a tiny model."""

import numpy as np
import pytest
from helpers import metrics_by_step

import gspo_jax.rewards.testing  # noqa: F401  (registers test_checksum)
from configs import roll_gspo_example
from gspo_jax.trainer import loop

# A 2-layer d=32 model, 8 prompts x 4 responses, 4 mini-batches (the recipe's split).
TINY = {
    "response_length": 12,
    "model.hidden_size": 32,
    "model.intermediate_size": 64,
    "model.num_layers": 2,
    "model.num_heads": 2,
    "model.num_kv_heads": 1,
    "model.head_dim": 16,
    "warm_start.steps": 3,
    "warm_start.target_accuracy": 0,
    "warm_start.batch_size": 16,
    "num_steps": 2,
    "rollout_batch_size": 8,
    "num_return_sequences_in_group": 4,
    "eval.num_prompts": 8,
    "eval.batch_size": 8,
    "reward.num_workers": 0,
    # A reward that varies within every group (the warm-started model scores 0 on the task):
    # non-zero advantages, so the KL terms and the clipping have something to act on.
    "reward.spec": "test_checksum",
    "checkpoint.every_steps": 0,
    "log.progress_bar": False,
    "log.plot": False,
}


def _config(data_dir, arg):
    c = roll_gspo_example.get_config(arg)
    for key, value in TINY.items():
        node = c
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    c.data.data_dir = str(data_dir)
    return c


def test_the_recipe_is_rolls():
    c = roll_gspo_example.get_config()  # ROLL's GSPO page as of 2026-04-30
    assert (c.adv_estimator, c.importance_sampling, c.ppo_epochs) == ("grpo", "seq", 1)
    assert not c.whiten_advantages and c.advantage_clip == 2.0 and c.dual_clip_loss
    assert c.loss_agg_mode == "seq-mean-token-mean"
    assert c.reward_clip == 10 and c.reward_norm is None
    assert c.use_kl_loss and c.kl_loss_coef == 0.001 and not c.add_token_level_kl
    earlier = roll_gspo_example.get_config("estimator=reinforce")  # its earlier yaml
    assert earlier.adv_estimator == "reinforce" and earlier.whiten_advantages
    with pytest.raises(ValueError, match="estimator='ppo'"):
        roll_gspo_example.get_config("estimator=ppo")
    with_kl = roll_gspo_example.get_config("add_token_level_kl=true")
    assert with_kl.add_token_level_kl and with_kl.token_level_kl_coef > 0


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("roll")
    out = {}
    for token_kl in (False, True):
        workdir = root / f"token_kl_{token_kl}"
        config = _config(root / "data", f"add_token_level_kl={token_kl}")
        if token_kl:
            # The recipe's 0.001 x KL_t (~1e-4 here after one update) moves the advantages by
            # ~1e-7, f32 rounding's size: 10 moves the gradient norm by ~1e-3 (measured).
            config.token_level_kl_coef = 10.0
        loop.run(config, str(workdir))
        out[token_kl] = metrics_by_step(workdir)
    return out


@pytest.mark.parametrize("token_kl", [False, True])
def test_roll_recipe_trains_through_the_loop(runs, token_kl):
    rows = runs[token_kl]
    assert set(rows) == {0, 1, 2}
    for step in (1, 2):
        m = rows[step]
        assert m["policy/grad_norm"] > 0 and m["policy/update_norm"] > 0
        assert all(np.isfinite(v) for v in m.values())
        assert m["policy/ratio_noise_floor"] == 0  # π_old recomputed by the step itself
    # Step 2 starts where step 1's updates left the policy: the KL loss (k3, >= 0, 0 only
    # at π_ref) is active.
    assert rows[2]["policy/kl_loss"] > 0


def test_token_level_kl_changes_the_update_once_the_policy_left_the_reference(runs):
    """Same seed, rollouts and rewards: at step 1 the policy is π_ref (every KL_t is 0, so
    the update is the same), at step 2 it is not, so the in-reward KL shifts the advantages
    and the gradient (by far more than f32 rounding, ~1e-7 of its norm; Adam normalises the
    update itself, so its norm barely moves)."""
    off, on = runs[False], runs[True]
    np.testing.assert_allclose(on[1]["reward/mean"], off[1]["reward/mean"])
    np.testing.assert_allclose(on[1]["policy/grad_norm"], off[1]["policy/grad_norm"], rtol=1e-5)
    assert on[2]["policy/grad_norm"] != pytest.approx(off[2]["policy/grad_norm"], rel=1e-4)
