"""The Dispatcher: how a rollout's groups are split over the generator replicas (pure bookkeeping:
no actors). Whole groups only, to eligible replicas only, in proportion to each replica's measured
speed and the work it still has."""

import pytest

from forge_core.controller import Dispatcher


def _check_partition(plan: dict, n: int, eligible: list) -> None:
    """Every group index 0..n-1 assigned exactly once, whole (a group is an index: never split),
    only to eligible replicas, and no replica listed without work."""
    got = sorted(g for gs in plan.values() for g in gs)
    assert got == list(range(n)), plan
    assert set(plan) <= set(eligible), plan
    assert all(plan.values()), plan


def _round(d: Dispatcher, n: int, eligible: list, seconds_per_group: dict) -> dict:
    """One rollout: assign ``n`` groups, then report each replica done after its per-group time."""
    plan = d.assign(n, eligible)
    _check_partition(plan, n, eligible)
    for r, gs in plan.items():
        d.done(r, len(gs), len(gs) * seconds_per_group[r])
    assert d.outstanding == [0] * len(d.outstanding)
    return plan


def test_dispatcher_balances_equal_replicas():
    d = Dispatcher(3)
    for n in (3, 6, 9, 12, 30):  # no speed known yet, then equal measured speeds
        plan = _round(d, n, [0, 1, 2], {0: 1.0, 1: 1.0, 2: 1.0})
        sizes = [len(plan.get(r, [])) for r in range(3)]
        assert max(sizes) - min(sizes) <= 1 and sum(sizes) == n, sizes
    plan = _round(d, 7, [0, 1, 2], {0: 1.0, 1: 1.0, 2: 1.0})  # not divisible: off by at most one
    sizes = sorted(len(v) for v in plan.values())
    assert sizes == [2, 2, 3], plan


def test_dispatcher_gives_a_slow_replica_less():
    d = Dispatcher(3)
    speed = {0: 3.0, 1: 1.0, 2: 1.0}  # replica 0 takes 3x longer per group
    first = _round(d, 12, [0, 1, 2], speed)
    assert [len(first[r]) for r in range(3)] == [4, 4, 4]  # nothing measured yet: even split
    for _ in range(3):
        plan = _round(d, 12, [0, 1, 2], speed)
        sizes = [len(plan.get(r, [])) for r in range(3)]
        # proportional to speed would be 12 * (1/3) / (1/3 + 2) = 1.7 groups for the slow one
        assert sizes[0] * 2 <= min(sizes[1], sizes[2]), sizes
        assert sizes[0] <= 3 and sum(sizes) == 12, sizes
    # it recovers: the slow replica becomes as fast as the others, its share comes back
    for _ in range(6):
        plan = _round(d, 12, [0, 1, 2], {0: 1.0, 1: 1.0, 2: 1.0})
    assert sorted(len(v) for v in plan.values()) == [4, 4, 4], plan


def test_dispatcher_counts_outstanding_work():
    """A replica still busy with earlier groups gets less of the next batch (overlapping rollouts)."""
    d = Dispatcher(2)
    a = d.assign(4, [0, 1])
    assert [len(a[0]), len(a[1])] == [2, 2]
    d.done(1, 2, 2.0)  # replica 1 finished; replica 0 still has its 2 groups
    b = d.assign(4, [0, 1])
    _check_partition(b, 4, [0, 1])
    assert len(b.get(0, [])) < len(b[1]), b


def test_dispatcher_only_eligible_replicas():
    d = Dispatcher(4)
    for eligible in ([2], [1, 3], [0, 3], [3, 2, 1]):
        plan = _round(d, 5, eligible, {r: 1.0 for r in range(4)})
        assert set(plan) <= set(eligible)
    plan = d.assign(3, [1])
    assert plan == {1: [0, 1, 2]}
    with pytest.raises(ValueError, match="no generator replica is eligible"):
        d.assign(2, [])
