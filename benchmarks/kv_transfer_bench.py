"""KV hand-off benchmark: one request of DeepSeek-V4-Flash shape moved through kvtransfer.

    python benchmarks/kv_transfer_bench.py --out results.json                  # 2 GPUs: 0 -> 1
    python benchmarks/kv_transfer_bench.py --path both                         # IPC and UCX
    python benchmarks/kv_transfer_bench.py --device cpu --tokens 1024,2048     # smoke test

Shape (per request; page = 256 tokens; pool pages laid out [page][layer][entries][bytes]):
    43 layers: 2 window-only, 21 ratio-4 (C4), 20 ratio-128 (C128); entries of 584 B
    swa        1 page  = 128 tokens x 43 layers x 584 B            (the sliding window)
    c4         T/256 pages of 64 entries x 584 B x 21 layers
    c128       T/256 pages of  2 entries x 584 B x 20 layers
    c4_indexer T/256 pages of 64 keys    x 132 B x 21 layers
    state_c4 / state_c4_indexer / state_c128: 1 page of the compressor rings, fp32:
               21 x 8 x (4x512), 21 x 8 x (4x128), 20 x 128 x (2x512) floats

The sender (this process, GPU0) and the receiver (a spawned process, GPU1; GPU0 if only one)
each own their pools. --path picks the sender's data path: "ipc" (default: the agent's normal
choice, CUDA IPC peer copies on one host), "ucx" (an agent built with cuda_ipc=False: every byte
through NIXL/UCX), or "both" (two sender agents in this process, timed alternately against the
same copy baseline). The path a write actually took is reported per row. Reported per size:
    kvtransfer write: send() of every pool (runs coalesced) until all writes landed, wall clock
    gpu:              the same writes' GPU time (CUDA events around the copy kernel; IPC path),
                      the like-for-like comparison with the copy's GPU time
    torch copy:       one device-to-device copy_ of the same number of bytes, CUDA events
                      (CPU: a memcpy of the same bytes in one process, as a reference)
    send() call:      host time of the request's send() calls (of it: Begin, posting)
With --per-layer, the streaming shapes too (see sends_for: one send() per layer and pool, one per
layer, one send_many() of every layer).
and for the first size, the whole hand-off as the receiver sees it: reserve -> target to the
sender (a pipe hop standing in for the Ray call) -> writes -> TransferDone with checksums ->
verified. Medians over --repeats after --warmup.

Ceiling: the torch copy of the same bytes, timed in the same run: `write_vs_copy` = copy time /
write time, and `gpu_write_vs_copy` the same with the IPC path's GPU time (like for like).
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvtransfer import (Agent, LayoutDescriptor, PoolLayout, Receiver, Sender,  # noqa: E402
                        SendPart, decode_target, layer_byte_range)

PAGE_TOKENS, WINDOW, ENTRY, IDX_KEY = 256, 128, 584, 132
N_C4, N_C128, N_LAYERS = 21, 20, 43
C4_LAYERS = tuple(range(2, 43, 2))       # 21 ids
C128_LAYERS = tuple(range(3, 42, 2))     # 20 ids
POOLS = {   # kind: (page bytes, layers per page, pages per request as a function of tokens)
    "swa": (WINDOW * N_LAYERS * ENTRY, N_LAYERS, lambda t: 1),
    "c4": (64 * ENTRY * N_C4, N_C4, lambda t: -(-t // PAGE_TOKENS)),
    "c128": (2 * ENTRY * N_C128, N_C128, lambda t: -(-t // PAGE_TOKENS)),
    "c4_indexer": (64 * IDX_KEY * N_C4, N_C4, lambda t: -(-t // PAGE_TOKENS)),
    "state_c4": (N_C4 * 8 * 4 * 512 * 4, N_C4, lambda t: 1),
    "state_c4_indexer": (N_C4 * 8 * 4 * 128 * 4, N_C4, lambda t: 1),
    "state_c128": (N_C128 * 128 * 2 * 512 * 4, N_C128, lambda t: 1),
}
LAYER_MAP = (("swa", tuple(range(N_LAYERS))), ("c4", C4_LAYERS), ("c128", C128_LAYERS),
             ("c4_indexer", C4_LAYERS), ("state_c4", C4_LAYERS),
             ("state_c4_indexer", C4_LAYERS), ("state_c128", C128_LAYERS))


STREAM_MODES = ("per_layer_kind", "per_layer", "all_layers")


def layer_ranges(layer: int) -> dict[str, tuple[int, int]]:
    """Per pool, the byte range of `layer` in its pages (pools holding that many layers)."""
    return {k: layer_byte_range(b, n, layer) for k, (b, n, _) in POOLS.items() if layer < n}


def sends_for(mode: str, src_pages: dict) -> list[tuple[str, dict]]:
    """The Sender calls one request makes, as (method, kwargs):
    whole_pages     one send() of every pool's whole pages (the hand-off)
    per_layer_kind  one send() per (layer, pool): the first streaming shape
    per_layer       one send() per layer, every pool's slice of it (per-pool byte ranges)
    all_layers      one send_many() of every layer's slices: one write for the request"""
    if mode == "whole_pages":
        return [("send", dict(src_pages=src_pages))]
    if mode == "per_layer_kind":
        return [("send", dict(src_pages={k: src_pages[k]}, page_byte_range=r))
                for layer in range(N_LAYERS) for k, r in layer_ranges(layer).items()]
    per_layer = [dict(src_pages={k: src_pages[k] for k in rs}, page_byte_range=rs)
                 for rs in map(layer_ranges, range(N_LAYERS))]
    if mode == "per_layer":
        return [("send", kw) for kw in per_layer]
    return [("send_many", dict(parts=[SendPart(**kw) for kw in per_layer]))]


