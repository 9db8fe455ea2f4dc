"""serve_bench.py reads the router's counters from /metrics before and after a level: the KV
transfer totals and the decode-side prefills by reason, as the router renders them."""

from benchmarks.serve_bench import deltas, parse_totals
from router.metrics import RouterMetrics


def test_decode_side_prefills_are_read_per_reason_and_their_growth_over_a_level_reported():
    m = RouterMetrics()
    m.decode_prefill("short_prompt")
    m.kv_transfer_done(1000, 0.5, 0.01)
    before = parse_totals(m.render()[0].decode())
    assert before["decode_prefill_short_prompt"] == 1.0 and before["wire_count"] == 1.0
    for reason in ("short_prompt", "expired", "expired", "no_room"):
        m.decode_prefill(reason)
    m.kv_transfer_failed("expired")
    after = parse_totals(m.render()[0].decode())
    assert deltas(before, after, "decode_prefill_") == {"short_prompt": 1, "expired": 2, "no_room": 1}
    assert deltas(before, after, "failed_") == {"expired": 1}
    assert deltas(after, after, "decode_prefill_") == {}
