"""The GSPO family's presets (configs/sapo.py, cispo.py, gmpo.py, luspo.py, dppo.py,
dr_grpo.py, rloo.py): each holds its paper's settings, validates without a warning, and runs
a few RL steps through `python -m gspo_jax.main` on a tiny model, logging the family's
metrics (policy/limited_frac, policy/limited_frac_seq, policy/weight_mean)."""

import importlib
import subprocess
import sys
import warnings

import numpy as np
import pytest
from helpers import TINY_MODEL, metrics_by_step

from gspo_jax.config.validate import validate

PRESETS = ("sapo", "cispo", "gmpo", "luspo", "dppo", "dr_grpo", "rloo")

# 4 prompts x 4 responses, 2 RL steps, evaluation only at the ends, nothing exported.
TINY = [
    *TINY_MODEL,
    "--config.num_steps=2",
    "--config.rollout_batch_size=4",
    "--config.num_return_sequences_in_group=4",
    "--config.num_mini_batches=2",
    # a reward that varies within every group: non-zero advantages, so each loss acts
    "--config.reward.spec=test_checksum",
    "--config.reward.num_workers=0",
    "--config.eval.num_prompts=8",
    "--config.eval.batch_size=8",
    "--config.eval.every_steps=0",
    "--config.checkpoint.every_steps=0",
    "--config.checkpoint.export_hf=false",
    "--config.log.plot=false",
    "--config.log.tensorboard=false",
]
# `python -m gspo_jax.main`, after importing the module that registers the test reward.
MAIN = (
    "import runpy, gspo_jax.rewards.testing; runpy.run_module('gspo_jax.main', run_name='__main__')"
)


def _config(name, arg=None):
    return importlib.import_module(f"configs.{name}").get_config(arg)


def test_each_preset_holds_its_papers_settings():
    c = _config("sapo")
    assert (c.loss_mode, c.importance_sampling, c.sapo_tau_pos, c.sapo_tau_neg) == (
        "sapo",
        "token",
        1.0,
        1.05,
    )
    assert _config("sapo", "level=seq").importance_sampling == "seq"
    c = _config("cispo")
    assert (c.loss_mode, c.clip_low, c.clip_high) == ("cispo", 1.0, 4.0)
    c = _config("gmpo")
    assert (c.loss_mode, c.importance_sampling, c.clip_low, c.clip_high) == (
        "gmpo",
        "token",
        0.4,
        0.4,
    )
    c = _config("luspo")
    assert (c.loss_mode, c.importance_sampling, c.loss_agg_mode) == (
        "clip",
        "seq",
        "seq-mean-token-sum",
    )
    c = _config("dppo")
    assert (c.loss_mode, c.dppo_delta_low, c.dppo_delta_high) == ("dppo_tv", 0.15, 0.15)
    c = _config("dppo", "variant=kl")
    assert (c.loss_mode, c.dppo_delta_high) == ("dppo_kl", 0.05)
    c = _config("dr_grpo")
    assert not c.norm_adv_by_std_in_grpo and c.loss_agg_mode == "seq-mean-token-sum-norm"
    assert _config("rloo").adv_estimator == "rloo"
    for name, arg in [(n, None) for n in PRESETS] + [("sapo", "level=seq"), ("dppo", "variant=kl")]:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            validate(_config(name, arg), num_devices=1)
    with pytest.raises(ValueError, match="level='sequence'"):
        _config("sapo", "level=sequence")
    with pytest.raises(ValueError, match="variant='js'"):
        _config("dppo", "variant=js")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("family")
    out = {}
    for name in PRESETS:
        workdir = root / name
        cmd = [
            sys.executable,
            "-c",
            MAIN,
            f"--config=configs/{name}.py",
            f"--workdir={workdir}",
            f"--config.data.data_dir={root / 'data'}",
            *TINY,
        ]
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (name, proc.stderr[-4000:])
        out[name] = metrics_by_step(workdir)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", PRESETS)
def test_preset_runs_through_main_and_logs_the_family_metrics(runs, name):
    rows = runs[name]
    assert set(rows) == {0, 1, 2}
    for step in (1, 2):
        m = rows[step]
        assert m["policy/optimizer_step"] == 2 * step and m["policy/skipped_updates"] == 0
        assert m["policy/grad_norm"] > 0
        for key in ("policy/limited_frac", "policy/limited_frac_seq", "policy/weight_mean"):
            assert 0.0 <= m[key] <= (1.0 if key != "policy/weight_mean" else 5.0), (key, m[key])
        assert all(np.isfinite(v) for v in m.values() if isinstance(v, float))
    # Each run's first update is on policy (π_old recomputed): nothing limited yet, and the
    # gradient weight is the plain policy gradient's (SAPO's gate sech²(0) = 1, CISPO's and
    # DPPO's weight r = 1, no clip or mask active).
    first = rows[1]
    assert first["updates/limited_frac/0"] == 0.0
    assert first["updates/weight_mean/0"] == pytest.approx(1.0)
