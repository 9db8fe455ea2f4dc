"""benchmarks/research/persistent_pair_probe.py's kernel gives the production products' bits (the GPU run
times it; here its work-item walk and phase split run in the interpreter)."""

import pytest
import torch

from benchmarks.research.persistent_pair_probe import Pair, resident_programs
from model.quantized import Fp8Linear


def _pair(groups=2, na=512, ka=2048):
    g = torch.Generator().manual_seed(0)
    wo_a = Fp8Linear.random(groups * na, ka, "cpu", impl="triton", generator=g, act_fp8=True)
    wo_b = Fp8Linear.random(192, groups * na, "cpu", impl="triton", generator=g, act_fp8=True)
    x = torch.randn(1, groups, ka, generator=g).bfloat16()
    return wo_a, wo_b, x


@pytest.mark.parametrize("programs", [1, 3, 64])
def test_the_pair_in_two_phases_matches_the_production_products_bit_for_bit(programs):
    wo_a, wo_b, x = _pair()
    want = wo_b(wo_a.grouped(x).flatten(1))
    pair = Pair(wo_a, wo_b, 2)
    assert pair.split_a > 1 and pair.split_b > 1  # the split-K arrivals are exercised
    assert torch.equal(pair.phases(x, programs), want)
    # the arrival counters are left zeroed for the next call, which gives the same bits
    assert not pair.cnt_a.any() and not pair.cnt_b.any()
    assert torch.equal(pair.phases(x, programs).clone(), want)


def test_the_persistent_form_with_one_program_passes_its_wait_and_clears_it():
    wo_a, wo_b, x = _pair()
    want = wo_b(wo_a.grouped(x).flatten(1))
    pair = Pair(wo_a, wo_b, 2)
    assert torch.equal(pair.persistent(x, 1), want)
    assert pair.sync.tolist() == [0, 0, 0]  # arrivals and exits cleared, no wait gave up


def test_a_pair_whose_shapes_do_not_chain_is_refused():
    wo_a, _, _ = _pair()
    wo_b = Fp8Linear.random(192, 384, "cpu", impl="triton", act_fp8=True)
    with pytest.raises(ValueError, match="wo_b takes 384 inputs, wo_a gives 2 × 512"):
        Pair(wo_a, wo_b, 2)


class _Compiled:
    def __init__(self, n_regs, shared):
        self.n_regs = n_regs
        self.metadata = type("M", (), {"shared": shared})()


def test_resident_programs_take_the_tighter_of_registers_and_shared_memory():
    # 128 registers: 4096 a warp, 16384 a 4-warp program → 4 an SM by registers
    assert resident_programs(_Compiled(128, 16 * 1024), 132) == 132 * 4
    # 100 KB of shared memory: 2 an SM, fewer than registers allow
    assert resident_programs(_Compiled(64, 100 * 1024), 132) == 132 * 2
    # registers round up per warp to 256: 81 registers take 88 (2816 a warp) → 5 programs, not 6
    assert resident_programs(_Compiled(81, 0), 10) == 10 * 5
