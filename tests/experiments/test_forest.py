"""Issue 43: the forest plot's statistics (experiments/gspo_vs_grpo/forest.py): Holm's
adjustment against hand values, the seed-level t interval against hand values and scipy,
the fixed-effect pool, and the tool reading the committed comparisons and score files."""

import os

import numpy as np
import pytest

from experiments.gspo_vs_grpo import forest


def test_holm_matches_hand_values():
    """p = (0.01, 0.04, 0.03, 0.2), m = 4. Sorted 0.01, 0.03, 0.04, 0.2 get 4·0.01 = 0.04,
    3·0.03 = 0.09, 2·0.04 = 0.08 -> 0.09 (running max), 1·0.2 = 0.2."""
    got = forest.holm([0.01, 0.04, 0.03, 0.2])
    np.testing.assert_allclose(got, [0.04, 0.09, 0.09, 0.2])


def test_holm_caps_at_one_and_ranks_a_missing_p_last():
    """(0.3, nan, 0.02): nan is ranked as 1. Sorted 0.02, 0.3, 1 -> 0.06, 0.6, 1 (nan out)."""
    got = forest.holm([0.3, float("nan"), 0.02])
    np.testing.assert_allclose(got[[0, 2]], [0.6, 0.06])
    assert np.isnan(got[1])
    assert forest.holm([0.5, 0.6])[0] == 1.0  # 2·0.5 = 1, 1·0.6 -> max(1, 0.6)


def test_t_interval_matches_hand_values():
    """d = (1, 2, 3, 4): mean 2.5, sd sqrt(5/3), se = sqrt(5/12); t_{0.975, 3} =
    3.182446305284263 (tables); t = 2.5 / se = 3.8729833, two-sided p = 0.030466 (tables)."""
    mean, low, high, p = forest.t_interval([1.0, 2.0, 3.0, 4.0])
    half = 3.182446305284263 * np.sqrt(5 / 12)
    assert mean == 2.5
    assert (low, high) == pytest.approx((2.5 - half, 2.5 + half), rel=1e-12)
    assert p == pytest.approx(0.030466, abs=2e-6)


def test_t_interval_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    d = np.random.default_rng(3).normal(0.01, 0.02, size=7)
    _, low, high, p = forest.t_interval(d)
    ref = stats.ttest_1samp(d, 0.0)
    lo, hi = ref.confidence_interval(0.95)
    assert (low, high, p) == pytest.approx((lo, hi, ref.pvalue), rel=1e-10)
    with pytest.raises(ValueError, match="needs >= 2 per-seed differences"):
        forest.t_interval([0.1])


def _row(rid, est, low, high, p="", group="", note="", per_problem=""):
    fields = dict.fromkeys(forest.COLUMNS, "")
    fields.update(id=rid, group=group, note=note, per_problem=per_problem)
    return forest.Row(fields, est, low, high, float(p) if p != "" else float("nan"))


def test_pool_is_inverse_variance_over_rows_of_one_group():
    """Intervals of half-width 1.96·0.01 and 1.96·0.02 around 0 and 0.05: weights 4 : 1,
    pooled 0.01, se 1/sqrt(1/0.01² + 1/0.02²) = 0.0089443."""
    z = forest.Z975
    rows = [
        _row("a", 0.0, -z * 0.01, z * 0.01, group="g"),
        _row("b", 0.05, 0.05 - z * 0.02, 0.05 + z * 0.02, group="g"),
        _row("c", 0.3, 0.2, 0.4, group="alone"),
    ]
    pools = forest.pooled(rows)
    assert list(pools) == ["g"]  # a group of one is not pooled
    est, low, high, k = pools["g"]
    assert est - low == pytest.approx(high - est)
    assert k == 2 and est == pytest.approx(0.01)
    assert high - est == pytest.approx(z * 0.0089442719, rel=1e-6)


def test_interim_rows_stay_out_of_the_holm_family():
    rows = forest.analyse(
        [_row("a", 0.1, 0.05, 0.15, p=0.01), _row("b", 0.1, 0.0, 0.2, p=0.02, note="interim")]
    )
    assert rows[0].holm == pytest.approx(0.01)  # m = 1
    assert np.isnan(rows[1].holm)


def test_the_tool_reads_the_committed_files_and_recomputes_their_row():
    """docs/forest/comparisons.csv loads; its one row with committed per-problem files is
    recomputed from them (4 seeds × 500 problems) and agrees with the published figures."""
    rows = forest.load()
    assert len({r.fields["id"] for r in rows}) == len(rows)
    row = next(r for r in rows if r.fields["per_problem"])
    got = forest.recompute(row)
    assert got.recomputed and got.t is not None
    scores = forest.per_problem_scores(
        os.path.join(forest.PER_PROBLEM, "family_4seeds"), "dense_gspo", 50
    )
    assert scores.shape == (4, 500) and set(np.unique(scores)) <= {0.0, 1.0}
    assert got.estimate == pytest.approx(0.012, abs=5e-4)
    assert got.t[0] == pytest.approx(got.estimate)  # the t interval's centre: the same mean


def test_a_malformed_comparisons_file_names_the_field(tmp_path):
    path = tmp_path / "c.csv"
    path.write_text("id,estimate\nx,0.1\n")
    with pytest.raises(ValueError, match="missing column"):
        forest.load(str(path))
    header = ",".join(forest.COLUMNS)
    values = dict.fromkeys(forest.COLUMNS, "")
    values.update(id="x", estimate="abc", low="0", high="1")
    path.write_text(header + "\n" + ",".join(values[c] for c in forest.COLUMNS) + "\n")
    with pytest.raises(ValueError, match="row 'x': field 'estimate' is not a number"):
        forest.load(str(path))
    values.update(estimate="2")
    path.write_text(header + "\n" + ",".join(values[c] for c in forest.COLUMNS) + "\n")
    with pytest.raises(ValueError, match="outside"):
        forest.load(str(path))
