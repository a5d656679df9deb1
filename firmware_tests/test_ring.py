from edge_runtime.ring import Ring
from firmware_tests.support import raises


def test_ring_keeps_newest_and_counts_drops():
    r = Ring(3)
    for i in range(5):
        r.push(i)
    assert list(r) == [2, 3, 4]
    assert r.dropped == 2
    assert len(r) == 3


def test_ring_pops_oldest_first_and_empties():
    r = Ring(2)
    r.push("a")
    r.push("b")
    assert r.pop() == "a"
    assert r.pop() == "b"
    raises(IndexError, r.pop)
    assert r.dropped == 0


def test_ring_rejects_zero_capacity():
    raises(ValueError, Ring, 0)


def test_ring_at_indexes_from_the_oldest():
    r = Ring(3)
    for i in range(4):
        r.push(i)
    assert [r.at(k) for k in range(3)] == [1, 2, 3]
    raises(IndexError, r.at, 3)
    raises(IndexError, r.at, -1)
