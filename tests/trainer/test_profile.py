"""log.profile_steps: which RL steps a trace covers, that a real trace is written, and the
config check that names the field.

- consecutive listed steps are one trace, a gap starts a new one, unlisted steps none;
- a trace left open by an error is stopped (what it caught is written);
- on this CPU a real `jax.profiler` trace of a jitted step lands in WORKDIR/profile;
- a step outside [1, num_steps], or a non-integer, is refused naming `log.profile_steps`."""

import glob
import os

import jax
import jax.numpy as jnp
import pytest

from configs import base
from gspo_jax.config.validate import ConfigError, validate
from gspo_jax.trainer.io import profile


def _calls(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.profiler, "start_trace", lambda d: calls.append(("start", d)))
    monkeypatch.setattr(jax.profiler, "stop_trace", lambda: calls.append(("stop",)))
    return calls


def test_consecutive_steps_share_a_trace_and_gaps_start_a_new_one(monkeypatch, tmp_path):
    calls = _calls(monkeypatch)
    with profile.StepProfiler(str(tmp_path), (2, 3, 5)) as p:
        for step in range(1, 7):
            p.before(step)
            calls.append(("step", step))
            p.after(step, jnp.zeros(()))
    where = os.path.join(str(tmp_path), "profile")
    assert calls == [
        ("step", 1),
        ("start", where),
        ("step", 2),
        ("step", 3),
        ("stop",),
        ("step", 4),
        ("start", where),
        ("step", 5),
        ("stop",),
        ("step", 6),
    ]


def test_a_trace_open_at_an_error_is_stopped(monkeypatch, tmp_path):
    calls = _calls(monkeypatch)
    with (
        pytest.raises(RuntimeError, match="boom"),
        profile.StepProfiler(str(tmp_path), (1, 2)) as p,
    ):
        p.before(1)
        raise RuntimeError("boom")
    assert calls[-1] == ("stop",)


def test_a_real_trace_of_a_jitted_step_is_written(tmp_path):
    step = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
    x = jnp.ones((64, 64))
    with profile.StepProfiler(str(tmp_path), (1,)) as p:
        p.before(1)
        out = step(x)
        p.after(1, out)
    traces = glob.glob(str(tmp_path / "profile" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert len(traces) == 1 and os.path.getsize(traces[0]) > 0


@pytest.mark.parametrize("steps", [(0,), (3, 99), ("2",), (True,)])
def test_profile_steps_outside_the_run_are_refused(steps):
    c = base.get_config()
    c.num_steps = 10
    c.log.profile_steps = steps
    with pytest.raises(ConfigError, match=r"config\.log\.profile_steps=.*num_steps=10"):
        validate(c)
