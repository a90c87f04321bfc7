"""The §5.4 noise floor against response length (experiments/gspo_vs_grpo/noise_length.py):
its statistics by hand, the sweep itself at two tiny lengths (f32: recomputed π_old gives
s_i = 1 exactly; every response runs to the full length), its cache, the rendered table and
the paragraph that reads it."""

import json

import jax
import numpy as np
import pytest

from experiments.gspo_vs_grpo import EPS_GSPO, Budget, cli, noise_length, report
from gspo_jax import sampling

LENGTHS = (4, 8)
KW = {"rollouts": 1, "dtypes": ("float32",), "sources": ("recompute",)}  # one train step each


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """The sweep at LENGTHS (f32, recomputed π_old, one rollout of 64 rows, one device), with
    the lengths of every response the sampler returned recorded on the side."""
    root = str(tmp_path_factory.mktemp("noise_length"))
    produced = []

    def recording(*args, **kwargs):
        out = sample(*args, **kwargs)
        produced.append(np.asarray(out.lengths))
        return out

    sample = sampling.sample_with
    with pytest.MonkeyPatch.context() as m:
        m.setattr(sampling, "sample_with", recording)  # bound by setup, per run
        rows = noise_length.noise_floor_lengths(root, LENGTHS, **KW, devices=jax.devices()[:1])
    return root, rows, produced


def test_sweep_rows_f32(sweep):
    """One row per length; f32 recompute: s_i = 1 exactly, nothing clipped; the lengths the
    rows report are those the sampler produced: every response the full length."""
    _, rows, produced = sweep
    assert [(r["length"], r["dtype"], r["pi_old"]) for r in rows] == [
        (n, "float32", "recompute") for n in LENGTHS
    ]
    assert [p.size for p in produced] == [64, 64]
    for r, lengths in zip(rows, produced, strict=True):
        assert r["rows"] == 64 and r["rollouts"] == 1
        assert r["length_mean"] == lengths.mean() and r["length_min"] == lengths.min()
        assert (lengths == r["length"]).all()  # the end tokens disabled
        assert r["max_abs_s_minus_1"] == 0.0
        assert r["clipfrac_seq"] == r["clipfrac_seq_range"] == 0.0
        assert r["token_gap_std"] == 0.0 and np.isnan(r["std_ratio"])


def test_sweep_is_cached(sweep, monkeypatch):
    """A rerun reads <root>/noise_floor_length/L<n>.json and measures nothing."""
    root, rows, _ = sweep

    def measure(*args):
        raise AssertionError("measured again")

    monkeypatch.setattr(noise_length, "_length_rows", measure)
    again = noise_length.noise_floor_lengths(root, LENGTHS, **KW)
    assert json.dumps(again) == json.dumps(rows)  # NaN-aware (the std ratio of recompute)
    assert json.dumps(noise_length.cached_rows(root)) == json.dumps(rows)
    with pytest.raises(AssertionError, match="measured again"):  # 2 rollouts: not cached
        noise_length.noise_floor_lengths(root, LENGTHS[:1], rollouts=2, dtypes=("float32",))


def test_rendered_table_has_every_cell(sweep):
    _, rows, _ = sweep
    text = noise_length.render(rows, EPS_GSPO)
    assert text.startswith("### §5.4 against length\n")
    assert "$" not in text
    for r in rows:
        assert noise_length.table_row(r) in text
    assert "| 4 | 4.0 | float32 | recompute | 0.0e+00 | 0.0% | 0.0% | – | – | – | – | – |" in text
    assert "| 8 | 8.0 | float32 | recompute | 0.0e+00 | 0.0% | 0.0% | – | – | – | – | – |" in text
    assert "at response lengths 4, 8," in text and "64 responses per cell (1 rollout of 64)" in text
    assert text.rstrip().endswith(
        "gives s_i = 1 exactly (nothing clipped) in float32 at every length."
    )


