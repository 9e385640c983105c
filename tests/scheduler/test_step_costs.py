"""The step-cost model speculation chooses by: measured, interpolated, extrapolated."""

from __future__ import annotations

import pytest

from hybridkv.scheduler.step_costs import StepCosts


def test_nothing_measured_has_no_estimate() -> None:
    costs = StepCosts()
    assert costs.estimate(8) is None
    assert len(costs) == 0


def test_a_count_below_every_measured_one_has_no_estimate() -> None:
    costs = StepCosts()
    costs.record(8, 0.1)
    assert costs.estimate(7) is None
    assert costs.estimate(8) == pytest.approx(0.1)


def test_one_measured_count_is_the_estimate_above_it() -> None:
    """Untried counts above the only measured one look as cheap, so they are tried."""
    costs = StepCosts()
    costs.record(8, 0.1)
    assert costs.estimate(20) == pytest.approx(0.1)


def test_between_measured_counts_on_their_line() -> None:
    """The tile steps of a CPU kernel show up once measured: 9 interpolates 8 and 12
    until 9 itself runs."""
    costs = StepCosts()
    costs.record(8, 0.100)
    costs.record(12, 0.140)
    assert costs.estimate(10) == pytest.approx(0.120)
    costs.record(9, 0.135)
    assert costs.estimate(9) == pytest.approx(0.135)
    assert costs.estimate(11) == pytest.approx(0.135 + 2 / 3 * 0.005)


def test_above_the_last_along_the_least_squares_slope() -> None:
    costs = StepCosts()
    for rows, seconds in [(1, 0.04), (4, 0.06), (8, 0.10)]:
        costs.record(rows, seconds)
    # The slope of a least-squares line through the three points.
    xs, ys = [1, 4, 8], [0.04, 0.06, 0.10]
    mx, my = sum(xs) / 3, sum(ys) / 3
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    assert costs.estimate(12) == pytest.approx(0.10 + 4 * slope)


def test_a_falling_line_never_makes_more_rows_cheaper() -> None:
    costs = StepCosts()
    costs.record(4, 0.2)  # a slow outlier
    costs.record(8, 0.1)
    assert costs.estimate(16) == pytest.approx(0.1)


def test_repeated_counts_follow_a_moving_average() -> None:
    costs = StepCosts()
    costs.record(8, 0.1)
    costs.record(8, 0.2)
    estimate = costs.estimate(8)
    assert estimate is not None
    assert 0.1 < estimate < 0.2
    assert len(costs) == 1


def test_engines_of_one_executor_share_its_costs() -> None:
    """The costs are the executor's: a second engine on it starts from what the first
    measured; another executor starts from nothing."""

    class Executor:
        pass

    one, other = Executor(), Executor()
    StepCosts.of(one).record(8, 0.1)
    assert StepCosts.of(one).estimate(8) == pytest.approx(0.1)
    assert StepCosts.of(other).estimate(8) is None


def test_exploration_comes_less_often_and_tries_each_offset() -> None:
    """After 16 choices, then 32 more, 64, 128, then every 256: none, 1, 2, 4 in turn."""
    costs = StepCosts()
    explored = [(i, e) for i in range(1, 1200) if (e := costs.exploration()) is not None]
    assert [i for i, _ in explored] == [16, 48, 112, 240, 496, 752, 1008]
    assert [e for _, e in explored] == [1, 2, 4, 0, 1, 2, 4]
