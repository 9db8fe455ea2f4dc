"""Transfer counters, owned by one Sender or Receiver (no global registry).

The worker exports snapshot() however it likes (Prometheus, Redis heartbeat, logs).
"""

from __future__ import annotations

from collections import Counter


class TransferMetrics:
    """bytes: payload bytes written (sender) or verified (receiver).
    transfers: completed transfers (sender: all writes done and TransferDone sent;
               receiver: verified ready).
    duration_s_sum / duration_count: seconds per completed transfer (sender: first send() to
               TransferDone; receiver: reserve() to verified).
    failures: count per reason code (e.g. "checksum", "expired", "xfer_error").
    """

    def __init__(self) -> None:
        self.bytes = 0
        self.transfers = 0
        self.duration_s_sum = 0.0
        self.duration_count = 0
        self.failures: Counter[str] = Counter()

    def completed(self, nbytes: int, seconds: float) -> None:
        self.bytes += nbytes
        self.transfers += 1
        self.duration_s_sum += seconds
        self.duration_count += 1

    def failed(self, reason: str) -> None:
        self.failures[reason] += 1

    def snapshot(self) -> dict:
        return {
            "bytes": self.bytes,
            "transfers": self.transfers,
            "duration_s_sum": self.duration_s_sum,
            "duration_count": self.duration_count,
            "failures": dict(self.failures),
        }
