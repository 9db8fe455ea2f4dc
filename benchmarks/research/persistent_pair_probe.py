"""What a grid-wide wait inside one persistent launch saves against a launch boundary, on the pair
of one-token products a decode layer runs back to back: the grouped wo_a, then wo_b on its output.

    python benchmarks/research/persistent_pair_probe.py --out p.json [--programs 132 264 396]

A per-layer persistent kernel (docs/journal/gpu-rounds-v37-v44.md, round v43) replaces each launch boundary of
the batch-1 chain by a grid-wide wait. Whether that pays is this measurement, on the simplest
dependent pair, with the production product's body (`fp8_gemm.a8_tile`, one output tile and K
split a work item) in every form, so only the boundary and the schedule differ:

* production: `Fp8Linear.grouped` then `Fp8Linear.__call__`, two launches of `_fp8_a8_kernel`
  under programmatic dependent launch, one program a work item (the model's decode step);
* phases: `_pair_kernel` launched twice (PHASE 1, then PHASE 2 with the dependent launch),
  `programs` programs walking the work items (item = pid, pid + programs, ...);
* persistent: `_pair_kernel` once (PHASE 0), the same walk, a grid-wide wait between the
  products: every program counts its arrival and spins until all have;
* persistent with prefetch: the same, each program asking L2 for its second-product weight lines
  before its wait (`_prefetch_items`), the one thing a grid-wide wait allows that a launch
  boundary does not.

Persistence needs every program resident at once: the grid is capped by the compiled kernels'
registers and shared memory (`resident_programs`, the fewest over the three persistent forms),
and the spin gives up after `SPIN_LIMIT` polls, flagging it, rather than hanging the GPU.

All forms must give the production output bit for bit (same tiles, same split order); the probe
checks that before timing. Graph replays of `--calls` pairs, median of `--reps`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model.kernels.common.pdl import launch_options, wait  # noqa: E402
from model.kernels.gemm.fp8_gemm import BLOCK, a8_tile, decode_config  # noqa: E402

SPIN_LIMIT = 1 << 22  # polls of the grid-wide wait before a program gives up (~1 s)
TOKEN_TILE = 16  # the one-token product's token tile (tl.dot's minimum)
BT = tl.constexpr(TOKEN_TILE)  # kernels may only read constexpr globals
BK = tl.constexpr(BLOCK)  # K step: the activations' and weights' 128-wide scale block


@triton.jit
def _grid_wait(sync_ptr, programs, SPIN_LIMIT: tl.constexpr):
    """Counts this program's arrival at sync_ptr[0] and spins until `programs` have arrived; 0 if
    it gave up, else 1. The barrier orders every thread's earlier stores before the release; the
    acquire orders later loads after the others' releases."""
    tl.debug_barrier()
    tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
    polls = 0
    while (seen < programs) & (polls < SPIN_LIMIT):
        seen = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
        polls += 1
    tl.debug_barrier()
    return (seen >= programs).to(tl.int32)


