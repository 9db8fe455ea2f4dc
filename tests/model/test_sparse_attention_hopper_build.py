"""The Gluon sparse-attention kernel (model/kernels/attention/sparse_attention_wgmma.py) built for Hopper
without a GPU, with Triton's bundled ptxas: what no CPU test can run. Its parity with the Triton
kernel and the reference is tests/gpu/test_kernels_flash.py's."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from model.kernels.attention import sparse_attention_wgmma
from tests.model.test_moe_hopper_build import without_interpreter

# compiles kernels for Hopper on the CPU: a minute on 2 cores, so CI runs it and the fast tier does not
pytestmark = pytest.mark.slow

MODULE = "tests.model.test_sparse_attention_hopper_build"

_POINTERS = {"q_ptr": "*bf16", "out_ptr": "*bf16", "partial_ptr": "*fp32", "ml_ptr": "*fp32", "seq_ptr": "*i32",
             "pos_ptr": "*i32", "sink_ptr": "*fp32", "inv_freq_ptr": "*fp32", "swa_buf": "*u8", "swa_table": "*i32",
             "c_buf": "*u8", "c_table": "*i32", "picks_ptr": "*i32"}


def build(ratio: int, splits: int):
    """(compiled kernel, ptxas -v report of its PTX) for a V4-Flash layer of `ratio`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = sparse_attention_wgmma._sparse_attn_wgmma_kernel
    consts = dict(WINDOW=128, RATIO=ratio, HAS_PICKS=ratio == 4, SWA_EPP=64, C_EPP=64, SPLITS=splits, SWA_ALIGN=8,
                  C_ALIGN=8, PDL=True)
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in _POINTERS:
            sig[name], attrs[(i,)] = _POINTERS[name], [["tt.divisibility", 16]]
        else:
            sig[name] = {"scale_log2": "fp32", "swa_layer_off": "i64", "c_layer_off": "i64"}.get(name, "i32")
    k = triton.compile(GluonASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": sparse_attention_wgmma.NUM_WARPS})
    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    report = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", "-", "-o", "/dev/null"], input=k.asm["ptx"],
                            capture_output=True, text=True)
    assert report.returncode == 0, report.stderr
    return k, report.stderr


def check_build(ratio: int, splits: int) -> None:
    """wgmma for both products, shared memory within Hopper's 227 KB, no spills, and no
    serialised wgmma (ptxas C7514: what a product left in flight across the loop's back edge, or
    an instruction reading an accumulator in flight, costs every wgmma of the kernel)."""
    k, report = build(ratio, splits)
    ptx = k.asm["ptx"]
    assert "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16" in ptx  # S = q·kᵀ, 32 entries a warpgroup
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16" in ptx  # P·k, 256 columns a warpgroup
    assert k.metadata.shared <= 227 * 1024
    assert "C7514" not in report, report
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    assert spills and not any(spills), report


def check_serialised_products_are_reported() -> None:
    """ptxas reports C7514 for the loop this kernel's first pipelined form had: P·k left in
    flight across the back edge, awaited (with its register operand) after the next S started."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait

    @gluon.jit
    def in_flight_at_back_edge(x_ptr, out_ptr, n):
        L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        P: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L, k_width=2)
        S: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        B: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        r = gl.arange(0, 64, layout=gl.SliceLayout(1, B))
        c = gl.arange(0, 64, layout=gl.SliceLayout(0, B))
        a = gl.allocate_shared_memory(gl.bfloat16, [64, 64], S, gl.load(x_ptr + r[:, None] * 64 + c[None, :]))
        zero = gl.zeros([64, 64], gl.float32, layout=L)
        acc = warpgroup_mma_init(zero)
        p = gl.zeros([64, 64], gl.bfloat16, layout=P)
        for _ in range(n):
            s_tok = warpgroup_mma(a, a.permute((1, 0)), zero, use_acc=False, is_async=True)
            acc, p = warpgroup_mma_wait(num_outstanding=1, deps=(acc, p))
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
            acc = acc * 0.5
            p = gl.convert_layout(s.to(gl.bfloat16), P)
            acc = warpgroup_mma(p, a, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        lr = gl.arange(0, 64, layout=gl.SliceLayout(1, L))
        lc = gl.arange(0, 64, layout=gl.SliceLayout(0, L))
        gl.store(out_ptr + lr[:, None] * 64 + lc[None, :], acc)

    k = triton.compile(GluonASTSource(in_flight_at_back_edge, {"x_ptr": "*bf16", "out_ptr": "*fp32", "n": "i32"},
                                      {}, {}), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    report = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", "-", "-o", "/dev/null"], input=k.asm["ptx"],
                            capture_output=True, text=True).stderr
    assert "C7514" in report, report


@pytest.mark.parametrize("ratio,splits", [(4, 1), (128, 1), (0, 4), (4, 16)])
def test_kernel_builds_for_hopper_with_its_products_in_flight(ratio, splits):
    """`check_build`, in a process without Triton's interpreter (which the CPU suite turns on)."""
    without_interpreter(f"check_build({ratio}, {splits})", MODULE)


def test_the_build_check_sees_serialised_products():
    """The C7514 check above can fail."""
    without_interpreter("check_serialised_products_are_reported()", MODULE)
