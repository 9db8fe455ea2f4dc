"""The timeline split of benchmarks/research/step_timeline.py on hand-made kernel intervals (the GPU run
profiles real graph replays; the arithmetic is checked here)."""

import pytest

from benchmarks.research.step_timeline import Kernel, analyse, kernels_of_trace, layer_spans, merged, replays


def step(offset: float = 0.0) -> list[Kernel]:
    """Main stream 1: a [0, 10), b [12, 20), c [30, 40); side stream 2: s [5, 25)."""
    spans = [("a", 1, 0, 10), ("b", 1, 12, 20), ("c", 1, 30, 40), ("s", 2, 5, 25)]
    return [Kernel(n, st, s + offset, e + offset) for n, st, s, e in spans]


def test_split_of_one_step():
    s = analyse(step())
    assert s["main_stream"] == 1
    assert s["wall_us"] == 40 and s["main_busy_us"] == 28
    assert s["side_only_us"] == 7  # [10, 12) and [20, 25)
    assert s["all_idle_us"] == 5  # [25, 30)
    assert s["overlap_us"] == 13  # s over a [5, 10) and b [12, 20)
    assert s["main_gaps"] == 2 and s["main_gap_us"] == 12
    longest = s["longest_gaps"][0]
    assert (longest["after"], longest["before"], longest["us"], longest["side_busy_us"]) == ("b", "c", 10, 5)
    assert list(s["wait_before"]) == ["c", "b"]
    assert s["main_self_overlap_us"] == 0
    # a trace that put every branch on one stream: its kernels overlap, which the split flags
    one_stream = [Kernel(k.name, 1, k.start, k.end) for k in step()]
    assert analyse(one_stream)["main_self_overlap_us"] == 13


def test_merged_intervals_and_replays():
    assert merged([(5, 8), (0, 3), (2, 4), (8, 9)]) == [(0, 4), (5, 9)]
    runs = replays(step() + step(100.0), 2)
    assert [len(r) for r in runs] == [4, 4] and min(k.start for k in runs[1]) == 100
    assert analyse(runs[1])["wall_us"] == 40
    with pytest.raises(ValueError, match="replays"):
        replays(step()[:3], 2)
    with pytest.raises(ValueError, match="no kernels"):
        analyse([])


def test_kernels_of_a_chrome_trace():
    trace = {"traceEvents": [
        {"cat": "kernel", "name": "_fp8_a8_kernel", "ts": 10.0, "dur": 14.5, "args": {"stream": 7}},
        {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 1.0, "dur": 3.0, "args": {}},
        {"cat": "kernel", "name": "_post_comb_kernel", "ts": 12.0, "dur": 5.0, "args": {"stream": 9}},
    ]}
    assert kernels_of_trace(trace) == [Kernel("_fp8_a8_kernel", 7, 10.0, 24.5),
                                       Kernel("_post_comb_kernel", 9, 12.0, 17.0)]


def test_layer_spans_by_marker():
    """Two layers of two entries each: spans from each layer's first entry, the last to the end."""
    ks = [Kernel("entry", 1, 0, 2), Kernel("x", 2, 2, 9), Kernel("entry", 1, 9, 10),
          Kernel("entry", 3, 12, 13), Kernel("y", 1, 13, 20), Kernel("entry", 1, 20, 21), Kernel("z", 4, 21, 30)]
    assert layer_spans(ks, "entry", 2) == [12, 18]
    assert layer_spans(ks, "entry", 1) == [9, 3, 8, 10]
    with pytest.raises(ValueError, match="layers of 3"):
        layer_spans(ks, "entry", 3)
    with pytest.raises(ValueError, match="layers of 2"):
        layer_spans(ks, "nothing", 2)