@triton.jit
def _prefetch_items(wb_addr, Nb, Kb, pid, programs, BLOCK_N: tl.constexpr, SPLIT_B: tl.constexpr,
                    EVICT_LAST: tl.constexpr):
    """Asks L2 for the weight lines of this program's second-product work items (each row's 128
    bytes of each of its K blocks, `prefetch.global.L2`, with the evict_last hint if EVICT_LAST:
    nothing waits on them)."""
    rows = tl.arange(0, BLOCK_N)
    for item in range(pid, tl.cdiv(Nb, BLOCK_N) * SPLIT_B, programs):
        r = (item // SPLIT_B) * BLOCK_N + rows
        for kb in range(item % SPLIT_B, tl.cdiv(Kb, BK), SPLIT_B):
            addr = wb_addr + r.to(tl.int64) * Kb + kb * BK
            take = (r < Nb).to(tl.int32)
            if EVICT_LAST:
                tl.inline_asm_elementwise(
                    "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
                    "=r,l,r", [addr, take], dtype=tl.int32, is_pure=False, pack=1)
            else:
                tl.inline_asm_elementwise(
                    "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                    "=r,l,r", [addr, take], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _pair_kernel(x_ptr, wa_ptr, sa_ptr, mid_ptr, wb_ptr, sb_ptr, y_ptr, part_ptr, cnt_a_ptr, cnt_b_ptr, sync_ptr,
                 Na, Ka, Ga, Nb, Kb, stride_sa, stride_sb, stride_part, wb_addr,
                 BLOCK_N: tl.constexpr, SPLIT_A: tl.constexpr, SPLIT_B: tl.constexpr, PHASE: tl.constexpr,
                 SPIN_LIMIT: tl.constexpr, PREFETCH: tl.constexpr = 0, PDL: tl.constexpr = False):
    """One token: mid [Ga, Na] = grouped product of x [Ga, Ka] with wa [Ga·Na, Ka] (PHASE 0 or 1),
    then y [Nb] = mid (flattened, Kb = Ga·Na) · wbᵀ (PHASE 0 or 2), W8A8 with the input
    quantised in the products as `_fp8_a8_kernel` does. PHASE 0 waits grid-wide between them and
    clears sync_ptr [2] (arrivals, exits) on the way out; a wait that gave up sets sync_ptr[2].
    PREFETCH (PHASE 0, GPU only; 1 plain, 2 with the evict_last hint): before its wait each
    program asks L2 for the weight of its second-product items (wb_addr: wb's address), which a
    launch boundary cannot do: what a persistent kernel adds beyond removing the launch."""
    wait(PDL)
    pid, programs = tl.program_id(0), tl.num_programs(0)
    if PHASE != 2:
        tiles_a = tl.cdiv(Na, BLOCK_N)
        for item in range(pid, tiles_a * Ga * SPLIT_A, programs):
            rest = item // SPLIT_A
            a8_tile(x_ptr, x_ptr, wa_ptr, sa_ptr, mid_ptr, part_ptr, cnt_a_ptr, 1, Na, Ka, Ga * Ka, Ka, 0, 0, Ka,
                    stride_sa, Ga * Na, Na, stride_part, rest // Ga, rest % Ga, item % SPLIT_A, Ga, BLOCK_N,
                    BT, BK, SPLIT_A, True, False, False)
    if PHASE == 0:
        if PREFETCH > 0:
            _prefetch_items(wb_addr, Nb, Kb, pid, programs, BLOCK_N, SPLIT_B, PREFETCH == 2)
        if _grid_wait(sync_ptr, programs, SPIN_LIMIT) == 0:
            tl.atomic_add(sync_ptr + 2, 1)
            return
    if PHASE != 1:
        for item in range(pid, tl.cdiv(Nb, BLOCK_N) * SPLIT_B, programs):
            a8_tile(mid_ptr, mid_ptr, wb_ptr, sb_ptr, y_ptr, part_ptr, cnt_b_ptr, 1, Nb, Kb, Kb, 0, 0, 0, Kb,
                    stride_sb, Nb, 0, stride_part, item // SPLIT_B, 0, item % SPLIT_B, 1, BLOCK_N,
                    BT, BK, SPLIT_B, True, False, False)
    if PHASE == 0:
        # the last program out clears the arrivals: every program has left the wait by then
        tl.debug_barrier()
        if tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu") == programs - 1:
            tl.store(sync_ptr, 0)
            tl.store(sync_ptr + 1, 0)


class Pair:
    """The buffers and launches of `_pair_kernel` for wo_a (grouped) and wo_b of one token."""

    def __init__(self, wo_a, wo_b, groups: int):
        self.wa, self.sa, self.wb, self.sb, self.groups = wo_a.weight, wo_a.scale, wo_b.weight, wo_b.scale, groups
        self.na, self.ka = self.wa.shape[0] // groups, self.wa.shape[1]
        self.nb, self.kb = self.wb.shape
        if self.kb != groups * self.na:
            raise ValueError(f"wo_b takes {self.kb} inputs, wo_a gives {groups} × {self.na}")
        ca = decode_config(1, self.na, self.ka, groups, a8=True)
        cb = decode_config(1, self.nb, self.kb, 1, a8=True)
        if ca["BLOCK_N"] != cb["BLOCK_N"] or ca["BLOCK_T"] != TOKEN_TILE or cb["BLOCK_T"] != TOKEN_TILE:
            raise ValueError(f"the pair's products take different tiles: {ca} / {cb}")
        self.block_n, self.split_a, self.split_b = ca["BLOCK_N"], ca["SPLIT_K"], cb["SPLIT_K"]
        dev = self.wa.device
        self.items = (triton.cdiv(self.na, self.block_n) * groups * self.split_a,
                      triton.cdiv(self.nb, self.block_n) * self.split_b)
        self.stride_part = max(groups * self.na, self.nb)
        self.part = torch.empty(max(self.split_a, self.split_b) * self.stride_part, device=dev, dtype=torch.float32)
        self.cnt_a = torch.zeros(self.items[0], device=dev, dtype=torch.int32)
        self.cnt_b = torch.zeros(self.items[1], device=dev, dtype=torch.int32)
        self.sync = torch.zeros(3, device=dev, dtype=torch.int32)
        self.mid = torch.empty(1, groups, self.na, device=dev, dtype=torch.bfloat16)
        self.y = torch.empty(1, self.nb, device=dev, dtype=torch.bfloat16)

    def launch(self, x: torch.Tensor, programs: int, phase: int, pdl: bool = False, prefetch: int = 0):
        """x [1, groups, Ka] bf16; phase 0 (persistent), 1 or 2 (one product); → the compiled kernel."""
        opts = launch_options(x) if pdl else {}
        return _pair_kernel[(programs,)](
            x, self.wa, self.sa, self.mid, self.wb, self.sb, self.y, self.part, self.cnt_a, self.cnt_b, self.sync,
            self.na, self.ka, self.groups, self.nb, self.kb, self.sa.stride(0), self.sb.stride(0), self.stride_part,
            self.wb.data_ptr(), BLOCK_N=self.block_n, SPLIT_A=self.split_a, SPLIT_B=self.split_b, PHASE=phase,
            SPIN_LIMIT=SPIN_LIMIT, PREFETCH=prefetch, num_warps=4, num_stages=3, **opts)

    def phases(self, x: torch.Tensor, programs: int) -> torch.Tensor:
        self.launch(x, programs, 1)
        self.launch(x, programs, 2, pdl=True)
        return self.y

    def persistent(self, x: torch.Tensor, programs: int, prefetch: int = 0) -> torch.Tensor:
        self.launch(x, programs, 0, prefetch=prefetch)
        return self.y

    def gave_up(self) -> int:
        return int(self.sync[2].item())


def resident_programs(kernel, sms: int, warps: int = 4) -> int:
    """Programs of a compiled kernel that fit on the GPU at once: per SM the fewest allowed by its
    registers (65536, allocated per warp in 256s) and shared memory (227 KB a program's share plus
    1 KB reserved), at most 32."""
    regs_per_warp = -(-kernel.n_regs * 32 // 256) * 256
    by_regs = 65536 // (regs_per_warp * warps)
    by_smem = (227 * 1024) // (kernel.metadata.shared + 1024) if kernel.metadata.shared else 32
    return sms * max(0, min(by_regs, by_smem, 32))


def main() -> None:
    from benchmarks.flash_model import stack
    from benchmarks.gpu_ceilings import bench_graph, ceilings

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--programs", nargs="+", type=int, default=[132, 264, 396, 528])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    ceil = ceilings()
    cfg_layer = 3  # any layer: wo_a / wo_b have the same shapes in all
    model = stack(1, first_layer=cfg_layer, act_fp8=True)
    attn, cfg = model.blocks[0].attn, model.cfg
    groups = cfg.o_groups
    pair = Pair(attn.wo_a, attn.wo_b, groups)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, groups, pair.ka, device="cuda", generator=g).bfloat16()

    def production():
        return attn.wo_b(attn.wo_a.grouped(x).flatten(1))

    want = production().clone()
    # one program a persistent form: its wait is met at once; also each form's compiled handle, and
    # the grid is capped for all of them by the one that fits fewest (the prefetch adds registers)
    forms = [pair.launch(x, 1, 0, prefetch=mode) for mode in (0, 1, 2)]
    torch.cuda.synchronize()
    one = forms[0]
    resident = min(resident_programs(k, sms) for k in forms)
    result = {"device": torch.cuda.get_device_name(), "ceilings": ceil, "sms": sms,
              "weight_mb": (pair.wa.numel() + pair.wb.numel()) / 1e6, "items": list(pair.items),
              "block_n": pair.block_n, "splits": [pair.split_a, pair.split_b], "registers": one.n_regs,
              "shared_bytes": one.metadata.shared, "resident_programs": resident,
              "checks": {"one_program": bool(torch.equal(pair.y, want))}}
    result["production_us"] = bench_graph(production, args.calls, args.reps) * 1e6
    print(f"{torch.cuda.get_device_name()}: wo_a + wo_b {result['weight_mb']:.1f} MB, items {pair.items}, "
          f"{one.n_regs} registers, {one.metadata.shared} B shared → {resident} resident programs; "
          f"production {result['production_us']:.1f} µs "
          f"({result['weight_mb'] / result['production_us']:.2f} TB/s)", flush=True)
    rows = []
    for p in args.programs:
        row = {"programs": p}
        out = pair.phases(x, p)
        row["phases_equal"] = bool(torch.equal(out, want))
        row["phases_us"] = bench_graph(lambda: pair.phases(x, p), args.calls, args.reps) * 1e6
        if p <= resident:
            out = pair.persistent(x, p)
            row["persistent_equal"] = bool(torch.equal(out, want))
            row["persistent_us"] = bench_graph(lambda: pair.persistent(x, p), args.calls, args.reps) * 1e6
            for mode, name in ((1, "prefetch"), (2, "prefetch_evict_last")):
                out = pair.persistent(x, p, prefetch=mode)
                row[f"{name}_equal"] = bool(torch.equal(out, want))
                row[f"{name}_us"] = bench_graph(lambda: pair.persistent(x, p, prefetch=mode), args.calls,
                                                args.reps) * 1e6
            row["gave_up"] = pair.gave_up()
        rows.append(row)
        print("  " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
              flush=True)
    result["rows"] = rows
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
