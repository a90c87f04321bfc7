"""curves.png says which ratio its clip panels plot, tells coinciding lines apart, and bands
held-out accuracy with its binomial interval over the evaluated problems."""

import json
import math

from gspo_jax.trainer.io import writers


class _Axis:
    def __init__(self):
        self.bands = []

    def fill_between(self, xs, lo, hi, **kw):
        self.bands.append((list(xs), lo, hi))


def test_the_ratio_is_read_from_the_runs_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"importance_sampling": "seq"}))
    assert writers.ratio_of_run(str(tmp_path / "metrics.jsonl")) == "s_i per response (GSPO)"
    (tmp_path / "config.json").write_text(json.dumps({"importance_sampling": "token"}))
    assert writers.ratio_of_run(str(tmp_path / "metrics.jsonl")) == "r_t per token (GRPO)"
    (tmp_path / "config.json").write_text("{torn")
    assert writers.ratio_of_run(str(tmp_path / "metrics.jsonl")) is None


def test_held_out_accuracy_gets_the_wilson_interval_of_its_problems():
    rows = [{"step": 0, "eval/accuracy": 0.5, "eval/num_prompts": 100.0}]
    ax = _Axis()
    writers.binomial_band(ax, rows, [0], [0.5], "C0")
    ((_, lo, hi),) = ax.bands
    half = 1.96 * math.sqrt(0.25 / 100 + 1.96**2 / 40000) / (1 + 1.96**2 / 100)
    assert math.isclose(hi[0] - lo[0], 2 * half) and math.isclose((lo[0] + hi[0]) / 2, 0.5)
    assert math.isclose(hi[0] - lo[0], 0.1920, abs_tol=1e-3)  # ± 9.6 points at n = 100


def test_the_plot_is_drawn_with_them(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"importance_sampling": "seq"}))
    rows = [{"step": s, "policy/clipfrac": 0.2, "policy/clipfrac_seq": 0.2} for s in range(1, 40)]
    rows += [{"step": s, "eval/accuracy": 0.3, "eval/num_prompts": 500.0} for s in (0, 20, 39)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = writers.plot_curves(str(tmp_path / "metrics.jsonl"), str(tmp_path / "curves.png"))
    assert (tmp_path / "curves.png").stat().st_size > 10_000 and out.endswith("curves.png")
