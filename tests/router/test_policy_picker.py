import pytest

from router.policies.picker import combine, pick
from worker_runtime.wire import WorkerLoad


def w(wid, draining=False):
    return WorkerLoad(wid, "decode", draining=draining)


@pytest.mark.parametrize("weighted,want", [
    ([], []),
    ([(1.0, [0.2, 0.8])], [0.2, 0.8]),
    ([(1.0, [1.0, 0.0]), (1.0, [0.0, 0.5])], [0.5, 0.25]),
    ([(3.0, [1.0, 0.0]), (1.0, [0.0, 1.0])], [0.75, 0.25]),
    ([(0.0, [1.0, 0.0])], [0.0, 0.0]),
])
def test_combine(weighted, want):
    assert combine(weighted) == pytest.approx(want)


def test_combine_rejects_bad_input():
    with pytest.raises(ValueError):
        combine([(1.0, [1.0]), (1.0, [1.0, 0.0])])
    with pytest.raises(ValueError):
        combine([(-1.0, [1.0])])


ENDS = [w("a"), w("b"), w("c")]


@pytest.mark.parametrize("endpoints,scores,key,want", [
    (ENDS, [0.1, 0.9, 0.5], "", "b"),
    (ENDS, [0.9, 0.9, 0.1], "k1", None),  # a tie: decided by the key, always one of a/b
    ([w("a", draining=True), w("b")], [1.0, 0.1], "", "b"),
    ([w("a", draining=True)], [1.0], "", "none"),
    ([], [], "", "none"),
])
def test_pick(endpoints, scores, key, want):
    got = pick(endpoints, scores, key)
    if want == "none":
        assert got is None
    elif want is None:
        assert got.worker_id in ("a", "b") and pick(endpoints, scores, key) == got  # deterministic
    else:
        assert got.worker_id == want


def test_ties_spread_over_keys():
    chosen = {pick(ENDS, [1.0, 1.0, 1.0], f"req-{i}").worker_id for i in range(64)}
    assert chosen == {"a", "b", "c"}
