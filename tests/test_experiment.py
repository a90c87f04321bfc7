"""The experiment's own pieces (experiments.gspo_vs_grpo); the whole command runs
in tests/test_notebooks.py (colabs/gspo_vs_grpo.ipynb, --quick)."""

import json

import numpy as np
import pytest

from experiments import gspo_vs_grpo
from gspo_jax import models

DENSE = "tests/fixtures/models/qwen3"


@pytest.mark.parametrize("noise", [0.0, 0.05])
def test_upcycled_moe_computes_the_dense_function_at_noise_0(tmp_path, noise):
    """8 copies of every MLP, top-2 gates renormalised to sum to 1: the same logits as the
    dense model (noise 0); the noise is what makes the experts differ."""
    out = gspo_vs_grpo.upcycle(DENSE, str(tmp_path / "moe"), noise=noise)
    with open(tmp_path / "moe" / "config.json") as f:
        assert json.load(f)["model_type"] == "qwen3_moe"
    dense_cfg, dense = models.load_pretrained(DENSE)
    moe_cfg, moe = models.load_pretrained(out)
    assert (moe_cfg.num_experts, moe_cfg.num_experts_per_tok) == (8, 2)
    assert moe_cfg.moe_intermediate_size == dense_cfg.intermediate_size
    tokens = np.random.default_rng(0).integers(3, dense_cfg.vocab_size, (2, 10)).astype(np.int32)
    mask = np.ones_like(tokens)
    a = np.asarray(models.forward(dense_cfg, dense, tokens, mask))
    b = np.asarray(models.forward(moe_cfg, moe, tokens, mask))
    if noise == 0:
        np.testing.assert_allclose(b, a, atol=1e-5)
    else:
        assert np.abs(b - a).max() > 1e-3


def test_upcycle_refuses_a_non_dense_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="model_type 'qwen3_moe'"):
        gspo_vs_grpo.upcycle("tests/fixtures/models/qwen3_moe", str(tmp_path / "x"))


def _stats(**means):
    return {k: (v, 0.0, [v]) for k, v in means.items()}


def test_verdict_rules():
    """§5.2 from clipped-token ratio and accuracy; §5.3 from expert change and the MoE arms'
    accuracy; the thresholds stated in results.md."""
    base = {"reward_mean": 0.1, "gap_mean": 0.0}
    stats = {
        "dense/gspo": _stats(clipfrac_tok=0.2, eval_end=0.30, **base),
        "dense/grpo": _stats(clipfrac_tok=0.002, eval_end=0.29, **base),
        "moe/gspo": _stats(clipfrac_tok=0.05, eval_end=0.30, expert_change_1=0.1, **base),
        "moe/grpo_rr": _stats(clipfrac_tok=0.01, eval_end=0.30, expert_change_1=0.1, **base),
        "moe/grpo": _stats(
            clipfrac_tok=0.01, eval_end=0.10, expert_change_1=0.1, expert_change_3=0.2, **base
        ),
    }
    stats["moe/gspo"]["expert_change_3"] = stats["moe/grpo"]["expert_change_3"]
    verdicts = {claim: verdict for claim, verdict, _ in gspo_vs_grpo.verdicts(stats, [])}
    dense = next(v for c, v in verdicts.items() if c.startswith("§5.2 (dense)"))
    moe = next(v for c, v in verdicts.items() if c.startswith("§5.2 (moe)"))
    assert dense == "reproduced"  # 100x the clipping, accuracy within tolerance
    assert moe == "partly reproduced (accuracy, not the clipping gap)"  # 5x < 10x
    rr = next(v for c, v in verdicts.items() if "Routing Replay" in c)
    assert rr == "reproduced"
    change = next(v for c, v in verdicts.items() if "experts change" in c)
    assert change == "reproduced"
