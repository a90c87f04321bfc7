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


def _fake_run(root, arm, seed, steps=4):
    d = root / f"{arm.model}_{arm.name}" / f"seed{seed}"
    d.mkdir(parents=True)
    rows = [{"step": 0, "eval/accuracy": 0.1}]
    for step in range(1, steps + 1):
        rows.append(
            {
                "step": step,
                "reward/mean": 0.1 * step,
                "policy/clipfrac": 0.01,
                "policy/clipfrac_seq": 0.02,
                "sampler/logprob_gap_mean": 1e-6,
                "policy/ratio_noise_floor": 1e-7,
            }
        )
    rows[-1]["eval/accuracy"] = 0.2
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("with_noise", [False, True])
def test_results_markdown_from_its_template(tmp_path, with_noise):
    """write_results fills every placeholder of results_template.md (and the noise floor's
    section only when measured) and ends the file with one newline."""
    arms = [a for a in gspo_vs_grpo.ARMS if a.model == "dense"]
    for arm in arms:
        _fake_run(tmp_path, arm, 0)
    noise = [
        {
            "dtype": "bfloat16",
            "pi_old": "sampler",
            "max_abs_s_minus_1": 1e-2,
            "max_clipfrac_seq": 0.5,
            "sampler_gap_max": 4e-2,
        }
    ]
    budget = gspo_vs_grpo.Budget(steps=4, seeds=1, prompts=4, eval_every=4, eval_prompts=8)
    path = tmp_path / "results.md"
    gspo_vs_grpo.write_results(
        str(path), str(tmp_path), arms, [0], budget, "cmd", 60.0, noise if with_noise else [], "c"
    )
    text = path.read_text()
    assert text.startswith("# Results: GSPO vs GRPO at laptop scale\n")
    assert "$" not in text
    assert text.endswith("gap metrics.\n" if with_noise else "gspo_vs_grpo_dense.png)\n")
    assert "| GSPO (dense) | 0.100 ± 0.000 | 0.200 ± 0.000 |" in text
    assert ("| bfloat16 | sampler | 1.0e-02 | 50% | 4.0e-02 |" in text) == with_noise
    assert (tmp_path / "results" / "gspo_vs_grpo_dense.png").exists()