def make_layout(max_tokens: int, copies: int) -> LayoutDescriptor:
    """Pools big enough for `copies` requests of max_tokens."""
    return LayoutDescriptor("bench-v4-flash", "fp8_pack", PAGE_TOKENS,
                            tuple(PoolLayout(k, b, copies * f(max_tokens))
                                  for k, (b, _, f) in POOLS.items()), LAYER_MAP)


def counts_for(tokens: int) -> dict[str, int]:
    return {k: f(tokens) for k, (_, _, f) in POOLS.items()}


def make_pools(layout: LayoutDescriptor, device: str) -> dict[str, torch.Tensor]:
    return {p.kind: torch.randint(0, 256, (p.num_pages, p.page_bytes), dtype=torch.uint8,
                                  device=device) for p in layout.pools}


class LowestFirst:
    """Allocator handing out the lowest free ids (contiguous runs on a fresh pool)."""

    def __init__(self, layout: LayoutDescriptor):
        self.free_ids = {p.kind: set(range(p.num_pages)) for p in layout.pools}

    def alloc(self, kind, n):
        ids = sorted(self.free_ids[kind])[:n]
        if len(ids) < n:
            raise RuntimeError(f"{kind}: out of pages")
        self.free_ids[kind].difference_update(ids)
        return ids

    def free(self, kind, ids):
        self.free_ids[kind].update(ids)

    def num_free(self, kind):
        return len(self.free_ids[kind])


# --------------------------------------------------------------------------- receiver process

def receiver_main(conn, device: str, layout_bytes: bytes, progress_thread: bool) -> None:
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    layout = LayoutDescriptor.from_bytes(layout_bytes)
    agent = Agent("bench-recv", make_pools(layout, device), progress_thread=progress_thread)
    alloc = LowestFirst(layout)
    receiver = Receiver(agent, alloc, layout)
    conn.send(agent.metadata())
    while True:
        cmd, arg = conn.recv()
        if cmd == "peer":
            agent.add_peer(*arg)
            conn.send(None)
        elif cmd == "reserve":          # -> target, then (seconds reserve->verified, ok)
            rid, counts = arg
            t0 = time.perf_counter()
            target = receiver.reserve(rid, counts, lease_s=60.0)
            conn.send(target.to_bytes())
            kind = None
            while kind is None:
                for ev in receiver.poll():
                    if ev.request_id == rid:
                        kind = ev.kind
            t1 = time.perf_counter()
            if kind == "ready":
                for k, ids in receiver.claim(rid).items():
                    alloc.free(k, ids)
            else:
                receiver.release(rid)
            conn.send((t1 - t0, kind))
        elif cmd == "exit":
            agent.close()
            conn.send(None)
            return


# --------------------------------------------------------------------------- sender side

def torch_copy_seconds(nbytes: int, src_dev: str, dst_dev: str, warmup: int,
                       repeats: int) -> list[float]:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=src_dev)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_dev)
    times = []
    for i in range(warmup + repeats):
        if src.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            dt = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
    del src, dst
    return times


