"""Intervals and paired differences (qevolve.algos.stats) against values worked out by hand."""

import pytest

from qevolve.algos.stats import auc, clustered, paired_bootstrap, percent_interval, wilson


def test_the_wilson_interval_by_hand():
    # 0 of 10: z² / n = 0.38415, centre = half-width = 0.19207 / 1.38415 = 0.13877: [0, 0.27753], not "0 ± 0"
    assert wilson(0, 10) == pytest.approx((0.0, 0.277533), abs=1e-6)
    # 5 of 10: centre 0.5, half-width 1.96·√(0.025 + 0.0096036) / 1.38415 = 0.263407
    assert wilson(5, 10) == pytest.approx((0.236593, 0.763407), abs=1e-6)
    assert wilson(10, 10) == pytest.approx((1 - 0.277533, 1.0), abs=1e-6)
    assert wilson(0, 0) == (0.0, 1.0)


def test_episodes_of_one_task_count_once_when_they_always_agree():
    # Two tasks, three seeds each, every seed agrees: Σ (Σ (x − p))² / n² = (1.5² + 1.5²) / 36 = 0.125 against
    # p(1 − p) / n = 0.25 / 6: deff 3, six episodes weigh as two, Wilson(1, 2) = [0.094531, 0.905469]
    got = clustered({"a": [1, 1, 1], "b": [0, 0, 0]})
    assert got["design_effect"] == pytest.approx(3.0)
    assert (got["rate"], got["won"], got["episodes"], got["tasks"]) == (0.5, 3, 6, 2)
    assert (got["low"], got["high"]) == pytest.approx((0.094531, 0.905469), abs=1e-6)
    # Seeds that disagree within each task: no clustering (deff 1), the plain Wilson interval of 2 of 4
    free = clustered({"a": [1, 0], "b": [1, 0]})
    assert free["design_effect"] == 1.0 and (free["low"], free["high"]) == pytest.approx(wilson(2, 4))
    assert clustered({"a": [0, 0], "b": [0]})["high"] == pytest.approx(wilson(0, 3)[1])
    with pytest.raises(ValueError, match="no episodes"):
        clustered({})


def test_the_paired_bootstrap_by_hand():
    # Two tasks, one seed, differences 1 and 0: a draw's mean is 0, ½ or 1 with chances ¼, ½, ¼;
    # the 95 % interval is [0, 1], the middle 40 % is ½ alone
    a, b = {"x": {0: 1}, "y": {0: 0}}, {"x": {0: 0}, "y": {0: 0}}
    got = paired_bootstrap(a, b)
    assert (got["difference"], got["low"], got["high"], got["tasks"], got["seeds"]) == (0.5, 0.0, 1.0, 2, 1)
    assert (paired_bootstrap(a, b, level=0.4)["low"], paired_bootstrap(a, b, level=0.4)["high"]) == (0.5, 0.5)
    # One task, two seeds that differ: the seeds are the second level, so the interval is [0, 1] too
    one = paired_bootstrap({"x": {0: 1, 1: 0}}, {"x": {0: 0, 1: 0}})
    assert (one["difference"], one["low"], one["high"]) == (0.5, 0.0, 1.0)
    same = paired_bootstrap(a, a)
    assert (same["difference"], same["low"], same["high"]) == (0.0, 0.0, 0.0)


def test_pairing_by_task_sees_a_difference_two_separate_intervals_cannot():
    # 100 tasks, the rows agree on all but 5, which row a wins: 35 % against 30 %, whose Wilson intervals overlap
    # widely; paired, a draw holds no discordant task with chance 0.95^100 = 0.006 < 0.025, so the interval
    # starts above 0
    a = {f"t{i}": {0: int(i < 35)} for i in range(100)}
    b = {f"t{i}": {0: int(i < 30)} for i in range(100)}
    assert wilson(35, 100)[0] < wilson(30, 100)[1]
    got = paired_bootstrap(a, b)
    assert got["difference"] == pytest.approx(0.05) and 0.0 < got["low"] <= 0.02 and 0.08 <= got["high"] <= 0.1


def test_only_tasks_both_rows_played_by_the_same_seeds_are_paired():
    a = {"x": {0: 1, 1: 1}, "y": {0: 1, 1: 1}, "z": {0: 1}, "only-a": {0: 1, 1: 1}}
    b = {"x": {0: 0, 1: 0}, "y": {0: 1, 1: 1}, "z": {0: 0, 1: 0}}
    got = paired_bootstrap(a, b)
    assert (got["tasks"], got["seeds"], got["difference"]) == (2, 2, 0.5), "z lost a seed's episode: left out"
    with pytest.raises(ValueError, match="share no task"):
        paired_bootstrap({"x": {0: 1}}, {"y": {0: 1}})


def test_intervals_print_in_percent():
    assert percent_interval(0.28, 0.219, 0.351) == "28.0 [21.9, 35.1]"
    assert percent_interval(0.043, -0.021, 0.108, signed=True) == "+4.3 [-2.1, +10.8]"


def test_the_auc_and_its_interval_by_hand():
    # Pairs (won, lost): 0.9 > 0.1, 0.9 > 0.85, 0.8 > 0.1, 0.8 < 0.85: 3 of 4. Hanley-McNeil: Q1 = 0.75 / 1.25 = 0.6,
    # Q2 = 2·0.5625 / 1.75 = 0.642857; var = (0.1875 + 0.0375 + 0.080357) / 4 = 0.076339, s.e. 0.276295
    got = auc([0.9, 0.8], [0.1, 0.85])
    assert got["auc"] == 0.75 and (got["low"], got["high"]) == pytest.approx((0.75 - 1.959964 * 0.276295, 1.0), abs=1e-5)
    assert got["contrast"] is False, "two against two cannot tell a ranking from chance"
    assert auc([1.0], [1.0])["auc"] == 0.5, "a tie counts half"
    # 30 against 30, every won above every lost: AUC 1, Q1 = Q2 = 1, variance 0
    assert auc([0.6 + i / 100 for i in range(30)], [0.2 + i / 100 for i in range(30)]) == {
        "auc": 1.0, "low": 1.0, "high": 1.0, "positives": 30, "negatives": 30, "contrast": True}
    # Interleaved, won on the odd hundredths and lost on the even: the won 2j + 1 is above j + 1 lost, Σ = 465 of 900
    assert auc([i / 100 for i in range(1, 60, 2)], [i / 100 for i in range(0, 60, 2)])["auc"] == pytest.approx(465 / 900)
    assert auc([i / 100 for i in range(1, 60, 2)], [i / 100 for i in range(0, 60, 2)])["contrast"] is False
    assert auc([0.5], [])["auc"] is None and auc([0.5], [])["contrast"] is None
