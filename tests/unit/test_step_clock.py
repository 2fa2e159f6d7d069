"""The GPU step time the adaptive policy learns from (speculative/worker.StepClock), against intervals
worked out by hand from launch and result times (ms)."""

import pytest

from tandem.speculative.worker import StepClock


def at(ms: float) -> float:
    return ms / 1e3


def test_a_step_launched_while_the_previous_one_runs_counts_from_that_ones_results():
    """Overlap: a prompt step P is launched at 0 and its results arrive at 30; the first decode step D1
    is launched at 8 (while P runs) and its results arrive at 35: D1 took 5 ms, not 27."""
    clock = StepClock()
    assert clock.collected(at(0), now=at(30)) == pytest.approx(30)  # P (the policy does not time it)
    assert clock.collected(at(8), now=at(35)) == pytest.approx(5)  # D1
    assert clock.collected(at(31), now=at(40)) == pytest.approx(5)  # D2: launched before D1's results


def test_a_step_launched_after_an_idle_gap_counts_from_its_launch():
    clock = StepClock()
    clock.collected(at(0), now=at(5))
    assert clock.collected(at(100), now=at(106)) == pytest.approx(6)
