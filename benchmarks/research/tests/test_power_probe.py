"""The sample arithmetic of benchmarks/research/power_probe.py on hand-made nvidia-smi lines (the GPU run
samples a real board; the parsing and the window means are checked here)."""

import datetime

from benchmarks.research.power_probe import parse, summarise


def line(t: float, clock: int, power: float, reasons: int) -> str:
    stamp = datetime.datetime.fromtimestamp(t).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    return f"{stamp}, {clock}, {power:.2f}, 0x{reasons:016x}"


def test_parse_reads_the_query_fields():
    t, clock, power, reasons = parse(line(1_000_000.25, 1845, 694.5, 0x4))
    assert abs(t - 1_000_000.25) < 1e-3 and clock == 1845 and power == 694.5 and reasons == 0x4


def test_window_means_leave_out_the_ramp_and_count_only_the_power_cap():
    t0 = 1_000_000.0
    samples = [parse(line(t0 + 0.1 * i, 1980, 150.0, 0x1)) for i in range(10)]  # the first second: ramp
    samples += [parse(line(t0 + 1.0 + 0.1 * i, 1800 if i % 2 else 1900, 700.0 if i % 2 else 690.0,
                           0x4 if i % 2 else 0x1)) for i in range(10)]
    samples += [parse(line(t0 + 5.0, 1980, 300.0, 0x4))]  # after the window
    row = summarise(samples, dict(label="w", start=t0, end=t0 + 2.0, ms=1.0))
    assert row["samples"] == 10
    assert row["clock_mhz"] == 1850 and row["clock_min_mhz"] == 1800 and row["power_w"] == 695
    assert row["capped"] == 0.5  # 0x1 (idle) is another reason, not the cap
    assert summarise(samples, dict(label="empty", start=t0 + 10, end=t0 + 11, ms=1.0))["samples"] == 0
