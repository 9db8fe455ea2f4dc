"""A sender never goes back to an incarnation of a peer that a later handshake replaced: metadata of
a restarted peer's old self (a late request of the old incarnation) is refused, and the handshake
with the new one stays in place."""

import pytest
import torch

from kvtransfer import Sender, StaleTarget
from kvt_harness import make_layout

LAYOUT = make_layout(num_pages=4)


def _pools():
    return {p.kind: torch.zeros(p.num_pages, p.page_bytes, dtype=torch.uint8) for p in LAYOUT.pools}


def test_old_incarnation_is_refused_after_a_new_handshake(new_agent):
    a, old, new = new_agent("ra", _pools()), new_agent("rb", _pools()), None
    try:
        sender = Sender(a, LAYOUT)
        sender.handshake("rb", old.metadata(), LAYOUT)
        sender.handshake("rb", old.metadata(), LAYOUT)  # the same incarnation again: fine
        new = new_agent("rb", _pools())  # restarted under the same name
        sender.handshake("rb", new.metadata(), LAYOUT)
        with pytest.raises(StaleTarget, match="restarted since"):
            sender.handshake("rb", old.metadata(), LAYOUT)
        assert a.peer("rb").epoch == new.epoch  # not swapped out
        assert sender.metrics.failures["stale_target"] == 1
    finally:
        for ag in (a, old, new):
            if ag is not None:
                ag.close()
