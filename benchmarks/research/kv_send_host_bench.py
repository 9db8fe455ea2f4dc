"""Host cost of Sender.send(): CPU pools, real NIXL over UCX, V4-Flash request shape.

    python benchmarks/research/kv_send_host_bench.py --tokens 8192,32768 --repeats 30 --out send_host.json

Same shape as benchmarks/kv_transfer_bench.py (43 layers: 2 window-only, 21 ratio-4, 20
ratio-128; 584-byte entries; 132-byte indexer keys; 256-token pages). The receiver is a spawned
process with its own agent; the sender lives here. No GPU: this measures the Python and NIXL
work a send() does on the calling thread, which on a GPU is the time before the first byte moves.
Modes (kv_transfer_bench.sends_for; each a fresh reservation per repeat, finished and
acknowledged before the next):

    whole_pages     one send() of every pool's whole pages (the hand-off)
    per_layer_kind  one send() per (layer, pool): the streaming shape of the first version
    per_layer       one send() per layer carrying every pool's slice of it (per-pool ranges)
    all_layers      one send_many() carrying every layer's slices (one write for the request)

Reported per mode: host µs per send() call (the call's duration minus the time inside NIXL's
transfer(), where UCX copies the bytes on CPU memory; median and p90 over repeats, calls
pooled), the host ms of the mode's send() calls per request (median), µs from the first call
to NIXL posting the first write (`to post`: on a GPU, when bytes start moving), the time until
every byte landed, and the number of send() calls and descriptors.

On CPU memory each request's bytes are copied by this process (inside transfer(), and again by
finish()'s checksums), which leaves the caches cold for the next request's send(): these host
times are higher than on a GPU host, where the sender's CPU never touches the KV bytes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.kv_transfer_bench import (STREAM_MODES, counts_for, make_layout,  # noqa: E402
                                          make_pools, receiver_main, sends_for)
from kvtransfer import Agent, Sender, decode_target  # noqa: E402

MODES = ("whole_pages",) + STREAM_MODES


class PostClock:
    """Wraps NIXL's transfer() (the call that posts a write) for every NIXL agent of this process,
    of which the sender's is the only one (the receiver's lives in its own process): when it was
    first entered, and the seconds spent inside it. On CPU memory UCX copies the bytes inside that
    call, so send()'s host cost is its duration minus the time inside transfer()."""

    def __init__(self):
        from nixl._api import nixl_agent
        self.first: float | None = None
        self.inside = 0.0
        inner = nixl_agent.transfer

        def transfer(*a, **k):
            t0 = time.perf_counter()
            if self.first is None:
                self.first = t0
            try:
                return inner(*a, **k)
            finally:
                self.inside += time.perf_counter() - t0
        nixl_agent.transfer = transfer


def one_request(sender: Sender, conn, clock: PostClock, rid: str, counts: dict,
                calls: list) -> dict:
    conn.send(("reserve", (rid, counts)))
    target = decode_target(conn.recv())
    clock.first = None
    durations, descriptors = [], 0
    t_start = time.perf_counter()
    for fn, kwargs in calls:
        clock.inside = 0.0
        t0 = time.perf_counter()
        posted = getattr(sender, fn)(target, **kwargs)
        durations.append(time.perf_counter() - t0 - clock.inside)
        descriptors += posted.descriptors
    to_post = (clock.first - t_start) if clock.first is not None else float("nan")
    while sender.in_flight(rid):
        sender.poll()
    landed = time.perf_counter() - t_start
    sender.finish(target, b"header")
    released = None
    while released is None:
        for ev in sender.poll():
            if ev.request_id == rid:
                released = ev.reason
    _, kind = conn.recv()
    if kind != "ready" or released != "acked":
        raise RuntimeError(f"{rid}: receiver {kind}, sender {released}")
    return {"calls": durations, "to_post_s": to_post, "landed_s": landed,
            "descriptors": descriptors}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="8192,32768")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None, help="write JSON results here")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    modes = args.modes.split(",")
    layout = make_layout(max(tokens), 1)

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_main, args=(child, "cpu", layout.to_bytes(), False),
                       daemon=True)
    proc.start()
    recv_md = conn.recv()
    agent = Agent("bench-send", make_pools(layout, "cpu"), progress_thread=False)
    sender = Sender(agent, layout)
    sender.handshake("bench-recv", recv_md, layout)
    conn.send(("peer", ("bench-send", agent.metadata())))
    conn.recv()
    clock = PostClock()

    rows, seq = [], 0
    for t in tokens:
        counts = counts_for(t)
        src_pages = {k: list(range(n)) for k, n in counts.items()}
        for mode in modes:
            calls = sends_for(mode, src_pages)
            runs = []
            for i in range(args.warmup + args.repeats):
                seq += 1
                r = one_request(sender, conn, clock, f"h-{seq}", counts, calls)
                if i >= args.warmup:
                    runs.append(r)
            per_call = sorted(d for r in runs for d in r["calls"])
            rows.append({
                "tokens": t, "mode": mode, "send_calls": len(calls),
                "descriptors": runs[0]["descriptors"],
                "call_us_median": statistics.median(per_call) * 1e6,
                "call_us_p90": per_call[int(0.9 * (len(per_call) - 1))] * 1e6,
                "total_ms_median": statistics.median(sum(r["calls"]) for r in runs) * 1e3,
                "to_post_us_median": statistics.median(r["to_post_s"] for r in runs) * 1e6,
                "landed_ms_median": statistics.median(r["landed_s"] for r in runs) * 1e3,
            })
    agent.close()
    conn.send(("exit", None))
    conn.recv()
    proc.join(10)

    print(f"send() host cost, CPU pools, NIXL/UCX (median of {args.repeats}, "
          f"{args.warmup} warm-up)")
    print(f"{'tokens':>7} {'mode':>15} {'calls':>6} {'descs':>6} {'µs/call':>8} {'p90':>8} "
          f"{'ms/request':>10} {'to post µs':>10} {'landed ms':>9}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['mode']:>15} {r['send_calls']:>6} {r['descriptors']:>6} "
              f"{r['call_us_median']:>8.1f} {r['call_us_p90']:>8.1f} {r['total_ms_median']:>10.3f} "
              f"{r['to_post_us_median']:>10.1f} {r['landed_ms_median']:>9.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"repeats": args.repeats, "warmup": args.warmup, "torch": torch.__version__,
                       "python": sys.version.split()[0], "rows": rows}, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
