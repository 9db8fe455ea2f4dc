"""The arithmetic of benchmarks/research/overlap_headroom_probe.py (the GPU run measures a real step beside a
real streamer; what it derives from the two timings is checked here)."""

import pytest

from benchmarks.research.overlap_headroom_probe import Streamer, concurrent_rate


def test_the_streamer_rate_beside_the_replays_leaves_out_what_it_read_alone_after_them():
    # 10 GB in 4 s; the replays took 3 s; alone it reads 4 GB/s, so the last second read 4 GB and
    # the replays' 3 s saw the other 6 GB
    assert concurrent_rate(10e9, 4e9, 4.0, 3.0) == pytest.approx(2e9)
    # ended with the replays: everything it read was read beside them
    assert concurrent_rate(6e9, 4e9, 3.0, 3.0) == pytest.approx(2e9)
    # timing noise can make the alone estimate exceed the total: no negative rate
    assert concurrent_rate(1e9, 4e9, 4.0, 3.0) == 0.0


def test_a_streamer_that_ended_before_the_replays_is_refused():
    with pytest.raises(ValueError, match="ended before the replays"):
        concurrent_rate(10e9, 4e9, 2.0, 3.0)


def test_streamer_specs_are_parsed_and_bad_ones_named():
    s = Streamer.parse("132x2x8")
    assert (s.programs, s.warps, s.unroll) == (132, 2, 8)
    assert s.chunk_words * 4 == 2 * 8 * 512  # warps · unroll · 512 bytes in flight a program
    assert s.label() == "132x2x8"
    for bad in ("132x2", "132x3x8", "132x2x6", "0x1x1", "ax1x1"):
        with pytest.raises(ValueError, match=bad):
            Streamer.parse(bad)
