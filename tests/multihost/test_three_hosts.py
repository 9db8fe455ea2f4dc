"""The CI tier's cross-host test: three hosts (network namespaces on a bridge), the smallest
split that takes KV across the network.

    host 0: Ray head, Valkey, `v4serve up` (router)   host 1: prefill-0   host 2: decode-0

Pinned by `--prefill-resources` / `--decode-resources` (the head advertises both roles too, so
only the pins keep the workers off it), requests over HTTP and gRPC give exactly `v4serve
generate`'s tokens, and their KV leaves host 1 through its network interface (UCX over TCP:
shared memory would never touch it). The five-host module (test_hosts_cluster.py, exhaustive)
adds prefix affinity and migration.
"""

from __future__ import annotations

import pytest

from tests.multihost.agent import Agent
from tests.multihost.hosts import Hosts
from tests.multihost.ray_hosts import RayHosts, RayHostsConfig
from tests.multihost.serve import UpOnHost
from tests.multihost.work import DECODE_NODE, PINS, PREFILL_NODE, workload

pytest.importorskip("nixl")

pytestmark = [pytest.mark.multihost, pytest.mark.cluster]


def test_kv_crosses_hosts_and_outputs_equal_generate(tiny_official_ckpt, reference):
    with Hosts(3, subnet="10.215.0", limit_s=900) as hosts:
        ray_hosts = RayHosts(hosts, RayHostsConfig(nodes={1: PREFILL_NODE, 2: DECODE_NODE},
                                                   head_resources={"prefill": 1, "decode": 1})).start()
        up = UpOnHost(hosts, ray_hosts, 0, tiny_official_ckpt,
                      ["--prefill", "1", "--decode", "1", "--max-model-len", "1024", "--remote-prefill-threshold",
                       "64", *PINS])
        agent = Agent(hosts, 0, ray_hosts.env())
        try:
            placed = agent.call("placement")
            assert placed["prefill-0"]["ip"] == hosts[1].ip and placed["decode-0"]["ip"] == hosts[2].ip, placed
            sent = hosts.counters(1)["tx_bytes"]
            work = workload(4, seed=5, lengths=(100, 300))  # all prefilled on host 1
            urls = {"http": up.http, "grpc": up.grpc}
            got = agent.call("generate", requests=[dict(w, url=urls[w["door"]]) for w in work])
            for i, (w, tokens) in enumerate(zip(work, got)):
                assert tokens == reference(w), (i, w["door"], tokens)
            kv = agent.call("metrics", url=up.http)["v4serve_kv_transfer_bytes_total"]
            assert kv > 0 and hosts.counters(1)["tx_bytes"] - sent >= kv
        finally:
            agent.close()
            assert up.stop() == 0
