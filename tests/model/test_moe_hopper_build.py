"""The MoE kernels built for Hopper without a GPU (Triton's bundled ptxas), at V4-Flash shapes on
meta tensors: what the interpreter of tests/model/test_moe_kernels.py cannot check (Triton's
compile-time rules, the inline PTX, the wgmma operand layout, register use and spills)."""

from __future__ import annotations

import os
import re
from dataclasses import replace

import pytest
import torch

from model.kernels.common.fp4 import reads_wgmma_operand
from model.kernels.moe import moe_fused, moe_grouped, moe_prefill
from model.kernels.moe.packed_experts import PackedExperts
from model.moe import MoE
from model.tiny import tiny_config

# compiles kernels for Hopper on the CPU: a minute on 2 cores, so CI runs it and the fast tier does not
pytestmark = pytest.mark.slow

_TL_DTYPES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32", torch.int64: "i64",
              torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv"}


def hopper_compile(launch):
    """Compile a planned launch for sm_90 as the JIT would (16-byte aligned pointers, ints divisible by
    16 marked so) → (compiled kernel, cubin resource usage line)."""
    import subprocess
    from pathlib import Path

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = launch.kernel.arg_names
    defaults = {p.name: p.default for p in launch.kernel.params}  # constexprs a launch may leave out (PDL)
    sig, attrs, consts = {}, {}, {}
    for i, name in enumerate(names):
        if i >= len(launch.args):
            sig[name], consts[name] = "constexpr", launch.meta.get(name, defaults[name])
            continue
        value = launch.args[i]
        if isinstance(value, torch.Tensor):
            sig[name], aligned = "*" + _TL_DTYPES[value.dtype], True
        else:
            sig[name], aligned = ("fp32", False) if isinstance(value, float) else ("i32", value % 16 == 0)
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    options = {k: launch.meta[k] for k in ("num_warps", "num_stages", "maxnreg") if k in launch.meta}
    k = triton.compile(ASTSource(launch.kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 128),
                       options=options)
    cubin = Path(os.environ.get("TMPDIR", "/tmp")) / f"moe_{os.getpid()}.cubin"
    cubin.write_bytes(k.asm["cubin"])
    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    usage = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
    cubin.unlink()
    return k, usage


def wgmma_pending_at_back_edge(ptx: str) -> bool:
    """Whether some loop of a PTX listing commits a wgmma group after its last wait, leaving the
    group in flight when the next iteration starts (the pattern of triton-lang/triton#9433: that
    iteration may overwrite the group's register operand). A loop is a label and the first later
    branch back to it."""
    lines = ptx.splitlines()
    labels = {line.split(":")[0]: i for i, line in enumerate(lines) if re.match(r"\$L__BB\d+_\d+:", line)}
    for i, line in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)
        if m is None or labels.get(m.group(1), i) >= i:
            continue
        events = [b for b in lines[labels[m.group(1)]:i] if "wgmma.commit_group" in b or "wgmma.wait_group" in b]
        if events and "commit_group" in events[-1]:
            return True
    return False


def flash_plan(path: str, fmt: str, T: int):
    D, I, E, k = 4096, 2048, 256, 6
    experts = PackedExperts(fmt, E, D, I, device="meta")
    shared = PackedExperts("fp8", 1, D, I, device="meta")
    x = torch.empty(T, D, dtype=torch.bfloat16, device="meta")
    ids, weights = torch.empty(T, k, dtype=torch.long, device="meta"), torch.empty(T, k, device="meta")
    tiles = moe_fused.decode_tiles(T) if path != "grouped" else (moe_grouped.GROUPED_GATEUP, moe_grouped.GROUPED_DOWN)
    if path == "grouped_decode":  # as `moe_grouped.grouped_moe` plans a few tokens: down unsplit
        tiles = (tiles[0], replace(tiles[1], split_k=1))
    tiles = (moe_grouped.fit(tiles[0], I, D), moe_grouped.fit(tiles[1], D, I))
    # as `moe_fused.fused_moe` plans them: FP4 activations on SWAP tiles in `preorder`'s layout
    launches, _ = moe_grouped.plan_kernels(x, weights, ids, experts, shared, 10.0, *tiles,
                                           fuse_combine=path == "fused", preordered=path != "grouped" and fmt == "fp4",
                                           asm=True)
    return launches


def check_hopper_build(path: str, fmt: str, T: int) -> None:
    for launch in flash_plan(path, fmt, T):
        k, usage = hopper_compile(launch)
        if launch.kernel.__name__ != "_count_sort_kernel":
            assert "wgmma" in k.asm["ptx"], f"{launch.kernel.__name__}: no wgmma (fell back to mma.sync)"
        if launch.meta.get("MMA") and fmt == "fp4":  # V4 tiles keep the in-place conversion
            assert reads_wgmma_operand(k.asm["ttgir"]), f"{launch.kernel.__name__}: FP4 words off the wgmma operand"
        if launch.meta.get("SETTLE"):  # the decode tiles (moe_fused): no product in flight into the next K step
            assert not wgmma_pending_at_back_edge(k.asm["ptx"]), f"{launch.kernel.__name__}: a wgmma group crosses a K step"
        cap = launch.meta.get("maxnreg")
        if cap is None:
            assert " LOCAL:0 " in usage and " STACK:0 " in usage, usage
        else:  # a register cap trades a few spilled bytes for more programs an SM (moe_fused.SMALL_DOWN)
            regs, local = (int(re.search(rf"{field}:(\d+)", usage).group(1)) for field in ("REG", "LOCAL"))
            assert regs <= cap and local <= 16, usage


