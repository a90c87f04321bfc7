"""Names renamed in this release (docs/configuration.md, "Renamed in this release"): the old
name still works, with a warning naming the new one, and cannot contradict the new one."""

import warnings

import pytest

from configs import default
from gspo_jax.config import specs
from gspo_jax.config.validate import ConfigError, ConfigWarning, validate
from gspo_jax.trainer import loop


def test_eval_num_samples_is_read_as_eval_pass_k_with_a_warning():
    c = default.get_config()
    c.eval.num_samples, c.reward.accuracy = 4, "arith_exact"
    with pytest.warns(ConfigWarning, match=r"eval.num_samples is deprecated.*eval.pass_k=4"):
        validate(c)
    assert specs.pass_k(c) == 4
    c.eval.num_samples, c.eval.pass_k = None, 3
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        validate(c)
    assert specs.pass_k(c) == 3


def test_eval_num_samples_beside_another_pass_k_is_an_error():
    c = default.get_config()
    c.eval.num_samples, c.eval.pass_k = 4, 2
    with pytest.raises(ConfigError, match=r"eval.num_samples=4 and config.eval.pass_k=2"):
        validate(c)


def test_a_bad_old_name_is_named_in_the_error():
    c = default.get_config()
    c.eval.num_samples = -1
    bad = r"config.eval.num_samples=-1 must be a non-negative"
    with pytest.raises(ConfigError, match=bad), warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        validate(c)


def test_rl_step_with_a_rollout_is_train_on_with_a_deprecation_warning(monkeypatch):
    calls = []
    monkeypatch.setattr(loop, "train_on", lambda *args: calls.append(args) or ("state", {}))
    with pytest.warns(DeprecationWarning, match=r"now loop.train_on"):
        assert loop.rl_step("trainer", "state0", "rollout") == ("state", {})
    assert calls == [("trainer", "state0", "rollout")]


def test_policy_loss_reads_rollout_logprobs_as_sampler_logprobs_with_a_warning():
    import jax.numpy as jnp

    from gspo_jax import objectives

    lp = jnp.log(jnp.array([[0.5, 0.25], [0.2, 0.4]]))
    kw = {"importance_sampling": "token", "clip_low": 0.2, "clip_high": 0.2}
    kw["rollout_correction"] = "tis"
    args = (lp, lp + 0.01, jnp.array([1.0, -1.0]), jnp.ones((2, 2)))
    new = objectives.policy_loss(*args, sampler_logprobs=lp - 0.3, **kw)
    with pytest.warns(DeprecationWarning, match="now sampler_logprobs"):
        old = objectives.policy_loss(*args, rollout_logprobs=lp - 0.3, **kw)
    assert float(new[0]) == float(old[0]) and new[1].keys() == old[1].keys()
