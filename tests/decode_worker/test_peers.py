"""KnownPeers: a decode worker loads each incarnation of a peer once, and never goes back to one
that a restart replaced (a router's registry view may still name it for a refresh)."""

import asyncio

import pytest
import torch

from decode_worker.peers import KnownPeers, StalePeer
from worker_runtime.wire import WorkerInfo, WorkerLoad

pytest.importorskip("nixl")

from kvtransfer.agent import Agent  # noqa: E402


def _agent(name: str) -> Agent:
    return Agent(name, {"swa": torch.zeros(2, 64, dtype=torch.uint8)}, progress_thread=False)


def test_each_incarnation_loads_once_and_a_replaced_one_is_refused():
    me, old = _agent("decode-0"), _agent("prefill-0")
    new = None
    try:
        peers = KnownPeers(me)
        assert peers.load("prefill-0", old.epoch, old.metadata()) == old.nixl_name
        assert peers.load("prefill-0", old.epoch, b"not read again") == old.nixl_name  # loaded already
        new = _agent("prefill-0")  # restarted under the same name: a new peer
        assert peers.load("prefill-0", new.epoch, new.metadata()) == new.nixl_name
        with pytest.raises(StalePeer, match="restarted"):
            peers.load("prefill-0", old.epoch, old.metadata())
        assert me.peer("prefill-0").epoch == new.epoch  # not swapped back
        with pytest.raises(ValueError):  # metadata of another incarnation than it claims
            peers.load("prefill-0", "f" * 16, new.metadata())
    finally:
        for a in (me, old, new):
            if a is not None:
                a.close()


def _entry(agent: Agent) -> WorkerInfo:
    """The registry entry of a prefill worker whose agent is `agent`."""
    return WorkerInfo(agent.name, "prefill", agent.name, agent.name, agent.epoch, "{}", agent.metadata(),
                      WorkerLoad(agent.name, "prefill"))


def test_a_prefill_worker_is_loaded_from_its_registry_entry_without_asking_it():
    me, old = _agent("decode-0"), _agent("prefill-0")
    new = None
    try:
        peers = KnownPeers(me)
        # no actor to ask (None): the entry alone must do
        assert asyncio.run(peers.load_prefill(None, _entry(old))) == (old.nixl_name, old.epoch)
        new = _agent("prefill-0")
        assert asyncio.run(peers.load_prefill(None, _entry(new))) == (new.nixl_name, new.epoch)
        # a router whose view predates the restart: stale, so the request is prefilled locally
        assert asyncio.run(peers.load_prefill(None, _entry(old))) is None
        assert me.peer("prefill-0").epoch == new.epoch
    finally:
        for a in (me, old, new):
            if a is not None:
                a.close()
