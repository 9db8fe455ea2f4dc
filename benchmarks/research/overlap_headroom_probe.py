"""How much HBM traffic a decode step leaves room for: the step's CUDA graph replayed while a
streaming kernel reads HBM beside it.

    python benchmarks/research/overlap_headroom_probe.py --out h.json [--layers 15] [--steps 1x8192 1x32768 64x8192]

A batch-1 step is a chain of latency-bound kernels (docs/journal/, rounds v28-v39): its
own traffic averages ~1.5 TB/s on an H200 whose copy rate is 4.2. A per-layer persistent kernel
would stream the next products' weights while the chain's latency-bound kernels (mHC entries,
norms, RoPE, gate, select, attention) run; that pays only if HBM traffic beside those kernels
leaves them as fast as they were. This measures the premise without writing that kernel: for
each streamer (`Streamer`: programs × warps × 16-byte loads in flight a thread, over a buffer
larger than L2), its rate alone, then the step's graph replayed `--reps` times on a
high-priority stream while the streamer runs on a low-priority one, sized to outlast them.

The streamer is a CUDA graph of short launches (`--chunks` chunks a program, a few µs), not one
long kernel: some of the step's kernels need a whole SM's registers, so a streamer program
resident on every SM for the whole run holds them off until it ends (a first version measured a
batch-1 step at 30 ms beside one). Short programs leave the SMs to the step's queued programs
(the block scheduler prefers the higher-priority stream) within a few µs.

Per streamer it reports the step's time beside the streamer against alone, the streamer's rate
beside the step (its bytes minus what it read alone after the replays ended, over the replays'
time; `concurrent_rate`), and `free_gb_per_step`: what the streamer read per step. If a step
slows little while the streamer reads as many bytes as the step's own roofline, the room the
persistent design needs is there; if the step slows in proportion, it is not. Batch 64, a
bandwidth-bound step, is the control: it must leave the streamer little, the two together near
the copy rate. Each launch reads on from where the last stopped (`streamer_graph`): launches over
the same chunks read them from L2, which measures the streamer's presence on the SMs rather than
HBM traffic (docs/journal/gpu-rounds-v37-v44.md, round v43, keeps such a run as that control).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.decode_step_bench import STEPS, experts_hit  # noqa: E402
from benchmarks.flash_model import decode_batches, decode_pools, roofline_bytes, stack  # noqa: E402
from benchmarks.gpu_ceilings import bench, ceilings  # noqa: E402
from model.cuda_graph import DecodeGraph  # noqa: E402


@dataclass(frozen=True)
class Streamer:
    """`programs` programs of `warps` warps, each thread keeping `unroll` 16-byte loads in flight:
    unroll · warps · 512 bytes a program. A program or two an SM (132 SMs on these cards) spreads
    the traffic evenly, as a persistent kernel's would be; a few fat programs instead slow the SMs
    they sit on, and every kernel of the step then waits for its programs there."""
    programs: int
    warps: int
    unroll: int

    @classmethod
    def parse(cls, spec: str) -> "Streamer":
        """"PxWxU", e.g. 132x1x8."""
        try:
            p, w, u = (int(v) for v in spec.split("x"))
        except ValueError:
            raise ValueError(f"streamer spec {spec!r} is not PROGRAMSxWARPSxUNROLL") from None
        if p < 1 or w not in (1, 2, 4, 8) or u < 1 or u & (u - 1):
            raise ValueError(f"streamer spec {spec!r}: programs >= 1, warps 1/2/4/8, unroll a power of two")
        return cls(p, w, u)

    @property
    def chunk_words(self) -> int:
        return self.unroll * self.warps * 128  # int32 words: 4 a thread a load

    def label(self) -> str:
        return f"{self.programs}x{self.warps}x{self.unroll}"


@triton.jit
def _stream_kernel(src_ptr, n_chunks, first, per_program, keep_ptr, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    """Each program reads `per_program` chunks of UNROLL·BLOCK int32 words, program-strided over
    the `n_chunks` of src from chunk `first` (wrapping), bypassing L1; it stores one flag so the
    loads are not dead."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    acc = tl.zeros([UNROLL, BLOCK], tl.int32)
    inner = tl.arange(0, UNROLL)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    for j in range(0, per_program):
        base = ((first + pid + j * programs) % n_chunks).to(tl.int64) * (UNROLL * BLOCK)
        acc ^= tl.load(src_ptr + base + inner, cache_modifier=".cg")
    tl.store(keep_ptr + pid, (tl.max(acc) == 12345).to(tl.int32))


def stream(src: torch.Tensor, keep: torch.Tensor, s: Streamer, per_program: int, first: int = 0) -> int:
    """Launches streamer `s` reading `per_program` chunks a program of src (int32, whole chunks of
    the largest streamer) from chunk `first`; returns the bytes read."""
    block = s.warps * 128
    n_chunks = src.numel() // s.chunk_words
    _stream_kernel[(s.programs,)](src, n_chunks, first % n_chunks, per_program, keep, BLOCK=block,
                                  UNROLL=s.unroll, num_warps=s.warps, num_stages=1)
    return s.programs * per_program * s.chunk_words * 4


def streamer_graph(src: torch.Tensor, keep: torch.Tensor, s: Streamer, per_program: int, launches: int
                   ) -> tuple[torch.cuda.CUDAGraph, int]:
    """(a graph of `launches` back-to-back launches of streamer `s`, the bytes one replay reads).
    Each launch reads on from where the last stopped: launches over the same chunks would read
    them from L2 (a launch's few MB fit), not HBM."""
    stream(src, keep, s, per_program)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        nbytes = sum(stream(src, keep, s, per_program, i * s.programs * per_program) for i in range(launches))
    return graph, nbytes


