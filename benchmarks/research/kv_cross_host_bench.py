"""KV hand-off between two hosts on CPU, against a plain TCP copy of the same bytes in the same run.

    sudo python benchmarks/research/kv_cross_host_bench.py --tokens 1024,4096 --repeats 10 --out x.json

Two hosts are two network namespaces on a bridge (tests/multihost/hosts.py): the sender in host
0, the receiver in host 1, each with UCX over TCP on its own eth0 (UCX_TLS=tcp: no shared
memory, though both share this machine's memory), so every byte crosses the veth pair and the
bridge, as between two machines. The request is kv_transfer_bench.py's (V4-Flash shape), moved
by the real Sender / Receiver (whole pages: one send() of every pool); its control messages go
over a TCP connection standing in for the Ray call (multiprocessing.connection).

Reported per size (medians over --repeats after --warmup):
    write:     send() until every write landed (the bytes over UCX TCP)
    hand-off:  reserve → target to the sender → writes → TransferDone with checksums → verified,
               as the receiver sees it
    tcp copy:  the same bytes through one TCP socket between the same two hosts, sent with
               sendall and received into a preallocated buffer, until the receiver's one-byte ack
    ratio:     tcp copy / write (1.0: the hand-off's data path is as fast as a plain socket)
and the UCX protocol UCX chose for the writes (UCX_PROTO_INFO: transport and device), which
must be tcp on eth0. Needs root (namespaces); the hosts are removed at exit.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from multiprocessing.connection import Client, Listener
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

PORT, TCP_PORT = 7070, 7071
AUTH = b"v4serve-kv-cross-host"


def _recv_exact(sock: socket.socket, buf: memoryview) -> None:
    got = 0
    while got < len(buf):
        n = sock.recv_into(buf[got:])
        if not n:
            raise ConnectionError("peer closed mid-copy")
        got += n


def _header(sock: socket.socket) -> int:
    head = bytearray(8)
    _recv_exact(sock, memoryview(head))
    return int.from_bytes(head, "little")


def receiver(listen: str, layout_hex: str) -> None:
    """Host 1: the KV receiver (kv_transfer_bench.receiver_main) and the TCP sink."""
    import threading

    from kv_transfer_bench import receiver_main

    host = listen.rsplit(":", 1)[0]

    def tcp_sink() -> None:
        with socket.create_server((host, TCP_PORT)) as srv:
            while True:
                conn, _ = srv.accept()
                with conn:
                    n = _header(conn)
                    buf = bytearray(n)
                    while n:
                        _recv_exact(conn, memoryview(buf))
                        conn.sendall(b"k")
                        n = _header(conn)

    threading.Thread(target=tcp_sink, daemon=True).start()
    with Listener((host, PORT), authkey=AUTH) as listener, listener.accept() as conn:
        receiver_main(conn, "cpu", bytes.fromhex(layout_hex), False)


def tcp_copy_seconds(peer: str, nbytes: int, warmup: int, repeats: int) -> list[float]:
    """The same bytes through one TCP connection to the receiver's host, acked by one byte."""
    data = os.urandom(nbytes)
    times = []
    with socket.create_connection((peer, TCP_PORT), timeout=60) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(nbytes.to_bytes(8, "little"))
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            sock.sendall(data)
            if sock.recv(1) != b"k":
                raise ConnectionError("no ack")
            dt = time.perf_counter() - t0
            if i >= warmup:
                times.append(dt)
            sock.sendall(nbytes.to_bytes(8, "little") if i + 1 < warmup + repeats else (0).to_bytes(8, "little"))
    return times