def instrument(agent: Agent) -> dict:
    """Time the agent's notify() and write() calls (seconds, accumulated into the dict)."""
    acc = {"notify": 0.0, "write": 0.0}
    for name in acc:
        fn = getattr(agent, name)

        def timed(*a, _fn=fn, _name=name, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                acc[_name] += time.perf_counter() - t0
        setattr(agent, name, timed)
    return acc


def one_transfer(sender: Sender, conn, rid: str, counts: dict, src_pages: dict,
                 mode: str, acc: dict) -> dict:
    """Reserve on the receiver, write everything, finish, wait for the ack. Seconds per phase."""
    gpu0 = sender.agent.ipc_stats().get("gpu_write_s", 0.0)
    conn.send(("reserve", (rid, counts)))
    target = decode_target(conn.recv())
    acc.update(notify=0.0, write=0.0)
    t0 = time.perf_counter()
    descriptors = nbytes = 0
    for fn, kwargs in sends_for(mode, src_pages):
        posted = getattr(sender, fn)(target, **kwargs)
        descriptors += posted.descriptors
        nbytes += posted.nbytes
    t_sent = time.perf_counter()
    notify_s, post_s = acc["notify"], acc["write"]     # Begin, and posting the write(s)
    while sender.in_flight(rid):
        sender.poll()
    t1 = time.perf_counter()
    sender.finish(target, b"first-token+sampling-state" * 4)    # computes the checksums
    t_fin = time.perf_counter()
    released = None
    while released is None:
        for ev in sender.poll():
            if ev.request_id == rid:
                released = ev.reason
    t2 = time.perf_counter()
    handoff_s, kind = conn.recv()
    if kind != "ready" or released != "acked":
        raise RuntimeError(f"{rid}: receiver {kind}, sender {released}")
    gpu_s = sender.agent.ipc_stats().get("gpu_write_s", 0.0) - gpu0
    return {"write_s": t1 - t0, "gpu_write_s": gpu_s, "send_call_s": t_sent - t0, "begin_notify_s": notify_s,
            "post_s": post_s, "finish_call_s": t_fin - t1,
            "finish_to_ack_s": t2 - t1, "handoff_s": handoff_s,
            "descriptors": descriptors, "nbytes": nbytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tokens", default=None, help="comma list (default 8192,32768,131072; "
                                                   "cpu: 1024,2048)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--path", choices=("ipc", "ucx", "both"), default="ipc",
                    help="sender data path: ipc (default; CUDA IPC where possible), ucx "
                         "(force NIXL/UCX), both (report each)")
    ap.add_argument("--per-layer", action="store_true",
                    help="also time the streaming shapes (per_layer_kind: one send() per layer "
                         "and pool; per_layer: one send() per layer; all_layers: one "
                         "send_many() of every layer)")
    ap.add_argument("--progress-thread", choices=("on", "off"), default=None,
                    help="NIXL progress thread (default: on for cuda, off for cpu, where it "
                         "would take a core from the other process)")
    ap.add_argument("--out", default=None, help="write JSON results here")
    args = ap.parse_args()

    tokens = [int(t) for t in (args.tokens or ("8192,32768,131072" if args.device == "cuda"
                                               else "1024,2048")).split(",")]
    if args.device == "cuda":
        n = torch.cuda.device_count()
        src_dev, dst_dev = "cuda:0", ("cuda:1" if n >= 2 else "cuda:0")
        torch.cuda.set_device(0)
    else:
        src_dev = dst_dev = "cpu"
    layout = make_layout(max(tokens), 1)
    progress = (args.progress_thread or ("on" if args.device == "cuda" else "off")) == "on"

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_main,
                       args=(child, dst_dev, layout.to_bytes(), progress), daemon=True)
    proc.start()
    recv_md = conn.recv()
    senders = {}    # requested path -> (agent, sender, path taken)
    for path in (("ipc", "ucx") if args.path == "both" else (args.path,)):
        name = "bench-send" if path == "ipc" else "bench-send-ucx"
        agent = Agent(name, make_pools(layout, src_dev), progress_thread=progress,
                      cuda_ipc=path == "ipc", time_ipc_writes=path == "ipc")
        sender = Sender(agent, layout)
        sender.handshake("bench-recv", recv_md, layout)
        conn.send(("peer", (name, agent.metadata())))
        conn.recv()
        taken = agent.transport("bench-recv")                 # maps ahead of the first write
        senders[path] = (agent, sender, taken, instrument(agent))

    results = {"device": args.device, "src": src_dev, "dst": dst_dev,
               "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
               if args.device == "cuda" else [],
               "torch": torch.__version__, "python": sys.version.split()[0],
               "repeats": args.repeats, "warmup": args.warmup, "progress_thread": progress,
               "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
               "sizes": []}
    try:
        import importlib.metadata as md
        results["nixl"] = md.version("nixl")
    except Exception:
        results["nixl"] = None

    seq = 0
    for t in tokens:
        counts = counts_for(t)
        src_pages = {k: list(range(n)) for k, n in counts.items()}
        rows = []
        for mode in ("whole_pages",) + (STREAM_MODES if args.per_layer else ()):
            runs = {path: [] for path in senders}
            for i in range(args.warmup + args.repeats):
                for path, (_, sender, _, acc) in senders.items():  # alternate: same conditions
                    seq += 1
                    r = one_transfer(sender, conn, f"bench-{seq}", counts, src_pages, mode, acc)
                    if i >= args.warmup:
                        runs[path].append(r)
            for path, rs in runs.items():
                agent, _, taken, _ = senders[path]
                rows.append((path, taken, agent.ipc_stats().get("modes", {}).get("bench-recv"),
                             mode, rs))
        nbytes = rows[0][4][0]["nbytes"]
        copy = torch_copy_seconds(nbytes, src_dev, dst_dev, args.warmup, args.repeats)
        copy_s = statistics.median(copy)
        for path, taken, ipc_mode, mode, rs in rows:
            write_s = statistics.median(r["write_s"] for r in rs)
            handoffs = sorted(r["handoff_s"] for r in rs)
            results["sizes"].append({
                "tokens": t, "mode": mode, "send_calls": len(sends_for(mode, src_pages)),
                "path": path, "transport": taken, "ipc_mapping": ipc_mode,
                "bytes": rs[0]["nbytes"], "descriptors": rs[0]["descriptors"],
                "pool_bytes": {k: n * POOLS[k][0] for k, n in counts.items()},
                "write_s_median": write_s, "write_GBps": rs[0]["nbytes"] / write_s / 1e9,
                "write_s_min": min(r["write_s"] for r in rs),
                "torch_copy_s_median": copy_s, "torch_copy_GBps": nbytes / copy_s / 1e9,
                "write_vs_copy": copy_s / write_s,
                "gpu_write_s_median": statistics.median(r["gpu_write_s"] for r in rs),
                "gpu_write_vs_copy": (copy_s / statistics.median(r["gpu_write_s"] for r in rs)
                                      if rs[0]["gpu_write_s"] else None),
                "handoff_s_median": statistics.median(handoffs),
                "handoff_s_p90": handoffs[min(len(rs) - 1, int(0.9 * len(rs)))],
                "send_call_s_median": statistics.median(r["send_call_s"] for r in rs),
                "begin_notify_s_median": statistics.median(r["begin_notify_s"] for r in rs),
                "post_s_median": statistics.median(r["post_s"] for r in rs),
                "finish_call_s_median": statistics.median(r["finish_call_s"] for r in rs),
                "finish_to_ack_s_median": statistics.median(r["finish_to_ack_s"] for r in rs),
            })

    # which copy implementation the IPC writes took (copies_memcpy / _torch / _triton)
    results["ipc_stats"] = {path: a.ipc_stats() for path, (a, _, _, _) in senders.items()}
    for agent, _, _, _ in senders.values():
        agent.close()             # unmap the receiver's pools before it exits
    conn.send(("exit", None))
    conn.recv()
    proc.join(10)

    hdr = (f"{'tokens':>7} {'mode':>14} {'path':>8} {'MB':>8} {'descs':>6} {'write ms':>9} "
           f"{'GB/s':>7} {'copy ms':>8} {'GB/s':>7} {'ratio':>6} {'gpu ms':>7} {'gpu ratio':>9} "
           f"{'hand-off ms':>11}")
    print(f"kvtransfer {src_dev} -> {dst_dev}  (median of {args.repeats}, {args.warmup} warm-up;"
          f" path = the transport writes took, ucx-only = forced by --path ucx)")
    print(hdr)
    for r in results["sizes"]:
        r["label"] = r["transport"] if r["path"] == "ipc" else "ucx-only"
        print(f"{r['tokens']:>7} {r['mode']:>14} {r['label']:>8} {r['bytes'] / 1e6:>8.1f} "
              f"{r['descriptors']:>6} {r['write_s_median'] * 1e3:>9.3f} {r['write_GBps']:>7.1f} "
              f"{r['torch_copy_s_median'] * 1e3:>8.3f} {r['torch_copy_GBps']:>7.1f} "
              f"{r['write_vs_copy']:>6.2f} {r['gpu_write_s_median'] * 1e3:>7.3f} "
              f"{(r['gpu_write_vs_copy'] or float('nan')):>9.2f} {r['handoff_s_median'] * 1e3:>11.2f}")
    print("phases (ms): send() call (of it: Begin notify, posting the write) | writes landed | "
          "finish() (sender checksums) | finish -> ack (notify, receiver verify, ack)")
    for r in results["sizes"]:
        print(f"{r['tokens']:>7} {r['mode']:>14} {r['label']:>8}  "
              f"{r['send_call_s_median'] * 1e3:8.3f} ({r['begin_notify_s_median'] * 1e3:6.3f} "
              f"{r['post_s_median'] * 1e3:6.3f}) {r['write_s_median'] * 1e3:8.3f} "
              f"{r['finish_call_s_median'] * 1e3:8.3f} {r['finish_to_ack_s_median'] * 1e3:8.3f}")
    modes = {r["ipc_mapping"] for r in results["sizes"] if r["ipc_mapping"]}
    if modes:
        print(f"CUDA IPC mapping mode: {', '.join(sorted(modes))}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
