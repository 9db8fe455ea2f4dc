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
    ignored: notifications deliberately not acted on, per reason ("duplicate").
    injected: faults a FaultPlan injected here, per fault ("drop_TransferDone", "truncate_write",
               ...): what the chaos suite reads to know its fault really fired.
    """

    def __init__(self) -> None:
        self.bytes = 0
        self.transfers = 0
        self.duration_s_sum = 0.0
        self.duration_count = 0
        self.failures: Counter[str] = Counter()
        self.ignored: Counter[str] = Counter()
        self.injected: Counter[str] = Counter()

    def completed(self, nbytes: int, seconds: float) -> None:
        self.bytes += nbytes
        self.transfers += 1
        self.duration_s_sum += seconds
        self.duration_count += 1

    def failed(self, reason: str) -> None:
        self.failures[reason] += 1

    def ignore(self, reason: str) -> None:
        self.ignored[reason] += 1

    def inject(self, fault: str) -> None:
        self.injected[fault] += 1

    def snapshot(self) -> dict:
        return {
            "bytes": self.bytes,
            "transfers": self.transfers,
            "duration_s_sum": self.duration_s_sum,
            "duration_count": self.duration_count,
            "failures": dict(self.failures),
            "ignored": dict(self.ignored),
            "injected": dict(self.injected),
        }
