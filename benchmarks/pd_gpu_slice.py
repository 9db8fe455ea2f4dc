"""The 2-GPU slice of the full-size V4-Flash P/D benchmark: prefill pool on GPU0, decode pool on
GPU1, KV over kvtransfer between the two processes, as many full-width layers as fit one GPU.

    python benchmarks/pd_gpu_slice.py --out $OUT/pd_slice.json [--layers N]

Both workers build the same first N layers of V4-Flash (random weights in the device format:
FP8 projections, FP4 experts; fp8_pack pools). Measured, per request of ISL 8192:
  * prefill of the whole prompt on GPU0 (eager, one chunk),
  * the hand-off: GPU1 reserves the request's pages in every pool, GPU0 writes its SWA window,
    C4 / C4-indexer / C128 pages and compress-state rings (CUDA IPC on one host), GPU1 verifies
    the checksums (reserve → verified), then GPU1 decodes one step on the received pages;
  * decode steps on GPU1 at concurrency 1 / 16 / 64 / 256 (CUDA graph per batch size, requests
    at context 8192 advancing `--steps` tokens; inter-token latency = wall time per step).
Estimates for the 43-layer model scale the per-layer times (stated as estimates): TTFT ≈
prefill + hand-off; ITL ≈ decode step; throughput per GPU of the 1P1D pair = the lesser of the
prefill GPU's request rate and the decode GPU's, times the tokens per request, over 2 GPUs.
Against: the hand-off against the prefill and the decode step around it (what it adds to TTFT
and ITL); the estimates against SGLang's published V4-Flash figures on H200 (TP4, FP4), for scale
only: a slice, not a served run (serve_bench.py measures the served model).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.flash_model import decode_pools, layers_that_fit, stack  # noqa: E402
from kvtransfer import Agent, LayoutDescriptor, Receiver, Sender, decode_target  # noqa: E402
from model.batch import ForwardBatch  # noqa: E402
from model.cuda_graph import DecodeGraph  # noqa: E402
from model.kv_pool import KVPools, SeqKV  # noqa: E402
from worker_runtime.kv_link import layout_of, pool_buffers  # noqa: E402

ISL, OSL, FULL_LAYERS = 8192, 1024, 43


def _sub_config(model, n):
    return dataclasses.replace(model.cfg, num_hidden_layers=n, compress_ratios=model.cfg.compress_ratios[:n])


def decode_main(conn, n: int, concurrencies: list[int], steps: int) -> None:
    torch.cuda.set_device(1 if torch.cuda.device_count() > 1 else 0)
    dev = f"cuda:{torch.cuda.current_device()}"
    model = stack(n, dev)
    cfg = _sub_config(model, n)
    pools = KVPools(cfg, "fp8_pack", max_tokens=ISL + steps + 8, max_seqs=2, device=dev)
    agent = Agent("slice-decode", pool_buffers(pools), progress_thread=True)
    receiver = Receiver(agent, pools, layout_of(pools))
    conn.send((agent.metadata(), layout_of(pools).to_bytes()))
    agent.add_peer(*conn.recv())
    out = {"handoff_s": [], "decode": []}
    counts = pools.resume_page_counts(ISL)
    while True:
        cmd = conn.recv()
        if cmd == "done":
            break
        t0 = time.perf_counter()
        target = receiver.reserve(cmd, counts, lease_s=60.0)
        conn.send(target.to_bytes())
        kind = None
        while kind is None:
            kind = next((ev.kind for ev in receiver.poll() if ev.request_id == cmd), None)
        out["handoff_s"].append(time.perf_counter() - t0)
        if kind != "ready":
            raise RuntimeError(f"{cmd}: {kind}")
        seq = pools.adopt(ISL, receiver.claim(cmd))   # decode one step on the received pages
        pools.reserve(seq, ISL + 1)                    # the page the next token lands in
        logits = model(ForwardBatch.build([(seq, [7])], device=dev), pools)
        ok = bool(torch.isfinite(logits).all())
        pools.release(seq)
        conn.send(ok)
    agent.close()
    del pools
    for c in concurrencies:
        dpools, seqs = decode_pools(model.cfg, n, c, ISL, device=dev, steps=steps)
        graph = DecodeGraph(model, dpools, batch_size=c, max_context=ISL + steps + 1)
        tok = [int(t) for t in torch.randint(0, 1024, (c,))]
        for i in range(steps):
            if i == 2:  # two warm-up steps
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            batch = ForwardBatch.build([(s, [t]) for s, t in zip(seqs, tok)], device=dev)
            graph.run(batch)
            batch.commit()
        torch.cuda.synchronize()
        itl = (time.perf_counter() - t0) / (steps - 2)
        out["decode"].append({"concurrency": c, "itl_s": itl, "itl_per_layer_s": itl / n})
        print(f"decode c={c:4d}: ITL {itl * 1e3:8.2f} ms ({itl * 1e3 / n:.3f} ms/layer)", flush=True)
        graph.close()
        del graph, dpools, seqs
        torch.cuda.empty_cache()
    conn.send(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    args = ap.parse_args()
    torch.cuda.set_device(0)
    free, _ = torch.cuda.mem_get_info()
    n = args.layers or layers_that_fit(free, 24 << 30)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=decode_main, args=(child, n, args.concurrency, args.steps), daemon=True)
    proc.start()
    model = stack(n, "cuda:0")
    cfg = _sub_config(model, n)
    pools = KVPools(cfg, "fp8_pack", max_tokens=ISL, max_seqs=1, device="cuda:0")
    agent = Agent("slice-prefill", pool_buffers(pools), progress_thread=True)
    sender = Sender(agent, layout_of(pools))
    peer_md, peer_layout = conn.recv()
    sender.handshake("slice-decode", peer_md, LayoutDescriptor.from_bytes(peer_layout))
    conn.send(("slice-prefill", agent.metadata()))
    print(f"{n} layers per GPU ({[cfg.compress_ratios[i] for i in range(n)]}); "
          f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB of weights", flush=True)
    prompt = torch.randint(0, 1024, (ISL,)).tolist()
    prefill_s, send_s, ok = [], [], []
    for r in range(args.requests + 1):  # the first request warms up
        seq = SeqKV()
        pools.reserve(seq, ISL)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        batch = ForwardBatch.build([(seq, prompt)], device="cuda:0")
        model(batch, pools)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        batch.commit()
        rid = f"req-{r}"
        conn.send(rid)
        target = decode_target(conn.recv())
        pages = pools.resume_pages(seq)
        kv_bytes = sum(len(p) * pools.specs[k].page_bytes for k, p in pages.items())
        sender.send(target, pages)
        while sender.in_flight(rid):
            sender.poll()
        sender.finish(target, b"first-token")
        released = None
        while released is None:
            released = next((ev.reason for ev in sender.poll() if ev.request_id == rid), None)
        t2 = time.perf_counter()
        ok.append(conn.recv())
        pools.release(seq)
        if r:
            prefill_s.append(t1 - t0)
            send_s.append(t2 - t1)
        print(f"request {r}: prefill {(t1 - t0) * 1e3:.1f} ms, hand-off {(t2 - t1) * 1e3:.2f} ms, {released}",
              flush=True)
    conn.send("done")
    dec = conn.recv()
    proc.join(30)
    agent.close()
    result = summarise(n, prefill_s, send_s, dec, ok)
    result["kv_bytes_per_request"] = kv_bytes
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["estimate_43_layers"], indent=1))


def summarise(n: int, prefill_s: list, send_s: list, dec: dict, ok: list) -> dict:
    prefill = statistics.median(prefill_s)
    handoff = statistics.median(dec["handoff_s"][1:] or dec["handoff_s"])
    scale = FULL_LAYERS / n
    est = {"ttft_s": prefill * scale + handoff * scale, "prefill_s": prefill * scale, "kv_handoff_s": handoff * scale,
           "by_concurrency": []}
    for d in dec["decode"]:
        itl = d["itl_s"] * scale
        decode_rps = d["concurrency"] / (OSL * itl)        # requests finishing per second on the decode GPU
        prefill_rps = 1 / (prefill * scale)
        rps = min(decode_rps, prefill_rps)
        est["by_concurrency"].append({
            "concurrency": d["concurrency"], "itl_ms": itl * 1e3,
            "output_tok_s_per_gpu": rps * OSL / 2, "total_tok_s_per_gpu": rps * (ISL + OSL) / 2,
            "bound": "decode" if decode_rps < prefill_rps else "prefill"})
    return {"layers": n, "prefill_s_median": prefill, "prefill_ms_per_layer": prefill * 1e3 / n,
            "handoff_s_median": handoff, "sender_handoff_s_median": statistics.median(send_s),
            "decode": dec["decode"], "decoded_received_pages_ok": all(ok), "estimate_43_layers": est}


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