def test_results_section(sweep):
    """report.noise_floor_markdown: the one-length table, then this one, under one heading;
    this one alone with the heading; nothing when neither was measured."""
    _, rows, _ = sweep
    noise = [
        {
            "dtype": "bfloat16",
            "pi_old": "sampler",
            "max_abs_s_minus_1": 1e-2,
            "max_clipfrac_seq": 0.5,
            "sampler_gap_max": 4e-2,
        }
    ]
    both = report.noise_floor_markdown(noise, rows)
    assert both.count("## Noise floor\n") == 1 and "$" not in both
    assert both.index("| bfloat16 | sampler | 1.0e-02 |") < both.index("### §5.4 against length")
    alone = report.noise_floor_markdown([], rows)
    assert alone.startswith("## Noise floor\n\n### §5.4 against length\n")
    assert report.noise_floor_markdown(noise, []) == report._noise_floor_section(noise)
    assert report.noise_floor_markdown([], []) == ""


def test_gap_stats_by_hand():
    """log s_i = masked mean of d per row; stds with ddof 0; a row without valid tokens is
    left out. Row 0: d = 1, 3 -> 2; row 1: 1, 1, 7 -> 3."""
    d = np.array([[1.0, 3.0, 9.0], [1.0, 1.0, 7.0], [100.0, 100.0, 100.0]])
    m = np.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    got = noise_length.gap_stats(d, m)
    assert got["rows"] == 2 and got["length_mean"] == 2.5 and got["length_min"] == 2
    assert got["log_s_mean"] == 2.5 and got["log_s_std"] == 0.5
    tokens = np.array([1.0, 3.0, 1.0, 1.0, 7.0])  # mean 2.6, mean of squares 12.2
    np.testing.assert_allclose(got["token_gap_std"], np.sqrt(12.2 - 2.6**2))
    np.testing.assert_allclose(got["token_gap_abs_mean"], np.abs(tokens).mean())
    np.testing.assert_allclose(got["std_ratio"], 0.5 / np.sqrt(12.2 - 2.6**2))
    np.testing.assert_allclose(got["pass_max_abs_s_minus_1"], np.expm1(3.0))


def _row(length, dev, *, dtype="bfloat16", source="sampler", std=None, mean=0.0):
    std = 0.04 / np.sqrt(length) if std is None else std
    return {
        "length": length,
        "dtype": dtype,
        "pi_old": source,
        "rollouts": 2,
        "rows": 128,
        "length_mean": float(length),
        "length_min": length,
        "max_abs_s_minus_1": dev,
        "pass_max_abs_s_minus_1": dev,
        "clipfrac_seq": 0.25,
        "clipfrac_seq_range": 0.5,
        "log_s_mean": mean,
        "log_s_std": std,
        "token_gap_std": 0.04,
        "token_gap_abs_mean": 0.03,
        "std_ratio": std / 0.04,
    }


