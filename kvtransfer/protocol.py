"""Wire types of the transfer protocol (see docs/kvtransfer.md).

    receiver (D)                                   sender (P)
    reserve() -> TransferTarget  ── out of band ──▶  send(target, pages)      [router / Ray call]
                                 ◀──── Begin ─────   (right after its first WRITE is posted)
                                 ◀═══ WRITEs ═════   one-sided NIXL writes, maybe per layer
                                 ◀─ TransferDone ─   finish(): after all writes completed
    verify checksums
                                 ──── Ack ───────▶   sender frees its hold on the pages
    (abort/expire/reject)        ──── Ack ───────▶   stop writing
                                 ◀─── Fenced ─────   nothing in flight: receiver may reuse pages

Every message is one byte of tag followed by compact JSON; bytes fields are base64. Messages
other than the target travel as NIXL notifications. `agent_epoch` / `target_epoch` is the
receiver's per-process random id: a restarted receiver has a new one, so anything addressed to
its previous incarnation is refused instead of written into a stale registration.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Union

# Ack.status values
ACK_OK = "ok"               # verified and admitted: sender may free its pages
ACK_REJECTED = "rejected"   # checksum failed and the receiver released the reservation
ACK_ABORTED = "aborted"     # receiver's caller aborted the request
ACK_EXPIRED = "expired"     # lease ran out before a verified TransferDone arrived
ACK_STATUSES = (ACK_OK, ACK_REJECTED, ACK_ABORTED, ACK_EXPIRED)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode())


@dataclass(frozen=True)
class TransferTarget:
    """Where to write a request's pages: handed from receiver to sender out of band.

    page_ids: per kind, the receiver's page ids in request order (same order and count as the
    sender's pages of that kind). lease_deadline: unix seconds after which the receiver may
    reuse the pages; the sender posts no write after it.
    """

    request_id: str
    agent_name: str
    agent_epoch: str
    layout_id: str
    page_ids: tuple[tuple[str, tuple[int, ...]], ...]
    lease_deadline: float

    def pages(self) -> dict[str, tuple[int, ...]]:
        return dict(self.page_ids)

    def to_bytes(self) -> bytes:
        return b"T" + json.dumps({
            "r": self.request_id, "n": self.agent_name, "e": self.agent_epoch,
            "l": self.layout_id, "p": [[k, list(ids)] for k, ids in self.page_ids],
            "d": self.lease_deadline,
        }, separators=(",", ":")).encode()

    @classmethod
    def from_dict(cls, d: dict) -> TransferTarget:
        return cls(d["r"], d["n"], d["e"], d["l"],
                   tuple((k, tuple(int(i) for i in ids)) for k, ids in d["p"]), float(d["d"]))


@dataclass(frozen=True)
class Begin:
    """Sender -> receiver with its first write (sent right after posting it, so the bytes start
    moving first): tells the receiver whom to stop on abort."""

    request_id: str
    target_epoch: str

    def to_bytes(self) -> bytes:
        return b"B" + json.dumps({"r": self.request_id, "e": self.target_epoch},
                                 separators=(",", ":")).encode()

    @classmethod
    def from_dict(cls, d: dict) -> Begin:
        return cls(d["r"], d["e"])


@dataclass(frozen=True)
class TransferDone:
    """Sender -> receiver after every write of this attempt has completed at the receiver.

    checksums: per kind, checksum.page_checksum of the sender's pages in request order.
    attempt: 1 for the first finish(), +1 for each resend into the same reservation; a
    notification with an attempt already seen is a duplicate and is ignored.
    nbytes: bytes written for this request (all attempts' sends of this attempt).
    """

    request_id: str
    target_epoch: str
    attempt: int
    checksums: tuple[tuple[str, int], ...]
    header: bytes
    nbytes: int

    def to_bytes(self) -> bytes:
        return b"D" + json.dumps({
            "r": self.request_id, "e": self.target_epoch, "a": self.attempt,
            "c": [[k, v] for k, v in self.checksums], "h": _b64(self.header), "b": self.nbytes,
        }, separators=(",", ":")).encode()

    @classmethod
    def from_dict(cls, d: dict) -> TransferDone:
        return cls(d["r"], d["e"], int(d["a"]), tuple((k, int(v)) for k, v in d["c"]),
                   _unb64(d["h"]), int(d["b"]))


@dataclass(frozen=True)
class Ack:
    """Receiver -> sender: the receiver is done with the sender's data (status says why)."""

    request_id: str
    target_epoch: str
    status: str
    lease_deadline: float

    def __post_init__(self) -> None:
        if self.status not in ACK_STATUSES:
            raise ValueError(f"bad ack status {self.status!r}")

    def to_bytes(self) -> bytes:
        return b"A" + json.dumps({"r": self.request_id, "e": self.target_epoch,
                                  "s": self.status, "d": self.lease_deadline},
                                 separators=(",", ":")).encode()

    @classmethod
    def from_dict(cls, d: dict) -> Ack:
        return cls(d["r"], d["e"], d["s"], float(d["d"]))


@dataclass(frozen=True)
class Fenced:
    """Sender -> receiver: no write for this request is in flight and none will be posted."""

    request_id: str
    target_epoch: str

    def to_bytes(self) -> bytes:
        return b"F" + json.dumps({"r": self.request_id, "e": self.target_epoch},
                                 separators=(",", ":")).encode()

    @classmethod
    def from_dict(cls, d: dict) -> Fenced:
        return cls(d["r"], d["e"])


Message = Union[TransferTarget, Begin, TransferDone, Ack, Fenced]
_BY_TAG = {b"T": TransferTarget, b"B": Begin, b"D": TransferDone, b"A": Ack, b"F": Fenced}
TAGS = tuple(_BY_TAG)


def decode(data: bytes) -> Message:
    """Parse any protocol message; raises ValueError on an unknown tag or malformed body."""
    cls = _BY_TAG.get(bytes(data[:1]))
    if cls is None:
        raise ValueError(f"unknown message tag {bytes(data[:1])!r}")
    try:
        return cls.from_dict(json.loads(data[1:]))
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"malformed {cls.__name__}: {e}") from e


def decode_target(data: bytes) -> TransferTarget:
    msg = decode(data)
    if not isinstance(msg, TransferTarget):
        raise ValueError(f"expected a TransferTarget, got {type(msg).__name__}")
    return msg
