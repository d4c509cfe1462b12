"""Intervals and paired differences (qevolve.algos.stats) against values worked out by hand."""

import numpy as np
import pytest

from qevolve.algos.stats import (
    auc,
    clustered,
    difference_text,
    mann_whitney_p,
    no_difference_bound,
    paired_bootstrap,
    percent_interval,
    wilson,
)


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
    # A rate of 0 or 1 shows no variance to measure clustering with: the interval of its tasks, not its episodes
    # (0 of 216 episodes on 72 tasks: Wilson(0, 72), upper 5.1 %, not Wilson(0, 216)'s 1.7 %)
    assert clustered({"a": [0, 0], "b": [0]})["high"] == pytest.approx(wilson(0, 2)[1])
    none = clustered({f"t{i}": [0, 0, 0] for i in range(72)})
    assert none["high"] == pytest.approx(wilson(0, 72)[1]) and none["high"] == pytest.approx(0.0507, abs=1e-4)
    assert none["design_effect"] == 3.0
    assert clustered({f"t{i}": [1, 1, 1] for i in range(72)})["low"] == pytest.approx(1 - 0.0507, abs=1e-4)
    with pytest.raises(ValueError, match="no episodes"):
        clustered({})


def test_the_paired_bootstrap_by_hand():
    # Two tasks, one seed, differences 1 and 0: a draw's mean is 0, ½ or 1 with chances ¼, ½, ¼;
    # the 95 % interval is [0, 1], the middle 40 % is ½ alone
    a, b = {"x": {0: 1}, "y": {0: 0}}, {"x": {0: 0}, "y": {0: 0}}
    got = paired_bootstrap(a, b)
    assert (got["difference"], got["low"], got["high"], got["tasks"], got["seeds"]) == (0.5, 0.0, 1.0, 2, 1)
    assert (paired_bootstrap(a, b, level=0.4)["low"], paired_bootstrap(a, b, level=0.4)["high"]) == (0.5, 0.5)
    # One task, two seeds that differ: a draw of seeds is (0, 0), (0, 1), (1, 0) or (1, 1), so the interval is [0, 1]
    # too
    one = paired_bootstrap({"x": {0: 1, 1: 0}}, {"x": {0: 0, 1: 0}})
    assert (one["difference"], one["low"], one["high"]) == (0.5, 0.0, 1.0)
    assert (one["per_seed"], one["better"], one["worse"], one["discordant"], one["bound"]) == (
        {0: 1.0, 1: 0.0},
        1,
        0,
        1,
        None,
    )


def test_seeds_are_drawn_once_for_every_task():
    # 20 tasks; seed 0's model beats row b on every task, seed 1's on none. A seed is one trained model: a draw
    # of seeds is shared by the tasks, so with chance 1/4 each a draw holds seed 0 twice (mean 1) or seed 1 twice
    # (mean 0), and the 95 % interval is [0, 1]. Drawing seeds again inside each task (nested) would average 40
    # coin flips and give about [0.35, 0.65]: run-to-run variance divided by the number of tasks.
    a = {f"t{i}": {0: 1, 1: 0} for i in range(20)}
    b = {f"t{i}": {0: 0, 1: 0} for i in range(20)}
    got = paired_bootstrap(a, b)
    assert (got["difference"], got["low"], got["high"]) == (0.5, 0.0, 1.0)
    assert (got["per_seed"], got["better"], got["worse"]) == ({0: 1.0, 1: 0.0}, 1, 0)
    assert difference_text(got) == "+50.0 [+0.0, +100.0], better on 1 of 2 seeds"


def test_no_discordant_pair_is_no_information_with_an_exact_bound():
    # 112 tasks, one seed, the rows agree on every one: not "+0.0 [+0.0, +0.0]" but Clopper-Pearson's upper bound
    # for 0 of 112, 1 − 0.025^(1/112) = 1 − exp(−3.688879 / 112) = 1 − 0.967601 = 0.032399
    a = {f"t{i}": {0: int(i < 5)} for i in range(112)}
    got = paired_bootstrap(a, a)
    assert (got["difference"], got["discordant"], got["tasks"]) == (0.0, 0, 112)
    assert got["bound"] == pytest.approx(0.032399, abs=1e-6) == no_difference_bound(112)
    assert difference_text(got) == "no discordant pair (Δ within ±3.2 on 112 tasks)"


