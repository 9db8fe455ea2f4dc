"""The CI tier's cross-host tests: one cluster on five hosts (network namespaces on a bridge,
tests/multihost/hosts.py), shared by every test of the module.

    host 0: Ray head, Valkey, `v4serve up` (router, HTTP and gRPC)   10.213.0.1
    host 1, 4: Ray nodes advertising {prefill, v4serve_prefill}        prefill-0, prefill-1
    host 2, 3: Ray nodes advertising {decode, v4serve_decode}          decode-0, decode-1

The head also advertises `prefill` and `decode`, so only `--prefill-resources v4serve_prefill=1
--decode-resources v4serve_decode=1` keeps the pools off it. UCX uses TCP on each host's eth0
only. Checked: the pools sit where they were pinned; requests over HTTP and gRPC give exactly
`v4serve generate`'s tokens, their KV crossing from the prefill hosts to the decode hosts over
UCX TCP (the protocol UCX reports, and the prefill hosts' interfaces sending the bytes); repeats
of a prompt go to the prefill host holding its prefix; a running request migrates from one
decode host to the other and ends with the same tokens; a `v4serve router` on a decode host
serves the same pools.
"""

from __future__ import annotations

import random
import re
import time
from pathlib import Path

import pytest

from tests.multihost.agent import Agent
from tests.multihost.hosts import Hosts
from tests.multihost.ray_hosts import RayHosts, RayHostsConfig
from tests.multihost.serve import UpOnHost
from tests.multihost.work import DECODE_NODE, PINS, PREFILL_NODE, workload

pytest.importorskip("nixl")

pytestmark = [pytest.mark.multihost, pytest.mark.cluster]

PREFILL_HOSTS, DECODE_HOSTS = (1, 4), (2, 3)


class Cluster:
    def __init__(self, hosts: Hosts, ray_hosts: RayHosts, up: UpOnHost, agent: Agent):
        self.hosts, self.ray_hosts, self.up, self.agent = hosts, ray_hosts, up, agent

    def generate(self, work: list[dict]) -> list:
        reqs = [dict(w, url=self.up.grpc if w["door"] == "grpc" else self.up.http) for w in work]
        return self.agent.call("generate", requests=reqs)

    def metrics(self) -> dict:
        return self.agent.call("metrics", url=self.up.http)


@pytest.fixture(scope="module")
def cluster(tiny_official_ckpt):
    hosts = Hosts(5, limit_s=1800).up()
    up = agent = None
    try:
        nodes = {**{i: PREFILL_NODE for i in PREFILL_HOSTS}, **{i: DECODE_NODE for i in DECODE_HOSTS}}
        ray_hosts = RayHosts(hosts, RayHostsConfig(nodes=nodes, head_resources={"prefill": 2, "decode": 2}),
                             env={"UCX_PROTO_INFO": "y"}).start()
        up = UpOnHost(hosts, ray_hosts, 0, tiny_official_ckpt,
                      ["--prefill", "2", "--decode", "2", "--max-model-len", "1024", "--remote-prefill-threshold",
                       "64", *PINS])
        agent = Agent(hosts, 0, ray_hosts.env())
        yield Cluster(hosts, ray_hosts, up, agent)
    finally:
        if agent is not None:
            agent.close()
        if up is not None:
            up.stop()
        hosts.down()


def ucx_protocols(cluster: Cluster, pid: int) -> list[str]:
    """The UCX_PROTO_INFO lines of worker process `pid` (its Ray log files on its node)."""
    lines = []
    for path in Path(cluster.ray_hosts.temp_dir).glob(f"h*/session_*/logs/worker-*-{pid}.*"):
        lines += [ln for ln in path.read_text(errors="replace").splitlines() if re.search(r"\|\s*\S+/\S+\s*\|", ln)]
    return lines


def test_pools_sit_on_the_hosts_they_are_pinned_to(cluster):
    placed = cluster.agent.call("placement")
    ip = {i: cluster.hosts[i].ip for i in range(len(cluster.hosts))}
    assert {placed[f"prefill-{i}"]["ip"] for i in range(2)} == {ip[i] for i in PREFILL_HOSTS}, placed
    assert {placed[f"decode-{i}"]["ip"] for i in range(2)} == {ip[i] for i in DECODE_HOSTS}, placed


def test_outputs_equal_generate_and_kv_crosses_hosts_over_tcp(cluster, reference):
    work = workload(4, seed=1)
    before = {i: cluster.hosts.counters(i)["tx_bytes"] for i in PREFILL_HOSTS}
    kv_before = cluster.metrics().get("v4serve_kv_transfer_bytes_total", 0.0)
    got = cluster.generate(work)
    for i, (w, tokens) in enumerate(zip(work, got)):
        assert tokens == reference(w), (i, w["door"], tokens)
    kv = cluster.metrics()["v4serve_kv_transfer_bytes_total"] - kv_before
    sent = sum(cluster.hosts.counters(i)["tx_bytes"] - before[i] for i in PREFILL_HOSTS)
    assert kv > 0
    # the KV left the prefill hosts through their network interfaces (over shared memory it
    # would not touch them: what they sent would be Ray's small messages alone)
    assert sent >= kv, (sent, kv)
    placed = cluster.agent.call("placement")
    protocols = [ln for i in range(2) for ln in ucx_protocols(cluster, placed[f"prefill-{i}"]["pid"])]
    assert protocols, "UCX reported no protocol (UCX_PROTO_INFO)"
    transports = {m.group(1) for ln in protocols for m in [re.search(r"\|\s*([a-z_]+)/\S+\s*\|", ln)] if m}
    assert transports == {"tcp"}, protocols[:20]
    assert all("tcp/eth0" in ln for ln in protocols if "tcp/" in ln)