def test_finding_reads_the_numbers():
    """Where the floor falls below ε_low, the fitted exponent, the offset, the extrapolation."""
    falls = [_row(16, 1e-2), _row(64, 4e-3), _row(256, 2e-4), _row(1024, 1e-4)]
    text = noise_length.finding(falls, EPS_GSPO)
    assert "falls to ε_low = 0.0003 or below from L = 256 on (2.0e-04" in text
    assert (
        "Averaging works as for independent token gaps: std(log s_i) / std(d_t) falls as L^-0.50"
        in text
    )
    assert "the per-token gap keeps its size with length" in text and "falls as L^-0.50;" in text
    # 3 std at 1024 = 3.75e-3 must shrink 12.5x at L^-0.5: L = 1024 * 12.5^2 = 160,000.
    assert "from L ≈ 160,000 on" in text
    stays = [_row(16, 1e-2), _row(1024, 1e-3, std=1e-3)]
    text = noise_length.finding(stays, EPS_GSPO)
    assert "stays above ε_low = 0.0003 at every length measured" in text
    assert "(3.3x ε_low)" in text and "clips 25.0% of the responses at L = 1024" in text
    # std 1e-2 at 16 -> 1e-3 at 1024: exponent log(0.1)/log(64) = -0.554; 3 std = 3e-3 must
    # shrink 10x: L = 1024 * 10^(1/0.554) = 65,536, to 2 significant digits 66,000.
    assert "Averaging works as for independent token gaps" in text  # within ±0.1 of -0.5
    assert "falls as L^-0.55;" in text and "from L ≈ 66,000 on" in text
    offset = [_row(16, 1e-2, std=2.5e-3), _row(1024, 1e-3, std=1e-3, mean=5e-4)]
    text = noise_length.finding(offset, EPS_GSPO)
    # std 2.5e-3 -> 1e-3 over 64x the length: L^(log 0.4 / log 64) = L^-0.22
    assert (
        "Averaging is weaker than for independent token gaps: std(log s_i) / std(d_t) falls as L^-0.22"
        in text
    )
    assert "mean log s_i, is 5.0e-04 at L = 1024 (1.67 ε_low)" in text
    assert "Extrapolating" not in text  # the offset alone exceeds ε_low


def test_finding_says_where_recompute_is_not_exact():
    rows = [
        _row(16, 0.0, source="recompute"),
        _row(1024, 5e-4, source="recompute"),
        _row(1024, 0.0, source="recompute", dtype="float32"),
    ]
    assert noise_length.finding(rows, EPS_GSPO) == (
        "π_old recomputed by the train step is not exact everywhere: s_i = 1 exactly in "
        "bfloat16 at L = 16; float32 at L = 1024, but not in bfloat16 at L = 1024: max "
        "abs(s_i − 1) = 5.0e-04, 25.0% of the responses clipped."
    )


def test_pass_agreement_clause():
    """The pass-vs-train-step gap of the sampler / whole_batch cells, the cells where the
    updates do not recompute π_old exactly named apart; nothing without such cells."""
    rows = [
        _row(16, 0.0, source="recompute"),
        _row(1024, 5e-4, source="recompute"),
        {**_row(16, 1e-2), "pass_max_abs_s_minus_1": 1e-2 + 3e-8},
        {**_row(1024, 2e-3), "pass_max_abs_s_minus_1": 1.8e-3},
    ]
    assert noise_length._pass_agreement(rows) == (
        "; in the sampler and whole_batch cells the max abs(s_i − 1) of these log-probs "
        "differs from the train step's by at most 3e-08, except bfloat16 at L = 1024: 2e-04 "
        "(the updates do not recompute the pass exactly there)"
    )
    assert noise_length._pass_agreement(rows[:2]) == ""


def test_lengths_flag():
    """--noise_floor_lengths: the published default, none under --quick, '' for none, and a
    clear error naming the flag."""
    parse = cli._parser().parse_args
    budget = Budget(steps=1, seeds=1, prompts=4, eval_every=1, eval_prompts=8)
    quick = Budget(steps=1, seeds=1, prompts=4, eval_every=0, eval_prompts=8, quick=True)
    assert (
        cli._noise_floor_lengths(parse([]), budget) == noise_length.LENGTHS == (16, 64, 256, 1024)
    )
    assert cli._noise_floor_lengths(parse([]), quick) == ()
    assert cli._noise_floor_lengths(parse(["--noise_floor_lengths=8,32"]), quick) == (8, 32)
    assert cli._noise_floor_lengths(parse(["--noise_floor_lengths="]), budget) == ()
    for bad in ("16,x", "0,16", "16,16"):
        with pytest.raises(ValueError, match="--noise_floor_lengths"):
            noise_length.parse_lengths(bad)
    with pytest.raises(ValueError, match="sources"):
        noise_length.noise_floor_lengths("/nonexistent", (4,), sources=("sampler", "typo"))