def check_unsettled_tiles_leave_a_product_pending() -> None:
    """The one-token gate/up tiles built unsettled at V4-Flash shapes: the K loop's last product
    group is still in flight at the back edge, which `wgmma_pending_at_back_edge` must see."""
    D, I, E, k = 4096, 2048, 256, 6
    experts = PackedExperts("fp4", E, D, I, device="meta")
    x = torch.empty(1, D, dtype=torch.bfloat16, device="meta")
    ids, weights = torch.empty(1, k, dtype=torch.long, device="meta"), torch.empty(1, k, device="meta")
    gateup = moe_grouped.fit(replace(moe_fused.SMALL_GATEUP, settle=False), I, D)
    launches, _ = moe_grouped.plan_kernels(x, weights, ids, experts, None, 10.0, gateup,
                                           moe_grouped.fit(moe_fused.SMALL_DOWN, D, I), fuse_combine=True,
                                           preordered=True, asm=True)
    (launch,) = [launch for launch in launches if launch.kernel.__name__ == "_gateup_kernel"]
    assert wgmma_pending_at_back_edge(hopper_compile(launch)[0].asm["ptx"])


def check_operand_layouts() -> None:
    """A small tile whose FP4 conversion Triton compiles before the layout change (BK 32: a
    row's columns 0, 1, 8, 9 in four registers) is detected, and the V4 K step (128) is not."""
    moe = MoE.random_packed(tiny_config(hidden_size=1024, moe_intermediate_size=512), layer=3, fmt="fp4", seed=5,
                            device="cpu")
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(5))  # on the CPU: compiled, never run
    weights, ids = moe.gate(x, torch.arange(8))
    for bk, want in ((32, False), (128, True)):
        tiles = moe_grouped.Tiles(BT=16, BN=64, BK=bk, swap_ab=True)
        launches, _ = moe_grouped.plan_kernels(x, weights, ids, moe.experts, moe.shared_experts, 10.0, tiles, tiles,
                                               fuse_combine=True, asm=True)
        down = launches[-1]
        assert down.meta["MMA"] and not down.meta["SETTLE"]
        assert reads_wgmma_operand(hopper_compile(down)[0].asm["ttgir"]) is want, bk



@pytest.mark.parametrize("path, fmt, T", [
    ("fused", "fp4", 64), ("fused", "fp4", 1), ("grouped", "fp4", 8192), ("grouped_decode", "fp4", 1),
    pytest.param("fused", "fp8", 64, marks=pytest.mark.exhaustive),
    pytest.param("grouped", "fp8", 8192, marks=pytest.mark.exhaustive),
])
def test_kernels_compile_for_hopper_without_spills(path, fmt, T):
    """The interpreter checks neither Triton's compile-time rules, nor the inline PTX, nor register
    use: compile both launches for sm_90 in a process without the interpreter, and require wgmma
    and no local-memory spills."""
    without_interpreter(f"check_hopper_build({path!r}, {fmt!r}, {T})")


def test_fp4_conversion_layout_check_detects_small_tiles():
    """Triton, not the kernel, decides whether the FP4 words are converted in the wgmma operand
    layout; `reads_wgmma_operand` must tell the two apart (the GPU path falls back on it)."""
    without_interpreter("check_operand_layouts()")


def test_pending_product_check_sees_unsettled_tiles():
    """The PTX check behind the settled decode tiles (check_hopper_build) is not vacuous."""
    without_interpreter("check_unsettled_tiles_leave_a_product_pending()")


def without_interpreter(call: str, module: str = "tests.model.test_moe_hopper_build") -> None:
    """Run `call` (a function of `module`, this one by default) in a process without Triton's
    interpreter."""
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"from {module} import *; {call}"
    run = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]


def test_fp4_words_convert_in_the_wgmma_operand_only_where_wgmma_runs():
    """The register-order conversion (kernels/common/fp4.py) is for wgmma's operand alone: Hopper, SWAP
    tiles of 64 rows per warpgroup (the decode and prefill tiles). Smaller tiles run mma.sync and
    other GPUs other MMAs, for which the layout check vouches nothing: those convert through
    explicit words."""
    for t in (moe_fused.DECODE_GATEUP, moe_fused.DECODE_DOWN, moe_fused.SMALL_GATEUP, moe_fused.SMALL_DOWN,
              moe_prefill.PREFILL_GATEUP, moe_prefill.PREFILL_DOWN):
        assert moe_grouped._tile_meta(t, True)["MMA"] and not moe_grouped._tile_meta(t, False)["MMA"]
    small = moe_grouped.Tiles(BT=16, BN=32, BK=32, num_warps=4, num_stages=2, swap_ab=True)
    assert not moe_grouped._tile_meta(small, True)["MMA"]
    assert not moe_grouped._tile_meta(moe_grouped.GROUPED_GATEUP, True)["MMA"]  # tokens as M