def concurrent_rate(total_bytes: float, alone_rate: float, stream_s: float, replays_s: float) -> float:
    """Bytes/s the streamer read while the replays ran: it started with them and ran on alone for
    stream_s - replays_s at `alone_rate` after they ended."""
    if stream_s < replays_s:
        raise ValueError(f"the streamer ({stream_s * 1e3:.2f} ms) ended before the replays "
                         f"({replays_s * 1e3:.2f} ms): size it larger")
    return max(0.0, total_bytes - alone_rate * (stream_s - replays_s)) / replays_s


def beside(replay, streamer: torch.cuda.CUDAGraph, streamer_replays: int, reps: int) -> tuple[float, float]:
    """(the streamer's seconds, the step replays' seconds): `streamer_replays` replays of the
    streamer graph launched first on a low-priority stream, `reps` step replays on a high-priority one."""
    low, high = torch.cuda.Stream(priority=0), torch.cuda.Stream(priority=-1)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    torch.cuda.synchronize()
    with torch.cuda.stream(low):
        ev[0].record()
        for _ in range(streamer_replays):
            streamer.replay()
        ev[1].record()
    with torch.cuda.stream(high):
        ev[2].record()
        for _ in range(reps):
            replay()
        ev[3].record()
    torch.cuda.synchronize()
    return ev[0].elapsed_time(ev[1]) / 1e3, ev[2].elapsed_time(ev[3]) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=15)
    ap.add_argument("--steps", nargs="+", default=["1x8192", "1x32768", "64x8192"], metavar="BATCHxCONTEXT")
    ap.add_argument("--streamers", nargs="+", default=["132x1x8", "132x2x8", "132x4x8", "132x4x16", "264x4x16",
                                                        "264x8x16"], metavar="PROGRAMSxWARPSxUNROLL")
    ap.add_argument("--chunks", type=int, default=2, help="chunks a streamer program reads before it exits")
    ap.add_argument("--launches", type=int, default=500, help="streamer launches in its graph")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--buffer-gib", type=float, default=2.0)
    args = ap.parse_args()
    streamers = [Streamer.parse(v) for v in args.streamers]
    ceil = ceilings()
    model = stack(args.layers, act_fp8=True)
    cfg, layers = model.cfg, list(range(args.layers))
    big = max(s.chunk_words for s in streamers)  # every streamer's chunks tile the buffer
    src = torch.randint(-2**31, 2**31 - 1, (int(args.buffer_gib * 2**30) // (4 * big) * big,), device="cuda",
                        dtype=torch.int32)
    keep = torch.zeros(max(s.programs for s in streamers), device="cuda", dtype=torch.int32)
    graphs, alone = {}, {}
    for s in streamers:
        graphs[s] = streamer_graph(src, keep, s, args.chunks, args.launches)
        alone[s] = bench(graphs[s][0].replay, warmup=2, reps=10)  # seconds a replay
        print(f"streamer {s.label():>9}: {graphs[s][1] / alone[s] / 1e12:.2f} TB/s alone, "
              f"{alone[s] / args.launches * 1e6:.1f} µs a launch", flush=True)
    result = {"device": torch.cuda.get_device_name(), "ceilings": ceil, "layers": args.layers, "chunks": args.chunks,
              "launches": args.launches, "steps": [],
              "streamers": [{**asdict(s), "alone_tb_s": graphs[s][1] / alone[s] / 1e12,
                             "launch_us": alone[s] / args.launches * 1e6} for s in streamers]}
    for spec in args.steps:
        batch, context = (int(v) for v in spec.split("x"))
        pools, seqs = decode_pools(cfg, args.layers, batch, context - STEPS, steps=STEPS)
        fb = decode_batches(seqs, STEPS)[0]
        hit = experts_hit(model, fb, pools)
        graph = DecodeGraph(model, pools, batch_size=batch, max_context=context + 1)
        graph.run(fb)
        replay = graph.graph.replay
        step_alone = bench(replay, warmup=3, reps=args.reps)
        need = sum(sum(roofline_bytes(cfg, i, b, batch, context - STEPS, h).values())
                   for i, b, h in zip(layers, model.blocks, hit))
        row = {"batch": batch, "context": context, "step_ms": step_alone * 1e3, "roofline_gb": need / 1e9,
               "fraction_of_roofline": need / ceil["copy_bytes_per_s"] / step_alone, "beside": []}
        print(f"B={batch} ctx={context}: step {step_alone * 1e3:.3f} ms alone, roofline {need / 1e9:.2f} GB "
              f"({row['fraction_of_roofline']:.1%})", flush=True)
        for s in streamers:
            # sized to outlast the replays at its alone rate; three times longer until it does
            streamer, nbytes = graphs[s]
            n = int(step_alone * args.reps * 1.5 / alone[s]) + 1
            beside(replay, streamer, 2, 2)  # warm: clocks
            for _ in range(4):
                stream_s, replays_s = beside(replay, streamer, n, args.reps)
                if stream_s >= replays_s:
                    break
                n *= 3
            rate = concurrent_rate(n * nbytes, nbytes / alone[s], stream_s, replays_s)
            step = replays_s / args.reps
            cell = {"streamer": s.label(), "step_ms": step * 1e3, "slowdown": step / step_alone - 1,
                    "streamer_tb_s": rate / 1e12, "free_gb_per_step": rate * step / 1e9}
            row["beside"].append(cell)
            print(f"  {s.label():>9}: step {step * 1e3:.3f} ms ({cell['slowdown']:+.1%}), streamer "
                  f"{rate / 1e12:.2f} TB/s beside it = {cell['free_gb_per_step']:.2f} GB a step", flush=True)
        result["steps"].append(row)
        graph.close()
        del graph, pools, seqs
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