def proto_lines(log: Path) -> list[str]:
    """UCX_PROTO_INFO's lines about RMA writes (put): which transport/device they took."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return [line.strip() for line in text.splitlines() if "put" in line.lower() and "tcp" in line.lower()]


def sender(args, peer: str) -> dict:
    """Host 0: the sender side of kv_transfer_bench, its control connection over TCP to host 1."""
    from kv_transfer_bench import POOLS, counts_for, instrument, make_layout, make_pools, one_transfer

    from kvtransfer import Agent, Sender

    tokens = [int(t) for t in args.tokens.split(",")]
    layout = make_layout(max(tokens), 1)
    deadline = time.monotonic() + 60
    while True:
        try:
            conn = Client((peer, PORT), authkey=AUTH)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    recv_md = conn.recv()
    agent = Agent("bench-send", make_pools(layout, "cpu"), progress_thread=False, cuda_ipc=False)
    snd = Sender(agent, layout)
    snd.handshake("bench-recv", recv_md, layout)
    conn.send(("peer", ("bench-send", agent.metadata())))
    conn.recv()
    acc = instrument(agent)
    rows, seq = [], 0
    for t in tokens:
        counts = counts_for(t)
        src_pages = {k: list(range(n)) for k, n in counts.items()}
        runs = []
        for i in range(args.warmup + args.repeats):
            seq += 1
            r = one_transfer(snd, conn, f"x-{seq}", counts, src_pages, "whole_pages", acc)
            if i >= args.warmup:
                runs.append(r)
        nbytes = runs[0]["nbytes"]
        tcp = tcp_copy_seconds(peer, nbytes, args.warmup, args.repeats)
        write_s = statistics.median(r["write_s"] for r in runs)
        tcp_s = statistics.median(tcp)
        rows.append({"tokens": t, "bytes": nbytes, "pool_bytes": {k: n * POOLS[k][0] for k, n in counts.items()},
                     "write_s_median": write_s, "write_GBps": nbytes / write_s / 1e9,
                     "handoff_s_median": statistics.median(r["handoff_s"] for r in runs),
                     "finish_call_s_median": statistics.median(r["finish_call_s"] for r in runs),
                     "finish_to_ack_s_median": statistics.median(r["finish_to_ack_s"] for r in runs),
                     "tcp_copy_s_median": tcp_s, "tcp_GBps": nbytes / tcp_s / 1e9, "tcp_vs_write": tcp_s / write_s,
                     "transport": agent.transport("bench-recv")})
    agent.close()
    conn.send(("exit", None))
    conn.recv()
    return {"sizes": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1024,4096")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=None)
    ap.add_argument("--role", choices=("receiver", "sender"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--peer", default="", help=argparse.SUPPRESS)
    ap.add_argument("--layout", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "receiver":
        receiver(args.peer, args.layout)
        return 0
    if args.role == "sender":
        print(json.dumps(sender(args, args.peer)))
        return 0

    from kv_transfer_bench import make_layout

    from tests.multihost.hosts import UCX_ENV, Hosts

    layout = make_layout(max(int(t) for t in args.tokens.split(",")), 1)
    env = {**os.environ, **UCX_ENV, "UCX_PROTO_INFO": "y", "PYTHONPATH": str(ROOT)}
    script = [sys.executable, str(Path(__file__).resolve())]
    with Hosts(2, limit_s=1200) as hosts:
        recv = hosts.popen(1, [*script, "--role", "receiver", "--peer", f"{hosts[1].ip}:{PORT}",
                               "--layout", layout.to_bytes().hex()], env=env, log="receiver.log")
        try:
            out = hosts.run(0, [*script, "--role", "sender", "--peer", hosts[1].ip, "--tokens", args.tokens,
                                "--warmup", str(args.warmup), "--repeats", str(args.repeats)],
                            env=env, timeout=1100)
        finally:
            if recv.poll() is None:
                recv.wait(30)
        lines = out.stdout.strip().splitlines()
        results = json.loads(lines[-1])
        results["ucx_proto"] = [line for line in lines[:-1] + out.stderr.splitlines()
                                if "tcp" in line.lower() or "posix" in line.lower() or "sysv" in line.lower()
                                or "cma" in line.lower()][:40]
        results["counters"] = {"sender": hosts.counters(0), "receiver": hosts.counters(1)}
    results.update(ucx_env=UCX_ENV, repeats=args.repeats, warmup=args.warmup, python=sys.version.split()[0],
                   cpus=len(os.sched_getaffinity(0)), date=time.strftime("%Y-%m-%d"))
    print("kvtransfer host 0 → host 1 over UCX TCP (veth + bridge) against a TCP socket copy of the same bytes; "
          f"median of {args.repeats} after {args.warmup} warm-up")
    print(f"{'tokens':>7} {'MB':>7} {'write ms':>9} {'GB/s':>6} {'hand-off ms':>11} {'tcp ms':>8} {'GB/s':>6} "
          f"{'tcp/write':>9}")
    for r in results["sizes"]:
        print(f"{r['tokens']:>7} {r['bytes'] / 1e6:>7.1f} {r['write_s_median'] * 1e3:>9.2f} {r['write_GBps']:>6.2f} "
              f"{r['handoff_s_median'] * 1e3:>11.2f} {r['tcp_copy_s_median'] * 1e3:>8.2f} {r['tcp_GBps']:>6.2f} "
              f"{r['tcp_vs_write']:>9.2f}")
    print("UCX protocols (UCX_PROTO_INFO):", *results["ucx_proto"][:12], sep="\n  ")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