def test_the_crossed_interval_covers_with_a_seed_effect_shared_across_tasks():
    # The review's simulation (fidelity-2026-12-07 §1): 62 tasks × 3 seeds, each task its own base rate, each seed
    # one trained model whose effect (SD 10 points) every task shares, no true difference on average. The crossed
    # bootstrap's 95 % interval must cover 0 in at least 92 % of 300 replicates (nested resampling covered 84-88 %).
    rng = np.random.default_rng(7)
    base = rng.uniform(0.3, 0.6, size=62)
    covered = 0
    for r in range(300):
        effect = rng.normal(0.0, 0.10, size=3)
        a_out = rng.random((62, 3)) < np.clip(base[:, None] + effect[None, :], 0, 1)
        b_out = rng.random((62, 3)) < base[:, None]
        a = {f"t{t}": {s: float(a_out[t, s]) for s in range(3)} for t in range(62)}
        b = {f"t{t}": {s: float(b_out[t, s]) for s in range(3)} for t in range(62)}
        got = paired_bootstrap(a, b, draws=2000, seed=r)
        covered += got["low"] <= 0.0 <= got["high"]
    assert covered / 300 >= 0.92, covered


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


def test_the_auc_and_its_exact_p_by_hand():
    # Pairs (won, lost): 0.9 > 0.1, 0.9 > 0.85, 0.8 > 0.1, 0.8 < 0.85: 3 of 4. Ranks 0.1 → 1, 0.8 → 2, 0.85 → 3, 0.9 →
    # 4: the won sum 6 against a mean of 5; the 6 equally likely pairs of ranks sum to 3, 4, 5, 5, 6, 7, of which 4 are
    # at least 1 from 5: p = 2/3
    got = auc([0.9, 0.8], [0.1, 0.85])
    assert (got["auc"], got["positives"], got["negatives"]) == (0.75, 2, 2) and got["p"] == pytest.approx(2 / 3)
    assert got["contrast"] is None, "two against two are too few to tell a ranking from chance"
    assert auc([1.0], [1.0])["auc"] == 0.5 and auc([1.0], [1.0])["p"] == 1.0, "a tie counts half"
    # Ties take their mean rank: won [1, 1], lost [0, 1] have ranks (3, 3) and (1, 3); every pair of ranks sums to
    # 6 or 4, both 1 from the mean 5: p = 1, though the AUC is (1 + ½ + 1 + ½) / 4 = 0.75
    assert auc([1, 1], [0, 1]) == {"auc": 0.75, "p": 1.0, "positives": 2, "negatives": 2, "contrast": None}
    # 3 won of 36 held-out episodes, all ranked above the 33 lost: only 2 of the C(36, 3) = 7,140 choices are as
    # extreme (the top three and the bottom three): p = 2 / 7,140, yet too few won to call a contrast
    three = auc([0.9, 0.91, 0.92], [i / 100 for i in range(33)])
    assert three["auc"] == 1.0 and three["p"] == pytest.approx(2 / 7140) and three["contrast"] is None
    # 5 against 5, separated: p = 2 / C(10, 5) = 2 / 252, a contrast
    five = auc([0.6, 0.7, 0.8, 0.9, 1.0], [0.1, 0.2, 0.3, 0.4, 0.5])
    assert five["p"] == pytest.approx(2 / 252) and five["contrast"] is True
    assert auc([0.1, 0.2, 0.3, 0.4, 0.5], [0.6, 0.7, 0.8, 0.9, 1.0])["contrast"] is True, (
        "below chance is a contrast too"
    )
    # Interleaved, won on the odd hundredths and lost on the even: the won 2j + 1 is above j + 1 lost, Σ = 465 of 900
    mixed = auc([i / 100 for i in range(1, 60, 2)], [i / 100 for i in range(0, 60, 2)])
    assert mixed["auc"] == pytest.approx(465 / 900) and mixed["p"] > 0.5 and mixed["contrast"] is False
    assert auc([0.5], []) == {"auc": None, "p": None, "positives": 1, "negatives": 0, "contrast": None}


def test_the_normal_approximation_takes_over_from_the_exact_count_close_to_it(monkeypatch):
    rng = np.random.default_rng(3)
    won, lost = list(rng.normal(0.4, 1, 25).round(1)), list(rng.normal(0, 1, 40).round(1))  # ties included
    exact, is_exact = mann_whitney_p(won, lost)
    monkeypatch.setattr("qevolve.algos.stats.EXACT_CELLS", 10)
    normal, was_exact = mann_whitney_p(won, lost)
    assert is_exact and not was_exact and 0.01 < exact < 0.5 and normal == pytest.approx(exact, abs=0.01)
