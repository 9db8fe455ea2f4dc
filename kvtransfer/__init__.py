"""v4serve kvtransfer: move a request's KV pages between workers over NIXL.

It moves pages of memory regions that its caller describes (see docs/kvtransfer.md):
layout.py (what must match), regions.py (page lists -> descriptors), checksum.py, protocol.py
(wire types), agent.py (NIXL), write_plan.py (a send's parts -> spans), sender.py / receiver.py
(the protocol's two sides), faults.py, metrics.py; transport.py names the agent interface the two
sides drive, which agent.py (NIXL) and local_agent.py (peers in one process) implement. Importing
this package does not import nixl; constructing an Agent does.
"""

from .checksum import page_checksum, pool_checksums
from .faults import FaultPlan
from .layout import LayoutDescriptor, PoolLayout
from .metrics import TransferMetrics
from .protocol import Ack, Begin, Fenced, TransferDone, TransferTarget, decode, decode_target
from .receiver import OutOfPages, Receiver, ReceiverEvent
from .regions import Span, SpanBatch, coalesce, layer_byte_range
from .sender import (LayoutMismatch, LeaseExpired, NotConnected, Posted, RequestClosed, Sender,
                     SenderEvent, StaleTarget)
from .agent import Agent
from .local_agent import AgentDirectory, LocalAgent
from .transport import RemotePeer, TransferAgent, TransferError
from .write_plan import SendPart

__all__ = [
    "Ack", "Agent", "AgentDirectory", "Begin", "FaultPlan", "Fenced", "LayoutDescriptor",
    "LayoutMismatch", "LeaseExpired", "LocalAgent", "NotConnected", "OutOfPages", "PoolLayout",
    "Posted", "Receiver", "ReceiverEvent", "RemotePeer", "RequestClosed", "SendPart", "Sender",
    "SenderEvent", "Span", "SpanBatch", "StaleTarget", "TransferAgent", "TransferDone",
    "TransferError", "TransferMetrics", "TransferTarget", "coalesce", "decode", "decode_target",
    "layer_byte_range", "page_checksum", "pool_checksums",
]