def settled(cluster: Cluster, since: dict, transfers: int, timeout_s: float = 30.0) -> dict:
    """Accounting once the prefill workers have counted `transfers` more transfers than in `since`
    (a transfer counts when its acknowledgement arrives, which may be after the response)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = cluster.agent.call("accounting")
        done = sum(now[w]["transfers"]["transfers"] - since[w]["transfers"]["transfers"]
                   for w in ("prefill-0", "prefill-1"))
        if done >= transfers or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def test_repeats_go_to_the_prefill_host_holding_the_prefix(cluster, reference):
    rng = random.Random(7)
    shared = [rng.randrange(32, 127) for _ in range(300)]  # a whole page of 256 tokens
    first = {"door": "http", "stream": False, "prompt": [*shared, 65], "max_tokens": 4, "temperature": 0.0, "seed": 0}
    # empty prefix caches (earlier tests' prompts filled them): the prefix stays where it lands
    start = cluster.agent.call("accounting", drop_cache=True)
    time.sleep(1.0)
    assert cluster.generate([first]) == [reference(first)]
    after = settled(cluster, start, 1)
    holder = next(w for w in ("prefill-0", "prefill-1")
                  if after[w]["transfers"]["transfers"] > start[w]["transfers"]["transfers"])
    other = "prefill-1" if holder == "prefill-0" else "prefill-0"
    time.sleep(1.0)  # the prefix index learns the holder's pages from its KV events
    repeats = [dict(first, prompt=shared + [66 + i], door=("http", "grpc")[i % 2]) for i in range(3)]
    # one after the other, each once the last is acknowledged (its pages are back in the prefix
    # cache then): with nothing queued anywhere the holder's 256 cached tokens always win
    last = after
    for w in repeats:
        assert cluster.generate([w]) == [reference(w)]
        last = settled(cluster, last, 1)
    end = last
    index = {k: v for k, v in cluster.metrics().items() if "prefix_index" in k or "queued" in k or "queue_depth" in k}
    assert end[holder]["transfers"]["transfers"] - after[holder]["transfers"]["transfers"] == len(repeats), (
        holder, {w: (end[w]["transfers"]["transfers"], end[w].get("cached_pages"), end[w].get("queued")) for w in end},
        index)
    assert end[other]["transfers"]["transfers"] == after[other]["transfers"]["transfers"]
    # and it reused the prefix: far fewer tokens computed than the repeats' prompts
    assert end[holder]["computed_tokens"] - after[holder]["computed_tokens"] < len(repeats) * 256


def test_a_running_decode_migrates_between_hosts(cluster, reference):
    w = {"door": "http", "stream": True, "prompt": [random.Random(3).randrange(32, 127) for _ in range(120)],
         "max_tokens": 160, "temperature": 0.0, "seed": 0}
    before = cluster.metrics().get('v4serve_retargeted_requests_total{path="migrate"}', 0.0)
    running = cluster.agent.submit("generate", requests=[dict(w, url=cluster.up.http)])
    source = None
    deadline = time.monotonic() + 120
    while source is None and time.monotonic() < deadline and not running.done():
        acct = cluster.agent.call("accounting")
        source = next((d for d in ("decode-0", "decode-1") if acct.get(d, {}).get("tokens_left", 0) >= 40), None)
    assert source is not None, "the request never ran with tokens to go"
    target = "decode-1" if source == "decode-0" else "decode-0"
    moved = cluster.agent.call("migrate", worker=source, to=target)
    assert sum(m["moved"] for m in moved) == 1, moved
    assert running.result(300) == [reference(w)]
    assert cluster.metrics()['v4serve_retargeted_requests_total{path="migrate"}'] == before + 1
    placed = cluster.agent.call("placement")
    assert {placed[source]["ip"], placed[target]["ip"]} == {cluster.hosts[i].ip for i in DECODE_HOSTS}


def test_a_router_on_a_decode_host_serves_the_same_pools(cluster, tiny_official_ckpt, reference):
    """`v4serve router` on host 3 (a driver joined to the head from a worker node's host) serves
    the pools `up` on host 0 owns: the same tokens, through either door. Its Ray driver is on host
    3's node (a driver taken for one on the head's node has the workers' replies sent to host 0,
    and its requests never finish)."""
    router = UpOnHost(cluster.hosts, cluster.ray_hosts, DECODE_HOSTS[1], tiny_official_ckpt,
                      ["--max-model-len", "1024", "--remote-prefill-threshold", "64"], command="router")
    try:
        work = workload(2, seed=9)  # one through each door
        urls = {"http": router.http, "grpc": router.grpc}
        got = cluster.agent.call("generate", requests=[dict(w, url=urls[w["door"]]) for w in work])
        for i, (w, tokens) in enumerate(zip(work, got)):
            assert tokens == reference(w), (i, w["door"], tokens)
    finally:
        assert router.stop() == 0
